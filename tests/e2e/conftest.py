"""The e2e world: real corral-filter and real nftables in an appliance namespace, sandboxes
and a fake internet in namespaces of their own. Root only; skips with the reason otherwise."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import control

from . import netns

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "e2e needs root (network namespaces, nftables): run scripts/test as root"
    for tool in ("ip", "nft", "curl"):
        if shutil.which(tool) is None:
            return f"e2e needs {tool}: scripts/setup installs it"
    try:
        import nftables  # noqa: F401
    except ImportError:
        return "e2e needs the nftables Python bindings: scripts/setup links them"
    return None


S1_POLICY = """
[http]
allow = ["allowed.test", "private.test", "inspected.test", "echo.test",
         "neighbour.test"]   # on inspected.test's address: the battery's --neighbour
[tcp]
allow = ["ssh.test:22"]
[[inspect]]
host = "inspected.test"
deny = ["GET /corral-selftest-denied/**"]   # the battery's --denied-request
[[git]]
host = "inspected.test"
repos = ["corral-selftest/probe"]           # the battery's --git-repo
"""
S2_POLICY = """
[http]
allow = ["other.test"]
"""


APPLIANCE_NAME = "e2e"


class World:
    def __init__(self, directory: Path):
        self.dir = directory
        self.socket = directory / "filter.sock"
        (directory / "s1.toml").write_text(S1_POLICY)
        (directory / "s2.toml").write_text(S2_POLICY)
        self.config = directory / "filter.toml"
        self.config.write_text(f"""
[filter]
workers = 2                      # the e2e tier runs the worker processes (the VM tier: one)
[dns]
listen = ["gateway:53"]          # on every session's gateway, sessions registered later
upstream = ["203.0.113.53:53"]   # included, and nowhere else: resolvers.py keeps its :53
[proxy]
listen = ["gateway:3128"]
transparent_http = ["gateway:3129"]
transparent_tls = ["gateway:3130"]
header_timeout = 5
[sshgate]                        # git over SSH to [[git]] hosts, keys held here
listen = ["gateway:3122"]
[inspect]                        # hosts a session's policy names in [[inspect]]
ca_dir = "{directory}/state/intercept"
upstream_ca = "{directory}/ca.pem"   # the fake internet's CA (written before the filter starts)
[state]
dir = "{directory}/state"
[control]
socket = "{self.socket}"
[firewall]
manage = true
interfaces = ["corral*", "podman*"]   # namespace sandboxes, and podman's bridges
[[session]]
name = "s1"
subnet = "10.213.1.0/24"
files = ["{directory}/s1.toml"]
[[session]]
name = "s2"
subnet = "10.213.2.0/24"
files = ["{directory}/s2.toml"]
""")
        self.processes = []

    def start(self):
        """The appliance is the local backend (`corral up --backend local`) run inside the
        appliance namespace: supervisor, firewall, filter, sandbox service and API."""
        netns.build(sessions=2)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.internet = netns.spawn(netns.INTERNET, [sys.executable, "-m", "tests.e2e.internet",
                                                     str(self.dir)], self.dir / "internet.log",
                                    env)
        self.processes.append(self.internet)
        self._wait(lambda: (self.dir / "ready").exists(), "the fake internet", "internet.log")
        # a workstation's resolvers hold port 53 on their addresses, as systemd-resolved and
        # dnsmasq do, for the whole run: every test then runs next to them
        self.resolvers = netns.spawn(netns.APPLIANCE, [sys.executable, "-m",
                                                       "tests.e2e.resolvers", str(self.dir)],
                                     self.dir / "resolvers.log", env)
        self.processes.append(self.resolvers)
        self._wait(lambda: (self.dir / "resolvers-ready").exists(), "the resolvers' stand-ins",
                   "resolvers.log")
        started = time.monotonic()
        result = self.corral("up", "--backend", "local", "--name", APPLIANCE_NAME,
                             "--state-dir", str(self.dir), "--no-image", timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"corral up failed:\n{result.stdout}{result.stderr}")
        print(f"corral up --backend local: {time.monotonic() - started:.1f}s")
        self._wait(self._filter_up, "corral-filter", "logs/filter.log")

    def corral(self, *args: str, timeout: float = 600, **kw):
        """The host CLI, run in the appliance namespace (where the API listens)."""
        import subprocess

        return subprocess.run(["nsenter", f"--net=/run/netns/{netns.APPLIANCE}",
                               str(BIN / "corral"), *args], capture_output=True, text=True,
                              timeout=timeout, env=self.cli_env, **kw)

    @property
    def cli_env(self) -> dict:
        return {**os.environ, "XDG_CONFIG_HOME": str(self.dir / "config")}

    def _filter_up(self):
        try:
            return self.control({"op": "status"})["ok"]
        except OSError:
            return False

    def _wait(self, ready, what, log):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if ready():
                return
            for process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{what} exited:\n" + (self.dir / log).read_text())
            if what == "corral-filter" and not (self.dir / "supervisor.pid").exists():
                raise RuntimeError("the supervisor exited:\n" + (
                    self.dir / "logs" / "supervisor.log").read_text())
            time.sleep(0.05)
        raise RuntimeError(f"{what} did not come up:\n" + (self.dir / log).read_text())

    def control(self, request: dict) -> dict:
        return control(self.socket, request)

    def events(self) -> list[dict]:
        """Every event so far, from the audit log (the ring of recent events is bounded)."""
        path = self.dir / "state" / "audit.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    def counters(self) -> dict:
        out = netns.sh("nft", "-j", "list", "counters", "table", "inet", "corral",
                       ns=netns.APPLIANCE).stdout
        return {c["counter"]["name"]: c["counter"]["packets"]
                for c in json.loads(out)["nftables"] if "counter" in c}

    def upstream_queries(self) -> str:
        path = self.dir / "dns-queries.log"
        return path.read_text() if path.exists() else ""

    def origin_requests(self) -> str:
        """Every request the fake internet's HTTP(S) origins got: METHOD HOST PATH lines."""
        path = self.dir / "http-requests.log"
        return path.read_text() if path.exists() else ""

    def in_sandbox(self, index: int, *args: str, timeout: float = 120):
        import subprocess

        return subprocess.run(["ip", "netns", "exec", netns.sandbox_name(index), *args],
                              capture_output=True, text=True, timeout=timeout)

    def stop(self):
        try:
            down = self.corral("down", "--appliance", APPLIANCE_NAME, timeout=180)
            print(f"corral down: {down.stdout.strip()} {down.stderr.strip()}")
        finally:
            for process in self.processes:
                netns.stop(process)
            netns.cleanup()


CONTAINERS_CONF = Path(__file__).with_name("containers.conf")


@pytest.fixture(scope="session")
def podman():
    """podman on this host; sandbox tests skip (saying why) where it cannot run."""
    from appliance.sandbox.podman import Podman

    if os.geteuid() != 0:
        pytest.skip("sandbox tests need root (rootful podman): run scripts/test as root")
    if shutil.which("podman") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("podman and mmdebstrap are missing: scripts/setup installs them")
    return Podman(CONTAINERS_CONF)


@pytest.fixture(scope="session")
def sandbox_image(podman):
    """The real sandbox image, built from Debian packages (kept between runs)."""
    from appliance.sandbox import image

    started = time.monotonic()
    reference = image.build(podman, progress=lambda line: print(f"image: {line}"))
    print(f"image: ready after {time.monotonic() - started:.0f}s")
    return reference


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    w = World(tmp_path_factory.mktemp("e2e"))
    try:
        w.start()
        yield w
    finally:
        w.stop()
