"""The express lane's reading of a request head, without sockets: a transport that keeps
what is written, a proxy that admits (the rest is tests/integration/filter/test_express.py,
against a real filter process)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from appliance.filter.proxy.express import HEAD, Lane, Origin
from appliance.filter.proxy.pipeline import Explicit


class Counted(bytearray):
    """A buffer that counts the bytes its searches look at."""

    looked = 0

    def find(self, sub, start=0, *args):
        Counted.looked += max(len(self) - start, 0)
        return super().find(sub, start, *args)


class Transport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.written, self.closed = bytearray(), False

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 40000) if name == "peername" else default

    def write(self, data):
        self.written += data

    paused = False

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed


def lane(forward=None, mode=None) -> tuple[Lane, Transport]:
    config = SimpleNamespace(max_header_bytes=65536, header_timeout=10, idle_timeout=60)
    proxy = SimpleNamespace(forward=forward, config=config, lanes=set(),
                            admit=lambda client, abort: True, release=lambda client: None)
    served = Lane(proxy, mode or Explicit())
    transport = Transport()
    served.connection_made(transport)
    served.buffer = Counted()
    return served, transport


def test_a_head_trickled_in_a_byte_at_a_time_is_searched_once():
    async def trickle():
        served, transport = lane()
        head = b"GET http://a.test/" + b"x" * 20000 + b" HTTP/1.1\r\n"
        for byte in head:
            served.data_received(bytes([byte]))
        assert served.phase == HEAD and not transport.written and not transport.closed
        served._leave()
        return len(head)

    Counted.looked = 0
    length = asyncio.run(trickle())
    assert Counted.looked < 4 * length  # searched from where the last search ended


def test_a_connect_head_is_read_once_here_and_the_tunnels_bytes_left_after_it():
    """On the explicit listener the lane reads a CONNECT's head (it once handed the
    connection over at the method's first word, and forward.py read the head again):
    forward.py gets it parsed, and the bytes after it (a ClientHello sent early) to read."""
    from appliance.filter.proxy.pipeline import Transparent

    async def connect(mode, pieces):
        served_with = []
        forward = SimpleNamespace(serve=lambda client, mode, kept, **how: served_with.append(
            (kept, how)))
        served, transport = lane(forward, mode)
        handed = []
        served._to_streams = handed.append  # the handler forward.py's task would run
        for piece in pieces:
            assert not handed, f"handed over before {piece!r}"
            served.data_received(piece)
        assert len(handed) == 1 and not transport.written
        handed[0]("client")
        left = bytes(served.buffer)
        served._leave()
        return served_with, left

    pieces = (b"CONNEC", b"T a.test:443 HTTP/1.1\r\nHost: a.test:443\r", b"\n\r\n\x16\x03\x01")
    served_with, left = asyncio.run(connect(Explicit(), pieces))
    [(kept, how)] = served_with
    assert kept is None and how["opening"] is True
    assert how["parsed"].start == ("CONNECT", "a.test:443", "HTTP/1.1")
    assert left == b"\x16\x03\x01"
    # the transparent listeners take no CONNECT: over at its first word, unread
    served_with, left = asyncio.run(connect(Transparent(80), (b"CONNEC",)))
    assert served_with[0][1]["parsed"] is None and left == b"CONNEC"


def test_an_origin_paused_for_a_client_that_was_behind_is_pooled_reading():
    """A client behind its response pauses the origin's reading; the client gone, the
    origin goes to the pool, and the next connection that takes it must read its answer
    (it once waited for ever on uvloop)."""
    kept = []

    async def behind_then_gone():
        forward = SimpleNamespace(_keep=lambda client, origin: kept.append(
            (origin, origin.transport.paused)))
        served, _ = lane(forward)
        origin = Origin(served, 65536)
        origin.connection_made(Transport())
        served.origin = origin
        served.pause_writing()
        assert origin.transport.paused
        served.connection_lost(None)

    asyncio.run(behind_then_gone())
    assert len(kept) == 1 and kept[0][1] is False and kept[0][0].lane is None


def test_a_pooled_upstream_the_lane_takes_keeps_its_connection_open_and_gives_it_back():
    """forward.py's Upstream taken by the lane (Origin.adopt) and given back (streams): its
    StreamWriter, once unreferenced, would close the connection when collected (Python
    3.11.8 on: the appliance's 3.13; here, on 3.11.2, the round trip is what is checked)."""
    import gc
    import socket

    from appliance.filter.proxy.forward import Upstream
    from appliance.filter.relay import PeerWriter

    async def round_trip():
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        kept = Upstream(("a.test", 80), reader, PeerWriter(writer), "192.0.2.1", "s1", 3)
        transport = writer.transport
        served, _ = lane()
        origin = Origin.adopt(kept, served, 65536)
        del kept, reader, writer
        gc.collect()
        await asyncio.sleep(0)
        assert not transport.is_closing() and transport.get_protocol() is origin
        back = origin.streams()  # as the lane hands it over
        gc.collect()
        back.writer.write(b"ping")
        theirs.sendall(b"pong")
        assert await asyncio.wait_for(back.reader.readexactly(4), 1) == b"pong"
        assert theirs.recv(4) == b"ping" and not transport.is_closing()
        served._leave()
        back.close()
        theirs.close()

    asyncio.run(round_trip())


def test_a_last_response_the_client_is_behind_on_is_drained_before_the_connection_goes():
    """Its response the last (HTTP/1.0), its end written while the client is behind: the
    connection keeps its place until the client took it, then closes. It once closed at
    once, gave its place back, and kept the socket and what it still had to send for as
    long as the client read nothing."""
    from appliance.filter.http import parse_request
    from appliance.filter.proxy.express import DRAIN, Exchange
    from appliance.filter.proxy.plan import Send

    released = []

    async def behind():
        served, transport = lane()
        served.proxy.release = released.append
        served.proxy.untrack = lambda flow: None
        served.proxy.closed = lambda event, counters: None
        served.proxy.stats = {"express_requests": 0}
        origin = Origin(served, 65536)
        origin.connection_made(Transport())
        served.origin = origin
        head = parse_request(b"GET http://a.test/ HTTP/1.0\r\n\r\n")
        exchange = Exchange(None, "s1", Send(head, None, {}))
        exchange.flow, exchange.event, exchange.left = object(), {}, 5
        served.exchange, served.phase = exchange, 3  # BODY
        transport.write = lambda data: served.pause_writing()  # over the high-water mark
        served._relay(origin, b"hello")
        assert served.phase == DRAIN and not released and not transport.closed
        served.resume_writing()  # the client took it
        assert released and transport.closed

    asyncio.run(behind())


def test_a_client_gone_as_its_tunnel_is_dialled_still_gets_the_decision_event():
    """The tunnel's 200 is written once the upstream answered (Proxy.open's `dialled`),
    before the decision event. A client that reset during the dial makes that write raise:
    it once escaped open() with the flow tracked, the upstream open and no event at all.
    Now open() returns as ever, and the tunnel's own cleanup ends what it holds."""
    from appliance.filter.proxy import Proxy
    from appliance.filter.relay import PeerWriter
    from appliance.policy import Decision

    class Closing:
        def is_closing(self):
            return True  # the client reset while the dial was awaited

        def write(self, data):
            raise AssertionError("written to a closing transport")

    events, tracked = [], set()
    upstream = (object(), object())

    async def dial(*args):
        return upstream, "192.0.2.1"

    async def judge(*args):
        return "s1", None, Decision(True, "allowed")

    def track(*args):
        tracked.add(7)
        return SimpleNamespace(id=7, address=None)

    proxy = SimpleNamespace(judge=judge, exfil=None, track=track, inspects=lambda p, h: False,
                            dial=dial, untrack=lambda flow: tracked.discard(flow.id),
                            event=lambda *args, **extra: events.append(extra) or {"id": 7})
    client = SimpleNamespace(writer=PeerWriter(Closing()))
    connection, event, flow = asyncio.run(Proxy.open(
        proxy, client, "a.test", 443, "connect", "a.test:443",
        dialled=lambda: client.writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")))
    assert connection is upstream and event == {"id": 7} and flow.address == "192.0.2.1"
    assert events == [{"event_id": 7}] and tracked == {7}  # the caller's to end, as ever
