"""Rules that parse but do not do what they look like: `corral check` warns about them.

Pure: a compiled Policy in, one sentence per finding out. Nothing here changes a decision;
what must never be written is refused by the parser instead (sessionconfig.py: a resolver port
of the host without `force_ports`).
"""

from __future__ import annotations

from .decide import Policy
from .rules import HTTP_DEFAULT_PORTS, overlap

INSPECTED_KINDS = ("inspect", "request", "git")


def lint(policy: Policy) -> list[str]:
    """What `corral check` warns about, in rule order."""
    return _tcp_to_inspected(policy)


def _tcp_to_inspected(policy: Policy) -> list[str]:
    """A tcp rule whose names an inspected host shares, on a port the firewall forwards: the
    connection goes straight to the host's address through nftables, where no request rule,
    git confinement, held credential or leak scan applies. (TCP 80 and 443 are redirected
    to the proxy, which inspects them: a tcp rule there changes nothing.)"""
    inspected = {}
    for rule in policy.rules:
        if rule.kind in INSPECTED_KINDS:
            inspected.setdefault(rule.host, rule)
    found = []
    for rule in policy.rules:
        if rule.kind != "tcp" or (rule.port.ports is not None
                                  and rule.port.ports <= HTTP_DEFAULT_PORTS):
            continue
        for host, marker in inspected.items():
            if overlap(rule, marker):
                found.append(
                    f"tcp rule {rule.text} ({rule.source or rule.layer}) reaches {host}, which "
                    f"is inspected ({marker.kind} rule from {marker.source or marker.layer}), "
                    "straight through the firewall: connections there are not inspected (no "
                    "request rules, no git confinement, no credentials, no leak scan). "
                    "HTTP(S) belongs in [http]; git over SSH goes through the git gateway "
                    "([[git]] with a key the appliance holds)")
    return found
