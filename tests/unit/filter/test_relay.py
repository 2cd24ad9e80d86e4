"""A spliced tunnel's descriptors: every one released on every path, the failing ones too."""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import socket

import pytest

from appliance.filter.relay import TUNNEL_FDS, Counters, _SplicedTunnel


def open_fds() -> set[int]:
    """Open descriptors (not the one listing /proc/self/fd used, closed by now)."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
        except OSError:
            continue
        out.add(int(name))
    return out


def lowest_free(count: int) -> list[int]:
    used, free, fd = open_fds(), [], 0
    while len(free) < count:
        if fd not in used:
            free.append(fd)
        fd += 1
    return free


@pytest.mark.parametrize("room", range(TUNNEL_FDS))
def test_a_tunnel_that_runs_out_of_descriptors_half_way_releases_what_it_took(room):
    """A real EMFILE at every step of building a spliced tunnel (the process may open only
    `room` more descriptors): nothing stays open, nothing stays registered."""
    loop = asyncio.new_event_loop()
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        before, watched = open_fds(), set(loop._selector.get_map())
        limit = lowest_free(room + 1)[-1]  # descriptors below it: exactly `room` free
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        try:
            with pytest.raises(OSError) as info:
                _SplicedTunnel(loop, b, c, Counters())
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert info.value.errno == errno.EMFILE
        assert open_fds() == before
        assert set(loop._selector.get_map()) == watched  # no reader or writer left behind
    finally:
        for sock in (a, b, c, d):
            sock.close()
        loop.close()


def test_a_whole_tunnel_costs_what_the_budget_says_and_gives_it_all_back():
    loop = asyncio.new_event_loop()
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    try:
        before = open_fds()
        spliced = _SplicedTunnel(loop, b, c, Counters())
        assert len(open_fds() - before) == TUNNEL_FDS
        spliced.close()
        assert open_fds() == before
    finally:
        for sock in (a, b, c, d):
            sock.close()
        loop.close()


def test_a_body_of_tiny_chunks_gives_the_loop_its_turns():
    """10,000 one-byte chunks, all buffered already: the copy yields every YIELD_EVERY
    chunks, so another task keeps running meanwhile (the loop is never held for the whole
    body)."""
    from appliance.filter.relay import YIELD_EVERY, copy_chunked

    async def run() -> tuple[int, bytes]:
        reader = asyncio.StreamReader(limit=1 << 16)
        reader.feed_data(b"1;x\r\na\r\n" * 10_000 + b"0\r\n\r\n")
        reader.feed_eof()
        out = bytearray()

        class Sink:
            def write(self, data):
                out.extend(data)

            async def drain(self):
                pass

        turns = 0

        async def other():
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        neighbour = asyncio.get_running_loop().create_task(other())
        await copy_chunked(reader, Sink(), Counters(), True, 5.0)
        neighbour.cancel()
        return turns, bytes(out)

    turns, out = asyncio.run(run())
    assert out == b"1\r\na\r\n" * 10_000 + b"0\r\n\r\n"  # re-framed: the extensions are gone
    assert turns >= 10_000 // YIELD_EVERY


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_reset_upstream_closed_here_leaves_no_error_nobody_takes(loop):
    """A connection reset by its peer, read (the reset raised to the reader) and closed:
    relay.settled takes the error its closing holds too, the one asyncio would log as
    "Future exception was never retrieved" if the garbage collector freed it first. On a
    real loopback connection, reset with SO_LINGER 0; the future is asyncio's own, so an
    interpreter that renames it fails here rather than logging in production."""
    import struct

    import uvloop

    from appliance.filter.relay import settled

    async def main() -> asyncio.Future:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_accept(sock_reader, sock_writer):
            accepted.set_result(sock_writer)

        server = await asyncio.start_server(on_accept, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        peer = await accepted
        sock = peer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peer.transport.abort()  # RST
        with pytest.raises(ConnectionResetError):
            while await reader.read(65536):
                pass
        closing = writer._protocol._closed
        assert isinstance(closing, asyncio.Future)
        writer.close()
        settled(writer)
        for _ in range(5):
            await asyncio.sleep(0)
        server.close()
        await server.wait_closed()
        return closing

    run = uvloop.run if loop == "uvloop" else asyncio.run
    closing = run(main())
    assert closing.done()
    assert closing._log_traceback is False  # taken: nothing will log it (read before
    assert isinstance(closing.exception(), ConnectionResetError)  # this takes it too)
