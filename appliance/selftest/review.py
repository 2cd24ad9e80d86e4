"""The review group. Files the session's diff must survive (T23): the probe only writes them
into the workspace and says which; the appliance (the sandbox service) then asks for the
session's diff, which must answer and name every one, and removes them again. A file the
agent changes after the diff (T32): the probe starts a process that keeps rewriting it; the
appliance takes the diff, waits until the file changed since, applies the diff's digest into
a scratch project and checks that what was written is what the diff showed.
"""

from __future__ import annotations

import os
import shutil
import sys

from .registry import NotRun, Outcome, probe

REVIEW_DIR = "corral-selftest-review"
DEPTH = 200


def hostile_tree(root: bytes) -> list[bytes]:
    """Write under `root` (made here) what an agent may leave for review; the names made,
    relative to `root`. The caller (the appliance) then asks for the session's diff."""
    os.mkdir(root)
    made = []

    def write(name: bytes, data: bytes) -> None:
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
        made.append(name)

    write(b"late-invalid-utf8.txt", b"a" * 9000 + b"\xff\n")  # valid for the first 8 KiB
    write(b"name-\xff\xfe-not-utf8.txt", b"a file whose name is not UTF-8\n")
    write(b"newline\nand-\x1b[31mansi-escape\x1b[0m.txt", b"a name that paints a terminal\n")
    os.mkfifo(os.path.join(root, b"fifo"))
    made.append(b"fifo")
    for name, target in ((b"loop-a", b"loop-b"), (b"loop-b", b"loop-a"),
                         (b"loop-self", b"loop-self")):
        os.symlink(target, os.path.join(root, name))
        made.append(name)
    deep = os.path.join(b"deep", *[b"d"] * (DEPTH - 1))
    os.makedirs(os.path.join(root, deep))
    write(os.path.join(deep, b"bottom.txt"), f"{DEPTH} levels down\n".encode())
    write(b"hardlink-target.txt", b"one inode, two names\n")
    os.link(os.path.join(root, b"hardlink-target.txt"), os.path.join(root, b"hardlink.txt"))
    made.append(b"hardlink.txt")
    return made


@probe("review-hostile-files", 23, group="review",
       records="review: the appliance asks for the session's diff, which must answer and name "
       "every file written")
def review_hostile_files(ctx):
    workdir = os.fsencode(ctx.args.workdir)
    root = os.path.join(workdir, REVIEW_DIR.encode())
    try:
        if os.path.lexists(root):
            shutil.rmtree(root)
        made = hostile_tree(root)
    except OSError as exc:
        shutil.rmtree(root, ignore_errors=True)  # half a tree must not reach anyone's review
        raise NotRun(f"cannot write the files in {ctx.args.workdir}: {exc}") from None
    paths = [os.fsdecode(os.path.join(REVIEW_DIR.encode(), name)) for name in made]
    return Outcome(True, f"wrote {len(paths)} entries under {ctx.args.workdir}/{REVIEW_DIR}",
                   {"kind": "review", "root": REVIEW_DIR, "paths": paths})



SNAPSHOT_DIR = "corral-selftest-snapshot"
CHANGING = f"{SNAPSHOT_DIR}/changing.txt"
WRITER_SECONDS = 120
"""How long the agent's writer goes on (it stops sooner once its directory is removed)."""
WRITER = r"""
import os, sys, time
path, until = sys.argv[1], time.monotonic() + float(sys.argv[2])
version = 0
while time.monotonic() < until and os.path.isdir(os.path.dirname(path)):
    version += 1
    line = b"version %d\n" % version
    with open(path, "wb") as f:  # truncated, then written in two steps
        f.write(line * 256)
        f.flush()
        f.write(line * 256)
    time.sleep(0.02)
"""


def start_writer(path: str, seconds: float = WRITER_SECONDS) -> int:
    """A process of the agent's that keeps rewriting `path`, detached from the battery (its
    own session, no terminal), so that it goes on after the battery has answered: while the
    appliance takes the diff and after. Returns its pid."""
    null = os.devnull
    return os.posix_spawn(sys.executable, [sys.executable, "-c", WRITER, path, str(seconds)],
                          dict(os.environ), setsid=True, file_actions=[
                              (os.POSIX_SPAWN_OPEN, 0, null, os.O_RDONLY, 0),
                              (os.POSIX_SPAWN_OPEN, 1, null, os.O_WRONLY, 0),
                              (os.POSIX_SPAWN_OPEN, 2, null, os.O_WRONLY, 0)])


@probe("review-changed-after-diff", 32, group="review",
       records="review: the appliance takes the session's diff while the agent's writer goes "
       "on changing a file; what is applied under the diff's digest must be what the diff "
       "showed, not what was written since")
def review_changed_after_diff(ctx):
    root = os.path.join(ctx.args.workdir, SNAPSHOT_DIR)
    path = os.path.join(ctx.args.workdir, CHANGING)
    try:
        if os.path.lexists(root):
            shutil.rmtree(root)
        os.mkdir(root)
        with open(path, "wb") as f:
            f.write(b"version 0\n")
        pid = start_writer(path)
    except OSError as exc:
        shutil.rmtree(root, ignore_errors=True)
        raise NotRun(f"cannot start a writer in {ctx.args.workdir}: {exc}") from None
    return Outcome(True, f"process {pid} rewrites {CHANGING} every 20 ms for "
                   f"{WRITER_SECONDS}s", {"kind": "review-snapshot", "root": SNAPSHOT_DIR,
                                          "path": CHANGING})
