"""The audit log: append-only JSONL, fsynced, each line chained to the one before it.

Every line carries `seq` (1, 2, ...) and `prev`, the SHA-256 of the previous line's bytes
(64 zeros for the first). Editing, removing, inserting or reordering any line breaks the
chain at the next line, which `verify()` reports by line number. What a chain alone cannot
show is a cut at the very end: `AuditLog.head` (the last seq and hash) is kept by the running
filter and reported over the control socket, so a verifier can compare against it.

Writes happen on one thread that takes every event queued since its last write, writes
them, and fsyncs once (group commit): the event loop never waits on the disk, and an event
is durable within one fsync of being emitted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

GENESIS = "0" * 64
_STOP = object()


def _hash(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def encode(seq: int, prev: str, event: dict) -> bytes:
    record = {"seq": seq, "prev": prev, **event}
    return json.dumps(record, separators=(",", ":"), sort_keys=True).encode()


class AuditLog:
    """Owns the file. `append()` is thread-safe and never blocks on I/O."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.seq, self.prev = self._recover()
        """The head: the last record on disk. Changed only under `_lock`, after its fsync."""
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._file = open(self.path, "ab")  # noqa: SIM115 - owned until close()
        os.chmod(self.path, 0o600)
        self._thread = threading.Thread(target=self._run, name="corral-audit", daemon=True)
        self._thread.start()
        self.failed: str | None = None

    @property
    def head(self) -> dict:
        with self._lock:
            return {"seq": self.seq, "hash": self.prev}

    def verify(self) -> Verdict:
        """The file against the head, with no batch half-written while it is read."""
        with self._lock:
            return verify(self.path, {"seq": self.seq, "hash": self.prev})

    def _recover(self) -> tuple[int, str]:
        """Continue the chain from the last complete line; cut a torn tail left by a crash."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return 0, GENESIS
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            log.warning("audit: cutting %d bytes of a torn last line from %s",
                        len(data) - keep, self.path)
            with open(self.path, "r+b") as f:
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())
            data = data[:keep]
        lines = data.splitlines()
        if not lines:
            return 0, GENESIS
        last = lines[-1]
        try:
            seq = int(json.loads(last)["seq"])
        except (ValueError, KeyError, TypeError):
            raise RuntimeError(f"{self.path}: last line is not an audit record; "
                               f"run `corral audit --verify` and move the file aside") from None
        return seq, _hash(last)

    def append(self, event: dict) -> None:
        self._queue.put(event)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(e is _STOP for e in batch)
            seq, prev, lines = self.seq, self.prev, []
            for event in batch:
                if event is _STOP:
                    continue
                seq += 1
                line = encode(seq, prev, event)
                prev = _hash(line)
                lines.append(line + b"\n")
            if lines:
                with self._lock:  # the head moves only once the batch is on disk
                    size = self._file.tell()
                    try:
                        self._file.write(b"".join(lines))
                        self._file.flush()
                        os.fsync(self._file.fileno())
                        self.seq, self.prev = seq, prev
                    except OSError as exc:  # disk full: say so loudly; status reports it
                        self.failed = f"audit write failed, {len(lines)} records lost: {exc}"
                        log.error("%s", self.failed)
                        self._cut_back(size)
            if stop:
                return

    def _cut_back(self, size: int) -> None:
        """After a failed write, drop any part of it, so the chain goes on from the head."""
        try:
            self._file.truncate(size)
            self._file.flush()
        except OSError as exc:
            log.error("audit: could not cut a failed write back: %s", exc)

    def close(self) -> None:
        """Write everything queued, then close."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._file.close()


@dataclass(frozen=True)
class Verdict:
    ok: bool
    lines: int
    """Lines checked."""
    error: str = ""
    line: int | None = None
    """1-based line number of the first break."""
    head: dict | None = None

    def to_json(self) -> dict:
        return {"intact": self.ok, "lines": self.lines, "error": self.error, "line": self.line,
                "head": self.head}


def page(path: Path, after: int = 0, since: float | None = None,
         limit: int = 100) -> tuple[list[dict], bool]:
    """Records with seq > `after` (and ts >= `since`), at most `limit`; and whether more follow.
    A scan from the start: the log is append-only and read rarely."""
    records: list[dict] = []
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return [], False
    with f:
        for raw in f:
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if record.get("seq", 0) <= after or (since is not None and record.get("ts", 0) < since):
                continue
            if len(records) == limit:
                return records, True
            records.append(record)
    return records, False


def verify(path: Path, expect_head: dict | None = None) -> Verdict:
    """Check the whole chain; report the first line where it breaks."""
    prev, seq, count = GENESIS, 0, 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            count = number
            if not raw.endswith(b"\n"):
                return Verdict(False, number, "last line is incomplete (torn write)", number)
            line = raw[:-1]
            try:
                record = json.loads(line)
                got_seq, got_prev = int(record["seq"]), record["prev"]
            except (ValueError, KeyError, TypeError):
                return Verdict(False, number, "not an audit record", number)
            if got_seq != seq + 1:
                return Verdict(False, number, f"seq {got_seq} follows {seq}: a line was "
                               "removed, inserted or moved", number)
            if got_prev != prev:
                return Verdict(False, number, "prev does not match the hash of the line "
                               "before: that line was edited, removed or moved", number)
            seq, prev = got_seq, _hash(line)
    head = {"seq": seq, "hash": prev}
    if expect_head is not None and head != expect_head:
        return Verdict(False, count, f"the log ends at seq {seq} but the filter wrote up to "
                       f"seq {expect_head.get('seq')}: lines were cut or the last one edited",
                       count, head)
    return Verdict(True, count, "", None, head)
