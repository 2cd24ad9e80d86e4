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


def lane(forward=None) -> tuple[Lane, Transport]:
    config = SimpleNamespace(max_header_bytes=65536, header_timeout=10, idle_timeout=60)
    proxy = SimpleNamespace(forward=forward, config=config, lanes=set(),
                            admit=lambda client, abort: True, release=lambda client: None)
    served = Lane(proxy, Explicit())
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
