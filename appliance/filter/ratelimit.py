"""Rate limits, sans-IO: the token bucket every per-session rate in the filter is made of
(DNS queries and denied names, events, leaf certificates, log lines), and what the filter
logs about a failure it did not expect, within a budget per session.

A connection that fails in a way the filter does not expect is logged with its traceback
(about 36 lines): that is a bug, and someone must see it. But what a session does with its
connections is the agent's to choose, and at the firewall's 500 new connections a second a
bug that every connection can reach would be ~18,000 lines a second: past journald's rate
limit, which then drops the filter's lines for everyone, the other sessions' and the
filter's own. So each session (None: clients outside every session) has a token bucket of
log lines: BURST at once, then RATE a second; what is over it is counted, and the next line
logged for that session says how many went unlogged. (A client that merely went away is no
failure: it is never logged at all, see tlsstream.py and proxy `_serve`.)

Times are the caller's monotonic seconds; nothing here reads a clock.
"""

from __future__ import annotations

import logging
from collections import Counter

RATE = 0.1
"""Failures logged a second per session, once its burst is spent."""
BURST = 5
"""Failures a session may have logged at once."""
SESSIONS_MAX = 4096
"""Buckets kept (sessions, and None); past it they start again."""


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; each query, event or mint takes one."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: int, now: float):
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float) -> bool:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class LogBudget:
    """Per session: may this failure be logged, and how many went unlogged before it."""

    def __init__(self, rate: float = RATE, burst: int = BURST):
        self.rate, self.burst = rate, burst
        self.buckets: dict[str | None, TokenBucket] = {}
        self.dropped: Counter[str | None] = Counter()
        """Per session, failures not logged since its last line."""
        self.dropped_total = 0
        """Failures not logged, all sessions, since the filter started (for `status`)."""

    def take(self, session: str | None, now: float) -> int | None:
        """None: do not log this one (it is counted); else log it, saying how many of the
        session's failures were not logged before it."""
        bucket = self.buckets.get(session)
        if bucket is None:
            if len(self.buckets) >= SESSIONS_MAX:
                self.buckets.clear()
            bucket = self.buckets[session] = TokenBucket(self.rate, self.burst, now)
        if not bucket.take(now):
            self.dropped[session] += 1
            self.dropped_total += 1
            return None
        return self.dropped.pop(session, 0)

    def forget(self, alive: set[str]) -> None:
        """Sessions that have gone leave nothing behind."""
        for session in [s for s in self.buckets if s is not None and s not in alive]:
            del self.buckets[session]
            self.dropped.pop(session, None)

    def log(self, logger: logging.Logger, session: str | None, now: float, message: str,
            *args) -> None:
        """`logger.exception(message, *args)` (call it in an `except` block) if the session's
        budget allows, with the session and what was dropped before it added."""
        dropped = self.take(session, now)
        if dropped is None:
            return
        more = f"; {dropped} more of its failures not logged" if dropped else ""
        logger.exception(f"{message} (session %s{more})", *args, session or "-")
