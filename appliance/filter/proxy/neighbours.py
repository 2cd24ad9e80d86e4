"""Names that share an address with an inspected host (THREATS 29): decisions without I/O.

A front-end — a CDN edge, one nginx — that serves an inspected host (`api.test`, with request
rules) and another allowed name (`front.test`) on one address picks the site by the Host
header inside TLS. A tunnel spliced for `front.test` carries TLS the filter never reads:
`Host: api.test` inside it would reach `api.test` past every request rule. The filter cannot
inspect `front.test` instead (invariant 11: a host that is not inspected never sees a corral
certificate), so it refuses the tunnel, naming the address and the inspected host, with the
fix: inspect the name too, or stop allowing it.

To know an inspected host's addresses the filter remembers what it resolved for it:

- `Watch`: which names it remembers addresses of — every pattern some session's policy
  inspects (`[[inspect]]`, `request` and `[[git]]` rules), and the hosts a secret is bound
  to (the filter ends their TLS too). The exact names it resolves itself, so they are known
  whether or not an agent ever looked them up; a wildcard's names cannot be listed, so only
  those resolved for some reason (a DNS query, a dial) are known. A name under a wildcard
  that nobody resolved since the filter started leaves its addresses unknown: a neighbour on
  one of them is spliced.
- `AddressBook`: address -> the patterns seen there, each with the latest name seen and
  until when it is remembered (at least REMEMBER: round-robin answers change at every TTL,
  and the addresses an inspected host was given a while ago are still its front-end's).
  One entry per (address, pattern), so a CDN where thousands of names share an address
  costs a decision the patterns seen there, never the names; PER_PATTERN addresses per
  pattern, the oldest forgotten first, so names an agent makes up under a wildcard it
  inspects evict only that wildcard's addresses.
- `neighbour()`: the decision for one tunnel, a dict lookup and the few patterns there.

What addresses cannot show: a CDN whose every edge serves every site serves `api.test` on
an address its DNS never gave; only inspecting the neighbour (or not allowing it) closes
that. Times are the caller's monotonic seconds; nothing here reads a clock or a socket.
The book is written on the event loop and read on worker threads too (the firewall's
learned set judges there): each address's entry is replaced whole, never changed in place.
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from appliance.policy import Decision, Host, Policy
from appliance.policy.names import IPAddress, parse_address, unmap

REMEMBER = 3600.0
"""Seconds an address seen for an inspected name is remembered, at least (longer if its
answer's TTL is)."""
PER_PATTERN = 256
"""Addresses remembered per inspected pattern (an exact name, or a wildcard)."""


@dataclass(frozen=True, slots=True)
class Seen:
    """An inspected name seen at an address."""

    name: str
    """The latest name seen there under its pattern (the pattern's own, for an exact name)."""
    until: float
    """Monotonic time it is forgotten."""


@dataclass(frozen=True, slots=True)
class Watch:
    """The names whose addresses are remembered, compiled from every policy in force and
    the secrets' hosts."""

    exact: frozenset[str]
    """Exact names some policy inspects or a secret is bound to."""
    suffixes: frozenset[str]
    """Wildcard suffixes (`x.y` for `*.x.y`) some policy inspects or a secret is bound to."""
    bound: tuple[str, ...] = ()
    """The secrets' exact host names: inspected in every session."""

    @classmethod
    def of(cls, policies: Iterable[Policy], bound_hosts: Iterable[str]) -> Watch:
        exact: set[str] = set()
        suffixes: set[str] = set()
        bound: list[str] = []
        for policy in policies:
            keys, wild = policy.inspected()
            exact.update(k for k in keys if parse_address(k) is None)
            suffixes.update(wild)
        for host in bound_hosts:
            if host.startswith("*."):
                suffixes.add(host[2:])
            elif parse_address(host) is None:
                exact.add(host)
                bound.append(host)
        return cls(frozenset(exact), frozenset(suffixes), tuple(sorted(set(bound))))

    def patterns(self, name: str) -> Iterable[str]:
        """The patterns `name` falls under: itself if exact, `*.suffix` for each wildcard
        covering it. O(labels)."""
        if name in self.exact:
            yield name
        if self.suffixes:
            dot = name.find(".")
            while dot >= 0:
                name = name[dot + 1 :]
                if name in self.suffixes:
                    yield f"*.{name}"
                dot = name.find(".")

    def all_patterns(self) -> set[str]:
        return {*self.exact, *(f"*.{s}" for s in self.suffixes)}

    def names(self, policy: Policy) -> tuple[str, ...]:
        """The exact names whose addresses a session under `policy` must know before one of
        its tunnels is spliced: what the policy inspects by name, and the secrets' hosts."""
        keys, _ = policy.inspected()
        own = (k for k in keys if parse_address(k) is None)
        return tuple(sorted({*own, *self.bound}))


class AddressBook:
    """address -> the inspected patterns seen there (see the module's docstring)."""

    def __init__(self, per_pattern: int = PER_PATTERN):
        self.per_pattern = per_pattern
        self._patterns: dict[str, OrderedDict[IPAddress, Seen]] = {}
        """pattern -> its addresses, the least recently seen first."""
        self._at: dict[IPAddress, dict[str, Seen]] = {}
        """address -> pattern -> what was seen; each dict replaced whole (read off the loop)."""

    def __len__(self) -> int:
        return sum(len(addresses) for addresses in self._patterns.values())

    def record(self, pattern: str, name: str, addresses: Iterable[IPAddress],
               until: float) -> list[IPAddress]:
        """`name` (under `pattern`) resolved to `addresses`, remembered until `until`.
        Returns those that are new to the pattern (its neighbours there may need cutting)."""
        known = self._patterns.setdefault(pattern, OrderedDict())
        new = []
        for address in addresses:
            address = unmap(address)
            if address not in known:
                new.append(address)
            else:
                known.move_to_end(address)
            seen = Seen(name, until)
            known[address] = seen
            self._at[address] = {**self._at.get(address, {}), pattern: seen}
        while len(known) > self.per_pattern:
            self._drop(pattern, known.popitem(last=False)[0])
        return new

    def at(self, address: IPAddress, now: float) -> tuple[Seen, ...]:
        """What is remembered at `address` (v4-mapped judged as v4)."""
        here = self._at.get(unmap(address))
        if not here:
            return ()
        return tuple(seen for seen in here.values() if seen.until > now)

    def keep(self, patterns: set[str]) -> None:
        """Forget the patterns no policy (and no secret) names any more."""
        for pattern in [p for p in self._patterns if p not in patterns]:
            for address in self._patterns.pop(pattern):
                self._drop(pattern, address)

    def expire(self, now: float) -> None:
        """Forget what has been remembered long enough."""
        for pattern, known in self._patterns.items():
            for address in [a for a, seen in known.items() if seen.until <= now]:
                del known[address]
                self._drop(pattern, address)

    def _drop(self, pattern: str, address: IPAddress) -> None:
        left = {p: s for p, s in self._at.get(address, {}).items() if p != pattern}
        if left:
            self._at[address] = left
        else:
            self._at.pop(address, None)


def neighbour(policy: Policy, host: Host, address: IPAddress, seen: Iterable[Seen],
              bound: Callable[[str], bool], kind: str = "http") -> Decision | None:
    """May `host` — which `policy` does not inspect — be reached at `address`, unread (a
    spliced tunnel; with `kind` "tcp", a tcp rule's direct connection)? None if it may;
    else the refusal: `address` is an IP literal the policy inspects, or an address where a
    name the policy inspects (or a secret's host, `bound`) was `seen`."""
    address = unmap(address)
    literal = Host(address=address)
    if host.address != address and policy.inspection(literal) is not None:
        return _refusal(host, address, str(address), kind)
    for each in seen:
        if each.name == host.name:
            continue
        if policy.inspection(Host(name=each.name)) is not None or bound(each.name):
            return _refusal(host, address, each.name, kind)
    return None


def _refusal(host: Host, address: IPAddress, inspected: str, kind: str) -> Decision:
    shown = f"[{host}]" if host.address is not None and host.address.version == 6 else host
    if kind == "tcp":  # nothing reads a tcp rule's bytes: inspecting the name would not help
        carried = f"a direct connection to {host} would carry"
        hint = (f"reach {shown} through the proxy (HTTPS_PROXY), with an [[inspect]] table "
                f"for it if it needs one, or remove the tcp rule for {shown}")
    else:
        carried = f"a tunnel spliced for {host} would carry"
        hint = (f"corral inspect {shown} (or an [[inspect]] table for it in corral.toml) to "
                f"have its requests read, or remove {shown} from [http] allow")
    return Decision(
        False, f"{host} is on {address}, an address of inspected host {inspected}: a front-end "
        f"serving both picks the site by the Host header inside TLS, which {carried} to "
        f"{inspected} unread", None, hint)


def address_of(text: str | IPAddress) -> IPAddress:
    """The address a flow reached, as events keep it (text), or as it was dialled."""
    if not isinstance(text, str):  # parsed already (ip_address would parse its text again)
        return unmap(text)
    return unmap(ipaddress.ip_address(text))
