"""The audit log's writer: group commit on a thread, rotation, retention, recovery.

An event is encoded and chained where it is emitted (a few µs, on the event loop); a writer
thread wakes at most once per `COMMIT_WINDOW`, writes every line queued since, and fsyncs
once (group commit). So the event loop never waits on the disk, an event is durable within
the window and one fsync, and the writer needs the interpreter's lock only for moments:
encoding batches on that thread made the loop wait for it, at high rates for a millisecond
(bench/: DNS p99 1 ms; a third of the proxy's CPU per request with a wake-up per event).

Rotation is rename, fsync the directory, create (and fsync the directory): a crash between
any two steps leaves every record in exactly one file, and start-up (`_recover`) continues
the chain from the newest segment that holds a record.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from appliance.sessionconfig import SEGMENT_BYTES, SEGMENTS_KEPT

from .files import (
    GENESIS,
    encode,
    fsync_dir,
    last_line,
    line_hash,
    open_active,
    segment_path,
    segments,
    seq_of,
)
from .heads import HeadSigner
from .reader import Verification, verify

log = logging.getLogger(__name__)

COMMIT_WINDOW = 0.005
"""Seconds the writer lets lines gather after the first of a batch arrives."""
_STOP = object()


class AuditLog:
    """Owns the files. `append()` is thread-safe and never blocks on I/O."""

    def __init__(self, path: Path, window: float = COMMIT_WINDOW,
                 segment_bytes: int = SEGMENT_BYTES, keep: int = SEGMENTS_KEPT,
                 signer: HeadSigner | None = None):
        self.path = Path(path)
        self.signer = signer
        """Signs the head now and then (heads.py), on this log's thread, after a write."""
        self.window = window
        self.segment_bytes = segment_bytes
        if keep < 2:
            raise ValueError(f"keep {keep} segments: at least 2 (the active and the last)")
        self.keep = keep
        self.path.parent.mkdir(parents=True, exist_ok=True)
        head, self._first = self._recover()
        self._head = head
        """(seq, hash) of the last record on disk: replaced whole, after its fsync."""
        self._tail = head
        """The last record encoded (queued or on disk). Changed only under `_append_lock`."""
        self._append_lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        """(seq, hash, line) for each encoded record, in chain order; `_STOP` to end."""
        self._file = open_active(self.path)  # owned until close()
        self._file_path = self.path
        """Where the open file is: the active name, or a segment's if a rotation stopped
        half-way (it is then finished before the next batch)."""
        self._size = self._file.tell()
        self._sizes = {s.path: s.path.stat().st_size for s in segments(self.path)}
        """Bytes per file, for `status` (kept here: status must not touch the disk)."""
        self.on_retire = None
        """Called on the writer's thread with the names of the segments retention removed
        and the first seq still kept (the service records it as an event)."""
        self.failed: str | None = None
        self._thread = threading.Thread(target=self._run, name="corral-audit", daemon=True)
        self._thread.start()

    @property
    def head(self) -> dict:
        seq, digest = self._head  # one read of one reference: no lock, never a torn pair
        return {"seq": seq, "hash": digest}

    def describe(self) -> dict:
        """What `status` shows: the head and the segments on disk (from memory, no I/O)."""
        sizes = dict(self._sizes)
        return {"path": str(self.path), "head": self.head, "segments": len(sizes),
                "bytes": sum(sizes.values()), "segment_bytes": self.segment_bytes,
                "segments_kept": self.keep, "error": self.failed,
                "signed": self.signer.describe() if self.signer is not None else None}

    def verify(self) -> Verification:
        """The files against the head: every record up to it (a batch being written after
        it is not read), without stopping the writer."""
        return verify(self.path, self.head)

    def _recover(self) -> tuple[tuple[int, str], int]:
        """The head to continue from, and the seq the active segment starts with: from the
        newest segment that holds a record. A torn last line left by a crash is cut."""
        for segment in reversed(segments(self.path)):
            with open(segment.path, "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                end, last = last_line(f, size)
                if end < size:
                    log.warning("audit: cutting %d bytes of a torn last line from %s",
                                size - end, segment.path)
                    f.truncate(end)
                    f.flush()
                    os.fsync(f.fileno())
                if last is None:
                    continue
                seq = seq_of(last, segment.path)
                if segment.first is None:  # the active segment: it starts where it starts
                    f.seek(0)
                    return (seq, line_hash(last)), seq_of(f.readline(), segment.path)
                return (seq, line_hash(last)), seq + 1
        return (0, GENESIS), 1

    def append(self, event: dict) -> None:
        with self._append_lock:  # encoding order is chain order is queue order
            seq, prev = self._tail
            line = encode(seq + 1, prev, event)
            self._tail = (seq + 1, line_hash(line))
            self._queue.put((seq + 1, self._tail[1], line + b"\n"))

    def sign_head(self, force: bool = False) -> dict | None:
        """Sign the head on disk if it is due (or `force`: if it moved since the last signed
        one); the new signed head, or None. Any thread."""
        if self.signer is None:
            return None
        seq, digest = self._head
        return self.signer.sign(seq, digest, force)

    def _next(self):
        """The next queued item; with a signer, wake when a head falls due meanwhile."""
        if self.signer is None:
            return self._queue.get()
        while True:
            try:
                wait = self.signer.wait(self._head[0], time.time())
                return self._queue.get(timeout=max(0.05, wait))
            except queue.Empty:
                self.sign_head()

    def _run(self) -> None:
        while True:
            first = self._next()
            if first is not _STOP and self.window:
                time.sleep(self.window)  # let the batch gather: one fsync for all of it
            batch = [first]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is _STOP for item in batch)
            records = [item for item in batch if item is not _STOP]
            if records:
                self._write(records)
                self.sign_head()
            if stop:
                return

    def _write(self, records: list[tuple[int, str, bytes]]) -> None:
        """Write a batch, rotating wherever the next record would take the active segment
        past `segment_bytes` (a record larger than a segment gets one of its own)."""
        while records:
            if self._file_path != self.path:  # a rotation cut short: finish it first
                self._rotate(records[0][0])
            size, fit = self._size, 0
            for _, _, line in records:
                if size and size + len(line) > self.segment_bytes:
                    break
                size, fit = size + len(line), fit + 1
            if fit == 0 and self._rotate(records[0][0]):
                continue
            fit = fit or len(records)  # no rotation possible: the open file takes them
            if not self._append(records[:fit], len(records)):
                return
            records = records[fit:]

    def _append(self, records: list[tuple[int, str, bytes]], batch: int) -> bool:
        """Write and fsync `records` (the first of `batch` still to write); on a failure,
        give up the whole rest of the batch and everything chained onto it."""
        size = self._size
        data = b"".join(line for _, _, line in records)
        try:
            self._file.write(data)
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            error = exc
            self._cut_back(size)
        else:
            self._size += len(data)
            self._sizes[self._file_path] = self._size
            self._head = (records[-1][0], records[-1][1])  # the head moves once it is on disk
            return True
        # Disk full: the records are lost, and so are those already chained onto them.
        # Start the chain again from the head on disk, so the log stays one whole chain.
        with self._append_lock:
            lost = batch
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    self._queue.put(_STOP)
                    break
                lost += 1
            self._tail = self._head
        self.failed = f"audit write failed, {lost} records lost: {error}"
        log.error("%s", self.failed)
        return False

    def _rotate(self, first: int) -> bool:
        """Rotate before the record `first`. A failure is logged (once) and the open file
        takes the records (the chain is whole either way)."""
        try:
            for _ in self._rotation(first):
                pass
        except OSError as exc:
            failed = f"audit rotation failed, {self._file_path} keeps growing: {exc}"
            if failed != self.failed:  # tried again before every batch: say it once
                log.error("%s", failed)
            self.failed = failed
            return False
        return True

    def _rotation(self, first: int) -> Iterator[str]:
        """The steps of a rotation. Each leaves a log that start-up recovers whole: until
        the rename, the active file holds everything; after it, the newest segment does
        (and `_recover` continues from it when `audit.jsonl` is missing or empty). A
        generator, so that a test can stop between steps as a crash would."""
        if self._file_path == self.path:  # else a rotation stopped after its rename
            segment = segment_path(self.path, self._first)
            os.rename(self.path, segment)  # the open file is still the same file
            self._file_path = segment
            self._sizes[segment] = self._sizes.pop(self.path, self._size)
            yield "renamed"
            fsync_dir(self.path.parent)
            yield "rename durable"
        new = open_active(self.path)  # created, and its name made durable
        old, self._file, self._file_path = self._file, new, self.path
        self._first, self._size, self._sizes[self.path] = first, 0, 0
        old.close()
        yield "created"
        self._retain()
        yield "retained"

    def _retain(self) -> None:
        """Delete the oldest segments beyond `keep` (the active one counts), and say so: a
        record of every removal goes into the log itself (through `on_retire`)."""
        rotated = [s for s in segments(self.path) if s.first is not None]
        removed = rotated[:max(0, len(rotated) + 1 - self.keep)]
        for segment in removed:
            segment.path.unlink(missing_ok=True)
            self._sizes.pop(segment.path, None)
            log.warning("audit: removed %s (more than %d segments)", segment.path.name,
                        self.keep)
        fsync_dir(self.path.parent)
        if removed and self.on_retire is not None:
            kept = rotated[len(removed)].first if len(rotated) > len(removed) else None
            self.on_retire([s.path.name for s in removed], kept)

    def _cut_back(self, size: int) -> None:
        """After a failed write, drop any part of it, so the chain goes on from the head."""
        try:
            self._file.truncate(size)
            self._file.flush()
        except OSError as exc:
            log.error("audit: could not cut a failed write back: %s", exc)

    def close(self) -> None:
        """Write everything queued, sign the head it ends at, then close."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
            self.sign_head(force=True)  # a clean stop leaves no unsigned tail
        self._file.close()
