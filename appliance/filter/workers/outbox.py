"""What a worker tells the coordinator of its own accord: every event (RelayBus) and every
firewall teaching (Learner). The coordinator's side is inbox.py.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import asdict

from appliance.firewall.learned import Learned, Teaching
from appliance.policy import Decision

from ..events import EventBus
from ..revocation import Reach
from .link import Link

LEARN_TIMEOUT = 5.0
"""Seconds a worker waits for the coordinator to teach the firewall: past it, nothing is
learned (the connection the answer was for is refused, as when nftables refuses)."""


class RelayBus(EventBus):
    """The worker's bus: each event, made printable and redacted here as anywhere, goes to
    the coordinator's bus (which checks it again, records it and tells subscribers)."""

    def __init__(self, link: Link | None, first_id: int):
        super().__init__()
        self.link = link
        self._ids = itertools.count(first_id)

    def emit(self, event, escaped: bool = False):
        event = super().emit(event, escaped)
        if self.link is not None and not self.link.closed.done():
            self.link.send({"op": "event", "event": event})
        return event


class Learner:
    """The firewall's learned set, as the DNS filter uses it (`learn`, on an executor
    thread): judged here first (this worker's policy and the inspected hosts' addresses it
    has seen), then taught by the coordinator, which judges again with its own."""

    def __init__(self, link: Link, reach: Reach, loop: asyncio.AbstractEventLoop):
        self.link, self.reach, self.loop = link, reach, loop

    def learn(self, teachings: list[Teaching]) -> Learned:
        allowed, refused = [], []
        for teaching in teachings:
            decision: Decision = self.reach.may_reach(
                teaching.session, (teaching.sandbox, teaching.destination, teaching.port),
                teaching.name)
            (allowed if decision.allowed else refused).append(
                teaching if decision.allowed else decision.reason)
        if not allowed:
            return Learned([], "; ".join(refused) or None)
        call = self.link.call({"op": "learn", "teachings": [asdict(t) for t in allowed]},
                              seconds=LEARN_TIMEOUT)
        reply = asyncio.run_coroutine_threadsafe(call, self.loop).result(LEARN_TIMEOUT + 1)
        taught = [Teaching(**t) for t in reply["taught"]]
        why = [*refused, *([reply["refused"]] if reply.get("refused") else [])]
        return Learned(taught, "; ".join(why) or None)
