"""What one session can hold open, and what a policy change does to what is open: a session at
its caps never affects another, and a flow the new policy denies is cut at once."""

from __future__ import annotations

import socket
import ssl
import time

import pytest

from tests.integration.conftest import ORIGIN, S2_CLIENT, FilterProcess, connect, recv_all

from .test_proxy import body_json, exchange, status_of, tunnel

CONNECTIONS, TUNNELS = 40, 10


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def capped(internet, tmp_path_factory, request):
    """A filter with small per-session caps and a descriptor limit that a session without
    caps would run out (1024: a tunnel costs 8)."""
    process = FilterProcess(
        tmp_path_factory.mktemp("capped"), internet.dns.address, event_loop=request.param,
        proxy_extra=f"max_connections_per_session = {CONNECTIONS}\n"
                    f"max_tunnels_per_session = {TUNNELS}\nkept_upstreams_per_session = 4",
        dns_extra="max_tcp = 4\nmax_pending = 4", nofile=1024)
    yield process
    process.stop()


def keep_alive_get(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection that made one request and stays open (the proxy waits for the next)."""
    sock = connect(port, source)
    sock.sendall(b"GET http://allowed.test/held HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    data = b""
    while b"/held" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the proxy closed before the response came"  # (else: a spin for ever)
        data += chunk
    return sock


def refused(port: int) -> bool:
    """The proxy reset or closed a new connection without a word."""
    with connect(port) as sock:
        try:
            sock.sendall(b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
            return sock.recv(100) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True


def test_a_session_at_its_caps_leaves_the_others_unaffected(capped, internet):
    held = []
    try:
        for _ in range(TUNNELS):
            sock, head = tunnel(capped.proxy_port, "allowed.test:80")
            assert status_of(head) == 200
            held.append(sock)
        sock, head = tunnel(capped.proxy_port, "allowed.test:80")
        assert status_of(head) == 503 and b"too many tunnels" in head
        sock.close()
        while len(held) < CONNECTIONS:
            held.append(keep_alive_get(capped.proxy_port))
        for port in (capped.proxy_port, capped.http_port, capped.tls_port):
            assert refused(port)
        status = capped.control({"op": "status"})
        assert status["proxy"]["per_session"]["s1"] == {"connections": CONNECTIONS,
                                                        "tunnels": TUNNELS}
        assert status["descriptors"]["limit"] == 1024
        # session s2, meanwhile: its DNS, its tunnels, its plain requests all work
        sock, head = tunnel(capped.proxy_port, "other.test:443", S2_CLIENT)
        assert status_of(head) == 200
        context = internet.ca.client_context()
        with context.wrap_socket(sock, server_hostname="other.test") as tls:
            tls.sendall(b"GET /s2 HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n")
            assert body_json(recv_all(tls))["path"] == "/s2"
        raw = exchange(capped.proxy_port, b"GET http://other.test/s2 HTTP/1.1\r\n"
                       b"Host: other.test\r\nConnection: close\r\n\r\n", S2_CLIENT)
        assert status_of(raw) == 200
        events = capped.events(session="s1", verdict="deny")
        assert any("40 connections open" in e["reason"] for e in events)
        assert any("10 tunnels open" in e["reason"] for e in events)
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while capped.control({"op": "status"})["proxy"]["per_session"].get("s1"):
        assert time.monotonic() < deadline, "s1's connections were not released"
        time.sleep(0.05)
    raw = exchange(capped.proxy_port, b"GET http://allowed.test/again HTTP/1.1\r\n"
                   b"Host: allowed.test\r\nConnection: close\r\n\r\n")
    assert body_json(raw)["path"] == "/again"


def test_a_session_that_would_not_fit_the_descriptor_limit_is_refused(capped):
    """1024 descriptors hold (1024 - 256) // (2*40 + 6*10 + 4 + 4 + 4) = 5 shares (the last
    4: idle upstreams kept): s1, s2, clients outside every session, and two more."""
    added = []
    try:
        for n in range(3, 6):
            answer = capped.control({"op": "session-add", "name": f"s{n}",
                                     "subnet": f"127.0.{n}.0/24"})
            if not answer["ok"]:
                break
            added.append(f"s{n}")
        assert added == ["s3", "s4"]
        assert "open-files limit (1024" in answer["error"]
        assert "holds 4 sessions at their caps" in answer["error"]
    finally:
        for name in added:
            capped.control({"op": "session-remove", "name": name})


# -- a policy change cuts what it now denies ----------------------------------------------------


@pytest.fixture
def revocable(corral_filter, internet):
    """cut.test, allowed to s1 by a runtime rule the test then removes."""
    internet.dns.zone["cut.test"] = [("A", ORIGIN, 300)]
    answer = corral_filter.control({"op": "add", "session": "s1", "kind": "http",
                                    "rule": "cut.test"})
    assert answer["ok"], answer
    yield corral_filter
    corral_filter.control({"op": "remove", "session": "s1", "kind": "http", "rule": "cut.test"})


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """The connection ends (EOF or reset) before `seconds`: a hang detector, generous on a
    loaded machine; the cut itself is synchronous with the change."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, ssl.SSLError, ssl.SSLEOFError):
        return True
    except TimeoutError:
        return False


def test_removing_a_rule_cuts_the_flows_it_allowed(revocable, internet):
    corral = revocable
    context = internet.ca.client_context()
    context.check_hostname = False  # the origin's certificate does not name cut.test
    spliced, head = tunnel(corral.proxy_port, "cut.test:443")
    assert status_of(head) == 200
    spliced = context.wrap_socket(spliced, server_hostname="cut.test")
    spliced.sendall(b"GET /one HTTP/1.1\r\nHost: cut.test\r\n\r\n")
    assert b"/one" in spliced.recv(65536)
    plain_inside, head = tunnel(corral.proxy_port, "cut.test:80")
    plain_inside.sendall(b"GET /two HTTP/1.1\r\nHost: cut.test\r\n\r\n")
    assert b"/two" in plain_inside.recv(65536)
    transparent = context.wrap_socket(connect(corral.tls_port), server_hostname="cut.test")
    transparent.sendall(b"GET /three HTTP/1.1\r\nHost: cut.test\r\n\r\n")
    assert b"/three" in transparent.recv(65536)
    keep_alive = connect(corral.proxy_port)
    keep_alive.sendall(b"GET http://cut.test/four HTTP/1.1\r\nHost: cut.test\r\n\r\n")
    assert b"/four" in keep_alive.recv(65536)
    ids_before = {e["id"] for e in corral.events() if e["name"] == "cut.test"}

    answer = corral.control({"op": "remove", "session": "s1", "kind": "http",
                             "rule": "cut.test"})
    assert answer["ok"], answer
    for sock in (spliced, plain_inside, transparent):
        assert closed_within(sock, 5.0)
        sock.close()
    cuts = [e for e in corral.events() if (e["reason"] or "").startswith("cut: ")]
    assert {e["kind"] for e in cuts} >= {"connect", "tls"}
    assert all(e["id"] in ids_before and e["verdict"] == "deny" for e in cuts)
    assert all("cut.test is not in the http policy" in e["reason"] for e in cuts)
    # a keep-alive connection between requests is not cut: its next request is judged
    keep_alive.sendall(b"GET http://cut.test/five HTTP/1.1\r\nHost: cut.test\r\n\r\n")
    assert status_of(recv_all(keep_alive)) == 403
    keep_alive.close()
    assert corral.control({"op": "add", "session": "s1", "kind": "http",
                           "rule": "cut.test"})["ok"]


def test_removing_a_session_cuts_its_flows(corral_filter, internet, tmp_path):
    internet.dns.zone["cut.test"] = [("A", ORIGIN, 300)]
    policy = tmp_path / "s9.toml"
    policy.write_text('[http]\nallow = ["cut.test"]\n')
    answer = corral_filter.control({"op": "session-add", "name": "s9",
                                    "subnet": "127.0.9.0/24", "files": [str(policy)]})
    assert answer["ok"], answer
    try:
        sock, head = tunnel(corral_filter.proxy_port, "cut.test:80", source="127.0.9.1")
        assert status_of(head) == 200
        sock.sendall(b"GET /s9 HTTP/1.1\r\nHost: cut.test\r\n\r\n")
        assert b"/s9" in sock.recv(65536)
    finally:
        assert corral_filter.control({"op": "session-remove", "name": "s9",
                                      "forget_rules": True})["ok"]
    assert closed_within(sock, 5.0)
    sock.close()
    event = corral_filter.wait_event(lambda e: (e["reason"] or "").startswith("cut: ")
                                     and e["session"] == "s9")
    assert (event["kind"], event["name"], event["port"]) == ("connect", "cut.test", 80)


def test_a_flow_still_dialling_is_cut_too(corral_filter, internet):
    """The rule goes while the proxy is still resolving the name: no tunnel opens."""
    internet.dns.zone["slow.test"] = [("A", ORIGIN, 300)]
    internet.dns.slow["slow.test"] = 0.4  # under the filter's upstream timeout (0.5 s)
    assert corral_filter.control({"op": "add", "session": "s1", "kind": "http",
                                  "rule": "slow.test"})["ok"]
    sock = connect(corral_filter.proxy_port)
    sock.sendall(b"CONNECT slow.test:80 HTTP/1.1\r\nHost: slow.test:80\r\n\r\n")
    time.sleep(0.1)
    assert corral_filter.control({"op": "remove", "session": "s1", "kind": "http",
                                  "rule": "slow.test"})["ok"]
    assert recv_all(sock) == b""  # cut: never a 200
    sock.close()
    event = corral_filter.wait_event(lambda e: e["name"] == "slow.test"
                                     and (e["reason"] or "").startswith("cut: "))
    assert event["kind"] == "connect" and event["address"] is None  # it had not dialled yet


@pytest.fixture(scope="module")
def brisk(internet, tmp_path_factory):
    process = FilterProcess(tmp_path_factory.mktemp("brisk"), internet.dns.address,
                            proxy_extra="idle_timeout = 1")
    yield process
    process.stop()


def test_a_client_that_stops_reading_does_not_hold_its_connection(brisk):
    """A response the client never reads: once the socket buffers are full, the proxy gives
    it idle_timeout to take more, then closes, and the session's share comes back."""
    sock = connect(brisk.proxy_port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"GET http://allowed.test/big/20000000 HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    deadline = time.monotonic() + 30  # a hang detector: the proxy gives up after ~1 s idle
    while brisk.control({"op": "status"})["proxy"]["per_session"].get("s1"):
        assert time.monotonic() < deadline, "the stalled connection is still held"
        time.sleep(0.2)
    sock.close()
