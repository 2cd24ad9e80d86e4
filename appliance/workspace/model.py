"""What a changeset is made of, the limits that bound it, and how a name or a line the agent
wrote is shown to a person (never as terminal control)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

EXCLUDED = (".corral",)
"""Top-level names never copied in: the project's corral directory holds its credentials."""
MAX_FILE = 32 * 1024 * 1024
"""The largest file a changeset carries; a larger one is shown with a note, never read."""
MAX_CARRIED = 64 * 1024 * 1024
"""The most file content one changeset carries; what is over is held back for the next apply.
On its way it is base64 in one JSON line through the sandbox service and the API (about
three copies at once in each, on an appliance of 2 GiB that also runs the agents)."""
MAX_DEPTH = 128
"""Directories deeper than this are not read (one descriptor per level is held meanwhile)."""
MAX_LISTING = 200_000
"""A directory with more entries than this is not read."""
MAX_CHANGES = 200_000
"""The walk stops after this many changes, saying where."""
MAX_VISITED = 2_000_000
"""... and after this many entries of both trees together."""
MAX_NAMES = 64 * 1024 * 1024
"""... and once the paths and link targets it reports come to this many bytes (a path may be
32 KiB long: 128 levels of 255-byte names)."""
MAX_NAME = 255
"""Bytes in one path component (NAME_MAX)."""
MAX_LINK = 4095
"""Bytes in a symlink's target (PATH_MAX - 1)."""

KINDS = ("file", "link", "other")


@dataclass(frozen=True)
class Limits:
    """The bounds of one walk (tests shrink them)."""

    max_file: int = MAX_FILE
    max_carried: int = MAX_CARRIED
    max_depth: int = MAX_DEPTH
    max_listing: int = MAX_LISTING
    max_changes: int = MAX_CHANGES
    max_visited: int = MAX_VISITED
    max_names: int = MAX_NAMES


LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class Entry:
    """One side of a change: a regular file, a symlink, or anything else (never carried)."""

    kind: str
    """file | link | other"""
    data: bytes | None = None
    """A file's contents (when loaded) or a link's target; None for `other`."""
    executable: bool = False
    size: int = 0
    """A file's size in bytes."""
    digest: str = ""
    """sha256 of a file's contents, hex, once read; how the host recognises its own file."""
    note: str = ""
    """Why this side cannot be carried ("too large: ...", "not a regular file: fifo", ...);
    empty when it can."""

    @property
    def carried(self) -> bool:
        if self.note or self.kind not in ("file", "link"):
            return False
        return self.kind == "link" or bool(self.digest)


@dataclass(frozen=True, slots=True)
class Change:
    path: str
    """Relative, with / separators; a name that is not UTF-8 keeps its bytes as surrogates
    (os.fsdecode), so it round-trips to the host byte for byte."""
    action: str
    """added | modified | removed"""
    before: Entry | None
    after: Entry | None

    @property
    def note(self) -> str:
        """Why the host cannot take this change as it stands; empty when it can."""
        for side, entry in (("", self.after), ("before: ", self.before)):
            if entry is not None and entry.note:
                return side + entry.note
        return ""


@dataclass(frozen=True, slots=True)
class Note:
    """Something the agent changed that is not a change the host can take: a directory that
    was not read, an empty directory, where the walk stopped."""

    path: str
    text: str


@dataclass
class Changeset:
    changes: list[Change] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    base: Path | None = None
    """Where the contents are read from when needed (appliance side)."""
    work: Path | None = None

    def __iter__(self):
        return iter(self.changes)

    def __len__(self) -> int:
        return len(self.changes)


def path_bytes(path: str) -> bytes:
    return os.fsencode(path)


def is_utf8(path: str) -> bool:
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# -- showing agent-written text to a person ----------------------------------------------------

def _escape(ch: str) -> str:
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    if ch == "\n":
        return "\\n"
    if ch == "\r":
        return "\\r"
    if ch == "\t":
        return "\\t"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def safe_line(text: str) -> tuple[str, bool]:
    """A line of the agent's text for a terminal: every control, format (bidi, zero-width),
    separator and undecodable character becomes a visible escape; tabs stay. Returns the
    line and whether anything was escaped."""
    if text.isprintable():
        return text, False
    out, escaped = [], False
    for ch in text:
        if ch == "\t" or ch.isprintable():
            out.append(ch)
        else:
            out.append(_escape(ch))
            escaped = True
    return "".join(out), escaped


def shown(path: str | bytes) -> str:
    """A name (or a link's target) for a terminal, git-style: as is when plain, else quoted
    with C escapes, so that no two names look alike and none can move the cursor."""
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    plain = all(p.strip() == p for p in path.split("/"))
    if plain and path.isprintable() and '"' not in path and "\\" not in path:
        return path
    out = []
    for ch in path:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(_escape(ch))
    return '"' + "".join(out) + '"'


def terminal_safe(text: str) -> str:
    """Whole output for a terminal: lines kept, anything else that is not printable escaped.
    The CLI runs every diff it prints through this, whatever the appliance sent."""
    return "\n".join(safe_line(line)[0] for line in text.split("\n"))


def human_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"
