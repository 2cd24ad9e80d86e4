"""The upstream resolver: asks the configured resolvers, caches by TTL, coalesces duplicates.

Policy-free on purpose: the DNS filter decides whether a client may ask, the proxy decides
whether it may connect; both then resolve through this one cache, so the address the proxy
dials is an address this resolver handed out and the proxy checked.

Each upstream is asked over UDP through a few sockets on random ports, rotated, with a
random ID per question (`upstream.py`), and only a reply with that ID and the same question
is accepted, read within bounds (`reply.py`); a truncated reply is asked again over TCP. A
resolver that times out, fails or answers SERVFAIL/REFUSED is skipped for the next one;
when all fail the caller gets UpstreamError (-> SERVFAIL, never NXDOMAIN).

The cache gives each session (the `owner` of what it caused to be asked) a share: a session
flooding random names evicts its own answers, never another's (`cache.SharedLru`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dnslib import QTYPE, RCODE, DNSError

from .cache import RESOLVER_CACHE_MAX, SharedLru
from .reply import Question, Reply, matching
from .upstream import UdpUpstream
from .wire import Record

log = logging.getLogger(__name__)

NEGATIVE_TTL_MAX = 300


class UpstreamError(Exception):
    """No upstream resolver gave a usable answer."""


@dataclass(frozen=True, slots=True)
class Answer:
    rcode: int
    records: tuple[Record, ...]
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
        owners = {tuple(name.lower().rstrip(".").encode().split(b"."))}
        changed = True
        while changed:  # CNAME chains are short; records may come in any order
            changed = False
            for record in self.records:
                if record.rtype == QTYPE.CNAME and _lower(record.name) in owners:
                    target = _lower(record.rdata)
                    if target not in owners:
                        owners.add(target)
                        changed = True
        return tuple(record.address for record in self.records
                     if record.address is not None and _lower(record.name) in owners)


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
        self._udp: dict[tuple[str, int], UdpUpstream] = {}
        """Each upstream's UDP sockets, opened on first use."""

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
                errors.append(f"{upstream[0]}:{upstream[1]}: {str(exc) or type(exc).__name__}")
                continue
            if reply.rcode not in (RCODE.NOERROR, RCODE.NXDOMAIN):
                errors.append(f"{upstream[0]}:{upstream[1]}: {RCODE.get(reply.rcode)}")
                continue
            return Answer(reply.rcode, reply.records, time.monotonic() + self._ttl(reply))
        self.stats["upstream_failures"] += 1
        raise UpstreamError("; ".join(errors) or "no upstream resolver configured")

    def _ttl(self, reply: Reply) -> int:
        if reply.records:
            return min(max(min(r.ttl for r in reply.records), self.ttl_min), self.ttl_max)
        negative = reply.negative_ttl if reply.negative_ttl is not None else 60
        return min(max(negative, self.ttl_min), self.ttl_max, NEGATIVE_TTL_MAX)

    async def _ask(self, upstream, name: str, qtype: int) -> Reply:
        udp = self._udp.get(upstream)
        if udp is None:
            udp = self._udp[upstream] = UdpUpstream(upstream, self.timeout)
        question, reply = await udp.ask(name, qtype)
        if reply.truncated:
            reply = await asyncio.wait_for(self._ask_tcp(upstream, question), self.timeout)
        return reply

    async def _ask_tcp(self, upstream, question: Question) -> Reply:
        reader, writer = await asyncio.open_connection(upstream[0], upstream[1])
        try:
            wire = question.pack()
            writer.write(struct.pack("!H", len(wire)) + wire)
            await writer.drain()
            (length,) = struct.unpack("!H", await reader.readexactly(2))
            reply = matching(await reader.readexactly(length), question)
            if reply is None:
                raise ValueError("TCP reply does not match the question")
            return reply
        except asyncio.IncompleteReadError:
            raise ValueError("upstream closed the TCP connection mid-reply") from None
        finally:
            writer.close()

    def close(self) -> None:
        """Closes the upstream sockets; questions still outstanding fail."""
        for udp in self._udp.values():
            udp.close()

    def udp_stats(self) -> dict:
        """The UDP sockets' counters, all upstreams together (replies that matched no
        question: "udp_strays")."""
        totals = {"udp_sockets_open": sum(len(u.sockets()) for u in self._udp.values())}
        for udp in self._udp.values():
            for key, value in udp.stats.items():
                totals[f"udp_{key}"] = totals.get(f"udp_{key}", 0) + value
        return totals


def _lower(labels: tuple[bytes, ...]) -> tuple[bytes, ...]:
    return tuple(label.lower() for label in labels)


def _retrieved(task: asyncio.Task) -> None:
    """Every asker may have gone (cancelled): the outcome is read here, so an upstream error
    nobody waits for is not logged as an exception never retrieved."""
    if not task.cancelled():
        task.exception()
