"""A neighbour on the same front-end (THREATS 29, issue 26 A4): `front.test` (allowed, not
inspected) and `api.test` (inspected, `DELETE` denied) on one address, served by one TLS
origin that picks the site by the Host header, as sites on one CDN edge or one nginx are.
CONNECT to `front.test`, TLS with the origin's own certificate, then `DELETE` with
`Host: api.test`: the origin served it. Now no tunnel for a name on an inspected host's
address is spliced — on CONNECT and on the transparent listener — and the refusal says
which address and which inspected host; DNS-learned tcp rules do not learn such an address;
a tunnel spliced before is cut when the address turns out to be an inspected host's.

The filter runs in this process (test_inspect.InProcessFilter), with a fake internet of
this module's own on 127.31.0.20-.29 (its origins' CA given to the filter as upstream_ca).
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dnslib import DNSRecord

from appliance.policy import Host
from appliance.sandbox import battery
from tests import fakes
from tests.fakes import FakeHttp
from tests.helpers import control
from tests.integration.conftest import S1_CLIENT, S2_CLIENT, connect, recv_all
from tests.integration.filter.test_inspect import (
    InProcessFilter,
    get,
    inspect_config,
    interception,  # noqa: F401  (a fixture)
    read_response,
)

EDGE = "127.31.0.20"
"""The shared front-end: front.test and api.test."""
ELSEWHERE = "127.31.0.21"
"""elsewhere.test: no inspected host ever lives here."""
WILD = "127.31.0.22"
"""wfront.test, and shared.wild.test (under the inspected *.wild.test)."""
MOVING = "127.31.0.23"
"""still.test; moving.test (inspected) comes to live here later."""
SOON = "127.31.0.24"
"""later.test (spliced) and soon.test, which a policy change comes to inspect."""
NOWHERE = "127.31.0.29"
"""Where moving.test lives first (nothing listens)."""

POLICY = """
[http]
allow = ["front.test:*", "api.test:*", "elsewhere.test:*", "wfront.test:*", "*.wild.test:*",
         "still.test:*", "moving.test:*", "later.test:*", "soon.test:*", "front6.test:*",
         "api6.test:*"]
[tcp]
allow = ["front.test:443"]
[cidr]
allow = ["::1/128"]

[[inspect]]
host = "api.test"
deny = ["DELETE /**"]

[[inspect]]
host = "*.wild.test"

[[inspect]]
host = "moving.test"

[[inspect]]
host = "api6.test"
"""
OTHER = """
[http]
allow = ["front.test:*", "api.test:*"]
"""
"""Session s2's policy: it inspects nothing, so nothing is its neighbour."""


class Internet:
    def __init__(self, directory: Path):
        self.loop = fakes.Loop()
        self.dns = fakes.FakeDns(self.loop)
        self.ca = fakes.TestCA(directory)
        both = self.ca.server_context(["front.test", "api.test"])
        self.edge = FakeHttp(self.loop, both, host=EDGE)
        self.plain = FakeHttp(self.loop, host=EDGE)
        self.elsewhere = FakeHttp(self.loop, self.ca.server_context(["elsewhere.test"]),
                                  host=ELSEWHERE)
        self.wild = FakeHttp(self.loop, self.ca.server_context(["wfront.test"]), host=WILD)
        self.still = FakeHttp(self.loop, self.ca.server_context(["still.test"]), host=MOVING)
        self.later = FakeHttp(self.loop, self.ca.server_context(["later.test"]), host=SOON)
        self.edge443 = self.edge80 = self.v6 = None
        self.privileged = self.no_v6 = None
        try:
            self.edge443 = FakeHttp(self.loop, both, port=443, host=EDGE)
            self.edge80 = FakeHttp(self.loop, port=80, host=EDGE)
        except PermissionError:
            self.privileged = f"binding {EDGE}:443 and :80 needs root"
        try:
            self.v6 = FakeHttp(self.loop, self.ca.server_context(["front6.test", "api6.test"]),
                               host="::1")
        except OSError as exc:
            self.no_v6 = f"no IPv6 loopback here: {exc}"
        zone = {"front.test": EDGE, "api.test": EDGE, "elsewhere.test": ELSEWHERE,
                "wfront.test": WILD, "shared.wild.test": WILD, "still.test": MOVING,
                "moving.test": NOWHERE, "later.test": SOON, "soon.test": SOON}
        for name, address in zone.items():
            self.dns.zone[name] = [("A", address, 1)]
        for name in ("front6.test", "api6.test"):
            self.dns.zone[name] = [("AAAA", "::1", 300)]

    def all(self) -> list[FakeHttp]:
        return [s for s in (self.edge, self.plain, self.elsewhere, self.wild, self.still,
                            self.later, self.edge443, self.edge80, self.v6) if s is not None]

    def seen(self) -> list[dict]:
        return [r for server in self.all() for r in server.requests]

    def close(self) -> None:
        for server in [*self.all(), self.dns]:
            server.close()
        self.loop.close()


@pytest.fixture(scope="module")
def internet(tmp_path_factory):
    world = Internet(tmp_path_factory.mktemp("frontends"))
    yield world
    world.close()


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def lab(request, internet, interception, tmp_path_factory):  # noqa: F811
    directory = tmp_path_factory.mktemp("filter")
    process = InProcessFilter(directory, internet.dns.address, request.param,
                              inspect_config(interception, internet.ca.ca_path), POLICY)
    (directory / "s2.toml").write_text(OTHER)
    inspecting(process, "api.test", False, POLICY, "s2")  # s2's file read again with s1's
    yield process
    process.stop()


def connect_to(lab, target: str, source: str = S1_CLIENT) -> tuple[socket.socket, bytes]:
    """CONNECT, and the proxy's answer head (and what came with it)."""
    sock = connect(lab.proxy_port, source)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        assert chunk, "the proxy closed instead of answering CONNECT"
        head += chunk
    return sock, head


def spliced_get(internet, sock, name: str, host: str, path: str, method: str = "GET"):
    """TLS with the origin's own certificate for `name`, then a request for `host`."""
    tls = internet.ca.client_context().wrap_socket(sock, server_hostname=name)
    return tls, get(tls, host, path, method)


def query(lab, name: str, qtype: str = "A") -> DNSRecord:
    port = int(lab.service.listeners.names["dns_udp"][0].rsplit(":", 1)[1])
    return DNSRecord.parse(DNSRecord.question(name, qtype).send("127.0.0.1", port, timeout=5))


def refusal_of(lab, name: str, since: int = 0) -> dict:
    return lab.wait_event(lambda e: e.get("name") == name and e["verdict"] != "allow"
                          and e.get("id", 0) > since and "address of inspected host"
                          in (e.get("reason") or ""))


def inspecting(lab, name: str, inspected: bool, policy: str, session: str = "s1") -> None:
    """s1's policy file becomes `policy` and the files are read again; wait until the
    filter has them (it reloads on a task of its own), which `name` being inspected (or
    not) in `session` shows."""
    lab.reload(policy)
    host = Host(name=name)

    async def now() -> bool:
        return (lab.service.store.sessions[session].policy.inspection(host) is not None
                ) == inspected
    deadline = time.monotonic() + 10
    while not lab.run(now()):
        assert time.monotonic() < deadline, "the filter did not take the policy"
        time.sleep(0.02)


def last_id(lab) -> int:
    return max((e.get("id") or 0 for e in lab.events()), default=0)


# -- the attack, on every path -------------------------------------------------------------


def test_a_connect_to_a_name_on_an_inspected_hosts_address_is_refused_with_why(
        lab, internet):
    """The attack as reported. The agent never looked api.test up: the filter resolved it
    itself, and refused the tunnel with a 403 that names the address and the host."""
    before = len(internet.seen())
    port = internet.edge.port
    sock, head = connect_to(lab, f"front.test:{port}")
    with sock:
        if head.startswith(b"HTTP/1.1 200"):  # the bypass as it was: the origin serves it
            tls, _ = spliced_get(internet, sock, "front.test", f"api.test:{port}", "/repo",
                                 "DELETE")
            tls.close()
    assert not [r for r in internet.seen()[before:] if r["method"] == "DELETE"]
    assert head.startswith(b"HTTP/1.1 403"), head
    assert "api.test" in internet.dns.names_asked()  # by the filter: the agent never asked
    deny = next(line for line in head.decode().split("\r\n")
                if line.lower().startswith("x-corral-deny:"))
    assert EDGE in deny and "inspected host api.test" in deny
    event = refusal_of(lab, "front.test")
    assert event["kind"] == "connect" and event["verdict"] == "deny"
    assert event["hint"].startswith("corral inspect front.test")


def test_the_transparent_listener_refuses_it_too(lab, internet):
    if internet.privileged:
        pytest.skip(internet.privileged)
    before, since = len(internet.seen()), last_id(lab)
    sock = connect(lab.tls_port)
    with pytest.raises(ssl.SSLError, match=r"ACCESS_DENIED|access denied"):
        spliced_get(internet, sock, "front.test", "api.test", "/repo", "DELETE")
    sock.close()
    assert internet.seen()[before:] == []
    event = refusal_of(lab, "front.test", since)
    assert event["kind"] == "tls" and EDGE in event["reason"]


def test_plain_http_to_the_neighbour_is_judged_by_its_host_header(lab, internet):
    """Plain HTTP is read: the absolute-form target decides, and a Host header naming the
    inspected neighbour is refused (explicit proxy); on the transparent port 80 the Host
    header decides, and api.test's request rules judge it. A CONNECT to the neighbour
    (plain HTTP inside, or TLS) is refused at once: no tunnel to that address."""
    before = len(internet.seen())
    port = internet.plain.port
    with connect(lab.proxy_port) as sock:
        sock.sendall(f"DELETE http://front.test:{port}/repo HTTP/1.1\r\nHost: api.test:{port}"
                     "\r\n\r\n".encode())
        status, headers, _ = read_response(sock)
    assert status == 403 and "api.test" in headers["x-corral-deny"]
    with connect(lab.proxy_port) as sock:
        sock.sendall(f"GET http://front.test:{port}/page HTTP/1.1\r\nHost: front.test:{port}"
                     "\r\n\r\n".encode())
        assert read_response(sock)[0] == 200
    assert internet.plain.requests[-1]["headers"]["host"] == f"front.test:{port}"
    sock, head = connect_to(lab, f"front.test:{port}")
    sock.close()
    assert head.startswith(b"HTTP/1.1 403")
    if internet.edge80 is not None:
        http_port = int(lab.service.listeners.names["transparent_http"][0].rsplit(":", 1)[1])
        with connect(http_port) as sock:
            sock.sendall(b"DELETE /repo HTTP/1.1\r\nHost: api.test\r\n\r\n")
            status, headers, _ = read_response(sock)
        assert status == 403 and "DELETE /repo on api.test denied" in headers["x-corral-deny"]
    assert not [r for r in internet.seen()[before:] if r["method"] == "DELETE"]


def test_a_name_that_shares_no_address_is_spliced_as_ever(lab, internet):
    port = internet.elsewhere.port
    sock, head = connect_to(lab, f"elsewhere.test:{port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    tls, (status, _, _) = spliced_get(internet, sock, "elsewhere.test",
                                      f"elsewhere.test:{port}", "/fine")
    tls.close()
    assert status == 200


def test_a_session_that_does_not_inspect_the_host_is_spliced(lab, internet):
    """Inspection is per session: s2 inspects nothing, so api.test's address is nothing to
    it (it may not evade rules it does not have)."""
    port = internet.edge.port
    sock, head = connect_to(lab, f"front.test:{port}", S2_CLIENT)
    assert head.startswith(b"HTTP/1.1 200"), head
    tls, (status, _, _) = spliced_get(internet, sock, "front.test", f"front.test:{port}", "/")
    tls.close()
    assert status == 200


def test_ipv6_neighbours_are_refused_too(lab, internet):
    if internet.v6 is None:
        pytest.skip(internet.no_v6)
    sock, head = connect_to(lab, f"front6.test:{internet.v6.port}")
    sock.close()
    assert head.startswith(b"HTTP/1.1 403") and b"::1" in head and b"api6.test" in head


# -- what can and cannot be known ------------------------------------------------------------


def test_a_name_under_an_inspected_wildcard_counts_once_it_was_resolved(lab, internet):
    """*.wild.test's names cannot be listed: shared.wild.test's address is known once
    something resolved it (here, the agent's own DNS query), and from then on its
    neighbour wfront.test gets no tunnel. Before that, it was spliced (the limit docs/inspect.md
    states)."""
    port = internet.wild.port
    sock, head = connect_to(lab, f"wfront.test:{port}")
    sock.close()
    assert head.startswith(b"HTTP/1.1 200")  # nobody has resolved a name there yet
    assert query(lab, "shared.wild.test").short() == WILD
    sock, head = connect_to(lab, f"wfront.test:{port}")
    sock.close()
    assert head.startswith(b"HTTP/1.1 403") and b"shared.wild.test" in head


def test_a_tunnel_is_cut_when_an_inspected_host_comes_to_live_at_its_address(lab, internet):
    """still.test is spliced; then moving.test (inspected) is answered at still.test's
    address (a round-robin set, a TTL run out). When the filter hears it, the tunnel is
    cut, with the reason."""
    port = internet.still.port
    sock, head = connect_to(lab, f"still.test:{port}")
    assert head.startswith(b"HTTP/1.1 200")
    tls, (status, _, _) = spliced_get(internet, sock, "still.test", f"still.test:{port}", "/")
    assert status == 200
    internet.dns.zone["moving.test"] = [("A", MOVING, 1)]
    try:
        time.sleep(1.2)  # the old answer's TTL (ttl_min = 1)
        assert query(lab, "moving.test").short() == MOVING
        tls.settimeout(5)
        assert recv_all(tls) == b""
    finally:
        tls.close()
        internet.dns.zone["moving.test"] = [("A", NOWHERE, 1)]
    event = lab.wait_event(lambda e: e.get("name") == "still.test" and "cut:" in (
        e.get("reason") or ""))
    assert "inspected host moving.test" in event["reason"] and MOVING in event["reason"]


def test_a_tunnel_is_cut_when_the_policy_comes_to_inspect_its_neighbour(lab, internet):
    port = internet.later.port
    sock, head = connect_to(lab, f"later.test:{port}")
    assert head.startswith(b"HTTP/1.1 200")
    tls, (status, _, _) = spliced_get(internet, sock, "later.test", f"later.test:{port}", "/")
    assert status == 200
    try:
        inspecting(lab, "soon.test", True, POLICY + '\n[[inspect]]\nhost = "soon.test"\n')
        tls.settimeout(5)
        assert recv_all(tls) == b""
        event = lab.wait_event(lambda e: e.get("name") == "later.test" and "cut:" in (
            e.get("reason") or ""))
        assert "inspected host soon.test" in event["reason"]
    finally:
        tls.close()
        inspecting(lab, "soon.test", False, POLICY)


def test_an_inspected_name_that_cannot_be_resolved_refuses_the_tunnel(lab, internet):
    """Fail closed: nobody can tell which addresses it has."""
    internet.dns.servfail.add("broken.test")
    try:
        inspecting(lab, "broken.test", True, POLICY + '\n[[inspect]]\nhost = "broken.test"\n')
        sock, head = connect_to(lab, f"elsewhere.test:{internet.elsewhere.port}")
        sock.close()
        assert head.startswith(b"HTTP/1.1 502") and b"broken.test" in head
    finally:
        internet.dns.servfail.discard("broken.test")
        inspecting(lab, "broken.test", False, POLICY)


def test_an_inspected_name_whose_ipv6_cannot_be_resolved_refuses_only_ipv6_tunnels(
        lab, internet):
    """A resolver that refuses AAAA for a name it holds only IPv4 for (dnsmasq without an
    upstream does): the name's IPv4 addresses are known, so an IPv4 tunnel is judged by
    them; an IPv6 one cannot be, and is refused."""
    internet.dns.zone["v4only.test"] = [("A", NOWHERE, 300)]
    internet.dns.refuse_aaaa.add("v4only.test")
    policy = POLICY.replace('[[inspect]]\nhost = "api6.test"\n', "") + \
        '\n[[inspect]]\nhost = "v4only.test"\n'
    try:
        inspecting(lab, "v4only.test", True, policy)
        sock, head = connect_to(lab, f"elsewhere.test:{internet.elsewhere.port}")
        sock.close()
        assert head.startswith(b"HTTP/1.1 200"), head
        if internet.v6 is not None:
            sock, head = connect_to(lab, f"front6.test:{internet.v6.port}")
            sock.close()
            assert head.startswith(b"HTTP/1.1 403") and b"v4only.test" in head, head
            assert b"IPv6" in head
    finally:
        internet.dns.refuse_aaaa.discard("v4only.test")
        inspecting(lab, "v4only.test", False, POLICY)


# -- tcp rules (learned from DNS) -------------------------------------------------------------


def test_a_tcp_rule_does_not_learn_an_inspected_hosts_address(lab, internet):
    """A tcp rule for front.test on 443 would let the agent's raw TLS reach api.test's
    front-end: the address is not taught to the firewall, and the DNS event says why."""
    if lab.service.learned is None:
        pytest.skip("nftables is not available to the filter here: nothing is learned")
    since = last_id(lab)
    assert query(lab, "front.test").short() == EDGE  # answered: the proxy may still use it
    event = lab.wait_event(lambda e: e.get("kind") == "dns" and e.get("name") == "front.test"
                           and e.get("qtype") == "A" and e.get("id", 0) > since)
    assert event["learned"] == []
    assert f"{EDGE}:443: front.test is on {EDGE}, an address of inspected host api.test" in (
        event["not_learned"])


# -- the battery's probe ------------------------------------------------------------------------


def test_the_batterys_connect_probe_passes_and_its_denial_is_recorded(lab, internet):
    """neighbour-connect-refused (appliance/selftest/inspection.py) against this filter,
    and the appliance's check that the filter recorded what it met. (Its transparent twin
    needs the firewall's redirect: the e2e tier runs it.)"""
    def control_(request: dict) -> dict:
        return control(lab.directory / "filter.sock", request)

    mark = battery.mark_before(control_)
    result = subprocess.run(
        [sys.executable, "-m", "appliance.selftest", "--json", "--gateway", "127.0.0.1",
         "--dns-port", lab.service.listeners.names["dns_udp"][0].rsplit(":", 1)[1],
         "--proxy-port", str(lab.proxy_port), "--allowed", "elsewhere.test",
         "--inspected", "api.test", "--neighbour", "front.test",
         "--only", "neighbour-connect-refused"], capture_output=True, text=True, timeout=60)
    probes, summary = battery.parse(result.stdout)
    assert summary is not None, result.stderr
    judged = battery.confirm(probes, control_, mark, "s1")
    assert battery.passed(judged), judged
    assert "an address of inspected host api.test" in judged[0]["detail"]
