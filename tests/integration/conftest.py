"""The real corral-filter, run as a process, in front of a fake internet on loopback.

Layout (all on 127.0.0.0/8, which Linux routes locally):
  127.31.0.2:80, :8080   HTTP origin         127.31.0.2:443   HTTPS origin (test CA)
  fake DNS on 127.0.0.1:<random>: allowed.test, other.test -> 127.31.0.2; private.test -> 10.0.0.1
  session s1 = 127.0.0.0/24 (clients connect from 127.0.0.1)
  session s2 = 127.0.1.0/24 (clients bind 127.0.1.1); anything else is outside every session.

Only the origins on ports 80 and 443 need root (a rule without a port allows exactly those,
and the transparent listeners dial them by definition). The tests that reach them are in the
modules of ORIGIN_PORT_MODULES, which skip without root; the rest of the tier (DNS, the API,
the CLI, startup) runs as any user.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fakes import FakeDns, FakeHttp, Loop, TestCA
from tests.helpers import control, stop

ORIGIN = "127.31.0.2"
S1_CLIENT = "127.0.0.1"
S2_CLIENT = "127.0.1.1"
OUTSIDE_CLIENT = "127.0.2.1"

APPLIANCE_POLICY = """
[cidr]
allow = ["127.31.0.0/16"]     # the fake internet lives in loopback
"""

S1_POLICY = """
[dns]
allow = ["dnsonly.test"]
[http]
allow = ["allowed.test", "allowed.test:8080", "private.test", "mixed.test", "cname.test",
         "*.wild.test", "fronted.test"]
[deny]
names = ["no.wild.test"]
[host]
ports = [8080]
"""

S2_POLICY = """
[http]
allow = ["other.test"]
"""


ORIGIN_PORT_MODULES = ("tests/integration/filter/test_proxy.py",
                       "tests/integration/filter/test_express.py",
                       "tests/integration/filter/test_control.py",
                       "tests/integration/filter/test_flows.py",
                       "tests/integration/filter/test_differential.py",
                       "tests/integration/filter/test_battery_records.py")
"""Test modules whose tests dial the fake origins on 127.31.0.2:80/443."""


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


def write_config(directory: Path, dns_upstream, extra_config: str = "",
                 control_extra: str = "", dns_extra: str = "", state_extra: str = "",
                 proxy_extra: str = "") -> Path:
    """The filter's config for this tier and the policy files it names, in `directory`."""
    (directory / "appliance.toml").write_text(APPLIANCE_POLICY)
    (directory / "s1.toml").write_text(S1_POLICY)
    (directory / "s2.toml").write_text(S2_POLICY)
    config = directory / "filter.toml"
    config.write_text(f"""
[dns]
listen = ["127.0.0.1:0"]
upstream = ["{dns_upstream[0]}:{dns_upstream[1]}"]
timeout = 0.5
ttl_min = 1
{dns_extra}
[proxy]
listen = ["127.0.0.1:0"]
transparent_http = ["127.0.0.1:0"]
transparent_tls = ["127.0.0.1:0"]
header_timeout = 2
{proxy_extra}
[policy]
files = ["{directory}/appliance.toml"]
[state]
dir = "{directory}/state"
{state_extra}
[control]
socket = "{directory / "filter.sock"}"
{control_extra}
[host]
gateway = "{ORIGIN}"
[[session]]
name = "s1"
subnet = "127.0.0.0/24"
files = ["{directory}/s1.toml"]
[[session]]
name = "s2"
subnet = "127.0.1.0/24"
files = ["{directory}/s2.toml"]
{extra_config}
""")
    return config


class FilterProcess:
    """corral-filter started from its console script with a generated config."""

    def __init__(self, directory: Path, dns_upstream, extra_config: str = "",
                 control_extra: str = "", event_loop: str = "auto", dns_extra: str = "",
                 state_extra: str = "", proxy_extra: str = "", nofile: int | None = None):
        self.dir = directory
        self.event_loop = event_loop
        self.nofile = nofile
        """RLIMIT_NOFILE for the filter process (its hard limit: it raises soft to hard)."""
        self.socket = directory / "filter.sock"
        self.log = directory / "filter.log"
        self.config = write_config(directory, dns_upstream, extra_config, control_extra,
                                   dns_extra, state_extra, proxy_extra)
        self.start()

    def start(self):
        exe = Path(sys.executable).parent / "corral-filter"
        with open(self.log, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen([str(exe), "--config", str(self.config),
                                          "--event-loop", self.event_loop],
                                         stdout=subprocess.DEVNULL, stderr=log,
                                         preexec_fn=self._limit if self.nofile else None)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"corral-filter exited {self.proc.returncode}:\n"
                                   + self.log.read_text())
            if self.socket.exists():
                try:
                    self.status = self.control({"op": "status"})
                    break
                except OSError:
                    pass
            time.sleep(0.05)
        else:
            raise RuntimeError("corral-filter did not come up:\n" + self.log.read_text())
        listeners = self.status["listeners"]

        def port(key):
            return int(listeners[key][0].rsplit(":", 1)[1])

        self.dns_port = port("dns_udp")
        self.proxy_port = port("proxy")
        self.http_port = port("transparent_http")
        self.tls_port = port("transparent_tls")

    def _limit(self):
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def control(self, request: dict) -> dict:
        return control(self.socket, request)

    def events(self, **filters) -> list[dict]:
        return self.control({"op": "events", "last": 10000, **filters})["events"]

    def wait_event(self, predicate, timeout=5.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events():
                if predicate(event):
                    return event
            time.sleep(0.02)
        raise AssertionError("no matching event; last events:\n" + "\n".join(
            json.dumps(e) for e in self.events()[-10:]))

    def stop(self):
        stop(self.proc)

    def restart(self):
        self.stop()
        self.start()


@pytest.fixture(scope="session")
def internet(tmp_path_factory):
    """The fake internet, shared by every integration test. Without root, no origin on
    80/443 (`privileged` says why): the modules that need them skip (see below)."""
    loop = Loop()
    ca = TestCA(tmp_path_factory.mktemp("ca"))
    dns = FakeDns(loop)
    http8080 = FakeHttp(loop, port=8080, host=ORIGIN)
    http80 = https = None
    privileged = None
    try:
        http80 = FakeHttp(loop, port=80, host=ORIGIN)
        https = FakeHttp(loop, ca.server_context(["allowed.test", "other.test", "fronted.test"]),
                         port=443, host=ORIGIN)
    except PermissionError:
        if http80 is not None:
            http80.close()
            http80 = None
        privileged = (f"binding ports 80/443 on {ORIGIN} needs root (run scripts/test as "
                      "root)")
    for name in ("allowed.test", "other.test", "fronted.test", "x.wild.test", "no.wild.test",
                 "dnsonly.test"):
        dns.zone[name] = [("A", ORIGIN, 300), ("AAAA", "2001:db8::1", 300)]
    dns.zone["private.test"] = [("A", "10.0.0.1", 300)]
    dns.zone["mixed.test"] = [("A", "10.0.0.1", 300), ("A", ORIGIN, 300)]
    dns.zone["cname.test"] = [("CNAME", "target.cdn.test.", 300)]
    dns.zone["target.cdn.test"] = [("A", ORIGIN, 300)]

    class Internet:
        pass

    world = Internet()
    world.loop, world.ca, world.dns = loop, ca, dns
    world.http80, world.http8080, world.https = http80, http8080, https
    world.privileged = privileged
    yield world
    for server in (http80, http8080, https, dns):
        if server is not None:
            server.close()
    loop.close()


@pytest.fixture(autouse=True)
def _origin_ports(request):
    """A test in a module that dials the origins on 80/443 skips when they could not be
    bound; it would otherwise fail for want of root, not for a fault."""
    if str(request.node.path).endswith(ORIGIN_PORT_MODULES):
        reason = request.getfixturevalue("internet").privileged
        if reason:
            pytest.skip(reason)


@pytest.fixture(scope="module")
def corral_filter(internet, tmp_path_factory):
    process = FilterProcess(tmp_path_factory.mktemp("filter"), internet.dns.address)
    yield process
    process.stop()


def connect(port: int, source: str = S1_CLIENT, timeout: float = 5) -> socket.socket:
    sock = socket.socket()
    sock.settimeout(timeout)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def recv_all(sock: socket.socket, limit: int = 1 << 24) -> bytes:
    data = b""
    while len(data) < limit:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        data += chunk
    return data


def os_is_root() -> bool:
    return os.geteuid() == 0
