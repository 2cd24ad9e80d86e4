"""Who taught each learned element: what lets a policy change take a tcp allowance back.

The DNS filter adds (sandbox . destination . port) to the learned set when it answers a name
that a tcp rule allows; the element itself does not say which name. The ledger remembers,
for every element, the session and the names whose answers taught it, and when it expires,
so that after a policy change `doomed()` finds the elements none of whose names the session
may still reach on that port. Pure bookkeeping: no I/O, no clock, no lock of its own
(`learned.LearnedSet` holds one around it and the set).

Bounded: at most `per_session` elements per session (a session at its share learns nothing
more until some expire, and no other session's share is touched) and at most NAMES_MAX names
per element (past that its oldest name is forgotten: the element may then be taken back
while a forgotten name would still allow it: closed, never open). Recording and expiring
cost O(1) per element touched; expiry empties one-second buckets, never scans.
"""

from __future__ import annotations

import ipaddress
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from appliance.policy import Decision

Key = tuple[str, str, int]
"""(sandbox address, destination address, port): an element of the learned set."""
NAMES_MAX = 8
"""Names remembered per element (many names of one CDN share its addresses)."""
PER_SESSION = 4096
"""Elements one session may hold in the learned set at once."""
Judge = Callable[[str, Key, str], Decision]
"""judge(session, element, name): may the session's sandbox reach the element's destination
and port, as an address of `name`, under the policy in force now?"""


@dataclass(slots=True)
class Element:
    session: str
    names: dict[str, None]
    """The names whose answers taught it, oldest first (a dict as an ordered set)."""
    expires: float
    """Monotonic seconds: never before nftables drops the element itself."""


@dataclass(frozen=True, slots=True)
class Revoked:
    """An element no name allows any more: delete it, and end its connections."""

    key: Key
    session: str
    names: tuple[str, ...]
    decision: Decision
    """Why its last allowed name is no longer allowed (the first name's decision)."""


class Ledger:
    def __init__(self, per_session: int = PER_SESSION, names_max: int = NAMES_MAX):
        self.per_session, self.names_max = per_session, names_max
        self.elements: dict[Key, Element] = {}
        self.held: Counter[str] = Counter()
        """Elements per session."""
        self._buckets: dict[int, set[Key]] = {}
        """ceil(expires) -> the elements that expire in that second."""
        self._swept = -1
        """The last second whose bucket `expire` emptied."""

    def __len__(self) -> int:
        return len(self.elements)

    def holds_any(self, subnets) -> bool:
        """Whether an element's sandbox address lies in one of `subnets` (ip_network)."""
        for sandbox, _, _ in self.elements:
            address = ipaddress.ip_address(sandbox)
            if any(address in subnet for subnet in subnets):
                return True
        return False

    def holds(self, session: str, key: Key) -> bool:
        element = self.elements.get(key)
        return element is not None and element.session == session

    def room(self, session: str, key: Key, pending: int = 0) -> bool:
        """May `session` teach `key`, with `pending` new elements about to be recorded? Yes
        when it holds it already or is under its share."""
        return self.holds(session, key) or self.held[session] + pending < self.per_session

    def record(self, session: str, name: str, key: Key, expires: float) -> None:
        """`name`'s answer taught `key` to `session`'s sandbox, until `expires` (the
        element's timeout was set again: its expiry is the latest teaching's)."""
        element = self.elements.get(key)
        if element is not None and element.session != session:  # the address changed hands
            self._forget(key)
            element = None
        if element is None:
            element = self.elements[key] = Element(session, {}, expires)
            self.held[session] += 1
        else:
            self._unbucket(key, element.expires)
            element.expires = expires
        element.names.pop(name, None)
        element.names[name] = None
        while len(element.names) > self.names_max:
            del element.names[next(iter(element.names))]
        self._buckets.setdefault(self._bucket(expires), set()).add(key)

    def expire(self, now: float) -> int:
        """Forget the elements nftables has dropped by `now`; how many."""
        if not self._buckets:
            self._swept = math.floor(now)
            return 0
        last = math.floor(now)
        if last - self._swept > len(self._buckets):  # fewer buckets than seconds to walk
            seconds: Iterable[int] = sorted(s for s in self._buckets if s <= last)
        else:
            seconds = range(self._swept + 1, last + 1)
        forgotten = 0
        for second in seconds:
            for key in self._buckets.pop(second, ()):
                self._drop(key)
                forgotten += 1
        self._swept = max(self._swept, last)
        return forgotten

    def doomed(self, judge: Judge) -> list[Revoked]:
        """The elements none of whose names `judge` (the policy in force now) allows."""
        out = []
        for key, element in self.elements.items():
            first = None
            for name in element.names:
                decision = judge(element.session, key, name)
                if decision.allowed:
                    break
                first = first or decision
            else:
                out.append(Revoked(key, element.session, tuple(element.names), first))
        return out

    def forget(self, keys: Iterable[Key]) -> None:
        for key in keys:
            self._forget(key)

    def live(self, now: float, sessions: set[str]) -> list[tuple[Key, int]]:
        """(element, whole seconds left) for every element of these sessions still alive:
        what a new ruleset carries over."""
        return [(key, math.ceil(element.expires - now))
                for key, element in self.elements.items()
                if element.session in sessions and element.expires > now]

    def _forget(self, key: Key) -> None:
        element = self.elements.get(key)
        if element is not None:
            self._unbucket(key, element.expires)
            self._drop(key)

    def _drop(self, key: Key) -> None:
        element = self.elements.pop(key)
        self.held[element.session] -= 1
        if self.held[element.session] <= 0:
            del self.held[element.session]

    def _bucket(self, expires: float) -> int:
        """The second whose sweep forgets an element expiring then: never one swept already
        (such an element would never be forgotten)."""
        return max(math.ceil(expires), self._swept + 1)

    def _unbucket(self, key: Key, expires: float) -> None:
        second = self._bucket(expires)
        bucket = self._buckets.get(second)
        if bucket is not None:
            bucket.discard(key)
            if not bucket:
                del self._buckets[second]
