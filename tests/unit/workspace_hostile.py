"""Hostile workspaces for the property tests (unit and slow): what an agent with a shell in
/work can leave behind, generated, and an independent oracle of what it changed.

The oracle (`reference`) is deliberately naive: os.walk on bytes, whole files read, no limits
but the ones the walk is told about. The properties then say what every diff and apply must
do, whatever was generated."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from appliance.workspace import (
    Conflict,
    Limits,
    apply,
    carry,
    changes,
    copy_in,
    diff_answer,
    fold,
    from_json,
    review,
    take,
    to_json,
    unnamed,
    verify,
)

SECRET = b"HOST-ONLY-SECRET-8d1f"
"""Written outside the project: it must never appear in a diff or a changeset."""

NAMES = [b"a", b"b", b"src", b"x.py", b"\xff", b"caf\xe9", b"two\nlines", b"\x1b[2J",
         b"cr\r", b" sp ", b'q"', b"back\\", b"\xe2\x80\xae.txt", b"\xc3", b"-", b"\t"]
SPICE = [b"\xff", b"\0", b"\r", b"\r\n", b"\x1b[31m", b"\x1b]0;t\x07", b"\xe2\x80\xae", b"\xc3",
         b"\xed\xa0\x80", b"\x85", b"\xc2\x9b", b"\n" * 3]


def write_file(path: bytes, data: bytes, append: bool = False, size: int | None = None) -> None:
    """As the agent writes, but never blocking on a FIFO someone put there (ENXIO) and never
    through a link (the harness must not write outside the tree either)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if size is not None:
            os.ftruncate(fd, size)  # sparse: a huge file that costs nothing
    finally:
        os.close(fd)


def _valid(name: bytes) -> bool:
    return b"/" not in name and b"\0" not in name and name not in (b".", b"..")


COMMON = [b"a", b"b", b"src", b"x.py", b"\xff", b"two\nlines"]
"""Most names come from here, so that the agent's operations meet the project's files."""
names = st.one_of(st.sampled_from(COMMON), st.sampled_from(COMMON), st.sampled_from(COMMON),
                  st.sampled_from(NAMES), st.binary(min_size=1, max_size=12).filter(_valid),
                  st.integers(200, 255).map(lambda n: b"L" * n))
paths = st.one_of(st.lists(names, min_size=1, max_size=2), st.lists(names, min_size=1,
                                                                     max_size=4))


@st.composite
def contents(draw) -> bytes:
    base = draw(st.one_of(st.binary(max_size=300),
                          st.text(max_size=300).map(lambda t: t.encode("utf-8", "surrogatepass")),
                          st.integers(0, 20000).map(lambda n: b"line\n" * (n // 5)),
                          st.integers(0, 20000).map(lambda n: b"a" * n)))
    data = bytearray(base)
    for offset, spice in draw(st.lists(st.tuples(st.integers(0, 20000), st.sampled_from(SPICE)),
                                       max_size=4)):
        data[min(offset, len(data)):min(offset, len(data))] = spice
    return bytes(data)


link_targets = st.one_of(
    st.sampled_from([b"/etc/passwd", b"../outside", b"../../host-secret", b"a", b"src/x.py",
                     b".", b"..", b"a/../../x", b"loop", b"self", b"\xff", b"\x1b[2J"]),
    st.lists(names, min_size=1, max_size=3).map(b"/".join),
    st.integers(1000, 4095).map(lambda n: b"t" * n))


BASELINE_PATHS = [[b"src", b"app.py"], [b"bin.dat"], [b"run.sh"], [b"docs", b"readme"],
                  [b"docs"], [b"link"], [b"big"], [b"empty"], [b"a", b"b", b"c", b"d", b"file"],
                  [b"a", b"b"], [b"caf\xe9"], [b"src"]]
"""What every generated project holds (BASELINE), for the agent's changes to meet."""
targets = st.one_of(st.sampled_from(BASELINE_PATHS), paths)

_OPS = {
    "write": lambda: st.tuples(st.just("write"), targets, contents()),
    "mkdir": lambda: st.tuples(st.just("mkdir"), targets),
    "remove": lambda: st.tuples(st.just("remove"), targets),
    "link": lambda: st.tuples(st.just("link"), targets, link_targets),
    "hardlink": lambda: st.tuples(st.just("hardlink"), targets, st.sampled_from(BASELINE_PATHS)),
    "fifo": lambda: st.tuples(st.just("fifo"), targets),
    "socket": lambda: st.tuples(st.just("socket"), targets),
    "chmod": lambda: st.tuples(st.just("chmod"), targets,
                               st.sampled_from([0, 0o644, 0o755, 0o4755, 0o111])),
    "huge": lambda: st.tuples(st.just("huge"), targets, st.sampled_from([70_000, 1 << 40])),
    "deep": lambda: st.tuples(st.just("deep"), targets, st.integers(4, 12)),
    "many": lambda: st.tuples(st.just("many"), targets, st.integers(35, 60)),
    "same size": lambda: st.tuples(st.just("same size"), targets),
    "touch": lambda: st.tuples(st.just("touch"), targets),
    "to dir": lambda: st.tuples(st.just("to dir"), targets),
}
ops = st.sampled_from(sorted(_OPS)).flatmap(lambda kind: _OPS[kind]())
"""Every kind of operation equally often, half of them on what the project holds."""
project_ops = st.lists(st.one_of(st.tuples(st.just("write"), paths, contents()),
                                 st.tuples(st.just("write"), paths, contents()),
                                 st.tuples(st.just("mkdir"), paths),
                                 st.tuples(st.just("huge"), paths, st.just(70_000)),
                                 st.tuples(st.just("link"), paths, st.sampled_from(
                                     [b"a", b"src", b"../a", b"x.py"]))), max_size=12)
agent_ops = st.lists(ops, min_size=1, max_size=25)

LIMITS = Limits(max_file=64 * 1024, max_carried=256 * 1024, max_depth=6, max_listing=40,
                max_changes=100_000, max_visited=1_000_000)
"""Small, so that generated trees cross every limit cheaply."""


BASELINE = [("write", [b"src", b"app.py"], b"print('hello')\n" * 20),
            ("write", [b"bin.dat"], bytes(range(256)) * 4),
            ("write", [b"run.sh"], b"#!/bin/sh\necho hi\n"), ("chmod", [b"run.sh"], 0o755),
            ("write", [b"docs", b"readme"], b"# readme\n\nsome text\n"),
            ("link", [b"link"], b"src/app.py"), ("huge", [b"big"], 70_000),
            ("write", [b"empty"], b""), ("write", [b"a", b"b", b"c", b"d", b"file"], b"deep\n"),
            ("write", [b"caf\xe9"], b"latin-1 name\n")]
"""Every generated project starts with one of each kind, for the agent's changes to meet."""


def _remove(path: bytes) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def perform(root: Path, op: tuple, sockets: list[socket.socket]) -> None:
    """One operation under `root` (bytes paths); whatever the file system refuses is fine."""
    kind, parts = op[0], op[1]
    path = os.path.join(os.fsencode(root), *parts)
    parent = os.path.dirname(path)
    # In a session a link out of /work leads elsewhere in the container; here it would lead
    # out of the test's tree: the harness never writes through one (nor makes directories
    # below one), so whatever lands outside was put there by diff or apply.
    top = os.path.realpath(os.fsencode(root))
    for where in (parent, path) if kind in ("deep", "many") else (parent,):
        real = os.path.realpath(where)
        if real != top and not real.startswith(top + b"/"):
            return
    with contextlib.suppress(OSError, ValueError):
        if kind in ("write", "link", "fifo", "socket", "huge", "deep", "many"):
            os.makedirs(parent, exist_ok=True)
        if kind in ("write", "link", "fifo", "socket", "huge") and os.path.lexists(path):
            _remove(path)  # the agent replaces what is there
        if kind == "write":
            write_file(path, op[2])
        elif kind == "mkdir":
            os.makedirs(path, exist_ok=True)
        elif kind == "remove":
            _remove(path)
        elif kind == "link":
            os.symlink(op[2], path)
        elif kind == "hardlink":
            os.link(os.path.join(os.fsencode(root), *op[2]), path, follow_symlinks=False)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "socket":
            here = os.open(".", os.O_RDONLY)
            try:
                os.chdir(parent)  # AF_UNIX names are short: bind relative to the directory
                listener = socket.socket(socket.AF_UNIX)
                sockets.append(listener)
                listener.bind(os.path.basename(path))
            finally:
                os.fchdir(here)
                os.close(here)
        elif kind == "chmod":
            if not os.path.islink(path):
                os.chmod(path, op[2])
        elif kind == "huge":
            write_file(path, b"", size=op[2])
        elif kind == "deep":
            os.makedirs(os.path.join(path, *[b"d"] * op[2], b"leaf-dir"), exist_ok=True)
            write_file(os.path.join(path, *[b"d"] * op[2], b"leaf"), b"deep\n")
        elif kind == "same size" and os.path.isfile(path) and not os.path.islink(path) \
                and os.path.getsize(path) < 1 << 20:
            data = bytearray(Path(os.fsdecode(path)).read_bytes())
            if data:
                data[len(data) // 2] ^= 1
                info = os.stat(path)
                write_file(path, bytes(data))
                os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))  # hide it from mtime
        elif kind == "touch" and not os.path.islink(path):
            os.utime(path, ns=(1, 1))
        elif kind == "to dir":
            _remove(path)
            os.mkdir(path)
            write_file(os.path.join(path, b"inside"), b"inside\n")
        elif kind == "many":
            os.makedirs(path, exist_ok=True)
            for i in range(op[2]):
                write_file(os.path.join(path, b"%d" % i), b"%d\n" % i)


# -- the oracle ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Thing:
    kind: str
    data: bytes = b""
    executable: bool = False
    size: int = 0
    mtime: int = 0


def _thing(path: bytes, max_file: int) -> Thing:
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return Thing("link", os.readlink(path))
    if stat.S_ISREG(info.st_mode):
        data = b"" if info.st_size > max_file else Path(os.fsdecode(path)).read_bytes()
        return Thing("file", data, bool(info.st_mode & 0o111), info.st_size, info.st_mtime_ns)
    return Thing(f"other {stat.S_IFMT(info.st_mode)}")


def reference(root: Path, max_file: int) -> dict[str, Thing]:
    """Every non-directory under `root` but the top-level .corral, by relative path."""
    out = {}
    top = os.fsencode(root)
    for directory, dirs, files in os.walk(top):
        if directory == top and b".corral" in dirs:
            dirs.remove(b".corral")
        for name in dirs + files:
            path = os.path.join(directory, name)
            if name in dirs and not os.path.islink(path):
                continue
            out[os.fsdecode(os.path.relpath(path, top))] = _thing(path, max_file)
    return out


def same(a: Thing | None, b: Thing | None, max_file: int) -> bool:
    if a is None or b is None or a.kind != b.kind:
        return a is None and b is None
    if a.kind == "file" and max(a.size, b.size) > max_file:
        return (a.size, a.mtime, a.executable) == (b.size, b.mtime, b.executable)
    return (a.data, a.executable) == (b.data, b.executable)


def changed(base: Path, work: Path, max_file: int) -> set[str]:
    old, new = reference(base, max_file), reference(work, max_file)
    return {p for p in old.keys() | new.keys() if not same(old.get(p), new.get(p), max_file)}


def covered(path: str, notes: list[str]) -> bool:
    return any(n == "." or path == n or path.startswith(n + "/") for n in notes)


def terminal_clean(text: str) -> bool:
    return all(ch in "\n\t" or ch.isprintable() for ch in text)


# -- the properties -----------------------------------------------------------------------------

def check_diff_and_apply(top: Path, project_script: list, agent_script: list,
                         limits: Limits = LIMITS) -> None:
    """Build a project, start a session on it, let the agent do its worst, then: diff and
    apply answer; every changed path is in the diff or under a note; what is applied is
    byte-exact on the host, what is not is refused by name; nothing outside is touched;
    after the fold only the refused remain."""
    project, work, base = top / "project", top / "work", top / "base"
    (top / "outside").mkdir()
    (top / "host-secret").write_bytes(SECRET)
    project.mkdir()
    sockets: list[socket.socket] = []
    try:
        for op in [*BASELINE, *project_script]:
            perform(project, op, sockets)
        copy_in(project, work, base)
        for op in agent_script:
            perform(work, op, sockets)
        truth = changed(base, work, limits.max_file)

        found = changes(base, work, limits)
        notes = [n.path for n in found.notes]
        paths = [c.path for c in found]
        assert len(paths) == len(set(paths))
        missing = [p for p in truth if p not in paths and not covered(p, notes)]
        assert not missing, (missing, notes)
        assert set(paths) <= truth, set(paths) - truth  # nothing reported that did not change

        taken = take(found, limits)  # the snapshot a diff shows and an apply gets
        answer = json.loads(json.dumps(diff_answer(taken, base), ensure_ascii=False).encode())
        assert unnamed(answer, sorted(truth)) == []  # as the selftest's review probe checks
        text, shown = review(found)
        assert terminal_clean(text), [c for c in text if not terminal_clean(c)][:5]
        assert [s.change.path for s in shown] == paths
        assert SECRET.decode() not in text

        carried = carry(found, None, limits)
        wire = json.dumps([to_json(c) for c in carried], ensure_ascii=False).encode("utf-8")
        assert SECRET not in wire
        back = [from_json(c) for c in json.loads(wire)]
        assert back == carried
        assert back == taken.changes and answer["digest"] == taken.digest
        verify(back, found.notes, taken.digest)  # what the host checks before writing

        original = reference(project, 1 << 40)
        try:
            result = apply(project, back)
        except Conflict as exc:  # the host has not changed since the start
            raise AssertionError(f"a conflict on an untouched host: {exc}") from None
        applied = {c.path: c for c in result.changes}
        refused = {r.path for r in result.refused}
        assert applied.keys() | refused == set(paths) and not applied.keys() & refused
        host = reference(project, 1 << 40)
        expected = dict(original)
        for path, change in applied.items():
            if change.after is None:
                expected.pop(path, None)
            else:
                entry = change.after
                expected[path] = Thing(entry.kind, entry.data or b"", entry.kind == "file"
                                       and entry.executable, len(entry.data or b""))
        assert {p: (t.kind, t.data, t.executable) for p, t in host.items()} == \
            {p: (t.kind, t.data, t.executable) for p, t in expected.items()}
        for path, thing in host.items():
            if thing.kind == "link" and path in applied:
                resolved = os.path.realpath(os.path.join(os.fsencode(project),
                                                         os.fsencode(path)))
                assert resolved.startswith(os.fsencode(project) + b"/") or \
                    resolved == os.fsencode(project), (path, thing)
        assert list((top / "outside").iterdir()) == []
        assert (top / "host-secret").read_bytes() == SECRET
        assert not [p for p in project.iterdir() if p.name.startswith(".corral-apply")]

        assert fold(base, result.changes) == []
        assert not [p for p in top.iterdir() if p.name.startswith(".corral-apply")]
        again = changes(base, work, limits)
        assert {c.path for c in again} <= refused
    finally:
        for listener in sockets:
            listener.close()
