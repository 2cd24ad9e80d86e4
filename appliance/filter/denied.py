"""What the filter refuses by decision, in one shape for the proxy and the git gateway: the
decision (its reason is what the client is told, its hint what to do about it), what was
asked for, and the status an HTTP client gets (403 refused; 502 when nothing answered).
"""

from __future__ import annotations

from appliance.policy import Decision


class Denied(Exception):
    """A request, tunnel or git call the filter refuses by decision; carries what to tell
    the client."""

    def __init__(self, decision: Decision, target: str = "", status: int = 403,
                 recorded: bool = False):
        super().__init__(decision.reason)
        self.decision, self.target, self.status = decision, target, status
        self.recorded = recorded
        """Whether an event already says so; the edge records the ones that are not."""
