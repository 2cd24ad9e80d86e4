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


async def _connection() -> tuple[tuple, tuple]:
    """Both ends of one loopback TCP connection, as asyncio streams: (near, far)."""
    loop = asyncio.get_running_loop()
    accepted = loop.create_future()
    server = await asyncio.start_server(lambda r, w: accepted.set_result((r, w)),
                                        "127.0.0.1", 0)
    near = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    far = await accepted
    server.close()
    return near, far


async def _close(*writers) -> None:
    for writer in writers:
        writer.close()
    await asyncio.sleep(0)


def test_a_spliced_body_takes_the_descriptors_its_budget_says_and_gives_them_back():
    """splice_exact adds BODY_FDS descriptors while it runs (within a tunnel's TUNNEL_FDS,
    which a tunnel serving HTTP does not use: limits.py counts on it), moves the body
    exactly, and closes them all."""
    from appliance.filter.relay import BODY_FDS, STATS, splice_exact

    assert BODY_FDS <= TUNNEL_FDS
    spliced = STATS["spliced_bodies"]

    async def run():
        (up_r, up_w), (_, origin_w) = await _connection()  # the filter dials the origin
        (client_r, client_w), (_, to_client) = await _connection()  # the client dials it
        n, body = 3 << 20, os.urandom(3 << 20)
        before = open_fds()
        origin_w.write(body[:1 << 20])
        splicing = asyncio.create_task(splice_exact(up_r, up_w, to_client, n, Counters(),
                                                    False, 5))
        got = await asyncio.wait_for(client_r.readexactly(1 << 20), 10)  # then it waits
        during = len(open_fds() - before)
        origin_w.write(body[1 << 20:] + b"next")
        got += await asyncio.wait_for(client_r.readexactly(n - len(got)), 10)
        left = await splicing
        after = open_fds() == before
        following = await up_r.readexactly(4)  # what came behind the body, for the stream
        await _close(up_w, origin_w, client_w, to_client)
        return got == body, left, during, after, following

    assert asyncio.run(run()) == (True, 0, BODY_FDS, True, b"next")
    assert STATS["spliced_bodies"] == spliced + 1


@pytest.mark.parametrize("room", range(4))
def test_a_body_that_finds_no_descriptor_to_splice_with_is_copied_whole(room):
    """A real EMFILE at each of the splice's descriptors: nothing it took stays open, and
    the body goes on through the copy, exactly."""
    from appliance.filter.relay import STATS, copy_exact

    spliced = STATS["spliced_bodies"]

    async def run():
        (up_r, up_w), (_, origin_w) = await _connection()  # the filter dials the origin
        (client_r, client_w), (_, to_client) = await _connection()  # the client dials it
        n, body = 2 << 20, os.urandom(2 << 20)
        origin_w.write(body)
        before = open_fds()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free(room + 1)[-1], hard))
        try:
            copying = asyncio.create_task(copy_exact(up_r, to_client, n, Counters(), False, 5,
                                                     b"", up_w))
            got = await asyncio.wait_for(client_r.readexactly(n), 10)
            await copying
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        after = open_fds() == before
        await _close(up_w, origin_w, client_w, to_client)
        return got == body, after

    assert asyncio.run(run()) == (True, True)
    assert STATS["spliced_bodies"] == spliced  # it never began
