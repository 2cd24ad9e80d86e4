"""The proxy's routing and re-serialisation, without sockets: where each request goes on
each kind of connection, and what the upstream is sent."""

from __future__ import annotations

import pytest

from appliance.filter.denied import Denied
from appliance.filter.http import (
    HttpError,
    check_request_line,
    parse_chunk_size,
    parse_request,
    parse_response,
)
from appliance.filter.proxy.flows import Flow, Flows
from appliance.filter.proxy.pipeline import (
    Explicit,
    InTunnel,
    Route,
    Transparent,
    framing,
    judge_request,
    outgoing,
    route,
    strip_empty_lines,
)
from appliance.policy import Decision, Host, parse_host

A = Host(name="a.test")
TUNNEL = InTunnel(A, 80)


def head(text: str):
    return parse_request(text.replace("\n", "\r\n").encode() + b"\r\n")


@pytest.mark.parametrize(("request_text", "mode", "expected"), [
    # explicit: the absolute-form target decides, in any scheme case; Host is rebuilt
    ("GET http://a.test/x?q HTTP/1.1\nHost: a.test\n", Explicit(), ("a.test", 80, "/x?q")),
    ("GET HTTP://A.TEST:8080/ HTTP/1.1\n", Explicit(), ("a.test", 8080, "/")),
    ("GET http://a.test:8080/ HTTP/1.1\nHost: a.test\n", Explicit(), ("a.test", 8080, "/")),
    ("GET http://a.test/ HTTP/1.1\nHost: A.test.:80\n", Explicit(), ("a.test", 80, "/")),
    # transparent: Host, or an absolute-form target (scheme case does not matter)
    ("GET /t HTTP/1.1\nHost: a.test\n", Transparent(80), ("a.test", 80, "/t")),
    ("GET HTTP://a.test/t HTTP/1.1\nHost: a.test\n", Transparent(80), ("a.test", 80, "/t")),
    ("OPTIONS * HTTP/1.1\nHost: a.test\n", Transparent(80), ("a.test", 80, "*")),
    # in a tunnel: the CONNECT target, however the request names it
    ("GET / HTTP/1.1\nHost: a.test\n", TUNNEL, ("a.test", 80, "/")),
    ("GET / HTTP/1.0\n", TUNNEL, ("a.test", 80, "/")),
    ("GET http://a.test/p HTTP/1.1\n", TUNNEL, ("a.test", 80, "/p")),
])
def test_requests_are_routed_to_what_they_name(request_text, mode, expected):
    where = route(head(request_text), mode)
    assert (str(where.host), where.port, where.path) == expected
    assert where.conflict is None


@pytest.mark.parametrize(("request_text", "mode", "conflict"), [
    ("GET http://a.test/ HTTP/1.1\nHost: b.test\n", Explicit(),
     "Host header 'b.test' differs from the request target a.test:80"),
    ("GET HTTP://b.test/ HTTP/1.1\nHost: a.test\n", Transparent(80),
     "Host header 'a.test' differs from the request target b.test:80"),
    ("GET / HTTP/1.1\nHost: a.test:8080\n", Transparent(80), "port 8080 differs"),
    ("GET http://a.test:8080/ HTTP/1.1\n", Transparent(80), "port 8080 differs"),
    ("GET / HTTP/1.1\nHost: b.test\n", TUNNEL,
     "Host header 'b.test' inside the tunnel differs from CONNECT host a.test:80"),
    ("GET / HTTP/1.1\nHost: a.test:81\n", TUNNEL, "inside the tunnel differs"),
    ("GET http://b.test/ HTTP/1.1\nHost: a.test\n", TUNNEL, "inside the tunnel differs"),
])
def test_a_second_name_is_a_conflict_judged_after_the_route(request_text, mode, conflict):
    where = route(head(request_text), mode)
    assert conflict in where.conflict
    if isinstance(mode, InTunnel):  # a tunnel only ever goes where it was opened to
        assert (where.host, where.port) == (A, 80)


def test_a_denied_target_is_reported_by_its_own_name_not_the_host_header():
    """`HTTP://denied/` with `Host: allowed` on port 80: the route is the URI's authority,
    so the policy judges (and the event names) the denied host."""
    where = route(head("GET HTTP://denied.test/ HTTP/1.1\nHost: allowed.test\n"),
                  Transparent(80))
    assert where.host == Host(name="denied.test")


@pytest.mark.parametrize(("request_text", "mode", "status", "message"), [
    ("GET / HTTP/1.1\nHost: a.test\n", Explicit(), 400, "origin-form"),
    ("GET / HTTP/1.1\n", Transparent(80), 400, "no Host header"),
    ("GET https://a.test/ HTTP/1.1\n", Explicit(), 400, "use CONNECT"),
    ("GET a.test/ HTTP/1.1\nHost: a.test\n", Transparent(80), 400, "absolute URI"),
    ("GET * HTTP/1.1\nHost: a.test\n", Transparent(80), 400, "absolute URI"),
    ("CONNECT a.test:443 HTTP/1.1\n", Transparent(80), 405, "CONNECT"),
    ("GET http://a.test@b.test/ HTTP/1.1\n", Explicit(), 400, "credentials"),
    ("GET / HTTP/1.1\nHost: a%2etest\n", Transparent(80), 400, "not a valid host name"),
])
def test_unroutable_requests_are_refused(request_text, mode, status, message):
    with pytest.raises(HttpError, match=message) as info:
        route(head(request_text), mode)
    assert info.value.status == status


def test_connect_inside_a_tunnel_is_denied():
    with pytest.raises(Denied, match="CONNECT inside a tunnel"):
        route(head("CONNECT b.test:443 HTTP/1.1\nHost: b.test:443\n"), TUNNEL)


def test_the_upstream_gets_origin_form_and_a_host_header_built_from_the_route():
    request = head("POST HTTP://A.test:8080/p?q=1 HTTP/1.1\nHost: a.test\nX-Keep: 1\n"
                   "Connection: keep-alive, X-Hop\nX-Hop: gone\nProxy-Authorization: secret\n"
                   "Keep-Alive: 5\nTE: trailers\nContent-Length: 3\n")
    sent = outgoing(request, route(request, Explicit()))
    assert sent == (b"POST /p?q=1 HTTP/1.1\r\nHost: a.test:8080\r\nX-Keep: 1\r\n"
                    b"Content-Length: 3\r\n\r\n")


@pytest.mark.parametrize(("inspected", "host"), [(True, "a.test"), (False, "a.test:443")])
def test_inside_tls_the_filter_ended_https_port_is_left_out_of_host(inspected, host):
    """Host leaves out the scheme's port: https's inside TLS the filter ended (a CDN that
    routes on the exact name refuses `a.test:443`), http's in a plain tunnel to 443."""
    tunnel = InTunnel(parse_host("a.test"), 443, inspected=inspected)
    for request in (head("GET /x HTTP/1.1\nHost: a.test\n"), head("GET /x HTTP/1.0\n"),
                    head("GET http://a.test:443/x HTTP/1.1\n")):
        assert outgoing(request, route(request, tunnel)).split(b"\r\n")[1] == \
            f"Host: {host}".encode()


def test_expect_and_upgrade_are_handled_by_the_proxy():
    request = head("GET http://a.test/ws HTTP/1.1\nConnection: Upgrade\nUpgrade: websocket\n"
                   "Expect: 100-continue\n")
    sent = outgoing(request, route(request, Explicit()), drop_expect=True, upgrade=True)
    assert sent == (b"GET /ws HTTP/1.1\r\nHost: a.test\r\nUpgrade: websocket\r\n"
                    b"Connection: upgrade\r\n\r\n")


def test_ipv6_literals_keep_their_brackets_in_host():
    where = Route(parse_host("2001:db8::1"), 8080, "/")
    assert where.authority == "[2001:db8::1]:8080" and where.target == "[2001:db8::1]:8080"


def test_empty_lines_before_a_request_are_dropped_and_counted():
    assert strip_empty_lines(b"\r\n\r\nGET / HTTP/1.1\r\n\r\n") == (b"GET / HTTP/1.1\r\n\r\n", 2)
    assert strip_empty_lines(b"\nGET") == (b"\nGET", 0)  # a bare LF is not an empty line


# -- framing the parser refuses (anything two parsers could read differently) ----------------


@pytest.mark.parametrize("connection", ["keep-alive, Content-Length", "Transfer-Encoding",
                                        "close, host", "CONTENT-LENGTH"])
def test_connection_may_not_name_a_framing_field(connection):
    with pytest.raises(HttpError, match="framing field") as info:
        parse_request(f"POST http://a.test/ HTTP/1.1\r\nConnection: {connection}\r\n"
                      f"Content-Length: 4\r\n\r\n".encode())
    assert info.value.status == 400
    with pytest.raises(HttpError) as info:
        parse_response(f"HTTP/1.1 200 OK\r\nConnection: {connection}\r\n\r\n".encode())
    assert info.value.status == 502


def test_transfer_encoding_in_an_http_10_request_is_refused():
    with pytest.raises(HttpError, match=r"HTTP/1\.0"):
        parse_request(b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n")


@pytest.mark.parametrize(("line", "size"), [
    (b"0", 0), (b"1a", 26), (b"FFFF", 65535), (b"5;name=value", 5), (b"5 ; ext", 5),
    (b"5;a=\"q\"", 5),
])
def test_chunk_size_lines(line, size):
    assert parse_chunk_size(line) == size


@pytest.mark.parametrize("line", [
    b"", b"5\n", b"5\r", b"\n5", b"5\nGET / HTTP/1.1", b"+5", b"-1", b"0x5", b" 5", b"5 x",
    b"5;\x00", b"5;\x7f", b"1" * 17, b"5;ext\n", b"g",
])
def test_chunk_size_lines_that_parsers_could_read_differently_are_refused(line):
    with pytest.raises(HttpError, match="chunk size"):
        parse_chunk_size(line)


# -- flows and caps ------------------------------------------------------------------------


def test_each_session_has_its_own_caps():
    flows = Flows(max_connections=2, max_tunnels=1)
    connections, tunnels = flows.connections, flows.tunnels
    assert connections.admit("s1") and connections.admit("s1")
    assert not connections.admit("s1")
    assert connections.admit("s2") and connections.admit(None)
    assert tunnels.admit("s1") and not tunnels.admit("s1")
    connections.release("s1")
    assert connections.admit("s1")
    assert dict(connections.held) == {"s1": 2, "s2": 1, None: 1}


def test_refusals_are_reported_once_a_second_with_their_count():
    cap = Flows(max_connections=0, max_tunnels=0).connections
    for _ in range(5):
        cap.admit("s1")
    assert cap.report("s1", now=100.0) == 5
    cap.admit("s1")
    assert cap.report("s1", now=100.5) == 0  # not yet: counted on
    cap.admit("s1")
    assert cap.report("s1", now=101.0) == 2


def test_judge_names_the_flows_the_new_policy_denies():
    flows = Flows(10, 10)
    cut = []
    for n, name in enumerate(["keep.test", "drop.test", "drop.test"]):
        flows.add(Flow(n, "s1", "10.0.0.2", f"10.0.0.2:{n}", "connect", Host(name=name), 443,
                       lambda n=n: cut.append(n)))
    denied = list(flows.denied_by(lambda f: Decision(f.host.name == "keep.test", "x")))
    assert [f.id for f, _ in denied] == [1, 2]
    flows.remove(1)
    assert sorted(flows.open) == [0, 2]


@pytest.mark.parametrize("line", [b"GET / HTTP/1.1", b"OPTIONS * HTTP/1.0",
                                  b"PURGE http://a.test/x?y HTTP/1.1"])
def test_request_lines_that_look_like_http(line):
    check_request_line(line)


@pytest.mark.parametrize("line", [b"SSH-2.0-OpenSSH_9.2p1 Debian-2", b"GET /", b"GET / HTTP/2.0",
                                  b"GET  / HTTP/1.1", b"GET / HTTP/1.1 ", b"\x16\x03\x01",
                                  b"get / http/1.1", b"GET /\t HTTP/1.1"])
def test_what_is_not_an_http_request_line_is_refused_at_its_first_line(line):
    with pytest.raises(HttpError, match=r"not an HTTP/1\.x request line"):
        check_request_line(line)


def test_a_head_of_too_many_fields_is_refused_before_it_costs_the_loop():
    from appliance.filter.http import MAX_FIELDS

    fields = "".join(f"X{i}: v\r\n" for i in range(MAX_FIELDS))
    parse_request(f"GET / HTTP/1.1\r\n{fields}\r\n".encode())
    with pytest.raises(HttpError, match="header fields") as info:
        parse_request(f"GET / HTTP/1.1\r\n{fields}Y: v\r\n\r\n".encode())
    assert info.value.status == 431
    with pytest.raises(HttpError) as info:
        parse_response(f"HTTP/1.1 200 OK\r\n{fields}Y: v\r\n\r\n".encode())
    assert info.value.status == 502


@pytest.mark.parametrize(("fields", "relayed"), [
    ("Connection: Upgrade\nUpgrade: websocket\nSec-WebSocket-Key: k\n", True),
    ("Connection: keep-alive, Upgrade\nUpgrade: WebSocket\nSec-WebSocket-Key: k\n", True),
    ("Connection: Upgrade\nUpgrade: h2c\nHTTP2-Settings: AAMAAABkAAQAAP__\n", False),
    ("Connection: Upgrade\nUpgrade: websocket, h2c\nSec-WebSocket-Key: k\n", False),
    ("Connection: Upgrade\nUpgrade: websocket\n", False),
    ("Upgrade: websocket\nSec-WebSocket-Key: k\n", False),
])
def test_only_a_websocket_upgrade_is_relayed(fields, relayed):
    from appliance.filter.proxy.pipeline import websocket

    request = head(f"GET http://a.test/ HTTP/1.1\n{fields}")
    assert websocket(request) is relayed
    sent = outgoing(request, route(request, Explicit()), upgrade=websocket(request))
    assert (b"Upgrade:" in sent) is relayed and b"HTTP2-Settings" not in sent


@pytest.mark.parametrize("line", ["POST http://a.test/ HTTP/1.1", "GET http://a.test/ HTTP/1.0"])
def test_a_websocket_is_asked_for_by_a_get_in_http_1_1_only(line):
    from appliance.filter.proxy.pipeline import websocket

    assert not websocket(head(f"{line}\nConnection: Upgrade\nUpgrade: websocket\n"
                              "Sec-WebSocket-Key: k\n"))


KEY = "dGhlIHNhbXBsZSBub25jZQ=="
ACCEPT = "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="  # RFC 6455 §1.3's own example


@pytest.mark.parametrize(("fields", "switched"), [
    (f"Upgrade: websocket\nConnection: Upgrade\nSec-WebSocket-Accept: {ACCEPT}\n", True),
    (f"Upgrade: WebSocket\nConnection: keep-alive, upgrade\nSec-WebSocket-Accept:  {ACCEPT}\n",
     True),
    ("", False),  # httpbin's /status/101
    ("Upgrade: websocket\nConnection: Upgrade\n", False),
    ("Upgrade: websocket\nConnection: Upgrade\nSec-WebSocket-Accept: d3Jvbmc=\n", False),
    (f"Upgrade: websocket\nConnection: Upgrade\nSec-WebSocket-Accept: {ACCEPT}\n"
     f"Sec-WebSocket-Accept: {ACCEPT}\n", False),
    (f"Upgrade: h2c\nConnection: Upgrade\nSec-WebSocket-Accept: {ACCEPT}\n", False),
    (f"Upgrade: websocket, h2c\nConnection: Upgrade\nSec-WebSocket-Accept: {ACCEPT}\n", False),
    (f"Upgrade: websocket\nSec-WebSocket-Accept: {ACCEPT}\n", False),
])
def test_only_a_101_that_proves_the_switch_ends_http_on_the_connection(fields, switched):
    from appliance.filter.proxy.pipeline import switch_refusal

    request = head(f"GET http://a.test/ws HTTP/1.1\nConnection: Upgrade\nUpgrade: websocket\n"
                   f"Sec-WebSocket-Key: {KEY}\n")
    reply = parse_response(("HTTP/1.1 101 Switching Protocols\n" + fields + "\n")
                           .replace("\n", "\r\n").encode())
    assert (switch_refusal(request, reply) is None) is switched


def _inspection():
    from appliance.policy import DEFAULT_RULES, Policy, dedupe, policy_file_rules

    text = ('[http]\nallow = ["a.test"]\n[[inspect]]\nhost = "a.test"\n'
            'deny = ["DELETE /**"]\n')  # no allow list: every other reading passes
    return Policy(dedupe([*DEFAULT_RULES, *policy_file_rules(text, "p.toml", "project")])
                  ).inspection(parse_host("a.test"))


def test_a_request_asking_to_be_read_in_too_many_ways_is_refused_before_they_are_judged():
    """Each reading is a decision on the loop (~10 µs): 2000 methods in an override field
    and 100 rewrite fields were 200,000 of them, seconds for one 8 KiB head."""
    methods = ",".join(f"M{i}" for i in range(2000))
    paths = "".join(f"X-Original-URL: /p{i}\n" for i in range(100))
    asked = head(f"POST /a HTTP/1.1\nHost: a.test\nX-HTTP-Method-Override: {methods}\n{paths}")
    decision = judge_request(_inspection(), asked, route(asked, Transparent(80)),
                             Decision(True, "host"))
    assert not decision.allowed
    assert "ways" in decision.reason


def test_a_method_asked_for_again_and_again_is_one_reading():
    asked = head("POST /a HTTP/1.1\nHost: a.test\nX-HTTP-Method-Override: "
                 + ",".join(["GET"] * 500) + "\nX-Original-URL: /b\nX-Rewrite-URL: /b\n")
    assert judge_request(_inspection(), asked, route(asked, Transparent(80)),
                         Decision(True, "host")).allowed


def test_a_method_in_the_query_of_a_rewrite_path_is_judged():
    """IIS's URL Rewrite routes by X-Original-URL, query and all: PHP behind it reads
    `_method` from that query."""
    inspection = _inspection()
    asked = head("POST /a HTTP/1.1\nHost: a.test\nX-Original-URL: /b?_method=DELETE\n")
    decision = judge_request(inspection, asked, route(asked, Transparent(80)),
                             Decision(True, "host"))
    assert not decision.allowed and "DELETE" in decision.reason


@pytest.mark.parametrize("method, head, expected", [
    ("GET", "HTTP/1.1 200 OK\r\nContent-Length: 5", (False, True)),
    ("GET", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked", (False, True)),
    ("GET", "HTTP/1.1 200 OK", (False, False)),  # ends when its connection ends
    ("HEAD", "HTTP/1.1 200 OK", (True, True)),  # a length or none: never a body to a HEAD
    ("GET", "HTTP/1.1 204 No Content", (True, True)),
    ("GET", "HTTP/1.1 304 Not Modified\r\nContent-Length: 9", (True, True)),
])
def test_how_a_response_ends_is_one_rule_for_both_paths(method, head, expected):
    """pipeline.framing: what forward.py relays and what the express lane serves (or hands
    over, unframed) agree on where a response ends."""
    assert framing(method, parse_response(f"{head}\r\n\r\n".encode())) == expected
