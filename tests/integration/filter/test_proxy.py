"""The proxy, explicit and transparent, with real TLS handshakes against a fake origin."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import time

import pytest

from tests.integration.conftest import ORIGIN, S2_CLIENT, connect, recv_all


def exchange(port: int, request: bytes, source: str = "127.0.0.1") -> bytes:
    with connect(port, source) as sock:
        sock.sendall(request)
        return recv_all(sock)


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def header(raw: bytes, name: str) -> str | None:
    head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    for line in head.split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def body_json(raw: bytes) -> dict:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


def tunnel(port: int, target: str, source: str = "127.0.0.1") -> tuple[socket.socket, bytes]:
    sock = connect(port, source)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            break
        head += chunk
    return sock, head


def https_get(sock: socket.socket, internet, server_name: str, path: str = "/") -> dict:
    context = internet.ca.client_context()
    with context.wrap_socket(sock, server_hostname=server_name) as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {server_name}\r\nConnection: close\r\n\r\n"
                    .encode())
        return body_json(recv_all(tls))


def test_the_filter_says_which_event_loop_runs_it(corral_filter):
    assert corral_filter.status["event_loop"] == corral_filter.event_loop


# -- CONNECT ---------------------------------------------------------------------------


def test_connect_to_allowed_host_carries_real_tls(corral_filter, internet):
    sock, head = tunnel(corral_filter.proxy_port, "allowed.test:443")
    assert head.startswith(b"HTTP/1.1 200")
    reply = https_get(sock, internet, "allowed.test", "/hello")
    assert reply["path"] == "/hello" and reply["tls_sni"] == "allowed.test"
    closed = corral_filter.wait_event(
        lambda e: e.get("closed") and e["kind"] == "connect" and e["name"] == "allowed.test")
    assert closed["up"] > 200 and closed["down"] > 200 and closed["address"] == ORIGIN
    assert closed["rule"] == "allowed.test" and closed["layer"] == "project"


def test_tunnels_are_spliced_and_pass_a_half_close_on(corral_filter):
    before = corral_filter.control({"op": "status"})["tunnels"]
    sock, head = tunnel(corral_filter.proxy_port, "allowed.test:80")
    assert head.startswith(b"HTTP/1.1 200")
    with sock:
        sock.sendall(b"GET /half HTTP/1.0\r\nHost: allowed.test\r\n\r\n")
        time.sleep(0.3)  # the tunnel is spliced by now
        sock.shutdown(socket.SHUT_WR)  # the client is done sending; the answer must come
        reply = recv_all(sock)
    assert reply.startswith(b"HTTP/1.") and b" 200 " in reply.split(b"\r\n")[0]
    assert b"/half" in reply
    after = corral_filter.control({"op": "status"})["tunnels"]
    assert after["spliced"] == before["spliced"] + 1 and after["streamed"] == before["streamed"]


def test_http_client_library_through_the_proxy(corral_filter, internet):
    conn = http.client.HTTPSConnection("127.0.0.1", corral_filter.proxy_port, timeout=5,
                                       context=internet.ca.client_context())
    conn.set_tunnel("allowed.test", 443)
    conn.request("GET", "/lib")
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read())["path"] == "/lib"
    conn.close()


def test_connect_to_name_outside_policy_is_403_with_reason_and_command(corral_filter):
    sock, head = tunnel(corral_filter.proxy_port, "other.test:443")
    sock.close()
    assert status_of(head) == 403
    assert header(head, "X-Corral-Deny") == "other.test is not in the http policy"
    assert b"corral allow-http other.test:443" in head
    event = corral_filter.wait_event(lambda e: e["kind"] == "connect" and e["name"] == "other.test")
    assert event["verdict"] == "deny" and event["hint"] == "corral allow-http other.test:443"


def test_connect_on_a_port_the_rule_does_not_cover_is_denied(corral_filter):
    sock, head = tunnel(corral_filter.proxy_port, "allowed.test:22")
    sock.close()
    assert status_of(head) == 403
    assert header(head, "X-Corral-Deny") == "allowed.test is allowed, but not on port 22"


def test_each_session_is_judged_by_its_own_policy(corral_filter, internet):
    sock, head = tunnel(corral_filter.proxy_port, "allowed.test:443", source=S2_CLIENT)
    sock.close()
    assert status_of(head) == 403
    sock, head = tunnel(corral_filter.proxy_port, "other.test:443", source=S2_CLIENT)
    assert status_of(head) == 200
    assert https_get(sock, internet, "other.test")["tls_sni"] == "other.test"


@pytest.mark.parametrize("server_name", ["other.test", "fronted.test"])
def test_sni_different_from_connect_host_is_denied(corral_filter, internet, server_name):
    """Domain fronting: even an SNI the policy allows must match the CONNECT host."""
    sock, head = tunnel(corral_filter.proxy_port, "allowed.test:443")
    assert status_of(head) == 200
    with pytest.raises(ssl.SSLError, match=r"ACCESS_DENIED|access denied"):
        https_get(sock, internet, server_name)
    event = corral_filter.wait_event(
        lambda e: e["verdict"] == "deny" and f"SNI {server_name} differs" in e["reason"])
    assert event["name"] == "allowed.test"


@pytest.mark.parametrize("target", [
    "127.31.0.2:443",  # the origin's own address, allowed only by name
    "2130706433:443",  # 127.0.0.1 spelt as one number
    "[::ffff:127.31.0.2]:443",  # v4-mapped: judged as v4
    "127.0.0.1:22",  # the appliance itself
])
def test_connect_to_ip_literal_is_denied(corral_filter, target):
    sock, head = tunnel(corral_filter.proxy_port, target)
    sock.close()
    assert status_of(head) == 403
    assert "IP literal" in header(head, "X-Corral-Deny")


def test_name_resolving_to_private_address_is_refused(corral_filter):
    sock, head = tunnel(corral_filter.proxy_port, "private.test:443")
    sock.close()
    assert status_of(head) == 403
    assert header(head, "X-Corral-Deny") == (
        "10.0.0.1 is in blocked range 10.0.0.0/8 (private.test resolved to it)")


def test_proxy_skips_blocked_addresses_and_dials_the_checked_one(corral_filter, internet):
    sock, head = tunnel(corral_filter.proxy_port, "mixed.test:80")
    assert status_of(head) == 200
    sock.sendall(b"GET /mixed HTTP/1.1\r\nHost: mixed.test\r\nConnection: close\r\n\r\n")
    assert body_json(recv_all(sock))["path"] == "/mixed"
    sock.close()


def test_second_connect_inside_a_tunnel_is_judged_on_its_target(corral_filter, internet):
    sock, head = tunnel(corral_filter.proxy_port, "allowed.test:80")
    assert status_of(head) == 200
    sock.sendall(b"CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n")
    reply = recv_all(sock)  # answered by the proxy, nothing relayed
    assert status_of(reply) == 403 and b"corral allow-http other.test:443" in reply
    sock.close()
    event = corral_filter.wait_event(lambda e: "CONNECT inside a tunnel" in (e["reason"] or ""))
    assert event["verdict"] == "deny"
    assert not any(r["method"] == "CONNECT" for r in internet.http80.requests)


def test_host_header_inside_tunnel_must_match(corral_filter):
    sock, head = tunnel(corral_filter.proxy_port, "allowed.test:80")
    assert status_of(head) == 200
    sock.sendall(b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n")
    reply = recv_all(sock)
    assert status_of(reply) == 403 and b"differs from CONNECT host" in reply
    sock.close()


# -- plain HTTP through the explicit proxy ---------------------------------------------


def test_absolute_form_get_with_keep_alive(corral_filter, internet):
    with connect(corral_filter.proxy_port) as sock:
        for n in range(3):
            sock.sendall(f"GET http://allowed.test/k{n} HTTP/1.1\r\nHost: allowed.test\r\n"
                         "Proxy-Connection: keep-alive\r\n\r\n".encode())
            data = b""
            while b"\r\n\r\n" not in data:
                data += sock.recv(65536)
            length = int(header(data, "Content-Length"))
            _, _, body = data.partition(b"\r\n\r\n")
            while len(body) < length:
                body += sock.recv(65536)
            reply = json.loads(body)
            assert reply["path"] == f"/k{n}"
            assert "proxy-connection" not in reply["headers"]
            assert reply["headers"]["host"] == "allowed.test"


def test_chunked_request_and_chunked_response(corral_filter):
    body = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    raw = exchange(corral_filter.proxy_port,
                   b"POST http://allowed.test/chunked HTTP/1.1\r\nHost: allowed.test\r\n"
                   b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + body)
    assert status_of(raw) == 200 and header(raw, "Transfer-Encoding") == "chunked"
    chunks, rest = b"", raw.split(b"\r\n\r\n", 1)[1]
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        chunks, rest = chunks + rest[:size], rest[size + 2 :]
    assert json.loads(chunks)["body"] == "hello world"


def test_expect_100_continue_is_answered_by_the_proxy(corral_filter):
    with connect(corral_filter.proxy_port) as sock:
        sock.sendall(b"PUT http://allowed.test/e HTTP/1.1\r\nHost: allowed.test\r\n"
                     b"Content-Length: 5\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(b"hello")
        reply = body_json(recv_all(sock))
    assert reply["body"] == "hello" and "expect" not in reply["headers"]


def test_close_delimited_response_and_port_rule(corral_filter):
    raw = exchange(corral_filter.proxy_port,
                   b"GET http://allowed.test:8080/close HTTP/1.1\r\n"
                   b"Host: allowed.test:8080\r\n\r\n")
    assert status_of(raw) == 200 and body_json(raw)["path"] == "/close"


def test_plain_http_to_denied_host_is_403(corral_filter):
    raw = exchange(corral_filter.proxy_port,
                   b"GET http://other.test/ HTTP/1.1\r\nHost: other.test\r\n\r\n")
    assert status_of(raw) == 403 and b"corral allow-http other.test:80" in raw


def test_host_header_differing_from_absolute_uri_is_denied(corral_filter):
    raw = exchange(corral_filter.proxy_port,
                   b"GET http://allowed.test/ HTTP/1.1\r\nHost: other.test\r\n\r\n")
    assert status_of(raw) == 403
    assert "differs from the request target" in header(raw, "X-Corral-Deny")


def test_userinfo_in_uri_is_refused(corral_filter):
    raw = exchange(corral_filter.proxy_port,
                   b"GET http://allowed.test@other.test/ HTTP/1.1\r\n\r\n")
    assert status_of(raw) == 400


def test_upgrade_switches_to_a_tunnel(corral_filter):
    with connect(corral_filter.proxy_port) as sock:
        sock.sendall(b"GET http://allowed.test/upgrade HTTP/1.1\r\nHost: allowed.test\r\n"
                     b"Connection: Upgrade\r\nUpgrade: echo\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(4096)
        assert status_of(data) == 101
        sock.sendall(b"ping")
        assert sock.recv(4) == b"ping"


def test_host_corral_reaches_only_listed_host_ports(corral_filter):
    raw = exchange(corral_filter.proxy_port,
                   b"GET http://host.corral:8080/h HTTP/1.1\r\nHost: host.corral:8080\r\n\r\n")
    assert status_of(raw) == 200 and body_json(raw)["path"] == "/h"
    raw = exchange(corral_filter.proxy_port,
                   b"GET http://host.corral/h HTTP/1.1\r\nHost: host.corral\r\n\r\n")
    assert status_of(raw) == 403 and b"host.corral:80 is not a listed host port" in raw


def test_malformed_and_oversized_requests_are_answered(corral_filter):
    assert status_of(exchange(corral_filter.proxy_port, b"GARBAGE\r\n\r\n")) == 400
    assert status_of(exchange(corral_filter.proxy_port,
                              b"GET http://allowed.test/ HTTP/1.1\r\nHost: allowed.test\r\n"
                              b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n")) == 400
    huge = b"GET http://allowed.test/ HTTP/1.1\r\nX-Pad: " + b"a" * 70000 + b"\r\n\r\n"
    assert status_of(exchange(corral_filter.proxy_port, huge)) == 431


def test_slow_client_does_not_block_others(corral_filter):
    slow = connect(corral_filter.proxy_port)
    slow.sendall(b"GET http://allowed.test/ HTTP/1.1\r\nHo")  # and then nothing
    raw = exchange(corral_filter.proxy_port,
                   b"GET http://allowed.test/fast HTTP/1.1\r\nHost: allowed.test\r\n"
                   b"Connection: close\r\n\r\n")
    assert body_json(raw)["path"] == "/fast"
    assert status_of(recv_all(slow)) == 408  # header timeout (2 s in this config)
    slow.close()


# -- transparent listeners ------------------------------------------------------------


def test_transparent_http_decides_by_host_header(corral_filter):
    raw = exchange(corral_filter.http_port,
                   b"GET /t HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
    assert status_of(raw) == 200 and body_json(raw)["path"] == "/t"
    raw = exchange(corral_filter.http_port,
                   b"GET /t HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n")
    assert status_of(raw) == 403
    raw = exchange(corral_filter.http_port, b"GET /t HTTP/1.1\r\n\r\n")
    assert status_of(raw) == 400


def test_transparent_tls_decides_by_sni(corral_filter, internet):
    context = internet.ca.client_context()
    client = connect(corral_filter.tls_port)
    with context.wrap_socket(client, server_hostname="allowed.test") as tls:
        tls.sendall(b"GET /sni HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
        assert body_json(recv_all(tls))["tls_sni"] == "allowed.test"
    with pytest.raises(ssl.SSLError, match=r"ACCESS_DENIED|access denied"):
        context.wrap_socket(connect(corral_filter.tls_port), server_hostname="other.test")
    event = corral_filter.wait_event(lambda e: e["kind"] == "tls" and e["name"] == "other.test")
    assert event["verdict"] == "deny"


def test_transparent_tls_without_sni_is_denied(corral_filter, internet):
    context = internet.ca.client_context()
    context.check_hostname = False
    with pytest.raises(ssl.SSLError):
        context.wrap_socket(connect(corral_filter.tls_port), server_hostname=None)
    corral_filter.wait_event(lambda e: e["kind"] == "tls" and "without SNI" in e["reason"])


def test_garbage_on_transparent_tls_gets_an_alert(corral_filter):
    raw = exchange(corral_filter.tls_port, b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00")
    assert raw.startswith(b"\x15\x03\x03")
