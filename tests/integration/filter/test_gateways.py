"""The filter listens on each session's gateway and nowhere wider (gateways.py): next to a
resolver holding the same port on another address (systemd-resolved's stub, dnsmasq) it
starts; a session added at run time gets its listeners, one removed loses them, and one
whose port is taken is refused, naming address, port, protocol and holder, the filter
serving on. Real corral-filter, real sockets on 127.77.0.0/16."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dnslib import QTYPE, DNSRecord

from tests.helpers import control, stop

from ..conftest import ORIGIN

EXE = str(Path(sys.executable).parent / "corral-filter")
POLICY = """
[http]
allow = ["allowed.test"]
[cidr]
allow = ["127.31.0.0/16"]     # the fake internet lives in loopback
"""


def free_ports(count: int) -> list[int]:
    """Ports free for TCP and UDP on 127.77.0.0/16 (probed on one of its addresses)."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            tcp.bind(("127.77.250.1", 0))
            port = tcp.getsockname()[1]
            try:
                udp.bind(("127.77.250.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def hold(host: str, port: int, protocols=("udp", "tcp")) -> list[socket.socket]:
    """Port `port` on `host`, held as systemd-resolved and dnsmasq hold 53: SO_REUSEADDR,
    TCP listening."""
    held = []
    for protocol in protocols:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if protocol == "udp"
                             else socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        if protocol == "tcp":
            sock.listen()
        held.append(sock)
    return held


def resolve(gateway: str, port: int, client: str, name: str = "allowed.test") -> list[str]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        sock.bind((client, 0))
        sock.sendto(DNSRecord.question(name).pack(), (gateway, port))
        reply = DNSRecord.parse(sock.recv(4096))
    return [str(r.rdata) for r in reply.rr if r.rtype == QTYPE.A]


def refused(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex((host, port)) != 0


class GatewayFilter:
    """corral-filter from its console script, with `config` (state kept across starts)."""

    def __init__(self, directory: Path, config: Path):
        self.dir, self.config = directory, config
        self.start()

    def start(self) -> None:
        with open(self.dir / "filter.log", "ab") as log:  # the child keeps its own copy
            self.process = subprocess.Popen([EXE, "--config", str(self.config)], stderr=log)
        self.wait_started()

    def wait_started(self) -> None:
        deadline = time.monotonic() + 15
        while True:
            try:
                self.control({"op": "status"})
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("corral-filter did not start:\n"
                                         + (self.dir / "filter.log").read_text()) from None
                time.sleep(0.05)

    def control(self, request: dict) -> dict:
        return control(self.dir / "filter.sock", request)


@pytest.fixture
def gateway_filter(internet, tmp_path):
    dns, proxy, http, tls = free_ports(4)
    stub = hold("127.77.0.53", dns)  # a resolver's stub on another address, same port
    (tmp_path / "g.toml").write_text(POLICY)
    config = tmp_path / "filter.toml"
    upstream = "{}:{}".format(*internet.dns.address)
    config.write_text(f"""
[dns]
listen = ["gateway:{dns}"]
upstream = ["{upstream}"]
[proxy]
listen = ["gateway:{proxy}"]
transparent_http = ["gateway:{http}"]
transparent_tls = ["gateway:{tls}"]
[state]
dir = "{tmp_path}/state"
[control]
socket = "{tmp_path}/filter.sock"
[[session]]
name = "g1"
subnet = "127.77.1.0/24"
files = ["{tmp_path}/g.toml"]
""")
    running = GatewayFilter(tmp_path, config)
    running.ports = {"dns": dns, "proxy": proxy, "http": http, "tls": tls}
    running.files = str(tmp_path / "g.toml")
    yield running
    stop(running.process)
    for sock in stub:
        sock.close()


def test_sessions_gateways_are_served_as_sessions_come_and_go(gateway_filter):
    f = gateway_filter
    dns, proxy = f.ports["dns"], f.ports["proxy"]
    listeners = f.control({"op": "status"})["listeners"]
    assert listeners["dns_udp"] == listeners["dns_tcp"] == [f"127.77.1.1:{dns}"]
    assert listeners["proxy"] == [f"127.77.1.1:{proxy}"]
    assert resolve("127.77.1.1", dns, "127.77.1.2") == [ORIGIN]
    assert refused("127.77.0.1", proxy)  # nothing wider than the gateway

    added = f.control({"op": "session-add", "name": "g2", "subnet": "127.77.2.0/24",
                       "files": [f.files]})
    assert added["ok"], added
    assert resolve("127.77.2.1", dns, "127.77.2.2") == [ORIGIN]
    assert not refused("127.77.2.1", proxy)
    assert not refused("127.77.2.1", f.ports["tls"])

    assert f.control({"op": "session-remove", "name": "g2"})["ok"]
    assert refused("127.77.2.1", proxy) and refused("127.77.2.1", dns)
    listeners = f.control({"op": "status"})["listeners"]
    assert all("127.77.2.1" not in a for names in listeners.values() for a in names)


def test_a_session_whose_port_is_taken_is_refused_saying_by_whom(gateway_filter):
    f = gateway_filter
    dns = f.ports["dns"]
    taken = hold("127.77.3.1", dns, ("tcp",))  # UDP binds (both reuse), TCP cannot
    try:
        answer = f.control({"op": "session-add", "name": "g3", "subnet": "127.77.3.0/24"})
    finally:
        for sock in taken:
            sock.close()
    assert not answer["ok"]
    assert answer["error"].startswith(
        f"session g3 not registered: cannot bind 127.77.3.1:{dns} (tcp): Address already in "
        "use (held by ")
    comm = Path("/proc/self/comm").read_text().strip()
    assert answer["error"].endswith(f"(held by {comm} (pid {os.getpid()}) on 127.77.3.1:{dns})")
    status = f.control({"op": "status"})
    assert status["ok"] and f.process.poll() is None  # refused, not crashed
    assert all("127.77.3.1" not in a for names in status["listeners"].values() for a in names)
    names = [s["name"] for s in f.control({"op": "sessions"})["sessions"]]
    assert names == ["g1"]
    # the port free again, the session comes (its UDP twin was not left bound)
    assert f.control({"op": "session-add", "name": "g3", "subnet": "127.77.3.0/24",
                      "files": [f.files]})["ok"]
    assert resolve("127.77.3.1", dns, "127.77.3.2") == [ORIGIN]


def test_a_registered_session_whose_port_is_taken_after_a_restart_is_left_unserved(
        gateway_filter):
    """Registered before a restart (sessions.json), its gateway port taken meanwhile: the
    filter starts and serves the others, and says which session it cannot serve and why."""
    f = gateway_filter
    dns = f.ports["dns"]
    assert f.control({"op": "session-add", "name": "g4", "subnet": "127.77.4.0/24",
                      "files": [f.files]})["ok"]
    stop(f.process)
    taken = hold("127.77.4.1", dns)
    try:
        f.start()
        status = f.control({"op": "status"})
        assert list(status["unserved"]) == ["g4"]
        assert status["unserved"]["g4"].startswith(f"cannot bind 127.77.4.1:{dns} (tcp): "
                                                   "Address already in use (held by ")
        assert resolve("127.77.1.1", dns, "127.77.1.2") == [ORIGIN]  # the others served
        assert all("127.77.4.1" not in a for names in status["listeners"].values()
                   for a in names)
    finally:
        for sock in taken:
            sock.close()
    # added again (as the sandbox service would on its next start), it is served
    assert f.control({"op": "session-add", "name": "g4", "subnet": "127.77.4.0/24",
                      "files": [f.files]})["ok"]
    assert f.control({"op": "status"})["unserved"] == {}
    assert resolve("127.77.4.1", dns, "127.77.4.2") == [ORIGIN]
