"""The audit log's format and files: chained JSON lines, and the segments they are in.

`audit.jsonl` is the active segment; a rotated one is `audit-<its first seq>.jsonl`. A
reader opens them all at one moment (`opened`), so that a rotation or a retention while it
reads cannot hide a record from it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from appliance.atomic import fsync_dir

GENESIS = "0" * 64
"""The `prev` of the first record."""
_ENCODER = json.JSONEncoder(separators=(",", ":"), sort_keys=True)


def line_hash(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def encode(seq: int, prev: str, event: dict) -> bytes:
    record = {"seq": seq, "prev": prev, **event}
    return _ENCODER.encode(record).encode()


@dataclass(frozen=True)
class Segment:
    path: Path
    first: int | None
    """The seq its name says its first record has; None for the active segment."""


def segment_path(active: Path, first: int) -> Path:
    """Where the active segment goes when it is rotated: named by its first seq."""
    return active.with_name(f"{active.stem}-{first:012d}{active.suffix}")


def segments(active: Path) -> list[Segment]:
    """The log's files in chain order: rotated segments by the seq in their names, then the
    active one (when it exists)."""
    pattern = re.compile(re.escape(active.stem) + r"-(\d+)" + re.escape(active.suffix))
    try:
        names = os.listdir(active.parent)
    except FileNotFoundError:
        return []
    found = sorted((int(m.group(1)), name) for name in names
                   if (m := pattern.fullmatch(name)))
    out = [Segment(active.with_name(name), first) for first, name in found]
    if active.name in names:
        out.append(Segment(active, None))
    return out


@contextlib.contextmanager
def opened(active: Path) -> Iterator[list[tuple[Segment, BinaryIO]]]:
    """Every file of the log, opened at one moment: a rotation or a retention while they are
    read cannot hide a record (an open file stays readable under its old name or none)."""
    for _ in range(20):
        listing = segments(active)
        files: list[tuple[Segment, BinaryIO]] = []
        try:
            for segment in listing:
                files.append((segment, open(segment.path, "rb")))  # noqa: SIM115 - closed below
        except FileNotFoundError:
            stable = False
        else:
            stable = segments(active) == listing
        if stable:
            break
        for _, f in files:
            f.close()
    else:
        raise OSError(f"{active}: the audit log kept rotating while it was being opened")
    try:
        yield files
    finally:
        for _, f in files:
            f.close()


def open_active(path: Path) -> BinaryIO:
    """The active segment for appending, created 0600 (and its name made durable) if new."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)
    f = os.fdopen(fd, "ab")
    if f.tell() == 0:
        fsync_dir(path.parent)
    return f


def last_line(f: BinaryIO, size: int) -> tuple[int, bytes | None]:
    """Where the complete lines of `f` end, and the last complete line (None: no line)."""
    position, tail = size, b""
    while position > 0:
        step = min(65536, position)
        position -= step
        f.seek(position)
        tail = f.read(step) + tail
        end = tail.rfind(b"\n")
        if end == -1:
            continue
        start = tail.rfind(b"\n", 0, end) + 1
        if start > 0 or position == 0:
            return position + end + 1, tail[start:end]
    return 0, None


def seq_of(line: bytes, where: Path) -> int:
    try:
        return int(json.loads(line)["seq"])
    except (ValueError, KeyError, TypeError):
        raise RuntimeError(f"{where}: a line is not an audit record; run `corral audit "
                           "--verify` and move the file aside") from None
