"""The workspace: the agent proposes, a human disposes. Standard library only: the appliance
computes changes, the host CLI applies them (the two sides may be different machines).

At start the project is copied twice, without `.corral/`: `work/` (mounted at /work, the
agent's) and `base/` (never mounted: what the agent started from). `changes()` compares the
two (appliance side); `apply()` writes a changeset into the host project, but only where the
host still holds what the change started from — a file the person edited meanwhile is a
conflict, and then nothing at all is written unless forced (host side). `fold()` writes the
applied changes into `base/`, so the next apply carries only what is new (appliance side).
Changesets travel as JSON (`to_json` / `from_json`).

The agent controls `work/` completely, so nothing read from it is trusted: symlinks are
compared and applied as links (never followed), a link pointing out of the project is
refused, and no write goes through a directory that is a symlink on the host.
"""

from __future__ import annotations

import base64
import difflib
import errno
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

EXCLUDED = (".corral",)
"""Top-level names never copied in: the project's corral directory holds its credentials."""
BINARY_PROBE = 8192
MAX_FILE = 256 * 1024 * 1024
"""The largest file a diff or apply carries."""


@dataclass(frozen=True)
class Entry:
    kind: str
    """file | link"""
    data: bytes
    """File contents, or the link's target."""
    executable: bool = False


@dataclass(frozen=True)
class Change:
    path: str
    """Relative, with / separators."""
    action: str
    """added | modified | removed"""
    before: Entry | None
    after: Entry | None

    @property
    def binary(self) -> bool:
        return any(e is not None and e.kind == "file" and _binary(e.data)
                   for e in (self.before, self.after))


@dataclass
class Conflict(Exception):
    paths: list[str] = field(default_factory=list)
    """Files the host changed since the session started."""
    refused: list[str] = field(default_factory=list)
    """Changes that would write outside the project (links out, symlinked directories)."""

    def __str__(self) -> str:
        parts = []
        if self.paths:
            parts.append("changed on the host since the session started: "
                         + ", ".join(self.paths))
        if self.refused:
            parts.append("refused: " + "; ".join(self.refused))
        return "; ".join(parts)


def _binary(data: bytes) -> bool:
    head = data[:BINARY_PROBE]
    if b"\0" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start < len(head) - 4  # a cut multi-byte character at the end is fine
    return False


def copy_in(project: Path, work: Path, base: Path) -> None:
    """The project into `work/` and `base/`, without `.corral/`; symlinks stay symlinks."""
    def ignore(directory, names):
        return [n for n in names if n in EXCLUDED] if Path(directory) == project else []

    for target in (base, work):
        shutil.copytree(project, target, symlinks=True, ignore=ignore)


def snapshot(root: Path) -> dict[str, Entry]:
    """Every file and link below `root`, by relative path; directories are implied.

    The agent may change `work/` while this runs, as root, reads it: every name is opened
    relative to its directory's descriptor without following links (os.fwalk, O_NOFOLLOW),
    and only what fstat says is a regular file is read — a file swapped for a link to a host
    path, or a directory swapped for one, is never followed; FIFOs and devices never block."""
    out: dict[str, Entry] = {}
    for directory, dirs, files, dir_fd in os.fwalk(root, follow_symlinks=False):
        here = Path(directory).relative_to(root)
        for name in [*files, *dirs]:
            relative = (here / name).as_posix()
            if relative.split("/", 1)[0] in EXCLUDED:
                continue
            entry = _read(name, dir_fd, relative)
            if entry is not None:
                out[relative] = entry
    return out


def _read(name: str, dir_fd: int, relative: str) -> Entry | None:
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(info.st_mode):
            return Entry("link", os.readlink(name, dir_fd=dir_fd).encode())
        if not stat.S_ISREG(info.st_mode):
            return None  # a directory (implied), FIFO, socket or device
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None  # gone meanwhile
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # became a link since the stat: read it next time
            return None
        raise
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            return None
        if info.st_size > MAX_FILE:
            raise ValueError(f"{relative} is {info.st_size} bytes; files over {MAX_FILE} "
                             "bytes are not carried back (copy it out of the session by hand)")
        return Entry("file", f.read(MAX_FILE + 1)[:MAX_FILE], bool(info.st_mode & 0o111))


def changes(base: Path, work: Path) -> list[Change]:
    before, after = snapshot(base), snapshot(work)
    out = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        action = "added" if old is None else "removed" if new is None else "modified"
        out.append(Change(path, action, old, new))
    return out


def render(changeset: list[Change]) -> str:
    """A unified diff of the text changes, a line for each binary one, and a summary."""
    lines: list[str] = []
    for change in changeset:
        old, new = change.before, change.after
        if change.binary or "link" in {e.kind for e in (old, new) if e}:
            what = (f"symlink -> {new.data.decode(errors='replace')}" if new and new.kind == "link"
                    else "binary file")
            lines.append(f"{change.action}: {change.path} ({what})")
            continue
        a = old.data.decode().splitlines(keepends=True) if old else []
        b = new.data.decode().splitlines(keepends=True) if new else []
        header_a = f"a/{change.path}" if old else "/dev/null"
        header_b = f"b/{change.path}" if new else "/dev/null"
        lines.extend(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                     for line in difflib.unified_diff(a, b, header_a, header_b))
        if old and new and old.executable != new.executable:
            lines.append(f"mode: {change.path} {'+x' if new.executable else '-x'}\n")
    counts = {a: sum(1 for c in changeset if c.action == a) for a in ("added", "modified",
                                                                      "removed")}
    binary = sum(1 for c in changeset if c.binary)
    summary = (f"{counts['added']} added, {counts['modified']} modified, {counts['removed']} "
               f"removed, {binary} binary")
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines) + summary


def selected(change: Change, paths: list[str] | None) -> bool:
    if not paths:
        return True
    return any(change.path == p.rstrip("/") or change.path.startswith(p.rstrip("/") + "/")
               for p in paths)


def _host_entry(project: Path, relative: str) -> Entry | None:
    path = project / relative
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return Entry("link", os.readlink(path).encode())
    if stat.S_ISREG(info.st_mode):
        return Entry("file", path.read_bytes(), bool(info.st_mode & 0o111))
    return Entry("other", b"")


def _inside(project: Path, relative: str) -> bool:
    """No component of the parent directory is a symlink, and it stays under the project."""
    current = project
    for part in Path(relative).parent.parts:
        current = current / part
        if current.is_symlink():
            return False
    return (project / relative).resolve(strict=False).parent.is_relative_to(project.resolve())


def apply(project: Path, changeset: list[Change], paths: list[str] | None = None,
          force: bool = False) -> list[Change]:
    """Write the selected changes into `project`; all or nothing. Raises Conflict."""
    project = project.resolve()
    chosen = [c for c in changeset if selected(c, paths)]
    conflict = Conflict()
    for change in chosen:
        if not _safe_path(change.path):
            conflict.refused.append(f"{change.path}: not a relative path inside the project")
            continue
        if not _inside(project, change.path):
            conflict.refused.append(f"{change.path}: a directory on the way is a symlink")
        new = change.after
        if new is not None and new.kind == "link":
            target = (project / change.path).parent / new.data.decode(errors="replace")
            if os.path.isabs(new.data) or not target.resolve(strict=False).is_relative_to(
                    project):
                conflict.refused.append(f"{change.path}: symlink points out of the project "
                                        f"({new.data.decode(errors='replace')})")
        if not force and _host_entry(project, change.path) != change.before:
            conflict.paths.append(change.path)
    if conflict.refused or conflict.paths:
        raise conflict
    for change in chosen:
        _write(project / change.path, change.after)
    return chosen


def fold(base: Path, applied: list[Change]) -> None:
    """What the host now holds becomes what the next diff starts from."""
    for change in applied:
        if not _safe_path(change.path) or not _inside(base, change.path):
            raise ValueError(f"{change.path!r} is not a path inside the workspace")
    for change in applied:
        _write(base / change.path, change.after)


def _safe_path(relative: str) -> bool:
    """A changeset may come over the network: only plain relative paths, never `..`."""
    parts = relative.split("/")
    return bool(relative) and not relative.startswith("/") and all(
        p not in ("", ".", "..") for p in parts) and "\x00" not in relative


def _write(path: Path, entry: Entry | None) -> None:
    if entry is None:
        if path.is_symlink() or path.exists():
            path.unlink()
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        path.unlink()
    if entry.kind == "link":
        path.symlink_to(entry.data.decode())
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(entry.data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o755 if entry.executable else 0o644)
    os.replace(tmp, path)


# -- changesets as JSON ------------------------------------------------------------------------

def _entry_json(entry: Entry | None) -> dict | None:
    if entry is None:
        return None
    return {"kind": entry.kind, "executable": entry.executable,
            "data": base64.b64encode(entry.data).decode()}


def _entry(data: object, where: str) -> Entry | None:
    if data is None:
        return None
    if not isinstance(data, dict) or data.get("kind") not in ("file", "link") or not \
            isinstance(data.get("data"), str) or not isinstance(data.get("executable"), bool):
        raise ValueError(f"{where}: an entry is {{kind: file|link, executable: bool, "
                         f"data: base64}}")
    try:
        raw = base64.b64decode(data["data"], validate=True)
    except ValueError:
        raise ValueError(f"{where}: data is not base64") from None
    return Entry(data["kind"], raw, data["executable"])


def to_json(change: Change) -> dict:
    return {"path": change.path, "action": change.action, "binary": change.binary,
            "before": _entry_json(change.before), "after": _entry_json(change.after)}


def from_json(data: object) -> Change:
    """A change as `to_json` wrote it; ValueError naming the field otherwise."""
    if not isinstance(data, dict) or not isinstance(data.get("path"), str):
        raise ValueError("a change is an object with a string 'path'")
    path = data["path"]
    if not _safe_path(path):
        raise ValueError(f"{path!r}: not a relative path inside the project")
    if data.get("action") not in ("added", "modified", "removed"):
        raise ValueError(f"{path}: action must be added, modified or removed")
    before = _entry(data.get("before"), f"{path}: before")
    after = _entry(data.get("after"), f"{path}: after")
    return Change(path, data["action"], before, after)
