"""Attacks on TLS inspection from inside a sandbox, with the policy's own `[[inspect]]` rules
(not test_inspect.py's stand-in): request rules evaded by method overrides, path spellings,
pipelining and framing inside the decrypted stream; the filter's event loop held by a
ClientHello; inspected hosts reached spliced; descriptors left behind by failures.

Reuses test_inspect.py's world (DNS, origin CA, TLS origins on 127.31.0.3) and its
in-process filter, but leaves the store's policies as they load from the policy files.
"""

from __future__ import annotations

import gzip
import os
import shutil
import ssl
import subprocess
import time

import pytest
from cryptography import x509

from tests.integration.conftest import connect, recv_all
from tests.integration.filter.test_inspect import (
    InProcessFilter,
    client_context,
    get,
    inspect_config,
    interception,  # noqa: F401  (a fixture)
    origins,  # noqa: F401  (a fixture)
    read_response,
    tunnel,
)

POLICY = """
[http]
allow = ["inspected.test:*", "plain.test:*", "allowed.test", "upgrade.test:*"]

[[inspect]]
host = "inspected.test"
allow = ["GET /**", "POST /repos/**", "PUT /repos/**"]
deny = ["* /gists/**", "DELETE /**", "PUT /repos/*/*/pulls/*/merge"]

[[inspect]]
host = "allowed.test"
allow = ["GET /**", "POST /**"]
deny = ["DELETE /**"]
"""


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def real(request, origins, interception, tmp_path_factory):  # noqa: F811
    config = inspect_config(interception, origins.ca.ca_path)
    process = InProcessFilter(tmp_path_factory.mktemp("filter"), origins.dns.address,
                              request.param, config, POLICY)
    yield process
    process.stop()


def inspected(real, interception, port, source="127.0.0.1"):  # noqa: F811
    sock = tunnel(real.proxy_port, f"inspected.test:{port}", source)
    return client_context(interception).wrap_socket(sock, server_hostname="inspected.test")


def seen_since(origins, before):  # noqa: F811
    return [(r["method"], r["path"]) for r in origins["good"].requests[before:]]


# -- (a) past a deny, or outside the allow list ---------------------------------------------


@pytest.mark.parametrize("override", [
    "X-HTTP-Method-Override: DELETE\r\n",
    "X-HTTP-Method: delete\r\n",
    "X-Method-Override: DELETE\r\n",
    "X-HTTP-Method-Override: GET\r\nX-HTTP-Method-Override: DELETE\r\n",
])
def test_a_method_override_header_does_not_carry_a_denied_method(
        real, origins, interception, override):  # noqa: F811
    """Rack (Rails, GitLab), Express, Symfony, ASP.NET and Google's APIs read a POST with
    X-HTTP-Method-Override: DELETE as a DELETE: `DELETE /**` must catch it."""
    port = origins["good"].port
    before = len(origins["good"].requests)
    with inspected(real, interception, port) as tls:
        status, headers, _ = get(tls, f"inspected.test:{port}", "/repos/acme/widget",
                                 method="POST", extra=override, body=b"{}")
    assert status == 403, headers
    assert "DELETE" in headers["x-corral-deny"].upper()
    assert seen_since(origins, before) == []
    real.wait_event(lambda e: e.get("path") == "/repos/acme/widget" and
                    e["verdict"] == "deny" and e.get("method") == "POST")


@pytest.mark.parametrize("query", ["_method=DELETE", "x=1&_method=delete",
                                   "%5Fmethod=DELETE", "_m%65thod=PATCH"])
def test_a_method_override_query_parameter_does_not_carry_a_denied_method(
        real, origins, interception, query):  # noqa: F811
    """Symfony and Laravel read `_method` from the query: PATCH is in no allow list."""
    port = origins["good"].port
    before = len(origins["good"].requests)
    with inspected(real, interception, port) as tls:
        status, headers, _ = get(tls, f"inspected.test:{port}", f"/repos/acme/widget?{query}",
                                 method="POST", body=b"{}")
    assert status == 403, headers
    assert seen_since(origins, before) == []


def _multipart(fields: dict[str, str], boundary: str = "b0undary", eol: str = "\r\n") -> bytes:
    parts = "".join(f"--{boundary}{eol}Content-Disposition: form-data; name=\"{name}\"{eol}"
                    f"{eol}{value}{eol}" for name, value in fields.items())
    return f"{parts}--{boundary}--{eol}".encode()


FORM = "Content-Type: application/x-www-form-urlencoded\r\n"
MULTIPART = "Content-Type: multipart/form-data; boundary=b0undary\r\n"
JSON = "Content-Type: application/json\r\n"


@pytest.mark.parametrize(("extra", "body"), [
    # header names as CGI/WSGI and Puma read them: '_' and '-' are one
    ("X_HTTP_Method_Override: DELETE\r\n", b"{}"),
    ("X-HTTP_METHOD-OVERRIDE: DELETE\r\n", b"{}"),
    ("x_method_override: DELETE\r\n", b"{}"),
    ("X-HTTP-Method-Override: DELETE, GET\r\n", b"{}"),  # Express takes the first
    # bodies Rack, Symfony, Laravel and Spring read `_method` from
    (FORM, b"a=1&_method=DELETE"),
    (FORM, b"_method=delete"),
    (FORM, b"a=1;_method=DELETE"),
    (FORM, b"%5Fmethod=DELETE"),
    (FORM, b"+_method=DELETE"),  # PHP drops leading spaces of a name
    (FORM, b".method=DELETE"),  # and reads '.', ' ' and a lone '[' as '_'
    (FORM, b"[method=DELETE"),
    (FORM, b"_method[]=DELETE"),
    ("", b"_method=DELETE"),  # Rack reads a POST without Content-Type as a form
    ("Content-Type: APPLICATION/X-WWW-FORM-URLENCODED; charset=utf-8\r\n",
     b"_method=DELETE"),
    (MULTIPART, _multipart({"title": "x", "_method": "DELETE"})),
    (MULTIPART, _multipart({"_method": "DELETE"}, eol="\n")),
    ('Content-Type: multipart/form-data; boundary="b0undary"\r\n',
     _multipart({"_method": "DELETE"})),
    (JSON, b'{"title": "x", "_method": "DELETE"}'),
    (JSON, b'{"_method": "GET", "_method": "DELETE"}'),  # parsers keep the first or the last
    ("Content-Type: application/vnd.api+json\r\n", b'{"_method": "DELETE"}'),
    (JSON, b'{"_method": "DELETE", '),  # unreadable, and it names _method: refused
    # as lighttpd, PHP, Rack 2, qs, Laravel and Tomcat read them
    ("X.HTTP.Method.Override: DELETE\r\n", b"{}"),  # lighttpd: any non-alphanumeric is _
    (FORM, b"_method%00x=DELETE"),  # PHP cuts a name at its NUL
    (FORM, b"[_method]=DELETE"),  # Rack 2 and qs drop leading brackets
    (FORM, b"x-http-method-override=DELETE"),  # ASP.NET MVC: the field's name as a form field
    ("Content-Type: \r\n", b"_method=DELETE"),  # Rack: an empty type is no type: a form
    ("Content-Type: application/x-www-form-urlencoded xyz\r\n", b"_method=DELETE"),  # PHP
    ("Content-Type: text/plain; x=/json\r\n", b'{"_method": "DELETE"}'),  # Laravel
    ("Content-Type: multipart/form-data; xboundary=php; boundary=b0undary\r\n",
     _multipart({"_method": "DELETE"}, boundary="php")),  # PHP: the first "boundary"
    ("Content-Type: multipart/form-data; boundary=b0undary; xboundary=rack\r\n",
     _multipart({"_method": "DELETE"}, boundary="rack")),  # Rack: the last "boundary="
    (MULTIPART, _multipart({"a": "1"}) + _multipart({"_method": "DELETE"})),  # PHP reads on
    (MULTIPART, b"--b0undary\r\nContent-ID: _method\r\n\r\nDELETE\r\n--b0undary--\r\n"),
    (MULTIPART, b"--b0undary\r\nContent-Disposition: form-data; name='_method'\r\n\r\n"
                b"DELETE\r\n--b0undary--\r\n"),  # PHP quotes with ' too
    (MULTIPART, b'--b0undary\r\nContent-Disposition: form-data; name="=?UTF-8?B?X21ldGhv'
                b'ZA==?="\r\n\r\nDELETE\r\n--b0undary--\r\n'),  # Tomcat: RFC 2047
])
def test_a_method_override_in_any_form_a_server_stack_reads_is_judged(
        real, origins, interception, extra, body):  # noqa: F811
    port = origins["good"].port
    before = len(origins["good"].requests)
    with inspected(real, interception, port) as tls:
        status, headers, _ = get(tls, f"inspected.test:{port}", "/repos/acme/widget",
                                 method="POST", extra=extra, body=body)
    assert status == 403, headers
    assert seen_since(origins, before) == []


@pytest.mark.parametrize("query", [".method=DELETE", "+_method=DELETE", "%20_method=DELETE",
                                   "[method=DELETE", "_method[]=DELETE", "_METHOD=DELETE"])
def test_query_names_that_php_style_parsers_read_as_method_are_judged(
        real, origins, interception, query):  # noqa: F811
    port = origins["good"].port
    before = len(origins["good"].requests)
    with inspected(real, interception, port) as tls:
        status, headers, _ = get(tls, f"inspected.test:{port}", f"/repos/acme/widget?{query}",
                                 method="POST", body=b"{}")
    assert status == 403, headers
    assert seen_since(origins, before) == []


def test_an_override_in_a_chunked_gzipped_form_body_is_judged(real, origins, interception):  # noqa: F811
    port = origins["good"].port
    before = len(origins["good"].requests)
    body = gzip.compress(b"a=1&_method=DELETE")
    with inspected(real, interception, port) as tls:
        tls.sendall(f"POST /repos/acme/widget HTTP/1.1\r\nHost: inspected.test:{port}\r\n"
                    f"{FORM}Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
                    .encode() + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        status, headers, _ = read_response(tls)
    assert status == 403, headers
    assert seen_since(origins, before) == []


@pytest.mark.parametrize("header", ["X-Original-URL", "X-Rewrite-URL", "x_original_url"])
def test_a_path_given_in_a_rewrite_header_is_judged_as_a_target(
        real, origins, interception, header):  # noqa: F811
    """Symfony (before 5.x) and IIS's URL Rewrite route by these: the path they name must
    pass the rules as the request line's does."""
    port = origins["good"].port
    before = len(origins["good"].requests)
    with inspected(real, interception, port) as tls:
        status, headers, _ = get(tls, f"inspected.test:{port}", "/repos/acme/widget",
                                 extra=f"{header}: /gists/new\r\n")
    assert status == 403, headers
    assert seen_since(origins, before) == []


def test_a_rewrite_path_is_judged_with_the_method_the_body_asks_for(
        real, origins, interception):  # noqa: F811
    """POST to an allowed path, routed by X-Original-URL to a merge, and `_method=PUT` in
    the body: Symfony (before 5) reads PUT .../merge, which a deny names. Each alone passes;
    the body's method must be judged at the rewrite's path too."""
    port = origins["good"].port
    before = len(origins["good"].requests)
    with inspected(real, interception, port) as tls:
        status, headers, _ = get(tls, f"inspected.test:{port}", "/repos/acme/widget",
                                 method="POST", body=b"_method=PUT",
                                 extra=f"{FORM}X-Original-URL: /repos/a/b/pulls/1/merge\r\n")
    assert status == 403, headers
    assert "merge" in headers["x-corral-deny"]
    assert seen_since(origins, before) == []


def test_forms_and_json_without_an_override_still_pass(real, origins, interception):  # noqa: F811
    port = origins["good"].port
    before = len(origins["good"].requests)
    with inspected(real, interception, port) as tls:
        for extra, body in [(FORM, b"method=DELETE&title=_method"), (JSON, b'{"method": "x"}'),
                            (MULTIPART, _multipart({"file": "_method=DELETE"})),
                            ("Content-Type: text/plain\r\n", b"_method=DELETE")]:
            status, headers, _ = get(tls, f"inspected.test:{port}", "/repos/acme/widget",
                                     method="POST", extra=extra, body=body)
            assert status == 200, (extra, body, headers)
    assert len(seen_since(origins, before)) == 4


def test_an_override_to_an_allowed_method_still_passes(real, origins, interception):  # noqa: F811
    port = origins["good"].port
    before = len(origins["good"].requests)
    with inspected(real, interception, port) as tls:
        status, _, _ = get(tls, f"inspected.test:{port}", "/repos/acme/widget", method="POST",
                           extra="X-HTTP-Method-Override: PUT\r\n", body=b"{}")
    assert status == 200
    assert seen_since(origins, before) == [("POST", "/repos/acme/widget")]


@pytest.mark.parametrize(("method", "target"), [
    ("GET", "/Gists"), ("GET", "/GISTS/x"), ("GET", "/%67ists"), ("GET", "/%67ists/"),
    ("GET", "//gists"), ("GET", "/x/../gists"), ("GET", "/x/%2E%2E/gists"),
    ("GET", "/gists;a=b"), ("GET", "/gists%2Fx"), ("GET", "/%2Fgists"), ("GET", "/gists%252F"),
    ("GET", "/gists\\x"), ("GET", "/gists%5Cx"), ("GET", "/./gists"), ("GET", "/gists%00"),
    ("GET", "/%C0%AFgists"), ("delete", "/repos/a/b"), ("DeLeTe", "/repos/a/b"),
    ("PUT", "/repos/a/b/pulls/1/MERGE"), ("PUT", "/repos/a/b/pulls/1/merge/"),
    ("PATCH", "/repos/a/b"), ("HEAD", "/repos/a/b"), ("OPTIONS", "*"),
    ("GET", "http://inspected.test:{port}/gists"), ("GET", "https://inspected.test:{port}/x"),
    ("GET", "http://inspected.test:{port}/x/..%2Fgists"),
    # paths as routers read them: format suffixes, escaped forms of what is refused raw,
    # Unicode a server normalises, an escaped '@'
    ("GET", "/gists.json"), ("GET", "/Gists.JSON/"), ("PUT", "/repos/a/b/pulls/1/merge.json"),
    ("PUT", "/repos/a/b/pulls/1/merge.json.xml"), ("GET", "/gists%3Bx"),
    ("GET", "/x/..%3B/gists"), ("GET", "/gists%3F.json"), ("GET", "/gists%23x"),
    ("GET", "/%EF%BD%87ists"), ("GET", "/g%C4%B1sts/1"), ("GET", "/gi%E2%80%8Bsts"),
    ("GET", "/x%EF%BC%8F..%EF%BC%8Fgists"), ("GET", "/x%u002F..%u002Fgists"),
    ("PUT", "/repos/a/b/pulls/1/%EF%BD%8Derge"), ("POST", "/repos/a/b?a=1;_method=DELETE"),
])
def test_spellings_of_a_denied_or_unlisted_request_never_reach_the_origin(
        real, origins, interception, method, target):  # noqa: F811
    port = origins["good"].port
    target = target.format(port=port)
    before = len(origins["good"].requests)
    with inspected(real, interception, port) as tls:
        tls.sendall(f"{method} {target} HTTP/1.1\r\nHost: inspected.test:{port}\r\n"
                    "Connection: close\r\n\r\n".encode())  # else recv_all waits 5 s
        status = int(recv_all(tls).split(b" ", 2)[1])
    assert status in (400, 403)
    assert seen_since(origins, before) == []


def test_pipelined_and_smuggled_requests_are_each_judged(real, origins, interception):  # noqa: F811
    """Several requests in one TLS record: an allowed GET, a denied DELETE, a POST whose
    body carries a request (Content-Length framing), then a GET. The origin sees exactly
    the allowed ones, each framed as the proxy read it."""
    port = origins["good"].port
    host = f"inspected.test:{port}"
    before = len(origins["good"].requests)
    smuggled = f"DELETE /repos/a/b HTTP/1.1\r\nHost: {host}\r\n\r\n"
    with inspected(real, interception, port) as tls:
        tls.sendall((f"GET /one HTTP/1.1\r\nHost: {host}\r\n\r\n"
                     f"DELETE /repos/a/b HTTP/1.1\r\nHost: {host}\r\n\r\n"
                     f"POST /repos/a/b HTTP/1.1\r\nHost: {host}\r\n"
                     f"Content-Length: {len(smuggled)}\r\n\r\n{smuggled}"
                     f"GET /two HTTP/1.1\r\nHost: {host}\r\n\r\n").encode())
        statuses = [read_response(tls)[0] for _ in range(4)]
    assert statuses == [200, 403, 200, 200]
    assert seen_since(origins, before) == [("GET", "/one"), ("POST", "/repos/a/b"),
                                           ("GET", "/two")]


@pytest.mark.parametrize("framing", [
    "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
    "Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
    "Content-Length: 5\r\nContent-Length: 6\r\n",
    "Transfer-Encoding: xchunked\r\n",
    "Content-Length: +5\r\n",
])
def test_ambiguous_framing_inside_inspected_tls_is_refused(
        real, origins, interception, framing):  # noqa: F811
    port = origins["good"].port
    before = len(origins["good"].requests)
    with inspected(real, interception, port) as tls:
        tls.sendall(f"POST /repos/a/b HTTP/1.1\r\nHost: inspected.test:{port}\r\n{framing}\r\n"
                    f"0\r\n\r\nDELETE /repos/a/b HTTP/1.1\r\nHost: inspected.test\r\n\r\n"
                    .encode())
        reply = recv_all(tls)
    assert reply.startswith(b"HTTP/1.1 400")
    assert seen_since(origins, before) == []


def test_http2_inside_inspected_tls_is_refused_and_recorded(real, origins, interception):  # noqa: F811
    """ALPN h2 is never selected; a client that speaks HTTP/2 anyway is refused."""
    port = origins["good"].port
    context = client_context(interception)
    context.set_alpn_protocols(["h2"])
    sock = tunnel(real.proxy_port, f"inspected.test:{port}")
    with context.wrap_socket(sock, server_hostname="inspected.test") as tls:
        assert tls.selected_alpn_protocol() is None
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        assert recv_all(tls).startswith(b"HTTP/1.1 400")
    real.wait_event(lambda e: "only HTTP/1.x can be inspected" in (e.get("reason") or ""))


def test_a_host_header_other_than_the_sni_is_refused_on_transparent_443(
        real, origins, interception):  # noqa: F811
    if origins.privileged:
        pytest.skip(origins.privileged)
    before = len(origins.https.requests)
    sock = connect(real.tls_port)
    with client_context(interception).wrap_socket(sock, server_hostname="allowed.test") as tls:
        status, headers, _ = get(tls, "inspected.test", "/fronted")
        assert status == 403 and "differs" in headers["x-corral-deny"]
    sock = connect(real.tls_port)
    with client_context(interception).wrap_socket(sock, server_hostname="allowed.test") as tls:
        status, _, _ = get(tls, "allowed.test", "/x", method="POST", body=b"1",
                           extra="X-HTTP-Method-Override: DELETE\r\n")
        assert status == 403
    assert origins.https.requests[before:] == []


# -- (b) an inspected host spliced ------------------------------------------------------------


@pytest.mark.parametrize(("connect_host", "sni"), [
    ("INSPECTED.TEST", "inspected.test"), ("inspected.test.", "inspected.test"),
    ("inspected.test", "INSPECTED.TEST"), ("Inspected.Test.", "inspected.TEST"),
])
def test_spellings_of_an_inspected_host_are_inspected_not_spliced(
        real, origins, interception, connect_host, sni):  # noqa: F811
    port = origins["good"].port
    sock = tunnel(real.proxy_port, f"{connect_host}:{port}")
    with client_context(interception).wrap_socket(sock, server_hostname=sni) as tls:
        issuer = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).issuer
        assert "corral interception CA" in issuer.rfc4514_string()
        assert get(tls, f"inspected.test:{port}", "/gists")[0] == 403


# -- (c) the event loop and descriptors --------------------------------------------------------


def openssl_through(real, port: int, groups: str) -> subprocess.CompletedProcess:
    """`openssl s_client` through the proxy (CONNECT) to inspected.test, offering `groups`."""
    return subprocess.run(
        ["openssl", "s_client", "-proxy", f"127.0.0.1:{real.proxy_port}", "-connect",
         f"inspected.test:{port}", "-servername", "inspected.test", "-groups", groups,
         "-tls1_3", "-brief"], input=b"", capture_output=True, timeout=20, check=False)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_a_client_hello_offering_only_ffdhe8192_does_not_hold_the_loop(
        real, origins):  # noqa: F811
    """OpenSSL 3 accepts the ffdhe groups by default; 8192-bit DH costs the event loop
    (where the handshake runs) 50-150 ms per ClientHello, before the client proves a thing.
    The filter's leaves offer P-256 only (RFC 8446's mandatory group)."""
    port = origins["good"].port
    refused = openssl_through(real, port, "ffdhe8192")
    assert refused.returncode != 0
    assert b"handshake failure" in refused.stderr or b"alert" in refused.stderr, refused.stderr
    real.wait_event(lambda e: "handshake with the client failed" in (e.get("reason") or "")
                    and e["verdict"] == "deny")
    # a client that leads with X25519 is asked again for P-256 (HelloRetryRequest)
    served = openssl_through(real, port, "X25519:P-256")
    assert b"prime256v1" in served.stderr or b"P-256" in served.stderr, served.stderr


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_every_failure_path_closes_both_sides(real, origins, interception):  # noqa: F811
    """Client that refuses the leaf, client that stalls in its handshake, non-HTTP inside,
    a denied request asking to close, an upstream failing verification, a client that
    leaves mid-handshake: afterwards the filter holds no more descriptors than before."""
    port = origins["good"].port
    untrusted = origins["untrusted"].port

    def failures():
        sock = tunnel(real.proxy_port, f"inspected.test:{port}")
        with pytest.raises(ssl.SSLCertVerificationError):
            origins.ca.client_context().wrap_socket(sock, server_hostname="inspected.test")
        sock.close()
        with inspected(real, interception, port) as tls:
            tls.sendall(b"\x00\x01 not http\r\n\r\n")
            recv_all(tls)
        with inspected(real, interception, port) as tls:
            get(tls, f"inspected.test:{port}", "/x", method="DELETE",
                extra="Connection: close\r\n")
            recv_all(tls)
        sock = tunnel(real.proxy_port, f"inspected.test:{port}")
        hello = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = client_context(interception).wrap_bio(*hello, server_hostname="inspected.test")
        with pytest.raises(ssl.SSLWantReadError):
            obj.do_handshake()
        sock.sendall(hello[1].read())
        sock.close()  # gone after its ClientHello
        sock = tunnel(real.proxy_port, f"inspected.test:{untrusted}")  # fails verification
        with client_context(interception).wrap_socket(
                sock, server_hostname="inspected.test") as tls:
            assert get(tls, f"inspected.test:{untrusted}", "/x")[0] == 403

    failures()  # warm: leaves minted, caches filled
    time.sleep(0.5)
    baseline = open_descriptors()
    for _ in range(3):
        failures()
    deadline = time.monotonic() + 5
    while open_descriptors() > baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_descriptors() <= baseline


def test_a_stalled_handshake_is_cut_within_the_header_timeout(real, origins, interception):  # noqa: F811
    port = origins["good"].port
    sock = tunnel(real.proxy_port, f"inspected.test:{port}")
    bios = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = client_context(interception).wrap_bio(*bios, server_hostname="inspected.test")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    sock.sendall(bios[1].read())  # the hello, then nothing
    sock.settimeout(10)
    started = time.monotonic()
    while sock.recv(65536):
        pass
    assert time.monotonic() - started < 5  # header_timeout is 2 s here
    sock.close()
    real.wait_event(lambda e: "handshake with the client failed" in (e.get("reason") or "")
                    and "timed out" in e["reason"])
