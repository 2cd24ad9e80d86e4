"""Plain HTTP's idle upstream connections, kept per (session, origin) for that session's next
request there: a package manager's hundred requests to one index over as many client
connections then cost one upstream connection, not a hundred. No I/O: what to close is
handed back to the caller (forward.py), which owns the sockets.

What may be kept is decided where the exchange ends (forward.py): a response read to its
end, an upstream that said nothing of closing, nothing buffered past the response. Kept
connections are never shared across sessions (the key holds the session) and never outlive
the policy they were dialled under: every change to the store empties the pool (`clear`),
since a connection's address was judged by the policy of its dial. A session keeps at most
`per_session` of them, the most recently used first (the warmest, and the one the origin is
least likely to have closed), each for at most `idle` seconds; the oldest give way. The
filter's descriptor budget counts them (limits.per_session).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

Connection = TypeVar("Connection")

PER_SESSION = 8
"""Idle upstream connections a session may keep (across all its origins)."""
IDLE = 15.0
"""Seconds an idle connection is kept: under the keep-alive timeouts origins commonly set
(nginx 75 s, Apache 5 s is the exception: a connection it closed is found at its EOF)."""


class Pool(Generic[Connection]):
    def __init__(self, per_session: int = PER_SESSION, idle: float = IDLE):
        self.per_session, self.idle = per_session, idle
        self._kept: dict[str, OrderedDict[int, tuple[tuple[str, int], Connection, float]]] = {}
        """Session -> its idle connections by id, oldest first: (origin, connection, since)."""
        self._ids = 0

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._kept.values())

    def put(self, session: str, origin: tuple[str, int], connection: Connection,
            now: float) -> list[Connection]:
        """Keep `connection` for the session's next request to `origin`; what to close: the
        session's oldest beyond `per_session` (none when per_session is 0: then it is)."""
        if self.per_session <= 0:
            return [connection]
        kept = self._kept.setdefault(session, OrderedDict())
        self._ids += 1
        kept[self._ids] = (origin, connection, now)
        closing = []
        while len(kept) > self.per_session:
            closing.append(kept.popitem(last=False)[1][1])
        return closing

    def take(self, session: str, origin: tuple[str, int], now: float
             ) -> tuple[Connection | None, list[Connection]]:
        """The session's most recently kept connection to `origin` within `idle`, and what
        to close: those of its connections that outlived `idle`."""
        kept = self._kept.get(session)
        if not kept:
            return None, []
        closing = self._expired(kept, now)
        found = None
        for key in reversed(kept):
            if kept[key][0] == origin:
                found = kept.pop(key)[1]
                break
        if not kept:
            del self._kept[session]
        return found, closing

    def expire(self, now: float) -> list[Connection]:
        """Every connection kept beyond `idle`, taken out: to close."""
        closing = []
        for session in list(self._kept):
            closing += self._expired(self._kept[session], now)
            if not self._kept[session]:
                del self._kept[session]
        return closing

    def next_expiry(self) -> float | None:
        """When the oldest kept connection outlives `idle` (None: none kept)."""
        oldest = [next(iter(kept.values()))[2] for kept in self._kept.values() if kept]
        return min(oldest) + self.idle if oldest else None

    def clear(self) -> list[Connection]:
        """Everything taken out (the policy changed, or the filter stops): to close."""
        closing = [c for kept in self._kept.values() for _, c, _ in kept.values()]
        self._kept.clear()
        return closing

    def _expired(self, kept: OrderedDict, now: float) -> list[Connection]:
        closing = []
        while kept:
            key = next(iter(kept))
            if now - kept[key][2] <= self.idle:
                break
            closing.append(kept.pop(key)[1])
        return closing
