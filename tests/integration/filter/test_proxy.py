"""The proxy, explicit and transparent, with real TLS handshakes against a fake origin."""

from __future__ import annotations

import http.client
import json
import os
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


def test_tunnels_are_spliced_and_pass_a_half_close_on(corral_filter, internet):
    before = corral_filter.control({"op": "status"})["tunnels"]
    sock, head = tunnel(corral_filter.proxy_port, "allowed.test:443")
    assert head.startswith(b"HTTP/1.1 200")
    with internet.ca.client_context().wrap_socket(sock, server_hostname="allowed.test") as tls:
        tls.sendall(b"GET /half HTTP/1.1\r\nHost: allowed.test\r\n\r\n")  # keep-alive
        time.sleep(0.3)  # the tunnel is spliced by now
        # the client is done sending (TCP half-close, under TLS): the origin must hear it
        # and end the connection once it has answered
        with socket.socket(fileno=os.dup(tls.fileno())) as raw:
            raw.shutdown(socket.SHUT_WR)
        reply, ended = b"", False
        while not ended:
            chunk = tls.recv(65536)  # a TimeoutError here: the half-close was lost
            reply, ended = reply + chunk, not chunk
    assert reply.startswith(b"HTTP/1.1 200") and b"/half" in reply
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


@pytest.mark.parametrize("inner", ["other.test:443", "allowed.test:443"])
def test_a_second_connect_inside_a_tunnel_is_refused(corral_filter, internet, inner):
    """Even to an allowed target: what followed its 200 would reach the upstream unseen."""
    sock, head = tunnel(corral_filter.proxy_port, "allowed.test:80")
    assert status_of(head) == 200
    sock.sendall(f"CONNECT {inner} HTTP/1.1\r\nHost: {inner}\r\n\r\n".encode())
    reply = recv_all(sock)  # answered by the proxy, nothing relayed
    assert status_of(reply) == 403 and b"CONNECT inside a tunnel" in reply
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
                chunk = sock.recv(65536)
                assert chunk, f"the proxy closed before answer {n}'s head"
                data += chunk
            length = int(header(data, "Content-Length"))
            _, _, body = data.partition(b"\r\n\r\n")
            while len(body) < length:
                chunk = sock.recv(65536)
                assert chunk, f"the proxy closed before answer {n}'s body"
                body += chunk
            reply = json.loads(body)
            assert reply["path"] == f"/k{n}"
            assert "proxy-connection" not in reply["headers"]
            assert reply["headers"]["host"] == "allowed.test"


def test_a_sessions_kept_upstream_serves_its_next_client_connections_only(corral_filter,
                                                                         internet):
    """Plain HTTP's upstream outlives the client connection it was dialled for (pool.py):
    the session's next connection to that origin reuses it; another session, a response
    not read to its end, and any change of policy get a new one."""
    origin, port = internet.http80, corral_filter.proxy_port

    def get(path: str, host: str = "allowed.test", source: str = "127.0.0.1") -> bytes:
        raw = exchange(port, f"GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n"
                       "Connection: close\r\n\r\n".encode(), source)
        assert status_of(raw) == 200, raw[:200]
        return raw

    get("/warm")  # whatever was kept before now holds one for s1
    before = origin.accepted
    for n in range(5):
        assert body_json(get(f"/again{n}"))["path"] == f"/again{n}"
    assert origin.accepted == before  # five client connections, no new upstream one
    get("/other", host="other.test", source=S2_CLIENT)  # s2: never s1's connection
    assert origin.accepted == before + 1
    get("/other2", host="other.test", source=S2_CLIENT)  # and s2's own is kept for it
    assert origin.accepted == before + 1
    answer = corral_filter.control({"op": "add", "session": "s1", "kind": "http",
                                    "rule": "kept.example"})
    assert answer["ok"], answer
    get("/after-change")  # the policy changed: what was kept under the old one is closed
    assert origin.accepted == before + 2
    # a response the client leaves half read: larger than the filter's send buffer can
    # hold (net.ipv4.tcp_wmem's most, 4 MiB here) with the client's receive buffer small;
    # else the whole of it is out of the filter's hands, read to its end, and kept
    # (4 MB once fit a client's receive buffer autotuned to tcp_rmem's 32 MiB)
    with socket.socket() as sock:
        sock.settimeout(5)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.bind(("127.0.0.1", 0))
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"GET http://allowed.test/big/16000000 HTTP/1.1\r\nHost: allowed.test"
                     b"\r\nConnection: close\r\n\r\n")
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
    get("/after-half")
    assert origin.accepted == before + 3  # that upstream was not kept


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


def test_a_websocket_upgrade_switches_to_a_tunnel(corral_filter):
    with connect(corral_filter.proxy_port) as sock:
        sock.sendall(b"GET http://allowed.test/upgrade HTTP/1.1\r\nHost: allowed.test\r\n"
                     b"Connection: Upgrade\r\nUpgrade: websocket\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            assert chunk, "the proxy closed before answering the upgrade"
            data += chunk
        assert status_of(data) == 101
        sock.sendall(b"ping")
        assert sock.recv(4) == b"ping"


def test_a_101_that_switches_nothing_is_not_relayed_as_a_tunnel(corral_filter):
    with connect(corral_filter.proxy_port) as sock:
        sock.sendall(b"GET http://allowed.test/status/101 HTTP/1.1\r\nHost: allowed.test\r\n"
                     b"Connection: Upgrade\r\nUpgrade: websocket\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        data = recv_all(sock)
    assert status_of(data) == 502 and b"answered 101 without switching" in data


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


@pytest.mark.parametrize("method, target", [("GET", "http://allowed.test/h"),
                                            ("CONNECT", "allowed.test:443")])
def test_max_header_bytes_is_the_most_a_request_head_may_be(corral_filter, method, target):
    """A head of exactly `max_header_bytes` (the default, 65536) is read; one byte to four
    more get 431. They were read once: the stream's limit let the read that ends a head run
    past it by the separator's four bytes."""
    limit, port = 65536, corral_filter.proxy_port
    start = f"{method} {target} HTTP/1.1\r\nHost: allowed.test\r\nX-Pad: ".encode()

    def head(length: int) -> bytes:
        return start + b"a" * (length - len(start) - 4) + b"\r\n\r\n"

    for over in (1, 2, 4):
        assert status_of(exchange(port, head(limit + over))) == 431, over
    with connect(port) as sock:
        sock.sendall(head(limit))
        assert sock.recv(64).startswith(b"HTTP/1.1 200"), method


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


# -- no path skips a check (issue 14, A) -------------------------------------------------


def test_a_client_hello_after_a_silence_is_still_checked(corral_filter, internet):
    """Waiting past header_timeout (2 s here) must not open the tunnel uninspected."""
    sock, head = tunnel(corral_filter.proxy_port, "allowed.test:443")
    assert status_of(head) == 200
    time.sleep(2.5)
    with pytest.raises(ssl.SSLError, match=r"ACCESS_DENIED|access denied"):
        https_get(sock, internet, "other.test")
    corral_filter.wait_event(lambda e: "SNI other.test differs" in (e["reason"] or ""))
    sock, head = tunnel(corral_filter.proxy_port, "allowed.test:443")
    time.sleep(2.5)  # and a late hello that names the CONNECT host goes through
    assert https_get(sock, internet, "allowed.test", "/late")["path"] == "/late"


def test_what_the_server_says_first_reaches_the_client_but_not_the_other_way(
        corral_filter, internet):
    """A server-speaks-first upstream is heard at once; the client's reply is still inspected:
    inside a tunnel only TLS and HTTP/1.x are relayed."""
    import asyncio

    async def banner(reader, writer):
        writer.write(b"SSH-2.0-origin\r\n")
        await writer.drain()
        internet.banner_heard.append(await reader.read(100))
        writer.close()

    async def start():
        return await asyncio.start_server(banner, ORIGIN, 0)

    internet.banner_heard = []
    server = internet.loop.run(start())
    port = server.sockets[0].getsockname()[1]
    corral_filter.control({"op": "add", "session": "s1", "kind": "http",
                           "rule": f"allowed.test:{port}"})
    try:
        sock, head = tunnel(corral_filter.proxy_port, f"allowed.test:{port}")
        assert status_of(head) == 200
        heard = head.split(b"\r\n\r\n", 1)[1]  # it may come in one read with the 200
        while len(heard) < 16:
            chunk = sock.recv(100)
            assert chunk, f"the tunnel closed before the origin's banner; heard {heard!r}"
            heard += chunk
        assert heard == b"SSH-2.0-origin\r\n"
        sock.sendall(b"SSH-2.0-client\r\n")
        reply = recv_all(sock)
        sock.close()
        assert status_of(reply) == 400 and b"neither TLS nor HTTP/1.x inside a tunnel" in reply
        assert internet.banner_heard in ([], [b""])  # the upstream heard nothing of it
        event = corral_filter.wait_event(
            lambda e: e["kind"] == "connect" and "neither TLS nor HTTP" in (e["reason"] or ""))
        assert event["verdict"] == "deny" and event["name"] == "allowed.test"
    finally:
        corral_filter.control({"op": "remove", "session": "s1", "kind": "http",
                               "rule": f"allowed.test:{port}"})
        server.close()


@pytest.mark.parametrize("connection", ["keep-alive, Content-Length", "Transfer-Encoding",
                                        "Host"])
def test_connection_naming_a_framing_field_is_refused_on_every_path(corral_filter, internet,
                                                                   connection):
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: other.test\r\n\r\n"
    request = (f"POST {{target}} HTTP/1.1\r\nHost: allowed.test\r\nConnection: {connection}\r\n"
               f"Content-Length: {len(smuggled)}\r\n\r\n").encode() + smuggled
    explicit = exchange(corral_filter.proxy_port,
                        request.replace(b"{target}", b"http://allowed.test/framing"))
    transparent = exchange(corral_filter.http_port, request.replace(b"{target}", b"/framing"))
    sock, _ = tunnel(corral_filter.proxy_port, "allowed.test:80")
    sock.sendall(request.replace(b"{target}", b"/framing"))
    inside = recv_all(sock)
    sock.close()
    for raw in (explicit, transparent, inside):
        assert status_of(raw) == 400 and b"framing field" in raw
        assert header(raw, "X-Corral-Error") is not None
    assert not any(r["path"] in ("/framing", "/smuggled") for r in internet.http80.requests)


def test_chunked_bodies_are_re_framed_and_bad_chunk_lines_refused(corral_filter, internet):
    body = b"5;ext=1\r\nhello\r\nB ; x=\"y\"\r\n 0123456789\r\n0\r\nX-Trailer: t\r\n\r\n"
    raw = exchange(corral_filter.proxy_port,
                   b"POST http://allowed.test/rechunk HTTP/1.1\r\nHost: allowed.test\r\n"
                   b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + body)
    assert status_of(raw) == 200 and body_json(raw)["body"] == "hello 0123456789"
    for bad in (b"3\nabc\r\n0\r\n\r\n", b"3\r\nabc\r\n0\r\nX: a\nb\r\n\r\n",
                b"+3\r\nabc\r\n0\r\n\r\n", b"3\r\nabcX\r\n0\r\n\r\n"):
        raw = exchange(corral_filter.proxy_port,
                       b"POST http://allowed.test/badchunk HTTP/1.1\r\nHost: allowed.test\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\n" + bad)
        assert status_of(raw) == 400 and b"chunk" in raw, raw
    assert not any(r["path"] == "/badchunk" for r in internet.http80.requests)


def test_transparent_absolute_form_is_judged_by_its_authority_in_any_case(corral_filter,
                                                                            internet):
    for scheme in (b"HTTP", b"Http", b"http"):
        raw = exchange(corral_filter.http_port, b"GET " + scheme + b"://other.test/abs "
                       b"HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
        assert status_of(raw) == 403 and header(raw, "X-Corral-Deny") == (
            "other.test is not in the http policy")
    raw = exchange(corral_filter.http_port, b"GET HTTP://allowed.test/abs?x=1 HTTP/1.1\r\n"
                   b"Host: allowed.test\r\nConnection: close\r\n\r\n")
    seen = body_json(raw)
    assert seen["path"] == "/abs?x=1" and seen["headers"]["host"] == "allowed.test"
    assert not any(r["path"].startswith("http") or r["path"].startswith("HTTP")
                   for r in internet.http80.requests)


def test_every_request_inside_a_tunnel_is_judged(corral_filter, internet):
    sock, head = tunnel(corral_filter.proxy_port, "allowed.test:80")
    assert status_of(head) == 200
    sock.sendall(b"GET /in1 HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
                 b"\r\nGET /in2 HTTP/1.1\r\nHost: other.test\r\n\r\n")
    reply = recv_all(sock)
    sock.close()
    first, _, second = reply.partition(b"HTTP/1.1 403")
    assert b"/in1" in first and b"inside the tunnel differs from CONNECT host" in second
    for inner in (b"GET http://other.test/in3 HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
                  b"GET http://other.test/in3 HTTP/1.1\r\n\r\n"):
        sock, _ = tunnel(corral_filter.proxy_port, "allowed.test:80")
        sock.sendall(inner)
        assert status_of(recv_all(sock)) == 403
        sock.close()
    assert not any(r["path"] in ("/in2", "/in3") for r in internet.http80.requests)
    sock, _ = tunnel(corral_filter.proxy_port, "allowed.test:80")
    sock.sendall(b"GET /ten HTTP/1.0\r\n\r\n")  # no Host: it goes where the tunnel goes
    seen = body_json(recv_all(sock))
    sock.close()
    assert seen["path"] == "/ten" and seen["headers"]["host"] == "allowed.test"
    corral_filter.wait_event(lambda e: e["kind"] == "http" and e["name"] == "allowed.test"
                             and e["verdict"] == "deny" and "inside the tunnel" in e["reason"])


def test_absolute_form_replaces_a_host_header_that_differs_only_in_port_notation(
        corral_filter):
    raw = exchange(corral_filter.proxy_port,
                   b"GET http://allowed.test:8080/p8080 HTTP/1.1\r\nHost: allowed.test\r\n"
                   b"Connection: close\r\n\r\n")
    seen = body_json(raw)
    assert seen["path"] == "/p8080" and seen["headers"]["host"] == "allowed.test:8080"


def test_the_proxy_names_its_own_timeouts_properly(corral_filter):
    slow = connect(corral_filter.proxy_port)
    slow.sendall(b"GET http://allowed.test/ HTTP/1.1\r\n")
    assert recv_all(slow).startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    slow.close()


def test_a_name_shaped_for_exfiltration_is_not_resolved_by_the_proxy_either(corral_filter,
                                                                             internet):
    """*.wild.test is allowed; a CONNECT to a name chosen to carry data under it is held to
    the same limits as a DNS query for it, and the name never reaches the upstream."""
    name = f"{'a' * 63}.{'b' * 63}.c.wild.test"
    sock, head = tunnel(corral_filter.proxy_port, f"{name}:443")
    sock.close()
    assert status_of(head) == 403
    assert header(head, "X-Corral-Deny").startswith("looks like DNS exfiltration")
    assert name not in internet.dns.names_asked()
    corral_filter.wait_event(lambda e: e["kind"] == "connect" and e["name"] == name
                             and e["verdict"] == "deny")


@pytest.mark.parametrize("port", ["proxy_port", "http_port"])
def test_an_h2c_upgrade_is_never_relayed(corral_filter, internet, port):
    """HTTP/2 after an upgrade would carry requests for any :authority past the proxy: the
    Upgrade is not forwarded, and an upstream that switches anyway is not listened to."""
    target = b"http://allowed.test/upgrade" if port == "proxy_port" else b"/upgrade"
    raw = exchange(getattr(corral_filter, port),
                   b"GET " + target + b" HTTP/1.1\r\nHost: allowed.test\r\n"
                   b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                   b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
                   b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert status_of(raw) == 502 and b"switched protocols unasked" in raw
    seen = [r for r in internet.http80.requests if r["path"] == "/upgrade"][-1]
    assert "upgrade" not in seen["headers"] and "http2-settings" not in seen["headers"]


def test_a_hello_after_the_upstream_gave_up_on_a_silent_tunnel_is_still_judged(
        corral_filter, internet):
    """A CDN closes a connection that says nothing for some seconds: the client's late
    ClientHello is inspected all the same, and the fronting recorded."""
    import asyncio

    async def impatient(reader, writer):
        await asyncio.sleep(0.5)
        writer.transport.abort()  # a reset, as a CDN may end a silent connection

    async def start():
        return await asyncio.start_server(impatient, ORIGIN, 0)

    server = internet.loop.run(start())
    port = server.sockets[0].getsockname()[1]
    corral_filter.control({"op": "add", "session": "s1", "kind": "http",
                           "rule": f"allowed.test:{port}"})
    try:
        sock, head = tunnel(corral_filter.proxy_port, f"allowed.test:{port}")
        assert status_of(head) == 200
        time.sleep(3.0)  # the upstream has gone, and longer ago than header_timeout (2 s)
        with pytest.raises(ssl.SSLError, match=r"ACCESS_DENIED|access denied"):
            https_get(sock, internet, "other.test")
        corral_filter.wait_event(lambda e: e["name"] == "allowed.test" and e["port"] == port
                                 and "SNI other.test differs" in (e["reason"] or ""))
    finally:
        corral_filter.control({"op": "remove", "session": "s1", "kind": "http",
                               "rule": f"allowed.test:{port}"})
        server.close()


def test_a_tunnel_to_a_name_must_say_the_name_in_its_hello(corral_filter, internet):
    """Without an SNI the server picks whichever vhost it likes: refused, not spliced."""
    sock, head = tunnel(corral_filter.proxy_port, "allowed.test:443")
    assert status_of(head) == 200
    context = internet.ca.client_context()
    context.check_hostname = False
    with pytest.raises(ssl.SSLError, match=r"ACCESS_DENIED|access denied"):
        context.wrap_socket(sock, server_hostname=None)
    corral_filter.wait_event(lambda e: "TLS without SNI inside a tunnel" in (e["reason"] or ""))
