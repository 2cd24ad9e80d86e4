"""Each role has an explicit interface (issue 27, item 7): it reads only its own variables
(its defaults, what its tasks register or set) and its inputs, declared in its
meta/argument_specs.yml without a default and passed by the playbooks from the roles that
own them; it notifies only handlers it has, and the topics other roles' handlers listen to
are declared by the role that sends them. So a role applied alone, to a host where its
inputs are given, works; this is proved with Ansible itself below, on this machine's
loopback connection, rendering into a temporary directory and changing nothing else."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jinja2
import jinja2.nodes
import pytest
import yaml

from cli import roles
from cli.box import every_task

ROOT = Path(__file__).resolve().parents[2]
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if p.is_dir())
PLAYBOOKS = ROOT / "playbooks"
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"

MAGIC = {"item", "inventory_hostname", "playbook_dir", "role_path", "hostvars", "groups",
         "group_names", "omit", "lookup", "query", "q", "now", "undef"}
"""Ansible's own names (and every `ansible_*` one): what a role may read besides its own."""
MAGIC |= {"loop", "range", "dict", "namespace", "lipsum", "cycler", "joiner", "caller"}
"""Jinja's own (`loop` in a for loop)."""
EXPRESSIONS = {"when", "changed_when", "failed_when", "until", "that"}
"""Task keys whose value is a bare Jinja expression, not a template."""


def _yaml(path: Path):
    return yaml.safe_load(path.read_text()) if path.exists() else None


def defaults(role: str) -> dict:
    return _yaml(ROOT / "roles" / role / "defaults" / "main.yml") or {}


def options(role: str) -> dict:
    return _yaml(ROOT / "roles" / role / "meta" / "argument_specs.yml")[
        "argument_specs"]["main"]["options"]


def inputs(role: str) -> set[str]:
    """What the role needs of others: declared in its argument specs, with no default."""
    return set(options(role)) - set(defaults(role))


def _names(template: str) -> set[str]:
    """The variables a template reads: names loaded and never set in it (Ansible's filters
    and tests are unknown to plain Jinja, so its AST is read, not compiled)."""
    # a regex's backslash, doubled: a string literal Jinja parses, which Ansible reads too
    tree = jinja2.Environment().parse(template.replace("\\", "\\\\"))
    names = list(tree.find_all(jinja2.nodes.Name))
    return {n.name for n in names if n.ctx == "load"} - {n.name for n in names
                                                          if n.ctx in ("store", "param")}


def _strings(value, key=None):
    """(key, string) of every string in a task's value, however deep."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v, key)
    elif isinstance(value, str):
        yield key, value


_tasks = every_task  # cli/box.py's: the box reads the roles' tasks the same way


def task_files(role: str) -> list[Path]:
    return sorted((ROOT / "roles" / role).glob("tasks/*.yml")) + sorted(
        (ROOT / "roles" / role).glob("handlers/*.yml"))


def referenced(role: str) -> dict[str, set[str]]:
    """Every variable the role reads -> where: its tasks and handlers (templated strings
    and bare expressions alike), its vars files and its templates."""
    found: dict[str, set[str]] = {}

    def add(names, where):
        for name in names:
            found.setdefault(name, set()).add(where)

    for path in task_files(role):
        where = str(path.relative_to(ROOT))
        for task in _tasks(_yaml(path)):
            for key, text in _strings({k: v for k, v in task.items()
                                       if k not in ("block", "rescue", "always")}):
                if key in EXPRESSIONS:
                    add(_names("{{ " + text + " }}"), where)
                elif "{{" in text or "{%" in text:
                    add(_names(text), where)
    for path in sorted((ROOT / "roles" / role).glob("vars/*.yml")):
        for _, text in _strings(_yaml(path)):
            add(_names(text), str(path.relative_to(ROOT)))
    for path in sorted((ROOT / "roles" / role / "templates").rglob("*.j2")):
        add(_names(path.read_text()), str(path.relative_to(ROOT)))
    return found


def set_by_the_role(role: str) -> set[str]:
    """What its own tasks define: registered results, task vars, facts, loop variables."""
    found = set()
    for path in task_files(role):
        for task in _tasks(_yaml(path)):
            found |= {task["register"]} if "register" in task else set()
            found |= set(task.get("vars") or {})
            found |= set(task.get("ansible.builtin.set_fact") or {})
            found |= {(task.get("loop_control") or {}).get("loop_var", "item")}
    return found


def test_the_reader_finds_variables_wherever_a_role_uses_them():
    """Else the test below could pass by reading nothing."""
    filter_reads, pki_reads = referenced("corral_filter"), referenced("corral_pki")
    assert "roles/corral_filter/templates/etc/corral/filter.toml.j2" in filter_reads[
        "corral_filter_interfaces"]  # a template
    assert "roles/corral_filter/tasks/main.yml" in filter_reads["corral_filter_prefix"]  # argv
    assert "corral_filter_resolved" in filter_reads  # a bare `when:` expression
    assert "corral_pki_rotate" in pki_reads and "corral_pki_server_dir" in pki_reads
    assert "corral_base_prefix" in referenced("corral_base")  # a handler's message
    assert "corral_pki_tmp" in set_by_the_role("corral_pki")  # registered in a block


@pytest.mark.parametrize("role", ROLES)
def test_a_role_reads_only_its_own_variables_and_its_declared_inputs(role):
    known = set(defaults(role)) | set(options(role)) | set_by_the_role(role)
    foreign = {name: sorted(where) for name, where in referenced(role).items()
               if name not in known and name not in MAGIC and not name.startswith("ansible_")}
    assert not foreign, (
        f"{role} reads variables that are neither its own nor declared inputs: {foreign}; "
        f"declare each as an input named {role}_* in roles/{role}/meta/argument_specs.yml "
        "and pass it in playbooks/site.yml")
    assert all(name.startswith(role + "_") for name in known - {"item"}), sorted(known)


@pytest.mark.parametrize("role", ROLES)
def test_an_input_is_required_and_has_no_default_in_the_role(role):
    """Applied alone without it, Ansible refuses the role by the input's name (below)."""
    for name in inputs(role):
        spec = options(role)[name]
        assert spec.get("required") is True and "default" not in spec, (role, name)
        assert spec["description"].startswith("Input: "), (role, name)


def _role_entries(playbook: str) -> list[dict]:
    return [entry for play in _yaml(PLAYBOOKS / playbook) for entry in play.get("roles", [])]


@pytest.mark.parametrize("playbook", ["site.yml", "rotate-certs.yml"])
def test_the_playbooks_pass_every_declared_input(playbook):
    entries = _role_entries(playbook)
    assert entries, playbook
    for entry in entries:
        role, given = entry["role"], set(entry.get("vars") or {})
        assert inputs(role) <= given, f"{playbook}: {role} misses {inputs(role) - given}"
        assert given <= set(options(role)), f"{playbook}: {role}: {given - set(options(role))}"


def test_site_yml_wires_each_input_from_a_variable_its_owner_defines():
    """An input comes from another role's own variable (a default of a role of the same
    play), never from an input of a third role nor from nowhere."""
    entries = _role_entries("site.yml")
    assert [e["role"] for e in entries] == ["corral_base", "corral_firewall", "corral_filter",
                                            "corral_sandbox", "corral_pki", "corral_api",
                                            "corral_manifest"]
    owned = {name: e["role"] for e in entries for name in defaults(e["role"])}
    wired = 0
    for entry in entries:
        for name, source in (entry.get("vars") or {}).items():
            sources = _names(source)
            assert sources and all(owned.get(s) not in (None, entry["role"]) for s in sources), (
                f"site.yml: {entry['role']}: {name} = {source!r}")
            wired += 1
    assert wired == sum(len(inputs(role)) for role in ROLES) == 17


def test_group_vars_set_owners_not_inputs():
    """site.yml's wiring outranks group_vars: an input set there would be silently lost."""
    knobs = set(_yaml(PLAYBOOKS / "group_vars" / "all.yml"))
    assert not knobs & set().union(*(inputs(role) for role in ROLES))


def _handlers(role: str) -> list[dict]:
    return _tasks(_yaml(ROOT / "roles" / role / "handlers" / "main.yml"))


def _listed(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def notified(role: str) -> set[str]:
    return {name for path in task_files(role) for task in _tasks(_yaml(path))
            for name in _listed(task.get("notify"))}


def answered(role: str) -> set[str]:
    return {name for handler in _handlers(role)
            for name in [handler["name"], *_listed(handler.get("listen"))]}


def declared_topics(role: str) -> set[str]:
    """The topics a role sends for others to listen to: its argument specs' description
    says "Notifies 'TOPIC' when ..."."""
    spec = _yaml(ROOT / "roles" / role / "meta" / "argument_specs.yml")["argument_specs"]["main"]
    return {topic for line in _listed(spec.get("description"))
            for topic in re.findall(r"Notifies '([^']+)'", line)}


@pytest.mark.parametrize("role", ROLES)
def test_a_role_notifies_only_handlers_it_has(role):
    """Ansible fails a run that notifies a handler nobody has: a role that notified
    another role's handler failed when applied alone."""
    missing = notified(role) - answered(role)
    assert not missing, f"{role} notifies {sorted(missing)}, which none of its handlers answers"


@pytest.mark.parametrize("role", ROLES)
def test_a_role_listens_only_to_its_own_notifications_or_declared_topics(role):
    topics = set().union(*(declared_topics(r) for r in ROLES if r != role))
    for handler in _handlers(role):
        for topic in _listed(handler.get("listen")):
            assert topic in notified(role) | topics, (
                f"{role}: handler {handler['name']!r} listens to {topic!r}, which no role "
                "declares (\"Notifies 'TOPIC' when ...\" in its argument specs' description)")
    for topic in declared_topics(role):  # a declaration is true
        assert topic in notified(role), f"{role} declares {topic!r} but never notifies it"


def test_the_topics_reach_the_handlers_that_ran_before_the_split():
    """The same handlers run on the same changes as when the roles notified each other's
    handlers by name: new code restarts the three services; the base ruleset and the CA
    store restart the filter after their own handler."""
    listeners = {topic: sorted({role for role in ROLES for h in _handlers(role)
                                if topic in _listed(h.get("listen"))})
                 for role in ROLES for topic in declared_topics(role)}
    assert listeners == {
        "Corral code changed": ["corral_api", "corral_base", "corral_filter", "corral_sandbox"],
        "Corral trust store changed": ["corral_base", "corral_filter"],
        "Corral base ruleset changed": ["corral_filter", "corral_firewall"],
    }


# --- Ansible itself: each role applied alone --------------------------------------------

MANAGED = "managed by the role interface test"
VALIDATING = "Validating arguments against arg spec 'main'"
"""The task Ansible puts first in a role that has argument specs."""


def _ansible(tmp_path: Path, plays: list[dict], *args: str) -> subprocess.CompletedProcess:
    """ansible-playbook against this machine over the local connection, as this user."""
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(f"alone ansible_connection=local ansible_python_interpreter="
                         f"{sys.executable}\n")
    playbook = tmp_path / "alone.yml"
    playbook.write_text(json.dumps(plays))
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), str(playbook), *args],
        cwd=PLAYBOOKS, capture_output=True, text=True, timeout=300,
        env={"ANSIBLE_CONFIG": str(PLAYBOOKS / "ansible.cfg"), "HOME": str(tmp_path),
             "PATH": f"{ANSIBLE_PLAYBOOK.parent}:/usr/bin:/bin", "ANSIBLE_NOCOLOR": "1",
             "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-local"),
             "LANG": os.environ.get("LANG", "C.UTF-8")})


def _templates(role: str) -> list[str]:
    base = ROOT / "roles" / role / "templates"
    return sorted(str(p.relative_to(base)) for p in base.rglob("*.j2"))


ALONE = [role for role in ROLES if _templates(role)]


def test_each_role_alone_renders_its_templates_as_the_local_backend_does(tmp_path):
    """One play per role with templates, that role alone, its inputs given as plain values
    (no other role in the play, so no other role's defaults to lean on): Ansible validates
    the inputs and renders every template of the role from the role's defaults and its
    inputs only, byte-identical to what cli/roles.py renders (the local backend's files)."""
    assert ALONE == ["corral_api", "corral_base", "corral_filter", "corral_firewall",
                     "corral_sandbox"]
    values = {**roles.defaults(), "ansible_managed": MANAGED, "inventory_hostname": "alone",
              "corral_filter_resolv_conf": "/etc/resolv.conf"}
    plays = []
    for role in ALONE:
        given = {**roles.inputs(role, values), "ansible_managed": MANAGED}
        if role == "corral_filter":  # a task's own variable (resolved's resolv.conf or not)
            given["corral_filter_resolv_conf"] = "/etc/resolv.conf"
        plays.append({
            "name": f"{role} alone", "hosts": "all", "gather_facts": False, "vars": given,
            "roles": [role],
            "tasks": [{"name": "Render the role's templates", "tags": ["render"],
                       "ansible.builtin.template": {
                           "src": str(ROOT / "roles" / role / "templates" / "{{ item }}"),
                           "dest": str(tmp_path / "out" / role) + "/{{ item | basename }}",
                           "mode": "0600"},
                       "loop": _templates(role)}],
        })
        (tmp_path / "out" / role).mkdir(parents=True)
    result = _ansible(tmp_path, plays, "--tags", "render")  # the roles' own tasks skipped
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(VALIDATING) == len(ALONE)
    for role in ALONE:
        for template in _templates(role):
            rendered = (tmp_path / "out" / role / Path(template).name).read_text()
            assert rendered == roles.render(role, template, values), (role, template)


def test_a_role_alone_without_its_inputs_is_refused_by_their_names(tmp_path):
    """Ansible's own message, before any task of the role runs: not an undefined variable
    half-way through (rotate-certs.yml, which applies corral_pki alone, failed that way)."""
    assert [role for role in ROLES if inputs(role)] == ["corral_api", "corral_filter",
                                                        "corral_manifest", "corral_pki",
                                                        "corral_sandbox"]
    plays = [{"name": f"{role} alone", "hosts": "all", "gather_facts": False,
              "ignore_errors": True, "roles": [role]} for role in ROLES if inputs(role)]
    result = _ansible(tmp_path, plays, "--tags", "validation-only")  # nothing but the specs
    plays_out = re.split(r"^PLAY \[(\w+) alone\]", result.stdout, flags=re.MULTILINE)
    refused = {}
    for role, text in zip(plays_out[1::2], plays_out[2::2], strict=True):
        missing = re.search(r"missing required arguments: ([\w, ]+)", text)
        refused[role] = set(missing.group(1).split(", ")) if missing else set()
    assert refused == {role: inputs(role) for role in ROLES if inputs(role)}, result.stdout


@pytest.mark.parametrize("playbook", ["site.yml", "rotate-certs.yml"])
def test_ansible_accepts_the_inputs_the_playbooks_wire(tmp_path, playbook):
    """Ansible's own argument validation of every role, with the playbook's wiring resolved
    (types included: the proxy port an int, the interfaces a list), and nothing else run."""
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(f"alone ansible_connection=local ansible_become=false "
                         f"ansible_python_interpreter={sys.executable}\n")
    result = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), playbook, "--check",
         "--tags", "validation-only"], cwd=PLAYBOOKS, capture_output=True, text=True,
        timeout=300, env={"ANSIBLE_CONFIG": str(PLAYBOOKS / "ansible.cfg"),
                          "HOME": str(tmp_path), "ANSIBLE_NOCOLOR": "1",
                          "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-local"),
                          "PATH": f"{ANSIBLE_PLAYBOOK.parent}:/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(VALIDATING) == len(
        _role_entries(playbook))
