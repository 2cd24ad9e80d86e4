"""Reading the audit log: `verify` walks the chain through every segment, `page` finds a
page by bisection. Neither takes a lock the writer holds: they open every segment at one
moment and read up to the head."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .files import GENESIS, Segment, line_hash, opened


@dataclass(frozen=True)
class Verification:
    ok: bool
    lines: int
    """Records checked."""
    error: str = ""
    line: int | None = None
    """1-based line number of the first break, in `segment`."""
    segment: str | None = None
    """The file the first break is in."""
    head: dict | None = None
    """The last record checked: seq and hash."""
    first: int | None = None
    """The seq of the first record kept. Above 1, older segments were removed (retention)
    and its `prev` cannot be checked."""
    segments: int = 0
    """Files read."""

    @property
    def note(self) -> str:
        if self.first is None or self.first == 1:
            return ""
        return (f"the log starts at seq {self.first} (older segments removed by retention): "
                f"the chain is checked from seq {self.first}, whose link to the records "
                "before it cannot be checked")

    def to_json(self) -> dict:
        return {"intact": self.ok, "lines": self.lines, "error": self.error,
                "segment": self.segment, "line": self.line, "head": self.head,
                "first": self.first, "segments": self.segments, "note": self.note}


def verify(path: Path, expect_head: dict | None = None) -> Verification:
    """Check the chain through every segment, oldest first; report the first break by file
    and line. With `expect_head` (the running filter's), read up to that record and require
    it: a cut tail is a break too; lines written after it are not read."""
    walk = _Walk(expect_head.get("seq") if expect_head is not None else None)
    with opened(Path(path)) as files:
        for segment, f in files:
            if walk.done:
                break
            error = walk.segment(segment, f)
            if error:
                return walk.verdict(error, len(files))
        if expect_head is not None and walk.head != expect_head:
            error = (f"the record at seq {walk.seq} is not the one the filter wrote: it was "
                     "edited" if walk.seq == expect_head.get("seq") else
                     f"the log ends at seq {walk.seq} but the filter wrote up to seq "
                     f"{expect_head.get('seq')}: lines were cut from its end")
            return walk.verdict(error, len(files), walk.last)
        return walk.verdict("", len(files))


class _Walk:
    """`verify`'s position along the chain: the last record checked and where it was."""

    def __init__(self, stop_at: int | None):
        self.stop_at = stop_at
        self.seq, self.prev, self.first, self.count = 0, GENESIS, None, 0
        self.last: tuple[str | None, int | None] = (None, None)
        """The file and line of the last record checked."""
        self.at: tuple[str | None, int | None] = (None, None)
        """The file and line being checked."""
        self.done = stop_at == 0

    @property
    def head(self) -> dict:
        return {"seq": self.seq, "hash": self.prev}

    def verdict(self, error: str, files: int, at: tuple | None = None) -> Verification:
        name, line = (at or self.at) if error else (None, None)
        return Verification(not error, self.count, error, line, name, self.head, self.first, files)

    def segment(self, segment: Segment, f: BinaryIO) -> str:
        """Check one file's lines; the break's message, or "" (then `done` says whether the
        expected head was reached)."""
        self.at = (segment.path.name, None)
        for number, raw in enumerate(f, 1):
            self.at = (segment.path.name, number)
            error = self._check(raw, number, segment.first)
            if error or self.done:
                return error
        if segment.first is not None and self.at[1] is None:
            return "the segment is empty: its records were removed"
        return ""

    def _check(self, raw: bytes, number: int, named: int | None) -> str:
        if not raw.endswith(b"\n"):
            return "last line is incomplete (torn write)"
        line = raw[:-1]
        try:
            record = json.loads(line)
            seq, prev = int(record["seq"]), record["prev"]
        except (ValueError, KeyError, TypeError):
            return "not an audit record"
        if number == 1 and named is not None and seq != named:
            return (f"the segment's first record is seq {seq} but its name says {named}: "
                    "segments were renamed or reordered")
        before = self.last[0]
        if self.first is None:
            self.first = seq
            if seq == 1 and prev != GENESIS:
                return "the first record does not start the chain (prev is not the genesis hash)"
        elif seq != self.seq + 1:
            if number == 1:
                missing = (f"record {seq - 1} is" if seq - 1 == self.seq + 1 else
                           f"records {self.seq + 1} to {seq - 1} are")
                return (f"seq {seq} follows seq {self.seq}, the last record of {before}: "
                        f"{missing} missing (a segment was removed, or lines cut from the end "
                        "of the one before)")
            return f"seq {seq} follows {self.seq}: a line was removed, inserted or moved"
        elif prev != self.prev:
            return ("prev does not match the hash of the line before: that line was edited, "
                    "removed or moved" + (f" (the last line of {before})" if number == 1 else ""))
        self.seq, self.prev, self.count = seq, line_hash(line), self.count + 1
        self.last = self.at
        self.done = seq == self.stop_at
        return ""


def page(path: Path, after: int = 0, since: float | None = None,
         limit: int = 100) -> tuple[list[dict], bool]:
    """Records with seq > `after` (and ts >= `since`), at most `limit`; and whether more
    follow. Cheap wherever the page is: the start is found by bisection, over the segments'
    first records and then inside one segment, so a recent page reads a few blocks, not the
    log. (`since` is bisected by the records' times, which follow the chain unless the
    clock was stepped back.)"""

    def wanted(record: dict) -> bool:
        return record.get("seq", 0) > after and (since is None or record.get("ts", 0) >= since)

    records: list[dict] = []
    with opened(Path(path)) as files:
        start = 0
        for index, (_, f) in enumerate(files):
            first = _record(f.readline())
            if first is not None and not wanted(first):
                start = index  # the first wanted record is here or further on
        for index, (_, f) in enumerate(files[start:]):
            f.seek(_bisect(f, wanted) if index == 0 else 0)
            for raw in f:
                record = _record(raw)
                if record is None or not wanted(record):
                    continue
                if len(records) == limit:
                    return records, True
                records.append(record)
    return records, False


def _record(raw: bytes) -> dict | None:
    """A complete line's record (None: torn, or not a record)."""
    if not raw.endswith(b"\n"):
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _bisect(f: BinaryIO, wanted: Callable[[dict], bool]) -> int:
    """The offset of the first line whose record is wanted (`wanted` is False, then True,
    along the file): O(log size) lines read. A torn or foreign line counts as not wanted."""
    low, high = 0, os.fstat(f.fileno()).st_size  # low: a line start; high: a line start or end
    while low < high:
        middle = (low + high) // 2
        start = low
        if middle > low:
            f.seek(middle - 1)
            f.readline()  # to the first line that starts at or after `middle`
            start = f.tell()
            if start >= high:  # no line starts in [middle, high): look at the one at low
                start = low
        f.seek(start)
        raw = f.readline()
        if not raw.endswith(b"\n"):  # a batch being written: past every record on disk
            high = start
            continue
        record = _record(raw)
        if record is not None and wanted(record):
            high = start
        else:
            low = start + len(raw)
    return low


SEGMENT_LINES = 200_000
"""The most lines `session_segment` hands out (an evidence bundle's chain segment)."""


def session_segment(path: Path, session: str, upto: int) -> list[str]:
    """The log's lines from the session's first record up to the record `upto` (a signed
    head's seq), every session's records between them included: the chain segment that
    links the session's records to that head. [] when the session has no record up to it."""
    marker = b'"session":' + json.dumps(session).encode()
    lines: list[str] = []
    with opened(Path(path)) as files:
        for _, f in files:
            for raw in f:
                if not raw.endswith(b"\n"):
                    return lines
                record = _record(raw) if lines or marker in raw else None
                if not lines and (record or {}).get("session") != session:
                    continue
                record = record or {}
                if record.get("seq", 0) > upto:
                    return lines
                lines.append(raw[:-1].decode())
                if len(lines) > SEGMENT_LINES:
                    raise ValueError(
                        f"the chain from session {session}'s first record to the signed head "
                        f"at seq {upto} is more than {SEGMENT_LINES} records: too large for "
                        "one evidence bundle")
    return lines
