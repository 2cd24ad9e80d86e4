"""The event bus: every decision goes to live subscribers, the recent ring and the audit log.

An event is an `Event` (appliance/event.py: SCHEMA says every field, what it means and which
kinds carry it), a dict of the fields its emitter gave. `emit` takes nothing else, makes
every string in it printable once and publishes that one object to subscribers, the ring
and the audit log: it is JSON as it is on the control socket and in the audit log. A
tunnel or proxied request produces its decision event at once (so `monitor` is live) and a
second event with `closed: true` and the byte counts when it ends (`closing`); both share
`id`.

Subscribers are bounded queues: a subscriber that cannot keep up loses its oldest events
(counted in `dropped`), never slows the proxy down.

Text in an event may quote what a session sent (a name, a header, a path). Whatever a
producer put in, an event leaves `emit` with every character a terminal would act on or
hide (controls, bidi and zero-width characters, line separators) escaped (`printable`):
what subscribers, `corral monitor` and the audit log get, and what the log replays
whenever it is read, is safe to show. Printable text is left as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections import Counter, deque
from collections.abc import AsyncIterator

from appliance.event import NAMES, Event, check, printable, printable_fields
from appliance.policy import Decision

from .ratelimit import TokenBucket
from .redact import NONE

__all__ = ["Event", "EventBus", "Subscription", "printable", "retired", "rule_changed"]


LINES = 256
"""Events whose encoded line is kept: subscribers drain their queues soon after an emit,
so one a second subscriber writes was mostly encoded for the first."""


class Subscription:
    def __init__(self, bus: EventBus, session: str | None, verdict: str | None, size: int):
        self.bus, self.session, self.verdict = bus, session, verdict
        self.queue: deque[dict] = deque(maxlen=size)
        self.ready = asyncio.Event()
        self.dropped = 0

    def wants(self, event: dict) -> bool:
        return (self.session is None or event.get("session") == self.session) and (
            self.verdict is None or event.get("verdict") == self.verdict
        )

    def push(self, event: dict) -> None:
        if len(self.queue) == self.queue.maxlen:
            self.dropped += 1
        self.queue.append(event)
        self.ready.set()

    async def __aiter__(self) -> AsyncIterator[dict]:
        while True:
            while self.queue:
                yield self.queue.popleft()
            self.ready.clear()
            await self.ready.wait()

    def close(self) -> None:
        self.bus.subscribers.discard(self)


class EventBus:
    def __init__(self, audit=None, recent: int = 1000, audit_rate: float = 200,
                 audit_burst: int = 2000):
        self.audit = audit
        self.recent: deque[dict] = deque(maxlen=recent)
        self.subscribers: set[Subscription] = set()
        self.counters: Counter = Counter()
        """(session, verdict) -> count, for `corral ls` and status."""
        self.last_seen: dict[str, float] = {}
        """session -> when its last event was (a session's --idle counts from it)."""
        self.started = time.time()
        """Before it, nothing was seen: a session's activity counts from here at the
        least (a restarted filter has no memory of the sessions' last events)."""
        self._ids = itertools.count(1)
        self.audit_rate, self.audit_burst = audit_rate, audit_burst
        self._buckets: dict[str | None, TokenBucket] = {}
        self.held: Counter = Counter()
        """session -> events kept out of the audit log since its last summary record."""
        self.held_total: Counter = Counter()
        """session -> events kept out of the audit log, ever (status)."""
        self._summary_due = False
        self.redactor = NONE
        """The secrets' values out of every event (redact.py); set with the secrets."""
        self._lines: dict[int, tuple[Event, bytes]] = {}
        """id(event) -> (event, its line): the last LINES encoded (`line`)."""

    def next_id(self) -> int:
        return next(self._ids)

    def emit(self, event: Event, escaped: bool = False) -> Event:
        """Publish `event` (refused with a TypeError unless it is an Event of SCHEMA's
        fields) with `ts` and `id` given when it has none; returns it, as published.
        `escaped`: its strings are printable already (the DNS wire cache's hit: a copy of an
        event published before, with the client's address, which the kernel wrote)."""
        if type(event) is not Event:
            check(event)  # raises, naming the fix (an Event's names: test_event.py)
        if not escaped:
            printable_fields(event)  # what a terminal acts on, escaped; then the one door
        self.redactor.fields(event)  # for the secrets' values to subscribers, the ring, the log
        if "ts" not in event:
            event["ts"] = round(time.time(), 6)
        if "id" not in event:
            event["id"] = next(self._ids)
        session, verdict = event.get("session"), event["verdict"]
        if not event.get("closed"):
            self.counters[(session, verdict)] += 1
        if session is not None:
            self.last_seen[session] = event["ts"]
        self.recent.append(event)
        for subscription in self.subscribers:  # Subscription.wants, without a call each
            if (subscription.session is None or subscription.session == session) and (
                    subscription.verdict is None or subscription.verdict == verdict):
                subscription.push(event)
        if self.audit is not None:
            self._record(event)
        return event

    def line(self, event: Event) -> bytes:
        """The event as a line of the control socket's stream, encoded once for however
        many subscribers stream it (`monitor`, the dashboard, the API's stream each have
        one). The event is held with its line, so its id names no other while it is here."""
        held = self._lines.get(id(event))
        if held is not None and held[0] is event:
            return held[1]
        encoded = json.dumps(event, separators=(",", ":")).encode() + b"\n"
        if len(self._lines) >= LINES:
            del self._lines[next(iter(self._lines))]  # the oldest
        self._lines[id(event)] = (event, encoded)
        return encoded

    def _record(self, event: dict) -> None:
        """Into the audit log, within the session's budget: past `audit_rate` records a
        second (a burst of `audit_burst`), a session's events reach subscribers but the log
        gets one summary record a second saying how many it did not get. A session that
        floods denials cannot push every other session's history out of the log's
        retention, nor its own earlier records. A change to the rules (kind `rule`) is the
        operator's, not the session's: always recorded, never charged to its budget; so is an
        approval (kind `approval`: a session has at most a few open, and each decision is a
        person's)."""
        session = event.get("session")
        if event.get("kind") in ("rule", "approval"):
            self.audit.append(event)
            return
        now = time.monotonic()
        bucket = self._buckets.get(session)
        if bucket is None:
            bucket = self._buckets[session] = TokenBucket(self.audit_rate, self.audit_burst,
                                                          now)
        if bucket.take(now):
            if self.held.get(session):
                self._summarise()  # the log says what it missed before what comes next
            self.audit.append(event)
            return
        self.held[session] += 1
        self.held_total[session] += 1
        if not self._summary_due:
            with contextlib.suppress(RuntimeError):  # no loop (tests): at the next record
                asyncio.get_running_loop().call_later(1.0, self._summarise)
                self._summary_due = True

    def _summarise(self) -> None:
        self._summary_due = False
        for session, count in list(self.held.items()):
            del self.held[session]
            self.audit.append(Event(
                ts=round(time.time(), 6), id=self.next_id(), session=session, kind="audit",
                name=None, verdict="error", rule=None, layer=None,
                reason=f"{count} events of this session not recorded one by one: more than "
                f"{self.audit_rate:g} a second ([state] audit_events_per_session)"))

    def forget(self, alive: set) -> None:
        """Drop the budgets of sessions that are gone."""
        for session in [s for s in self._buckets if s is not None and s not in alive]:
            del self._buckets[session]
        for session in [s for s in self.last_seen if s not in alive]:
            del self.last_seen[session]

    def decision(self, decision: Decision, *, session: str | None, client: str, kind: str,
                 name: str, port: int | None = None, address: str | None = None,
                 event_id: int | None = None, verdict: str | None = None, **extra) -> Event:
        """The event of a decision (its verdict unless `verdict` says otherwise; `extra`:
        more of SCHEMA's fields), emitted; returns it as published."""
        rule = decision.rule
        if extra and not NAMES.issuperset(extra):  # the callers' own names, unseen by tests
            check(Event(extra, kind=kind, verdict=decision.verdict, reason=decision.reason))
        if decision.hint:
            # only learning-open allowances keep their hint
            extra = {**extra, "hint": decision.hint, "learning": "open"} if decision.allowed \
                else {**extra, "hint": decision.hint}
        return self.emit(Event(
            id=event_id if event_id is not None else self.next_id(),
            session=session, client=client, kind=kind, name=name, port=port, address=address,
            verdict=verdict or decision.verdict, reason=decision.reason,
            rule=rule.text if rule else None, layer=rule.layer if rule else None, **extra))

    def subscribe(self, session: str | None = None, verdict: str | None = None,
                  size: int = 10000) -> Subscription:
        subscription = Subscription(self, session, verdict, size)
        self.subscribers.add(subscription)
        return subscription

    def last(self, n: int, session: str | None = None, verdict: str | None = None) -> list[dict]:
        probe = Subscription(self, session, verdict, 1)
        return [e for e in self.recent if probe.wants(e)][-n:] if n > 0 else []


def rule_changed(session: str, rule, action: str, until: float | None = None,
                 by: str | None = None) -> Event:
    """A runtime rule added (for good, or `until` a time), revoked or expired: kind `rule`,
    verdict `change` (its audit record is never charged to the session's budget); `by`: who
    asked for it, when someone did (the API's client, an approval's decider)."""
    text = f"{rule.kind} {rule.text}"
    if until is not None:
        text += " until " + time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(until))
    return Event(session=session, client=None, kind="rule", name=rule.host or None,
                 port=None, address=None, verdict="change", action=action, rule=rule.text,
                 rule_kind=rule.kind, layer=rule.layer, expires=until,
                 reason=f"{action}: {text} (session runtime layer)",
                 **({"by": by} if by else {}))


def retired(names: list[str], kept: int | None) -> Event:
    """Audit retention removed segments: which, and where the log now starts (so a
    verifier can tell retention from a cut)."""
    return Event(session=None, client=None, kind="audit", name=None, port=None,
                 address=None, verdict="error", rule=None, layer=None,
                 reason=f"retention removed {', '.join(names)}; the log now starts at seq "
                 f"{kept}")
