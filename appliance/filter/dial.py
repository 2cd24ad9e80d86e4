"""Dialling a host the policy allowed, for the proxy and the git gateway alike: the
addresses to try, each decided before it is tried, and the first allowed one that answers.

What is decided here is decided once for both: host.corral is the VM host's address the
filter was given ([host] gateway) and nothing is looked up for it; a name is resolved by the
filter's own resolver (so the address dialled is one its cache holds); every other host's
address is checked against the blocked ranges and cidr rules before a connection is tried.
How to connect (TCP for the proxy, SSH for the gateway) is the caller's `connect`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from appliance.policy import HOST_NAME, Decision, Host, Policy

from .dns.resolver import Resolver, UpstreamError

Connection = TypeVar("Connection")
NO_GATEWAY = Decision(False, f"{HOST_NAME} is no address here: the filter has no [host] "
                      "gateway", hint="set corral_filter_host_gateway (the Vagrantfile sets "
                      "the VM host's address)")


class Undialable(Exception):
    """No connection to the host: `decision` says why, and `failed` whether something
    broke (nothing resolved or answered: the proxy says 502) rather than the policy
    refusing every address (403)."""

    def __init__(self, decision: Decision, failed: bool = False):
        super().__init__(decision.reason)
        self.decision, self.failed = decision, failed


class Unanswered(Exception):
    """What a caller's `connect` raises for an address that did not answer (its message
    says how), so that the next address is tried."""


async def candidates(host: Host, gateway, resolver: Resolver, session: str | None) -> list:
    """The addresses to try for `host`: host.corral's one, an address literal itself, or
    what the resolver answers for the name (counted against `session`'s cache share)."""
    if host.name == HOST_NAME:
        if gateway is None:
            raise Undialable(NO_GATEWAY)
        return [gateway]
    if host.address is not None:
        return [host.address]
    try:
        found = await resolver.addresses(host.name, session)
    except UpstreamError as exc:
        raise Undialable(Decision(False, f"cannot resolve {host}: {exc}"), True) from None
    if not found:
        raise Undialable(Decision(False, f"{host} has no address"), True)
    return found


def decide(policy: Policy, address, host: Host, port: int) -> Decision:
    """May the filter dial `address` for `host`? host.corral's one address is the VM host's,
    which the appliance was given; every other host's addresses are checked against the
    blocked ranges and cidr rules."""
    if host.name == HOST_NAME:
        return Decision(True, f"{HOST_NAME} is the VM host")
    return policy.decide_address(address, host, port)


async def first_answering(addresses: Sequence, check: Callable[[object], Decision],
                          connect: Callable[[object], Awaitable[Connection]],
                          host: Host) -> tuple[str, Connection]:
    """The first of `addresses` that `check` allows and `connect` reaches, as (address,
    connection). Undialable when there is none: the last failure when an allowed address
    did not answer, else the first refusal."""
    refusal, failure = None, None
    for address in addresses:
        verdict = check(address)
        if not verdict.allowed:
            refusal = refusal or verdict
            continue
        try:
            return str(address), await connect(address)
        except Unanswered as exc:
            failure = str(exc)
    if failure is not None:
        raise Undialable(Decision(False, failure), True)
    raise Undialable(refusal or Decision(False, f"{host} has no address"))
