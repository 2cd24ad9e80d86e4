"""The roles' conventions and templates: every variable prefixed with its role and
documented in argument_specs; every config template rendered from the defaults and read by
the very loader the service uses (so a template and its service cannot drift apart)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jinja2
import pytest
import yaml

from appliance.api.config import ApiConfig
from appliance.api.config import load as load_api
from appliance.sandbox.service import SandboxConfig
from appliance.sandbox.service import load as load_sandbox
from appliance.sessionconfig import TABLES, FilterConfig
from appliance.sessionconfig import load_config as load_filter
from cli import roles
from cli.box import every_task

ROOT = Path(__file__).resolve().parents[2]
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if p.is_dir())


def defaults(role: str) -> dict:
    return yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text()) or {}


def all_defaults(**overrides) -> dict:
    values = {"ansible_managed": "managed by test", "inventory_hostname": "corral-test"}
    for role in ROLES:
        values.update(defaults(role))
    values.update(overrides)
    return values


def render(role: str, template: str, **overrides) -> str:
    """As the appliance gets it: the renderer the local backend uses (cli/roles.py)."""
    return roles.render(role, template, all_defaults(**overrides))


def test_the_roles_are_the_services_of_design_md():
    assert ROLES == ["corral_api", "corral_base", "corral_filter", "corral_firewall",
                     "corral_manifest", "corral_pki", "corral_sandbox"]


@pytest.mark.parametrize("role", ROLES)
def test_every_variable_is_prefixed_and_in_the_argument_specs(role):
    names = set(defaults(role))
    specs = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    assert all(n.startswith(role + "_") for n in options), sorted(options)
    assert names <= set(options), names - set(options)  # the others are its inputs
    assert all(o.get("description") for o in options.values())


def test_group_vars_only_sets_variables_the_roles_define():
    knobs = yaml.safe_load((ROOT / "playbooks" / "group_vars" / "all.yml").read_text())
    known = set(all_defaults())
    assert set(knobs) <= known, set(knobs) - known


def test_filter_config_renders_into_what_the_filter_loads(tmp_path):
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 10.0.2.3\n")
    for name in ("filter.toml", "policy.toml"):
        text = render("corral_filter", f"etc/corral/{name}.j2", corral_base_control_group="root",
                      corral_filter_resolv_conf=str(resolv),
                      corral_filter_state_dir=str(tmp_path / "state"),
                      corral_filter_presets=["debian"],
                      corral_filter_allow_http=["example.com"])
        (tmp_path / name).write_text(text.replace("/etc/corral/policy.toml",
                                                  str(tmp_path / "policy.toml")))
    config = load_filter(str(tmp_path / "filter.toml"))
    assert config.dns.upstream == (("10.0.2.3", 53),)
    assert config.firewall.manage and config.firewall.interfaces == ("podman*",)
    assert config.control_group == "root"
    assert config.proxy.listen == (("gateway", 3128),)  # each session's gateway, no wider
    # the role's audit retention is the filter's own default, not a second opinion
    fields = {f.name: f.default for f in dataclasses.fields(FilterConfig)}
    assert (config.audit_segment_bytes, config.audit_segments) == (
        fields["audit_segment_bytes"], fields["audit_segments"])
    assert config.state_dir == str(tmp_path / "state")
    assert config.events.journal  # journald runs on every appliance: it gets every event


def test_the_appliance_layer_names_a_preset_with_its_parameters():
    """`corral_filter_presets` entries are names, or mappings that give a preset its
    parameters (issue 26, F16: github-pr acts on the repositories named)."""
    from appliance.policy import Policy, parse_host, policy_file_rules

    text = render("corral_filter", "etc/corral/policy.toml.j2", corral_filter_presets=[
        "debian", {"name": "github-pr", "repos": ["acme/widget", 'we"ird/x']}])
    with pytest.raises(ValueError, match=r"github-pr: repos: 'we\"ird/x' is not OWNER/REPO"):
        policy_file_rules(text, "policy.toml", "appliance")
    text = render("corral_filter", "etc/corral/policy.toml.j2", corral_filter_presets=[
        "debian", {"name": "github-pr", "repos": ["acme/widget"]}])
    policy = Policy(policy_file_rules(text, "policy.toml", "appliance"))
    api = policy.inspection(parse_host("api.github.com"))
    assert api.decide("POST", "/repos/acme/widget/pulls").allowed
    assert not api.decide("POST", "/repos/other/widget/pulls").allowed
    assert policy.decide_http(parse_host("deb.debian.org"), 80).allowed


def test_host_corral_is_written_only_when_the_role_is_given_an_address(tmp_path):
    fixed = {"corral_filter_upstream": ["9.9.9.9:53"], "corral_filter_resolv_conf": "unused"}
    assert "[host]" not in render("corral_filter", "etc/corral/filter.toml.j2", **fixed)
    text = render("corral_filter", "etc/corral/filter.toml.j2", **fixed,
                  corral_filter_host_gateway="192.168.121.1")
    assert tomllib.loads(text)["host"] == {"gateway": "192.168.121.1"}


def test_filter_config_with_fixed_upstreams(tmp_path):
    text = render("corral_filter", "etc/corral/filter.toml.j2",
                  corral_filter_upstream=["9.9.9.9:53"], corral_filter_resolv_conf="unused")
    assert tomllib.loads(text)["dns"] == {"listen": ["gateway:53"], "upstream": ["9.9.9.9:53"]}


def test_sandbox_and_api_configs_render_into_what_their_services_load(tmp_path):
    sandbox = tmp_path / "sandbox.toml"
    sandbox.write_text(render("corral_sandbox", "etc/corral/sandbox.toml.j2"))
    config = load_sandbox(str(sandbox))
    assert (config.socket, config.group, config.filter_socket, config.proxy_port) == (
        "/run/corral-sandbox/control.sock", "corral", "/run/corral-filter/control.sock", 3128)
    api = tmp_path / "api.toml"
    api.write_text(render("corral_api", "etc/corral/api.toml.j2"))
    config = load_api(str(api))
    assert config.listen == "0.0.0.0:8443" and str(config.tls) == "/etc/corral/api"
    assert config.sandbox_socket == "/run/corral-sandbox/control.sock"


def _code_defaults() -> dict[tuple[str, str, str], object]:
    """(config file, table, key) -> the default of the field the loader fills from it."""
    found = {}
    for table, cls in TABLES.items():
        for f in dataclasses.fields(cls):
            found[("filter.toml", table, f.name)] = f.default
    for f in dataclasses.fields(FilterConfig):
        if f.metadata.get("key"):
            table, _, key = f.metadata["key"].partition(".")
            found[("filter.toml", table, key)] = f.default
    for name, table, cls in (("sandbox.toml", "sandbox", SandboxConfig),
                             ("api.toml", "api", ApiConfig)):
        for f in dataclasses.fields(cls):
            found[(name, table, f.name)] = f.default
    return found


TEMPLATED = re.compile(r'^(\w+) = "?\{\{ (\w+)(?: \| to_json)? \}\}"?\s*(#.*)?$')


def templated_keys(role: str, name: str) -> list[tuple[str, str, str]]:
    """(table, key, variable) of each key a config template sets from one role variable."""
    table, found = "", []
    for line in (ROOT / "roles" / role / "templates" / "etc" / "corral" / f"{name}.j2"
                 ).read_text().splitlines():
        if line.startswith("["):
            table = line.strip("[] ")
        elif match := TEMPLATED.match(line):
            found.append((table, match.group(1), match.group(2)))
    return found


CONFIG_TEMPLATES = [("corral_filter", "filter.toml"), ("corral_sandbox", "sandbox.toml"),
                    ("corral_api", "api.toml")]
DIFFER_ON_PURPOSE = {
    ("filter.toml", "control", "group"): "code: no group, root alone; the role: the API's",
    ("sandbox.toml", "sandbox", "group"): "code: no group, root alone; the role: the API's",
    ("api.toml", "api", "listen"): "code: loopback unless told; the role: the management "
                                   "interface, which Vagrant forwards to the host's loopback",
    ("api.toml", "api", "pidfile"): "code: none unless asked; the role: in the unit's "
                                    "RuntimeDirectory, which only systemd creates",
    ("filter.toml", "host", "gateway"): "code: none; the role: none as well (empty, and the "
                                        "table is written only when it is set)",
    ("filter.toml", "inspect", "ca_dir"): "code: inspection off unless a CA is given; the "
                                          "role: the filter's own CA in its state directory",
    ("filter.toml", "events", "journal"): "code: off (tests, the local backend, a filter "
                                          "where no journald runs); the role: on, journald "
                                          "runs on every appliance",
    ("filter.toml", "filter", "workers"): "code: 1, one process (tests start hundreds of "
                                          "filters, each at once); the role: one worker per "
                                          "CPU, a team's load on every core",
}
"""Where a role default and its code default differ, and why (safe without the role)."""


def test_every_role_default_a_config_template_writes_is_the_loaders_default():
    """A default is written once: what the role writes into a config is what the service
    assumes when the key is left out, so hand-written configs and the appliance agree."""
    code, values = _code_defaults(), all_defaults()
    for role in ROLES:  # an input is its owner's default, as site.yml passes it
        values.update(roles.inputs(role, values))
    compared = []
    for role, name in CONFIG_TEMPLATES:
        for table, key, variable in templated_keys(role, name):
            where = (name, table, key)
            if variable not in values or where in DIFFER_ON_PURPOSE:
                continue  # not a role default (a task's own variable), or explained above
            assert where in code, f"{name} [{table}] {key}: the loader has no such key"
            expected = code[where]
            expected = list(expected) if isinstance(expected, tuple) else expected
            assert values[variable] == expected, (
                f"{name} [{table}] {key}: role {variable} = {values[variable]!r}, "
                f"code default {expected!r}")
            compared.append(where)
    assert len(compared) >= 12, compared  # the templates were read, not skipped
    assert set(DIFFER_ON_PURPOSE) <= {(n, t, k) for r, n in CONFIG_TEMPLATES
                                      for t, k, _ in templated_keys(r, n)}


def test_the_filter_is_ahead_of_the_sandboxes_for_the_cpu():
    """The filter serves every session: under a flood it is never one equal among a
    sandbox's processes (bench/: its loop waited for a core longer than it ran), so it
    runs in a slice of its own, beside machine.slice (podman's sandboxes), with ten times
    the default CPU weight. The bench reads the weight from here (bench/cgroups.py)."""
    filter_unit = render("corral_filter", "etc/systemd/system/corral-filter.service.j2")
    slice_unit = render("corral_filter", "etc/systemd/system/corral.slice.j2")
    assert "Slice=corral.slice\n" in filter_unit
    assert "[Slice]\nCPUWeight=1000\n" in slice_unit
    tasks = yaml.safe_load((ROOT / "roles/corral_filter/tasks/main.yml").read_text())
    written = [f["dest"] for t in tasks for f in t.get("corral_files", {}).get("files", [])]
    assert "/etc/systemd/system/corral.slice" in written


def test_units_are_hardened_and_ordered():
    filter_unit = render("corral_filter", "etc/systemd/system/corral-filter.service.j2")
    api_unit = render("corral_api", "etc/systemd/system/corral-api.service.j2")
    sandbox_unit = render("corral_sandbox", "etc/systemd/system/corral-sandbox.service.j2")
    firewall_unit = render("corral_firewall", "etc/systemd/system/corral-firewall.service.j2")
    assert "CapabilityBoundingSet=CAP_NET_BIND_SERVICE CAP_NET_ADMIN\n" in filter_unit
    assert "LimitNOFILE=1048576\n" in filter_unit
    assert "User=corral-filter\n" in filter_unit and "User=corral-api\n" in api_unit
    for unit in (filter_unit, api_unit):
        for line in ("ProtectSystem=strict", "NoNewPrivileges=yes", "Restart=always"):
            assert line + "\n" in unit
    assert "StateDirectory=corral-filter\n" in filter_unit
    assert "RuntimeDirectory=corral-filter\n" in filter_unit  # where the control socket is
    # the control socket and journald's ([events] journal), never closed off
    assert re.search(r"^RestrictAddressFamilies=.*\bAF_UNIX\b", filter_unit, re.M)
    assert not re.search(r"^(InaccessiblePaths|TemporaryFileSystem)=.*/run", filter_unit, re.M)
    assert "CapabilityBoundingSet=\n" in api_unit  # none at all
    assert "Requires=corral-firewall.service corral-filter.service" in sandbox_unit
    assert "Before=network-pre.target" in firewall_unit
    assert "DefaultDependencies=no" in firewall_unit


def test_base_ruleset_template_names_every_interface_pattern():
    one = render("corral_firewall", "etc/corral/base.nft.j2")
    two = render("corral_firewall", "etc/corral/base.nft.j2",
                 corral_firewall_interfaces=["podman*", "corral*"])
    assert 'iifname "podman*" jump deny_unknown' in one
    assert 'iifname { "podman*", "corral*" } jump deny_unknown' in two


PACKAGE_MODULES = {"ansible.builtin.apt", "apt", "ansible.builtin.package", "package"}


_tasks = every_task  # cli/box.py's: the box reads the roles' tasks the same way


def _resolve(value, variables: dict):
    """A task argument as Ansible would see it: templates rendered from the role defaults;
    a whole-value template keeps its type (a list stays a list)."""
    if isinstance(value, list):
        return [_resolve(v, variables) for v in value]
    if not isinstance(value, str) or "{{" not in value:
        return value
    whole = re.fullmatch(r"\{\{\s*(\w+)\s*\}\}", value)
    if whole:
        return _resolve(variables[whole.group(1)], variables)
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined)
    return environment.from_string(value).render(**variables)


def installed_packages() -> dict[str, list[str]]:
    """Every package an apt (or package) task of any role installs -> where: parsed from
    the tasks themselves, names resolved from the role defaults, loops expanded."""
    variables = all_defaults()
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "roles").glob("*/tasks/*.yml")):
        for task in _tasks(yaml.safe_load(path.read_text())):
            module = next((m for m in PACKAGE_MODULES if m in task), None)
            if module is None:
                continue
            where = f"{path.relative_to(ROOT)}: {task.get('name')}"
            args = task[module]
            if isinstance(args, str):  # the free form: name=x state=present
                args = dict(word.split("=", 1) for word in args.split())
            assert "deb" not in args, f"{where}: a .deb file cannot be baked into the box"
            if args.get("state", "present") in ("absent", "build-dep"):
                continue
            assert "name" in args, f"{where}: an apt task without names (upgrade?)"
            items = _resolve(task.get("loop", task.get("with_items", [None])), variables)
            for item in items:
                names = _resolve(args["name"], {**variables, "item": item})
                for name in [names] if isinstance(names, str) else names:
                    for package in str(name).split(","):
                        found.setdefault(package.strip().split("=")[0], []).append(where)
    return found


def test_every_apt_task_is_found_with_its_packages():
    """The parser reads the roles as they are: it is no use if it finds nothing."""
    found = installed_packages()
    assert {"python3-nftables", "podman", "nftables", "mmdebstrap"} <= set(found), found
    assert any("corral_firewall/tasks/main.yml" in w for w in found["nftables"])


def test_box_bakes_in_every_package_the_roles_install():
    """Under TCG an apt download costs minutes: every apt task must be a no-op on a box
    from `corral box build`, so each package any role installs is in the box's list."""
    from cli.box import appliance_packages

    baked = set(appliance_packages())
    missing = {name: where for name, where in installed_packages().items() if name not in baked}
    assert not missing, missing


def test_no_task_installs_packages_behind_the_apt_module():
    """apt-get in a shell or command task would escape the check above."""
    for path in sorted((ROOT / "roles").glob("*/tasks/*.yml")):
        for task in _tasks(yaml.safe_load(path.read_text())):
            for module in ("ansible.builtin.shell", "ansible.builtin.command", "shell",
                           "command"):
                text = json.dumps(task.get(module, ""))
                assert not re.search(r"\b(apt-get|apt|dpkg)\s+(-\S+\s+)*(install|-i)\b",
                                     text), f"{path}: {task.get('name')}"


def test_the_box_preloads_the_sandbox_images_the_appliance_uses():
    from appliance.sandbox import image
    from cli.box import SANDBOX_IMAGES

    assert (image.BASE, image.IMAGE) == SANDBOX_IMAGES


@pytest.mark.parametrize("playbook", ["site.yml", "verify.yml", "rotate-certs.yml"])
def test_playbooks_pass_syntax_check(playbook):
    result = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "--syntax-check", "-i",
         "localhost,", playbook], cwd=ROOT / "playbooks", capture_output=True, text=True,
        env={"ANSIBLE_CONFIG": str(ROOT / "playbooks" / "ansible.cfg"), "PATH": "/usr/bin:/bin",
             "HOME": "/tmp"}, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ansible_lint_is_clean_at_its_configured_profile():
    assert "profile: production" in (ROOT / ".ansible-lint").read_text()
    result = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-lint"), "--nocolor", "--format=pep8",
         "playbooks/site.yml", "playbooks/verify.yml", "playbooks/rotate-certs.yml", "roles"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/tmp",
             "NO_COLOR": "1",
             # corral's settings, as for every run of the playbooks: where corral_files is
             "ANSIBLE_CONFIG": str(ROOT / "playbooks" / "ansible.cfg")})
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_appliance_sends_no_name_queries_onto_session_links():
    """systemd-resolved speaks LLMNR (and mDNS, where on) on every link it sees, so each new
    session bridge got the appliance's own queries for its name, which the firewall
    reported as the session's denials (issue 26, F15). The filter role's drop-in turns
    them off, with the stub listener it already freed port 53 from."""
    import configparser

    tasks = _tasks(yaml.safe_load((ROOT / "roles/corral_filter/tasks/main.yml").read_text()))
    (drop_in,) = [t["ansible.builtin.template"] for t in tasks
                  if t.get("ansible.builtin.template", {}).get("dest")
                  == "/etc/systemd/resolved.conf.d/corral.conf"]
    parsed = configparser.ConfigParser()
    parsed.optionxform = str
    parsed.read_string(render("corral_filter", drop_in["src"]))
    assert dict(parsed["Resolve"]) == {"DNSStubListener": "no", "LLMNR": "no",
                                       "MulticastDNS": "no"}
