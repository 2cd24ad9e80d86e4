"""What the agent changed: `base/` and `work/` walked side by side (appliance side).

One walk over both trees, iterative, in sorted order, holding two directory descriptors per
level of the current path and nothing else: a deep tree costs no recursion and at most
2 x `max_depth` descriptors. Files are compared by metadata first and by content only when
the sizes agree (chunk by chunk: neither tree is ever held in memory); contents are read
later, only for what differs (`carry`) or what is shown (`review`).

Nothing the agent leaves behind stops the walk: what cannot be compared or carried becomes a
change with a note (a FIFO, a file over the limit, a file that vanished mid-read) or a `Note`
(a directory too deep, too big or unreadable, an empty directory, where the walk stopped).
A directory that was not read never yields removals: the host keeps what it cannot see.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import tree
from .model import EXCLUDED, LIMITS, Change, Changeset, Entry, Limits, Note, human_size
from .tree import Unreadable


@dataclass
class _Frame:
    path: str
    """Relative; "" for the top."""
    fds: tuple[int | None, int | None]
    """(base, work): None where that side has no directory here."""
    depth: int
    subdirs: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    """(name, base kind, work kind) still to enter, last first."""

    def close(self) -> None:
        for fd in self.fds:
            if fd is not None:
                os.close(fd)


def _join(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


class _Walk:
    def __init__(self, limits: Limits, out: Changeset):
        self.limits, self.out = limits, out
        self.visited = 0
        self.names = 0
        """Bytes of the paths and link targets reported so far."""
        self.stopped = False

    def note(self, path: str, text: str) -> None:
        self.out.notes.append(Note(path, text))
        self._count(path, len(path))

    def _count(self, path: str, size: int) -> None:
        self.names += size
        if self.names > self.limits.max_names and not self.stopped:
            self.stop(path, f"{self.limits.max_names} bytes of names")

    def run(self, roots: tuple[int, int]) -> None:
        top = self._enter("", (os.dup(roots[0]), os.dup(roots[1])), 0, (None, None))
        stack = [top] if top else []
        try:
            while stack and not self.stopped:
                frame = stack[-1]
                if not frame.subdirs:
                    stack.pop().close()
                    continue
                name, base_kind, work_kind = frame.subdirs.pop()
                path = _join(frame.path, name)
                if frame.depth + 1 > self.limits.max_depth:
                    self.note(path, f"deeper than {self.limits.max_depth} levels: not read, "
                                    "not shown or carried")
                    continue
                fds: list[int | None] = []
                try:
                    for fd, kind in zip(frame.fds, (base_kind, work_kind), strict=True):
                        fds.append(tree.open_dir(fd, name) if kind == "dir" else None)
                except Unreadable as exc:
                    for fd in fds:
                        if fd is not None:
                            os.close(fd)
                    self.note(path, f"directory {exc}: not shown or carried")
                    continue
                child = self._enter(path, (fds[0], fds[1]), frame.depth + 1,
                                    (base_kind, work_kind))
                if child:
                    stack.append(child)
        finally:
            for frame in stack:
                frame.close()

    def _list(self, fd: int | None, path: str, work: bool) -> dict[str, os.stat_result]:
        if fd is None:
            return {}
        out: dict[str, os.stat_result] = {}
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if len(out) >= self.limits.max_listing:
                        raise Unreadable(f"has more than {self.limits.max_listing} entries")
                    if not path and entry.name in EXCLUDED:
                        if work:
                            self.note(entry.name, "never carried (the project's own corral "
                                                  "directory stays on the host)")
                        continue
                    try:
                        info = tree.lstat(fd, entry.name)
                    except Unreadable as exc:
                        self.note(_join(path, entry.name), f"{exc}: not shown or carried")
                        continue
                    if info is not None:
                        out[entry.name] = info
        except OSError as exc:
            raise Unreadable(tree.reason(exc)) from None
        return out

    def _enter(self, path: str, fds: tuple[int | None, int | None], depth: int,
               kinds: tuple[str | None, str | None]) -> _Frame | None:
        """List a directory on both sides, compare what is not a directory, and return the
        frame that will enter the subdirectories (None when there is nothing to enter)."""
        frame = _Frame(path, fds, depth)
        try:
            base, work = self._list(fds[0], path, False), self._list(fds[1], path, True)
        except Unreadable as exc:
            frame.close()
            self.note(path or ".", f"directory {exc}: not shown or carried")
            return None
        self.visited += len(base) + len(work)
        if self.visited > self.limits.max_visited:
            frame.close()
            self.stop(path or ".", f"more than {self.limits.max_visited} entries in the two "
                      "trees")
            return None
        if path and fds[1] is not None and not work and (fds[0] is None or base):
            self.note(path, "empty directory: not carried (only files and links are)")
        elif path and fds[0] is not None and not base and kinds[1] is None:
            self.note(path, "empty directory removed: not carried (only files and links are)")
        for name in sorted(base.keys() | work.keys()):
            old, new = base.get(name), work.get(name)
            old_kind = tree.kind_of(old.st_mode) if old else None
            new_kind = tree.kind_of(new.st_mode) if new else None
            if "dir" in (old_kind, new_kind):
                frame.subdirs.append((name, old_kind, new_kind))
            old = old if old_kind not in (None, "dir") else None
            new = new if new_kind not in (None, "dir") else None
            if (old or new) and not self.stopped:
                self._compare(_join(path, name), name, fds, old, new)
        frame.subdirs.reverse()
        return frame

    def stop(self, path: str, why: str) -> None:
        self.stopped = True
        self.note(path, f"the walk stopped here ({why}): what it had not reached is not "
                        "shown or carried")

    def _compare(self, path: str, name: str, fds: tuple, old: os.stat_result | None,
                 new: os.stat_result | None) -> None:
        if old and new and self._same(fds, name, old, new):
            return
        action = "modified" if old and new else "added" if new else "removed"
        before = self._entry(fds[0], name, old) if old else None
        after = self._entry(fds[1], name, new) if new else None
        self.out.changes.append(Change(path, action, before, after))
        self._count(path, len(path) + sum(len(e.data or b"") for e in (before, after)
                                          if e is not None and e.kind == "link"))
        if len(self.out.changes) >= self.limits.max_changes and not self.stopped:
            self.stop(path, f"{self.limits.max_changes} changes")

    def _same(self, fds: tuple, name: str, old: os.stat_result, new: os.stat_result) -> bool:
        kind = tree.kind_of(old.st_mode)
        if kind != tree.kind_of(new.st_mode):
            return False
        if kind == "link":
            try:
                return tree.readlink(fds[0], name) == tree.readlink(fds[1], name)
            except Unreadable:
                return False
        if kind != "file":
            return True  # two FIFOs, two sockets: nothing to carry either way
        if _executable(old) != _executable(new) or old.st_size != new.st_size:
            return False
        if new.st_size > self.limits.max_file:  # never read: size and time stand for it
            return old.st_mtime_ns == new.st_mtime_ns
        return tree.same_content(fds[0], fds[1], name, self.limits.max_file)

    def _entry(self, fd: int, name: str, info: os.stat_result) -> Entry:
        kind = tree.kind_of(info.st_mode)
        if kind == "link":
            try:
                return Entry("link", tree.readlink(fd, name))
            except Unreadable as exc:
                return Entry("link", None, note=str(exc))
        if kind == "file":
            note = tree.too_large(info.st_size, self.limits.max_file) \
                if info.st_size > self.limits.max_file else ""
            return Entry("file", None, _executable(info), info.st_size, note=note)
        return Entry("other", note=f"not a regular file: {kind}")


def _executable(info: os.stat_result) -> bool:
    return bool(info.st_mode & 0o111)


def changes(base: Path, work: Path, limits: Limits = LIMITS) -> Changeset:
    """Every file and link that differs between `base/` and `work/`, by path, with notes for
    what was not compared. Contents are not loaded (see `carry` and `review`)."""
    out = Changeset(base=Path(base), work=Path(work))
    roots: list[int | None] = []
    try:
        for side, root in (("base", base), ("work", work)):
            try:
                roots.append(tree.open_root(Path(root)))
            except Unreadable as exc:
                out.notes.append(Note(".", f"{side}/ {exc}: nothing compared"))
                return out
        if None in roots:
            if roots != [None, None]:
                missing = "base" if roots[0] is None else "work"
                out.notes.append(Note(".", f"the workspace has no {missing}/ directory: "
                                           "nothing compared"))
            return out
        _Walk(limits, out).run((roots[0], roots[1]))  # type: ignore[arg-type]
    finally:
        for fd in roots:
            if fd is not None:
                os.close(fd)
    out.changes.sort(key=lambda c: c.path)
    return out


# -- loading what differs ------------------------------------------------------------------------

class Reader:
    """Reads the changed names of one side, keeping the last parent directory open (changes
    come sorted, so siblings share it)."""

    def __init__(self, root: Path | None):
        self.root, self.problem = None, "vanished while being read"
        try:
            self.root = tree.open_root(root) if root is not None else None
        except Unreadable as exc:
            self.problem = f"the workspace {exc}"
        self.parent: tuple[str, int] | None = None

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.parent:
            os.close(self.parent[1])
            self.parent = None
        if self.root is not None:
            os.close(self.root)
            self.root = None

    def _dir(self, path: str) -> tuple[int, str]:
        if self.root is None:
            raise Unreadable(self.problem)
        parent, _, name = path.rpartition("/")
        if self.parent and self.parent[0] == parent:
            return self.parent[1], name
        if self.parent:
            os.close(self.parent[1])
            self.parent = None
        fd = tree.descend(self.root, parent.split("/") if parent else [])
        self.parent = (parent, fd)
        return fd, name

    def read(self, path: str, limit: int) -> tuple[bytes, os.stat_result]:
        return tree.read_file(*self._dir(path), limit)

    def digest(self, path: str, limit: int) -> tuple[str, int, os.stat_result]:
        return tree.hash_file(*self._dir(path), limit)


def carry(changeset: Changeset, paths: list[str] | None = None,
          limits: Limits = LIMITS) -> list[Change]:
    """The selected changes ready for the host: each file's contents and digest after, its
    digest before (the host compares its own file to it). At most `max_carried` bytes of
    contents in all: a file over that is held back with a note (the next diff and apply
    take it)."""
    out, carried = [], 0
    with Reader(changeset.base) as base, Reader(changeset.work) as work:
        for change in changeset.changes:
            if not selected(change, paths):
                continue
            before, after = change.before, change.after
            if before is not None and before.kind == "file" and not before.note:
                try:
                    digest, size, _ = base.digest(change.path, limits.max_file)
                    before = Entry("file", None, before.executable, size, digest)
                except Unreadable as exc:
                    before = Entry("file", None, before.executable, before.size,
                                   note=f"on the appliance: {exc}")
            if after is not None and after.kind == "file" and not after.note:
                if carried + after.size > limits.max_carried:
                    after = Entry("file", None, after.executable, after.size,
                                  note=f"held back: this apply already carries "
                                       f"{human_size(carried)} (the limit is "
                                       f"{human_size(limits.max_carried)}); after this apply, "
                                       "diff and apply again for the rest")
                else:
                    try:
                        data, info = work.read(change.path, limits.max_file)
                        if carried + len(data) > limits.max_carried:  # it grew meanwhile
                            raise Unreadable(f"held back: it grew to {len(data)} bytes "
                                             "while being read; diff and apply again for it")
                        after = Entry("file", data, _executable(info), len(data),
                                      hashlib.sha256(data).hexdigest())
                        carried += len(data)
                    except Unreadable as exc:
                        after = Entry("file", None, after.executable, after.size,
                                      note=str(exc))
            out.append(Change(change.path, change.action, before, after))
    return out


def selected(change: Change, paths: list[str] | None) -> bool:
    if not paths:
        return True
    return any(change.path == p.rstrip("/") or change.path.startswith(p.rstrip("/") + "/")
               for p in paths)

