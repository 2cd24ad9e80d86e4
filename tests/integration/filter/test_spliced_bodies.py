"""Long response bodies inside a CONNECT tunnel that carries plain HTTP are spliced
(relay.splice_exact): the bytes go from the origin's socket to the client's through a pipe,
none through Python, and exactly the body's length of them, so the connection goes on with
the next request. Here, against an origin the test drives by hand, under uvloop and
asyncio's loop: the bytes arrive whole and in order through a client that reads slowly; a
client that stops reading, an origin that ends or resets in the middle of a body, and a
policy change that cuts the tunnel each end the connection, leaving no descriptor, task,
loop error or warning behind. And a spliced TLS tunnel that meets TCP urgent data (which
splice cannot move past) ends at once rather than spinning."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading
import time

import pytest

from tests.integration.filter.test_attack_handshakes import (
    clean,
    filter_tasks,
    rst,
    watched,
)
from tests.integration.filter.test_inspect import (
    World,
    interception,  # noqa: F401  (a fixture)
    origins,  # noqa: F401  (a fixture)
    read_response,
    tls_through,
    tunnel,
)

POLICY = """
[http]
allow = ["spliced.test:*"]
"""
IDLE = 2
"""The filter's idle_timeout here, seconds."""
BODY = 6 << 20
"""Longer than the pipe (1 MiB), and than what the stream takes in before the splice."""


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def lab(request, origins, interception, tmp_path_factory):  # noqa: F811
    with watched(request, origins, interception, tmp_path_factory, POLICY,
                 proxy_extra=f"idle_timeout = {IDLE}") as process:
        # spliced.test resolved once: the resolver's sockets (kept, by design) are open
        # before any test counts the descriptors it leaves behind
        tunnel(process.proxy_port, f"spliced.test:{origins['plain'].port}").close()
        yield process


class Origin:
    """One connection on World.PLAIN (spliced.test's address), served by `script` on a
    thread of its own."""

    def __init__(self, script):
        self.listener = socket.create_server((World.PLAIN, 0))
        self.listener.settimeout(10)
        self.port = self.listener.getsockname()[1]
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, args=(script,), daemon=True)
        self.thread.start()

    def _serve(self, script) -> None:
        try:
            sock, _ = self.listener.accept()
            sock.settimeout(15)
            with contextlib.closing(sock):
                script(sock)
        except BaseException as exc:  # the test says what went wrong here
            self.failure = exc

    def join(self) -> None:
        self.thread.join(15)
        self.listener.close()
        assert not self.thread.is_alive(), "the origin is still serving"
        if self.failure is not None:
            raise self.failure


def pattern(n: int) -> bytes:
    """n bytes where a byte lost, doubled or out of place shows."""
    counted = b"".join(b"%08d" % i for i in range(n // 8 + 1))
    return counted[:n]


def head(sock: socket.socket) -> bytes:
    """A message's head, read a byte at a time: nothing past it (its body, the next
    message) is taken."""
    read = b""
    while b"\r\n\r\n" not in read:
        chunk = sock.recv(1)
        assert chunk, f"the connection ended before a message's head: {read[:80]!r}"
        read += chunk
    return read


def read_exactly(sock: socket.socket, n: int, slowly: bool = False) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(65536, n - len(out)))
        assert chunk, f"the connection ended after {len(out)} of {n} bytes"
        out += chunk
        if slowly and len(out) < 256 << 10:
            time.sleep(0.01)  # the client's buffer fills: the filter waits to write
    return bytes(out)


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def ended(sock: socket.socket, seconds: float = 15) -> bool:
    """Whether the filter ends the client's connection within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def spliced(lab) -> int:
    return lab.status()["tunnels"]["spliced_bodies"]


def settled(lab, before: int) -> None:
    """The filter's descriptors are back to `before` (the splice's duplicates and pipe
    closed), within a few seconds; then nothing else left behind (clean)."""
    deadline = time.monotonic() + 5
    while descriptors() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert descriptors() <= before


def test_a_long_body_is_spliced_whole_and_the_next_request_on_the_tunnel_follows(lab):
    body = pattern(BODY)

    def script(sock):
        assert head(sock).startswith(b"GET /big HTTP/1.1")
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % BODY + body[:1000])
        time.sleep(0.2)  # the rest later: the filter waits for the origin, spliced
        sock.sendall(body[1000:])
        assert head(sock).startswith(b"GET /next HTTP/1.1")
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")

    origin = Origin(script)
    tasks, fds, before = filter_tasks(lab), descriptors(), spliced(lab)
    client = tunnel(lab.proxy_port, f"spliced.test:{origin.port}")
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    client.settimeout(15)
    host = f"Host: spliced.test:{origin.port}\r\n"
    client.sendall(f"GET /big HTTP/1.1\r\n{host}\r\n".encode())
    reply = head(client)
    assert reply.startswith(b"HTTP/1.1 200") and b"Content-Length: %d" % BODY in reply
    assert read_exactly(client, BODY, slowly=True) == body
    client.sendall(f"GET /next HTTP/1.1\r\n{host}Connection: close\r\n\r\n".encode())
    assert head(client).startswith(b"HTTP/1.1 200")
    assert read_exactly(client, 5) == b"hello"
    origin.join()
    client.close()
    assert spliced(lab) == before + 1
    event = lab.wait_event(lambda e: e.get("closed") and e["kind"] == "http"
                           and e["name"] == "spliced.test" and e["down"] >= BODY)
    assert event["down"] == BODY
    settled(lab, fds)
    clean(lab, tasks)


def test_a_client_that_stops_reading_a_spliced_body_loses_its_connection(lab):
    def script(sock):
        head(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (64 << 20))
        with contextlib.suppress(OSError):  # until the filter gives up on the client
            sock.sendall(b"x" * (64 << 20))

    origin = Origin(script)
    tasks, fds, before = filter_tasks(lab), descriptors(), spliced(lab)
    client = tunnel(lab.proxy_port, f"spliced.test:{origin.port}")
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    client.sendall(f"GET /big HTTP/1.1\r\nHost: spliced.test:{origin.port}\r\n\r\n".encode())
    client.settimeout(15)
    head(client)
    time.sleep(IDLE + 1.5)  # reads nothing for longer than idle_timeout
    assert spliced(lab) == before + 1
    assert ended(client), "a client that reads nothing keeps its spliced body going"
    client.close()
    origin.join()
    settled(lab, fds)
    clean(lab, tasks)


@pytest.mark.parametrize("how", ["fin", "rst"])
def test_an_origin_that_ends_in_the_middle_of_a_spliced_body_ends_the_tunnel(lab, how):
    def script(sock):
        head(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % BODY
                     + b"x" * (BODY // 2))
        time.sleep(0.2)
        if how == "rst":
            rst(sock)

    origin = Origin(script)
    tasks, fds, before = filter_tasks(lab), descriptors(), spliced(lab)
    client = tunnel(lab.proxy_port, f"spliced.test:{origin.port}")
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    client.sendall(f"GET /big HTTP/1.1\r\nHost: spliced.test:{origin.port}\r\n\r\n".encode())
    client.settimeout(15)
    head(client)
    time.sleep(0.6)  # the origin's end comes while the pipe holds what the client has not read
    got = 0
    with contextlib.suppress(ConnectionResetError):
        while chunk := client.recv(1 << 20):
            got += len(chunk)
    # the client sees the body cut short, never one made up; what the pipe held went out
    assert got == BODY // 2 if how == "fin" else got <= BODY // 2
    client.close()
    origin.join()
    assert spliced(lab) == before + 1
    if how == "fin":  # the request's closing event counts what reached the client
        event = lab.wait_event(lambda e: e.get("closed") and e["kind"] == "http"
                               and e.get("port") == origin.port)
        assert event["down"] == got
    settled(lab, fds)
    clean(lab, tasks)


def test_a_policy_change_cuts_a_tunnel_in_the_middle_of_a_spliced_body(lab):
    going = threading.Event()

    def script(sock):
        head(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (64 << 20))
        going.set()
        with contextlib.suppress(OSError):  # until the cut closes the filter's side
            while True:
                sock.sendall(b"x" * (1 << 20))
                time.sleep(0.05)

    origin = Origin(script)
    tasks, fds, before = filter_tasks(lab), descriptors(), spliced(lab)
    client = tunnel(lab.proxy_port, f"spliced.test:{origin.port}")
    client.sendall(f"GET /big HTTP/1.1\r\nHost: spliced.test:{origin.port}\r\n\r\n".encode())
    client.settimeout(15)
    head(client)
    assert going.wait(10)
    client.recv(1 << 20)  # the body is on its way
    assert spliced(lab) == before + 1
    try:
        lab.reload('[http]\nallow = ["other.test"]\n')
        assert ended(client, 5), "the body went on after its host was denied"
    finally:
        lab.reload(POLICY)
    client.close()
    origin.join()
    lab.wait_event(lambda e: (e["reason"] or "").startswith("cut:")
                   and e["name"] == "spliced.test")
    settled(lab, fds)
    clean(lab, tasks)


def test_a_spliced_body_ends_at_its_length_when_the_next_response_came_with_it(lab):
    """The origin answers the first request with the second's response right behind its
    body, in one write: the splice takes exactly the first body, and the second response is
    read as a response when the second request has gone up."""
    body = pattern(BODY)

    def script(sock):
        head(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % BODY + body
                     + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        head(sock)

    origin = Origin(script)
    tasks, fds, before = filter_tasks(lab), descriptors(), spliced(lab)
    client = tunnel(lab.proxy_port, f"spliced.test:{origin.port}")
    client.settimeout(15)
    host = f"Host: spliced.test:{origin.port}\r\n"
    client.sendall(f"GET /big HTTP/1.1\r\n{host}\r\n".encode())
    assert head(client).startswith(b"HTTP/1.1 200")
    assert read_exactly(client, BODY) == body
    client.sendall(f"GET /next HTTP/1.1\r\n{host}Connection: close\r\n\r\n".encode())
    reply = head(client)
    assert reply.startswith(b"HTTP/1.1 200") and b"Content-Length: 5" in reply
    assert read_exactly(client, 5) == b"hello"
    assert ended(client)
    client.close()
    origin.join()
    assert spliced(lab) == before + 1
    settled(lab, fds)
    clean(lab, tasks)


def test_a_body_with_urgent_data_is_copied_on_from_where_splice_stops(lab):
    """TCP urgent data stops splice(2) where it is while the socket stays readable: the
    body goes on through the copy (which skips the urgent byte, as a read does), neither
    spinning on the socket nor waiting out the idle timeout."""
    body = pattern(BODY)
    splicing = threading.Event()

    def script(sock):
        head(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % BODY
                     + body[:BODY // 2])
        assert splicing.wait(10)
        sock.send(b"!", socket.MSG_OOB)
        sock.sendall(body[BODY // 2:])
        head(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")

    origin = Origin(script)
    tasks, fds, before = filter_tasks(lab), descriptors(), spliced(lab)
    client = tunnel(lab.proxy_port, f"spliced.test:{origin.port}")
    client.settimeout(IDLE - 0.5)  # the body must not wait for the idle timeout
    host = f"Host: spliced.test:{origin.port}\r\n"
    client.sendall(f"GET /big HTTP/1.1\r\n{host}\r\n".encode())
    assert head(client).startswith(b"HTTP/1.1 200")
    first = read_exactly(client, 1 << 20)
    assert spliced(lab) == before + 1  # under way before the urgent byte is sent
    splicing.set()
    assert first + read_exactly(client, BODY - len(first)) == body
    client.sendall(f"GET /next HTTP/1.1\r\n{host}Connection: close\r\n\r\n".encode())
    assert head(client).startswith(b"HTTP/1.1 200")
    assert read_exactly(client, 5) == b"hello"
    client.close()
    origin.join()
    assert spliced(lab) == before + 1
    settled(lab, fds)
    clean(lab, tasks)


@pytest.mark.parametrize("side", ["client", "origin", "origin, half-closed"])
def test_urgent_data_in_a_spliced_tunnel_ends_it_at_once(lab, origins, side):  # noqa: F811
    """splice(2) stops at TCP urgent data for good, while the socket stays readable: a
    spliced direction that meets it would wake and take nothing until the idle timeout, a
    core a tunnel, for one byte an agent sends out of band. TLS has no use for urgent data:
    the tunnel ends, at once; also when its other direction had ended first (a half-close),
    whose end and this failure come together (both read: none left to be logged)."""
    tasks, fds = filter_tasks(lab), descriptors()
    before = lab.status()["tunnels"]["spliced"]
    go, sent = threading.Event(), threading.Event()
    if side == "client":
        port = origins["plain"].port
    else:  # an origin of the test's own, which sends the byte once the tunnel is spliced
        context = origins.ca.server_context(["spliced.test"])

        def script(sock):
            with context.wrap_socket(sock, server_side=True) as tls:
                head(tls)
                tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                if side == "origin, half-closed":
                    while tls.recv(4096):  # until the client's half-close has come through
                        pass
                else:
                    assert go.wait(10)
                with socket.socket(fileno=os.dup(tls.fileno())) as raw:  # under the TLS
                    raw.send(b"!", socket.MSG_OOB)
                    raw.send(b"more")  # what follows the urgent byte makes it readable
                sent.set()
                time.sleep(IDLE + 1)  # the filter ends it first, or its idle timeout does
        origin = Origin(script)
        port = origin.port
    tls = tls_through(lab, origins.ca.client_context(), "spliced.test", port)
    tls.settimeout(5)
    tls.sendall(b"GET /first HTTP/1.1\r\nHost: spliced.test\r\n\r\n")
    assert read_response(tls)[0] == 200
    time.sleep(0.3)
    assert lab.status()["tunnels"]["spliced"] == before + 1
    raw = socket.socket(fileno=os.dup(tls.fileno()))
    if side == "client":
        raw.send(b"!", socket.MSG_OOB)
        raw.send(b"more")  # what follows the urgent byte makes the socket readable
    else:
        if side == "origin, half-closed":
            raw.shutdown(socket.SHUT_WR)  # passed on to the origin: that direction is done
        go.set()
        assert sent.wait(10)
    assert ended(raw, IDLE / 2), "the tunnel went on past urgent data"
    raw.close()
    tls.close()
    if side != "client":
        origin.join()
    settled(lab, fds)
    clean(lab, tasks)


def test_urgent_data_then_the_origins_end_still_delivers_the_whole_body(lab):
    """With the origin's FIN already in, splice(2) at the urgent mark says 0, as at the end:
    the copy reads on (past the urgent byte) and finds what is really there."""
    body, mark = pattern(2 << 20), 3 << 19

    def script(sock):
        head(sock)
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body[:mark])
        sock.send(b"!", socket.MSG_OOB)
        sock.sendall(body[mark:])
        sock.shutdown(socket.SHUT_WR)
        time.sleep(2)

    origin = Origin(script)
    tasks, fds, before = filter_tasks(lab), descriptors(), spliced(lab)
    client = tunnel(lab.proxy_port, f"spliced.test:{origin.port}")
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    client.settimeout(IDLE + 3)
    client.sendall(f"GET /big HTTP/1.1\r\nHost: spliced.test:{origin.port}\r\n\r\n".encode())
    head(client)
    time.sleep(1)  # the origin's FIN is in the filter's socket by now
    assert read_exactly(client, len(body)) == body
    client.close()
    origin.join()
    assert spliced(lab) == before + 1
    settled(lab, fds)
    clean(lab, tasks)


def test_what_a_client_sends_right_behind_its_hello_reaches_the_origin_whole(lab):
    """The tunnel's streams hold what came with the hello (here more than their buffer's
    limit, so they had stopped reading the socket): handed to the splice, every byte goes
    up once and in order, none read by the streams beside it."""
    bios = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(*bios, server_hostname="spliced.test")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = bios[1].read()
    early, later = pattern(400 << 10), pattern(2 << 20)[::-1]
    got = bytearray()

    def script(sock):
        sock.settimeout(IDLE + 3)
        while chunk := sock.recv(1 << 20):
            got.extend(chunk)

    origin = Origin(script)
    tasks, fds, before = filter_tasks(lab), descriptors(), lab.status()["tunnels"]["spliced"]
    client = tunnel(lab.proxy_port, f"spliced.test:{origin.port}")
    client.sendall(hello + early)
    time.sleep(0.5)
    for at in range(0, len(later), 64 << 10):
        client.sendall(later[at:at + (64 << 10)])
        time.sleep(0.005)
    client.shutdown(socket.SHUT_WR)
    assert ended(client)
    client.close()
    origin.join()
    assert lab.status()["tunnels"]["spliced"] == before + 1
    assert bytes(got) == hello + early + later
    settled(lab, fds)
    clean(lab, tasks)
