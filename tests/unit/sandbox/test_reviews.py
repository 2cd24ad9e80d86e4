"""What was reviewed is what gets applied (THREATS 32), through the sandbox service's own
`diff` and `changes` requests over a real workspace on disk. podman cannot run in unit tests:
a recorder stands in for it (pause and unpause), never for the workspace under test."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from appliance import workspace
from appliance.sandbox.reviews import KEEP
from appliance.sandbox.service import SandboxConfig, Sessions
from appliance.sandbox.sessions import Record, SessionError, SessionManager


class Podman:
    """Answers pause/unpause as podman does (or fails them, when told), recording each."""

    def __init__(self, pause_fails: bool = False):
        self.calls: list[tuple[str, ...]] = []
        self.pause_fails = pause_fails

    def run(self, *args, check=True, **kwargs):
        self.calls.append(args)
        failed = self.pause_fails and args[0] == "pause"
        return SimpleNamespace(returncode=125 if failed else 0, stdout=b"",
                               stderr=b"Error: this container does not have a cgroup"
                               if failed else b"")


def _service(tmp_path, state="stopped", podman=None):
    podman = podman or Podman()
    manager = SessionManager(podman, lambda request: {"ok": True}, tmp_path / "state")
    manager._save(Record("s1", "10.213.9.0/24", "10.213.9.1", "corral-s1", "corral-s1",
                         "img", 0.0, state=state))
    work, base = manager.workspace("s1")
    for side in (work, base):
        side.mkdir(parents=True)
        (side / "app.py").write_text("print('v1')\n")
    return Sessions(SandboxConfig(), manager), work, podman


def _changes(service, digest) -> dict[str, bytes]:
    answer = service.answer({"op": "changes", "name": "s1", "digest": digest}, None)
    json.dumps(answer)
    return {c["path"]: workspace.from_json(c).after.data for c in answer["changes"]}


def test_apply_gets_the_bytes_the_diff_showed_not_what_the_agent_wrote_since(tmp_path):
    service, work, _ = _service(tmp_path)
    (work / "app.py").write_text("print('reviewed')\n")
    shown = service.answer({"op": "diff", "name": "s1"}, None)
    assert "+print('reviewed')" in shown["diff"]
    (work / "app.py").write_text("print('written after the diff')\n")
    (work / "extra.py").write_text("import os\n")
    assert _changes(service, shown["digest"]) == {"app.py": b"print('reviewed')\n"}


def test_notes_on_what_is_never_carried_do_not_stop_an_apply(tmp_path):
    """A `.corral/` the agent makes in /work is a note (never carried); its path is not a
    path apply could write, and the snapshot and the host still take the changeset."""
    service, work, _ = _service(tmp_path)
    (work / ".corral").mkdir()
    (work / ".corral" / "client.key").write_text("planted")
    (work / "app.py").write_text("print('v2')\n")
    shown = service.answer({"op": "diff", "name": "s1"}, None)
    assert [n["path"] for n in shown["notes"]] == [".corral"]
    answer = service.answer({"op": "changes", "name": "s1", "digest": shown["digest"]}, None)
    changes = [workspace.from_json(c) for c in answer["changes"]]
    workspace.verify(changes, [workspace.note_from(n) for n in answer["notes"]],
                     shown["digest"])


def test_a_digest_no_diff_showed_is_refused_naming_both_digests(tmp_path):
    service, work, _ = _service(tmp_path)
    (work / "app.py").write_text("print('v2')\n")
    unknown = "0" * 64
    with pytest.raises(SessionError) as refused:
        service.answer({"op": "changes", "name": "s1", "digest": unknown}, None)
    now = workspace.take(workspace.changes(*reversed(service.manager.workspace("s1"))))
    message = str(refused.value)
    assert unknown in message and now.digest in message and "corral diff s1" in message
    with pytest.raises(ValueError, match="64 hex digits"):
        service.answer({"op": "changes", "name": "s1", "digest": "../../etc/passwd"}, None)
    with pytest.raises(Exception, match="'digest' must name"):
        service.answer({"op": "changes", "name": "s1"}, None)


def test_the_last_diffs_are_kept_and_a_pruned_one_only_while_the_changes_are_the_same(
        tmp_path):
    service, work, _ = _service(tmp_path)
    digests = []
    for version in range(KEEP + 1):
        (work / "app.py").write_text(f"print({version})\n")
        digests.append(service.answer({"op": "diff", "name": "s1"}, None)["digest"])
    assert _changes(service, digests[1]) == {"app.py": b"print(1)\n"}  # kept
    with pytest.raises(SessionError, match="keeps the last"):
        _changes(service, digests[0])  # pruned, and the workspace has moved on
    (work / "app.py").write_text("print(0)\n")  # back to exactly what it was: the same digest
    assert _changes(service, digests[0]) == {"app.py": b"print(0)\n"}


def test_a_damaged_snapshot_is_refused_never_applied(tmp_path):
    service, work, _ = _service(tmp_path)
    (work / "app.py").write_text("print('v2')\n")
    digest = service.answer({"op": "diff", "name": "s1"}, None)["digest"]
    kept = service.manager.reviews("s1").directory / f"{digest}.json"
    data = json.loads(kept.read_text())
    data["changes"][0]["after"]["executable"] = True
    kept.write_text(json.dumps(data))
    with pytest.raises(SessionError, match="is damaged"):
        _changes(service, digest)


def test_a_running_session_is_paused_while_its_diff_is_read_and_resumed(tmp_path):
    service, work, podman = _service(tmp_path, state="running")
    (work / "app.py").write_text("print('v2')\n")
    answer = service.answer({"op": "diff", "name": "s1"}, None)
    assert podman.calls == [("pause", "corral-s1"), ("unpause", "corral-s1")]
    assert "not_paused" not in answer


def test_a_session_that_cannot_be_paused_is_still_shown_what_is_applied_and_told(tmp_path):
    service, work, podman = _service(tmp_path, state="running", podman=Podman(True))
    (work / "app.py").write_text("print('v2')\n")
    answer = service.answer({"op": "diff", "name": "s1"}, None)
    assert podman.calls == [("pause", "corral-s1")]
    assert "could not be paused" in answer["not_paused"]
    assert _changes(service, answer["digest"]) == {"app.py": b"print('v2')\n"}


def test_a_session_left_paused_by_a_diff_cut_short_is_resumed_at_reconcile(tmp_path):
    service, _, podman = _service(tmp_path, state="running")
    podman.json = lambda *args: [{"Names": ["corral-s1"], "State": "paused"}] \
        if args[0] == "ps" else []
    done = service.manager.reconcile()
    assert ("unpause", "corral-s1") in podman.calls and any("unpaused s1" in d for d in done)
    assert service.manager.get("s1").state == "running"
