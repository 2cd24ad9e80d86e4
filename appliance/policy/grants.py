"""What a person may grant: a denial the default alone made, for a name, and the rule a
grant adds. Pure; the filter's approvals (ask mode) and the CLI's `corral learn` share it."""

from __future__ import annotations

from .decision import Decision
from .names import HostNameError, parse_address, split_host_port


def approvable(decision: Decision) -> bool:
    """Denied by the default alone: no deny rule, no placeholder, no host port, and a
    command that would allow it (`corral allow-http|dns|tcp TARGET`) for a *name*. Never
    an IP literal: a rule naming a literal opens it even in a blocked range (the metadata
    service, the LAN, the VM host), which only `corral allow-*` typed by a person may do;
    never a name of the appliance's own (`*.corral`)."""
    if decision.allowed or decision.rule is not None or not decision.hint.startswith(
            ("corral allow-http ", "corral allow-dns ", "corral allow-tcp ")):
        return False
    try:
        name, _ = split_host_port(grant_of(decision)[1])
    except HostNameError:
        return False
    if parse_address(name) is not None:
        return False
    name = name.rstrip(".").lower()
    return name != "corral" and not name.endswith(".corral")


def grant_of(decision: Decision) -> tuple[str, str]:
    """(rule kind, rule text) the decision's hint would add: what a grant adds."""
    _, command, target = decision.hint.split(" ", 2)
    return command.removeprefix("allow-"), target
