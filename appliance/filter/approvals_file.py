"""approvals.json: the open approvals written down, so that they outlive a restart of the
filter (an agent told "pending", a person holding an id). The book (approvals.Approvals)
says what; this module says when, and does the disk work off the event loop.

- An approval that **closes** (a decision, its expiry, its session's end) is written down at
  once, and a person's decision is answered only once it is (`save`, awaited by the control
  socket): a crash must not bring back what a person refused.
- One that **opens** is written within SAVE_EVERY seconds: a crash loses at most those, and
  the agent's next request opens them again.
- Asks for one already open (its count, its last ask) are written every TOUCH_EVERY seconds.
- Writes go through one thread, in order; a write that fails removes the file instead (the
  worst a full disk can do is restore nothing), and its error is logged once.
- Reading back (`restore`) takes only approvals of sessions that still exist with the subnet
  they had (a session of the same name made later is another agent); a file that cannot be
  read costs the approvals, never the filter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from appliance.atomic import fsync_dir, write_atomic

from .approvals import SAVE_EVERY, TOUCH_EVERY, Approvals, Pending

log = logging.getLogger(__name__)


class ApprovalsFile:
    def __init__(self, path: Path, book: Approvals, identity: Callable[[str], str]):
        self.path, self.book, self.identity = Path(path), book, identity
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="corral-approvals")
        self._saved = (book.changes, book.touched)
        self._written = time.monotonic()
        self._error: str | None = None
        self._lock: asyncio.Lock | None = None
        self._closing: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        book.on_close = self._closed_one

    def restore(self, sessions: dict[str, str]) -> list[Pending]:
        """What the file holds for `sessions` (name -> identity), taken into the book. The
        file is written anew at the first save, without what was left out."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.error("approvals: %s cannot be read, none restored: %s", self.path, exc)
            return []
        self._saved = (-1, -1)
        try:
            restored = self.book.restore(data, sessions)
        except Exception as exc:  # whatever a damaged file does, the filter starts
            log.error("approvals: %s: %s; none restored", self.path, exc)
            return []
        if restored:
            log.info("approvals: %d open approval(s) restored", len(restored))
        return restored

    def start(self) -> None:
        self._lock, self._closing = asyncio.Lock(), asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(),
                                                            name="corral-approvals")

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SAVE_EVERY):
                    await self._closing.wait()
            self._closing.clear()
            try:
                await self.save()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end the saving
                log.exception("approvals: saving failed")

    def _closed_one(self) -> None:
        if self._closing is not None:
            self._closing.set()

    async def save(self) -> None:
        """Write the book down if it changed (opened or closed approvals), or if only asks
        were counted and TOUCH_EVERY has passed."""
        if self._lock is None:
            return  # not serving yet: nothing has changed since the restore
        async with self._lock:
            now = (self.book.changes, self.book.touched)
            if now == self._saved or (now[0] == self._saved[0] and
                                      time.monotonic() - self._written < TOUCH_EVERY):
                return
            snapshot = self.book.snapshot(self.identity)  # on the loop: one consistent view
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._writer, self._write, snapshot)
            except OSError as exc:
                if str(exc) != self._error:
                    log.error("approvals: cannot write %s (removed instead: none would be "
                              "restored): %s", self.path, exc)
                self._error = str(exc)
                return
            self._saved, self._written, self._error = now, time.monotonic(), None

    def _write(self, snapshot: dict) -> None:
        try:
            write_atomic(self.path, Approvals.encode(snapshot), 0o600)
        except OSError:
            with contextlib.suppress(OSError):  # an old file would bring back closed ones
                self.path.unlink(missing_ok=True)
                fsync_dir(self.path.parent)
            raise

    async def close(self) -> None:
        """The last save (the filter's servers are closed: nothing changes after it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            with contextlib.suppress(Exception):
                self._written = float("-inf")  # counted asks too
                await self.save()
        self._writer.shutdown(wait=True)
