"""The express lane (proxy/express.py): plain GETs and HEADs served by protocol callbacks,
and every other request or response handed over to forward.py with what was read, the
connection going on there. Against a real filter process (uvloop and asyncio's loop) and the
fake origin on 127.31.0.2:80."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from tests.integration.conftest import FilterProcess, connect, recv_all


def read_response(sock: socket.socket, buffered: bytearray, head_only: bool = False) -> bytes:
    """One response off `sock` (framed by length or chunks), what followed it left in
    `buffered`."""
    deadline = time.monotonic() + 10

    def more() -> None:
        assert time.monotonic() < deadline, "no whole response within 10 s"
        chunk = sock.recv(65536)
        assert chunk, f"closed after {bytes(buffered)[:200]!r}"
        buffered.extend(chunk)

    while b"\r\n\r\n" not in buffered:
        more()
    end = buffered.index(b"\r\n\r\n") + 4
    head = bytes(buffered[:end]).decode("latin-1").lower()
    if head_only:
        del buffered[:end]
        return bytes(head.encode())
    if "transfer-encoding: chunked" in head:
        while b"\r\n0\r\n\r\n" not in buffered[end - 2:]:
            more()
        size = buffered.index(b"\r\n0\r\n\r\n", end - 2) + 7
    else:
        length = int(head.split("content-length:")[1].split("\r\n")[0])
        size = end + length
        while len(buffered) < size:
            more()
    whole = bytes(buffered[:size])
    del buffered[:size]
    return whole


def body_of(raw: bytes) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"chunked" in head.lower():
        parts, rest = [], body
        while True:
            size, _, rest = rest.partition(b"\r\n")
            if int(size, 16) == 0:
                break
            parts.append(rest[:int(size, 16)])
            rest = rest[int(size, 16) + 2:]
        body = b"".join(parts)
    return json.loads(body)


def get(path: str, host: str = "allowed.test", method: str = "GET", extra: str = "") -> bytes:
    return f"{method} http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


def lane(corral) -> tuple[int, int]:
    proxy = corral.control({"op": "status"})["proxy"]
    return proxy["express_requests"], proxy["express_handed_over"]


def test_plain_gets_on_one_connection_take_the_lane_and_one_origin_connection(corral_filter,
                                                                             internet):
    served, handed = lane(corral_filter)
    accepted = internet.http80.accepted
    buffered = bytearray()
    with connect(corral_filter.proxy_port) as sock:
        for i in range(5):
            sock.sendall(get(f"/lane/{i}"))
            answer = read_response(sock, buffered)
            assert answer.startswith(b"HTTP/1.1 200") and body_of(answer)["path"] == f"/lane/{i}"
    assert lane(corral_filter) == (served + 5, handed)
    assert internet.http80.accepted - accepted <= 1  # one connection carried all five
    closing = [e for e in corral_filter.events() if e.get("closed")
               and (e["name"], e["kind"]) == ("allowed.test", "http")][-5:]
    assert [e["down"] > 100 and e["address"] == "127.31.0.2" for e in closing] == [True] * 5
    decided = {e["id"] for e in corral_filter.events() if not e.get("closed")}
    assert {e["id"] for e in closing} <= decided  # each the second event of its decision


def test_pipelined_requests_are_answered_in_order(corral_filter):
    buffered = bytearray()
    with connect(corral_filter.proxy_port) as sock:
        sock.sendall(b"".join(get(f"/pipe/{i}") for i in range(4)))
        paths = [body_of(read_response(sock, buffered))["path"] for _ in range(4)]
    assert paths == [f"/pipe/{i}" for i in range(4)]


def test_a_request_the_lane_does_not_take_goes_to_forward_and_the_connection_goes_on(
        corral_filter):
    served, handed = lane(corral_filter)
    buffered = bytearray()
    with connect(corral_filter.proxy_port) as sock:
        sock.sendall(get("/first"))
        assert body_of(read_response(sock, buffered))["path"] == "/first"
        sock.sendall(get("/posted", method="POST", extra="Content-Length: 5\r\n") + b"hello")
        answer = body_of(read_response(sock, buffered))
        assert (answer["method"], answer["body"]) == ("POST", "hello")
        sock.sendall(get("/after"))
        assert body_of(read_response(sock, buffered))["path"] == "/after"
    assert lane(corral_filter) == (served + 1, handed + 1)


def test_a_chunked_response_is_handed_over_at_its_head_whole(corral_filter):
    served, handed = lane(corral_filter)
    buffered = bytearray()
    with connect(corral_filter.proxy_port) as sock:
        sock.sendall(get("/chunked"))
        answer = read_response(sock, buffered)
        assert b"transfer-encoding: chunked" in answer.lower()
        assert body_of(answer)["path"] == "/chunked"
        sock.sendall(get("/then"))
        assert body_of(read_response(sock, buffered))["path"] == "/then"
    assert lane(corral_filter) == (served, handed + 1)
    events = [e for e in corral_filter.events() if e["name"] == "allowed.test"]
    chunked = [e for e in events if e.get("closed") and e["down"] > 0][-2]
    assert len([e for e in events if e["id"] == chunked["id"]]) == 2  # decided once, closed once


def test_a_head_answered_with_a_body_never_answers_the_next_request(corral_filter):
    """The fake origin answers HEAD with its body too: those bytes spoil its connection,
    and the next request gets an origin connection of its own, and its own answer."""
    buffered = bytearray()
    with connect(corral_filter.proxy_port) as sock:
        sock.sendall(get("/headed", method="HEAD"))
        head = read_response(sock, buffered, head_only=True)
        assert head.startswith(b"http/1.1 200") and "content-length" in head.decode()
        sock.sendall(get("/next"))
        assert body_of(read_response(sock, buffered))["path"] == "/next"
        assert not buffered


def test_a_refused_request_is_refused_by_forward_with_its_event(corral_filter):
    served, handed = lane(corral_filter)
    with connect(corral_filter.proxy_port) as sock:
        sock.sendall(get("/x", host="other.test"))
        buffered = bytearray()
        answer = read_response(sock, buffered)
    assert answer.startswith(b"HTTP/1.1 403") and b"X-Corral-Deny" in answer
    assert lane(corral_filter) == (served, handed + 1)
    event = corral_filter.wait_event(lambda e: e["name"] == "other.test"
                                     and e["verdict"] == "deny")
    assert event["kind"] == "http"


def test_a_large_body_read_slowly_arrives_whole(corral_filter):
    """Back-pressure: the origin's reading waits while the client's is behind."""
    size = 8_000_000
    with connect(corral_filter.proxy_port, timeout=20) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.sendall(get(f"/big/{size}"))
        data = bytearray()
        time.sleep(0.5)  # the socket buffers fill, the proxy pauses the origin
        while len(data) < size + 30:
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            data += chunk
            if len(data) - size > 200:  # past any head: the body is all there
                break
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b"x" * size


def test_a_head_that_stalls_gets_a_408(corral_filter):
    """header_timeout (2 s here) for a head begun, as forward.py gives it."""
    with connect(corral_filter.proxy_port) as sock:
        sock.sendall(get("/stalled")[:30])
        started = time.monotonic()
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert 1.5 < time.monotonic() - started < 6
    event = corral_filter.wait_event(lambda e: e["verdict"] == "error"
                                     and "408" in (e["reason"] or ""))
    assert event["kind"] == "http"


@pytest.fixture(scope="module")
def idle_soon(internet, tmp_path_factory):
    process = FilterProcess(tmp_path_factory.mktemp("idle"), internet.dns.address,
                            proxy_extra="idle_timeout = 1")
    yield process
    process.stop()


def test_a_connection_idle_between_requests_is_closed_without_a_word(idle_soon):
    buffered = bytearray()
    with connect(idle_soon.proxy_port) as sock:
        sock.sendall(get("/once"))
        assert body_of(read_response(sock, buffered))["path"] == "/once"
        started = time.monotonic()
        assert sock.recv(65536) == b""  # closed, no 408: no request had begun
        assert 0.5 < time.monotonic() - started < 6


@pytest.mark.parametrize("source", ["127.0.0.1"])
def test_the_transparent_listener_serves_plain_http_on_the_lane(corral_filter, source):
    served, _ = lane(corral_filter)
    buffered = bytearray()
    with connect(corral_filter.http_port, source) as sock:
        for path in ("/t1", "/t2"):
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: allowed.test\r\n\r\n".encode())
            assert body_of(read_response(sock, buffered))["path"] == path
    assert lane(corral_filter)[0] == served + 2


def test_http_1_0_clients_one_request_a_connection_share_one_origin_connection(corral_filter,
                                                                              internet):
    """As ab and many scripts do: the proxy asks the origin to keep its connection, and each
    next client connection of the session takes it from the pool; each client still gets
    its answer and the end of its connection."""
    accepted = internet.http80.accepted
    for i in range(4):
        with connect(corral_filter.proxy_port) as sock:
            sock.sendall(f"GET http://allowed.test/ten/{i} HTTP/1.0\r\n"
                         "Host: allowed.test\r\n\r\n".encode())
            answer = recv_all(sock)  # the proxy closes after it, as HTTP/1.0 expects
        assert answer.startswith(b"HTTP/1.1 200") and b"\r\nConnection: close\r\n" in answer
        sent = body_of(answer)
        assert sent["path"] == f"/ten/{i}" and sent["headers"]["connection"] == "keep-alive"
    assert internet.http80.accepted - accepted <= 1


# -- origins that misbehave (found by attacking the lane) ------------------------------------


class RawOrigin:
    """An origin on `address`:80 that does what `behave(conn, origin)` does with each
    connection, on a thread of its own; `lost` counts connections the filter closed on
    it while it was still sending."""

    def __init__(self, address: str, behave):
        self.sock = socket.create_server((address, 80), reuse_port=False, backlog=64)
        self.sock.settimeout(0.2)
        self.behave, self.accepted, self.lost, self.running = behave, 0, 0, True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.running:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn) -> None:
        conn.settimeout(20)
        try:
            self.behave(conn, self)
        except (BrokenPipeError, ConnectionResetError):
            self.lost += 1
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.running = False
        self.thread.join(timeout=5)
        self.sock.close()


def head_of(conn) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    return data


def shut_at_once(conn, origin):
    pass  # accepts, then closes


def flood(conn, origin):  # an answer, then a stream nobody asked for
    head_of(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi")
    junk = b"J" * (1 << 20)
    for _ in range(200):
        conn.sendall(junk)


def huge_head(conn, origin):
    head_of(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 70000 + b"\r\nContent-Length: 2\r\n\r\nhi")
    head_of(conn)


def extra_later(conn, origin):  # each answer followed, later, by one nobody asked for
    while head_of(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst")
        time.sleep(0.3)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nSMUGGLED")


MISBEHAVING = {"shut.wild.test": ("127.31.0.40", shut_at_once),
               "flood.wild.test": ("127.31.0.41", flood),
               "huge.wild.test": ("127.31.0.42", huge_head),
               "extra.wild.test": ("127.31.0.43", extra_later)}
NAMED = {"get.extra.wild.test": "127.31.0.43", "post.extra.wild.test": "127.31.0.43"}
"""Other names of an origin above: each test its own pool entry (session, name, port)."""


@pytest.fixture(scope="module")
def misbehaving(internet):
    origins = {}
    for name, (address, behave) in MISBEHAVING.items():
        internet.dns.zone[name] = [("A", address, 300)]
        origins[name] = RawOrigin(address, behave)
    for name, address in NAMED.items():
        internet.dns.zone[name] = [("A", address, 300)]
    yield origins
    for origin in origins.values():
        origin.close()


def settled(corral, deadline: float = 5.0) -> dict:
    """The proxy's counts once every flow has ended (or as they are at `deadline`)."""
    end = time.monotonic() + deadline
    while True:
        proxy = corral.control({"op": "status"})["proxy"]
        if not proxy["open_flows"] or time.monotonic() > end:
            return proxy
        time.sleep(0.05)


def test_an_origin_that_closes_as_it_accepts_gets_its_client_a_502(corral_filter, misbehaving):
    """The lane once waited for ever when the origin's end came before the dial was done
    (many at once make that likely): no answer, its flow and its session's connection held
    after the client left."""
    answers: list[bytes] = []

    def one(i: int) -> None:
        with connect(corral_filter.proxy_port) as sock:
            sock.sendall(get(f"/shut/{i}", host="shut.wild.test"))
            answers.append(recv_all(sock)[:12])  # b"" at the 5 s timeout: no answer

    for _ in range(2):
        threads = [threading.Thread(target=one, args=(i,)) for i in range(30)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    assert answers == [b"HTTP/1.1 502"] * 60
    proxy = settled(corral_filter)
    assert proxy["open_flows"] == 0 and not proxy["per_session"].get("s1", {}).get(
        "connections")


def test_an_origin_streaming_unasked_bytes_is_closed_not_buffered(corral_filter, misbehaving):
    """After its answer the origin streams 200 MiB nobody asked for while the client sits
    idle: the filter closes that connection (it held the whole stream in memory once)."""
    origin = misbehaving["flood.wild.test"]
    lost = origin.lost
    buffered = bytearray()
    with connect(corral_filter.proxy_port) as sock:
        sock.sendall(get("/flood", host="flood.wild.test"))
        assert read_response(sock, buffered).endswith(b"hi")
        end = time.monotonic() + 10
        while origin.lost == lost and time.monotonic() < end:
            time.sleep(0.05)
    assert origin.lost == lost + 1, "the filter kept reading what nobody asked for"


def test_a_response_head_over_the_limit_is_refused_as_forward_refuses_it(corral_filter,
                                                                         misbehaving):
    with connect(corral_filter.proxy_port) as sock:
        sock.sendall(get("/huge", host="huge.wild.test"))
        answer = recv_all(sock)
    assert answer.startswith(b"HTTP/1.1 502") and b"too large" in answer


@pytest.mark.parametrize("first", ["GET", "POST"])
def test_bytes_an_origin_sends_after_its_answer_never_answer_the_next_request(
        corral_filter, misbehaving, first):
    """The next request goes to forward.py (a POST) with the connection the first one used:
    what the origin sent unasked meanwhile must not be read as its answer (forward.py read
    it so, on its own, before)."""
    buffered, host = bytearray(), f"{first.lower()}.extra.wild.test"
    with connect(corral_filter.proxy_port) as sock:
        extra = "Content-Length: 1\r\n" if first == "POST" else ""
        sock.sendall(get("/a", host=host, method=first, extra=extra) + (b"x" if extra else b""))
        assert read_response(sock, buffered).endswith(b"first")
        time.sleep(0.6)  # the unasked answer arrives
        sock.sendall(get("/b", host=host, method="POST", extra="Content-Length: 1\r\n") + b"x")
        assert read_response(sock, buffered).endswith(b"first")

