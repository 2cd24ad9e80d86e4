"""What a session's policy says of one DNS query: judged once, without I/O.

`judge_query(query, policy)` takes a parsed question (`wire.Query`) and the policy of the
session that asked, and returns its verdict. The filter (`filter.py`) only acts on it: it
answers at once what the policy answers alone, takes a token from the session's limit on
denied names when the verdict is `counted`, and carries the rest with the pending query to
the slow path. The resolver is asked only through `DnsFilter._ask_upstream`, which takes an
`Allowed` verdict, and only `judge_query` makes one: no path reaches an upstream without
the policy having allowed that name.

The checks, in order (each verdict says what the client is answered):

- a class other than IN, or ANY/AXFR/IXFR       -> RefusedQuestion   REFUSED, counted
- a name that is no host name                   -> NotHostName       NXDOMAIN, counted
  (a label with a dot or a non-ASCII byte, or one `parse_host` refuses: `-x.example`)
- an address written as a name (`192.0.2.1`)    -> NotHostName       NXDOMAIN, not counted
- host.corral, the VM host's gateway            -> HostGateway       from [host] ports
- a name the policy denies                      -> PolicyAnswer      NXDOMAIN, counted
- an allowed name, HTTPS or SVCB type           -> PolicyAnswer      NOERROR, no records
- an allowed name, any other type               -> Allowed           asked upstream
"""

from __future__ import annotations

from typing import NamedTuple

from dnslib import QTYPE, RCODE

from appliance.policy import HOST_NAME, Decision, Host, HostNameError, Policy, parse_host

from .wire import Query

REFUSED_TYPES = frozenset({QTYPE.ANY, QTYPE.AXFR, QTYPE.IXFR})
EMPTY_TYPES = frozenset({64, 65})
"""SVCB and HTTPS: their records carry address hints and ECH configs that bypass A/AAAA
filtering; clients fall back to A/AAAA when they get none."""
CLASS_IN = 1


class RefusedQuestion(NamedTuple):
    """A class other than IN, or a type no policy answers (ANY, AXFR, IXFR): REFUSED, and
    no event (the denied-names limit's report speaks for a flood of them)."""

    counted = True


class NotHostName(NamedTuple):
    """A name the policy cannot judge: NXDOMAIN, and an event naming it as `shown`."""

    shown: str
    """The name escaped (`Query.shown`): the agent's bytes are never recorded as sent."""
    counted: bool
    """Takes from the denied-names limit: a name that is no name at all does, so a flood of
    `-n1.flood.example` meets the same limit as denied names; an address written as a name
    has never done (unchanged here)."""

    @property
    def decision(self) -> Decision:
        return Decision(False, f"'{self.shown}' is not a valid host name")


class HostGateway(NamedTuple):
    """host.corral: the VM host's gateway, answered from the policy's [host] ports."""

    counted = False


class PolicyAnswer(NamedTuple):
    """Answered by the policy alone, at once, and cacheable: a name it denies (NXDOMAIN),
    or an allowed name of a type answered empty (HTTPS, SVCB: NOERROR without records)."""

    host: Host
    decision: Decision

    @property
    def counted(self) -> bool:
        return not self.decision.allowed

    @property
    def rcode(self) -> int:
        return RCODE.NOERROR if self.decision.allowed else RCODE.NXDOMAIN


_JUDGED = object()
"""The token `Allowed` is made with: private to this module, so that only judge_query can."""


class Allowed:
    """A name the policy allows, of a type asked upstream: the one verdict the resolver is
    asked with. Made by `judge_query` only: built anywhere else it raises TypeError."""

    __slots__ = ("decision", "host")
    counted = False

    def __init__(self, host: Host, decision: Decision, token: object = None):
        if token is not _JUDGED:
            raise TypeError("an Allowed verdict is made by judge.judge_query only: judge "
                            "the query against the session's policy to get one")
        self.host, self.decision = host, decision

    def __repr__(self) -> str:
        return f"Allowed({self.host.name!r}, {self.decision.reason!r})"


QueryVerdict = RefusedQuestion | NotHostName | HostGateway | PolicyAnswer | Allowed

REFUSED_QUESTION = RefusedQuestion()
HOST_GATEWAY = HostGateway()


def judge_query(query: Query, policy: Policy) -> QueryVerdict:
    """The verdict on `query` under `policy`: the checks in the order the module lists."""
    if query.qclass != CLASS_IN or query.qtype in REFUSED_TYPES:
        return REFUSED_QUESTION
    text = query.name
    if text is None:  # a label holding a dot or a byte that is not ASCII
        return NotHostName(query.shown, True)
    try:
        host = parse_host(text)
    except HostNameError:
        return NotHostName(query.shown, True)
    if host.name is None:  # an IP literal: no name to look up
        return NotHostName(query.shown, False)
    if host.name == HOST_NAME:
        return HOST_GATEWAY
    decision = policy.decide_dns(host)
    if decision.allowed and query.qtype not in EMPTY_TYPES:
        return Allowed(host, decision, _JUDGED)
    return PolicyAnswer(host, decision)
