"""Moving bytes: tunnels, HTTP body framing, and where a redirected connection was going.

No decisions here; proxy.py decides, this module only copies, with bounded buffers
(`drain()` for back-pressure) and an idle timeout shared by both directions of a tunnel.
An established tunnel between two sockets moves its bytes with splice(2) through a pipe:
they never enter Python.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import struct
import time
from dataclasses import dataclass, field

from .http import Head, HttpError, check_trailer_line, parse_chunk_size

CHUNK = 256 * 1024
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
SPLICE = getattr(os, "splice", None)
SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
F_SETPIPE_SZ = 1031  # linux/fcntl.h
PIPE_SIZE = 1 << 20
YIELD_EVERY = 64
"""Chunks copied before the loop is given a turn: a body of many tiny chunks, all in the
buffer already, would otherwise hold the one event loop for as long as it lasts."""
TUNNEL_FDS = 6
"""Descriptors a spliced tunnel adds to its two connections (see _SplicedTunnel)."""
BODY_FDS = 4
"""Descriptors splicing a body adds (two duplicates and a pipe, see splice_exact): within a
tunnel's TUNNEL_FDS, which a tunnel that serves HTTP rather than being spliced holds unused."""
SPLICED_BODY_MIN = 1 << 20
"""Bytes of a body past which it is spliced when its caller allows (see splice_exact):
below, setting the splice up costs about what the copies it saves do."""
SIOCATMARK = 0x8905  # linux/sockios.h: is the socket's next byte urgent data?
URGENT = ("TCP urgent data in a spliced tunnel (splice cannot move past it, and TLS has no "
          "use for it)")
STUCK_WAKEUPS = 3
"""Wake-ups in a row for a readable socket that splice takes nothing from, after which a
spliced tunnel ends (TCP urgent data: see _Splice._readable)."""
STATS = {"spliced": 0, "streamed": 0, "spliced_bodies": 0}
"""Tunnels by how their bytes moved (status reports it: a fallback should be visible), and
the response bodies in tunnels whose splice began (splice_exact)."""


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


async def within(awaitable, seconds: float | None):
    """`await` with a time limit (TimeoutError), as `async with asyncio.timeout(seconds)`
    has it, but on one timer per task (_Deadline) that each call moves, rather than a timer
    scheduled and cancelled per call: a proxied request awaits a dozen, and a keep-alive
    connection does it for every request. Without a task, or inside another `within` of the
    same task, asyncio.timeout itself."""
    if seconds is None:
        return await awaitable
    task = asyncio.current_task()
    deadline = _DEADLINES.get(task)
    if deadline is None and task is not None:
        deadline = _DEADLINES[task] = _Deadline(task)
        task.add_done_callback(_forget)
    elif deadline is None or deadline.armed:
        async with asyncio.timeout(seconds):
            return await awaitable
    deadline.arm(seconds)
    try:
        return await awaitable
    except asyncio.CancelledError as exc:
        if deadline.disarm():
            raise TimeoutError from exc
        raise
    finally:
        deadline.disarm()


class _Deadline:
    """A task's time limit for `within`: when it ends (`when`), and one timer that fires at
    or before it. Moving the limit later leaves the timer alone; when it fires early it is
    set again for the limit, so an idle connection costs a wake-up per timeout, and a busy
    one none. Expiry is asyncio.timeout's: the task is cancelled, and the cancellation
    becomes a TimeoutError where it was waiting, unless someone else cancelled it too."""

    __slots__ = ("armed", "at", "cancelling", "expired", "handle", "loop", "task", "when")

    def __init__(self, task: asyncio.Task):
        self.task, self.loop = task, task.get_loop()
        self.when = self.at = 0.0
        self.handle: asyncio.TimerHandle | None = None
        self.armed = self.expired = False
        self.cancelling = 0

    def arm(self, seconds: float) -> None:
        self.when = when = self.loop.time() + seconds
        self.cancelling = self.task.cancelling()
        self.armed = True
        if self.handle is None:
            self.at, self.handle = when, self.loop.call_at(when, self._fire)
        elif when < self.at:
            self.handle.cancel()
            self.at, self.handle = when, self.loop.call_at(when, self._fire)

    def disarm(self) -> bool:
        """Stop waiting; True when the limit expired and its cancellation was the only one
        (the caller raises TimeoutError), as asyncio.Timeout.__aexit__ decides."""
        if not self.armed:
            return False
        self.armed = False
        if not self.expired:
            return False
        self.expired = False
        return self.task.uncancel() <= self.cancelling

    def _fire(self) -> None:
        self.handle = None
        if not self.armed:
            return
        if self.at < self.when:  # moved later since the timer was set
            self.at, self.handle = self.when, self.loop.call_at(self.when, self._fire)
            return
        self.expired = True
        self.task.cancel()


_DEADLINES: dict[asyncio.Task, _Deadline] = {}
"""Each task's _Deadline, from its first `within` until it is done."""


def _forget(task: asyncio.Task) -> None:
    deadline = _DEADLINES.pop(task, None)
    if deadline is not None and deadline.handle is not None:
        deadline.handle.cancel()


class PeerWriter:
    """A connection's StreamWriter, whose `write` says so when the peer has gone: once the
    transport is closed (the peer reset it, or it was closed here), uvloop raises
    RuntimeError ("the handler is closed") and asyncio's loop drops the bytes and warns
    after a few; both would reach the log as a failure. Here it is a ConnectionResetError,
    which the proxy's edge takes as the peer going away. Everything else is the writer's."""

    __slots__ = ("writer",)

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer

    def write(self, data) -> None:
        if self.writer.is_closing():
            raise ConnectionResetError("the connection is closed")
        self.writer.write(data)

    def __getattr__(self, name: str):
        return getattr(self.writer, name)


async def drain(writer, idle: float) -> None:
    """Wait for the peer to take what was written, at most `idle` seconds: a peer that
    stops reading must not hold its connection (and its session's share) for ever."""
    try:
        await within(writer.drain(), idle)
    except TimeoutError:
        raise ConnectionError(f"the peer read nothing for {idle:g} s") from None


LINGER_SECONDS = 2.0
LINGER_BYTES = 16 << 20


async def linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Before closing a connection whose answer came ahead of its request's body: the answer
    sent, then what the client still sends read and dropped, for at most LINGER_SECONDS and
    LINGER_BYTES (nginx's lingering close, bounded). Closed with bytes unread, a connection
    is reset, and a client still sending its body meets the reset before it reads the
    answer: a 413 for a body too large to scan, or a refusal, arrived as "connection reset"
    or a TLS EOF in the middle of its write."""
    deadline = time.monotonic() + LINGER_SECONDS
    left = LINGER_BYTES
    with contextlib.suppress(ConnectionError, TimeoutError, OSError):  # (ssl's are OSErrors)
        await drain(writer, LINGER_SECONDS)
        while left > 0 and (remaining := deadline - time.monotonic()) > 0:
            data = await within(reader.read(min(left, CHUNK)), remaining)
            if not data:
                return
            left -= len(data)


def settled(writer: asyncio.StreamWriter) -> None:
    """Take the error a connection closed here ends with, now or whenever it arrives, so
    that asyncio never logs it as "Future exception was never retrieved". asyncio keeps a
    reset twice: raised to whoever reads the connection, and as the outcome of its closing
    (the stream protocol's close future). Raised through the frames that hold the
    connection, the reset ties them, the connection and that future into a cycle; when the
    garbage collector frees it, the future may go before the protocol whose __del__ would
    take its error (one log line and traceback per upstream that hangs up mid-response).
    And uvloop delivers an upstream TLS handshake's timeout to a connection a loop turn or
    more after the filter closed it. A callback on the future takes either; it never
    waits, and a closing that never ends (stock asyncio after a cancelled handshake)
    holds nothing but the callback. The future is asyncio's (StreamReaderProtocol._closed,
    3.8 to 3.13; tests/unit/filter/test_relay.py fails if it goes)."""
    closing = getattr(getattr(writer, "_protocol", None), "_closed", None)
    if isinstance(closing, asyncio.Future):
        closing.add_done_callback(_take_error)


def _take_error(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


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


async def _pump(reader, writer, counters: Counters, upward: bool, idle: float) -> None:
    while True:
        try:
            data = await within(reader.read(CHUNK), idle)
        except TimeoutError:
            if time.monotonic() - counters.last < idle:
                continue  # the other direction is busy; the tunnel is not idle
            raise
        if not data:
            if writer.can_write_eof():
                with contextlib.suppress(OSError):
                    writer.write_eof()
            else:  # TLS has no half-close: one side's end is the end of both directions
                writer.close()
            return
        counters.add(len(data), upward)
        writer.write(data)
        await drain(writer, idle)


async def tunnel(client_r, client_w, up_r, up_w, counters: Counters, idle: float,
                 splice: bool = True) -> None:
    """Copy both ways until both sides have finished, one side fails, or both sit idle;
    spliced (TUNNEL_FDS more descriptors) unless `splice` is False."""
    if splice and SPLICE is not None and await _hand_over(client_r, client_w, up_r, up_w,
                                                          counters, idle):
        STATS["spliced"] += 1
        await _splice_tunnel(client_w, up_w, counters, idle)
        return
    STATS["streamed"] += 1
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


async def _hand_over(client_r, client_w, up_r, up_w, counters: Counters, idle: float) -> bool:
    """Take both sockets away from asyncio's streams, so splice can move the bytes: stop
    their reading, pass on what they had already read, and let their write buffers empty.
    False (the streams keep the tunnel) when either side is not a plain open socket or has
    already seen its end — the pumps handle half-closed tunnels."""
    readers = ((client_r, client_w, up_w, True), (up_r, up_w, client_w, False))
    for reader, writer, _, _ in readers:
        sock = writer.get_extra_info("socket")
        # StreamReader's _eof: the end has arrived, even with bytes still buffered
        if sock is None or sock.type != socket.SOCK_STREAM or writer.is_closing() or \
                getattr(reader, "_eof", True):
            return False
    for _, writer, _, _ in readers:
        writer.transport.pause_reading()
    for reader, _, other, upward in readers:
        # StreamReader has no public way to say how much it holds; _buffer is where it is
        buffered = len(getattr(reader, "_buffer", b""))
        if buffered:
            data = await reader.readexactly(buffered)  # all there: no wait
            counters.add(len(data), upward)
            other.write(data)
    for _, writer, _, _ in readers:
        # again: a read that emptied a buffer over its limit resumed its transport, which
        # would read the socket beside the splice (what it took would never go on)
        writer.transport.pause_reading()
    for _, writer, _, _ in readers:
        writer.transport.set_write_buffer_limits(high=0)  # drain() now waits for empty
        await drain(writer, idle)
    return True


class _Splice:
    """One direction of a spliced tunnel: socket -> pipe -> socket, driven by readiness.
    It borrows its descriptors; `_SplicedTunnel` owns them."""

    def __init__(self, loop, src: int, dst: socket.socket, pipe: tuple[int, int],
                 counters: Counters, upward: bool):
        self.loop = loop
        self.src, self.dst, self.dst_fd = src, dst, dst.fileno()
        self.pipe_r, self.pipe_w = pipe
        self.counters, self.upward = counters, upward
        self.pending = 0  # bytes in the pipe
        self.eof = False
        self.idle_wakeups = 0  # in a row, with nothing to splice
        self.done = loop.create_future()
        loop.add_reader(self.src, self._guard, self._readable)

    def _guard(self, step) -> None:
        """Run a readiness callback; anything it raises ends this direction (the tunnel
        closes) rather than leaving it waiting for an idle timeout."""
        try:
            step()
        except Exception as exc:
            self._finish(exc)

    def _finish(self, error: BaseException | None) -> None:
        self.loop.remove_reader(self.src)
        self.loop.remove_writer(self.dst_fd)
        if not self.done.done():
            if error is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(error)

    def _readable(self) -> None:
        try:
            n = SPLICE(self.src, self.pipe_w, PIPE_SIZE, flags=SPLICE_FLAGS)
        except (BlockingIOError, InterruptedError):
            # said to be readable, with the pipe empty (the reader waits while it holds
            # anything), yet nothing to take: TCP urgent data, which splice never moves
            # past. One such wake-up could be chance; STUCK_WAKEUPS in a row are not
            self.idle_wakeups += 1
            if self.idle_wakeups >= STUCK_WAKEUPS:
                self._finish(ConnectionError(URGENT))
            return
        except OSError as exc:
            self._finish(exc)
            return
        self.idle_wakeups = 0
        if n == 0 and _at_urgent_mark(self.src):  # the end is in, behind urgent data
            self._finish(ConnectionError(URGENT))
            return
        if n == 0:
            self.eof = True
            self.loop.remove_reader(self.src)
        else:
            self.pending += n
            self.counters.add(n, self.upward)
        self._write()

    def _write(self) -> None:
        while self.pending:
            try:
                n = SPLICE(self.pipe_r, self.dst_fd, self.pending, flags=SPLICE_FLAGS)
            except (BlockingIOError, InterruptedError):
                self.loop.remove_reader(self.src)  # back-pressure: read no more for now
                self.loop.add_writer(self.dst_fd, self._guard, self._writable)
                return
            except OSError as exc:
                self._finish(exc)
                return
            self.pending -= n
        if self.eof:
            with contextlib.suppress(OSError):
                self.dst.shutdown(socket.SHUT_WR)  # pass the half-close on
            self._finish(None)

    def _writable(self) -> None:
        self.loop.remove_writer(self.dst_fd)
        self._write()
        if not self.pending and not self.eof and not self.done.done():
            self.loop.add_reader(self.src, self._guard, self._readable)


class _SplicedTunnel:
    """Every descriptor a spliced tunnel adds, owned in one place and released together,
    whatever step fails: one duplicate of each socket (asyncio refuses readers on a
    transport's own descriptor; the duplicate is also a socket object of our own, for
    shutdown(): uvloop's transports hand out sockets that refuse it) and a pipe per direction:
    TUNNEL_FDS on top of the two connections."""

    def __init__(self, loop, client: socket.socket, upstream: socket.socket,
                 counters: Counters):
        self.fds: list[int] = []
        self.sockets: list[socket.socket] = []
        self.directions: list[_Splice] = []
        try:
            ends = [self._dup(client), self._dup(upstream)]
            pipes = [self._pipe(), self._pipe()]
            for (src, dst), pipe, upward in (((ends[0], ends[1]), pipes[0], True),
                                             ((ends[1], ends[0]), pipes[1], False)):
                self.directions.append(_Splice(loop, src.fileno(), dst, pipe, counters,
                                               upward))
        except BaseException:
            self.close()
            raise

    def _dup(self, sock: socket.socket) -> socket.socket:
        fd = os.dup(sock.fileno())
        try:
            dup = socket.socket(fileno=fd)
        except BaseException:
            os.close(fd)
            raise
        self.sockets.append(dup)
        return dup

    def _pipe(self) -> tuple[int, int]:
        pipe = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.fds.extend(pipe)
        with contextlib.suppress(OSError):
            fcntl.fcntl(pipe[1], F_SETPIPE_SZ, PIPE_SIZE)
        return pipe

    def close(self) -> None:
        for direction in self.directions:
            direction._finish(None)  # unregisters before the descriptors close
        for fd in self.fds:
            os.close(fd)
        for sock in self.sockets:
            sock.close()
        self.fds, self.sockets, self.directions = [], [], []


async def _splice_tunnel(client_w, up_w, counters: Counters, idle: float) -> None:
    loop = asyncio.get_running_loop()
    client, upstream = client_w.get_extra_info("socket"), up_w.get_extra_info("socket")
    spliced = _SplicedTunnel(loop, client, upstream, counters)
    futures = [d.done for d in spliced.directions]
    try:
        while True:
            done, pending = await asyncio.wait(futures, timeout=idle,
                                               return_when=asyncio.FIRST_EXCEPTION)
            if not pending or any([f.exception() for f in done]):  # each error read
                return  # both ends finished, or one failed: the tunnel is over
            if time.monotonic() - counters.last >= idle:
                return  # both sat idle
    finally:
        spliced.close()
        for future in futures:  # a direction that failed as the tunnel was cut, say:
            if future.done() and not future.cancelled():  # read, or asyncio logs it
                future.exception()


async def copy_exact(reader, writer, n: int, counters: Counters, upward: bool, idle: float,
                     prefix: bytes = b"", source=None):
    """Copy `n` bytes; `prefix` (a message head) goes out with the first of them: one send
    for a small response rather than two. With `source` (the writer of `reader`'s
    connection), a body of SPLICED_BODY_MIN or more is spliced when both ends allow it."""
    if source is not None and n >= SPLICED_BODY_MIN:
        if prefix:
            writer.write(prefix)
            prefix = b""
        n = await splice_exact(reader, source, writer, n, counters, upward, idle)
    while n > 0:
        data = await within(reader.read(min(n, CHUNK)), idle)
        if not data:
            raise ConnectionError("peer closed in the middle of a message body")
        n -= len(data)
        counters.add(len(data), upward)
        writer.write(prefix + data if prefix else data)
        prefix = b""
        await drain(writer, idle)
    if prefix:
        writer.write(prefix)


def _plain(writer) -> bool:
    """Whether `writer`'s connection is a TCP socket of its own, open, with no TLS on it
    (whose socket would carry ciphertext): one splice may read or write."""
    sock = writer.get_extra_info("socket")
    return (sock is not None and sock.type == socket.SOCK_STREAM
            and writer.get_extra_info("ssl_object") is None and not writer.is_closing())


async def splice_exact(reader, source, writer, n: int, counters: Counters, upward: bool,
                       idle: float) -> int:
    """Move `n` bytes from `source`'s connection (read by `reader`) to `writer`'s with
    splice(2), none of them through Python: what `reader` holds already first, then the
    socket's, and not a byte past the n-th (the next message stays in the socket, for the
    stream). Returns how many are left to copy the ordinary way: all `n` when either end is
    not a plain socket, `reader` has seen its end or no descriptor is to be had; the rest
    when the source turns out to hold what splice cannot read (_spliced); else none. What
    the pipe holds when the source ends or fails still goes out. Raises as copy_exact does:
    ConnectionError when the source ends first, the destination fails, or takes nothing
    for `idle`; TimeoutError when the source sends nothing for `idle`. A cancel (a policy
    change cutting the connection) stops it at once: no byte moves but in this task.

    Takes BODY_FDS descriptors while it runs: its callers' budget must hold them (a tunnel
    that serves HTTP holds TUNNEL_FDS it does not use)."""
    if SPLICE is None or not _plain(source) or not _plain(writer) or getattr(
            reader, "_eof", True):
        return n
    # StreamReader has no public way to say how much it holds; _buffer is where it is.
    # Read before reading is paused: a read that empties the buffer resumes the transport
    held = len(getattr(reader, "_buffer", b""))
    data = await reader.read(min(held, n)) if held else b""  # held: no wait
    if data:
        n -= len(data)
        counters.add(len(data), upward)
        writer.write(data)
    if not n:
        return 0
    limits = writer.transport.get_write_buffer_limits()
    fds: list[int] = []
    try:
        source.transport.pause_reading()
        writer.transport.set_write_buffer_limits(high=0)  # drain() now waits for empty
        await drain(writer, idle)  # what was written goes first
        try:
            fds.append(os.dup(source.get_extra_info("socket").fileno()))
            fds.append(os.dup(writer.get_extra_info("socket").fileno()))
            fds.extend(os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError:  # no descriptor to spare: nothing spliced yet, the copy goes on
            return n
        with contextlib.suppress(OSError):
            fcntl.fcntl(fds[3], F_SETPIPE_SZ, PIPE_SIZE)
        STATS["spliced_bodies"] += 1
        return await _spliced(*fds, n, counters, upward, idle)
    finally:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(RuntimeError):  # a transport closed meanwhile
            writer.transport.set_write_buffer_limits(high=limits[1], low=limits[0])
        if not source.transport.is_closing():
            source.transport.resume_reading()


async def _spliced(src: int, dst: int, pipe_r: int, pipe_w: int, n: int, counters: Counters,
                   upward: bool, idle: float) -> int:
    """splice_exact's loop: `n` bytes from `src` through the pipe to `dst`. Returns 0, or
    how many are left, with the pipe empty, for the copy to read on when splice can take no
    more: TCP urgent data stops it for good (where the socket stays readable, and where it
    says 0 once the source's end is in, as at the end itself), and a read skips it."""
    loop = asyncio.get_running_loop()
    pending = 0  # bytes in the pipe
    failed: OSError | None = None  # the source's error, raised once the pipe is out
    ended = False  # splice said 0: the source's end, or urgent data once its end is in
    woken = False  # the source was said to be readable, and nothing has moved since
    due = loop.time() + idle  # nothing moved by then: the connection is idle
    while n or pending:
        moved = 0
        if n and failed is None and not ended:
            try:
                got = _splice(src, pipe_w, min(n, PIPE_SIZE))
            except OSError as exc:  # a reset: what came before it still goes out
                got, failed = None, exc
            if got == 0:
                ended = True
            elif got:
                n, pending, moved = n - got, pending + got, got
        if pending:
            sent = _splice(pipe_r, dst, pending)
            if sent:
                pending, moved = pending - sent, moved + sent
                counters.add(sent, upward)  # what reached the peer's socket
        if failed is not None and not pending:
            raise failed
        if ended and not pending:  # the copy's read tells an end from urgent data
            return n
        if moved:
            woken, due = False, loop.time() + idle
            await asyncio.sleep(0)  # a pipe's worth at most: the others get the loop
        elif pending:  # the destination is full (or the pipe is, which it alone empties)
            if not await _ready(loop, dst, True, due - loop.time()):
                raise ConnectionError(f"the peer read nothing for {idle:g} s")
        elif woken:
            return n
        elif await _ready(loop, src, False, due - loop.time()):
            woken = True
        else:
            raise TimeoutError(f"nothing came for {idle:g} s")
    return 0


def _at_urgent_mark(fd: int) -> bool:
    """Whether the next byte to read from socket `fd` is TCP urgent data (which splice
    stops at, saying 0 once the peer's end has arrived: not the end itself)."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, SIOCATMARK, b"\0\0\0\0"))[0] != 0
    except OSError:
        return False


def _splice(src: int, dst: int, n: int) -> int | None:
    """splice(2) of up to `n` bytes, non-blocking: how many moved (0: `src` ended), or None
    when it would block."""
    try:
        return SPLICE(src, dst, n, flags=SPLICE_FLAGS)
    except (BlockingIOError, InterruptedError):
        return None


async def _ready(loop, fd: int, writable: bool, seconds: float) -> bool:
    """Wait until `fd` is readable (or writable): False when `seconds` passed first."""
    if seconds <= 0:
        return False
    ready = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if writable else (
        loop.add_reader, loop.remove_reader)
    add(fd, _resolve, ready)
    try:
        await within(ready, seconds)
        return True
    except TimeoutError:
        return False
    finally:
        remove(fd)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


async def _chunk_line(reader, idle: float) -> bytes:
    """A chunk's size line, the CRLF after its data, or a trailer line, without its CRLF."""
    try:
        data = await within(reader.readuntil(b"\r\n"), idle)
    except asyncio.LimitOverrunError:
        raise HttpError(400, "chunk line too long") from None
    except asyncio.IncompleteReadError:
        raise ConnectionError("peer closed in the middle of a chunked body") from None
    return data[:-2]


async def _next_chunk(reader, idle: float, max_trailer: int, chunks: int) -> int:
    """The size of the body's `chunks`-th chunk, for the caller to read its data (then
    _chunk_end). At the last chunk (0) the trailer is read, checked and dropped."""
    size = parse_chunk_size(await _chunk_line(reader, idle))
    if chunks % YIELD_EVERY == 0:  # buffered chunks never wait: let the loop run
        await asyncio.sleep(0)
    if size == 0:
        trailer = 0
        while (field := await _chunk_line(reader, idle)) != b"":
            check_trailer_line(field)
            trailer += len(field)
            if trailer > max_trailer:
                raise HttpError(400, f"chunked trailer larger than {max_trailer} bytes")
    return size


async def _chunk_end(reader, idle: float) -> None:
    if await _chunk_line(reader, idle) != b"":
        raise HttpError(400, "chunk data not followed by CRLF")


async def copy_chunked(reader, writer, counters: Counters, upward: bool, idle: float,
                       max_trailer: int = 65536):
    """Copy a chunked body re-serialised: each chunk as `{size:x}` CRLF, data, CRLF, whatever
    spelling the sender used (extensions dropped), the last chunk as `0` CRLF CRLF (trailer
    fields read, checked and dropped). A line the parser refuses ends the body with an
    HttpError before anything of it is passed on."""
    chunks = 0
    while size := await _next_chunk(reader, idle, max_trailer, chunks := chunks + 1):
        await copy_exact(reader, writer, size, counters, upward, idle, b"%x\r\n" % size)
        await _chunk_end(reader, idle)
        writer.write(b"\r\n")
    writer.write(b"0\r\n\r\n")
    await drain(writer, idle)


async def copy_body(head: Head, reader, writer, counters, upward: bool, idle: float,
                    prefix: bytes = b"", source=None) -> None:
    """Copy a request body, or a response body that is framed by length or chunks, after
    `prefix` (the message's head, when the caller has not sent it yet). `source`: splice a
    long body framed by length (copy_exact)."""
    if head.chunked:
        if prefix:
            writer.write(prefix)
        await copy_chunked(reader, writer, counters, upward, idle)
    elif head.content_length:
        await copy_exact(reader, writer, head.content_length, counters, upward, idle, prefix,
                         source)
    elif prefix:
        writer.write(prefix)


async def copy_until_eof(reader, writer, counters: Counters, idle: float) -> None:
    while data := await within(reader.read(CHUNK), idle):
        counters.add(len(data), upward=False)
        writer.write(data)
        await drain(writer, idle)


async def read_body(head: Head, reader, limit: int, idle: float,
                    max_trailer: int = 65536) -> bytes:
    """A request body read whole (chunks joined, extensions and trailer dropped), at most
    `limit` bytes of it: for the rare request that must be judged by its body before any
    of it goes on. Raises HttpError (413 past the limit, 400 for a malformed one) or
    ConnectionError."""

    def too_large() -> HttpError:
        return HttpError(413, f"request body larger than {limit} bytes, the most the filter "
                         "holds to judge it")

    async def exactly(n: int) -> bytes:
        try:
            return await within(reader.readexactly(n), idle)
        except asyncio.IncompleteReadError:
            raise ConnectionError("peer closed in the middle of a message body") from None

    if not head.chunked:
        length = head.content_length or 0
        if length > limit:
            raise too_large()
        return await exactly(length) if length else b""
    body, chunks = bytearray(), 0
    while size := await _next_chunk(reader, idle, max_trailer, chunks := chunks + 1):
        if len(body) + size > limit:
            raise too_large()
        body += await exactly(size)
        await _chunk_end(reader, idle)
    return bytes(body)
