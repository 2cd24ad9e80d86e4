"""Writing a changeset: into the host project (`apply`, run by the CLI) or into `base/`
(`fold`, on the appliance).

`apply` first decides every change against what the host holds now: a change the host can
take is written, one it already holds is counted as applied (so an apply that was cut short
can be run again), a file the person edited meanwhile is a conflict (then nothing at all is
written unless forced), and anything that cannot or must not be written is refused by name
with the reason — the rest is still written. Refused: what the appliance could not carry
(a FIFO, a file over the limit, ...), a symlink that points out of the project, a path
whose directory on the way is a symlink or a file on this host, a name this host's file
system will not take.

Writing is all or nothing for what is written: contents are staged in a directory of our
own next to the files, then every step is a rename that is journalled, and an interrupted
apply (an error, Ctrl-C) puts back everything it had moved. Every step opens one name
relative to its directory's descriptor without following links, so nothing is written
through a symlink, whatever appeared since the check, and no path is too long.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import tree
from .compare import selected
from .model import MAX_LINK, Change, Entry, shown
from .tree import DIR_FLAGS, Unreadable
from .wire import git_runs, safe_path


@dataclass(frozen=True)
class Refusal:
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{shown(self.path)}: {self.reason}"


@dataclass
class Applied:
    changes: list[Change] = field(default_factory=list)
    """Written, or found already in place."""
    refused: list[Refusal] = field(default_factory=list)


@dataclass
class Conflict(Exception):
    paths: list[str] = field(default_factory=list)
    """Files the host changed since the session started: nothing was written."""
    refused: list[Refusal] = field(default_factory=list)
    """What would have been refused anyway."""

    def __str__(self) -> str:
        text = ("changed on the host since the session started: "
                + ", ".join(shown(p) for p in self.paths))
        if self.refused:
            text += "; refused: " + "; ".join(str(r) for r in self.refused)
        return text


# -- what the host holds ------------------------------------------------------------------------

@dataclass
class _Host:
    kind: str | None
    """None (nothing there), file, link, dir, or another file type."""
    info: os.stat_result | None = None
    target: bytes = b""
    digest: str = ""


def _parts(path: str) -> tuple[list[str], str]:
    parent, _, name = path.rpartition("/")
    return (parent.split("/") if parent else []), name


def _walk_parents(root_fd: int, parts: list[str]) -> tuple[int | None, str, str]:
    """(descriptor of the parent, "", "") when every directory on the way is one; (None, "",
    "") when one is missing; (None, blocking path, its kind) when one is something else."""
    fd = os.dup(root_fd)
    try:
        for i, part in enumerate(parts):
            info = tree.lstat(fd, part)
            if info is None:
                os.close(fd)
                return None, "", ""
            kind = tree.kind_of(info.st_mode)
            if kind != "dir":
                os.close(fd)
                return None, "/".join(parts[:i + 1]), kind
            next_fd = tree.open_dir(fd, part)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd, "", ""


def _host(parent_fd: int | None, name: str) -> _Host:
    if parent_fd is None:
        return _Host(None)
    info = tree.lstat(parent_fd, name)
    if info is None:
        return _Host(None)
    kind = tree.kind_of(info.st_mode)
    host = _Host(kind, info)
    if kind == "link":
        host.target = tree.readlink(parent_fd, name)
    return host


def _matches(host: _Host, entry: Entry | None, parent_fd: int | None, name: str) -> bool:
    if entry is None:
        return host.kind is None
    if host.kind != entry.kind or host.info is None:
        return False
    if entry.kind == "link":
        return host.target == entry.data
    if entry.kind != "file" or not entry.digest:
        return False
    if bool(host.info.st_mode & 0o111) != entry.executable or host.info.st_size != entry.size:
        return False
    if not host.digest:
        host.digest = tree.hash_file(parent_fd, name, max(entry.size, 1))[0]  # type: ignore[arg-type]
    return host.digest == entry.digest


def link_problem(project: Path, path: str, target: bytes | None) -> str:
    """Why a symlink with this target at `path` could lead out of the project; empty when it
    cannot. Leading `..` are counted against the link's depth; `..` after a name is refused
    (where it leads depends on links); the host's own links are resolved too."""
    if not target or b"\0" in target or len(target) > MAX_LINK:
        return "not a valid symlink target"
    out = f"symlink points out of the project ({shown(target)})"
    if target.startswith(b"/"):
        return out
    names = [p for p in target.split(b"/") if p not in (b"", b".")]
    ups = 0
    while ups < len(names) and names[ups] == b"..":
        ups += 1
    if b".." in names[ups:]:
        return f"symlink target has '..' after a name ({shown(target)}): refused, since " \
               "where it leads depends on links"
    if ups > path.count("/"):
        return out
    here = os.path.join(project, os.fsdecode(posixpath.dirname(os.fsencode(path))))
    resolved = os.path.realpath(os.path.join(here, os.fsdecode(target)))
    if os.path.commonpath([resolved, str(project)]) != str(project):
        return out
    return ""


# -- deciding ---------------------------------------------------------------------------------

@dataclass
class _Plan:
    root_fd: int
    project: Path
    force: bool
    writes: list[Change] = field(default_factory=list)
    done: list[Change] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    removing: set[str] = field(default_factory=set)
    """Paths this apply removes (or finds already removed)."""
    clearing: list[Change] = field(default_factory=list)
    """Changes that put something where the host has a directory."""

    def refuse(self, change: Change, reason: str) -> None:
        self.refused.append(Refusal(change.path, reason))

    def decide(self, change: Change, check: bool = True) -> None:
        problem = safe_path(change.path) or git_runs(change.path)
        if problem:
            return self.refuse(change, problem)
        if change.note:
            return self.refuse(change, f"not carried: {change.note}")
        after = change.after
        if after is not None and after.kind == "file" and after.data is None:
            return self.refuse(change, "not carried: the changeset holds no contents for it")
        if after is not None and after.kind == "link":
            problem = link_problem(self.project, change.path, after.data)
            if problem:
                return self.refuse(change, problem)
        parts, name = _parts(change.path)
        try:
            parent_fd, blocker, kind = _walk_parents(self.root_fd, parts)
        except Unreadable as exc:
            return self.refuse(change, f"a directory on the way cannot be opened here: {exc}")
        if blocker and blocker not in self.removing:
            what = "a symlink" if kind == "link" else f"a {kind}"
            return self.refuse(change, f"a directory on the way is {what} on this host "
                                       f"({shown(blocker)})")
        try:
            host = _host(parent_fd, name)
            if host.kind == "dir" and after is not None:
                if change.before is not None and check and not self.force:
                    self.conflicts.append(change.path)
                else:
                    self.clearing.append(change)
                    self._write(change)
            elif not check or _matches(host, change.before, parent_fd, name):
                self._write(change)
            elif _matches(host, after, parent_fd, name):
                self.done.append(change)
                if after is None:
                    self.removing.add(change.path)
            elif self.force:
                self._write(change)
            else:
                self.conflicts.append(change.path)
        except Unreadable as exc:
            self.refuse(change, f"cannot be read on this host: {exc}")
        finally:
            if parent_fd is not None:
                os.close(parent_fd)

    def _write(self, change: Change) -> None:
        self.writes.append(change)
        if change.after is None:
            self.removing.add(change.path)

    def check_clearing(self) -> None:
        """A directory may only give way when this apply removes everything in it."""
        for change in list(self.clearing):
            extra = _first_kept(self.root_fd, change.path, self.removing)
            if extra:
                self.writes.remove(change)
                self.clearing.remove(change)
                self.refuse(change, f"a directory on this host is in the way, holding "
                                    f"{shown(extra)}, which this change does not remove")


def _first_kept(root_fd: int, path: str, removing: set[str]) -> str:
    """The first non-directory under `path` on the host that is not being removed."""
    try:
        fd = tree.descend(root_fd, path.split("/"))
    except Unreadable as exc:
        return f"{path} ({exc})"
    stack: list[tuple[str, int]] = [(path, fd)]
    try:
        while stack:
            here, fd = stack.pop()
            try:
                names = sorted(os.listdir(fd))
                for name in names:
                    child = f"{here}/{name}"
                    info = tree.lstat(fd, name)
                    if info is None:
                        continue
                    if tree.kind_of(info.st_mode) == "dir":
                        stack.append((child, tree.open_dir(fd, name)))
                    elif child not in removing:
                        return child
            finally:
                os.close(fd)
    except (OSError, Unreadable) as exc:
        return f"{path} ({exc})"
    finally:
        for _, fd in stack:
            os.close(fd)
    return ""


# -- writing ----------------------------------------------------------------------------------

class _Failed(Exception):
    pass


class _Writer:
    """Every step is journalled so that `undo` can put back what was there."""

    def __init__(self, root: Path, staging_parent: Path):
        self.root_fd = os.open(root, DIR_FLAGS)
        self.staging = Path(tempfile.mkdtemp(dir=staging_parent, prefix=".corral-apply-"))
        self.staging_fd = os.open(self.staging, DIR_FLAGS)
        self.journal: list[Callable[[], None]] = []
        self.touched: set[str] = set()
        self.counter = 0

    def _name(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def step(self, path: str, action: Callable[[], None]) -> None:
        """One change; an OSError undoes what it had done and names the path."""
        mark = len(self.journal)
        try:
            action()
        except (OSError, Unreadable) as exc:
            self._undo_to(mark)
            raise _Failed(f"cannot be written on this host: {exc}") from None

    def _undo_to(self, mark: int) -> list[str]:
        errors = []
        while len(self.journal) > mark:
            try:
                self.journal.pop()()
            except OSError as exc:
                errors.append(str(exc))
        return errors

    def _parent(self, path: str, create: bool) -> tuple[int, str]:
        parts, name = _parts(path)
        fd = os.dup(self.root_fd)
        done: list[str] = []
        try:
            for part in parts:
                if create and tree.lstat(fd, part) is None:
                    os.mkdir(part, 0o777, dir_fd=fd)
                    self.journal.append(self._rmdir_later("/".join([*done, part])))
                next_fd = os.open(part, DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = next_fd
                done.append(part)
        except BaseException:
            os.close(fd)
            raise
        self.touched.add("/".join(parts))
        return fd, name

    def _rmdir_later(self, path: str) -> Callable[[], None]:
        def undo():
            fd, name = self._parent(path, create=False)
            try:
                os.rmdir(name, dir_fd=fd)
            finally:
                os.close(fd)
        return undo

    def _move(self, path: str, to_staging: bool, staged: str) -> None:
        """path -> staging/staged, or back; journalled."""
        fd, name = self._parent(path, create=False)
        try:
            if to_staging:
                os.rename(name, staged, src_dir_fd=fd, dst_dir_fd=self.staging_fd)
            else:
                os.rename(staged, name, src_dir_fd=self.staging_fd, dst_dir_fd=fd)
        finally:
            os.close(fd)
        self.journal.append(lambda: self._unmove(path, to_staging, staged))

    def _unmove(self, path: str, to_staging: bool, staged: str) -> None:
        fd, name = self._parent(path, create=False)
        try:
            if to_staging:
                os.rename(staged, name, src_dir_fd=self.staging_fd, dst_dir_fd=fd)
            else:
                os.rename(name, staged, src_dir_fd=fd, dst_dir_fd=self.staging_fd)
        finally:
            os.close(fd)

    def stage(self, entry: Entry) -> str:
        name = self._name("new-")
        if entry.kind == "link":
            os.symlink(entry.data, name, dir_fd=self.staging_fd)  # type: ignore[arg-type]
            return name
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600,
                     dir_fd=self.staging_fd)
        try:
            view = memoryview(entry.data)  # type: ignore[arg-type]
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, 0o755 if entry.executable else 0o644)
            os.fsync(fd)
        finally:
            os.close(fd)
        return name

    def _kind(self, path: str, create: bool = False) -> str | None:
        fd, name = self._parent(path, create)
        try:
            info = tree.lstat(fd, name)
        finally:
            os.close(fd)
        return tree.kind_of(info.st_mode) if info else None

    def remove(self, path: str) -> None:
        kind = self._kind(path)
        if kind == "dir":
            raise OSError(f"{shown(path)} is a directory here now")
        if kind is not None:
            self._move(path, True, self._name("old-"))

    def clear(self, path: str) -> None:
        """The directory at `path` now holds only directories: it goes, whole."""
        if self._kind(path) != "dir":
            return
        kept = _first_kept(self.root_fd, path, set())
        if kept:
            raise OSError(f"the directory is not empty ({shown(kept)})")
        self._move(path, True, self._name("old-"))

    def place(self, path: str, staged: str) -> None:
        kind = self._kind(path, create=True)
        if kind == "dir":  # only `clear` moves a directory, once it holds nothing kept
            raise OSError(f"a directory is in the way at {shown(path)}")
        if kind is not None:
            self._move(path, True, self._name("old-"))
        self._move(path, False, staged)

    def prune(self, path: str) -> None:
        """Directories that this apply's removals left empty go too (as in git)."""
        parts, _ = _parts(path)
        while parts:
            here = "/".join(parts)
            try:
                fd = tree.descend(self.root_fd, parts)
            except Unreadable:
                return
            try:
                empty = not os.listdir(fd)
            finally:
                os.close(fd)
            if not empty:
                return
            self._move(here, True, self._name("old-"))
            parts = parts[:-1]

    def commit(self) -> None:
        for path in sorted(self.touched):
            try:
                fd = tree.descend(self.root_fd, path.split("/") if path else [])
            except Unreadable:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self.journal.clear()

    def close(self, keep: bool = False) -> None:
        os.close(self.staging_fd)
        os.close(self.root_fd)
        if not keep:  # what was written stays written if this fails: a leftover is harmless
            with contextlib.suppress(OSError):
                remove_tree(self.staging)

    def undo(self) -> None:
        errors = self._undo_to(0)
        if errors:
            self.close(keep=True)
            raise OSError(f"an interrupted write could not be fully undone ({'; '.join(errors)}); "
                          f"what it had moved away is in {self.staging}") from None


def _write(root: Path, staging_parent: Path, plan: _Plan) -> list[Change]:
    """Write the plan's changes; refused ones are added to the plan, the written returned."""
    writer = _Writer(root, staging_parent)
    failed: set[str] = set()
    try:
        staged: dict[str, str] = {}
        for change in plan.writes:
            if change.after is not None:
                try:
                    staged[change.path] = writer.stage(change.after)
                except OSError as exc:
                    plan.refuse(change, f"cannot be staged on this host: {exc}")
                    failed.add(change.path)
        removals = [c for c in plan.writes if c.after is None]
        additions = [c for c in plan.writes if c.after is not None and c.path not in failed]
        steps: list[tuple[Change, Callable[[], None]]] = []
        steps += [(c, lambda c=c: writer.remove(c.path)) for c in reversed(removals)]
        clearing = {c.path for c in plan.clearing}

        def put(change: Change) -> None:  # a directory that gives way goes in the same step
            if change.path in clearing:
                writer.clear(change.path)
            writer.place(change.path, staged[change.path])

        steps += [(c, lambda c=c: put(c)) for c in additions]
        for change, action in steps:
            if change.path in failed:
                continue
            try:
                writer.step(change.path, action)
            except _Failed as exc:
                plan.refuse(change, str(exc))
                failed.add(change.path)
        for change in removals:
            if change.path not in failed:
                with contextlib.suppress(_Failed):  # an empty directory stays: harmless
                    writer.step(change.path, lambda c=change: writer.prune(c.path))
        writer.commit()
    except BaseException:
        writer.undo()  # raises, keeping the staging directory, when it cannot
        writer.close()
        raise
    writer.close()
    return [c for c in plan.writes if c.path not in failed]


def _order(changes: list[Change]) -> list[Change]:
    return sorted(changes, key=lambda c: os.fsencode(c.path).split(b"/"))


def apply(project: Path, changeset, paths: list[str] | None = None,
          force: bool = False) -> Applied:
    """Write the selected changes into `project`. Raises Conflict (nothing written) when the
    host changed a file since the session started, unless `force`."""
    project = Path(project).resolve()
    chosen = _order([c for c in changeset if selected(c, paths)])
    root_fd = os.open(project, DIR_FLAGS)
    try:
        plan = _Plan(root_fd, project, force)
        for change in chosen:
            plan.decide(change)
        plan.check_clearing()
    finally:
        os.close(root_fd)
    if plan.conflicts:
        raise Conflict(plan.conflicts, plan.refused)
    written = _write(project, project, plan) if plan.writes else []
    return Applied(_order(written + plan.done), plan.refused)


def fold(base: Path, applied: list[Change]) -> list[Refusal]:
    """What the host now holds becomes what the next diff starts from. Returns what could
    not be folded (the next diff shows it again)."""
    base = Path(base).resolve()
    root_fd = os.open(base, DIR_FLAGS)
    try:
        plan = _Plan(root_fd, base, force=True)
        for change in _order(list(applied)):
            plan.decide(change, check=False)
        plan.check_clearing()
    finally:
        os.close(root_fd)
    if plan.writes:
        _write(base, base.parent, plan)
    return plan.refused


def remove_tree(path: Path) -> None:
    """rm -rf without recursion (a tree the agent made may be thousands of levels deep),
    without following links, with a few descriptors: a directory deeper than `HELD` levels
    is moved up to the top and taken apart from there. What is already gone is fine."""
    try:
        top = os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        os.unlink(path)
        return
    moved = 0

    def frame(fd: int, name: str | None) -> tuple[int, str | None, list[str]]:
        subdirs = []
        for entry in os.listdir(fd):
            info = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                subdirs.append(entry)
            else:
                os.unlink(entry, dir_fd=fd)
        return fd, name, subdirs

    try:
        stack = [frame(top, None)]
    except BaseException:
        os.close(top)
        raise
    try:
        while stack:
            fd, name, subdirs = stack[-1]
            if not subdirs:
                stack.pop()
                os.close(fd)
                if name is not None:
                    os.rmdir(name, dir_fd=stack[-1][0])
                continue
            child = subdirs.pop()
            if len(stack) >= HELD:
                moved += 1
                while True:
                    new = f".corral-rm-{moved}"
                    if not os.path.lexists(os.path.join(path, new)):
                        break
                    moved += 1
                os.rename(child, new, src_dir_fd=fd, dst_dir_fd=top)
                stack[0][2].append(new)
                continue
            stack.append(frame(os.open(child, DIR_FLAGS, dir_fd=fd), child))
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    os.rmdir(path)


HELD = 64
"""Directory descriptors `remove_tree` holds at most."""
