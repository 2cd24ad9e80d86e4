"""Talking to an upstream resolver: the question sent, the only reply accepted, the sockets.

A fresh socket per question bought three things, and the few long-lived sockets here keep
each of them (an off-path spoofer must still guess a random port and a random ID, and
match the question):

- every socket is connected to its upstream from a port the kernel chose at random, so a
  datagram from anywhere else never reaches it;
- every question gets a random 16-bit ID that no other question outstanding on its socket
  holds (`Book.ask`); a timeout frees it;
- a reply is accepted only for an ID outstanding on that socket (looked up before anything
  is parsed), with the QR bit, the same question (name, ASCII case aside, and type), and
  within `reply.py`'s bounds (`reply.matching`). Anything else, a stray, a late or a spoofed
  reply, is dropped and counted, and the question it claims to answer waits on for the
  real one.

Ports rotate: a socket takes ROTATE_QUERIES questions or ROTATE_SECONDS, whichever comes
first, then is retired (no new question; closed once its last one is answered or timed
out). An error on a socket (an ICMP unreachable, a failed send) retires it at once and fails
the questions it holds, so the resolver goes on to the next upstream.

`Book` is the pure part (IDs, rotation, and which question a reply answers: `reply.py`
reads it), tested as transcripts without sockets; `UdpUpstream` moves the bytes: a batch of
reads per wake-up (asyncio's datagram transport reads one datagram per turn of the loop), a
timer per question.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import Callable

from .reply import Question, Reply, labels_of, matching

SOCKETS = 4
"""Sockets each upstream is asked through, round robin."""
SOCKETS_MAX = 64
"""... and at most this many, when SOCKETS are all holding OUTSTANDING_MAX questions (the
filter's MAX_PENDING waiting at once fit)."""
OUTSTANDING_MAX = 256
"""Questions outstanding on one socket at once: their replies, arriving together, fit its
receive buffer (a fresh socket per question never dropped one for want of room)."""
RECEIVE_BUFFER = 1 << 20
"""Bytes each socket asks the kernel to buffer (SO_RCVBUFFORCE: the filter has
CAP_NET_ADMIN; else SO_RCVBUF, capped by net.core.rmem_max)."""
ROTATE_QUERIES = 1000
"""Questions one socket (one source port) is used for before it is retired."""
ROTATE_SECONDS = 30.0
"""Seconds one socket is used for before it is retired."""
READS = 64
"""Datagrams read per wake-up of a socket."""
SO_RCVBUFFORCE = 33
"""Linux's SO_RCVBUF past net.core.rmem_max, for CAP_NET_ADMIN (not in `socket`)."""


class Book:
    """The questions outstanding on one socket (pure: no I/O, no clock of its own).

    `ask` gives a question a random ID none outstanding holds and keeps `token` (what the
    caller waits on) under it; `receive` returns (token, reply) for the reply to an
    outstanding question and forgets it, or None for anything else (counted in `strays`);
    `forget` ends a question that will have no reply (a timeout). `retired` says when the
    socket should take no new question."""

    __slots__ = ("_random", "asked", "born", "broken", "outstanding", "strays")

    def __init__(self, born: float, random: Callable[[int], int] = secrets.randbits):
        self.born = born
        self.asked = 0
        self.outstanding: dict[int, tuple[Question, object]] = {}
        self.strays = 0
        self.broken = False
        """Set on an error: retired at once, whatever its age."""
        self._random = random

    def retired(self, now: float) -> bool:
        return (self.broken or self.asked >= ROTATE_QUERIES
                or now - self.born >= ROTATE_SECONDS)

    @property
    def full(self) -> bool:
        return len(self.outstanding) >= OUTSTANDING_MAX

    def ask(self, labels: tuple[bytes, ...], qtype: int, token: object) -> Question:
        if self.full:
            raise ValueError(f"{OUTSTANDING_MAX} questions outstanding on one socket")
        qid = self._random(16)
        while qid in self.outstanding:  # at most OUTSTANDING_MAX of 65536 taken
            qid = self._random(16)
        question = Question(qid, labels, qtype)
        self.outstanding[qid] = (question, token)
        self.asked += 1
        return question

    def receive(self, data: bytes) -> tuple[object, Reply] | None:
        entry = self.outstanding.get(int.from_bytes(data[:2], "big")) if len(
            data) >= 12 else None
        reply = matching(data, entry[0]) if entry is not None else None
        if reply is None:
            self.strays += 1
            return None
        del self.outstanding[entry[0].id]
        return entry[1], reply

    def forget(self, question: Question, token: object) -> None:
        """Ends `question` if it still waits under `token` (its ID may be another's now)."""
        entry = self.outstanding.get(question.id)
        if entry is not None and entry[1] is token:
            del self.outstanding[question.id]


class _Socket:
    """One connected UDP socket and the questions outstanding on it."""

    __slots__ = ("book", "sock")

    def __init__(self, sock: socket.socket, book: Book):
        self.sock, self.book = sock, book


class UdpUpstream:
    """The sockets one upstream is asked through, on one event loop (a new loop, as a test's
    `asyncio.run`, gets new sockets)."""

    def __init__(self, address: tuple[str, int], timeout: float):
        self.address = address
        self.timeout = timeout
        """Seconds a question waits for its reply."""
        self.family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.loop: asyncio.AbstractEventLoop | None = None
        self.live: list[_Socket] = []
        """Sockets taking new questions."""
        self.draining: list[_Socket] = []
        """Retired sockets still waiting for their questions' replies."""
        self._next = 0
        self.stats = {"sockets_opened": 0, "strays": 0, "socket_errors": 0}

    async def ask(self, name: str, qtype: int) -> tuple[Question, Reply]:
        """The question asked and its reply. Raises TimeoutError, OSError or ValueError."""
        labels = labels_of(name)
        loop = asyncio.get_running_loop()
        conn = self._choose(loop)
        waiter = loop.create_future()
        question = conn.book.ask(labels, qtype, waiter)
        timer = loop.call_later(self.timeout, _expire, waiter, self.timeout)
        try:
            try:
                conn.sock.send(question.pack())
            except (BlockingIOError, InterruptedError):
                raise OSError("the socket's send buffer is full") from None
            except OSError as exc:
                self._broken(conn, exc)
                raise
            return question, await waiter
        finally:
            timer.cancel()
            if waiter.done() and not waiter.cancelled():
                waiter.exception()  # retrieved, whether awaited or not (a failed send)
            conn.book.forget(question, waiter)
            if not conn.book.outstanding and conn in self.draining:
                self._close(conn)

    def sockets(self) -> list[socket.socket]:
        """The sockets open now (for tests and status)."""
        return [conn.sock for conn in self.live + self.draining]

    def close(self) -> None:
        for conn in self.live + self.draining:
            self._broken(conn, OSError("the resolver closed"))

    def _choose(self, loop: asyncio.AbstractEventLoop) -> _Socket:
        if self.loop is not loop:
            self.close()
            self.loop = loop
        now = loop.time()
        for conn in [c for c in self.live if c.book.retired(now)]:
            self.live.remove(conn)
            if conn.book.outstanding:
                self.draining.append(conn)
            else:
                self._close(conn)
        if len(self.live) < SOCKETS:
            return self._open(now)
        for i in range(len(self.live)):
            conn = self.live[(self._next + i) % len(self.live)]
            if not conn.book.full:
                self._next = (self._next + i + 1) % len(self.live)
                return conn
        if len(self.live) + len(self.draining) < SOCKETS_MAX:
            return self._open(now)
        raise OSError(f"{SOCKETS_MAX} sockets with {OUTSTANDING_MAX} questions outstanding "
                      "each: no room for another")

    def _open(self, now: float) -> _Socket:
        sock = socket.socket(self.family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RECEIVE_BUFFER)
            except PermissionError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
            sock.connect(self.address)  # UDP: no packet, a random port of the kernel's
        except OSError:
            sock.close()
            raise
        conn = _Socket(sock, Book(now))
        self.loop.add_reader(sock.fileno(), self._readable, conn)
        self.live.append(conn)
        self.stats["sockets_opened"] += 1
        return conn

    def _readable(self, conn: _Socket) -> None:
        for _ in range(READS):
            try:
                data = conn.sock.recv(65535)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # an ICMP error (unreachable, refused) for this socket
                self._broken(conn, exc)
                return
            got = conn.book.receive(data)
            if got is None:
                self.stats["strays"] += 1
            elif not got[0].done():
                got[0].set_result(got[1])

    def _broken(self, conn: _Socket, exc: OSError) -> None:
        """Retire `conn` at once, failing every question it holds with `exc`."""
        if conn.sock.fileno() < 0:
            return
        conn.book.broken = True
        self.stats["socket_errors"] += 1
        for _, waiter in conn.book.outstanding.values():
            if not waiter.done():
                waiter.set_exception(type(exc)(*exc.args))  # one each: no shared traceback
        self._close(conn)

    def _close(self, conn: _Socket) -> None:
        for group in (self.live, self.draining):
            if conn in group:
                group.remove(conn)
        if conn.sock.fileno() >= 0:
            if self.loop is not None and not self.loop.is_closed():
                self.loop.remove_reader(conn.sock.fileno())
            conn.sock.close()


def _expire(waiter: asyncio.Future, timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError(f"no reply within {timeout:g} s"))
