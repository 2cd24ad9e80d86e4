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
  within `parse_reply`'s bounds (`matching`). Anything else, a stray, a late or a spoofed
  reply, is dropped and counted, and the question it claims to answer waits on for the
  real one.

Ports rotate: a socket takes ROTATE_QUERIES questions or ROTATE_SECONDS, whichever comes
first, then is retired (no new question; closed once its last one is answered or timed
out). An error on a socket (an ICMP unreachable, a failed send) retires it at once and fails
the questions it holds, so the resolver goes on to the next upstream.

`Book` is the pure part (IDs, matching, rotation), tested as transcripts without sockets;
`UdpUpstream` moves the bytes: a batch of reads per wake-up (asyncio's datagram transport
reads one datagram per turn of the loop), a timer per question.

A reply is parsed by dnslib, but never unbounded: at most MAX_REPLY bytes and MAX_RECORDS
records, and every name in it (owner names and the names inside CNAME, MX, SOA, SRV...
data alike) is read by the bounded reader of `wire.py` instead of dnslib's recursive one:
at most MAX_JUMPS compression pointers per name, each pointing back, and REPLY_STEPS_MAX
steps for all the names of a reply. A hostile upstream cannot freeze the loop either.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import ip_address

from dnslib import QTYPE, RR, DNSError, DNSHeader, DNSLabel, DNSQuestion, DNSRecord
from dnslib.buffer import BufferError
from dnslib.label import DNSBuffer

from .wire import CNAME, MAX_LABEL, MAX_NAME, OPT, ParseBudget, Record, WireError, read_name

A, AAAA = 1, 28

MAX_REPLY = 16384
"""The largest upstream reply read (TCP may carry 65535): the filter asks with an EDNS size
of 1232, and a reply that needs more than 16 KiB for one name is refused (SERVFAIL)."""
MAX_RECORDS = 128
"""Records an upstream reply may hold in all its sections (an address set is a few dozen;
dnslib takes about 1 ms for 128)."""
MAX_JUMPS = 16
"""Compression pointers followed in one name of a reply (real names need one to three)."""
REPLY_STEPS_MAX = 4096
"""Steps (labels and pointers) the bounded reader may take over all the names of a reply:
a 1232-byte reply of 64 records needs a few hundred."""
EDNS_SIZE = 1232
"""The UDP payload size every question offers (DNS Flag Day 2020)."""

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


@dataclass(frozen=True, slots=True)
class Question:
    """One question to an upstream: its ID and what a reply must echo."""

    id: int
    labels: tuple[bytes, ...]
    """The name's labels, lower case (as sent)."""
    qtype: int

    def pack(self) -> bytes:
        """The query: RD, one question of class IN, an OPT record offering EDNS_SIZE."""
        return (struct.pack("!6H", self.id, 0x0100, 1, 0, 0, 1)
                + b"".join(bytes((len(label),)) + label for label in self.labels)
                + struct.pack("!xHHxHHIH", self.qtype, 1, OPT, EDNS_SIZE, 0, 0))


def labels_of(name: str) -> tuple[bytes, ...]:
    """The labels of a host name, lower case; IDNA for one that is not ASCII (as dnslib).
    Raises ValueError for a name no query can carry."""
    text = name.rstrip(".")
    try:
        raw = text.lower().encode("ascii") if text.isascii() else text.encode("idna").lower()
    except UnicodeError as exc:
        raise ValueError(f"cannot ask for {name!r}: {exc}") from None
    labels = tuple(raw.split(b".")) if raw else ()
    if len(raw) > MAX_NAME - 2 or b"" in labels or max(map(len, labels), default=0) > (
            MAX_LABEL):
        raise ValueError(f"cannot ask for {name!r}: not a name a query can carry")
    return labels


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


@dataclass(frozen=True, slots=True)
class Reply:
    """What the resolver keeps of an upstream's reply."""

    rcode: int
    truncated: bool
    records: tuple[Record, ...]
    """The answer section."""
    negative_ttl: int | None
    """For a reply without records: the authority's SOA TTL, or its minimum if lower."""


def matching(data: bytes, question: Question) -> Reply | None:
    """The reply to `question` in `data`, or None for anything else (a stray, a spoof, bytes
    that are no reply or exceed the bounds). The ID and the QR bit are compared first, then
    the question, before a record is read. An answer of A, AAAA and CNAME records of plain
    names is read here, by the bounded name reader; anything else by dnslib, within
    `parse_reply`'s bounds, which hold for both."""
    if len(data) < 12 or int.from_bytes(data[:2], "big") != question.id or not (
            data[2] & 0x80):
        return None
    try:
        counts = _bounded(data)
        labels, pos = read_name(data, 12, ParseBudget(MAX_NAME), MAX_JUMPS)
    except WireError:
        return None
    if (len(labels) != len(question.labels) or pos + 4 > len(data)
            or struct.unpack_from("!H", data, pos)[0] != question.qtype
            or any(a.lower() != b for a, b in zip(labels, question.labels, strict=True))):
        return None
    rcode, truncated = data[3] & 0x0F, bool(data[2] & 0x02)
    try:
        records = _plain_answer(data, pos + 4, counts[1])
    except WireError:
        return None
    if records is not None:
        return Reply(rcode, truncated, records, None)
    try:
        reply = parse_reply(data, additional=False)
    except Exception:  # hostile bytes can raise more than DNSError inside dnslib
        return None
    soa = [rr for rr in reply.auth if rr.rtype == QTYPE.SOA]
    return Reply(rcode, truncated, tuple(_record(rr) for rr in reply.rr),
                 min(soa[0].ttl, soa[0].rdata.times[-1]) if soa else None)


_PLAIN_LABEL = re.compile(rb"[A-Za-z0-9_-]{1,63}\Z")


def _plain_answer(data: bytes, pos: int, count: int) -> tuple[Record, ...] | None:
    """The answer section when it holds only A, AAAA and CNAME records of plain names
    (letters, digits, hyphens, underscores), read without dnslib; None for any other (or
    an empty one: its TTL is in the authority section), for dnslib to read. Raises
    WireError for bytes that are no such records."""
    if not count:
        return None
    budget = ParseBudget(REPLY_STEPS_MAX)
    size = len(data)
    records = []
    for _ in range(count):
        name, pos = read_name(data, pos, budget, MAX_JUMPS)
        if pos + 10 > size:
            raise WireError("record cut off")
        rtype, rclass, ttl, length = struct.unpack_from("!HHIH", data, pos)
        pos += 10
        end = pos + length
        if end > size or not all(_PLAIN_LABEL.match(label) for label in name):
            return None
        if rtype in (A, AAAA) and length == (4 if rtype == A else 16):
            rdata = bytes(data[pos:end])
            address = ip_address(rdata)
            records.append(Record(tuple(name), rtype, rclass, ttl, rdata, address,
                                  str(address)))
        elif rtype == CNAME:
            target, after = read_name(data, pos, budget, MAX_JUMPS)
            if after != end or not all(_PLAIN_LABEL.match(label) for label in target):
                return None
            records.append(Record(tuple(name), rtype, rclass, ttl, tuple(target), None,
                                  ".".join(label.decode() for label in target) + "."))
        else:
            return None
        pos = end
    return tuple(records)


def _record(rr: RR) -> Record:
    """A record as dnslib read it."""
    name = tuple(rr.rname.label)
    if rr.rtype == QTYPE.CNAME:
        return Record(name, rr.rtype, rr.rclass, rr.ttl, tuple(rr.rdata.label.label), None,
                      str(rr.rdata), rr)
    if rr.rtype in (QTYPE.A, QTYPE.AAAA):
        data = bytes(rr.rdata.data)
        address = ip_address(data)
        return Record(name, rr.rtype, rr.rclass, rr.ttl, data, address, str(address), rr)
    return Record(name, rr.rtype, rr.rclass, rr.ttl, None, None, str(rr.rdata), rr)


def _bounded(data: bytes) -> tuple[int, int, int, int]:
    """The section counts of a reply within MAX_REPLY and MAX_RECORDS. Raises WireError."""
    if len(data) > MAX_REPLY:
        raise WireError(f"reply of {len(data)} bytes; at most {MAX_REPLY} are read")
    if len(data) < 12:
        raise WireError("reply shorter than a header")
    counts = struct.unpack_from("!4H", data, 4)
    if counts[0] != 1 or sum(counts[1:]) > MAX_RECORDS:
        raise WireError(f"reply with {counts[0]} questions and {sum(counts[1:])} records; "
                        f"1 and at most {MAX_RECORDS} are read")
    return counts


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
                waiter.set_exception(OSError(exc.errno, exc.strerror or str(exc)))
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


class _BoundedBuffer(DNSBuffer):
    """dnslib's buffer, with names read by wire.py's bounded reader under one budget for
    the whole message (dnslib's own reader recurses and copies: see wire.py)."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.budget = ParseBudget(REPLY_STEPS_MAX)

    def decode_name(self, last=-1) -> DNSLabel:
        try:
            labels, self.offset = read_name(self.data, self.offset, self.budget, MAX_JUMPS)
            for label in labels:
                label.decode()  # dnslib refuses labels that are not UTF-8: so do we
        except (WireError, UnicodeDecodeError) as exc:
            raise BufferError(f"name at offset {self.offset}: {exc}") from None
        return DNSLabel(labels)


def parse_reply(data: bytes, additional: bool = True) -> DNSRecord:
    """An upstream reply, parsed by dnslib within bounds; without its additional section
    unless `additional` (the resolver reads the answer and authority sections only: the
    OPT record and glue are counted and bounded, not parsed). Raises DNSError or
    WireError."""
    counts = _bounded(data)
    buffer = _BoundedBuffer(data)
    try:
        header = DNSHeader.parse(buffer)
        questions = [DNSQuestion.parse(buffer)]
        sections = [[RR.parse(buffer) for _ in range(n)]
                    for n in (counts[1:] if additional else (*counts[1:3], 0))]
    except BufferError as exc:
        raise DNSError(f"malformed reply: {exc}") from None
    return DNSRecord(header, questions, sections[0], auth=sections[1], ar=sections[2])
