"""The error a control call answers with.

It lives apart from `control.py` because the parts the control socket is
given (registration, the firewall, changes) raise it too, and `control.py`
imports those parts: one module at the bottom keeps the arrows one way.
"""


class ControlError(Exception):
    """A control call refused; its message goes back to the caller as the answer's error."""
