"""Attacks on inspected tunnels' two TLS handshakes, which run at once (proxy/tunnel.py
_inspect): clients that abort, stall or send garbage mid-handshake while the upstream stalls,
fails verification, or finishes and leaves; a cut while both are open; a download the client
leaves. Afterwards: no upstream socket left open, no loop exception handler call, no error
logged, no task left behind; a stalled upstream answered with its reason. (From an attack
round on the overlapped handshakes; two findings were older than it, and are fixed.)"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
import ssl
import struct
import threading
import time

import pytest

from tests.integration.filter.test_inspect import (
    InProcessFilter,
    World,
    client_context,
    inspect_config,
    interception,  # noqa: F401  (a fixture)
    origins,  # noqa: F401  (a fixture)
    read_response,
    tunnel,
)

POLICY = """
[http]
allow = ["inspected.test:*", "untrusted.test:*"]

[[inspect]]
host = "inspected.test"

[[inspect]]
host = "untrusted.test"
"""


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def watched(request, origins, interception, tmp_path_factory, policy: str,  # noqa: F811
            proxy_extra: str = "connect_timeout = 1"):
    """An in-process filter with `policy` whose loop's exception handler calls and warnings
    logged are kept (`handled`, `captured`), for the attacks' tests to find none."""
    process = InProcessFilter(tmp_path_factory.mktemp("filter"), origins.dns.address,
                              request.param, inspect_config(interception, origins.ca.ca_path),
                              policy, proxy_extra=proxy_extra)
    handled: list[dict] = []
    process.loop.call_soon_threadsafe(process.loop.set_exception_handler,
                                      lambda loop, context: handled.append(context))
    captured = Captured()
    logging.getLogger().addHandler(captured)
    process.handled, process.captured = handled, captured
    try:
        yield process
    finally:
        logging.getLogger().removeHandler(captured)
        process.stop()


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def lab(request, origins, interception, tmp_path_factory):  # noqa: F811
    with watched(request, origins, interception, tmp_path_factory, POLICY) as process:
        yield process


def filter_tasks(lab) -> int:
    async def count():
        return len(asyncio.all_tasks())
    return lab.run(count())


def collect(lab) -> None:
    async def gcollect():
        gc.collect()
        await asyncio.sleep(0.05)
        gc.collect()
    lab.run(gcollect())


def hello_only(interception, name="inspected.test"):  # noqa: F811
    bios = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = client_context(interception).wrap_bio(*bios, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return obj, bios, bios[1].read()


def drained(sock, seconds=15) -> bytes:
    sock.settimeout(seconds)
    out = b""
    try:
        while data := sock.recv(65536):
            out += data
    except (ConnectionResetError, TimeoutError):
        pass
    return out


class Origin:
    """A TCP origin on World.ADDRESS whose behaviour the test picks per connection."""

    def __init__(self):
        self.listener = socket.create_server((World.ADDRESS, 0))
        self.listener.settimeout(10)
        self.port = self.listener.getsockname()[1]

    def accept(self) -> socket.socket:
        sock, _ = self.listener.accept()
        sock.settimeout(15)
        return sock

    def close(self):
        self.listener.close()


def wait_closed_by_filter(sock) -> bool:
    """True once the filter has closed its side (EOF or reset)."""
    sock.settimeout(15)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def rst(sock):
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def unretrieved(lab) -> list[str]:
    """The filter's futures that hold an error nobody took: each is logged ("exception was
    never retrieved") when it is freed, which for one in a reference cycle is whenever the
    garbage collector frees the cycle, in an order of its own: asserted here, before
    anything is collected, so that it fails every time, not once in a few runs."""
    async def find():
        return [repr(o)[:200] for o in gc.get_objects()
                if isinstance(o, asyncio.Future) and o.get_loop() is lab.loop and o.done()
                and not o.cancelled() and o._log_traceback]
    return lab.run(find())


def clean(lab, before_tasks):
    """No task left behind, no loop exception handler call, no warning logged; and no
    future holding an error nobody took (unretrieved)."""
    deadline = time.monotonic() + 5
    while filter_tasks(lab) > before_tasks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert unretrieved(lab) == []
    collect(lab)
    assert filter_tasks(lab) <= before_tasks
    assert lab.handled == [], lab.handled
    bad = [r for r in lab.captured.records if r.levelno >= logging.WARNING]
    assert bad == [], [r.getMessage() for r in bad]


# -- scenarios -----------------------------------------------------------------------------


def test_the_upstream_handshake_overlaps_the_clients_and_ends_with_it(
        lab, interception):  # noqa: F811
    """Both TLS handshakes at once (a new connection waits for one, not two in a row): the
    origin is sent the filter's ClientHello while the client has sent only its own, and a
    client that leaves then takes the upstream connection with it."""
    listener = socket.create_server((World.ADDRESS, 0))
    listener.settimeout(10)
    sock = tunnel(lab.proxy_port, f"inspected.test:{listener.getsockname()[1]}")
    origin, _ = listener.accept()  # dialled at CONNECT, as for every tunnel
    try:
        bios = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = client_context(interception).wrap_bio(*bios, server_hostname="inspected.test")
        with pytest.raises(ssl.SSLWantReadError):
            obj.do_handshake()
        sock.sendall(bios[1].read())  # the client's hello, and nothing more
        origin.settimeout(10)
        hello = origin.recv(65536)
        assert hello[:1] == b"\x16" and b"inspected.test" in hello  # the filter's own hello
        sock.close()  # the client leaves mid-handshake: the upstream goes too
        while origin.recv(65536):
            pass
    finally:
        for each in (sock, origin, listener):
            each.close()


@pytest.mark.parametrize("client", ["stall", "garbage", "rst", "close"])
@pytest.mark.parametrize("upstream", ["stall", "fails-verification", "done-then-closes"])
def test_client_aborts_mid_handshake(lab, origins, interception, client, upstream):  # noqa: F811
    before = filter_tasks(lab)
    origin = None
    name = "inspected.test"
    if upstream == "fails-verification":
        port = origins["untrusted"].port
        name = "untrusted.test"
    elif upstream == "done-then-closes":
        port = origins["good"].port
    else:
        origin = Origin()
        port = origin.port
    try:
        sock = tunnel(lab.proxy_port, f"{name}:{port}")
        up = origin.accept() if origin else None
        _, _, hello = hello_only(interception, name)
        sock.sendall(hello)
        if up is not None:
            assert up.recv(65536)[:1] == b"\x16"
        else:
            time.sleep(0.3)  # the upstream handshake ends (fails, or completes)
        if client == "stall":
            drained(sock)  # header_timeout (2 s) ends it
            sock.close()
        elif client == "garbage":
            sock.sendall(b"\x17\x03\x03\x00\x05hello" + os.urandom(64))
            drained(sock)
            sock.close()
        elif client == "rst":
            rst(sock)
        else:
            sock.close()
        if up is not None:
            assert wait_closed_by_filter(up)
            up.close()
    finally:
        if origin:
            origin.close()
    clean(lab, before)


def test_a_cut_while_both_handshakes_are_open(lab, interception):  # noqa: F811
    origin = Origin()
    before = filter_tasks(lab)
    try:
        sock = tunnel(lab.proxy_port, f"inspected.test:{origin.port}")
        up = origin.accept()
        _, _, hello = hello_only(interception)
        sock.sendall(hello)
        assert up.recv(65536)[:1] == b"\x16"
        lab.reload(POLICY.replace('"inspected.test:*", ', ""))
        try:
            assert wait_closed_by_filter(up)
            drained(sock)
        finally:
            lab.reload(POLICY)
        sock.close()
        up.close()
    finally:
        origin.close()
    clean(lab, before)


def test_hold_many_half_handshakes(lab, interception):  # noqa: F811
    """Many clients each with a ClientHello in, upstreams stalled: all end within the
    timeouts and nothing stays behind."""
    origin = Origin()
    before = filter_tasks(lab)
    socks, ups = [], []
    try:
        for _ in range(20):
            sock = tunnel(lab.proxy_port, f"inspected.test:{origin.port}")
            socks.append(sock)
            ups.append(origin.accept())
            sock.sendall(hello_only(interception)[2])
        for up in ups:
            assert wait_closed_by_filter(up)
        for sock in socks:
            drained(sock)
    finally:
        for each in socks + ups:
            each.close()
        origin.close()
    clean(lab, before)


def test_concurrent_abort_storm(lab, origins, interception):  # noqa: F811
    """Clients that leave at random moments around the hello, against the untrusted origin
    (its handshake fails at once) and the good one."""
    import random
    before = filter_tasks(lab)
    rng = random.Random(7)
    _, _, hello = hello_only(interception)
    _, _, hello_u = hello_only(interception, "untrusted.test")

    def one(i):
        untrusted = i % 2
        name = "untrusted.test" if untrusted else "inspected.test"
        port = origins["untrusted" if untrusted else "good"].port
        sock = tunnel(lab.proxy_port, f"{name}:{port}")
        data = hello_u if untrusted else hello
        cut = rng.randrange(0, len(data) + 40)
        payload = data + os.urandom(40)
        sock.sendall(payload[:cut])
        time.sleep(rng.random() * 0.05)
        if rng.random() < 0.5:
            rst(sock)
        else:
            sock.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    time.sleep(2.5)  # header_timeout for any half-read hello
    clean(lab, before)


@pytest.mark.parametrize("after", ["close-before-hello", "handshake-then-close",
                                   "handshake-then-data"])  # a flood: test_attack_h_linger.py
def test_upstream_that_leaves_or_talks_early_while_the_client_completes_later(
        lab, origins, interception, after):  # noqa: F811
    origin = Origin()
    before = filter_tasks(lab)
    done = threading.Event()
    result = {}

    def serve():
        up = origin.accept()
        try:
            if after == "close-before-hello":
                up.close()
                return
            ctx = origins.ca.server_context(["inspected.test"])
            tls = ctx.wrap_socket(up, server_side=True)
            result["handshake"] = True
            if after == "handshake-then-close":
                tls.close()
                return
            if after == "handshake-then-data":
                tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nearly")
            else:
                tls.settimeout(0.5)
                with pytest.raises((TimeoutError, OSError, ssl.SSLError)):
                    while True:
                        tls.sendall(b"x" * 65536)
            done.wait(20)
            tls.close()
        except Exception as exc:
            result["error"] = repr(exc)

    server = threading.Thread(target=serve)
    server.start()
    try:
        sock = tunnel(lab.proxy_port, f"inspected.test:{origin.port}")
        if after == "close-before-hello":
            time.sleep(0.3)
        obj, bios, hello = hello_only(interception)
        sock.sendall(hello)
        time.sleep(0.5)  # the upstream's handshake, and what it does next, comes first
        sock.settimeout(15)
        while True:
            try:
                obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                if bios[1].pending:
                    sock.sendall(bios[1].read())
                data = sock.recv(65536)
                assert data, "closed during the client's handshake"
                bios[0].write(data)
        if bios[1].pending:
            sock.sendall(bios[1].read())
        obj.write(b"GET / HTTP/1.1\r\nHost: inspected.test\r\n\r\n")
        sock.sendall(bios[1].read())
        got = b""
        while b"\r\n\r\n" not in got:
            data = sock.recv(65536)
            if not data:
                break
            bios[0].write(data)
            try:
                while chunk := obj.read(65536):
                    got += chunk
            except ssl.SSLWantReadError:
                pass
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                break
        print(after, got[:200])
        sock.close()
    finally:
        done.set()
        server.join(30)
        origin.close()
    assert "error" not in result, result
    clean(lab, before)


def established_to(port: int) -> int:
    """The filter's ends of connections to the origin (remote port `port`), any state but
    closed (/proc/net/tcp: the namespace is this test's own)."""
    count = 0
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if int(fields[2].split(":")[1], 16) == port and fields[3] != "0A":
                count += 1
    return count


def test_a_download_the_client_leaves_does_not_keep_the_upstream_open(
        lab, origins, interception):  # noqa: F811
    origin = Origin()
    n = 5
    leave = threading.Event()
    ready = threading.Semaphore(0)

    def serve():
        up = origin.accept()
        tls = origins.ca.server_context(["inspected.test"]).wrap_socket(up, server_side=True)
        tls.settimeout(10)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = tls.recv(65536)
            assert chunk, "the filter closed before its request's head"  # not a spin
            buf += chunk
        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n")
        tls.settimeout(0.5)
        try:
            while True:  # a large download: until the filter stops reading
                tls.sendall(b"x" * 65536)
        except (TimeoutError, OSError, ssl.SSLError):
            pass
        ready.release()
        leave.wait(60)  # a server that keeps its end open (and reads nothing more)
        tls.close()  # (wrapping took the socket over: closing `up` would close nothing)

    servers = []
    try:
        for _ in range(n):
            server = threading.Thread(target=serve)
            server.start()
            servers.append(server)
            sock = tunnel(lab.proxy_port, f"inspected.test:{origin.port}")
            tls = client_context(interception).wrap_socket(sock,
                                                           server_hostname="inspected.test")
            tls.settimeout(10)
            tls.sendall(b"GET /big HTTP/1.1\r\nHost: inspected.test\r\n\r\n")
            assert tls.recv(65536).startswith(b"HTTP/1.1 200")
            ready.acquire(timeout=30)  # the filter has stopped reading the upstream
            tls.close()  # the client leaves the download
        # every tunnel has ended (the client's connection is gone): its upstream socket goes
        # with it, not at TLS's shutdown timeout (30 s) while close_notify waits for a reply
        deadline = time.monotonic() + 10
        while established_to(origin.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert dict(lab.service.proxy.flows.tunnels.held) == {}
        assert established_to(origin.port) == 0
    finally:
        leave.set()
        for server in servers:
            server.join(60)
        origin.close()


def test_a_stalled_upstream_handshake_is_answered_with_a_reason(lab, interception):  # noqa: F811
    origin = Origin()
    try:
        sock = tunnel(lab.proxy_port, f"inspected.test:{origin.port}")
        up = origin.accept()
        tls = client_context(interception).wrap_socket(sock, server_hostname="inspected.test")
        assert up.recv(65536)[:1] == b"\x16"  # the filter's ClientHello: never answered
        tls.sendall(b"GET / HTTP/1.1\r\nHost: inspected.test\r\n\r\n")
        tls.settimeout(15)
        status, headers, _ = read_response(tls)  # connect_timeout = 1 here
        assert status == 502
        assert wait_closed_by_filter(up)
        tls.close()
        up.close()
    finally:
        origin.close()
    event = lab.wait_event(lambda e: "TLS to upstream" in (e.get("reason") or ""))
    assert not event["reason"].endswith("failed: "), event["reason"]
    assert headers["x-corral-error"].endswith("timed out"), headers["x-corral-error"]
