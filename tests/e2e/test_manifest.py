"""The manifest collector for real, on this machine: the roles' templates rendered into a
temporary root, the filter's full ruleset loaded by corral-firewall into a network namespace,
and `python -m appliance.manifest` run there as the appliance runs it (real dpkg-query, real
podman, real nftables). Drift is named: an edited file, a rule added by hand; a session's
chains and learned elements are not drift, and a second write changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from appliance.manifest import compare, loads
from appliance.manifest.collect import files
from cli import roles
from tests.unit.test_roles import all_defaults

pytestmark = pytest.mark.e2e
BIN = Path(sys.executable).parent
TEMPLATES = [("corral_filter", "etc/corral/filter.toml.j2"),
             ("corral_filter", "etc/corral/policy.toml.j2"),
             ("corral_firewall", "etc/corral/base.nft.j2"),
             ("corral_filter", "etc/systemd/system/corral-filter.service.j2")]


def appliance_root(root: Path, host_gateway: str = "192.168.121.1") -> Path:
    """The files the roles render, under `root`, as they would be under / (state, the
    control socket and the interception CA under `root` too)."""
    values = all_defaults(
        corral_filter_state_dir=str(root / "state"),
        corral_filter_control_socket=str(root / "control.sock"),
        corral_filter_inspect_ca_dir=str(root / "intercept"),
        corral_filter_host_gateway=host_gateway, corral_filter_resolv_conf="/etc/resolv.conf",
        corral_filter_control_group="")
    for role, template in TEMPLATES:
        target = root / template.removesuffix(".j2")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(roles.render(role, template, values, config_dir=str(root / "etc/corral")))
    (root / "etc/corral/api").mkdir()
    (root / "etc/corral/api/server.key").write_text("one per appliance: not in the manifest\n")
    return root


@pytest.fixture
def namespace():
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces")
    name = f"corral-manifest-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def in_namespace(namespace: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", namespace, *argv], capture_output=True,
                          text=True, timeout=300)


def manifest_tool(namespace: str, root: Path, *argv: str) -> subprocess.CompletedProcess:
    return in_namespace(namespace, str(BIN / "python"), "-m", "appliance.manifest", *argv,
                        "--root", str(root), "--venv", sys.prefix)


def load_ruleset(namespace: str, root: Path) -> None:
    """What corral-filter does when it starts and as sessions come: the full ruleset."""
    done = in_namespace(namespace, str(BIN / "corral-firewall"), "apply", "--config",
                        str(root / "etc/corral/filter.toml"))
    assert done.returncode == 0, done.stderr


def test_the_collector_names_drift_and_nothing_else(tmp_path, namespace):
    root = appliance_root(tmp_path / "root")
    recorded = tmp_path / "manifest.json"
    # no corral table yet (the filter has not started): nothing is recorded, and it says why
    early = manifest_tool(namespace, root, "write", str(recorded), "--name", "one")
    assert early.returncode == 1 and not recorded.exists()
    assert "the loaded ruleset is missing: no table inet corral" in early.stderr
    load_ruleset(namespace, root)

    first = manifest_tool(namespace, root, "write", str(recorded), "--name", "one",
                          "--commit", "ab765c3")
    assert (first.returncode, first.stdout) == (0, "written\n"), first.stderr
    manifest = loads(recorded.read_bytes())
    assert manifest["ruleset"]["loaded"] == "as rendered"
    assert "/etc/corral/filter.toml" in manifest["files"]
    assert not [f for f in manifest["files"] if f.startswith("/etc/corral/api/")]
    assert manifest["packages"]["nftables"].split()[0]  # this host's dpkg, really read
    assert manifest["wheels"]["corral"]["version"]
    assert manifest["appliance"] == {"name": "one", "hostname": os.uname().nodename,
                                     "host_gateway": "192.168.121.1"}
    again = manifest_tool(namespace, root, "write", str(recorded), "--name", "one",
                          "--commit", "ab765c3")
    assert (again.returncode, again.stdout) == (0, "unchanged\n"), again.stderr

    # a session comes: its chains, its rules and what the DNS filter learns are no drift
    (root / "state").mkdir(exist_ok=True)
    (root / "state/sessions.json").write_text(json.dumps({"version": 1, "sessions": [
        {"name": "s1", "subnet": "10.213.1.0/24", "gateway": "10.213.1.1", "files": []}]}))
    load_ruleset(namespace, root)
    added = in_namespace(namespace, "nft", "add", "element", "inet", "corral", "learned",
                         "{ 10.213.1.2 . 1.2.3.4 . 22 timeout 60s }")
    assert added.returncode == 0, added.stderr
    clean = manifest_tool(namespace, root, "check", str(recorded))
    assert (clean.returncode, clean.stdout.splitlines()[-1:]) == (
        0, [f"as provisioned: the appliance matches {recorded}"]), clean.stdout + clean.stderr

    # an edited file is named
    config = root / "etc/corral/policy.toml"
    original = config.read_bytes()
    config.write_bytes(original + b"# x\n")
    edited = manifest_tool(namespace, root, "check", str(recorded))
    assert edited.returncode == 1, edited.stderr
    assert [line.split(":")[0] for line in edited.stdout.splitlines()] == [
        "file /etc/corral/policy.toml"]
    config.write_bytes(original)

    # a config file edited until it no longer parses: still each difference, by name
    config = root / "etc/corral/filter.toml"
    original = config.read_bytes()
    config.write_bytes(original + b"x\n")
    broken = manifest_tool(namespace, root, "check", str(recorded))
    assert broken.returncode == 1, broken.stderr
    named = [line.split(":")[0] for line in broken.stdout.splitlines()]
    assert named == ["file /etc/corral/filter.toml", "ruleset", "ruleset rendered",
                     "policy appliance", "appliance host_gateway"], broken.stdout
    assert "filter.toml" in broken.stdout.splitlines()[2]  # which file does not parse
    config.write_bytes(original)

    # a rule loaded by hand is named, and so is the rule it is
    rule = in_namespace(namespace, "nft", "add", "rule", "inet", "corral", "filter_input",
                        "tcp", "dport", "4444", "accept")
    assert rule.returncode == 0, rule.stderr
    drifted = manifest_tool(namespace, root, "check", str(recorded), "--json")
    assert drifted.returncode == 1, drifted.stderr
    report = json.loads(drifted.stdout)
    assert [d["text"] for d in report["differences"]] == ["ruleset: loaded differs from rendered"]
    assert [n for n in report["ruleset_notes"] if n.startswith("+ rule filter_input")
            and "4444" in n]

    # the filter's own reload puts it right
    load_ruleset(namespace, root)
    assert manifest_tool(namespace, root, "check", str(recorded)).returncode == 0


def test_two_appliances_from_one_configuration_hash_their_files_alike(tmp_path):
    """The host gateway is the appliance's own: masked in the files, kept in `appliance`."""
    root = tmp_path / "root"
    hashed = []
    for gateway in ("192.168.121.1", "10.0.0.1"):
        if root.exists():
            subprocess.run(["rm", "-rf", str(root)], check=True)
        appliance_root(root, host_gateway=gateway)
        assert f'gateway = "{gateway}"' in (root / "etc/corral/filter.toml").read_text()
        hashed.append(files(root, {"host_gateway": gateway}))
    assert compare({"files": hashed[0]}, {"files": hashed[1]}).differences == ()
    unmasked = [files(root, {}), hashed[1]]
    assert [d.name for d in compare({"files": unmasked[0]}, {"files": unmasked[1]}
                                    ).differences] == ["/etc/corral/filter.toml"]
