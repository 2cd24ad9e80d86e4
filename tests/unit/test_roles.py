"""The roles' conventions and templates: every variable prefixed with its role and
documented in argument_specs; every config template rendered from the defaults and read by
the very loader the service uses (so a template and its service cannot drift apart)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import jinja2
import pytest
import yaml

from appliance.api.config import load as load_api
from appliance.filter.config import load_config as load_filter
from appliance.sandbox.service import load as load_sandbox

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
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    environment.filters.update(to_json=json.dumps, basename=lambda p: Path(p).name,
                               dirname=lambda p: str(Path(p).parent))
    source = (ROOT / "roles" / role / "templates" / template).read_text()
    return environment.from_string(source).render(**all_defaults(**overrides))


def test_the_roles_are_the_services_of_design_md():
    assert ROLES == ["corral_api", "corral_base", "corral_filter", "corral_firewall",
                     "corral_pki", "corral_sandbox"]


@pytest.mark.parametrize("role", ROLES)
def test_every_variable_is_prefixed_and_in_the_argument_specs(role):
    names = set(defaults(role))
    specs = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    assert all(n.startswith(role + "_") for n in names), sorted(names)
    assert names == set(options), names ^ set(options)
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
    assert config.proxy.listen == (("0.0.0.0", 3128),)


def test_filter_config_with_fixed_upstreams(tmp_path):
    text = render("corral_filter", "etc/corral/filter.toml.j2",
                  corral_filter_upstream=["9.9.9.9:53"], corral_filter_resolv_conf="unused")
    assert tomllib.loads(text)["dns"] == {"listen": ["0.0.0.0:53"], "upstream": ["9.9.9.9:53"]}


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


def test_units_are_hardened_and_ordered():
    filter_unit = render("corral_filter", "etc/systemd/system/corral-filter.service.j2")
    api_unit = render("corral_api", "etc/systemd/system/corral-api.service.j2")
    sandbox_unit = render("corral_sandbox", "etc/systemd/system/corral-sandbox.service.j2")
    firewall_unit = render("corral_firewall", "etc/systemd/system/corral-firewall.service.j2")
    assert "CapabilityBoundingSet=CAP_NET_BIND_SERVICE CAP_NET_ADMIN\n" in filter_unit
    assert "User=corral-filter\n" in filter_unit and "User=corral-api\n" in api_unit
    for unit in (filter_unit, api_unit):
        for line in ("ProtectSystem=strict", "NoNewPrivileges=yes", "Restart=always"):
            assert line + "\n" in unit
    assert "StateDirectory=corral-filter\n" in filter_unit
    assert "RuntimeDirectory=corral-filter\n" in filter_unit  # where the control socket is
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


def test_box_bakes_in_every_package_the_roles_install():
    from cli.box import appliance_packages

    packages = appliance_packages()
    for role, key in (("corral_base", "corral_base_packages"),
                      ("corral_sandbox", "corral_sandbox_packages")):
        assert set(defaults(role)[key]) <= set(packages)
    assert "nftables" in packages  # corral_firewall's


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
             "NO_COLOR": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
