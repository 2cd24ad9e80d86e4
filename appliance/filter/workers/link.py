"""The link between the coordinator and one worker: frames over a Unix stream socketpair,
with descriptors passed alongside (SCM_RIGHTS).

A frame is a 4-byte length, one byte saying how its body is encoded, and the body. The two
directions are encoded differently on purpose:
- coordinator -> worker: pickle (`P`). It carries compiled inputs the worker must take as
  they are (rules, session configs, the filter's config, secrets), and the worker already
  trusts the coordinator with everything (it was started by it, with its privileges).
- worker -> coordinator: JSON (`J`), at most MAX_JSON bytes a frame. A worker parses what
  agents send; one that was made to misbehave must not be able to run code in the process
  that holds the firewall and the control socket through the link, so nothing it says is
  unpickled, and every field is checked (coordinator.py). The link is one wall, not all
  of them: a worker runs as the filter's user, so it keeps no capability (confine.py: it
  cannot touch the firewall or bind a port) and a seccomp filter refuses it the calls
  with which that user could act as the coordinator (jail.py: the control socket, a write
  in the state directory, a signal, a new program), and a Landlock ruleset the files its
  user may read but it needs not (landlock.py: the state directory's among them).

The coordinator's end stops reading a worker while more than HIGH_WATER bytes wait to be
sent to it (a worker that asks for answers and reads none would otherwise grow the
coordinator's memory until the kernel kills the whole filter); it reads again once the
worker has taken half of them. A worker's end never stops reading: the two could then wait
on each other.

`Frames` is the pure decoder (bytes in, bodies out); `Link` puts it on a socket with the
event loop's reader and writer callbacks. Descriptors sent with a frame arrive no later
than its first byte (they ride on the sendmsg that carries it), so a message that says it
brought `fds` takes that many from the queue of those received, in order.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import pickle
import secrets
import socket
import struct
from collections import deque
from collections.abc import Callable

log = logging.getLogger("corral.filter")

HEADER = struct.Struct("!IB")
PICKLE, JSON = ord("P"), ord("J")
MAX_JSON = 4 << 20
"""The largest frame a worker may send (an event is about a kilobyte; a status reply tens)."""
MAX_PICKLE = 1 << 30
"""The largest frame the coordinator sends: a whole state at 100k rules is tens of MiB."""
MAX_FDS = 16
"""Descriptors taken from one recvmsg: a gateway's listeners are five."""
HIGH_WATER = 64 << 20
"""Bytes waiting to go to a worker past which the coordinator stops reading it (a change
for many sessions' large policies is tens of MiB: its sender waits a moment, nothing more)."""
BEATS_KEPT = 64
"""Beats whose answer still counts, at the least (`Link.beats_for`: more when the silence
allowed is longer)."""


class LinkError(ValueError):
    """A frame that breaks the protocol: the link is closed (the worker restarted)."""


class Frames:
    """Bytes in, (kind, body) out. Refuses a frame of another kind than `accepts` or larger
    than its kind's limit, before reading its body."""

    def __init__(self, accepts: int):
        self.accepts = accepts
        self.limit = MAX_JSON if accepts == JSON else MAX_PICKLE
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        bodies: list[bytes] = []
        while len(self._buffer) >= HEADER.size:
            length, kind = HEADER.unpack_from(self._buffer)
            if kind != self.accepts:
                raise LinkError(f"a frame of kind {kind!r}, expected {self.accepts!r}")
            if length > self.limit:
                raise LinkError(f"a frame of {length} bytes, more than {self.limit}")
            if len(self._buffer) < HEADER.size + length:
                break
            bodies.append(bytes(self._buffer[HEADER.size:HEADER.size + length]))
            del self._buffer[:HEADER.size + length]
        return bodies


def encode(message: dict, kind: int) -> bytes:
    if kind == PICKLE:
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    else:
        body = json.dumps(message, separators=(",", ":")).encode()
        if len(body) > MAX_JSON:
            raise LinkError(f"a message of {len(body)} bytes, more than {MAX_JSON}")
    return HEADER.pack(len(body), kind) + body


def decode(body: bytes, kind: int) -> dict:
    # only a worker reads pickle, from its coordinator; the coordinator refuses a pickled
    # frame before reading its body (Frames.accepts)
    message = pickle.loads(body) if kind == PICKLE else json.loads(body)  # noqa: S301
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise LinkError("a message that is not an object with an `op`")
    return message


class Link:
    """One end of the link. `handle(message, fds)` is called on the loop for each message
    that is not a reply (it may return an awaitable: run as a task, its result or error
    sent back when the message has an `id`); `closed` is done when the other end is gone
    or broke the protocol."""

    def __init__(self, sock: socket.socket, *, sends: int, handle: Callable):
        self.sock, self.sends, self.handle = sock, sends, handle
        self.frames = Frames(JSON if sends == PICKLE else PICKLE)
        self.sock.setblocking(False)
        self.loop = asyncio.get_running_loop()
        self.closed: asyncio.Future = self.loop.create_future()
        self._out: deque[tuple[memoryview, list[int]]] = deque()
        """Frames to send (what is left of the first), each with the descriptors that go
        with its first byte: a partial send takes a slice, never a copy of the rest."""
        self._fds: deque[int] = deque()
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()
        self.heard = self.loop.time()
        """When the other end last answered a beat (loop time): its loop read the beat and
        ran. Nothing else moves it: any frame a stuck worker could send blindly."""
        self._beats: dict[int, None] = {}
        """The ids of the beats not answered yet, oldest first (`keep` at most)."""
        self._queued = 0
        """Bytes in `_out`."""
        self._paused = False
        self.loop.add_reader(self.sock.fileno(), self._readable)

    # -- sending ---------------------------------------------------------------------
    def send(self, message: dict, fds: list[int] | tuple[int, ...] = ()) -> None:
        """Queue `message` (and the descriptors, which stay the caller's to close)."""
        if self.closed.done():
            raise ConnectionError("the worker's link is closed")
        if len(fds) > MAX_FDS:
            raise LinkError(f"{len(fds)} descriptors in one message, at most {MAX_FDS}")
        frame = memoryview(encode(message, self.sends))
        self._out.append((frame, [os.dup(fd) for fd in fds]))
        self._queued += len(frame)
        if len(self._out) == 1:
            self._writable()

    @staticmethod
    def beats_for(silence: float, every: float) -> int:
        """How many unanswered beats to keep when one goes every `every` seconds and an
        answer counts for `silence` seconds: each beat of that silence, and two more."""
        return max(BEATS_KEPT, math.ceil(silence / every) + 2)

    def beat(self, keep: int = BEATS_KEPT) -> None:
        """Say this loop runs, with an id: the other end's loop answers it (as any message
        with one), and that answer moves `heard`. The id is random, so only an end that read
        the beat can answer it (call ids count up: a worker could answer those unread). The
        last `keep` beats' answers count (`beats_for`): an older one's comes too late."""
        number = secrets.randbits(62) | 1 << 62  # never one of the counted ids
        self._beats[number] = None
        while len(self._beats) > keep:
            del self._beats[next(iter(self._beats))]
        self.send({"op": "beat", "id": number})

    async def call(self, message: dict, fds=(), seconds: float | None = None) -> dict:
        """Send `message` with an id and wait for its reply; ConnectionError when the link
        closes first, TimeoutError past `seconds`; a reply that says `error` raises
        LinkError with it."""
        number = next(self._ids)
        future = self._calls[number] = self.loop.create_future()
        try:
            self.send({**message, "id": number}, fds)
            async with asyncio.timeout(seconds):
                reply = await future
        finally:
            self._calls.pop(number, None)
        if reply.get("error") is not None:
            raise LinkError(str(reply["error"]))
        return reply

    def _writable(self) -> None:
        while self._out:
            data, fds = self._out[0]
            try:
                if fds:
                    sent = self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                       array.array("i", fds))])
                else:
                    sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                self.loop.add_writer(self.sock.fileno(), self._writable)
                return
            except OSError as exc:
                self.close(exc)
                return
            for fd in fds:
                os.close(fd)
            self._queued -= sent
            if self._paused and self._queued <= HIGH_WATER // 2:
                self._paused = False
                self.loop.add_reader(self.sock.fileno(), self._readable)
            if sent < len(data):
                self._out[0] = (data[sent:], [])
                continue
            self._out.popleft()
        with contextlib.suppress(Exception):
            self.loop.remove_writer(self.sock.fileno())

    # -- receiving -------------------------------------------------------------------
    def _readable(self) -> None:
        try:
            data, ancillary, flags, _ = self.sock.recvmsg(
                1 << 18, socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize),
                socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.close(exc)
            return
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(raw[:len(raw) - len(raw) % fds.itemsize])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:  # descriptors the kernel dropped: a message lost them
            self.close(LinkError("descriptors were cut off a message (more than MAX_FDS)"))
            return
        if self._fds and self.sends == PICKLE:
            # the coordinator takes no descriptor from a worker: kept, each frame's would
            # fill its table (the audit log, the control socket, the gateways need it)
            log.error("workers: a worker sent descriptors, closing its link")
            self.close(LinkError("a worker sent descriptors"))
            return
        if not data:
            self.close(None)
            return
        try:
            for body in self.frames.feed(data):
                self._dispatch(decode(body, self.frames.accepts))
        except (LinkError, ValueError, pickle.UnpicklingError, EOFError) as exc:
            log.error("workers: a broken frame on the link, closing it: %s", exc)
            self.close(exc)
            return
        if self.sends == PICKLE and self._queued > HIGH_WATER and not self.closed.done():
            self._paused = True  # until the worker reads what waits for it (_writable)
            self.loop.remove_reader(self.sock.fileno())

    def _dispatch(self, message: dict) -> None:
        if message["op"] == "reply":
            number = message.get("id")
            if type(number) is not int:
                raise LinkError(f"a reply to {number!r:.40}")
            if number in self._beats:
                self.heard = self.loop.time()
                del self._beats[number]
                return
            future = self._calls.get(number)
            if future is not None and not future.done():
                future.set_result(message)
            return
        count = message.get("fds", 0)
        if not isinstance(count, int) or not 0 <= count <= len(self._fds):
            raise LinkError(f"a message that says it brought {count!r} descriptors")
        fds = [self._fds.popleft() for _ in range(count)]
        try:
            result = self.handle(message, fds)
        except Exception as exc:
            self._answer(message, None, exc)
            return
        if asyncio.iscoroutine(result):
            task = self.loop.create_task(result)
            self._tasks.add(task)
            task.add_done_callback(lambda t: self._finished(message, t))
        else:
            self._answer(message, result, None)

    def _finished(self, message: dict, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            self._answer(message, None, ConnectionError("cancelled"))
        else:
            self._answer(message, task.result() if task.exception() is None else None,
                         task.exception())

    def _answer(self, message: dict, result, error: BaseException | None) -> None:
        if error is not None and not isinstance(error, (LinkError, ConnectionError)):
            log.error("workers: %s failed", message["op"], exc_info=error)
        if "id" not in message or self.closed.done():
            return
        reply = {**(result if isinstance(result, dict) else {}), "op": "reply",
                 "id": message["id"],
                 "error": None if error is None else f"{type(error).__name__}: {error}"}
        self.send(reply)

    def close(self, why: BaseException | None = None) -> None:
        if self.closed.done():
            return
        self.closed.set_result(why)
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.sock.fileno())
            self.loop.remove_writer(self.sock.fileno())
        self.sock.close()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(ConnectionError("the worker's link closed"))
        for _, fds in self._out:
            for fd in fds:
                os.close(fd)
        self._out.clear()
        while self._fds:
            os.close(self._fds.popleft())
        for task in self._tasks:
            task.cancel()
