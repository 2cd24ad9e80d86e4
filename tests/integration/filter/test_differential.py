"""Differential test: what the origin reads is exactly what the proxy decided on.

Generated request streams — valid ones and hostile ones (framing fields named in Connection,
chunk lines and trailers spelt oddly, bare LFs, leading empty lines, absolute-form targets in
any scheme case, Host headers that disagree, bodies that are themselves requests, pipelining)
— go through the proxy on each path (explicit, transparent, inside a CONNECT tunnel) to a
recording origin that parses them with h11, a strict HTTP/1.1 parser independent of ours.
For every stream: the origin never sees a message it cannot parse, never a request for any
host but the allowed one, and exactly as many requests as the proxy allowed for that client.
The denied name lives on the same address as the allowed one, as on every CDN.
"""

from __future__ import annotations

import itertools
import socket
import socketserver
import threading
import time

import h11
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.integration.conftest import FilterProcess, connect

DIFF_ORIGIN = "127.31.0.3"
ALLOWED, DENIED = "diff-allowed.test", "diff-denied.test"
EXAMPLES = 300
_tags = itertools.count(1)


class Recorder:
    """An origin on DIFF_ORIGIN:80 that reads with h11 and answers every request."""

    def __init__(self):
        self.requests: list[dict] = []
        self.errors: list[str] = []
        self.open = 0
        self.lock = threading.Lock()
        recorder = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                with recorder.lock:
                    recorder.open += 1
                try:
                    recorder.serve(self.request)
                finally:
                    with recorder.lock:
                        recorder.open -= 1

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer((DIFF_ORIGIN, 80), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def serve(self, sock: socket.socket) -> None:
        conn = h11.Connection(h11.SERVER)
        sock.settimeout(10)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                self.errors.append(f"{exc}")
                return
            if event is h11.NEED_DATA:
                try:
                    data = sock.recv(65536)
                except OSError:
                    return
                if not data:
                    self._at_eof(conn)
                    return
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                headers = [(k.decode(), v.decode("latin-1")) for k, v in event.headers]
                with self.lock:
                    self.requests.append({"method": event.method.decode(),
                                          "target": event.target.decode("latin-1"),
                                          "headers": headers})
            elif isinstance(event, h11.EndOfMessage):
                body = b"ok"
                sock.sendall(conn.send(h11.Response(status_code=200, headers=[
                    ("Content-Length", str(len(body)))])) + conn.send(h11.Data(data=body))
                    + conn.send(h11.EndOfMessage()))
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                return

    def _at_eof(self, conn: h11.Connection) -> None:
        """The proxy closed: a message cut short by the client hanging up is no smuggling."""
        conn.receive_data(b"")
        try:
            while True:
                event = conn.next_event()
                if isinstance(event, h11.ConnectionClosed) or event in (h11.NEED_DATA,
                                                                        h11.PAUSED):
                    return
                if isinstance(event, h11.Request):  # a whole head arrived with the EOF
                    self.requests.append({"method": event.method.decode(),
                                          "target": event.target.decode("latin-1"),
                                          "headers": [(k.decode(), v.decode("latin-1"))
                                                      for k, v in event.headers]})
        except h11.RemoteProtocolError:
            pass  # incomplete at EOF: the client's stream ended mid-message

    def seen(self, tag: str, expected: int) -> list[dict]:
        """This example's requests, once the origin has read as many as `expected` and closed
        every connection — or as they stand after 5 s (the origin's threads may lag behind
        the client, which has its answers already; a leak or a mismatch shows after 5 s)."""
        deadline = time.monotonic() + 5
        while True:
            with self.lock:
                seen = [r for r in self.requests if f"/ex{tag}/" in r["target"]]
                idle = not self.open
            if (idle and len(seen) == expected) or time.monotonic() > deadline:
                return seen
            time.sleep(0.01)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def corral_filter(internet, tmp_path_factory, request):
    """The filter, keeping no idle upstream (proxy/pool.py): each stream's upstream closes
    with its client, so what the origin read is all that stream caused, and an upstream
    left open is a leak. (Kept upstreams have their own test in test_proxy.py.)"""
    process = FilterProcess(tmp_path_factory.mktemp("filter"), internet.dns.address,
                            event_loop=request.param,
                            proxy_extra="kept_upstreams_per_session = 0")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def recorder(corral_filter, internet):
    try:
        origin = Recorder()
    except PermissionError:
        pytest.skip("binding port 80 on 127.31.0.3 needs root (run scripts/test as root)")
    for name in (ALLOWED, DENIED):
        internet.dns.zone[name] = [("A", DIFF_ORIGIN, 300)]
    assert corral_filter.control({"op": "add", "session": "s1", "kind": "http",
                                  "rule": ALLOWED})["ok"]
    yield origin
    corral_filter.control({"op": "remove", "session": "s1", "kind": "http", "rule": ALLOWED})
    origin.close()


# -- generated request streams -----------------------------------------------------------------

def weighted(*choices: tuple[object, int]):
    """A choice among values, each as often as its weight: valid requests mostly, with hostile
    features mixed in, so that streams reach the origin and the odd ones sit between them."""
    return st.sampled_from([value for value, weight in choices for _ in range(weight)])


NAMES = weighted((ALLOWED, 8), (ALLOWED.upper(), 1), (ALLOWED + ".", 1), (f"{ALLOWED}:80", 2),
                 (DENIED, 3), (f"{DENIED}:80", 1), (f"{ALLOWED}:8080", 1))
CONNECTION = weighted((None, 8), ("keep-alive", 3), ("close", 1), ("keep-alive, Content-Length", 1),
                      ("Transfer-Encoding", 1), ("Host", 1), ("X-Other", 1), ("upgrade", 1))


@st.composite
def request(draw, tag: str, explicit: bool) -> bytes:
    n = draw(st.integers(0, 999))
    path = f"/ex{tag}/r{n}"
    name = draw(NAMES)  # where the request means to go; its Host header mostly agrees
    form = "absolute" if explicit else draw(weighted(("origin", 3), ("absolute", 1)))
    if form == "origin":
        target = path
    else:
        scheme = draw(weighted(("http", 4), ("HTTP", 1), ("hTtP", 1)))
        target = f"{scheme}://{name}{path}"
    version = draw(weighted(("HTTP/1.1", 4), ("HTTP/1.0", 1)))
    method = draw(weighted(("GET", 1), ("POST", 1)))
    lines = [f"{method} {target} {version}"]
    hosts = draw(weighted(("same", 8), ("other", 2), ("none", 1), ("twice", 1)))
    if hosts != "none":
        lines.append(f"Host: {name if hosts == 'same' else draw(NAMES)}")
    if hosts == "twice":
        lines.append(f"Host: {draw(NAMES)}")
    connection = draw(CONNECTION)
    if connection:
        lines.append(f"Connection: {connection}")
    smuggled = (f"GET /ex{tag}/smuggled HTTP/1.1\r\nHost: {DENIED}\r\n\r\n").encode()
    framing = draw(weighted(("none", 6), ("length", 4), ("wrong-length", 1), ("chunked", 3),
                            ("chunked-odd", 2), ("both", 1), ("two-lengths", 1),
                            ("unframed-body", 1)))
    body = b"" if framing == "none" else draw(weighted((b"", 1), (b"hello", 2), (smuggled, 2)))
    if framing in ("length", "both", "two-lengths"):
        lines.append(f"Content-Length: {len(body)}")
    if framing == "two-lengths":
        lines.append(f"Content-Length: {len(body) + 1}")
    if framing == "wrong-length":
        lines.append(f"Content-Length: {max(0, len(body) - 3)}")
    if framing in ("chunked", "chunked-odd", "both"):
        lines.append("Transfer-Encoding: chunked")
    lines.append(draw(weighted(("X-Fine: y", 8), (" folded: x", 1), ("Bad : x", 1),
                               ("X-Ctl: a\rb", 1))))
    eol = draw(weighted(("\r\n", 12), ("\n", 1)))
    head = ("\r\n" * draw(weighted((0, 6), (1, 2), (2, 1))) + eol.join(lines) + "\r\n\r\n"
            ).encode()
    if framing == "chunked":
        payload = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    elif framing == "chunked-odd":
        spelling = draw(weighted((b"%X;ext=1\r\n", 2), (b"%x \r\n", 1), (b"%x\n", 1),
                                 (b"0%x\r\n", 2), (b"+%x\r\n", 1), (b"%x ; a=\"b\"\r\n", 1)))
        trailer = draw(weighted((b"", 2), (b"X-T: 1\r\n", 2), (b"X-T: 1\n", 1),
                                (f"Host: {DENIED}\r\n".encode(), 1)))
        payload = ((spelling % len(body)) + body + b"\r\n" if body else b"") + (
            b"0\r\n" + trailer + b"\r\n")
    else:
        payload = body
    return head + payload


@st.composite
def stream(draw) -> tuple[str, str, bytes]:
    tag = str(next(_tags))
    path = draw(weighted(("explicit", 1), ("transparent", 1), ("tunnel", 1)))
    requests = draw(st.lists(request(tag, path == "explicit"), min_size=1, max_size=3))
    return tag, path, b"".join(requests)


def send(corral_filter, path: str, data: bytes) -> tuple[str, bytes]:
    """Send a stream on one client connection, half-close, read everything back."""
    port = corral_filter.http_port if path == "transparent" else corral_filter.proxy_port
    sock = connect(port, timeout=10)
    label = f"127.0.0.1:{sock.getsockname()[1]}"
    with sock:
        if path == "tunnel":
            sock.sendall(f"CONNECT {ALLOWED}:80 HTTP/1.1\r\nHost: {ALLOWED}:80\r\n\r\n"
                         .encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(4096)
                assert chunk, "the proxy closed instead of answering CONNECT"
                head += chunk
            assert head.startswith(b"HTTP/1.1 200"), head
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        replies = b""
        while chunk := sock.recv(65536):
            replies += chunk
    return label, replies


@given(example=stream())
@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                        HealthCheck.too_slow])
def test_the_origin_reads_exactly_the_requests_the_proxy_allowed(corral_filter, recorder,
                                                                 example):
    tag, path, data = example
    recorder.errors.clear()  # each example answers for its own stream
    last = max((e["id"] for e in corral_filter.events()), default=0)  # client ports recur
    label, _ = send(corral_filter, path, data)
    allowed = [e for e in corral_filter.events() if e["id"] > last and e["client"] == label
               and e["kind"] == "http" and e["verdict"] == "allow" and not e.get("closed")]
    seen = recorder.seen(tag, len(allowed))
    assert not recorder.errors, (recorder.errors, data)
    assert not recorder.open, ("an upstream connection outlived its client", data)
    for r in seen:
        hosts = [v for k, v in r["headers"] if k.lower() == "host"]
        assert hosts == [ALLOWED], (r, data)
        assert r["target"].startswith(f"/ex{tag}/"), (r, data)
        assert "smuggled" not in r["target"], (r, data)
    assert len(seen) == len(allowed), (seen, allowed, data)
    event(f"{path}: {len(seen)} of the requests reached the origin")
    assert all(e["name"] == ALLOWED for e in allowed)


def test_the_generator_reaches_the_origin_and_the_proxy_refuses(corral_filter, recorder):
    """The property above is not vacuous: a plain request does reach the origin, and the
    hostile ones above are refused rather than dropped silently."""
    tag = str(next(_tags))
    _, replies = send(corral_filter, "transparent",
                      f"GET /ex{tag}/plain HTTP/1.1\r\nHost: {ALLOWED}\r\n\r\n".encode())
    assert replies.startswith(b"HTTP/1.1 200")
    assert [r["target"] for r in recorder.seen(tag, 1)] == [f"/ex{tag}/plain"]
    _, replies = send(corral_filter, "transparent",
                      f"GET /ex{tag}/x HTTP/1.1\r\nHost: {DENIED}\r\n\r\n".encode())
    assert replies.startswith(b"HTTP/1.1 403")
