"""Property tests: whatever the agent leaves in /work, diff and apply answer.

Hostile workspaces are generated (tests/unit/workspace_hostile.py): bytes at random offsets,
names that are not UTF-8 or hold newlines and escapes, names of 255 bytes, deep trees, big
directories, sparse huge files, FIFOs, sockets, symlinks anywhere (loops, out, long), hard
links, modes 000 and set-uid; a thread rewrites the tree while the diff reads it. The heavy
variants (more examples, deeper and bigger trees) are in tests/slow."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import threading
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings

from appliance.workspace import Conflict, apply, carry, changes, copy_in, from_json, review, to_json

from .workspace_hostile import (
    SECRET,
    agent_ops,
    check_diff_and_apply,
    project_ops,
    terminal_clean,
    write_file,
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow,
                                                   HealthCheck.data_too_large])
@given(project_script=project_ops, agent_script=agent_ops)
@example(project_script=[], agent_script=[("touch", [b"big"]), ("remove", [b"docs", b"readme"]),
                                          ("same size", [b"src", b"app.py"]),
                                          ("chmod", [b"run.sh"], 0o644),
                                          ("to dir", [b"bin.dat"]), ("remove", [b"a"])])
@example(project_script=[], agent_script=[("write", [b"x"], b"a" * 9000 + b"\xff\n"),
                                          ("link", [b"docs"], b"../../host-secret"),
                                          ("fifo", [b"src", b"app.py"]), ("deep", [b"a"], 12),
                                          ("many", [b"src"], 50)])
def test_whatever_the_agent_leaves_diff_and_apply_answer(project_script, agent_script):
    top = Path(tempfile.mkdtemp(prefix="corral-hostile-"))
    try:
        check_diff_and_apply(top, project_script, agent_script)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def mutate(work: Path, stop: threading.Event, seed: int, counter: list[int]) -> None:
    """The agent, racing the reader: files rewritten, swapped for links (to a host secret),
    FIFOs and directories, directories swapped for links and files, trees moved around."""
    rng = random.Random(seed)
    names = [b"a", b"b", b"c", b"\xff", b"d1", b"d2"]
    root = os.fsencode(work)
    secret = os.fsencode(work.parent / "host-secret")
    while not stop.is_set():
        counter[0] += 1
        parts = [rng.choice(names) for _ in range(rng.randint(1, 3))]
        path = os.path.join(root, *parts)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            kind = rng.randrange(9)
            if os.path.isdir(path) and not os.path.islink(path) and kind < 6:
                if rng.random() < 0.5:
                    shutil.rmtree(path)
                else:
                    os.rename(path, os.path.join(root, rng.choice(names) + b"-moved"))
                continue
            if os.path.lexists(path) and not os.path.isdir(path):
                os.unlink(path)
            if kind in (0, 1):
                write_file(path, rng.randbytes(rng.randint(0, 70_000)))
            elif kind == 2:
                os.symlink(secret, path)
            elif kind == 3:
                os.symlink(os.path.dirname(secret), path)
            elif kind == 4:
                os.mkfifo(path)
            elif kind == 5:
                os.makedirs(path, exist_ok=True)
                write_file(os.path.join(path, b"f"), b"x" * rng.randint(0, 10))
            elif kind == 6:
                write_file(path, b"", size=1 << 40)
            elif kind == 7:
                os.chmod(os.path.dirname(path), rng.choice([0, 0o755]))
            else:
                write_file(path, b"\xff\x1b[2J\0" * rng.randint(1, 100), append=True)
        except OSError:
            pass


def test_a_tree_changing_under_the_reader_never_breaks_diff_or_apply():
    top = Path(tempfile.mkdtemp(prefix="corral-race-"))
    stop, counter = threading.Event(), [0]
    try:
        (top / "host-secret").write_bytes(SECRET)
        project = top / "project"
        (project / "a").mkdir(parents=True)
        (project / "a" / "b").write_text("b\n")
        (project / "c").write_text("c\n")
        copy_in(project, top / "work", top / "base")
        threads = [threading.Thread(target=mutate, args=(top / "work", stop, seed, counter))
                   for seed in (1, 2)]
        for thread in threads:
            thread.start()
        rounds = 0
        try:
            while rounds < 25 or counter[0] < 500:
                rounds += 1
                found = changes(top / "base", top / "work")
                text, _ = review(found)
                assert terminal_clean(text) and SECRET.decode() not in text
                wire = json.dumps([to_json(c) for c in carry(found)], ensure_ascii=False)
                assert SECRET.decode() not in wire
                host = top / f"host-{rounds}"
                shutil.copytree(project, host, symlinks=True)
                try:
                    result = apply(host, [from_json(c) for c in json.loads(wire)])
                except Conflict as exc:
                    raise AssertionError(f"a conflict on an untouched host: {exc}") from None
                assert {c.path for c in result.changes} | {r.path for r in result.refused} \
                    == {c.path for c in found}
                shutil.rmtree(host)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert counter[0] >= 500  # the tree really was changing meanwhile
    finally:
        stop.set()
        for path in (top / "work").rglob("*"):
            if path.is_dir() and not path.is_symlink():
                os.chmod(path, 0o755)
        shutil.rmtree(top, ignore_errors=True)
