"""Runtime rules granted for a while, taken back when their time comes.

Ends are wall-clock and kept on disk with the rules (policystore.py): one already past at start
is taken back at once. `GrantExpiry` wakes at the next end or on any change, and never
sleeps more than a minute (the clock may be set). Taking back is a change like any other
(changes.py); if the disk or nftables refuse it, the rules go from memory anyway: the
filter no longer grants them (fail closed), and an event says what is left to a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from appliance.event import Event
from appliance.policystore import Change, PolicyStore

from .events import EventBus, rule_changed

log = logging.getLogger("corral.filter")
LONGEST_SLEEP = 60.0
RETRY = 2.0
"""Seconds before trying again after a bug in taking back (never every later grant lost)."""


def due_in(end: float | None, now: float) -> float | None:
    """Seconds to wait before the next look, or None when a grant's end has come."""
    if end is not None and end <= now:
        return None
    return LONGEST_SLEEP if end is None else min(LONGEST_SLEEP, max(0.0, end - now))


class GrantExpiry:
    def __init__(self, store: PolicyStore, change: Callable[..., Awaitable[Change]],
                 bus: EventBus,
                 in_memory: Callable[..., Awaitable[Change]] | None = None):
        """`change`: how a change reaches the store (changes.Changes.change); `in_memory`:
        how one that cannot be written does (changes.Changes.in_memory: the workers are
        told it too); None: committed here."""
        self.store, self.change, self.bus = store, change, bus
        self.in_memory = in_memory
        self._woken = asyncio.Event()
        self._task: asyncio.Task | None = None

    def changed(self) -> None:
        """The policy changed (a store listener): the next end may be another."""
        self._woken.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="corral-grants")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not leave every later grant in force
                log.exception("grants: taking back rules whose time came failed")
                await asyncio.sleep(RETRY)

    async def step(self) -> None:
        """Take back what is due, or wait for the next end or a change."""
        self._woken.clear()
        wait = due_in(self.store.next_end(), time.time())
        if wait is None:
            await self.expire()
            return
        # asyncio.timeout, not wait_for: 3.11's wait_for swallows a cancel that comes as
        # the event is set (a change, then stop at once): the filter would not stop
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self._woken.wait()

    async def expire(self) -> None:
        """Take back every grant whose end has come, each with an event."""
        try:
            change = await self.change(lambda: self.store.plan_expire(time.time()))
        except Exception as exc:  # disk or nftables: the rule goes from memory anyway
            # fail closed: the filter no longer grants it, nor does any worker
            if self.in_memory is not None:
                change = await self.in_memory(lambda: self.store.plan_expire(time.time()))
            else:
                change = self.store.plan_expire(time.time())
                self.store.commit(change)
            log.error("grants: rules whose time came are taken back in the filter, but "
                      "not on disk or in the firewall: %s", exc)
            self.bus.emit(Event(session=None, client=None, kind="rule", name=None,
                                verdict="error", rule=None, layer=None,
                                reason="runtime rules whose time came are taken back in the "
                                "filter but could not be on disk or in the firewall (a "
                                f"restart takes them back there): {exc}"))
        for session, rule in change.result:
            log.info("grants: %s rule %s of session %s expired", rule.kind, rule.text,
                     session)
            self.bus.emit(rule_changed(session, rule, "expired"))
