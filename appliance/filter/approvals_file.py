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
  worst a full disk can do is restore nothing), and its error is logged once. When even the
  removal fails, a decision waiting on it is answered with that error (`save(strict=True)`):
  the file may list it again after a restart. After `close`, writes happen on the caller's
  thread (a control connection still open at stop may decide).
- Reading back (`restore`) takes only approvals of sessions that still exist with the subnet
  they had; a session removed has its approvals written off before the removal is answered
  (the service awaits `save`), so one made later under the same name does not find them. A
  file that cannot be read (not a regular file, too large, damaged) costs the approvals,
  never the filter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from appliance.atomic import fsync_dir, write_atomic

from .approvals import MAX_DUMP, SAVE_EVERY, TOUCH_EVERY, Approvals, Pending

log = logging.getLogger(__name__)


class Unwritten(OSError):
    """The approvals could not be written down, nor the old file removed: it may list
    approvals that have closed since (a restart would bring them back)."""


class ApprovalsFile:
    def __init__(self, path: Path, book: Approvals, identity: Callable[[str], str]):
        self.path, self.book, self.identity = Path(path), book, identity
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="corral-approvals")
        self._saved = (book.changes, book.touched)
        self._written = time.monotonic()
        self._error: str | None = None
        self._closed = False
        self._bug_said = False
        self._lock: asyncio.Lock | None = None
        self._closing: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        book.on_close = self._closed_one

    def restore(self, sessions: dict[str, str]) -> list[Pending]:
        """What the file holds for `sessions` (name -> identity), taken into the book. The
        file is written anew at the first save, without what was left out."""
        try:
            data = _read_regular(self.path, MAX_DUMP + 1)
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.error("approvals: %s cannot be read, none restored: %s", self.path, exc)
            self._saved = (-1, -1)  # written anew (a regular file) at the first save
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
        if self.book.changes != self._saved[0]:  # closed or read back before: write now
            self._closing.set()
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
            except Exception:  # a bug (save logs the disk's errors): said once, tried again
                if not self._bug_said:
                    log.exception("approvals: saving failed")
                self._bug_said = True

    def _closed_one(self) -> None:
        if self._closing is not None:
            self._closing.set()

    async def save(self, strict: bool = False) -> None:
        """Write the book down if it changed (opened or closed approvals), or if only asks
        were counted and TOUCH_EVERY has passed. A failure is logged (once while it lasts);
        with `strict` (a decision waits on it), Unwritten is raised when the file may still
        list what has closed."""
        if self._lock is None:
            return  # not serving yet: start() writes what changed
        async with self._lock:
            now = (self.book.changes, self.book.touched)
            if now == self._saved or (now[0] == self._saved[0] and
                                      time.monotonic() - self._written < TOUCH_EVERY):
                return
            snapshot = self.book.snapshot(self.identity)  # on the loop: one consistent view
            try:
                if self._closed:  # stopping: no writer thread any more
                    self._write(snapshot)
                else:
                    await asyncio.get_running_loop().run_in_executor(self._writer,
                                                                     self._write, snapshot)
            except Exception as exc:
                if str(exc) != self._error:
                    log.error("approvals: cannot write %s: %s", self.path, exc)
                self._error = str(exc)
                if strict and isinstance(exc, Unwritten):
                    raise
                return
            self._saved, self._written, self._error = now, time.monotonic(), None

    def _write(self, snapshot: dict) -> None:
        """Replace the file; if that fails, remove it (an old file would bring back what has
        closed): Unwritten when even that fails."""
        try:
            write_atomic(self.path, Approvals.encode(snapshot), 0o600)
        except BaseException as exc:
            try:
                self.path.unlink(missing_ok=True)
                fsync_dir(self.path.parent)
            except OSError as also:
                raise Unwritten(f"{exc!r}, and the old file could not be removed either "
                                f"({also}): a restart may list approvals closed since") from exc
            if not isinstance(exc, Exception):
                raise
            raise OSError(f"{exc!r}; the file was removed instead (none would be "
                          "restored)") from exc

    async def close(self) -> None:
        """The last save, counted asks included. A decision still arriving on a control
        connection open since before the stop is written on the loop (`_closed`)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            with contextlib.suppress(Exception):
                self._written = float("-inf")
                await self.save()
        self._writer.shutdown(wait=True)  # after the last write queued on it has landed
        self._closed = True


def _read_regular(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of a regular file, never following a link or waiting on a
    FIFO (OSError otherwise)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
