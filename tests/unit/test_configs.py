"""Every config file the project writes is read by the loader of the service it is for:
the local backend's (rendered from the roles' templates), examples/filter.toml, and the
filter configs the integration and e2e harnesses write. The roles' templates themselves are
tests/unit/test_roles.py's. A writer and its reader cannot drift apart unnoticed."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from appliance.api.config import load as load_api
from appliance.local import Supervisor
from appliance.sandbox.service import load as load_sandbox
from appliance.sessionconfig import load_config as load_filter
from cli import local
from cli.client import CliError

ROOT = Path(__file__).resolve().parents[2]


def up_args(**given) -> argparse.Namespace:
    """`corral up --backend local`'s options as its parser gives them (cli/main.py)."""
    from cli.main import parser

    argv = ["up", "--backend", "local"]
    for key, value in given.items():
        for item in value if isinstance(value, list) else [value]:
            argv += [f"--{key.replace('_', '-')}", item]
    return parser().parse_args(argv)


@pytest.fixture
def resolv(tmp_path, monkeypatch):
    """The host's resolv.conf, as the local backend finds it."""
    path = tmp_path / "resolv.conf"
    path.write_text("nameserver 127.0.0.53\nnameserver 2001:db8::1\nnameserver 10.0.2.3\n")
    monkeypatch.setattr(local, "RESOLV_CONFS", (tmp_path / "absent.conf", path))
    return path


def test_the_local_backends_files_are_the_roles_read_by_the_real_loaders(tmp_path, resolv):
    state = tmp_path / "state"
    filter_socket, listen = local._configure(state, up_args())
    assert listen == "127.0.0.1:7443" and filter_socket == str(state / "run" / "filter.sock")
    config = load_filter(str(state / "filter.toml"))
    assert config.dns.listen == (("gateway", 53),)  # the host's resolvers keep their :53
    # the host's resolvers, read at each start: an IPv6 one too, loopback stubs skipped
    assert config.dns.upstream == (("2001:db8::1", 53), ("10.0.2.3", 53))
    assert config.state_dir == str(state / "filter") and config.control_group is None
    assert config.control_socket == filter_socket
    assert config.policy_files == (str(state / "policy.toml"),)
    assert config.firewall.manage and config.firewall.interfaces == ("podman*",)
    assert not config.events.journal  # a supervisor, not systemd: the events stay in state/
    sandbox = load_sandbox(str(state / "sandbox.toml"))
    assert (sandbox.socket, sandbox.state_dir, sandbox.filter_socket, sandbox.group) == (
        str(state / "run" / "sandbox.sock"), str(state / "sandbox"), filter_socket, "")
    assert sandbox.containers_conf == str(state / "containers.conf")
    assert sandbox.proxy_port == 3128 and sandbox.max_project == 512 * 1024**2
    api = load_api(str(state / "api.toml"))
    assert (api.listen, api.tls, api.control_socket, api.sandbox_socket, api.pidfile) == (
        "127.0.0.1:7443", state / "api", filter_socket, sandbox.socket,
        str(state / "run" / "api.pid"))
    podman = tomllib.loads((state / "containers.conf").read_text())
    assert podman["engine"]["cgroup_manager"] in ("systemd", "cgroupfs")
    for name in ("filter.toml", "sandbox.toml", "api.toml", "containers.conf", "policy.toml"):
        text = (state / name).read_text()
        assert "/etc/corral" not in text and "written once by `corral up" in text, name
    supervisor = Supervisor(state)  # the local backend's supervisor reads them too
    assert supervisor.filter_socket == filter_socket
    assert supervisor.sandbox.path == sandbox.socket


def test_a_kept_file_stays_and_the_others_follow_it(tmp_path, resolv):
    """Written once, then the user's: an edited filter.toml (another control socket and
    proxy port) is kept, and the sandbox and API configs written after it point at it."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "filter.toml").write_text(f"""
[dns]
listen = ["gateway:53"]
upstream = ["192.0.2.53:53"]
[proxy]
listen = ["gateway:8888"]
[state]
dir = "{state}/filter"
[control]
socket = "{state}/mine.sock"
""")
    before = (state / "filter.toml").read_text()
    filter_socket, _ = local._configure(state, up_args(upstream="198.51.100.1:53"))
    assert (state / "filter.toml").read_text() == before
    assert filter_socket == str(state / "mine.sock")
    sandbox = load_sandbox(str(state / "sandbox.toml"))
    assert sandbox.filter_socket == filter_socket and sandbox.proxy_port == 8888
    assert load_api(str(state / "api.toml")).control_socket == filter_socket


def test_given_upstreams_are_the_filters_whatever_their_family(tmp_path, resolv):
    state = tmp_path / "state"
    local._configure(state, up_args(upstream=["[2001:db8::53]:53", "192.0.2.53:5353"]))
    config = load_filter(str(state / "filter.toml"))
    assert config.dns.upstream == (("2001:db8::53", 53), ("192.0.2.53", 5353))


def test_a_host_without_a_usable_resolver_is_told_to_name_one(tmp_path, resolv):
    """No silent fall-back to a public resolver: the error names the fix."""
    resolv.write_text("nameserver 127.0.0.53\n")  # only systemd-resolved's stub
    with pytest.raises(CliError) as raised:
        local._configure(tmp_path / "state", up_args())
    assert "no nameserver other than loopback stubs" in str(raised.value)
    assert "--upstream IP:PORT" in raised.value.hint


def test_a_broken_upstream_is_refused_before_anything_starts(tmp_path, resolv):
    with pytest.raises(CliError, match="does not load") as raised:
        local._configure(tmp_path / "state", up_args(upstream="2001:db8::1:53"))
    assert "needs a port number" in str(raised.value)


def test_systemd_resolved_hosts_forward_to_its_upstreams_not_its_stub(tmp_path, monkeypatch):
    resolved, plain = tmp_path / "resolved.conf", tmp_path / "resolv.conf"
    plain.write_text("nameserver 127.0.0.53\n")
    monkeypatch.setattr(local, "RESOLV_CONFS", (resolved, plain))
    assert local.resolv_conf() == plain
    resolved.write_text("nameserver 10.0.2.3\n")
    assert local.resolv_conf() == resolved


def test_the_example_filter_config_loads(monkeypatch):
    monkeypatch.chdir(ROOT)  # its paths are relative to the checkout, as scripts/filter runs it
    config = load_filter("examples/filter.toml")
    assert config.dns.listen == (("127.0.0.1", 5353),)
    # a filter that took no notice of --check would serve for ever: bounded
    result = subprocess.run([str(Path(sys.executable).parent / "corral-filter"), "--config",
                             "examples/filter.toml", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_integration_harness_config_loads(tmp_path):
    from tests.integration.conftest import write_config

    config = load_filter(str(write_config(tmp_path, ("127.0.0.1", 5353))))
    assert [s.name for s in config.sessions] == ["s1", "s2"]
    group = load_filter(str(write_config(tmp_path, ("127.0.0.1", 5353),
                                         control_extra='group = "root"')))
    assert group.control_group == "root"


def test_the_e2e_harness_config_loads(tmp_path):
    from tests.e2e.conftest import World

    world = World(tmp_path)
    (tmp_path / "ca.pem").write_text("")  # the fake internet writes its CA before the filter
    config = load_filter(str(world.config))
    assert config.inspect.ca_dir == f"{tmp_path}/state/intercept"
    assert config.firewall.manage and config.firewall.interfaces == ("corral*", "podman*")
    assert [str(s.gateway) for s in config.sessions] == ["10.213.1.1", "10.213.2.1"]


def test_the_benchmark_harness_config_loads(tmp_path):
    from bench.run import FILTER, GATEWAY, POLICY, UPSTREAM

    (tmp_path / "policy.toml").write_text(POLICY)
    (tmp_path / "filter.toml").write_text(FILTER.format(dir=tmp_path, gateway=GATEWAY,
                                                        up=UPSTREAM))
    config = load_filter(str(tmp_path / "filter.toml"))
    assert config.firewall.interfaces == ("cb-sbx*",)
    assert [s.name for s in config.sessions] == ["bench"]
