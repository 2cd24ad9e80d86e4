"""The workspace round trip on real files: copy in, change, diff, apply, conflicts."""

from __future__ import annotations

import os

import pytest

from appliance.workspace import Conflict, apply, changes, copy_in, fold, from_json, render, to_json


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


def round_trip(project, base, work, **options):
    """What `corral apply` does: changes on the appliance, applied on the host, folded back."""
    wire = [to_json(c) for c in changes(base, work)]
    applied = apply(project, [from_json(c) for c in wire], **options)
    fold(base, applied)
    return applied


def agent_edits(work):
    (work / "src" / "app.py").write_text("print('hello, world')\n")
    (work / "src" / "new.py").write_text("x = 1\n")
    (work / "gone.txt").unlink()
    (work / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    os.chmod(work / "run.sh", 0o755)


def test_copy_in_leaves_out_corral(dirs):
    _, work, base = dirs
    assert not (work / ".corral").exists() and not (base / ".corral").exists()
    assert (work / "src" / "app.py").read_text() == "print('hello')\n"
    assert changes(base, work) == []


def test_diff_shows_text_binary_mode_and_a_summary(dirs):
    _, work, base = dirs
    agent_edits(work)
    text = render(changes(base, work))
    assert "--- a/src/app.py\n+++ b/src/app.py\n" in text
    assert "-print('hello')\n+print('hello, world')\n" in text
    assert "--- /dev/null\n+++ b/src/new.py\n" in text and "+x = 1\n" in text
    assert "--- a/gone.txt\n+++ /dev/null\n" in text
    assert "added: blob.bin (binary file)" in text
    assert "mode: run.sh +x" in text
    assert text.endswith("2 added, 2 modified, 1 removed, 1 binary")


def test_apply_writes_the_changes_and_the_next_apply_is_empty(dirs):
    project, work, base = dirs
    agent_edits(work)
    applied = round_trip(project, base, work)
    assert {c.path for c in applied} == {"src/app.py", "src/new.py", "gone.txt", "blob.bin",
                                         "run.sh"}
    assert (project / "src" / "app.py").read_text() == "print('hello, world')\n"
    assert not (project / "gone.txt").exists()
    assert (project / "blob.bin").read_bytes() == b"\x00\x01\x02binary"
    assert os.stat(project / "run.sh").st_mode & 0o111
    assert (project / ".corral" / "client.key").read_text() == "secret"
    assert changes(base, work) == []
    assert round_trip(project, base, work) == []


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


def test_path_limits_what_is_applied(dirs):
    project, work, base = dirs
    agent_edits(work)
    applied = round_trip(project, base, work, paths=["src"])
    assert {c.path for c in applied} == {"src/app.py", "src/new.py"}
    assert (project / "gone.txt").exists()
    assert {c.path for c in changes(base, work)} == {"gone.txt", "blob.bin", "run.sh"}


def test_a_symlink_out_of_the_project_is_refused(dirs):
    project, work, base = dirs
    (work / "escape").symlink_to("/etc/passwd")
    (work / "inner").symlink_to("src/app.py")
    with pytest.raises(Conflict) as info:
        round_trip(project, base, work)
    assert info.value.refused == ["escape: symlink points out of the project (/etc/passwd)"]
    assert not (project / "inner").exists()  # all or nothing
    applied = round_trip(project, base, work, paths=["inner"])
    assert [c.path for c in applied] == ["inner"]
    assert os.readlink(project / "inner") == "src/app.py"


def test_no_write_goes_through_a_symlinked_directory_on_the_host(dirs, tmp_path):
    project, work, base = dirs
    outside = tmp_path / "outside"
    outside.mkdir()
    (project / "docs").symlink_to(outside)  # the host has a link the base does not know
    (work / "docs").mkdir()
    (work / "docs" / "x.md").write_text("planted\n")
    with pytest.raises(Conflict) as info:
        round_trip(project, base, work, force=True)
    assert "docs/x.md: a directory on the way is a symlink" in info.value.refused
    assert not (outside / "x.md").exists()


def test_a_changeset_from_the_network_cannot_name_a_path_outside():
    for path in ("../escape", "/etc/passwd", "a/../../b", "", "a//b"):
        with pytest.raises(ValueError, match="not a relative path"):
            from_json({"path": path, "action": "added", "before": None,
                       "after": {"kind": "file", "executable": False, "data": ""}})
    with pytest.raises(ValueError, match="base64"):
        from_json({"path": "x", "action": "added", "before": None,
                   "after": {"kind": "file", "executable": False, "data": "@@"}})
    with pytest.raises(ValueError, match="action"):
        from_json({"path": "x", "action": "moved", "before": None, "after": None})


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
    assert "pipe" not in found and found["linked-dir"].after.kind == "link"
    assert not any(p.startswith("linked-dir/") for p in found)


def test_fold_refuses_paths_through_a_symlinked_directory(dirs, tmp_path):
    _, _, base = dirs
    outside = tmp_path / "outside"
    outside.mkdir()
    (base / "docs").symlink_to(outside)
    change = from_json({"path": "docs/x.md", "action": "added", "before": None,
                        "after": {"kind": "file", "executable": False, "data": "eA=="}})
    with pytest.raises(ValueError, match="not a path inside"):
        fold(base, [change])
    assert not (outside / "x.md").exists()
