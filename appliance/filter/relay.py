"""Moving bytes: tunnels, HTTP body framing, and where a redirected connection was going.

No decisions here; proxy.py decides, this module only copies, with bounded buffers
(`drain()` for back-pressure) and an idle timeout shared by both directions of a tunnel.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from dataclasses import dataclass, field

from .http import Head, HttpError, parse_chunk_size

CHUNK = 256 * 1024
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h


@dataclass
class Counters:
    up: int = 0
    """Client to upstream."""
    down: int = 0
    """Upstream to client."""
    started: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)

    def add(self, n: int, upward: bool) -> None:
        if upward:
            self.up += n
        else:
            self.down += n
        self.last = time.monotonic()

    def duration(self) -> float:
        return round(time.monotonic() - self.started, 6)


def original_port(writer: asyncio.StreamWriter, default: int) -> int:
    """The destination port before nftables redirected the connection to us.

    Falls back to `default` when the connection was not redirected (a direct connection
    to the transparent listener reports our own address, or no NAT entry exists).
    """
    sock = writer.get_extra_info("socket")
    try:
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    except OSError:
        return default
    port = int.from_bytes(raw[2:4], "big")
    address = socket.inet_ntoa(raw[4:8])
    if (address, port) == tuple(sock.getsockname()[:2]):
        return default
    return port


def set_nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _pump(reader, writer, counters: Counters, upward: bool, idle: float) -> None:
    while True:
        try:
            data = await asyncio.wait_for(reader.read(CHUNK), idle)
        except TimeoutError:
            if time.monotonic() - counters.last < idle:
                continue  # the other direction is busy; the tunnel is not idle
            raise
        if not data:
            if writer.can_write_eof():
                with contextlib.suppress(OSError):
                    writer.write_eof()
            return
        counters.add(len(data), upward)
        writer.write(data)
        await writer.drain()


async def tunnel(client_r, client_w, up_r, up_w, counters: Counters, idle: float) -> None:
    """Copy both ways until both sides have finished, one side fails, or both sit idle."""
    tasks = [
        asyncio.create_task(_pump(client_r, up_w, counters, True, idle), name="tunnel-up"),
        asyncio.create_task(_pump(up_r, client_w, counters, False, idle), name="tunnel-down"),
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def copy_exact(reader, writer, n: int, counters: Counters, upward: bool, idle: float):
    while n > 0:
        data = await asyncio.wait_for(reader.read(min(n, CHUNK)), idle)
        if not data:
            raise ConnectionError("peer closed in the middle of a message body")
        n -= len(data)
        counters.add(len(data), upward)
        writer.write(data)
        await writer.drain()


async def copy_chunked(reader, writer, counters: Counters, upward: bool, idle: float):
    """Copy a chunked body verbatim, parsing its framing to know where it ends."""

    async def line() -> bytes:
        try:
            data = await asyncio.wait_for(reader.readuntil(b"\r\n"), idle)
        except asyncio.LimitOverrunError:
            raise HttpError(400, "chunk line too long") from None
        except asyncio.IncompleteReadError:
            raise ConnectionError("peer closed in the middle of a chunked body") from None
        writer.write(data)
        return data

    while True:
        size = parse_chunk_size((await line())[:-2])
        if size == 0:
            while (await line()) != b"\r\n":  # trailer fields, then the empty line
                pass
            await writer.drain()
            return
        await copy_exact(reader, writer, size, counters, upward, idle)
        if (await line()) != b"\r\n":
            raise HttpError(400, "chunk data not followed by CRLF")


async def copy_body(head: Head, reader, writer, counters, upward: bool, idle: float) -> None:
    """Copy a request body, or a response body that is framed by length or chunks."""
    if head.chunked:
        await copy_chunked(reader, writer, counters, upward, idle)
    elif head.content_length:
        await copy_exact(reader, writer, head.content_length, counters, upward, idle)


async def copy_until_eof(reader, writer, counters: Counters, idle: float) -> None:
    while data := await asyncio.wait_for(reader.read(CHUNK), idle):
        counters.add(len(data), upward=False)
        writer.write(data)
        await writer.drain()
