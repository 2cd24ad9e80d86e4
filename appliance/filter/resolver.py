"""The upstream resolver: asks the configured resolvers, caches by TTL, coalesces duplicates.

Policy-free on purpose: the DNS filter decides whether a client may ask, the proxy decides
whether it may connect; both then resolve through this one cache, so the address the proxy
dials is an address this resolver handed out and the proxy checked.

Each upstream query uses a fresh connected UDP socket (a new random source port), a random
ID, and accepts only a reply with that ID and the same question; a truncated reply is asked
again over TCP. A resolver that times out, fails or answers SERVFAIL/REFUSED is skipped
for the next one; when all fail the caller gets UpstreamError (-> SERVFAIL, never NXDOMAIN).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import socket
import struct
import time
from dataclasses import dataclass, field

from dnslib import EDNS0, QTYPE, RCODE, RR, DNSError, DNSRecord

log = logging.getLogger(__name__)

NEGATIVE_TTL_MAX = 300
CACHE_MAX = 100_000


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
    def __init__(self, upstreams, timeout: float = 2.0, ttl_min: int = 5, ttl_max: int = 3600):
        self.upstreams = list(upstreams)
        self.timeout = timeout
        self.ttl_min, self.ttl_max = ttl_min, ttl_max
        self.cache: dict[tuple[str, int], Answer] = {}
        self._inflight: dict[tuple[str, int], asyncio.Future] = {}
        self.stats = {"upstream_queries": 0, "upstream_failures": 0, "cache_hits": 0}

    async def query(self, name: str, qtype: int) -> Answer:
        """A cached or fresh answer for a normalised name. Raises UpstreamError."""
        key = (name, qtype)
        now = time.monotonic()
        cached = self.cache.get(key)
        if cached is not None and cached.expires > now:
            self.stats["cache_hits"] += 1
            return cached
        pending = self._inflight.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            answer = await self._ask_all(name, qtype)
        except UpstreamError as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it, nobody leaks a warning
            raise
        else:
            future.set_result(answer)
            self._store(key, answer)
            return answer
        finally:
            del self._inflight[key]

    async def addresses(self, name: str) -> tuple:
        """IPv4 addresses of `name`, else IPv6 ones. Raises UpstreamError."""
        for qtype in (QTYPE.A, QTYPE.AAAA):
            found = (await self.query(name, qtype)).addresses(name)
            if found:
                return found
        return ()

    def _store(self, key, answer: Answer) -> None:
        if len(self.cache) >= CACHE_MAX:
            now = time.monotonic()
            self.cache = {k: v for k, v in self.cache.items() if v.expires > now}
            while len(self.cache) >= CACHE_MAX:
                del self.cache[next(iter(self.cache))]
        self.cache[key] = answer

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


def _matching(data: bytes, query: DNSRecord) -> DNSRecord | None:
    try:
        reply = DNSRecord.parse(data)
    except Exception:  # hostile bytes can raise more than DNSError inside dnslib
        return None
    if (
        reply.header.id != query.header.id
        or not reply.header.qr
        or len(reply.questions) != 1
        or reply.q.qtype != query.q.qtype
        or str(reply.q.qname).lower() != str(query.q.qname).lower()
    ):
        return None
    return reply
