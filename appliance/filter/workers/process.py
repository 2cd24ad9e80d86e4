"""One worker process as the coordinator sees it: its process, its link, whether it serves,
and the turn that orders what reaches it."""

from __future__ import annotations

import asyncio
import contextlib

from .link import Link, LinkError

ID_BITS = 40
"""Each process a worker starts numbers its events from its own block's start, block <<
ID_BITS (2**40 events a process; the coordinator's own are block 0), blocks handed out in
turn: ids are unique while the filter runs, and the first 8191 starts stay below 2**53,
where a JSON reader with doubles (the dashboard's JavaScript) still reads them exactly."""

STOP_TIMEOUT = 5.0
"""Seconds a worker has to end once told to stop, before it is killed."""


class WorkerProcess:
    """One worker process as the coordinator sees it."""

    def __init__(self, index: int):
        self.index = index
        self.process: asyncio.subprocess.Process | None = None
        self.link: Link | None = None
        self.ready = False
        """Started with the whole state and serving its gateways: changes go to it."""
        self.turn = asyncio.Lock()
        """Held while it starts, and while a change, the secrets, a new CA or a gateway is
        sent and acknowledged: each reaches it after its start, never lost in between.
        (Questions, verdicts and heard addresses are sent as they come.)"""
        self.restarts = 0
        self.relay: asyncio.Task | None = None
        """Its log lines onto the filter's stderr (coordinator.relay_log), until it ends."""
        self.block = 0
        """The block of event ids its current process numbers its events in (ID_BITS)."""

    def kill(self) -> None:
        self.ready = False  # (its waiting requests are forgotten by Workers._keep)
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        if self.link is not None:
            self.link.close()

    async def ask(self, message: dict) -> dict | None:
        """A question (nothing changes): its answer, or None when it cannot answer now."""
        if not self.ready or self.link is None:
            return None
        try:
            return await self.link.call(message, seconds=5.0)
        except (ConnectionError, LinkError, TimeoutError):
            return None

    async def stop(self) -> None:
        """Told to stop (its last events reach the coordinator first), waited for, killed
        if it takes longer than STOP_TIMEOUT."""
        if self.link is not None and not self.link.closed.done():
            with contextlib.suppress(ConnectionError, LinkError, TimeoutError):
                await self.link.call({"op": "stop"}, seconds=STOP_TIMEOUT)
        if self.process is not None and self.process.returncode is None:
            try:
                async with asyncio.timeout(STOP_TIMEOUT):
                    await self.process.wait()
            except TimeoutError:
                self.kill()
                await self.process.wait()
        if self.link is not None:
            self.link.close()
