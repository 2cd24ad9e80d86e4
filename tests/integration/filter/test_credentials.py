"""Secrets held by the filter, for real: stored over the control socket, a placeholder
swapped for the value inside TLS the filter ends to the secret's hosts (reaching a real TLS
origin, which echoes what it got), and every other way out for a placeholder refused before
anything is dialled. The value never shows up in an answer, an event or the audit log."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import json
import zlib

import pytest

from tests.helpers import control
from tests.integration.conftest import S1_CLIENT, S2_CLIENT, connect, recv_all

from .test_inspect import (
    POLICY,
    InProcessFilter,
    client_context,
    get,
    inspect_config,
    interception,  # noqa: F401  (a fixture)
    origins,  # noqa: F401  (a fixture)
    read_response,
    tls_through,
    tunnel,
)

VALUE = "sk-live-0123456789abcdefABCDEF"
GH_VALUE = "ghp_0123456789abcdefghijklmnopqrstuvwxyz"
SCAN_BYTES = 65536


@pytest.fixture(scope="module")
def holding(origins, interception, tmp_path_factory):  # noqa: F811
    """A filter holding two secrets: API_TOKEN for inspected.test (named in [[inspect]]) as
    x-api-key, GH_TOKEN for plain.test (not named: inspected because it is bound) as a
    bearer token."""
    directory = tmp_path_factory.mktemp("filter")
    config = inspect_config(interception, origins.ca.ca_path, f"scan_bytes = {SCAN_BYTES}\n")
    process = InProcessFilter(directory, origins.dns.address, "asyncio", config, POLICY)
    socket = directory / "filter.sock"
    answers = [
        control(socket, {"op": "secret-set", "name": "API_TOKEN", "value": VALUE,
                         "hosts": ["inspected.test"], "scheme": "header", "header": "x-api-key"}),
        control(socket, {"op": "secret-set", "name": "GH_TOKEN", "value": GH_VALUE,
                         "hosts": ["plain.test"]}),
    ]
    assert all(a["ok"] and a["added"] for a in answers), answers
    assert VALUE not in json.dumps(answers) and GH_VALUE not in json.dumps(answers)
    process.socket = socket
    yield process
    process.stop()


def placeholders(process, session: str) -> dict[str, str]:
    answer = control(process.socket, {"op": "secret-environment", "session": session})
    assert answer["ok"], answer
    return answer["environment"]


def test_a_session_gets_placeholders_never_values(holding):
    s1, s2 = placeholders(holding, "s1"), placeholders(holding, "s2")
    assert set(s1) == {"API_TOKEN", "GH_TOKEN"} and s1 != s2
    assert all(p.startswith("corral-secret-") for p in [*s1.values(), *s2.values()])
    unknown = control(holding.socket, {"op": "secret-environment", "session": "nobody"})
    assert not unknown["ok"] and "no session 'nobody'" in unknown["error"]
    listed = control(holding.socket, {"op": "secret-list"})
    assert [s["name"] for s in listed["secrets"]] == ["API_TOKEN", "GH_TOKEN"]
    assert VALUE not in json.dumps(listed) and GH_VALUE not in json.dumps(holding.status())


def test_the_placeholder_becomes_the_value_on_the_secrets_host_inside_tls(
        holding, origins, interception):  # noqa: F811
    port = origins["good"].port
    mine = placeholders(holding, "s1")
    with tls_through(holding, client_context(interception), "inspected.test", port) as tls:
        status, _, body = get(tls, f"inspected.test:{port}", "/v1/messages",
                              extra=f"x-api-key: {mine['API_TOKEN']}\r\n")
    assert status == 200
    assert json.loads(body)["headers"]["x-api-key"] == VALUE
    event = holding.wait_event(lambda e: e.get("path") == "/v1/messages" and
                               not e.get("closed"))
    assert event["secrets"] == ["API_TOKEN"] and VALUE not in json.dumps(event)
    # plain.test has no [[inspect]] table: being a secret's host is enough to be inspected
    with tls_through(holding, client_context(interception), "plain.test", port) as tls:
        status, _, body = get(tls, f"plain.test:{port}", "/user",
                              extra=f"Authorization: token {mine['GH_TOKEN']}\r\n")
    assert status == 200
    assert json.loads(body)["headers"]["authorization"] == f"token {GH_VALUE}"


@pytest.mark.parametrize("case", ["another host", "another session", "the query"])
def test_a_placeholder_going_anywhere_else_is_refused_before_anything_is_sent(
        holding, origins, interception, case):  # noqa: F811
    port = origins["good"].port
    host, source, extra, path = "inspected.test", S1_CLIENT, "", "/v1/x"
    mine = placeholders(holding, "s1")["API_TOKEN"]
    if case == "another host":
        host, extra = "s2.test", f"x-api-key: {mine}\r\n"
    elif case == "another session":
        source, extra = S2_CLIENT, f"x-api-key: {mine}\r\n"
    else:
        path = f"/v1/x?key={mine}"
    before, seen = len(origins["good"].requests), {e["id"] for e in holding.events()}
    with tls_through(holding, client_context(interception), host, port, source) as tls:
        status, headers, _ = get(tls, f"{host}:{port}", path, extra=extra)
        assert status == 403 and "placeholder" in headers["x-corral-deny"]
        assert headers["connection"] == "keep-alive"
        assert get(tls, f"{host}:{port}", "/after")[0] == 200  # the connection goes on
    assert [r["path"] for r in origins["good"].requests[before:]] == ["/after"]
    event = holding.wait_event(lambda e: e.get("kind") == "secret" and e["verdict"] == "deny"
                               and e["id"] not in seen)
    assert event["name"] == host
    assert mine not in json.dumps(event) and VALUE not in json.dumps(event)
    assert event["secret"] == (None if case == "another session" else "API_TOKEN")


def test_plain_http_never_carries_a_placeholder_or_gets_a_value(holding, origins):  # noqa: F811
    mine = placeholders(holding, "s1")["API_TOKEN"]
    with connect(holding.proxy_port) as sock:
        sock.sendall(f"GET http://inspected.test:{origins['good'].port}/x HTTP/1.1\r\n"
                     f"Host: inspected.test\r\nx-api-key: {mine}\r\n"
                     "Connection: close\r\n\r\n".encode())
        reply = recv_all(sock)
    assert reply.startswith(b"HTTP/1.1 403") and b"placeholder" in reply
    assert VALUE.encode() not in reply


def test_the_value_is_in_no_record_and_the_file_is_the_filters_alone(holding):
    audit = b"".join(p.read_bytes() for p in (holding.directory / "state").glob("audit*"))
    assert b"API_TOKEN" in audit  # the secret is named in the records...
    assert VALUE.encode() not in audit and GH_VALUE.encode() not in audit  # ...never shown
    stored = holding.directory / "state" / "secrets.json"
    assert stored.stat().st_mode & 0o777 == 0o600


class HeadEcho:
    """A TLS origin that answers each request head with `reply(head)`: what a hostile or
    careless API could send back."""

    def __init__(self, world, reply):
        self.reply, self.heads = reply, []

        async def serve(reader, writer):
            try:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                writer.write(self.reply(head))
                await writer.drain()
            finally:
                writer.close()

        async def start():
            server = await asyncio.start_server(
                serve, world.ADDRESS, 0, ssl=world.ca.server_context(["plain.test"]))
            return server, server.sockets[0].getsockname()[1]

        self.server, self.port = world.loop.run(start())


def _authorization(head: bytes) -> bytes:
    line = next(x for x in head.split(b"\r\n") if x.lower().startswith(b"authorization:"))
    return line.partition(b":")[2].strip()


@pytest.mark.parametrize("shape", ["a header", "a malformed line", "the status line"])
def test_an_origin_sending_the_secret_back_in_its_head_is_not_passed_on(
        holding, origins, interception, shape):  # noqa: F811
    def reply(head):
        echoed = _authorization(head)
        if shape == "a header":
            return b"HTTP/1.1 200 OK\r\nX-Echo: " + echoed + b"\r\nContent-Length: 0\r\n\r\n"
        if shape == "a malformed line":
            return b"HTTP/1.1 200 OK\r\n" + echoed + b"\r\nContent-Length: 0\r\n\r\n"
        return b"HTTP/1.1 " + echoed + b"\r\n\r\n"

    origin = HeadEcho(origins, reply)
    mine = placeholders(holding, "s1")["GH_TOKEN"]
    with tls_through(holding, client_context(interception), "plain.test", origin.port) as tls:
        status, headers, body = get(tls, f"plain.test:{origin.port}", "/echo",
                                    extra=f"Authorization: Bearer {mine}\r\n")
    assert GH_VALUE.encode() in origin.heads[0]  # it was attached...
    assert status == 502  # ...and does not come back, in the answer, the event or the log
    assert GH_VALUE not in json.dumps(headers) + body.decode("latin-1")
    assert GH_VALUE not in json.dumps(holding.events())
    audit = b"".join(p.read_bytes() for p in (holding.directory / "state").glob("audit*"))
    assert GH_VALUE.encode() not in audit
    origins.loop.loop.call_soon_threadsafe(origin.server.close)


def test_trace_never_carries_a_secret(holding, origins, interception):  # noqa: F811
    port = origins["good"].port
    mine = placeholders(holding, "s1")["GH_TOKEN"]
    before = len(origins["good"].requests)
    with tls_through(holding, client_context(interception), "plain.test", port) as tls:
        status, headers, _ = get(tls, f"plain.test:{port}", "/trace", method="TRACE",
                                 extra=f"Authorization: Bearer {mine}\r\n")
        assert status == 403 and "TRACE sends the request back" in headers["x-corral-deny"]
        assert get(tls, f"plain.test:{port}", "/trace", method="TRACE")[0] == 200  # no secret
    assert [r["method"] for r in origins["good"].requests[before:]] == ["TRACE"]


@pytest.mark.parametrize(("extra", "body"), [
    ("X-HTTP-Method-Override: TRACE\r\n", b"{}"),
    ("Content-Type: application/x-www-form-urlencoded\r\n", b"_method=track"),
])
def test_a_request_asking_to_be_read_as_trace_never_carries_a_secret(
        holding, origins, interception, extra, body):  # noqa: F811
    """An origin that honours overrides and answers TRACE by echoing would hand the value
    back: what a request asks to be read as is an echo as much as its own method."""
    port = origins["good"].port
    mine = placeholders(holding, "s1")["GH_TOKEN"]
    before = len(origins["good"].requests)
    with tls_through(holding, client_context(interception), "plain.test", port) as tls:
        status, headers, _ = get(tls, f"plain.test:{port}", "/x", method="POST", body=body,
                                 extra=f"Authorization: Bearer {mine}\r\n{extra}")
    assert status == 403 and "sends the request back" in headers["x-corral-deny"], headers
    assert len(origins["good"].requests) == before


def test_a_spliced_tunnel_is_cut_when_a_secret_comes_to_be_bound_to_its_host(
        holding, origins):  # noqa: F811
    """A secret's host is inspected (its placeholder is swapped inside TLS the filter ends):
    a tunnel to it spliced before the secret was set could carry any request, as one to a
    host that comes to be named in [[inspect]]."""
    port = origins["plain"].port
    sock = tunnel(holding.proxy_port, f"cut.test:{port}")
    with origins.ca.client_context().wrap_socket(sock, server_hostname="cut.test") as tls:
        assert get(tls, f"cut.test:{port}", "/before")[0] == 200
        stored = control(holding.socket, {"op": "secret-set", "name": "CUT_TOKEN",
                                          "value": "sk-cut-0123456789abcdef",
                                          "hosts": ["cut.test"]})
        try:
            assert stored["ok"], stored
            event = holding.wait_event(lambda e: e.get("name") == "cut.test" and
                                       "inspected now" in (e.get("reason") or ""))
            assert event["verdict"] == "deny"
            with contextlib.suppress(OSError):  # cut: nothing more comes through it
                tls.sendall(f"GET /after HTTP/1.1\r\nHost: cut.test:{port}\r\n\r\n".encode())
            assert recv_all(tls) == b""
        finally:
            control(holding.socket, {"op": "secret-remove", "name": "CUT_TOKEN"})
    assert "/after" not in [r["path"] for r in origins["plain"].requests]


# -- leaks in what a request carries out (proxy/leaks.py) ---------------------------------------


def chunked(tls, host: str, path: str, body: bytes, size: int = 1):
    """A POST whose body is sent in chunks of `size` bytes (a token split across them)."""
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                      for i in range(0, len(body), size))
    tls.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n"
                "\r\n".encode() + chunks + b"0\r\n\r\n")
    return read_response(tls)


@pytest.mark.parametrize(("case", "detector"), [
    ("token", "a GitHub token"), ("value", "the secret API_TOKEN"),
    ("theirs", "a placeholder that is not this session's"), ("split", "a private key"),
    ("query", "a GitHub token")])
def test_a_body_or_target_carrying_a_secret_out_is_refused_before_any_of_it_is_sent(
        holding, origins, interception, case, detector):  # noqa: F811
    port = origins["good"].port
    host = f"inspected.test:{port}"
    body = {"token": f"token={'ghp_' + 'Ab1' * 12}".encode(), "value": VALUE.encode(),
            "theirs": placeholders(holding, "s2")["API_TOKEN"].encode(),
            "split": b"-----BEGIN RSA PRIVATE KEY-----\nMIIE", "query": b""}[case]
    before, seen = len(origins["good"].requests), {e["id"] for e in holding.events()}
    with tls_through(holding, client_context(interception), "inspected.test", port) as tls:
        if case == "split":
            status, headers, _ = chunked(tls, host, "/upload", body)
        elif case == "query":
            status, headers, _ = get(tls, host, "/search?q=ghp_" + "Ab1" * 12)
        else:
            status, headers, _ = get(tls, host, "/upload", "POST", body=body)
        assert status == 403 and detector in headers["x-corral-deny"], headers
        assert get(tls, host, "/after")[0] == 200  # the connection goes on
    assert [r["path"] for r in origins["good"].requests[before:]] == ["/after"]
    event = holding.wait_event(lambda e: e["id"] not in seen and e.get("kind") == "leak")
    assert event["verdict"] == "deny" and event["detector"] == detector
    assert VALUE not in json.dumps(event) and "Ab1Ab1" not in json.dumps(event)


def test_a_clean_body_is_sent_whole_and_the_sessions_own_placeholder_is_no_leak(
        holding, origins, interception):  # noqa: F811
    port = origins["good"].port
    mine = placeholders(holding, "s1")["API_TOKEN"]
    with tls_through(holding, client_context(interception), "inspected.test", port) as tls:
        status, _, body = chunked(tls, f"inspected.test:{port}", "/notes",
                                  f"a note naming {mine}".encode(), size=5)
    assert status == 200
    assert json.loads(body)["body"] == f"a note naming {mine}"


@pytest.mark.parametrize("size", [SCAN_BYTES + 1, 8 << 20])
def test_a_body_too_large_to_read_is_refused_and_says_how_to_let_it_pass(
        holding, origins, interception, size):  # noqa: F811
    """The answer comes from the head, before the body; the client still sending it gets
    the answer, not a reset (the filter reads and drops what comes until it closes: 8 MiB
    is more than the sockets' buffers hold, so the client is mid-write when it is sent)."""
    port = origins["good"].port
    before = len(origins["good"].requests)
    with tls_through(holding, client_context(interception), "inspected.test", port) as tls:
        status, headers, _ = get(tls, f"inspected.test:{port}", "/bulk", "POST",
                                 body=b"x" * size)
    assert status == 413 and "scan = false" in headers["x-corral-error"], headers
    assert len(origins["good"].requests) == before


def test_a_secret_limited_to_requests_reaches_only_those(holding, origins, interception):  # noqa: F811
    answer = control(holding.socket, {"op": "secret-set", "name": "LIMITED_TOKEN",
                                      "value": "sk-limited-0123456789abcdef",
                                      "hosts": ["inspected.test"], "scheme": "header",
                                      "header": "x-limited", "requests": ["GET /v1/read/**"]})
    assert answer["ok"] and answer["secret"]["requests"] == ["GET /v1/read/**"], answer
    port = origins["good"].port
    mine = placeholders(holding, "s1")["LIMITED_TOKEN"]
    before = len(origins["good"].requests)
    try:
        with tls_through(holding, client_context(interception), "inspected.test", port) as tls:
            status, _, body = get(tls, f"inspected.test:{port}", "/v1/read/x",
                                  extra=f"x-limited: {mine}\r\n")
            assert status == 200
            assert json.loads(body)["headers"]["x-limited"] == "sk-limited-0123456789abcdef"
            status, headers, _ = get(tls, f"inspected.test:{port}", "/v1/write", "POST",
                                     extra=f"x-limited: {mine}\r\n", body=b"{}")
            assert status == 403 and "placeholder" in headers["x-corral-deny"], headers
        # refused from its head, with a body still coming: the refusal, not a reset
        with tls_through(holding, client_context(interception), "inspected.test", port) as tls:
            status, headers, _ = get(tls, f"inspected.test:{port}", "/v1/write", "POST",
                                     extra=f"x-limited: {mine}\r\n", body=b"x" * (8 << 20))
            assert status == 403 and "placeholder" in headers["x-corral-deny"], headers
        assert [r["path"] for r in origins["good"].requests[before:]] == ["/v1/read/x"]
    finally:
        control(holding.socket, {"op": "secret-remove", "name": "LIMITED_TOKEN"})


@pytest.mark.parametrize(("extra", "body"), [
    ("Content-Type: application/x-www-form-urlencoded\r\n", b"_method=DELETE"),
    ("X-HTTP-Method-Override: DELETE\r\nContent-Type: text/plain\r\n", b"{}"),
])
def test_a_limited_secret_goes_with_no_request_the_origin_reads_as_another_method(
        holding, origins, interception, extra, body):  # noqa: F811
    """plain.test has no request rules (it is inspected because a secret is bound to it),
    so its bodies were never read for `_method`: a secret limited to `POST /v1/messages`
    went with a request Rack or Laravel read as DELETE /v1/messages."""
    answer = control(holding.socket, {"op": "secret-set", "name": "LIMITED_TOKEN",
                                      "value": "sk-limited-0123456789abcdef",
                                      "hosts": ["plain.test"], "scheme": "header",
                                      "header": "x-limited", "requests": ["POST /v1/messages"]})
    assert answer["ok"], answer
    port = origins["good"].port
    mine = placeholders(holding, "s1")["LIMITED_TOKEN"]
    before = len(origins["good"].requests)
    try:
        with tls_through(holding, client_context(interception), "plain.test", port) as tls:
            status, headers, _ = get(tls, f"plain.test:{port}", "/v1/messages", "POST",
                                     extra=f"x-limited: {mine}\r\n{extra}", body=body)
            assert status == 403, headers
            status, _, echoed = get(tls, f"plain.test:{port}", "/v1/messages", "POST",
                                    extra=f"x-limited: {mine}\r\n", body=b"a=1")
            assert status == 200
            assert json.loads(echoed)["headers"]["x-limited"] == "sk-limited-0123456789abcdef"
        assert [r["path"] for r in origins["good"].requests[before:]] == ["/v1/messages"]
    finally:
        control(holding.socket, {"op": "secret-remove", "name": "LIMITED_TOKEN"})


# -- a held value in a field, and bodies as the origin decodes them ----------------------------


HELD_IN_FIELDS = [
    f"Authorization: Bearer {VALUE}\r\n",
    f"Cookie: a=1; s={VALUE}\r\n",
    "Authorization: Basic " + base64.b64encode(f"me:{VALUE}".encode()).decode() + "\r\n",
    f"X-Note: {VALUE}\r\n",
    f"{VALUE}: a field named after it\r\n",
]


@pytest.mark.parametrize("field", HELD_IN_FIELDS)
def test_a_value_the_agent_holds_goes_nowhere_in_a_field(
        holding, origins, interception, field):  # noqa: F811
    """An agent may come to hold a value (a bound host that echoes it): written into any
    field, or as a field's name, to another inspected host, it is a leak."""
    port = origins["good"].port
    host = f"upgrade.test:{port}"
    before, seen = len(origins["good"].requests), {e["id"] for e in holding.events()}
    with tls_through(holding, client_context(interception), "upgrade.test", port) as tls:
        status, headers, _ = get(tls, host, "/x", extra=field)
        assert status == 403 and "the secret API_TOKEN" in headers["x-corral-deny"], headers
        assert get(tls, host, "/after")[0] == 200
    assert [r["path"] for r in origins["good"].requests[before:]] == ["/after"]
    event = holding.wait_event(lambda e: e["id"] not in seen and e.get("kind") == "leak")
    assert VALUE not in json.dumps(event)


AWS = b"aws_access_key_id=AKIAIOSFODNN7EXAMPLE"
KEY = b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEA\n"


def _deflate_raw(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(("coding", "encode", "plain", "detector"), [
    ("gzip", gzip.compress, AWS, "AWS access key"),
    ("x-gzip", gzip.compress, KEY, "a private key"),
    ("deflate", zlib.compress, VALUE.encode(), "the secret API_TOKEN"),
    ("deflate", _deflate_raw, AWS, "AWS access key"),
    ("gzip, deflate", lambda d: zlib.compress(gzip.compress(d)), KEY, "a private key"),
    ("GZIP", lambda d: gzip.compress(d[:10]) + gzip.compress(d[10:]), AWS,
     "AWS access key"),  # two members, as gzip(1) concatenates them
])
def test_a_compressed_body_is_scanned_as_the_origin_inflates_it(
        holding, origins, interception, coding, encode, plain, detector):  # noqa: F811
    port = origins["good"].port
    before = len(origins["good"].requests)
    with tls_through(holding, client_context(interception), "inspected.test", port) as tls:
        status, headers, _ = get(tls, f"inspected.test:{port}", "/upload", "POST",
                                 extra=f"Content-Encoding: {coding}\r\n", body=encode(plain))
    assert status == 403 and detector in headers["x-corral-deny"], headers
    assert len(origins["good"].requests) == before


@pytest.mark.parametrize(("coding", "body", "complaint"), [
    ("br", b"\x1b\x03\x00\xf8\xa5\x40\x02\x10", "cannot decode"),
    ("zstd", b"\x28\xb5\x2f\xfd\x00\x58\x11\x00\x00", "cannot decode"),
    ("gzip", b"not gzip at all", "not valid gzip"),
    ("gzip", gzip.compress(b"x")[:-4], "ends before its stream"),
    ("gzip", gzip.compress(b"0" * (16 << 20)), "expands past"),
    ("gzip", gzip.compress(b"x") + b"trailing", "after the gzip stream"),
])
def test_a_body_the_filter_cannot_decode_is_refused_on_a_host_that_scans(
        holding, origins, interception, coding, body, complaint):  # noqa: F811
    port = origins["good"].port
    before = len(origins["good"].requests)
    with tls_through(holding, client_context(interception), "inspected.test", port) as tls:
        status, headers, _ = get(tls, f"inspected.test:{port}", "/upload", "POST",
                                 extra=f"Content-Encoding: {coding}\r\n", body=body)
    assert status == 403 and complaint in headers["x-corral-deny"], headers
    assert len(origins["good"].requests) == before


def test_a_clean_compressed_body_reaches_the_origin_as_it_was_sent(
        holding, origins, interception):  # noqa: F811
    port = origins["good"].port
    sent = gzip.compress(b'{"note": "nothing to see"}')
    with tls_through(holding, client_context(interception), "inspected.test", port) as tls:
        status, _, answer = get(tls, f"inspected.test:{port}", "/upload", "POST",
                                extra="Content-Encoding: gzip\r\n", body=sent)
    assert status == 200
    assert json.loads(answer)["body"].encode("latin-1") == sent


def test_a_token_in_a_base64_multipart_part_is_found(holding, origins, interception):  # noqa: F811
    port = origins["good"].port
    body = (b"--xyz\r\nContent-Disposition: form-data; name=\"file\"\r\n"
            b"Content-Transfer-Encoding: base64\r\n\r\n" + base64.encodebytes(KEY)
            + b"\r\n--xyz--\r\n")
    with tls_through(holding, client_context(interception), "inspected.test", port) as tls:
        status, headers, _ = get(tls, f"inspected.test:{port}", "/upload", "POST",
                                 extra="Content-Type: multipart/form-data; boundary=xyz\r\n",
                                 body=body)
    assert status == 403 and "a private key" in headers["x-corral-deny"], headers


@pytest.mark.parametrize("shape", ["a malformed trailer line", "a trailer field's name",
                                   "a trailer after a bad chunk"])
def test_an_origin_quoting_the_secret_in_a_broken_body_gets_no_word_of_it_out(
        holding, origins, interception, shape):  # noqa: F811
    """A bound host answers a chunked body whose trailer quotes the Authorization the
    filter attached: the reason the filter gives (to the client, the events, the audit log)
    names what is wrong without the value, or any beginning of it a cut would leave."""
    def reply(head):
        echoed = _authorization(head)
        trailer = {"a malformed trailer line": echoed,
                   "a trailer field's name": echoed.replace(b" ", b"") + b" : x",
                   "a trailer after a bad chunk": echoed}[shape]
        chunk = b"1\r\nx\r\n" if shape != "a trailer after a bad chunk" else b"1 " + echoed + \
            b"\r\nx\r\n"
        return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk
                + b"0\r\n" + trailer + b"\r\n\r\n")

    origin = HeadEcho(origins, reply)
    mine = placeholders(holding, "s1")["GH_TOKEN"]
    with tls_through(holding, client_context(interception), "plain.test", origin.port) as tls:
        tls.sendall(f"GET /echo HTTP/1.1\r\nHost: plain.test:{origin.port}\r\n"
                    f"Authorization: Bearer {mine}\r\n\r\n".encode())
        answer = recv_all(tls)
    assert GH_VALUE.encode() in origin.heads[0]  # it was attached
    said = [answer.decode("latin-1"), json.dumps(holding.events()),
            b"".join(p.read_bytes() for p in (holding.directory / "state").glob("audit*"))
            .decode("latin-1")]
    for text in said:
        assert GH_VALUE[:8] not in text, text[-400:]
    origins.loop.loop.call_soon_threadsafe(origin.server.close)
