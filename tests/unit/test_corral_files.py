"""corral_files (playbooks/action_plugins, playbooks/library): a role's files in one module
run, or in none. Run for real by ansible-playbook on this machine's local connection, into
a temporary directory, as the roles run it on an appliance."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_state_fact import fact_module

ROOT = Path(__file__).resolve().parents[2]


def _action_plugin():
    """The action plugin's module, loaded from its file (its pure half is tested here)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "corral_files_action", ROOT / "playbooks/action_plugins/corral_files.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


corral_files = _action_plugin()

ME = {"owner": pwd.getpwuid(os.getuid()).pw_name, "group": grp.getgrgid(os.getgid()).gr_name}


def entry(dest: Path, content: str, mode: str = "0640", **extra) -> dict:
    return {"dest": str(dest), "content": content, "mode": mode, **ME, **extra}


def seen(content: str, mode: str = "0640") -> dict:
    return {"sha256": hashlib.sha256(content.encode()).hexdigest(), "mode": mode, **ME}


def test_only_what_the_fact_does_not_show_current_is_sent(tmp_path):
    a, b, c = (entry(tmp_path / n, f"{n}\n") for n in "abc")
    facts = {"ansible_local": {"corral": {"files": {
        a["dest"]: seen("a\n"),                   # current
        b["dest"]: seen("b\n", mode="0644"),      # another mode
        c["dest"]: {"mode": "0640", **ME}}}}}     # no digest (a key's): compared remotely
    assert corral_files.pending([a, b, c], facts) == [b, c]
    assert corral_files.pending([a, b], {}) == [a, b]  # no fact: everything
    assert corral_files.pending([a], {"ansible_local": {"corral": "error loading fact"}}) == [a]


def _play(tmp_path: Path, files: list[dict], *args: str) -> subprocess.CompletedProcess:
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(f"here ansible_connection=local ansible_python_interpreter="
                         f"{sys.executable}\n")
    play = [{"hosts": "all", "gather_facts": False,
             "tasks": [{"name": "Write", "corral_files": {"files": files}}]}]
    (tmp_path / "play.yml").write_text(json.dumps(play))
    return subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory),
         str(tmp_path / "play.yml"), *args], capture_output=True, text=True, timeout=300,
        cwd=ROOT / "playbooks",
        env={"ANSIBLE_CONFIG": str(ROOT / "playbooks" / "ansible.cfg"), "HOME": str(tmp_path),
             "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "ANSIBLE_NOCOLOR": "1",
             "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-local"),
             "LANG": os.environ.get("LANG", "C.UTF-8")})


def _recap(result: subprocess.CompletedProcess) -> str:
    assert "PLAY RECAP" in result.stdout, result.stdout + result.stderr
    return result.stdout.split("PLAY RECAP")[1]


def test_files_are_written_with_their_mode_then_left_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    files = [entry(out / "one.toml", "one = 1\n"), entry(out / "two.conf", "two\n", "0600")]
    first = _play(tmp_path, files)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "changed=1" in _recap(first)
    assert (out / "one.toml").read_text() == "one = 1\n"
    assert stat.S_IMODE((out / "one.toml").stat().st_mode) == 0o640
    assert stat.S_IMODE((out / "two.conf").stat().st_mode) == 0o600
    again = _play(tmp_path, files)
    assert again.returncode == 0 and "changed=0" in _recap(again), again.stdout
    # and the state fact reads back exactly what the action compares: a second run on an
    # appliance sends nothing at all
    fact = fact_module(tmp_path)
    fact.FILES = (str(out) + "/*",)
    assert corral_files.pending(files, {"ansible_local": {"corral": {"files": fact.files()}}}) \
        == []
    (out / "two.conf").chmod(0o644)  # a mode changed by hand is put back
    mended = _play(tmp_path, files, "--diff")
    assert "changed=1" in _recap(mended), mended.stdout
    assert stat.S_IMODE((out / "two.conf").stat().st_mode) == 0o600


def test_a_file_its_validate_refuses_replaces_no_file_of_the_task(tmp_path):
    """Every new file is checked before any replaces its old one: otherwise the first would
    be in place, the task failed, its handler never notified, and the next run would find
    the file current and notify nothing either."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "unit.service").write_text("old unit\n")
    (out / "base.nft").write_text("old\n")
    refused = _play(tmp_path, [entry(out / "unit.service", "new unit\n"),
                               entry(out / "base.nft", "new\n", validate="grep -q old %s")])
    assert refused.returncode != 0
    assert "refused the new file" in refused.stdout, refused.stdout
    assert (out / "base.nft").read_text() == "old\n"
    assert (out / "unit.service").read_text() == "old unit\n"
    assert sorted(p.name for p in out.iterdir()) == ["base.nft", "unit.service"]  # no temp
    passed = _play(tmp_path, [entry(out / "base.nft", "new\n", validate="grep -q new %s")])
    assert passed.returncode == 0, passed.stdout
    assert (out / "base.nft").read_text() == "new\n"


@pytest.mark.parametrize(("files", "says"), [
    ([{"dest": "/tmp/x", "content": "x"}], "a list of {dest, content, mode, owner, group"),
    ("not a list", "a list of {dest, content, mode, owner, group"),
    ([{"dest": "/tmp/x", "content": "x", "mode": "0644", **ME, "validtae": "nft -c -f %s"}],
     "and nothing else"),
    ([{"dest": "/tmp/x", "content": "x", "mode": 420, **ME}], "mode must be a string"),
    ([{"dest": "/tmp/x", "content": "x", "mode": "644", **ME}], "is not an octal mode"),
    ([{"dest": "/tmp/x", "content": "x", "mode": "0644", "owner": "no-such-user-here",
       "group": ME["group"]}], "no such user or group"),
])
def test_a_malformed_list_is_refused_by_name(tmp_path, files, says):
    result = _play(tmp_path, files)
    assert result.returncode != 0 and says in result.stdout, result.stdout


def test_check_mode_writes_nothing_and_says_what_would_change(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = _play(tmp_path, [entry(out / "one.toml", "one\n")], "--check", "--diff")
    assert result.returncode == 0 and "changed=1" in _recap(result), result.stdout
    assert "+one" in result.stdout
    assert not (out / "one.toml").exists()
