"""The workspace round trip on real files: copy in, change, diff, apply, conflicts, fold; and
one test for each kind of thing the agent can leave in /work to break review."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import socket
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

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
    remove_tree,
    render,
    review,
    show,
    take,
    to_json,
    unnamed,
)

ESC = "\x1b"


@pytest.fixture
def dirs(tmp_path):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "app.py").write_text("print('hello')\n")
    (project / "README").write_text("readme\n")
    (project / "gone.txt").write_text("delete me\n")
    (project / "run.sh").write_text("#!/bin/sh\n")
    (project / ".corral").mkdir()
    (project / ".corral" / "client.key").write_text("secret")
    work, base = tmp_path / "work", tmp_path / "base"
    copy_in(project, work, base)
    return project, work, base


LIMITS = Limits()


def over_the_wire(base, work, paths=None, limits=LIMITS):
    """What the service sends and the CLI reads: format 2 JSON, strict UTF-8 (no lone
    surrogates may survive into it)."""
    wire = [to_json(c) for c in carry(changes(base, work, limits), paths, limits)]
    text = json.dumps(wire, ensure_ascii=False).encode("utf-8")
    return [from_json(c) for c in json.loads(text)]


def round_trip(project, base, work, paths=None, force=False, limits=LIMITS):
    """What `corral apply` does: changes on the appliance, applied on the host, folded back."""
    applied = apply(project, over_the_wire(base, work, paths, limits), paths, force=force)
    assert fold(base, applied.changes) == []
    return applied


def agent_edits(work):
    (work / "src" / "app.py").write_text("print('hello, world')\n")
    (work / "src" / "new.py").write_text("x = 1\n")
    (work / "gone.txt").unlink()
    (work / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    os.chmod(work / "run.sh", 0o755)


def terminal_clean(text: str) -> bool:
    return all(ch == "\n" or ch == "\t" or ch.isprintable() for ch in text)


def test_copy_in_leaves_out_corral_and_what_the_agent_puts_there_stays_out(dirs):
    project, work, base = dirs
    assert not (work / ".corral").exists() and not (base / ".corral").exists()
    assert (work / "src" / "app.py").read_text() == "print('hello')\n"
    assert changes(base, work).changes == []
    (work / ".corral").mkdir()
    (work / ".corral" / "client.key").write_text("planted")
    found = changes(base, work)
    assert found.changes == [] and [n.path for n in found.notes] == [".corral"]
    assert "not shown: .corral: never carried" in render(found)
    round_trip(project, base, work)
    assert (project / ".corral" / "client.key").read_text() == "secret"


def test_diff_shows_text_binary_mode_and_a_summary(dirs):
    _, work, base = dirs
    agent_edits(work)
    text = render(changes(base, work))
    assert "--- a/src/app.py\n+++ b/src/app.py\n" in text
    assert "-print('hello')\n+print('hello, world')\n" in text
    assert "--- /dev/null\n+++ b/src/new.py\n" in text and "+x = 1\n" in text
    assert "--- a/gone.txt\n+++ /dev/null\n" in text
    assert "added: blob.bin (binary file, 9 bytes)" in text
    assert "mode: run.sh +x" in text
    assert text.endswith("2 added, 2 modified, 1 removed, 1 binary")


def test_apply_writes_the_changes_and_the_next_apply_is_empty(dirs):
    project, work, base = dirs
    agent_edits(work)
    applied = round_trip(project, base, work)
    assert {c.path for c in applied.changes} == {"src/app.py", "src/new.py", "gone.txt",
                                                 "blob.bin", "run.sh"}
    assert applied.refused == []
    assert (project / "src" / "app.py").read_text() == "print('hello, world')\n"
    assert not (project / "gone.txt").exists()
    assert (project / "blob.bin").read_bytes() == b"\x00\x01\x02binary"
    assert os.stat(project / "run.sh").st_mode & 0o111
    assert (project / ".corral" / "client.key").read_text() == "secret"
    assert not [p for p in project.iterdir() if p.name.startswith(".corral-apply")]
    assert changes(base, work).changes == []
    assert round_trip(project, base, work).changes == []


def test_a_host_edit_since_the_start_is_a_conflict_and_nothing_is_written(dirs):
    project, work, base = dirs
    agent_edits(work)
    (project / "src" / "app.py").write_text("print('the human was here')\n")
    with pytest.raises(Conflict) as info:
        round_trip(project, base, work)
    assert info.value.paths == ["src/app.py"]
    assert (project / "gone.txt").exists() and not (project / "src" / "new.py").exists()
    assert "changed on the host since the session started: src/app.py" in str(info.value)
    round_trip(project, base, work, force=True)
    assert (project / "src" / "app.py").read_text() == "print('hello, world')\n"


def test_an_apply_that_was_not_folded_finds_its_changes_in_place(dirs):
    """The fold (appliance side) can fail after the host wrote: the next apply is no
    conflict, it recognises what the host already holds and folds it."""
    project, work, base = dirs
    agent_edits(work)
    first = apply(project, over_the_wire(base, work))
    again = apply(project, over_the_wire(base, work))
    assert {c.path for c in again.changes} == {c.path for c in first.changes}
    assert fold(base, again.changes) == []
    assert changes(base, work).changes == []


def test_path_limits_what_is_applied(dirs):
    project, work, base = dirs
    agent_edits(work)
    applied = round_trip(project, base, work, paths=["src"])
    assert {c.path for c in applied.changes} == {"src/app.py", "src/new.py"}
    assert (project / "gone.txt").exists()
    assert {c.path for c in changes(base, work)} == {"gone.txt", "blob.bin", "run.sh"}


def test_a_symlink_out_of_the_project_is_refused_by_name_and_the_rest_applied(dirs):
    project, work, base = dirs
    (work / "escape").symlink_to("/etc/passwd")
    (work / "inner").symlink_to("src/app.py")
    (work / "up").symlink_to("../../outside")
    (work / "src" / "sideways").symlink_to("../README")
    applied = round_trip(project, base, work)
    assert [str(r) for r in applied.refused] == [
        "escape: symlink points out of the project (/etc/passwd)",
        "up: symlink points out of the project (../../outside)"]
    assert os.readlink(project / "inner") == "src/app.py"
    assert os.readlink(project / "src" / "sideways") == "../README"
    assert not (project / "escape").is_symlink() and not (project / "up").is_symlink()


def test_links_that_only_escape_through_other_links_are_refused(dirs):
    """`e` -> "." and `d` -> "e/../x" read as inside the project one by one, but together
    `d` leads out; `..` after a name is refused. A host link out is resolved."""
    project, work, base = dirs
    (project / "hostlink").symlink_to("/etc")
    (base / "hostlink").symlink_to("/etc")
    (work / "hostlink").symlink_to("/etc")
    (work / "e").symlink_to(".")
    (work / "d").symlink_to("e/../x")
    (work / "through").symlink_to("hostlink/passwd")
    refused = {r.path: r.reason for r in round_trip(project, base, work).refused}
    assert set(refused) == {"d", "through"}
    assert "'..' after a name" in refused["d"]
    assert "points out of the project" in refused["through"]
    assert os.readlink(project / "e") == "."


def test_no_write_goes_through_a_symlinked_directory_on_the_host(dirs, tmp_path):
    project, work, base = dirs
    outside = tmp_path / "outside"
    outside.mkdir()
    (project / "docs").symlink_to(outside)  # the host has a link the base does not know
    (work / "docs").mkdir()
    (work / "docs" / "x.md").write_text("planted\n")
    (work / "docs" / "y.md").write_text("planted\n")
    applied = round_trip(project, base, work, force=True)
    assert [str(r) for r in applied.refused] == [
        "docs/x.md: a directory on the way is a symlink on this host (docs)",
        "docs/y.md: a directory on the way is a symlink on this host (docs)"]
    assert list(outside.iterdir()) == []


def test_a_changeset_from_the_network_cannot_name_a_path_outside():
    entry = {"kind": "file", "executable": False, "size": 0,
             "digest": hashlib.sha256(b"").hexdigest(), "data": ""}
    for path in ("../escape", "/etc/passwd", "a/../../b", "", "a//b", ".corral/x"):
        with pytest.raises(ValueError, match=r"not a relative path|never carried"):
            from_json({"path": path, "action": "added", "before": None, "after": entry})
    with pytest.raises(ValueError, match="base64"):
        from_json({"path": "x", "action": "added", "before": None,
                   "after": {**entry, "data": "@@"}})
    with pytest.raises(ValueError, match="does not match"):
        from_json({"path": "x", "action": "added", "before": None,
                   "after": {**entry, "data": "eA=="}})
    with pytest.raises(ValueError, match="action"):
        from_json({"path": "x", "action": "moved", "before": None, "after": None})
    with pytest.raises(ValueError, match="needs after only"):
        from_json({"path": "x", "action": "added", "before": entry, "after": entry})
    with pytest.raises(ValueError, match="NUL"):
        from_json({"path_bytes": "eAB5", "action": "added", "before": None, "after": entry})


def test_what_the_agent_swaps_in_is_never_followed(dirs, tmp_path):
    _, work, base = dirs
    secret = tmp_path / "host-secret"
    secret.write_text("host only\n")
    (work / "src" / "app.py").unlink()
    (work / "src" / "app.py").symlink_to(secret)  # a file swapped for a link to the host
    os.mkfifo(work / "pipe")  # would block a naive reader forever
    (work / "linked-dir").symlink_to(tmp_path)
    found = {c.path: c for c in changes(base, work)}
    assert found["src/app.py"].after.kind == "link"
    assert b"host only" not in found["src/app.py"].after.data
    assert found["linked-dir"].after.kind == "link"
    assert not any(p.startswith("linked-dir/") for p in found)
    assert found["pipe"].after.kind == "other"
    assert "host only" not in render(changes(base, work))


def test_fold_refuses_paths_through_a_symlinked_directory(dirs, tmp_path):
    _, _, base = dirs
    outside = tmp_path / "outside"
    outside.mkdir()
    (base / "docs").symlink_to(outside)
    change = from_json({"path": "docs/x.md", "action": "added", "before": None,
                        "after": {"kind": "file", "executable": False, "size": 1,
                                  "digest": hashlib.sha256(b"x").hexdigest(), "data": "eA=="}})
    refused = fold(base, [change])
    assert [str(r) for r in refused] == [
        "docs/x.md: a directory on the way is a symlink on this host (docs)"]
    assert not (outside / "x.md").exists()


# -- content the diff used to choke on ------------------------------------------------------

def test_an_invalid_byte_after_the_first_8_kib_is_shown_and_applied(dirs):
    """The reported case: valid UTF-8 for 8 KiB, then 0xff."""
    project, work, base = dirs
    data = b"a" * 9000 + b"\xff\n"
    (work / "x").write_bytes(data)
    (work / "lines").write_bytes(b"a\n" * 4500 + b"\xff\n")
    (work / "README").write_bytes(b"readme\n" + b"b\n" * 4500 + b"\xfe\xff\n")
    text = render(changes(base, work))
    assert "+" + "a" * show.LINE_SHOWN + " [... 7002 more characters not shown]" in text
    assert "\n+\\xff\n" in text and "\n+\\xfe\\xff\n" in text
    assert terminal_clean(text)
    round_trip(project, base, work)
    assert (project / "x").read_bytes() == data


def test_a_nul_late_in_a_file_makes_it_binary_and_never_reaches_the_terminal(dirs):
    _, work, base = dirs
    (work / "late-nul").write_bytes(b"x" * 20000 + b"\0" + b"y\n")
    (work / "README").write_bytes(b"readme\n" + b"z" * 10000 + b"\0")
    text = render(changes(base, work))
    assert "added: late-nul (binary file, 20003 bytes)" in text
    assert "modified: README (text file, 7 bytes -> binary file, 10008 bytes)" in text
    assert "\0" not in text


def test_terminal_controls_in_contents_are_shown_escaped(dirs):
    _, work, base = dirs
    hostile = (f"ok{ESC}]0;owned\x07 {ESC}[2J\rhidden\u202eevil\u200b\x9b31m\x85"
               "\u2028tab\tstays\n")
    (work / "src" / "app.py").write_text(hostile)
    text = render(changes(base, work))
    assert terminal_clean(text), repr(text)
    assert "\\x1b]0;owned\\x07 \\x1b[2J\\rhidden\\u202eevil\\u200b\\x9b31m\\x85\\u2028tab\tstays" \
        in text
    assert "are shown as" in text


def test_cr_only_line_endings_and_huge_lines_are_shown_bounded(dirs):
    _, work, base = dirs
    (work / "mac.txt").write_bytes(b"one\rtwo\rthree\r")
    (work / "minified.js").write_bytes(b"x" * 100_000)
    text = render(changes(base, work))
    assert "+one\\rtwo\\rthree\\r\n\\ No newline at end of file" in text
    assert f"[... {100_000 - show.LINE_SHOWN} more characters not shown]" in text
    assert "minified.js: lines over" in text
    assert max(len(line) for line in text.split("\n")) < show.LINE_SHOWN + 100


def test_a_file_text_in_base_and_binary_in_work_and_back(dirs):
    project, work, base = dirs
    (work / "README").write_bytes(b"\0\1\2")
    (base / "blob").write_bytes(b"\0\1")
    (project / "blob").write_bytes(b"\0\1")
    (work / "blob").write_text("now text\n")
    text = render(changes(base, work))
    assert "modified: README (text file, 7 bytes -> binary file, 3 bytes)" in text
    assert "modified: blob (binary file, 2 bytes -> text file, 9 bytes)" in text
    round_trip(project, base, work)
    assert (project / "README").read_bytes() == b"\0\1\2"


def test_the_alignment_work_is_bounded(dirs, monkeypatch):
    """difflib costs up to cubic time on crafted input: only the differing middle is
    aligned, within a budget; past it the middle is shown as one replacement."""
    _, work, base = dirs
    calls = []
    real = show.difflib.SequenceMatcher

    def counting(*args, **kwargs):
        calls.append((len(args[1]), len(args[2])))
        return real(*args, **kwargs)

    monkeypatch.setattr(show.difflib, "SequenceMatcher", counting)
    periodic_a = "".join(f"{i % 101}\n" for i in range(5000))
    periodic_b = "".join(f"{(i * 7) % 101}\n" for i in range(5000))
    for i in range(12):
        (base / f"p{i}").write_text("same head\n" * 100 + periodic_a + "same tail\n" * 100)
        (work / f"p{i}").write_text("same head\n" * 100 + periodic_b + "same tail\n" * 100)
    (base / "small").write_text("a\nb\nc\n")
    (work / "small").write_text("a\nB\nc\n")
    text = render(changes(base, work))
    assert sum(a * b for a, b in calls) <= show.ALIGN_BUDGET
    assert all(a * b <= show.ALIGN_CELLS for a, b in calls)
    assert (1, 1) in calls  # the small file's middle was aligned; the head and tail were not
    assert "-b\n+B\n" in text and text.count("+++ b/p") == 12


# -- names ------------------------------------------------------------------------------------

def test_names_that_are_not_utf8_travel_byte_exact(dirs):
    project, work, base = dirs
    raw = b"caf\xe9-latin1"
    (work / os.fsdecode(raw)).write_bytes(b"data\n")
    (work / os.fsdecode(b"dir\xff")).mkdir()
    (work / os.fsdecode(b"dir\xff") / os.fsdecode(b"in\xfe")).write_bytes(b"inner\n")
    text = render(changes(base, work))
    assert '+++ "b/caf\\xe9-latin1"' in text and '+++ "b/dir\\xff/in\\xfe"' in text
    wire = [to_json(c) for c in carry(changes(base, work))]
    assert json.dumps(wire, ensure_ascii=False).encode("utf-8")  # no lone surrogate left
    assert {w["path"] for w in wire} == {'"caf\\xe9-latin1"', '"dir\\xff/in\\xfe"'}
    round_trip(project, base, work)
    assert Path(os.fsdecode(os.path.join(os.fsencode(project), raw))).read_bytes() == b"data\n"
    assert (project / os.fsdecode(b"dir\xff") / os.fsdecode(b"in\xfe")).read_bytes() == \
        b"inner\n"


def test_names_with_newlines_and_escapes_never_reach_the_terminal(dirs):
    project, work, base = dirs
    names = [f"evil{ESC}[2J", "two\nlines", "cr\rname", "bidi\u202etxt.exe", ' lead', 'q"uote',
             "back\\slash", "tab\tname"]
    for name in names:
        (work / name).write_text("x\n")
    os.symlink(f"target{ESC}[31m", work / "link")
    text = render(changes(base, work))
    assert terminal_clean(text) and "\t" not in text
    for shown_name in ['"evil\\x1b[2J"', '"two\\nlines"', '"cr\\rname"', '"bidi\\u202etxt.exe"',
                       '" lead"', '"q\\"uote"', '"back\\\\slash"', '"tab\\tname"']:
        assert f'+++ "b/{shown_name[1:]}' in text, shown_name
    assert 'added: link (symlink -> "target\\x1b[31m")' in text
    round_trip(project, base, work)
    assert sorted(os.listdir(project)) == sorted(
        [".corral", "README", "gone.txt", "run.sh", "src", "link", *names])


def test_very_long_paths_beyond_path_max_are_diffed_and_applied(dirs):
    project, work, base = dirs
    parts = ["d" * 250] * 20  # 5 KB: more than PATH_MAX, fine for one name at a time
    fd = os.open(work, os.O_RDONLY)
    for part in parts:
        os.mkdir(part, dir_fd=fd)
        fd, old = os.open(part, os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    os.write(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), b"deep\n")
    os.close(fd)
    found = changes(base, work)
    assert [c.path for c in found] == ["/".join([*parts, "f"])]
    assert "+deep" in render(found)
    round_trip(project, base, work)
    fd = os.open(project, os.O_RDONLY)
    for part in parts:
        fd, old = os.open(part, os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    assert os.read(os.open("f", os.O_RDONLY, dir_fd=fd), 100) == b"deep\n"


# -- sizes and counts -------------------------------------------------------------------------

def test_a_file_over_the_limit_is_shown_and_refused_by_name(dirs):
    project, work, base = dirs
    with open(work / "huge", "wb") as f:
        f.truncate(1 << 40)  # sparse: a TiB that costs nothing, and is never read
    (work / "fine.txt").write_text("fine\n")
    text = render(changes(base, work))
    assert "added: huge (too large: 1099511627776 bytes (1024.0 GiB; the limit is 32.0 MiB)" \
           ", not carried)" in text
    applied = round_trip(project, base, work)
    assert [c.path for c in applied.changes] == ["fine.txt"]
    assert [str(r) for r in applied.refused] == [
        "huge: not carried: too large: 1099511627776 bytes (1024.0 GiB; the limit is "
        "32.0 MiB)"]


def test_a_file_over_the_limit_on_both_sides_is_compared_by_size_and_time(dirs):
    """Never read: an equal size and modification time stand for "unchanged"; anything
    else is a change, shown and not carried."""
    project, work, base = dirs
    for root in (project, base, work):
        with open(root / "dataset", "wb") as f:
            f.truncate(40 << 20)
        os.utime(root / "dataset", ns=(10**18, 10**18))
    assert changes(base, work).changes == []
    with open(work / "dataset", "r+b") as f:
        f.write(b"changed")
    found = changes(base, work)
    assert [(c.path, c.action) for c in found] == [("dataset", "modified")]
    assert "modified: dataset (too large: 41943040 bytes" in render(found)
    assert "not carried" in render(found)


def test_over_the_total_limit_the_rest_is_held_back_for_the_next_apply(dirs):
    project, work, base = dirs
    limits = Limits(max_file=1000, max_carried=2500)
    for i in range(5):
        (work / f"f{i}").write_bytes(bytes([65 + i]) * 1000)
    first = round_trip(project, base, work, limits=limits)
    assert [c.path for c in first.changes] == ["f0", "f1"]
    assert all("held back" in r.reason for r in first.refused) and len(first.refused) == 3
    second = round_trip(project, base, work, limits=limits)
    assert [c.path for c in second.changes] == ["f2", "f3"]
    third = round_trip(project, base, work, limits=limits)
    assert [c.path for c in third.changes] == ["f4"] and third.refused == []
    assert changes(base, work).changes == []


def test_a_directory_with_too_many_entries_is_noted_and_nothing_under_it_removed(dirs):
    _, work, base = dirs
    (work / "many").mkdir()
    for i in range(30):
        (work / "many" / str(i)).write_text("x")
    (work / "src" / "app.py").unlink()
    limits = Limits(max_listing=20)
    found = changes(base, work, limits)
    assert [c.path for c in found] == ["src/app.py"]
    assert [(n.path, n.text) for n in found.notes] == [
        ("many", "directory has more than 20 entries: not shown or carried"),
        ("src", "empty directory: not carried (only files and links are)")]
    assert "not shown: many: directory has more than 20 entries" in render(found)


def test_the_walk_stops_when_names_add_up_and_says_where(dirs):
    """255-byte names 128 levels deep are 32 KiB a path: 200k of them would be 6 GB."""
    _, work, base = dirs
    long = work / ("n" * 255) / ("m" * 255)
    long.mkdir(parents=True)
    for i in range(40):
        (long / f"{i:03d}{'x' * 250}").write_text("x")
    found = changes(base, work, Limits(max_names=8000))
    assert 10 <= len(found) <= 16
    assert "the walk stopped here (8000 bytes of names)" in found.notes[-1].text
    assert sum(len(c.path) for c in found) <= 8000 + len(found.changes[-1].path)


def test_showing_reads_at_most_its_budget(dirs, monkeypatch):
    """One text file hard-linked many times costs one read budget, not one read each."""
    _, work, base = dirs
    (work / "one").write_bytes(b"line\n" * 40_000)
    for i in range(20):
        os.link(work / "one", work / f"link{i:02d}")
    monkeypatch.setattr(show, "READ_LIMIT", 1_000_000)
    monkeypatch.setattr(show, "RENDER_LIMIT", 1 << 30)
    reads = []
    real = show.Reader.read
    monkeypatch.setattr(show.Reader, "read", lambda self, *a: reads.append(a) or real(self, *a))
    text = render(changes(base, work))
    assert len(reads) == 5  # 200 kB each: the fifth crosses the budget, the rest is not read
    assert text.count("+++ b/link") == 5
    assert "added: link05 (file, 200000 bytes; diff not shown" in text
    assert "added: one (file, 200000 bytes; diff not shown: the diff read 976.6 KiB already)" \
        in text


def test_the_walk_stops_at_the_change_limit_and_says_where(dirs):
    _, work, base = dirs
    for i in range(10):
        (work / f"n{i}").write_text("x")
    (work / "src" / "app.py").unlink()
    found = changes(base, work, Limits(max_changes=4))
    assert len(found) == 4
    assert len(found.notes) == 1 and "the walk stopped here (4 changes)" in found.notes[0].text
    assert "gone.txt" not in {c.path for c in found}  # what it did not reach: not a removal


# -- types and modes --------------------------------------------------------------------------

def test_devices_are_shown_and_never_read(dirs):
    project, work, base = dirs
    try:  # /dev/zero never ends, /dev/random may block: neither is ever opened
        os.mknod(work / "zero", stat.S_IFCHR | 0o666, os.makedev(1, 5))
        os.mknod(work / "random", stat.S_IFCHR | 0o666, os.makedev(1, 8))
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD (the sandbox has none; this host neither)")
    text = render(changes(base, work))
    for device in ("random", "zero"):
        assert f"added: {device} (not a regular file: character device, not carried)" in text
    assert {r.path for r in round_trip(project, base, work).refused} == {"random", "zero"}


def test_fifos_sockets_loops_and_hard_links(dirs, tmp_path):
    project, work, base = dirs
    os.mkfifo(work / "fifo")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(work / "sock"))
    os.symlink("loop-b", work / "loop-a")
    os.symlink("loop-a", work / "loop-b")
    os.symlink("self", work / "self")
    os.link(work / "README", work / "hard")
    try:
        text = render(changes(base, work))
        assert "added: fifo (not a regular file: fifo, not carried)" in text
        assert "added: sock (not a regular file: socket, not carried)" in text
        assert "added: loop-a (symlink -> loop-b)" in text
        assert "+++ b/hard" in text and "+readme" in text
        applied = round_trip(project, base, work)
    finally:
        listener.close()
    assert {r.path for r in applied.refused} == {"fifo", "sock"}
    assert os.readlink(project / "self") == "self"
    assert (project / "hard").read_text() == "readme\n"


def test_directories_replaced_by_files_and_back(dirs):
    project, work, base = dirs
    for root in (project, base, work):
        (root / "tree" / "deeper").mkdir(parents=True)
        (root / "tree" / "deeper" / "leaf").write_text("leaf\n")
        (root / "tree" / "top").write_text("top\n")
        (root / "was-file").write_text("file\n")
    remove_tree(work / "tree")
    (work / "tree").write_text("a file now\n")
    (work / "was-file").unlink()
    (work / "was-file").mkdir()
    (work / "was-file" / "inside").write_text("inside\n")
    text = render(changes(base, work))
    assert "--- a/tree/deeper/leaf" in text and "+++ b/tree\n" in text
    round_trip(project, base, work)
    assert (project / "tree").read_text() == "a file now\n"
    assert (project / "was-file" / "inside").read_text() == "inside\n"
    assert changes(base, work).changes == []
    # and back
    (work / "tree").unlink()
    (work / "tree" / "again").mkdir(parents=True)
    (work / "tree" / "again" / "x").write_text("x\n")
    remove_tree(work / "was-file")
    (work / "was-file").symlink_to("tree")
    round_trip(project, base, work)
    assert (project / "tree" / "again" / "x").read_text() == "x\n"
    assert os.readlink(project / "was-file") == "tree"


def test_directories_emptied_by_removals_go_too(dirs):
    """As in git: the host keeps no empty directories behind the agent's removals (an
    empty directory the agent keeps is a note, never carried)."""
    project, work, base = dirs
    for root in (project, base, work):
        (root / "d" / "e" / "f").mkdir(parents=True)
        (root / "d" / "e" / "f" / "only").write_text("x\n")
        (root / "d" / "keep").write_text("x\n")
    (work / "d" / "e" / "f" / "only").unlink()
    (work / "d" / "keep").unlink()
    remove_tree(work / "d")
    round_trip(project, base, work)
    assert not (project / "d").exists() and not (base / "d").exists()
    assert (project / "src").is_dir()


def test_a_host_directory_holding_files_the_change_does_not_remove_is_not_replaced(dirs):
    project, work, base = dirs
    for root in (project, base, work):
        (root / "d").mkdir()
        (root / "d" / "known").write_text("known\n")
    (project / "d" / "mine").write_text("the person's own\n")
    remove_tree(work / "d")
    (work / "d").write_text("file\n")
    applied = round_trip(project, base, work)
    assert [str(r) for r in applied.refused] == [
        "d: a directory on this host is in the way, holding d/mine, which this change does "
        "not remove"]
    assert (project / "d" / "mine").read_text() == "the person's own\n"
    assert not (project / "d" / "known").exists()  # its own removal is still applied


def test_empty_directories_are_noted(dirs):
    _, work, base = dirs
    (base / "was-empty").mkdir()
    (work / "new-empty" / "nested").mkdir(parents=True)
    found = changes(base, work)
    assert found.changes == []
    assert sorted((n.path, n.text.split(":")[0]) for n in found.notes) == [
        ("new-empty/nested", "empty directory"), ("was-empty", "empty directory removed")]


def test_mode_000_files_and_directories_are_read_as_root(dirs):
    if os.geteuid() != 0:
        pytest.skip("needs root: the service reads as root")
    project, work, base = dirs
    (work / "locked").mkdir()
    (work / "locked" / "f").write_text("in a locked dir\n")
    (work / "src" / "app.py").write_text("locked file\n")
    os.chmod(work / "src" / "app.py", 0)
    os.chmod(work / "locked", 0)
    applied = round_trip(project, base, work)
    assert {c.path for c in applied.changes} == {"locked/f", "src/app.py"}
    assert (project / "src" / "app.py").read_text() == "locked file\n"


def in_child(run):
    """`run()` in a forked child (which may drop privileges or descriptors); its JSON."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            os.write(write, json.dumps(run()).encode())
            os._exit(0)
        except BaseException as exc:
            os.write(write, json.dumps({"child failed": repr(exc)}).encode())
            os._exit(1)
    os.close(write)
    with os.fdopen(read, "rb") as stream:
        answer = json.loads(stream.read())
    _, status = os.waitpid(pid, 0)
    assert status == 0, answer
    return answer


def test_unreadable_files_and_directories_become_notes_not_errors():
    """What the reader cannot open (here: a reader that is not root) is named, never an
    error that stops the diff."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the reader as another user")
    top = Path(tempfile.mkdtemp(prefix="corral-unreadable-"))  # pytest's tmp is root-only
    try:
        os.chmod(top, 0o755)
        (top / "project" / "src").mkdir(parents=True)
        (top / "project" / "src" / "app.py").write_text("hello\n")
        work, base = top / "work", top / "base"
        copy_in(top / "project", work, base)
        (work / "locked").mkdir()
        (work / "locked" / "f").write_text("x\n")
        (work / "secret").write_text("x\n")
        (work / "src" / "app.py").write_text("changed\n")
        for path in (work, base, *work.rglob("*"), *base.rglob("*")):
            os.chown(path, 65534, 65534, follow_symlinks=False)
        os.chmod(work / "locked", 0)
        os.chmod(work / "secret", 0)
        os.chown(work / "secret", 0, 0)
        (top / "gone").mkdir(mode=0o700)  # a workspace the reader cannot enter at all

        def as_nobody():
            os.setgid(65534)
            os.setuid(65534)
            found = changes(base, work)
            unopenable = changes(top / "gone" / "base", work)
            return [render(found), [to_json(c) for c in carry(found)], render(unopenable)]

        text, wire, unopenable = in_child(as_nobody)
    finally:
        remove_tree(top)
    assert "not shown: locked: directory unreadable: Permission denied" in text
    assert "added: secret (unreadable: Permission denied" in text
    notes = {w["path"]: w["after"].get("note") for w in wire}
    assert notes["secret"] == "unreadable: Permission denied" and notes["src/app.py"] is None
    assert "base/ cannot be opened: Permission denied: nothing compared" in unopenable


def test_a_deep_tree_is_walked_with_few_descriptors_and_noted_past_the_limit(dirs):
    """os.fwalk recursed and kept a descriptor per level: RecursionError or EMFILE. Here a
    tree deeper than the limit, walked by a process allowed 64 descriptors."""
    _, work, base = dirs
    fd = os.open(work, os.O_RDONLY)
    for _ in range(300):
        os.mkdir("d", dir_fd=fd)
        fd, old = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.close(fd)
    (work / "d" / "shallow").write_text("x\n")
    def with_64_descriptors():
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        found = changes(base, work, Limits(max_depth=20))
        return [[c.path for c in found], [n.path for n in found.notes], render(found)]

    paths, notes, text = in_child(with_64_descriptors)
    assert paths == ["d/shallow"]
    assert notes == ["/".join(["d"] * 21)] and "deeper than 20 levels" in text


def test_remove_tree_takes_apart_what_shutil_cannot(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)
    os.mkdir("top", dir_fd=fd)
    fd, old = os.open("top", os.O_RDONLY, dir_fd=fd), fd
    os.close(old)
    for i in range(1100):  # shutil.rmtree: RecursionError from about 1000
        os.mkdir("d", dir_fd=fd)
        if i % 100 == 0:
            os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
            os.symlink("/etc", "l", dir_fd=fd)
        fd, old = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    os.close(fd)
    remove_tree(tmp_path / "top")
    assert not (tmp_path / "top").exists()
    assert Path("/etc/passwd").exists()


# -- apply: all or nothing for what it writes -------------------------------------------------

def snapshot(root: Path) -> dict[bytes, tuple]:
    out = {}
    for directory, dirs, files in os.walk(os.fsencode(root)):
        for name in dirs + files:
            path = os.path.join(directory, name)
            info = os.lstat(path)
            data = os.readlink(path) if os.path.islink(path) else \
                Path(os.fsdecode(path)).read_bytes() if os.path.isfile(path) else b"dir"
            out[os.path.relpath(path, os.fsencode(root))] = (info.st_mode, data)
    return out


def test_an_interrupted_apply_puts_everything_back(dirs, monkeypatch):
    project, work, base = dirs
    agent_edits(work)
    remove_tree(work / "src")
    (work / "src").write_text("src is a file now\n")
    before = snapshot(project)
    wire = over_the_wire(base, work)
    real, calls = os.rename, []

    def interrupted(at):
        def rename(*args, **kwargs):
            calls.append(args)
            if len(calls) == at:
                raise KeyboardInterrupt
            return real(*args, **kwargs)
        return rename

    for stop in range(1, 100):  # Ctrl-C at every step in turn: the project is as it was
        calls.clear()
        monkeypatch.setattr(os, "rename", interrupted(stop))
        try:
            apply(project, wire)
        except KeyboardInterrupt:
            monkeypatch.setattr(os, "rename", real)
            assert snapshot(project) == before, stop
            assert not [p for p in project.iterdir() if p.name.startswith(".corral-apply")]
            continue
        break
    monkeypatch.setattr(os, "rename", real)
    assert stop > 6  # it did get interrupted at every step of a real apply
    assert (project / "src").read_text() == "src is a file now\n"


def test_a_change_this_host_cannot_write_is_refused_by_name_and_the_rest_written(dirs):
    project, work, base = dirs
    (work / "src" / "app.py").write_text("changed\n")
    (work / "src" / "new.py").write_text("new\n")
    (work / "README").write_text("changed too\n")
    locked = subprocess.run(["chattr", "+i", str(project / "src")], capture_output=True)
    if locked.returncode:
        pytest.skip(f"chattr +i is not possible here: {locked.stderr.decode().strip()}")
    try:
        applied = apply(project, over_the_wire(base, work))
    finally:
        subprocess.run(["chattr", "-i", str(project / "src")], check=True)
    assert [c.path for c in applied.changes] == ["README"]
    assert sorted(r.path for r in applied.refused) == ["src/app.py", "src/new.py"]
    assert all("cannot be written on this host" in r.reason for r in applied.refused)
    assert (project / "src" / "app.py").read_text() == "print('hello')\n"
    assert (project / "README").read_text() == "changed too\n"
    assert not [p for p in project.iterdir() if p.name.startswith(".corral-apply")]


def test_review_says_how_each_change_was_shown(dirs):
    _, work, base = dirs
    agent_edits(work)
    os.mkfifo(work / "fifo")
    _, shown_changes = review(changes(base, work))
    assert {s.change.path: (s.binary, s.change.note) for s in shown_changes} == {
        "blob.bin": (True, ""), "fifo": (False, "not a regular file: fifo"),
        "gone.txt": (False, ""), "run.sh": (False, ""), "src/app.py": (False, ""),
        "src/new.py": (False, "")}


def test_the_diff_answer_names_every_file_the_review_probe_writes(dirs):
    """The selftest's review probe (appliance/selftest/review.py `hostile_tree`) writes these and
    checks the service's `diff` answer with `unnamed`: a name that is not UTF-8 comes back
    from `path_bytes`, a file below the depth limit is named by the note on its directory."""
    _, work, base = dirs
    root = os.path.join(os.fsencode(work), b"corral-selftest-review")
    os.mkdir(root)
    made = [b"late-invalid-utf8.txt", b"name-\xff\xfe-not-utf8.txt",
            b"newline\nand-\x1b[31mansi-escape\x1b[0m.txt", b"hardlink-target.txt"]
    for name in made:
        Path(os.fsdecode(os.path.join(root, name))).write_bytes(b"a" * 9000 + b"\xff\n")
    os.link(os.path.join(root, made[-1]), os.path.join(root, b"hardlink.txt"))
    os.mkfifo(os.path.join(root, b"fifo"))
    for name, target in ((b"loop-a", b"loop-b"), (b"loop-b", b"loop-a"), (b"self", b"self")):
        os.symlink(target, os.path.join(root, name))
    deep = os.path.join(b"deep", *[b"d"] * 199)
    os.makedirs(os.path.join(root, deep))
    Path(os.fsdecode(os.path.join(root, deep, b"bottom.txt"))).write_text("200 down\n")
    made += [b"hardlink.txt", b"fifo", b"loop-a", b"loop-b", b"self",
             os.path.join(deep, b"bottom.txt")]
    paths = [os.fsdecode(os.path.join(b"corral-selftest-review", name)) for name in made]
    answer = diff_answer(take(changes(base, work)), base)
    json.dumps(answer, ensure_ascii=False).encode("utf-8")  # sendable, valid Unicode
    assert unnamed(answer, paths) == []
    assert unnamed(answer, ["corral-selftest-review/never-written"]) == [
        "corral-selftest-review/never-written"]
    assert unnamed({"changes": [{"path": "a/b"}], "notes": [{"path": "d"}]},
                   ["a/b", "d/e/f", "a/bc", "dd/x"]) == ["a/bc", "dd/x"]


def test_what_would_have_git_run_a_command_on_the_host_is_refused_by_name(dirs):
    """The agent writes /work/.git (and any nested repository's) as it likes; applied on the
    host, a hook runs at the person's next commit or checkout, and `core.fsmonitor` (or
    core.hooksPath, core.sshCommand, a filter driver) in a config at their next `git
    status`, which a shell prompt runs on its own. Those are refused by name, whatever
    else the agent did to the repository is applied."""
    project, work, base = dirs
    for root in (project, work, base):
        (root / ".git" / "hooks").mkdir(parents=True)
        (root / ".git" / "refs" / "heads").mkdir(parents=True)
        (root / ".git" / "config").write_text("[core]\n\tbare = false\n")
    (work / ".git" / "config").write_text("[core]\n\tfsmonitor = touch /tmp/owned\n")
    (work / ".git" / "config.worktree").write_text("[core]\n\thooksPath = /tmp\n")
    (work / ".git" / "hooks" / "post-checkout").write_text("#!/bin/sh\ntouch /tmp/owned\n")
    (work / ".git" / "modules" / "lib" / "hooks").mkdir(parents=True)
    (work / ".git" / "modules" / "lib" / "config").write_text("[core]\n\tfsmonitor = x\n")
    (work / ".git" / "modules" / "lib" / "hooks" / "pre-commit").write_text("#!/bin/sh\n")
    (work / "vendor" / "tool" / ".git").mkdir(parents=True)  # a repository of its own
    (work / "vendor" / "tool" / ".git" / "config").write_text("[core]\n\tfsmonitor = x\n")
    (work / "sub").mkdir()
    (work / "sub" / ".git").write_text("gitdir: ../evil\n")  # points git elsewhere
    (work / ".git" / "modules" / "refs").mkdir()  # a submodule named like git's data
    (work / ".git" / "modules" / "refs" / "config").write_text("[core]\n\tfsmonitor = x\n")
    (work / ".git" / "refs" / "heads" / "main").write_text("0" * 40 + "\n")  # a branch
    (work / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    applied = round_trip(project, base, work)
    refused = sorted(r.path for r in applied.refused)
    assert refused == [".git/config", ".git/config.worktree",
                       ".git/hooks/post-checkout", ".git/modules/lib/config",
                       ".git/modules/lib/hooks/pre-commit", ".git/modules/refs/config",
                       "sub/.git",
                       "vendor/tool/.git/config"], refused
    assert all("git" in r.reason and "host" in r.reason for r in applied.refused)
    assert (project / ".git" / "config").read_text() == "[core]\n\tbare = false\n"
    assert not (project / ".git" / "hooks" / "post-checkout").exists()
    assert (project / ".git" / "refs" / "heads" / "main").is_file()  # a branch: applied
    assert (project / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n"
    assert (project / "README").read_text() == "readme\n"
