"""The review group: files the session's diff must survive (T23). The probe only writes them
into the workspace and says which; the appliance (the sandbox service) then asks for the
session's diff, which must answer and name every one, and removes them again.
"""

from __future__ import annotations

import os
import shutil

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

