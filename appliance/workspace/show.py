"""The diff a person reads: a unified diff of the text changes, one line for every other
change, the notes, and a summary (appliance side).

Every byte here was written by the agent and ends up in a person's terminal, so names,
link targets and lines go through `safe_line`/`shown`: a control character, an escape
sequence, a bidi override or a byte that is not UTF-8 is shown as an escape, never sent.
A file is text when it holds no NUL (as in git, but all of it is looked at, not a
prefix); bytes that are not UTF-8 are shown as escapes; lines end at LF only. The work
is bounded: contents are read one change at a time, at most `TEXT_LIMIT` per side; long
lines are cut; alignment (difflib) runs only on the differing middle of a file and within a
budget; past `RENDER_LIMIT` the remaining changes get one line each. Whatever is cut says so.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from .compare import Reader
from .model import Change, Changeset, Entry, human_size, safe_line, shown
from .tree import Unreadable

TEXT_LIMIT = 1024 * 1024
"""The largest side shown as a text diff."""
LINE_SHOWN = 2000
"""Characters of one line shown."""
ALIGN_CELLS = 4_000_000
"""The largest differing middle (lines before x lines after) aligned line by line."""
ALIGN_BUDGET = 40_000_000
"""... and all of them together, for one diff: what difflib may cost is bounded."""
RENDER_LIMIT = 16 * 1024 * 1024
"""Characters of diff text; after that each change gets one line."""
READ_LIMIT = 256 * 1024 * 1024
"""Bytes read to show one diff (the same 1 MiB file hard-linked 100k times is 100 GB);
after that, too, each change gets one line."""
CONTEXT = 3


@dataclass
class Shown:
    change: Change
    binary: bool
    """A side was shown as binary."""


@dataclass
class _Side:
    entry: Entry | None
    text: str | None = None
    """Decoded contents when the side is a text file small enough to show."""
    binary: bool = False
    problem: str = ""
    """Why the contents could not be read now."""

    def describe(self) -> str:
        entry = self.entry
        if entry is None:
            return "nothing"
        if entry.kind == "link":
            return f"symlink -> {shown(entry.data)}" if entry.data is not None else \
                f"symlink ({entry.note})"
        if entry.kind == "other":
            return entry.note
        if entry.note or self.problem:
            return entry.note or self.problem
        if self.binary:
            return f"binary file, {entry.size} bytes"
        if self.text is not None:
            return f"text file, {entry.size} bytes"
        if entry.size > TEXT_LIMIT:
            return f"file, {entry.size} bytes ({human_size(entry.size)}): too large to show"
        return f"file, {entry.size} bytes"


def _load(reader: Reader, path: str, entry: Entry | None, renderer: _Renderer) -> _Side:
    side = _Side(entry)
    if entry is None or entry.kind != "file" or entry.note or entry.size > TEXT_LIMIT:
        return side
    if entry.data is not None:  # a snapshot's bytes: shown as they will be applied
        data = entry.data
    else:
        try:
            data, _ = reader.read(path, TEXT_LIMIT)
        except Unreadable as exc:
            side.problem = f"{exc} (not shown)"
            return side
    renderer.read += len(data)
    if b"\0" in data:
        side.binary = True
    else:  # bytes that are not UTF-8 are shown as \xNN (a Latin-1 file is still reviewable)
        side.text = data.decode("utf-8", "surrogateescape")
    return side


def _lines(text: str) -> list[str]:
    """Lines ending at LF only (str.splitlines would also split at CR, VT, FF, U+2028...)."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


class _Renderer:
    def __init__(self):
        self.out: list[str] = []
        self.size = 0
        self.read = 0
        self.budget = ALIGN_BUDGET

    @property
    def full(self) -> str:
        """Empty while changes are still shown in full; else why not."""
        if self.size >= RENDER_LIMIT:
            return f"the diff is over {human_size(RENDER_LIMIT)}"
        if self.read >= READ_LIMIT:
            return f"the diff read {human_size(READ_LIMIT)} already"
        return ""

    def emit(self, line: str) -> None:
        self.out.append(line)
        self.size += len(line) + 1

    def opcodes(self, a: list[str], b: list[str]) -> list[tuple[str, int, int, int, int]]:
        """Equal head and tail found in linear time; difflib aligns only the middle, when it
        is small enough and the budget allows; otherwise the middle is one replacement."""
        head = 0
        while head < min(len(a), len(b)) and a[head] == b[head]:
            head += 1
        tail = 0
        while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
            tail += 1
        mid_a, mid_b = a[head:len(a) - tail], b[head:len(b) - tail]
        codes = [("equal", 0, head, 0, head)] if head else []
        cells = len(mid_a) * len(mid_b)
        if cells and cells <= min(ALIGN_CELLS, self.budget):
            self.budget -= cells
            codes += [(tag, i1 + head, i2 + head, j1 + head, j2 + head) for tag, i1, i2, j1, j2
                      in difflib.SequenceMatcher(None, mid_a, mid_b).get_opcodes()]
        elif mid_a or mid_b:
            tag = "replace" if mid_a and mid_b else "delete" if mid_a else "insert"
            codes.append((tag, head, len(a) - tail, head, len(b) - tail))
        if tail:
            codes.append(("equal", len(a) - tail, len(a), len(b) - tail, len(b)))
        return codes

    def text_diff(self, change: Change, old: str | None, new: str | None) -> None:
        a, b = _lines(old) if old is not None else [], _lines(new) if new is not None else []
        self.emit(f"--- {shown('a/' + change.path) if old is not None else '/dev/null'}")
        self.emit(f"+++ {shown('b/' + change.path) if new is not None else '/dev/null'}")
        escaped = cut = False
        for group in _groups(self.opcodes(a, b)):
            first, last = group[0], group[-1]
            self.emit(f"@@ -{_range(first[1], last[2])} +{_range(first[3], last[4])} @@")
            for tag, i1, i2, j1, j2 in group:
                rows = [(" ", line) for line in a[i1:i2]] if tag == "equal" else \
                    [("-", line) for line in a[i1:i2]] + [("+", line) for line in b[j1:j2]]
                for mark, line in rows:
                    body = line[:-1] if line.endswith("\n") else line
                    if len(body) > LINE_SHOWN:
                        body, cut = body[:LINE_SHOWN], True
                        more = f" [... {len(line) - LINE_SHOWN} more characters not shown]"
                    else:
                        more = ""
                    body, was_escaped = safe_line(body)
                    escaped |= was_escaped
                    self.emit(mark + body + more)
                    if not line.endswith("\n"):
                        self.emit("\\ No newline at end of file")
        if escaped:
            self.emit(f"note: {shown(change.path)}: characters that a terminal would act on "
                      "(controls, escapes, bidi, bytes that are not UTF-8) are shown as "
                      "\\xNN, \\r, \\uNNNN")
        if cut:
            self.emit(f"note: {shown(change.path)}: lines over {LINE_SHOWN} characters are cut")


def _range(start: int, stop: int) -> str:
    length = stop - start
    first = start + 1 if length else start
    return f"{first}" if length == 1 else f"{first},{length}"


def _groups(codes: list[tuple[str, int, int, int, int]], n: int = CONTEXT):
    """difflib's hunk grouping (SequenceMatcher.get_grouped_opcodes), on our opcodes."""
    if not codes:
        return
    codes = list(codes)
    if codes[0][0] == "equal":
        tag, i1, i2, j1, j2 = codes[0]
        codes[0] = tag, max(i1, i2 - n), i2, max(j1, j2 - n), j2
    if codes[-1][0] == "equal":
        tag, i1, i2, j1, j2 = codes[-1]
        codes[-1] = tag, i1, min(i2, i1 + n), j1, min(j2, j1 + n)
    group = []
    for tag, i1, i2, j1, j2 in codes:
        if tag == "equal" and i2 - i1 > 2 * n:
            group.append((tag, i1, min(i2, i1 + n), j1, min(j2, j1 + n)))
            yield group
            group = []
            i1, j1 = max(i1, i2 - n), max(j1, j2 - n)
        group.append((tag, i1, i2, j1, j2))
    if group and not (len(group) == 1 and group[0][0] == "equal"):
        yield group


def review(changeset: Changeset) -> tuple[str, list[Shown]]:
    """The diff text, and how each change was shown."""
    renderer, shown_changes = _Renderer(), []
    counts = {"added": 0, "modified": 0, "removed": 0}
    binary = not_carried = 0
    with Reader(changeset.base) as base, Reader(changeset.work) as work:
        for change in changeset.changes:
            counts[change.action] += 1
            cut = renderer.full
            old = _Side(change.before) if cut else _load(base, change.path, change.before,
                                                          renderer)
            new = _Side(change.after) if cut else _load(work, change.path, change.after,
                                                         renderer)
            is_binary = old.binary or new.binary
            binary += is_binary
            not_carried += bool(change.note)
            shown_changes.append(Shown(change, is_binary))
            texts = [s.text for s in (old, new) if s.entry is not None]
            if not cut and all(t is not None for t in texts):
                renderer.text_diff(change, old.text, new.text)
            else:
                renderer.emit(f"{change.action}: {shown(change.path)} ("
                              f"{_what(change, old, new, cut)})")
            if (change.before and change.after and change.before.kind == "file" ==
                    change.after.kind and change.before.executable != change.after.executable):
                renderer.emit(f"mode: {shown(change.path)} "
                              f"{'+x' if change.after.executable else '-x'}")
    for note in changeset.notes:  # all of them: the walk bounds their number and size
        renderer.emit(f"not shown: {shown(note.path)}: {note.text}")
    summary = (f"{counts['added']} added, {counts['modified']} modified, {counts['removed']} "
               f"removed, {binary} binary")
    if not_carried:
        summary += f", {not_carried} not carried"
    if changeset.notes:
        summary += f", {len(changeset.notes)} note(s)"
    return "\n".join([*renderer.out, summary]), shown_changes


def _what(change: Change, old: _Side, new: _Side, cut: str) -> str:
    if change.action == "added":
        what = new.describe()
    elif change.action == "removed":
        what = old.describe()
    elif old.binary and new.binary:
        what = f"binary file, {old.entry.size} -> {new.entry.size} bytes"  # type: ignore[union-attr]
    else:
        what = f"{old.describe()} -> {new.describe()}"
    if cut:
        what += f"; diff not shown: {cut}"
    if change.note:
        what += ", not carried"
    return what


def render(changeset: Changeset) -> str:
    """The diff text alone."""
    return review(changeset)[0]
