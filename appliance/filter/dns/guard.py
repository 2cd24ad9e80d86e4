"""Per-session limits of the DNS filter, sans-IO: what one session may cost, and what a name
allowed by a wildcard may carry.

- `SessionLimits`: token buckets per session for the query rate and for names the policy
  denies, counts of queries waiting
  for an upstream and of DNS-over-TCP connections, and the once-a-second reports of what was
  refused (a flood gets one event a second, with the count, not one event per packet).
- `ExfilGuard`: a wildcard rule (`*.example.com`) lets a client choose the rest of the
  name, and every name it chooses is sent upstream, where whoever serves the zone reads it:
  a channel out. An exact name is no channel. For names a wildcard allowed, the guard
  limits how many characters the client chose, how random a long label looks, and how
  many distinct names a session asks under one zone a minute.

Times are the caller's monotonic seconds; nothing here reads a clock or a socket.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass

from ..ratelimit import TokenBucket

REPORT_INTERVAL = 1.0
"""Seconds between two events about the same limit and session."""
WINDOW = 60.0
"""The exfiltration guard's window for distinct names, in seconds."""


@dataclass(frozen=True, slots=True)
class Report:
    """What to tell about refusals under one limit: `count` refused since the last report."""

    limit: str
    count: int


class SessionLimits:
    """What each session may have at once, and the reports of what it was refused.

    Sessions are names (None: clients outside every session, judged together)."""

    LIMITS = ("rate", "denied", "pending", "tcp")

    def __init__(self, rate: float, burst: int, max_pending: int, max_tcp: int,
                 denied_rate: float = 20.0, denied_burst: int = 200):
        self.rate, self.burst = rate, burst
        self.denied_rate, self.denied_burst = denied_rate, denied_burst
        self.max_pending, self.max_tcp = max_pending, max_tcp
        self.buckets: dict[str | None, TokenBucket] = {}
        self.denied_buckets: dict[str | None, TokenBucket] = {}
        self.pending: Counter = Counter()
        """Queries per session between `begin` and `end` (waiting for an upstream)."""
        self.tcp: Counter = Counter()
        """Open DNS-over-TCP connections per session."""
        self.refused: Counter = Counter()
        """(session, limit) -> queries or connections refused, ever."""
        self._unreported: Counter = Counter()
        self._reported: dict[tuple, float] = {}

    def admit(self, session: str | None, now: float) -> bool:
        """May this session's next query be served (the rate limit)?"""
        bucket = self.buckets.get(session)
        if bucket is None:
            bucket = self.buckets[session] = TokenBucket(self.rate, self.burst, now)
        return bucket.take(now)

    def admit_denied(self, session: str | None, now: float) -> bool:
        """May this session have one more denied name answered (its denied-names limit)?"""
        bucket = self.denied_buckets.get(session)
        if bucket is None:
            bucket = self.denied_buckets[session] = TokenBucket(self.denied_rate,
                                                                self.denied_burst, now)
        return bucket.take(now)

    def begin(self, session: str | None) -> bool:
        """A query starts waiting for an upstream, unless the session has too many already."""
        if self.pending[session] >= self.max_pending:
            return False
        self.pending[session] += 1
        return True

    def end(self, session: str | None) -> None:
        self.pending[session] -= 1
        if self.pending[session] <= 0:
            del self.pending[session]

    def open_tcp(self, session: str | None) -> bool:
        """A DNS-over-TCP connection opens, unless the session holds too many already."""
        if self.tcp[session] >= self.max_tcp:
            return False
        self.tcp[session] += 1
        return True

    def close_tcp(self, session: str | None) -> None:
        self.tcp[session] -= 1
        if self.tcp[session] <= 0:
            del self.tcp[session]

    def refuse(self, session: str | None, limit: str, now: float) -> Report | None:
        """Count a refusal; a Report when one is due (at most one a second per session and
        limit, carrying every refusal since the last one), else None."""
        key = (session, limit)
        self.refused[key] += 1
        self._unreported[key] += 1
        if now - self._reported.get(key, -math.inf) < REPORT_INTERVAL:
            return None
        self._reported[key] = now
        return Report(limit, self._unreported.pop(key))

    def describe(self, limit: str) -> str:
        """The limit in words, for an event's reason."""
        return {
            "rate": f"DNS rate limit: more than {self.rate:g} queries a second "
                    f"(burst {self.burst}) from this session",
            "denied": f"DNS rate limit on denied names: more than {self.denied_rate:g} names "
                      f"the policy denies a second (burst {self.denied_burst}) from this "
                      "session",
            "pending": f"DNS limit: more than {self.max_pending} queries of this session "
                       "waiting for an upstream",
            "tcp": f"DNS limit: more than {self.max_tcp} DNS-over-TCP connections from "
                   "this session",
        }[limit]

    def forget(self, alive: set) -> None:
        """Drop the buckets and reports of sessions that have gone (counts of what is in
        flight stay until it ends)."""
        for buckets in (self.buckets, self.denied_buckets):
            for session in [s for s in buckets if s not in alive]:
                del buckets[session]
        for key in [k for k in self._reported if k[0] not in alive]:
            self._reported.pop(key, None)
            self._unreported.pop(key, None)


def entropy(text: str) -> float:
    """Shannon entropy of `text`'s characters, in bits per character."""
    size = len(text)
    return -sum(n / size * math.log2(n / size) for n in Counter(text).values())


class ExfilGuard:
    """DNS exfiltration limits for names a wildcard rule allowed (pure but for its window).

    `check(session, name, zone, now)` says which limit a name breaks, or None; a name that
    passes is remembered in its session's and zone's window. Memory is bounded: at most
    `names` entries per session and zone, and zones are the policy's wildcard suffixes."""

    def __init__(self, length: int, entropy_max: float, entropy_length: int, names: int):
        self.length, self.names = length, names
        self.entropy_max, self.entropy_length = entropy_max, entropy_length
        self.windows: dict[tuple[str | None, str], OrderedDict[str, float]] = {}
        self.denied: Counter = Counter()
        """session -> names refused as exfiltration, ever."""

    def check(self, session: str | None, name: str, zone: str, now: float,
              qtype: int | None = None) -> str | None:
        """`qtype` None or A/AAAA (what the proxy and any client ask) counts the name once;
        any other type counts (name, type) apart: the choice of type is a channel too."""
        reason = self._shape(name, zone)
        if reason is None:
            key = name if qtype in (None, 1, 28) else f"{name} type {qtype}"
            reason = self._rate(session, key, zone, now)
        if reason is not None:
            self.denied[session] += 1
        return reason

    def _shape(self, name: str, zone: str) -> str | None:
        chosen = name[: -len(zone) - 1]
        if len(chosen) > self.length:
            return (f"{len(chosen)} characters chosen under *.{zone} "
                    f"(at most {self.length})")
        for label in chosen.split("."):
            if len(label) >= self.entropy_length:
                bits = entropy(label)
                if bits > self.entropy_max:
                    return (f"a {len(label)}-character label with {bits:.2f} bits of entropy "
                            f"per character (at most {self.entropy_max:g} for labels of "
                            f"{self.entropy_length} or more)")
        return None

    def _rate(self, session: str | None, name: str, zone: str, now: float) -> str | None:
        window = self.windows.get((session, zone))
        if window is None:
            window = self.windows[(session, zone)] = OrderedDict()
        while window and next(iter(window.values())) <= now - WINDOW:
            window.popitem(last=False)
        if name in window:
            window.move_to_end(name)
        elif len(window) >= self.names:
            return (f"more than {self.names} distinct names under *.{zone} in a minute "
                    "from this session")
        window[name] = now
        return None

    def forget(self, alive: set) -> None:
        for key in [k for k in self.windows if k[0] not in alive]:
            del self.windows[key]
