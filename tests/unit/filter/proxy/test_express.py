"""The express lane's reading of a request head, without sockets: a transport that keeps
what is written, a proxy that admits (the rest is tests/integration/filter/test_express.py,
against a real filter process)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from appliance.filter.proxy.express import HEAD, Lane
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

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed


def lane() -> tuple[Lane, Transport]:
    config = SimpleNamespace(max_header_bytes=65536, header_timeout=10, idle_timeout=60)
    proxy = SimpleNamespace(forward=None, config=config, lanes=set(),
                            admit=lambda client, abort: True)
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
