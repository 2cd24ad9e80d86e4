"""What an event is: one type, `Event`, and `SCHEMA`, the only names an event may carry.

Every decision and every change the filter makes is an `Event` handed to `EventBus.emit`
(events.py), which makes every string in it printable (`printable_fields`) and publishes
it: the one object live subscribers, the recent ring, the control socket's
`events`/`subscribe`, the admin API and the audit log (sorted keys, chained:
audit/files.py) get. An Event is a dict of exactly the fields its emitter gave, in that
order (so it is JSON as it is); a field not given is not there (None is, as null).

The readers (`corral monitor`, `monitor --ask`, the dashboard, the log export) take the
dict back with `decode`, which keeps the names SCHEMA knows and drops any other (an
appliance newer than the CLI). Both sides are held to the same names. At run time `emit`
refuses anything but an Event, and `EventBus.decision` a name its callers add that SCHEMA
lacks, with a TypeError that names the fix (`check`). Once, in the unit tests
(tests/unit/filter/test_event.py), not per event: every `Event(...)` written in appliance/
uses SCHEMA's names (and says kind, verdict and reason, the kind one of KINDS), every
field the CLI and the dashboard read is SCHEMA's, and docs/filter.md's table is SCHEMA.
This module is the standard library only, so the CLI imports it without the filter's
runtime.

Why a dict with a schema and not a dataclass: the proxy emits an event per request, and an
event sets about a dozen of the forty-odd fields. A slotted dataclass costs each event all
of them, set or not (built, then looked at to encode it): measured, it nearly doubled the
bus's cost per event (3.1 -> 5.8 µs). A dict costs what its own fields cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple


class Field(NamedTuple):
    name: str
    type: str
    kinds: str
    """Which kinds of event carry it ("all": every one)."""
    meaning: str


KINDS = ("dns", "http", "connect", "tls", "git", "leak", "secret", "firewall", "rule",
         "approval", "session", "certs", "audit")
"""What `kind` says an event is about: dns, http, connect, tls, git (the queries, requests,
tunnels and calls judged); leak (a request carrying a secret out); secret (a placeholder
going astray, or the secrets changed); firewall (a reject, a learned allowance taken
back); rule (a session's runtime rule added, revoked or expired); approval (ask mode);
session (one not served, or stopped); certs (the interception CA rotated); audit (records
the log did not keep)."""

_FLOWS = "dns, http, connect, tls, git, leak"
SCHEMA: tuple[Field, ...] = (
    # who, what, the verdict
    Field("id", "int", "all", "unique since the filter started; a flow's decision, its cut "
          "and its closing event share it (given by the bus when left out)"),
    Field("session", "str | None", "all", "the session it concerns; None: outside every "
          "session, or the appliance's own"),
    Field("client", "str | None", "all", "who asked: a proxy or git client's address:port, "
          "a DNS client's address, a reject's sandbox; None for an operator's change"),
    Field("kind", "str", "all", "what it is about, one of KINDS (required)"),
    Field("name", "str | None", "all", "the host name asked for (DNS, Host, CONNECT, SNI, a "
          "git host)"),
    Field("port", "int | None", "all", "the port asked for"),
    Field("address", "str | None", "all", "the address connected to, or a reject's "
          "destination"),
    Field("verdict", "str", "all", "allow, deny, error (something failed); change (a rule, "
          "approval, secret, CA or session changed); pending (an approval waiting) "
          "(required)"),
    Field("reason", "str", "all", "why, in words; a cut's starts `cut:` (required)"),
    Field("rule", "str | None", "all", "the text of the rule that decided; None: the "
          "default did"),
    Field("layer", "str | None", "all", "where that rule comes from: default, appliance, "
          "project, runtime"),
    # what a request was (inspected hosts)
    Field("method", "str", "http, leak, git", "the request's method"),
    Field("path", "str", "http, leak, git", "the request's path without its query, at most "
          "200 characters"),
    Field("secrets", "list[str]", "http, leak", "the names of the secrets attached"),
    Field("detector", "str", "leak", "what found a secret going out"),
    # DNS
    Field("qtype", "str", "dns", "the query's type: A, AAAA, ..."),
    Field("answers", "list[str]", "dns", "the addresses answered"),
    Field("removed", "list[str]", "dns", "answers taken out, each with why"),
    Field("learned", "str | list", "dns", "what the firewall was taught for tcp rules, or "
          "why not"),
    Field("not_learned", "dict | list", "dns", "allowances the firewall refused, and why"),
    Field("limit", "str", "dns", "which limit refused queries: rate, denied, pending, tcp"),
    Field("refused", "int", "dns", "how many it refused since its last report"),
    # the firewall
    Field("protocol", "str", "firewall", "tcp, udp, icmp, ..."),
    Field("names", "list[str]", "firewall", "the names that taught an allowance taken back"),
    Field("connections", "int", "firewall", "how many open connections a cut ended"),
    Field("error", "str", "firewall", "why a cut could not end its connections"),
    # changes
    Field("action", "str", "rule, approval, session", "what changed: added, revoked, "
          "expired (rule); pending, approved, refused, settled, expired, ended (approval); "
          "stopped (session)"),
    Field("rule_kind", "str", "rule", "the kind of the rule: dns, http, tcp, cidr"),
    Field("expires", "float | None", "rule", "when a rule added for a while ends (epoch "
          "seconds); None: for good"),
    Field("approval", "str", "approval", "the approval's id"),
    Field("grant_kind", "str", "approval", "the kind of rule a grant would add"),
    Field("target", "str", "approval", "the rule a grant would add, as corral "
          "allow-<grant_kind> takes it"),
    Field("note", "str | None", "approval", "what the agent said when it asked"),
    Field("grant", "str | None", "approval", "what was granted: once, for, always, policy; "
          "None: refused"),
    Field("by", "str", "approval, rule", "who decided (an approval); who added or revoked "
          "the rule (a rule, from the API or an approval)"),
    Field("released", "int", "approval", "how many held requests the grant let go"),
    Field("secret", "str | None", "secret", "the secret whose placeholder went astray; "
          "None: none of the session's"),
    # what to do about it
    Field("hint", "str", "all", "the command that would allow it (denials), or what to "
          "change"),
    Field("learning", "str", _FLOWS, "`open` when a learning-open session let through "
          "what its policy denies"),
    # when, and a flow's end
    Field("ts", "float", "all", "when, epoch seconds to 6 decimals (given by the bus when "
          "left out)"),
    Field("closed", "bool", "http, connect, tls", "true on a flow's second event, when it "
          "ended"),
    Field("up", "int", "http, connect, tls", "bytes the client sent (closed)"),
    Field("down", "int", "http, connect, tls", "bytes the client got (closed)"),
    Field("duration", "float", "http, connect, tls", "seconds the flow lasted (closed)"),
)
FIELDS: tuple[str, ...] = tuple(f.name for f in SCHEMA)
"""Every name an event may carry."""
NAMES = frozenset(FIELDS)
REQUIRED = frozenset({"kind", "verdict", "reason"})


class Event(dict):
    """One event: `Event(kind=..., verdict=..., reason=..., session=..., ...)`, any of the
    fields in SCHEMA, in the order its keys are to have. It is its own wire form (a dict:
    JSON as it is); only what `emit` was handed as an Event is published (`check`)."""

    __slots__ = ()


def check(event: object) -> None:
    """Refuse what is no Event, or one with a name SCHEMA lacks, or without `kind`,
    `verdict` and `reason`, with a TypeError naming the fix. `emit` checks the type of
    each event (what is built as `Event(name=...)` in appliance/ is checked against SCHEMA
    by tests/unit/filter/test_event.py, not again per event: the proxy emits one per
    request); `EventBus.decision` checks the names its callers add."""
    if type(event) is Event and NAMES.issuperset(event) and event.keys() >= REQUIRED:
        return
    if type(event) is not Event:
        raise TypeError(f"an event is an Event (appliance/event.py), not "
                        f"{type(event).__name__}: build it as Event(kind=..., verdict=..., "
                        "reason=..., ...) with the fields of SCHEMA")
    unknown = [name for name in event if name not in NAMES]
    if unknown:
        raise TypeError(f"Event got {', '.join(map(repr, unknown))}: no such field; the "
                        "fields are SCHEMA's in appliance/event.py (add one there, "
                        "and to docs/filter.md, to carry something new)")
    missing = sorted(REQUIRED - event.keys())
    raise TypeError(f"Event needs {', '.join(missing)}: every event says what it is about, "
                    "its verdict and why")


def closing(opened: Mapping, ts: float, up: int, down: int, duration: float) -> Event:
    """The second event of a flow, from its decision event as emitted: the same id and what
    it was about, with when it ended and the bytes each way."""
    return Event(id=opened["id"], session=opened["session"], client=opened["client"],
                 kind=opened["kind"], name=opened["name"], port=opened["port"],
                 address=opened["address"], verdict=opened["verdict"],
                 reason=opened["reason"], rule=opened["rule"], layer=opened["layer"],
                 ts=ts, closed=True, up=up, down=down, duration=duration)


def printable(text: str) -> str:
    """`text` with every character that is not printable (str.isprintable: C0 and C1
    controls, DEL, format characters such as bidi overrides and zero-width ones, line and
    paragraph separators, surrogates) as `\\xNN`, `\\uNNNN` or `\\UNNNNNNNN`."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(ch, f"\\x{code:02x}")
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable_fields(event: dict) -> None:
    """Make every string in an event printable, in place: its values, and in its lists and
    tables every string, their keys too (a tuple becomes a list). An event's own keys are
    SCHEMA's; each value is looked at once, by its type."""
    for key, value in event.items():
        kind = type(value)
        if kind is str:
            if not value.isprintable():
                event[key] = printable(value)
        elif kind is dict or kind is list:
            _printable_values(value)
        elif kind is tuple:
            event[key] = value = list(value)
            _printable_values(value)


def _printable_values(container: dict | list) -> None:
    items = container.items() if type(container) is dict else enumerate(container)
    for key, value in items:
        kind = type(value)
        if kind is str:
            if not value.isprintable():
                container[key] = printable(value)
        elif kind is dict or kind is list:
            _printable_values(value)
        elif kind is tuple:
            container[key] = value = list(value)
            _printable_values(value)
    if type(container) is dict:
        for key in [k for k in container if type(k) is str and not k.isprintable()]:
            container[printable(key)] = container.pop(key)


def decode(wire: Mapping) -> Event:
    """An event as a reader gets it (JSON from the control socket or the API): the fields
    SCHEMA knows, any other dropped; none is required (a reader shows what came)."""
    return Event({name: value for name, value in wire.items() if name in NAMES})
