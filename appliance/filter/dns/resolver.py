"""The upstream resolver: asks the configured resolvers, caches by TTL, coalesces duplicates.

Policy-free on purpose: the DNS filter decides whether a client may ask, the proxy decides
whether it may connect; both then resolve through this one cache, so the address the proxy
dials is an address this resolver handed out and the proxy checked.

Each upstream query uses a fresh connected UDP socket (a new random source port), a random
ID, and accepts only a reply with that ID and the same question; a truncated reply is asked
again over TCP. A resolver that times out, fails or answers SERVFAIL/REFUSED is skipped
for the next one; when all fail the caller gets UpstreamError (-> SERVFAIL, never NXDOMAIN).

A reply is parsed by dnslib, but never unbounded: at most MAX_REPLY bytes and MAX_RECORDS
records, and every name in it (owner names and the names inside CNAME, MX, SOA, SRV...
data alike) is read by the bounded reader of `wire.py` instead of dnslib's recursive one:
at most MAX_JUMPS compression pointers per name, each pointing back, and REPLY_STEPS_MAX
steps for all the names of a reply. A hostile upstream cannot freeze the loop either.

The cache gives each session (the `owner` of what it caused to be asked) a share: a session
flooding random names evicts its own answers, never another's (`cache.SharedLru`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dnslib import EDNS0, QTYPE, RCODE, RR, DNSError, DNSHeader, DNSLabel, DNSQuestion, DNSRecord
from dnslib.buffer import BufferError
from dnslib.label import DNSBuffer

from .cache import RESOLVER_CACHE_MAX, SharedLru
from .wire import ParseBudget, WireError, read_name

log = logging.getLogger(__name__)

NEGATIVE_TTL_MAX = 300
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


class UpstreamError(Exception):
    """No upstream resolver gave a usable answer."""


@dataclass(frozen=True, slots=True)
class Answer:
    rcode: int
    records: tuple[RR, ...]
    """The answer section as received (CNAMEs and addresses)."""
    expires: float
    """Monotonic time after which the answer must be asked again."""
    followed: dict = field(default_factory=dict, compare=False, repr=False)
    """addresses() by name, worked out once per answer: the proxy asks on every dial."""

    def ttl(self, now: float) -> int:
        return max(1, int(self.expires - now))

    def addresses(self, name: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...]:
        """The A/AAAA data reached from `name` by following the CNAMEs in this answer."""
        found = self.followed.get(name)
        if found is None:
            found = self.followed[name] = self._follow(name)
        return found

    def _follow(self, name: str) -> tuple:
        owners = {name.lower().rstrip(".")}
        changed = True
        while changed:  # CNAME chains are short; records may come in any order
            changed = False
            for rr in self.records:
                owner = str(rr.rname).lower().rstrip(".")
                if rr.rtype == QTYPE.CNAME and owner in owners:
                    target = str(rr.rdata.label).lower().rstrip(".")
                    if target not in owners:
                        owners.add(target)
                        changed = True
        return tuple(ipaddress.ip_address(str(rr.rdata)) for rr in self.records
                     if rr.rtype in (QTYPE.A, QTYPE.AAAA)
                     and str(rr.rname).lower().rstrip(".") in owners)


class Resolver:
    def __init__(self, upstreams, timeout: float = 2.0, ttl_min: int = 5, ttl_max: int = 3600,
                 share: int = RESOLVER_CACHE_MAX):
        self.upstreams = list(upstreams)
        self.timeout = timeout
        self.ttl_min, self.ttl_max = ttl_min, ttl_max
        self.cache = SharedLru(RESOLVER_CACHE_MAX, share)
        """(name, qtype) -> Answer, each owned by the session whose query fetched it."""
        self._inflight: dict[tuple[str, int], asyncio.Future] = {}
        self.observers: list[Callable[[str, Answer], None]] = []
        """Called with (name, answer) for every answer fetched from an upstream (the
        filter remembers where inspected hosts live: frontends.py)."""
        self.stats = {"upstream_queries": 0, "upstream_failures": 0, "cache_hits": 0}

    async def query(self, name: str, qtype: int, owner: str | None = None) -> Answer:
        """A cached or fresh answer for a normalised name; a fresh one is cached in `owner`'s
        share (the session that asked). Raises UpstreamError."""
        key = (name, qtype)
        now = time.monotonic()
        cached = self.cache.get(key)
        if cached is not None:
            if cached.expires > now:
                self.stats["cache_hits"] += 1
                return cached
            self.cache.pop(key)
        fetch = self._inflight.get(key)
        if fetch is None:  # one upstream query for every asker; it outlives any of them
            fetch = asyncio.get_running_loop().create_task(
                self._fetch(key, name, qtype, owner), name="dns-upstream")
            fetch.add_done_callback(_retrieved)
            self._inflight[key] = fetch
        return await asyncio.shield(fetch)

    async def _fetch(self, key, name: str, qtype: int, owner: str | None) -> Answer:
        try:
            answer = await self._ask_all(name, qtype)
            self.cache.put(key, answer, owner)
            for observer in self.observers:
                observer(name, answer)
            return answer
        finally:
            del self._inflight[key]

    async def addresses(self, name: str, owner: str | None = None) -> tuple:
        """IPv4 addresses of `name`, else IPv6 ones. Raises UpstreamError."""
        for qtype in (QTYPE.A, QTYPE.AAAA):
            found = (await self.query(name, qtype, owner)).addresses(name)
            if found:
                return found
        return ()

    async def _ask_all(self, name: str, qtype: int) -> Answer:
        errors = []
        for upstream in self.upstreams:
            self.stats["upstream_queries"] += 1
            try:
                reply = await self._ask(upstream, name, qtype)
            except (OSError, TimeoutError, DNSError, ValueError) as exc:
                errors.append(f"{upstream[0]}:{upstream[1]}: {exc or type(exc).__name__}")
                continue
            rcode = reply.header.rcode
            if rcode not in (RCODE.NOERROR, RCODE.NXDOMAIN):
                errors.append(f"{upstream[0]}:{upstream[1]}: {RCODE.get(rcode)}")
                continue
            return Answer(rcode, tuple(reply.rr), time.monotonic() + self._ttl(reply))
        self.stats["upstream_failures"] += 1
        raise UpstreamError("; ".join(errors) or "no upstream resolver configured")

    def _ttl(self, reply: DNSRecord) -> int:
        if reply.rr:
            return min(max(min(rr.ttl for rr in reply.rr), self.ttl_min), self.ttl_max)
        soa = [rr for rr in reply.auth if rr.rtype == QTYPE.SOA]
        negative = min(soa[0].ttl, soa[0].rdata.times[-1]) if soa else 60
        return min(max(negative, self.ttl_min), self.ttl_max, NEGATIVE_TTL_MAX)

    async def _ask(self, upstream, name: str, qtype: int) -> DNSRecord:
        query = DNSRecord.question(name, QTYPE.get(qtype))
        query.header.id = secrets.randbits(16)
        query.add_ar(EDNS0(udp_len=1232))
        wire = query.pack()
        reply = await asyncio.wait_for(self._ask_udp(upstream, wire, query), self.timeout)
        if reply.header.tc:
            reply = await asyncio.wait_for(self._ask_tcp(upstream, wire, query), self.timeout)
        return reply

    async def _ask_udp(self, upstream, wire: bytes, query: DNSRecord) -> DNSRecord:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in upstream[0] else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            await loop.sock_connect(sock, upstream)
            await loop.sock_sendall(sock, wire)
            while True:  # ignore strays and spoofs until the real reply or the timeout
                data = await loop.sock_recv(sock, 65535)
                reply = _matching(data, query)
                if reply is not None:
                    return reply

    async def _ask_tcp(self, upstream, wire: bytes, query: DNSRecord) -> DNSRecord:
        reader, writer = await asyncio.open_connection(upstream[0], upstream[1])
        try:
            writer.write(struct.pack("!H", len(wire)) + wire)
            await writer.drain()
            (length,) = struct.unpack("!H", await reader.readexactly(2))
            reply = _matching(await reader.readexactly(length), query)
            if reply is None:
                raise ValueError("TCP reply does not match the question")
            return reply
        except asyncio.IncompleteReadError:
            raise ValueError("upstream closed the TCP connection mid-reply") from None
        finally:
            writer.close()


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


def parse_reply(data: bytes) -> DNSRecord:
    """An upstream reply, parsed by dnslib within bounds. Raises DNSError or WireError."""
    if len(data) > MAX_REPLY:
        raise WireError(f"reply of {len(data)} bytes; at most {MAX_REPLY} are read")
    if len(data) < 12:
        raise WireError("reply shorter than a header")
    counts = struct.unpack_from("!4H", data, 4)
    if counts[0] != 1 or sum(counts[1:]) > MAX_RECORDS:
        raise WireError(f"reply with {counts[0]} questions and {sum(counts[1:])} records; "
                        f"1 and at most {MAX_RECORDS} are read")
    buffer = _BoundedBuffer(data)
    try:
        header = DNSHeader.parse(buffer)
        questions = [DNSQuestion.parse(buffer)]
        sections = [[RR.parse(buffer) for _ in range(n)] for n in counts[1:]]
    except BufferError as exc:
        raise DNSError(f"malformed reply: {exc}") from None
    return DNSRecord(header, questions, sections[0], auth=sections[1], ar=sections[2])


def _retrieved(task: asyncio.Task) -> None:
    """Every asker may have gone (cancelled): the outcome is read here, so an upstream error
    nobody waits for is not logged as an exception never retrieved."""
    if not task.cancelled():
        task.exception()


def _matching(data: bytes, query: DNSRecord) -> DNSRecord | None:
    """The reply to `query` in `data`, or None for anything else (a stray, a spoof, bytes
    that are no reply or exceed the bounds). The ID is compared before anything is parsed."""
    if len(data) < 12 or struct.unpack_from("!H", data)[0] != query.header.id or not (
            data[2] & 0x80):
        return None
    try:
        reply = parse_reply(data)
    except Exception:  # hostile bytes can raise more than DNSError inside dnslib
        return None
    if (
        len(reply.questions) != 1
        or reply.q.qtype != query.q.qtype
        or str(reply.q.qname).lower() != str(query.q.qname).lower()
    ):
        return None
    return reply
