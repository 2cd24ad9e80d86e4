"""What a person may grant: a denial the default alone made, for a name, and the rule a
grant adds. Pure; the filter's approvals (ask mode) and the CLI's `corral learn` share it.

One rule decides the text of a granted rule, wherever it is formed (`rule_texts`): the
ports that were asked, and no other. `NAME:PORT` for each port; the bare name, which an
http rule reads as ports 80 and 443, only where both were asked (or, for http, where no
port was: a name looked up in ask mode stands for what a client goes on to ask). The
policy's hint (`corral allow-http NAME:443`), so what a session is granted, what `corral
approve --always` writes into corral.toml and what `corral learn` proposes are one text:
a grant of 443 never opens plain HTTP on 80 as a side effect."""

from __future__ import annotations

from collections.abc import Iterable

from .decision import Decision
from .names import HostNameError, parse_address, split_host_port

HTTP_BARE = frozenset({80, 443})
"""The ports an http rule without a port covers (rules.HTTP_DEFAULT_PORTS)."""


def rule_texts(kind: str, name: str, ports: Iterable[int | str] = ()) -> list[str]:
    """The rules of `kind` that allow `name` on exactly `ports` (numbers), in port order.
    dns: the name (no port). tcp: `NAME:PORT` each. http: `NAME:PORT` each, but the bare
    name for 80 and 443 when both are asked, and for no port at all. An IPv6 literal is
    bracketed, as a rule's text is."""
    host = f"[{name}]" if ":" in name else name
    numbers = sorted({int(p) for p in ports})
    if kind == "dns":
        return [host]
    plain: list[str] = []
    if kind == "http" and (not numbers or set(numbers) >= HTTP_BARE):
        plain = [host]
        numbers = [p for p in numbers if p not in HTTP_BARE]
    return plain + [f"{host}:{p}" for p in numbers]


def rule_text(kind: str, name: str, port: int | None) -> str:
    """The one rule that allows `name` on `port` (None: no port, a DNS lookup): what
    `rule_texts` gives for one port, without its sorting (every first denial asks)."""
    host = f"[{name}]" if ":" in name else name
    return host if port is None or kind == "dns" else f"{host}:{int(port)}"


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
