"""Changes to the policy store, one at a time, never on the event loop.

A change (a rule, a session, a reload, grants whose time came) is worked out by a `plan`,
written and followed by the firewall on a blocking thread, then swapped in on the loop:
all or nothing, and never two starting from the same state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from appliance.firewall import ruleset
from appliance.firewall.nft import NftError
from appliance.policy import ConfigError
from appliance.policystore import Change, PolicyStore

from .blocking import Blocking
from .errors import ControlError
from .firewalled import Firewall

log = logging.getLogger("corral.filter")


class Before(NamedTuple):
    """The store's state before a change, as the workers are told it (replica.state_for)."""

    registered: tuple
    sessions: dict
    base: tuple


class Changes:
    def __init__(self, store: PolicyStore, blocking: Blocking, firewall: Firewall,
                 manage: bool):
        """`manage`: the firewall follows each change its ruleset depends on
        (`[firewall] manage`)."""
        self.store, self.blocking, self.firewall, self.manage = store, blocking, firewall, manage
        self.follow: Callable[[object, Change], Awaitable[None]] | None = None
        """Told each committed change with the state before it, and awaited before the
        change returns: the worker processes (workers/coordinator.py `follow`)."""
        self._changing: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task] = set()

    async def change(self, plan: Callable[[], Change],
                     first: Callable[[], None] | None = None) -> Change:
        """One change to the policy store: `plan()` works it out, it is written and (with
        `[firewall] manage`, when the ruleset depends on it) the firewall follows, all on a
        blocking thread; then it is swapped in on the loop. One change at a time, so that two
        never start from the same state (the second would lose the first's rule). All or
        nothing: a file that cannot be written or a ruleset nftables refuses leaves the
        disk and the store as they were, and raises. `first` runs on the loop once the
        change's turn has come, before `plan`: it may refuse (raise) what waited meanwhile."""
        if self._changing is None:
            self._changing = asyncio.Lock()
        async with self._changing:
            if first is not None:
                first()
            change = await self.blocking.run(self._prepare, plan)
            before = Before(self.store.registered, self.store.sessions, self.store.base)
            self.store.commit(change)
            if self.follow is not None and change.changed:
                await self.follow(before, change)
            return change

    async def in_memory(self, plan: Callable[[], Change]) -> Change:
        """A change made in memory alone, nothing written and the firewall not told: what
        taking back a grant does when the disk or nftables refuse (expiry.py, fail closed).
        Still one at a time and still followed by the workers: one not told would go on
        granting it, and later changes reach a worker as differences from this one."""
        if self._changing is None:
            self._changing = asyncio.Lock()
        async with self._changing:
            change = plan()
            before = Before(self.store.registered, self.store.sessions, self.store.base)
            self.store.commit(change)
            if self.follow is not None and change.changed:
                await self.follow(before, change)
            return change

    def _prepare(self, plan: Callable[[], Change]) -> Change:
        change = plan()
        if change.changed:
            change.write()
            if self.manage and self._ruleset_changes(change):
                try:
                    self.firewall.apply(change)
                except BaseException:
                    change.undo()
                    raise
        return change

    def _ruleset_changes(self, change: Change) -> bool:
        """The ruleset holds the sessions and the tcp rules that name an address."""
        return ruleset.differs(self.store, change)

    def reload(self) -> None:
        """SIGHUP: re-read the policy files, as a change like any other (off the loop, after
        the changes before it)."""
        task = asyncio.get_running_loop().create_task(self._reload(), name="corral-reload")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reload(self) -> None:
        try:
            await self.change(self.store.plan_reload)
        except (ConfigError, NftError, ControlError, OSError) as exc:
            log.error("reload refused, policy unchanged: %s", exc)
            return
        except Exception:
            log.exception("reload refused, policy unchanged: internal error")
            return
        log.info("policy reloaded: %d sessions", len(self.store.sessions))
