"""The DNS filter: answers every query, forwards only names the client's policy allows.

Denied -> NXDOMAIN, and the name never leaves the appliance (no exfiltration through
queries). Upstream broken -> SERVFAIL (never NXDOMAIN: that would be cached as "does not
exist"). Addresses in blocked ranges are removed from answers (rebinding). Malformed ->
FORMERR, unsupported -> NOTIMP/REFUSED; a packet too short to carry an ID, or one that is
itself a response, is dropped. `answer()` never raises: every failure becomes an rcode.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time

from dnslib import EDNS0, QTYPE, RCODE, RR, A, DNSHeader, DNSRecord

from appliance.policy import HOST_NAME, Decision, HostNameError, Policy, parse_host

from .events import EventBus
from .relay import within
from .resolver import Resolver, UpstreamError
from .store import PolicyStore

log = logging.getLogger(__name__)

REFUSED_TYPES = {QTYPE.ANY, QTYPE.AXFR, QTYPE.IXFR}
# HTTPS/SVCB records carry address hints and ECH configs that bypass A/AAAA filtering;
# clients fall back to A/AAAA when they get none.
EMPTY_TYPES = {64, 65}
UDP_PLAIN_LIMIT = 512
UDP_EDNS_LIMIT = 1232
TCP_IDLE = 10.0


def _error_reply(data: bytes, rcode: int) -> bytes:
    """A header-only reply for a query we could not parse: same ID, QR set, the rcode."""
    (qid, flags) = struct.unpack("!HH", data[:4])
    opcode_rd = flags & 0x7900  # opcode and RD echo back
    return struct.pack("!HHHHHH", qid, 0x8000 | opcode_rd | 0x0080 | rcode, 0, 0, 0, 0)


def _qname(request: DNSRecord) -> str | None:
    """The question name as text, or None when a label holds a dot or non-ASCII bytes."""
    labels = request.q.qname.label
    try:
        texts = [label.decode("ascii") for label in labels]
    except UnicodeDecodeError:
        return None
    if any("." in t or not t for t in texts):
        return None
    return ".".join(texts)


POLICY_ONLY_SECONDS = 30.0
"""How long an answer decided by policy alone (a denial) is served from the wire cache; a
policy change makes a new Policy object, which is part of the key, so it never goes stale."""
WIRE_CACHE_MAX = 20_000


def _skip_name(wire: bytes, pos: int) -> int:
    while True:
        length = wire[pos]
        if length >= 0xC0:  # a compression pointer ends the name
            return pos + 2
        if length == 0:
            return pos + 1
        pos += 1 + length


def ttl_offsets(wire: bytes) -> list[int]:
    """Where the TTL fields are in a reply we packed (OPT's TTL slot is flags: not a TTL)."""
    counts = struct.unpack_from("!4H", wire, 4)
    pos = 12
    for _ in range(counts[0]):
        pos = _skip_name(wire, pos) + 4
    out = []
    for _ in range(sum(counts[1:])):
        pos = _skip_name(wire, pos)
        rtype, _, _, length = struct.unpack_from("!HHIH", wire, pos)
        if rtype != QTYPE.OPT:
            out.append(pos + 4)
        pos += 10 + length
    return out


class WireCache:
    """Hot answers kept as the bytes that went out, keyed by (policy, transport, the query
    after its ID): a hit patches the ID and the TTLs and emits the same decision event —
    no parsing, no deciding, no encoding. Only answers that need nothing per client are
    kept (never one that taught the firewall, never SERVFAIL)."""

    def __init__(self, limit: int = WIRE_CACHE_MAX):
        self.limit = limit
        self.entries: dict[tuple, tuple[bytes, list[int], float, dict]] = {}
        self.hits = 0

    def get(self, key: tuple, query_id: bytes, client: str, now: float
            ) -> tuple[bytes, dict] | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        wire, offsets, expires, event = entry
        if expires <= now:
            del self.entries[key]
            return None
        self.hits += 1
        reply = bytearray(wire)
        reply[:2] = query_id
        ttl = max(1, int(expires - now))
        for offset in offsets:
            struct.pack_into("!I", reply, offset, ttl)
        return bytes(reply), {**event, "client": client}

    def drop_session(self, session: str | None) -> None:
        """Forget a session's answers (its policy changed): old Policy objects, which the
        keys hold, must not stay alive for the length of a TTL."""
        self.entries = {k: v for k, v in self.entries.items() if k[1] != session}

    def put(self, key: tuple, wire: bytes, expires: float, event: dict, now: float) -> None:
        if len(self.entries) >= self.limit:
            self.entries = {k: v for k, v in self.entries.items() if v[2] > now}
            while len(self.entries) >= self.limit:
                del self.entries[next(iter(self.entries))]
        template = {k: v for k, v in event.items() if k not in ("id", "ts", "client")}
        self.entries[key] = (wire, ttl_offsets(wire), expires, template)


class DnsFilter:
    def __init__(self, store: PolicyStore, resolver: Resolver, bus: EventBus, gateway=None,
                 learner=None, learn_ttl_min: int = 60):
        self.store, self.resolver, self.bus, self.gateway = store, resolver, bus, gateway
        self.learner = learner
        """Something with learn([(sandbox, destination, port, ttl)]): the firewall's set."""
        self.learn_ttl_min = learn_ttl_min
        self.wire = WireCache()
        self.policies: dict[str | None, Policy] = {}
        """The policy each session had when last seen here: a new one empties its cache."""

    def _key(self, data: bytes, client: str, udp: bool) -> tuple:
        """The wire cache's key: (policy, session, transport, the query after its ID). A
        session whose policy changed since it was last seen loses its cached answers."""
        session, policy = self.store.lookup(client)
        if self.policies.get(session) is not policy:
            self.wire.drop_session(session)
            self.policies[session] = policy
        return (policy, session, udp, data[2:])

    def _hit(self, key: tuple, data: bytes, client: str) -> bytes | None:
        hit = self.wire.get(key, data[:2], client, time.monotonic())
        if hit is None:
            return None
        self.bus.emit(hit[1])
        return hit[0]

    def cached(self, data: bytes, client: str, udp: bool) -> bytes | None:
        """The answer from the wire cache (its event emitted), or None: call answer()."""
        if len(data) < 12:
            return None
        return self._hit(self._key(data, client, udp), data, client)

    async def answer(self, data: bytes, client: str, udp: bool) -> bytes | None:
        if len(data) < 12:
            return None
        key = self._key(data, client, udp)
        hit = self._hit(key, data, client)
        if hit is not None:
            return hit
        now = time.monotonic()
        try:
            request = DNSRecord.parse(data)
        except Exception as exc:  # dnslib raises more than DNSError on hostile bytes
            self.bus.emit({"session": key[1], "client": client, "kind": "dns", "name": None,
                           "verdict": "error", "reason": f"malformed query: {exc}"[:200]})
            return _error_reply(data, RCODE.FORMERR)
        if request.header.qr:
            return None  # a response sent to us: never answer (no reflection loops)
        note: dict = {}
        try:
            reply = await self._answer(request, client, key[1], key[0], note)
        except Exception:  # a bug must not cost the client its answer
            log.exception("dns: failed answering %s", client)
            reply = request.reply()
            reply.header.rcode = RCODE.SERVFAIL
            note.clear()
        try:
            wire = self._pack(request, reply, udp)
        except Exception:  # dnslib parses some questions it then refuses to pack (label > 63)
            return _error_reply(data, RCODE.FORMERR)
        policy, session = key[0], key[1]
        if "expires" in note and "event" in note and self.policies.get(session) is policy:
            self.wire.put(key, wire, note["expires"], note["event"], now)  # policy unchanged
        return wire

    async def _answer(self, request: DNSRecord, client: str, session: str | None,
                      policy: Policy, note: dict) -> DNSRecord:
        """The reply. `note` gets "event" (the decision) and, when the reply may be served
        from the wire cache, "expires" (monotonic)."""
        reply = request.reply()  # copies ID, RD and the question; sets QR, RA
        reply.header.aa = 0
        if request.header.opcode != 0:
            reply.header.rcode = RCODE.NOTIMP
            return reply
        if len(request.questions) != 1:
            reply.header.rcode = RCODE.FORMERR
            return reply
        question = request.q
        if question.qclass != 1 or question.qtype in REFUSED_TYPES:
            reply.header.rcode = RCODE.REFUSED
            return reply
        text = _qname(request)
        try:
            host = parse_host(text) if text is not None else None
        except HostNameError:
            host = None
        qtype = question.qtype
        qtype_name = QTYPE.get(qtype)
        if host is None or host.name is None:
            shown = text if text is not None else repr(str(question.qname))
            self._event(Decision(False, f"{shown!r} is not a valid host name"),
                        session, client, shown[:255], qtype_name)
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        name = host.name
        if name == HOST_NAME:
            return self._host_corral(reply, policy, session, client, qtype)
        decision = policy.decide_dns(host)
        if not decision.allowed or qtype in EMPTY_TYPES:  # decided by the policy alone
            note["event"] = self._event(decision, session, client, name, qtype_name)
            note["expires"] = time.monotonic() + POLICY_ONLY_SECONDS
            if not decision.allowed:
                reply.header.rcode = RCODE.NXDOMAIN
            return reply
        try:
            answer = await self.resolver.query(name, qtype)
        except UpstreamError as exc:
            self._event(Decision(False, f"upstream failed: {exc}", decision.rule), session,
                        client, name, qtype_name, verdict="error")
            reply.header.rcode = RCODE.SERVFAIL
            return reply
        now = time.monotonic()
        reply.header.rcode = answer.rcode
        kept, removed = [], []
        for rr in answer.records:
            if rr.rtype in (QTYPE.A, QTYPE.AAAA):
                check = policy.decide_address(parse_host(str(rr.rdata)).address)
                if not check.allowed:
                    removed.append(f"{rr.rdata} ({check.reason})")
                    continue
            copy = RR(rr.rname, rr.rtype, rr.rclass, answer.ttl(now), rr.rdata)
            kept.append(copy)
            reply.add_answer(copy)
        addresses = [str(rr.rdata) for rr in kept if rr.rtype in (QTYPE.A, QTYPE.AAAA)]
        extra = {"answers": addresses}
        if removed:
            extra["removed"] = removed
        tcp_rules = policy.tcp_rules(host) if session is not None else []
        if tcp_rules and qtype == QTYPE.A and kept:
            learned = await self._learn(client, kept, tcp_rules, answer.ttl(now))
            extra["learned"] = learned
        else:  # nothing taught to the firewall for this client: the bytes can be reused
            note["expires"] = answer.expires
        note["event"] = self._event(decision, session, client, name, qtype_name, **extra)
        return reply

    async def _learn(self, client: str, records, rules, ttl: int) -> list[str] | str:
        """Open the firewall for this client to these addresses on the tcp rules' ports,
        before the answer leaves: the client must never race its own connect."""
        ports = sorted({p for rule in rules for p in rule.port.ports or ()})
        timeout = max(ttl, self.learn_ttl_min)
        entries = [(client, str(rr.rdata), port, timeout)
                   for rr in records if rr.rtype == QTYPE.A for port in ports]
        if self.learner is None:
            return "not learned: the filter has no firewall to teach"
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.learner.learn, entries)
        except Exception as exc:  # fail closed: no element, no connection; say why
            log.error("dns: could not add tcp allowances: %s", exc)
            return f"not learned: {exc}"
        return [f"{dst}:{port}" for _, dst, port, _ in entries]

    def _host_corral(self, reply, policy: Policy, session, client, qtype) -> DNSRecord:
        if self.gateway is None or not policy.host_ports:
            reason = "no [host] gateway configured" if self.gateway is None else (
                "the policy lists no host ports")
            self._event(Decision(False, f"{HOST_NAME}: {reason}", None,
                                 "add ports to [host] ports in corral.toml"),
                        session, client, HOST_NAME, QTYPE.get(qtype))
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        if qtype == QTYPE.A:
            reply.add_answer(RR(HOST_NAME, QTYPE.A, ttl=60, rdata=A(str(self.gateway))))
        ports = ",".join(str(p) for p in sorted(policy.host_ports))
        self._event(Decision(True, f"{HOST_NAME} is the VM host (ports {ports})"), session,
                    client, HOST_NAME, QTYPE.get(qtype), answers=[str(self.gateway)])
        return reply

    def _event(self, decision: Decision, session, client, name, qtype, **extra) -> dict:
        return self.bus.decision(decision, session=session, client=client, kind="dns",
                                 name=name, qtype=qtype, **extra)

    @staticmethod
    def _pack(request: DNSRecord, reply: DNSRecord, udp: bool) -> bytes:
        edns = next((ar for ar in request.ar if ar.rtype == QTYPE.OPT), None)
        if edns is not None:
            reply.add_ar(EDNS0(udp_len=UDP_EDNS_LIMIT))
        wire = reply.pack()
        limit = UDP_EDNS_LIMIT if edns is not None else UDP_PLAIN_LIMIT
        if udp and len(wire) > limit:
            header = DNSHeader(id=reply.header.id, qr=1, ra=1, rd=request.header.rd, tc=1,
                               rcode=reply.header.rcode)
            wire = DNSRecord(header, q=request.q).pack()
        return wire


class UdpServer:
    """DNS over UDP on a bound socket. Reads up to BATCH datagrams per wake-up (asyncio's
    datagram transport reads one per event-loop turn); hot names are answered right here,
    the rest in a task each."""

    MAX_PENDING = 10_000
    BATCH = 64

    def __init__(self, dns: DnsFilter):
        self.dns = dns
        self.sock: socket.socket | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tasks: set[asyncio.Task] = set()

    def attach(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> UdpServer:
        self.loop, self.sock = loop, sock
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._readable)
        return self

    def close(self) -> None:
        if self.sock is not None:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    def _readable(self) -> None:
        for _ in range(self.BATCH):
            try:
                data, addr = self.sock.recvfrom(65535)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # an ICMP error for an earlier reply surfaces here
                log.debug("dns: udp error %s", exc)
                continue
            self.datagram_received(data, addr)

    def sendto(self, wire: bytes, addr) -> None:
        if self.sock is None:
            return
        try:
            self.sock.sendto(wire, addr)
        except (BlockingIOError, InterruptedError):
            pass  # a full send buffer drops the answer, as UDP may; the client retries
        except OSError as exc:
            log.debug("dns: cannot answer %s: %s", addr, exc)

    def datagram_received(self, data: bytes, addr) -> None:
        try:
            hit = self.dns.cached(data, addr[0], udp=True)  # hot names: no task at all
        except Exception:
            log.exception("dns: wire cache failed; answering the slow way")
            hit = None
        if hit is not None:
            self.sendto(hit, addr)
            return
        if len(self.tasks) >= self.MAX_PENDING:
            if len(data) >= 12:
                self.sendto(_error_reply(data, RCODE.REFUSED), addr)
            return
        task = self.loop.create_task(self._reply(data, addr), name="dns-udp")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reply(self, data: bytes, addr) -> None:
        wire = await self.dns.answer(data, addr[0], udp=True)
        if wire is not None:
            self.sendto(wire, addr)


async def serve_tcp(dns: DnsFilter, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
    """RFC 7766 framing: 2-byte length, any number of queries, idle timeout."""
    client = writer.get_extra_info("peername")[0]
    try:
        while True:
            try:
                head = await within(reader.readexactly(2), TCP_IDLE)
                (length,) = struct.unpack("!H", head)
                data = await within(reader.readexactly(length), TCP_IDLE)
            except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                return
            wire = await dns.answer(data, client, udp=False)
            if wire is None:
                return
            writer.write(struct.pack("!H", len(wire)) + wire)
            await writer.drain()
    finally:
        writer.close()
