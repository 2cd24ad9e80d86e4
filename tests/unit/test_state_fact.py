"""corral_base's state fact (ansible_local.corral) and the checks the roles make against it.

Under emulation each module costs seconds, so a task runs only where the fact shows the
appliance differs from what the task would make. A guard that compared less than its task
sets would skip a task that had work to do: each is held here to its task's mode, owner and
group, and the fact to reading them as the guards spell them."""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from appliance.sandbox import image
from cli import box
from tests.unit.test_roles import _tasks, render

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = "etc/ansible/facts.d/corral.fact.j2"
FILE_MODULES = ("ansible.builtin.template", "ansible.builtin.copy", "ansible.builtin.file")


def fact_module(tmp_path: Path, prefix: str = "/opt/corral") -> types.ModuleType:
    script = tmp_path / "corral.fact"
    script.write_text(box.fact_script(prefix))
    module = types.ModuleType("corral_fact")
    exec(compile(script.read_text(), str(script), "exec"), module.__dict__)
    return module


def test_the_box_bakes_the_fact_the_role_writes():
    """Byte for byte: otherwise the first provisioning of every box rewrites it."""
    assert box.fact_script("/opt/corral") == render("corral_base", TEMPLATE)
    assert box.fact_script("/srv/x") == render("corral_base", TEMPLATE,
                                               corral_base_prefix="/srv/x")


def test_the_fact_names_the_sandbox_image_the_appliance_builds(tmp_path):
    assert fact_module(tmp_path).SANDBOX_IMAGE == image.IMAGE


def test_files_are_read_as_the_guards_spell_them_and_keys_keep_no_digest(tmp_path):
    fact = fact_module(tmp_path)
    tree = tmp_path / "etc"
    (tree / "api").mkdir(parents=True)
    (tree / "filter.toml").write_text("[dns]\n")
    (tree / "filter.toml").chmod(0o640)
    (tree / "api/server.key").write_text("secret")
    (tree / "api/server.key").chmod(0o644)
    (tree / "link.toml").symlink_to(tree / "filter.toml")
    fact.FILES = (str(tree) + "/**",)
    fact.DIRECTORIES = (str(tree), str(tree / "api"), str(tmp_path / "absent"))
    fact.LINKS = (str(tree / "link.toml"), str(tree / "filter.toml"))
    me = {"owner": pwd.getpwuid(os.getuid()).pw_name, "group": grp.getgrgid(os.getgid()).gr_name}
    assert fact.files() == {
        str(tree / "filter.toml"): {"sha256": hashlib.sha256(b"[dns]\n").hexdigest(),
                                    "mode": "0640", **me},
        str(tree / "api/server.key"): {"mode": "0644", **me}}
    assert set(fact.directories()) == {str(tree), str(tree / "api")}
    assert fact.links() == {str(tree / "link.toml"): str(tree / "filter.toml")}


def test_the_whole_fact_is_json_and_leaves_out_what_it_cannot_read(tmp_path):
    """Run as Ansible runs it: JSON on stdout whatever this machine lacks (a reader that
    fails leaves its key out, so the tasks that need it run). The venv is absent: no
    archive is named, which no archive's digest equals."""
    script = tmp_path / "corral.fact"
    script.write_text(box.fact_script(str(tmp_path / "prefix")))
    done = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CONTAINERS_CONF": "/dev/null"})
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout)
    assert state["wheels"] == ""
    assert "python3" in state["packages"]
    assert state["users"]["root"]["group"] == "root" and "root" in state["groups"]


def _with_guards(items, outer: str = ""):
    """Each task with its `when` and its blocks' (a block's guard holds for its tasks)."""
    for task in items or []:
        when = f"{outer} {task.get('when', '')}"
        yield task, when
        for key in ("block", "rescue", "always"):
            yield from _with_guards(task.get(key), when)


def _file_tasks():
    for path in sorted((ROOT / "roles").glob("*/tasks/*.yml")):
        for task, when in _with_guards(yaml.safe_load(path.read_text())):
            if any(m in task for m in FILE_MODULES) and task.get("delegate_to") != "localhost":
                yield task, when


def _guarded_file_tasks():
    for task, when in _file_tasks():
        for module in FILE_MODULES:
            if module in task and any(f"ansible_local.corral.{kind}[" in when
                                      for kind in ("files", "directories", "links")):
                yield pytest.param(task[module], when, id=task["name"][:60])


def _files_entries():
    for path in sorted((ROOT / "roles").glob("*/tasks/*.yml")):
        for task in _tasks(yaml.safe_load(path.read_text())):
            for entry in (task.get("corral_files") or {}).get("files", []):
                yield pytest.param(entry, id=entry["dest"])


@pytest.mark.parametrize("entry", list(_files_entries()))
def test_each_file_corral_files_writes_names_what_the_fact_compares(entry):
    """The action compares digest, mode, owner and group with the fact: an entry has each,
    and its content is a template of the roles or, for the issued server side, a file."""
    assert {"dest", "content", "mode", "owner", "group"} <= set(entry), entry
    assert re.fullmatch(r"0[0-7]{3}", entry["mode"]), entry["mode"]
    src = re.fullmatch(r"\{\{ lookup\('ansible\.builtin\.template', '([^']+)'\) \}\}",
                       entry["content"])
    if src:
        assert list((ROOT / "roles").glob(f"*/templates/{src.group(1)}")), src.group(1)
    else:  # the server side, issued on the control machine: read as it is, newline and all
        assert "lookup('ansible.builtin.file'" in entry["content"], entry["content"]
        assert "rstrip=false" in entry["content"], entry["content"]


@pytest.mark.parametrize(("args", "when"), list(_guarded_file_tasks()))
def test_a_guard_compares_everything_its_task_sets(args, when):
    if args.get("state") == "link":
        assert f"!= '{args['src']}'" in when
        return
    for key in ("mode", "owner"):
        assert f"'{key}': '{args[key]}'" in when, (key, when)
    group = args["group"]
    wanted = f"'group': '{group}'" if "{{" not in group else \
        f"'group': {group.strip('{} ')}"
    assert wanted in when, (group, when)
    if args.get("state") != "directory":
        assert "hash('sha256')" in when, when


def test_every_file_task_of_the_roles_is_guarded_or_says_why_not():
    """A new task without a guard is only slow; this keeps the count honest."""
    unguarded = [task["name"] for task, when in _file_tasks()
                 if "ansible_local.corral" not in when]
    assert len(list(_files_entries())) == 15  # and corral_files checks its own
    # an image archive is copied (and compared by the copy) only when one is given
    assert unguarded == ["Copy the image archive"], unguarded
