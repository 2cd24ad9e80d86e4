"""TLS inspection, with real handshakes: a Python `ssl` client that trusts the interception CA,
the filter terminating its TLS, and real TLS origins on loopback behind it (their own test
CA, given to the filter as `upstream_ca`).

The filter runs in this process, on uvloop and on asyncio's loop (a thread each), with the
sessions' policy files naming the inspected hosts in `[[inspect]]` tables: nothing of the
filter or the policy is replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest
from cryptography import x509

from appliance import pki
from appliance.filter.service import Service, loop_factory
from appliance.sessionconfig import load_config
from tests import fakes
from tests.fakes import FakeHttp
from tests.helpers import control
from tests.integration.conftest import S1_CLIENT, S2_CLIENT, connect, recv_all, write_config

FLOOD = 40
"""Distinct names under the inspected wildcard in the flood test."""
LEAF_CACHE = 8
MINT_BURST = 20


# -- the filter, in this process ---------------------------------------------------------------


def inspect_config(interception: Path, upstream_ca: str | None = None, extra: str = "") -> str:
    """The filter's [inspect] table: the interception CA `interception` holds, `upstream_ca`
    (the origins' CA) as what upstreams are verified against, and `extra` lines after them
    (more keys of the table, or tables of their own)."""
    lines = ["[inspect]", f'ca_cert = "{interception / "intercept-ca.crt"}"',
             f'ca_key = "{interception / "intercept-ca.key"}"']
    if upstream_ca is not None:
        lines.append(f'upstream_ca = "{upstream_ca}"')
    return "\n" + "\n".join(lines) + "\n" + extra


class InProcessFilter:
    """corral-filter's Service on a loop thread."""

    def __init__(self, directory: Path, dns, event_loop: str, inspect: str, policy: str,
                 dns_extra: str = "", proxy_extra: str = ""):
        config_path = write_config(directory, dns, extra_config=inspect, dns_extra=dns_extra,
                                   proxy_extra=proxy_extra)
        self.directory = directory
        (directory / "s1.toml").write_text(policy)
        (directory / "s2.toml").write_text(policy)
        factory = loop_factory(event_loop)
        self.loop = factory() if factory else asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="filter", daemon=True)
        self.thread.start()
        self.service = self.run(self._start(load_config(str(config_path))))
        listeners = self.service.listeners.names
        self.proxy_port = int(listeners["proxy"][0].rsplit(":", 1)[1])
        self.tls_port = int(listeners["transparent_tls"][0].rsplit(":", 1)[1])

    async def _start(self, config) -> Service:
        service = Service(config)
        await service.start()
        return service

    def run(self, coro, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def status(self) -> dict:
        async def status():
            return self.service.status.describe()
        return self.run(status())

    def events(self) -> list[dict]:
        async def recent():
            return list(self.service.bus.recent)
        return self.run(recent())

    def wait_event(self, predicate, timeout: float = 5.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events():
                if predicate(event):
                    return event
            time.sleep(0.02)
        raise AssertionError("no matching event; last events:\n" + "\n".join(
            json.dumps(e, default=str) for e in self.events()[-10:]))

    def reload(self, policy: str) -> None:
        """Session s1's policy file becomes `policy`, read again as SIGHUP has it read."""
        (self.directory / "s1.toml").write_text(policy)

        async def reload():
            self.service.reload()
        self.run(reload())

    def stop(self) -> None:
        """As corral-filter stops (asyncio.Runner): the service, then every task left."""
        async def stop():
            await self.service.stop()
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # transports those tasks closed finish on the loop's next rounds: let them, or
            # they are collected unclosed later and warn in another module's test
            await asyncio.sleep(0.05)
            await self.loop.shutdown_asyncgens()
            await self.loop.shutdown_default_executor()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def interception(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("intercept")
    pki.write_intercept_ca(*pki.intercept_ca(), directory)
    return directory


class World:
    """This module's own fake internet, on 127.31.0.3 (inside the appliance policy's cidr
    allow, beside conftest's shared one, whose fixed ports another run may hold): a DNS
    server, an origin CA the filter is told to trust, and TLS origins on ports of their own:
    `good`, `untrusted` (a CA nobody trusts), `mismatch` (trusted, but for another name),
    and `https` on 443 for the transparent listener (None without root). The names spliced
    here (spliced.test, cut.test) live on an address of their own, served by `plain`: a name
    on an inspected host's address gets no tunnel (neighbours.py)."""

    ADDRESS = "127.31.0.3"
    PLAIN = "127.31.0.16"

    def __init__(self, directory: Path):
        self.loop = fakes.Loop()
        self.dns = fakes.FakeDns(self.loop)
        (directory / "origin-ca").mkdir()
        (directory / "stranger-ca").mkdir()
        self.ca = fakes.TestCA(directory / "origin-ca")
        stranger = fakes.TestCA(directory / "stranger-ca")
        names = ["inspected.test", "plain.test", "upgrade.test", "cut.test", "allowed.test",
                 "s2.test", "spliced.test",
                 *(f"n{i}.flood.test" for i in range(FLOOD))]
        self.servers = {
            "good": FakeHttp(self.loop, self.ca.server_context(names), host=self.ADDRESS),
            "untrusted": FakeHttp(self.loop, stranger.server_context(["untrusted.test"]),
                                  host=self.ADDRESS),
            "mismatch": FakeHttp(self.loop, self.ca.server_context(["elsewhere.test"]),
                                 host=self.ADDRESS),
            "plain": FakeHttp(self.loop, self.ca.server_context(names), host=self.PLAIN),
        }
        self.https, self.privileged = None, None
        try:
            self.https = FakeHttp(self.loop, self.ca.server_context(names), port=443,
                                  host=self.ADDRESS)
        except PermissionError:
            self.privileged = f"binding {self.ADDRESS}:443 needs root"
        for name in [*names, "untrusted.test", "mismatch.test", "noca.test"]:
            self.dns.zone[name] = [("A", self.ADDRESS, 300)]
        for name in ("spliced.test", "cut.test"):
            self.dns.zone[name] = [("A", self.PLAIN, 300)]

    def __getitem__(self, name: str) -> FakeHttp:
        return self.servers[name]

    def close(self) -> None:
        for server in [*self.servers.values(), self.https, self.dns]:
            if server is not None:
                server.close()
        self.loop.close()


@pytest.fixture(scope="module")
def origins(tmp_path_factory):
    world = World(tmp_path_factory.mktemp("world"))
    yield world
    world.close()


POLICY = """
[http]
allow = ["inspected.test:*", "plain.test:*", "spliced.test:*", "untrusted.test:*",
         "mismatch.test:*", "upgrade.test:*", "cut.test:*", "*.flood.test:*", "allowed.test",
         "noca.test:*", "s2.test:*"]

[[inspect]]
host = "inspected.test"
deny = ["DELETE /**", "* /gists/**"]

[[inspect]]
host = "allowed.test"
deny = ["* /denied/**"]
""" + "".join(f'\n[[inspect]]\nhost = "{host}"\n' for host in (
    "untrusted.test", "mismatch.test", "upgrade.test", "*.flood.test", "noca.test", "s2.test"))
"""The sessions' policy: every host allowed, all but plain.test, spliced.test and cut.test
inspected (a table with no allow list lets every request through that no deny matches)."""


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def inspecting(request, origins, interception, tmp_path_factory):
    config = inspect_config(interception, origins.ca.ca_path, f"""leaf_cache = {LEAF_CACHE}
mint_burst = {MINT_BURST}
mint_rate = 0.01
""")
    process = InProcessFilter(tmp_path_factory.mktemp("filter"), origins.dns.address,
                              request.param, config, POLICY,
                              dns_extra="exfil_names = 1000")
    yield process
    process.stop()


# -- clients -----------------------------------------------------------------------------------


def client_context(interception: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(interception / "intercept-ca.crt"))


def tunnel(port: int, target: str, source: str = S1_CLIENT) -> socket.socket:
    sock = connect(port, source)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, "the proxy closed instead of answering CONNECT"
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def tls_through(filter_: InProcessFilter, context: ssl.SSLContext, name: str, port: int,
                source: str = S1_CLIENT) -> ssl.SSLSocket:
    return context.wrap_socket(tunnel(filter_.proxy_port, f"{name}:{port}", source),
                               server_hostname=name)


def read_response(sock) -> tuple[int, dict[str, str], bytes]:
    """One response framed by Content-Length (all the proxy and the fake origin send)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed inside a response body"
        body += chunk
    return int(lines[0].split(" ")[1]), headers, body


def get(sock, host: str, path: str, method: str = "GET", extra: str = "", body: bytes = b""):
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{extra}".encode()
                 + (f"Content-Length: {len(body)}\r\n" if body else "").encode()
                 + b"\r\n" + body)
    return read_response(sock)


# -- the tests ----------------------------------------------------------------------------------


def test_an_allowed_request_reaches_the_origin_exactly_as_re_serialised(
        inspecting, origins, interception):
    port = origins["good"].port
    with tls_through(inspecting, client_context(interception), "inspected.test", port) as tls:
        tls.sendall(f"POST /upload?x=1 HTTP/1.1\r\nHost: inspected.test:{port}\r\n"
                    "X-Keep: 1\r\nConnection: keep-alive, X-Drop\r\nX-Drop: secret\r\n"
                    "Proxy-Connection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
                    "5;ext=1\r\nhello\r\n0\r\n\r\n".encode())
        status, _, body = read_response(tls)
    assert status == 200
    seen = json.loads(body)
    assert seen == {"method": "POST", "path": "/upload?x=1", "body": "hello",
                    "tls_sni": "inspected.test",
                    "headers": {"host": f"inspected.test:{port}", "x-keep": "1",
                                # read whole for leaks (leaks.py), then sent with its length
                                "content-length": "5"}}
    event = inspecting.wait_event(lambda e: e.get("path") == "/upload" and not e.get("closed"))
    assert event["verdict"] == "allow" and event["method"] == "POST"
    assert "x=1" not in json.dumps(event)  # the query stays out of events


def test_a_sessions_next_connection_resumes_its_tls_to_the_upstream_never_anothers(
        inspecting, origins, interception):
    """The filter's TLS to an inspected upstream resumes the session's last one there
    (inspect.ResumingContext): the upstream sees a resumed handshake for s1's second
    connection, and a full one for s2's first, s1's ticket being s1's alone."""
    origin, context = origins["good"], client_context(interception)
    port = origin.port

    def one(source: str) -> bool:
        with tls_through(inspecting, context, "inspected.test", port, source) as tls:
            assert get(tls, f"inspected.test:{port}", "/resume")[0] == 200
        deadline = time.monotonic() + 5
        while len(origin.resumed) < seen + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        return origin.resumed[-1]

    seen = len(origin.resumed)
    one(S1_CLIENT)  # whatever s1 had before, it holds a ticket after this one
    seen += 1
    assert one(S1_CLIENT) is True
    seen += 1
    assert one(S2_CLIENT) is False  # never s1's ticket
    seen += 1
    assert one(S2_CLIENT) is True


def test_the_client_sees_a_corral_leaf_for_the_host_and_http_1_1(
        inspecting, origins, interception):
    context = client_context(interception)
    context.set_alpn_protocols(["h2", "http/1.1"])
    with tls_through(inspecting, context, "inspected.test", origins["good"].port) as tls:
        leaf = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))
        assert tls.selected_alpn_protocol() == "http/1.1"
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
    ca = x509.load_pem_x509_certificate((interception / "intercept-ca.crt").read_bytes())
    leaf.verify_directly_issued_by(ca)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["inspected.test"]
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc < ca.not_valid_after_utc - \
        ca.not_valid_before_utc


def test_denied_requests_get_403_with_the_reason_and_the_connection_goes_on(
        inspecting, origins, interception):
    port = origins["good"].port
    host = f"inspected.test:{port}"
    before = len(origins["good"].requests)
    with tls_through(inspecting, client_context(interception), "inspected.test", port) as tls:
        assert get(tls, host, "/one")[0] == 200
        status, headers, body = get(tls, host, "/repo", method="DELETE")
        assert status == 403 and headers["connection"] == "keep-alive"
        assert headers["x-corral-deny"] == ("DELETE /repo on inspected.test denied by request "
                                            "rule !inspected.test DELETE /** (project layer)")
        assert b"DELETE /repo on inspected.test" in body
        status, headers, _ = get(tls, host, "/gists", method="POST", body=b'{"a": 1}')
        assert status == 403 and "/gists" in headers["x-corral-deny"]
        assert get(tls, host, "/two")[0] == 200  # the same connection, still in step
    paths = [r["path"] for r in origins["good"].requests[before:]]
    assert paths == ["/one", "/two"]
    event = inspecting.wait_event(lambda e: e.get("method") == "DELETE")
    assert event["verdict"] == "deny" and event["kind"] == "http"
    assert event["name"] == "inspected.test" and event["path"] == "/repo"


def test_a_denied_request_that_asks_to_close_is_answered_and_closed(
        inspecting, origins, interception):
    port = origins["good"].port
    with tls_through(inspecting, client_context(interception), "inspected.test", port) as tls:
        status, headers, _ = get(tls, f"inspected.test:{port}", "/x", method="DELETE",
                                 extra="Connection: close\r\n")
        assert status == 403 and headers["connection"] == "close"
        assert recv_all(tls) == b""


def test_inside_inspected_tls_a_request_for_another_host_is_refused(
        inspecting, origins, interception):
    """Domain fronting, which a splice cannot see (test_attack_tls.py): the SNI names an
    allowed host, the Host header inside another. Inspected, the request is refused."""
    port = origins["good"].port
    before = len(origins["good"].requests)
    with tls_through(inspecting, client_context(interception), "inspected.test", port) as tls:
        status, headers, _ = get(tls, f"plain.test:{port}", "/fronted")
    assert status == 403 and "differs from CONNECT host" in headers["x-corral-deny"]
    assert len(origins["good"].requests) == before


def test_a_client_that_does_not_trust_the_interception_ca_fails_closed(inspecting, origins):
    before = len(origins["good"].requests)
    context = origins.ca.client_context()  # trusts the origin's CA, not corral's
    sock = tunnel(inspecting.proxy_port, f"inspected.test:{origins['good'].port}")
    with pytest.raises(ssl.SSLCertVerificationError):
        context.wrap_socket(sock, server_hostname="inspected.test")
    sock.close()
    event = inspecting.wait_event(lambda e: "handshake with the client failed" in
                                  (e.get("reason") or ""))
    assert event["verdict"] == "deny" and event["kind"] == "connect"
    assert "unknown ca" in event["reason"]
    time.sleep(0.2)
    assert len(origins["good"].requests) == before


@pytest.mark.parametrize(("name", "why"), [
    # the stranger CA has the trusted one's name: OpenSSL tries that one's key, and fails
    ("untrusted.test", "certificate signature failure|unable to get local issuer"),
    ("mismatch.test", "Hostname mismatch"),
])
def test_an_upstream_that_fails_verification_is_denied_with_the_reason(
        inspecting, origins, interception, name, why):
    server = origins["untrusted" if name == "untrusted.test" else "mismatch"]
    with tls_through(inspecting, client_context(interception), name, server.port) as tls:
        status, headers, _ = get(tls, f"{name}:{server.port}", "/secret")
    assert status == 403
    assert headers["x-corral-deny"].startswith(f"upstream {name}:{server.port} failed TLS "
                                               "verification")
    assert re.search(why, headers["x-corral-deny"])
    assert server.requests == []
    event = inspecting.wait_event(lambda e: e.get("name") == name and e["verdict"] == "deny")
    assert re.search(why, event["reason"])


def test_a_host_that_is_not_inspected_is_spliced_with_the_origins_own_certificate(
        inspecting, origins, interception):
    port = origins["plain"].port
    before = inspecting.status()["tunnels"]
    sock = tunnel(inspecting.proxy_port, f"spliced.test:{port}")
    with origins.ca.client_context().wrap_socket(sock, server_hostname="spliced.test") as tls:
        issuer = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).issuer
        assert issuer == origins.ca.cert.subject
        assert get(tls, f"spliced.test:{port}", "/spliced")[0] == 200
    after = inspecting.status()["tunnels"]  # spliced in the kernel, not streamed by Python
    assert after["spliced"] == before["spliced"] + 1 and after["streamed"] == before["streamed"]
    sock = tunnel(inspecting.proxy_port, f"spliced.test:{port}")
    with pytest.raises(ssl.SSLCertVerificationError):  # no corral certificate on the wire
        client_context(interception).wrap_socket(sock, server_hostname="spliced.test")
    sock.close()


def test_a_websocket_upgrade_is_relayed_after_inspection(inspecting, origins, interception):
    port = origins["good"].port
    with tls_through(inspecting, client_context(interception), "upgrade.test", port) as tls:
        tls.sendall(f"GET /upgrade HTTP/1.1\r\nHost: upgrade.test:{port}\r\n"
                    "Connection: Upgrade\r\nUpgrade: websocket\r\n"
                    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = tls.recv(4096)
            assert chunk, "the filter closed before answering the upgrade"
            head += chunk
        assert head.startswith(b"HTTP/1.1 101")
        tls.sendall(b"frames are not inspected")
        echoed = b""
        while len(echoed) < 24:
            chunk = tls.recv(4096)
            assert chunk, f"the tunnel closed before the echo; got {echoed!r}"
            echoed += chunk
        assert echoed == b"frames are not inspected"


WEBSOCKET_ASK = ("Connection: Upgrade\r\nUpgrade: websocket\r\n"
                 "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")


@pytest.mark.parametrize("path", ["/status/101", "/status/101/wrong-accept"])
def test_a_101_that_switches_nothing_leaves_no_request_unread(inspecting, origins,
                                                              interception, path):
    """httpbin's /status/101 answers 101 and goes on reading HTTP: relaying raw bytes after
    it would carry the next requests (a denied DELETE, a token) past every check."""
    port = origins["good"].port
    before = len(origins["good"].requests)
    with tls_through(inspecting, client_context(interception), "inspected.test", port) as tls:
        status, headers, _ = get(tls, f"inspected.test:{port}", path, extra=WEBSOCKET_ASK)
        assert status == 502 and "101" in headers["x-corral-error"]
        with contextlib.suppress(OSError):
            tls.sendall(f"DELETE /repos/x HTTP/1.1\r\nHost: inspected.test:{port}\r\n"
                        "\r\n".encode())
            tls.recv(4096)
    assert [r["path"] for r in origins["good"].requests[before:]] == [path]
    inspecting.wait_event(lambda e: e.get("verdict") == "error"
                          and "answered 101 without" in (e.get("reason") or ""))


def test_transparent_443_to_an_inspected_host(inspecting, origins, interception):
    if origins.privileged:
        pytest.skip(origins.privileged)
    before = len(origins.https.requests)
    sock = connect(inspecting.tls_port)
    with client_context(interception).wrap_socket(sock, server_hostname="allowed.test") as tls:
        assert get(tls, "allowed.test", "/through")[0] == 200
        status, headers, _ = get(tls, "allowed.test", "/denied/x")
        assert status == 403 and "/denied/x" in headers["x-corral-deny"]
        issuer = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).issuer
        assert "corral interception CA" in issuer.rfc4514_string()
    assert [r["path"] for r in origins.https.requests[before:]] == ["/through"]
    assert origins.https.requests[-1]["tls_sni"] == "allowed.test"
    # https's own port is left out of Host, as clients write it (CDNs that route on the
    # exact name refuse `allowed.test:443`)
    assert origins.https.requests[-1]["headers"]["host"] == "allowed.test"


def test_a_spliced_tunnel_is_cut_when_its_host_comes_to_be_inspected(inspecting, origins):
    port = origins["plain"].port
    sock = tunnel(inspecting.proxy_port, f"cut.test:{port}")
    with origins.ca.client_context().wrap_socket(sock, server_hostname="cut.test") as tls:
        assert get(tls, f"cut.test:{port}", "/before")[0] == 200
        try:
            inspecting.reload(POLICY + '\n[[inspect]]\nhost = "cut.test"\n')
            assert recv_all(tls) == b""  # the tunnel was cut
        finally:
            inspecting.reload(POLICY)
    event = inspecting.wait_event(lambda e: e.get("name") == "cut.test" and
                                  "inspected now" in (e.get("reason") or ""))
    assert event["verdict"] == "deny"


def test_an_sni_flood_stays_within_the_cache_and_the_mint_budget(
        inspecting, origins, interception):
    """Distinct names under an inspected wildcard, all at once: the session mints its burst
    and is refused the rest (with an event), the cache keeps `leaf_cache` leaves, and
    another session still has its own inspected host served meanwhile, a first mint too."""
    port, context = origins["good"].port, client_context(interception)
    results: list[str] = []

    def one(i: int) -> None:
        try:
            with tls_through(inspecting, context, f"n{i}.flood.test", port) as tls:
                results.append(str(get(tls, f"n{i}.flood.test:{port}", "/f")[0]))
        except ssl.SSLError as exc:
            results.append(exc.reason or str(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(FLOOD)]
    for thread in threads:
        thread.start()
    try:
        with tls_through(inspecting, context, "s2.test", port, S2_CLIENT) as tls:
            assert get(tls, f"s2.test:{port}", "/meanwhile")[0] == 200
    finally:
        for thread in threads:
            thread.join(20)
    inspect = inspecting.status()["inspect"]
    assert inspect["leaves"] <= LEAF_CACHE and inspect["evicted"] > 0
    assert results.count("200") <= MINT_BURST
    assert results.count("200") + results.count("TLSV1_ALERT_ACCESS_DENIED") == FLOOD
    assert inspect["refused"] >= FLOOD - MINT_BURST
    inspecting.wait_event(lambda e: "[inspect] mint_rate" in (e.get("reason") or ""))


def test_without_an_interception_ca_an_inspected_host_is_denied_not_tunnelled(
        origins, tmp_path):
    process = InProcessFilter(tmp_path, origins.dns.address, "asyncio", "", POLICY)
    try:
        sock = tunnel(process.proxy_port, f"noca.test:{origins['good'].port}")
        with pytest.raises(ssl.SSLError, match=r"ACCESS_DENIED|access denied"):
            origins.ca.client_context().wrap_socket(sock, server_hostname="noca.test")
        sock.close()
        event = process.wait_event(lambda e: e.get("name") == "noca.test" and
                                   e["verdict"] == "deny")
        assert "no interception CA" in event["reason"]
        assert process.status()["inspect"] is None
    finally:
        process.stop()


def _ca_pem(answer: dict) -> bytes:
    assert answer["ok"], answer
    return answer["ca"]["pem"].encode()


def _leaf_of(process: InProcessFilter, ca_pem: bytes, port: int) -> x509.Certificate:
    """A handshake with `inspected.test` through the filter, trusting `ca_pem` alone."""
    context = ssl.create_default_context(cadata=ca_pem.decode())
    with tls_through(process, context, "inspected.test", port) as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))


def test_the_filter_makes_its_own_ca_keeps_it_and_rotation_takes_effect_at_once(
        origins, tmp_path):
    """`[inspect] ca_dir`: made on the first start (key 0600, directory 0700), the same CA
    after a restart, and `inspect-rotate` signs the next handshake with a new one: the old
    CA no longer verifies it, cached leaves included."""
    ca_dir = tmp_path / "intercept"
    config = f'[inspect]\nca_dir = "{ca_dir}"\nupstream_ca = "{origins.ca.ca_path}"\n'
    port = origins["good"].port
    process = InProcessFilter(tmp_path, origins.dns.address, "asyncio", config, POLICY)
    try:
        first = _ca_pem(control(tmp_path / "filter.sock", {"op": "inspect-ca"}))
        assert (ca_dir.stat().st_mode & 0o777) == 0o700
        assert (pki.CaDirectory(ca_dir).key.stat().st_mode & 0o777) == 0o600
        _leaf_of(process, first, port)  # and now a leaf of the first CA is cached
    finally:
        process.stop()
    process = InProcessFilter(tmp_path, origins.dns.address, "asyncio", config, POLICY)
    try:
        assert _ca_pem(control(tmp_path / "filter.sock", {"op": "inspect-ca"})) == first
        rotated = control(tmp_path / "filter.sock", {"op": "inspect-rotate"})
        second = _ca_pem(rotated)
        assert second != first and rotated["previous"] != rotated["ca"]["sha256"]
        leaf = _leaf_of(process, second, port)
        leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(second))
        with pytest.raises(ssl.SSLCertVerificationError):
            _leaf_of(process, first, port)
        event = process.wait_event(lambda e: e.get("kind") == "certs")
        assert rotated["ca"]["sha256"] in event["reason"] and event["verdict"] == "change"
        generations = [p.name for p in ca_dir.iterdir() if p.is_dir() and not p.is_symlink()]
        assert len(generations) == 1  # the old pair is gone with its key
    finally:
        process.stop()


def test_a_damaged_ca_in_the_filters_directory_is_replaced_at_start(origins, tmp_path):
    ca_dir = tmp_path / "intercept"
    directory = pki.CaDirectory(ca_dir)
    directory.ensure()
    stranger_key = pki.intercept_ca()[1]  # a key that is not the certificate's
    directory.key.write_bytes(stranger_key)
    config = f'[inspect]\nca_dir = "{ca_dir}"\nupstream_ca = "{origins.ca.ca_path}"\n'
    process = InProcessFilter(tmp_path, origins.dns.address, "asyncio", config, POLICY)
    try:
        ca = _ca_pem(control(tmp_path / "filter.sock", {"op": "inspect-ca"}))
        _leaf_of(process, ca, origins["good"].port)
        assert directory.cert.read_bytes() == ca
    finally:
        process.stop()


def test_a_ca_given_as_files_is_not_rotated_by_the_filter(inspecting):
    socket = inspecting.directory / "filter.sock"
    answer = control(socket, {"op": "inspect-rotate"})
    assert not answer["ok"] and "python -m appliance.pki intercept-ca" in answer["error"]
    assert control(socket, {"op": "inspect-ca"})["ca"]["rotatable"] is False


def test_a_ca_dir_that_cannot_be_kept_turns_inspection_off_not_the_filter(origins, tmp_path):
    """The roles always give a ca_dir: a CA that cannot be made there (a full disk, a path
    that is not a directory) must cost the inspected hosts, not every session's egress."""
    (tmp_path / "file").write_text("")
    config = f'[inspect]\nca_dir = "{tmp_path}/file/ca"\nupstream_ca = "{origins.ca.ca_path}"\n'
    port = origins["good"].port
    process = InProcessFilter(tmp_path, origins.dns.address, "asyncio", config, POLICY)
    try:
        assert "cannot keep the interception CA" in process.status()["inspect"]["error"]
        sock = tunnel(process.proxy_port, f"noca.test:{port}")
        with pytest.raises(ssl.SSLError, match=r"ACCESS_DENIED|access denied"):
            origins.ca.client_context().wrap_socket(sock, server_hostname="noca.test")
        sock.close()
        plain = origins["plain"].port
        with origins.ca.client_context().wrap_socket(
                tunnel(process.proxy_port, f"spliced.test:{plain}"),
                server_hostname="spliced.test") as tls:
            assert get(tls, f"spliced.test:{plain}", "/spliced")[0] == 200
    finally:
        process.stop()
