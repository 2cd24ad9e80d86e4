"""The DNS filter: answers every query, forwards only names the client's policy allows.

Denied -> NXDOMAIN, and the name never leaves the appliance (no exfiltration through
queries); past the session's limit on denied names, REFUSED. Upstream broken -> SERVFAIL
(never NXDOMAIN: that would be cached as "does not exist"). Addresses in blocked ranges are
removed from answers (rebinding) unless a cidr rule covers them. Malformed -> FORMERR,
unsupported -> NOTIMP/REFUSED; a packet too short to carry an ID, or one that is itself a
response, is dropped. `answer()` never raises: every failure becomes an rcode.

Client bytes are read only by `wire.parse_query` (bounded: no packet can hold the loop);
dnslib only builds replies. Each query is judged once, by `judge.judge_query` (pure): its
verdict travels with the pending query, and the resolver is asked only with an `Allowed`
one. Each session is held to its share (`guard.py`): a query rate (over it: REFUSED at
once), names it may not have (a bucket of their own, which names that are no host names and
types no policy answers also take from), queries waiting for an upstream, DNS-over-TCP
connections, its share of the caches, and for names a wildcard allows, the exfiltration
limits (NXDOMAIN).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from dataclasses import dataclass

from dnslib import EDNS0, QTYPE, RCODE, RR, A, DNSHeader, DNSLabel, DNSQuestion, DNSRecord

from appliance.event import Event
from appliance.firewall.learned import Teaching
from appliance.policy import HOST_NAME, Decision, Policy
from appliance.policy.grants import rule_text
from appliance.policystore import PolicyStore
from appliance.sessionconfig import DnsConfig

from ..approvals import Holds, approvable
from ..events import EventBus
from ..ratelimit import LogBudget
from ..relay import within
from .cache import WIRE_CACHE_MAX, WireCache
from .guard import ExfilGuard, Report, SessionLimits
from .judge import (
    Allowed,
    HostGateway,
    NotHostName,
    PolicyAnswer,
    QueryVerdict,
    RefusedQuestion,
    judge_query,
)
from .resolver import Resolver, UpstreamError
from .wire import (
    OPT_RECORD,
    UDP_EDNS_LIMIT,
    UDP_PLAIN_LIMIT,
    Query,
    WireError,
    error_reply,
    pack_reply,
    parse_query,
    refusal,
)

log = logging.getLogger(__name__)

TCP_IDLE = 10.0
POLICY_ONLY_SECONDS = 30.0
"""How long an answer decided by policy alone (a denial) is served from the wire cache; a
policy change makes a new Policy object, which is part of the key, so it never goes stale."""


@dataclass(slots=True)
class PendingQuery:
    """A query that passed the quick checks and goes the slow way, with the verdict it was
    judged (`finish()` acts on it, never judges again; an `Allowed` one may ask an
    upstream); it holds one of its session's `max_pending` places until answered."""

    key: tuple
    session: str | None
    policy: Policy
    query: Query
    verdict: QueryVerdict


class DnsFilter:
    def __init__(self, store: PolicyStore, resolver: Resolver, bus: EventBus, gateway=None,
                 learner=None, learn_ttl_min: int = 60, config: DnsConfig | None = None,
                 holds: Holds | None = None, frontends=None):
        self.store, self.resolver, self.bus, self.gateway = store, resolver, bus, gateway
        self.frontends = frontends
        """Where the inspected hosts live (frontends.Frontends): known before a tcp rule's
        addresses are taught, so that one of theirs is not (the learner judges that)."""
        self.holds = holds
        """Approvals a session in ask mode opens for the names it is denied (approvals.py)."""
        self.learner = learner
        """The firewall's learned set (firewall.learned.LearnedSet): learn([Teaching])."""
        self.learn_ttl_min = learn_ttl_min
        config = config if config is not None else DnsConfig()
        self.wire = WireCache(WIRE_CACHE_MAX, config.cache_share)
        self.limits = SessionLimits(config.rate, config.burst, config.max_pending,
                                    config.max_tcp, config.denied_rate, config.denied_burst)
        self.exfil = ExfilGuard(config.exfil_length, config.exfil_entropy,
                                config.exfil_entropy_length, config.exfil_names)
        self.failures = LogBudget()
        """What is logged of queries the filter failed to answer: a budget per session."""
        self.policies: dict[str | None, Policy] = {}
        """The policy each session had when last seen here: a new one empties its cache."""
        store.on_change(self._sessions_changed)

    def _sessions_changed(self) -> None:
        """A session that has gone leaves nothing behind: cached answers, buckets, windows."""
        alive = {None, *self.store.sessions}
        for session in [s for s in self.policies if s not in alive]:
            del self.policies[session]
            self.wire.drop_session(session)
            self.resolver.cache.drop_owner(session)
        self.limits.forget(alive)
        self.exfil.forget(alive)
        self.failures.forget(alive)

    def _key(self, session: str | None, policy: Policy, data: bytes, udp: bool) -> tuple:
        """The wire cache's key: (policy, session, transport, the query after its ID). A
        session whose policy changed since it was last seen loses its cached answers."""
        if self.policies.get(session) is not policy:
            self.wire.drop_session(session)
            self.policies[session] = policy
        return (policy, session, udp, bytes(data[2:]))

    def first(self, data: bytes, client: str, udp: bool) -> bytes | PendingQuery | None:
        """What can be known at once, without awaiting: the reply (over the rate limit, a
        cached answer, a malformed query, too many waiting), None (nothing to answer: too
        short, or a response), or a PendingQuery query for `finish()`."""
        if len(data) < 12 or data[2] & 0x80:
            return None
        session, policy = self.store.lookup(client)
        now = time.monotonic()
        if not self.limits.admit(session, now):
            self._refused(session, client, "rate", now)
            return self._refusal(data)
        key = self._key(session, policy, data, udp)
        hit = self.wire.get(key, data[:2], client, now)
        if hit is not None:
            # the decision's (published: escaped), without its id, ts, client
            self.bus.emit(Event(hit[1]), escaped=True)
            return hit[0]
        try:
            query = parse_query(data)
        except WireError as exc:
            self.bus.emit(Event(session=session, client=client, kind="dns", name=None,
                                verdict="error", reason=f"malformed query: {exc}"[:200]))
            return error_reply(data, exc.rcode)
        if query is None:
            return None
        verdict = judge_query(query, policy)
        if verdict.counted and not self.limits.admit_denied(session, now):
            self._refused(session, client, "denied", now)
            return refusal(query, RCODE.REFUSED)  # not cached: the name stays denied
        if type(verdict) is PolicyAnswer:
            return self._answered_by_policy(query, verdict, key, session, policy, client, now)
        if not self.limits.begin(session):
            self._refused(session, client, "pending", now)
            return refusal(query, RCODE.REFUSED)
        return PendingQuery(key, session, policy, query, verdict)

    def _answered_by_policy(self, query: Query, verdict: PolicyAnswer, key: tuple,
                            session: str | None, policy: Policy, client: str, now: float
                            ) -> bytes:
        """The reply to a query the policy answers by itself (a denied name, a type answered
        empty), built here without a task or dnslib: a flood of random denied names (the
        exfiltration pattern) costs the loop a few microseconds a query."""
        decision, name = verdict.decision, verdict.host.name
        if not decision.allowed and self.holds is not None and session is not None and (
                policy.hold and approvable(decision)):
            # never held (resolvers retry and time out): NXDOMAIN now, and an approval for
            # the name as an http grant, which answers DNS too (what a client that resolves
            # a name goes on to ask the proxy for)
            grant = rule_text("http", name, None)
            self.holds.ask(session, decision._replace(hint=f"corral allow-http {grant}"),
                           "dns", client, name)
        event = self._event(decision, session, client, name, QTYPE.get(query.qtype))
        wire = refusal(query, verdict.rcode)
        if query.edns is not None:  # one OPT record, as _pack adds: ARCOUNT 1
            wire = wire[:10] + b"\x00\x01" + wire[12:] + OPT_RECORD
        self.wire.put(key, session, wire, now + POLICY_ONLY_SECONDS, event)
        return wire

    @staticmethod
    def _refusal(data: bytes) -> bytes:
        """REFUSED with the question when there is one (a stub resolver ignores a reply
        without it and waits for its timeout); no event for what does not parse: the
        limit's report speaks for the whole flood."""
        try:
            query = parse_query(data)
        except WireError:
            query = None
        return refusal(query, RCODE.REFUSED) if query is not None else error_reply(
            data, RCODE.REFUSED)

    def _refused(self, session: str | None, client: str, limit: str, now: float) -> None:
        report = self.limits.refuse(session, limit, now)
        if report is not None:
            self._report(session, client, report)

    def _report(self, session: str | None, client: str, report: Report) -> None:
        what = "connections" if report.limit == "tcp" else "queries"
        self.bus.emit(Event(session=session, client=client, kind="dns", name=None,
                            verdict="deny", limit=report.limit, refused=report.count,
                            reason=f"{self.limits.describe(report.limit)}: {report.count} "
                                   f"{what} refused since the last report"))

    async def finish(self, data: bytes, client: str, udp: bool, pending: PendingQuery) -> bytes:
        """The reply to a PendingQuery query; frees its place."""
        query, session, policy = pending.query, pending.session, pending.policy
        note: dict = {}
        try:
            reply = await self._answer(query, pending.verdict, client, session, policy,
                                       note, udp)
        except Exception:  # a bug must not cost the client its answer
            self.failures.log(log, session, time.monotonic(), "dns: failed answering %s",
                              client)
            reply = _reply(query)
            reply.header.rcode = RCODE.SERVFAIL
            note.clear()
        finally:
            self.limits.end(session)
        try:
            wire = reply if type(reply) is bytes else self._pack(query, reply, udp)
        except Exception:  # a name dnslib will not pack: a reply without the question
            self.failures.log(log, session, time.monotonic(), "dns: cannot pack the reply "
                              "to %s", client)
            return error_reply(data, RCODE.SERVFAIL)
        if "expires" in note and "event" in note and self.policies.get(session) is policy:
            self.wire.put(pending.key, session, wire, note["expires"], note["event"])
        return wire

    async def answer(self, data: bytes, client: str, udp: bool) -> bytes | None:
        """The reply to one query (None: nothing to answer)."""
        first = self.first(data, client, udp)
        if not isinstance(first, PendingQuery):
            return first
        return await self.finish(data, client, udp, first)

    def tcp_opened(self, client: str) -> tuple[bool, str | None]:
        """A DNS-over-TCP connection from `client` opens: (admitted, its session). Not
        admitted when the session holds `max_tcp` already: close it. An admitted one is
        paired with tcp_closed(session)."""
        session, _ = self.store.lookup(client)
        if self.limits.open_tcp(session):
            return True, session
        self._refused(session, client, "tcp", time.monotonic())
        return False, session

    def tcp_closed(self, session: str | None) -> None:
        self.limits.close_tcp(session)

    def stats(self) -> dict:
        """Counters for `status`: totals, and per session what it holds and was refused."""
        refused = self.limits.refused
        sessions: dict = {}
        for session in sorted({None, *self.store.sessions}, key=lambda s: s or ""):
            sessions[session or "-"] = {
                "wire_cache_entries": self.wire.entries.owned(session),
                "resolver_cache_entries": self.resolver.cache.owned(session),
                "pending": self.limits.pending[session], "tcp": self.limits.tcp[session],
                "rate_limited": refused[(session, "rate")],
                "denied_limited": refused[(session, "denied")],
                "pending_refused": refused[(session, "pending")],
                "tcp_refused": refused[(session, "tcp")],
                "exfil_denied": self.exfil.denied[session],
            }
        return {
            "wire_cache_hits": self.wire.hits, "wire_cache_entries": len(self.wire.entries),
            "wire_cache_evicted": self.wire.entries.evicted,
            "rate_limited": sum(n for (_, limit), n in refused.items() if limit == "rate"),
            "denied_limited": sum(n for (_, lim), n in refused.items() if lim == "denied"),
            "pending_refused": sum(n for (_, lim), n in refused.items() if lim == "pending"),
            "tcp_refused": sum(n for (_, limit), n in refused.items() if limit == "tcp"),
            "exfil_denied": sum(self.exfil.denied.values()),
            "sessions": sessions,
        }

    async def _answer(self, query: Query, verdict: QueryVerdict, client: str,
                      session: str | None, policy: Policy, note: dict, udp: bool
                      ) -> DNSRecord | bytes:
        """The reply to a pending query, as its verdict says (judged once, in `first()`);
        an upstream's answer comes packed already (`wire.pack_reply`).
        `note` gets "event" (the decision) and, when the reply may be served from the wire
        cache, "expires" (monotonic)."""
        kind = type(verdict)
        if kind is Allowed:
            return await self._ask_upstream(verdict, query, client, session, policy, note,
                                            udp)
        reply = _reply(query)
        if kind is RefusedQuestion:
            reply.header.rcode = RCODE.REFUSED
        elif kind is NotHostName:
            self._event(verdict.decision, session, client, verdict.shown,
                        QTYPE.get(query.qtype))
            reply.header.rcode = RCODE.NXDOMAIN
        elif kind is HostGateway:
            return self._host_corral(reply, policy, session, client, query.qtype)
        else:  # the policy's own answers never wait: first() sends them at once
            raise TypeError(f"no pending query is answered as {verdict!r}")
        return reply

    async def _ask_upstream(self, allowed: Allowed, query: Query, client: str,
                            session: str | None, policy: Policy, note: dict, udp: bool
                            ) -> DNSRecord | bytes:
        """The reply to a query for a name the policy allows: the only way from a client's
        query to the resolver, and it takes the `Allowed` verdict that only `judge_query`
        makes, so no path asks an upstream for a name the policy did not allow. On the way:
        the exfiltration limits (a wildcard's names), the answer's blocked addresses
        removed, the firewall taught a tcp rule's addresses."""
        if type(allowed) is not Allowed:
            raise TypeError(f"the resolver is asked with an Allowed verdict of judge_query, "
                            f"not {allowed!r}")
        host, decision, qtype = allowed.host, allowed.decision, query.qtype
        name, qtype_name = host.name, QTYPE.get(qtype)
        rule = decision.rule
        if rule is not None and rule.wildcard:  # a name the client chose: a channel out?
            breach = self.exfil.check(session, name, rule.suffix, time.monotonic(), qtype)
            if breach is not None:
                self._event(Decision(False, f"looks like DNS exfiltration: {breach}", rule,
                                     f"allow the exact name (corral allow-dns {name}) or "
                                     "raise the filter's [dns] exfil_* limits"),
                            session, client, name, qtype_name)
                return pack_reply(query, RCODE.NXDOMAIN, [], 0, udp)
        try:
            answer = await self.resolver.query(name, qtype, session)
        except UpstreamError as exc:
            self._event(Decision(False, f"upstream failed: {exc}", decision.rule), session,
                        client, name, qtype_name, verdict="error")
            return pack_reply(query, RCODE.SERVFAIL, [], 0, udp)
        ttl = answer.ttl(time.monotonic())
        kept, removed, addresses = [], [], []
        for record in answer.records:
            if record.address is not None:
                # an answer opens no literal: only a cidr rule admits a blocked address
                check = policy.decide_address(record.address, host)
                if not check.allowed:
                    removed.append(f"{record.text} ({check.reason})")
                    continue
                addresses.append(record.text)
            kept.append(record)
        extra = {"answers": addresses}
        if removed:
            extra["removed"] = removed
        tcp_rules = policy.tcp_rules(host) if session is not None else []
        if tcp_rules and qtype == QTYPE.A and kept:
            unknown = await self.frontends.ready(policy) if self.frontends else None
            if unknown is not None:  # fail closed: an inspected host's address may be here
                extra["learned"] = ("not learned: cannot tell whether these are an inspected "
                                    f"host's addresses: {unknown}")
            else:
                extra.update(await self._learn(session, client, name, kept, tcp_rules, ttl))
        else:  # nothing taught to the firewall for this client: the bytes can be reused
            note["expires"] = answer.expires
        note["event"] = self._event(decision, session, client, name, qtype_name, **extra)
        if all(record.rdata is not None for record in kept):
            return pack_reply(query, answer.rcode, kept, ttl, udp)
        reply = _reply(query)  # names inside the data (MX, SRV...): dnslib compresses them
        reply.header.rcode = answer.rcode
        for record in kept:
            rr = record.rr
            reply.add_answer(RR(rr.rname, rr.rtype, rr.rclass, ttl, rr.rdata))
        return reply

    async def _learn(self, session: str, client: str, name: str, records, rules,
                     ttl: int) -> dict:
        """Open the firewall for this client to these addresses on the tcp rules' ports,
        before the answer leaves: the client must never race its own connect. The firewall
        remembers that `name` taught them, so that a policy change that denies it takes
        them back. What the event says: "learned" (and "not_learned", why not, when the
        firewall refused some)."""
        ports = sorted({p for rule in rules for p in rule.port.ports or ()})
        timeout = max(ttl, self.learn_ttl_min)
        teachings = [Teaching(session, name, client, record.text, port, timeout)
                     for record in records if record.rtype == QTYPE.A for port in ports]
        if self.learner is None:
            return {"learned": "not learned: the filter has no firewall to teach"}
        try:
            learned = await asyncio.get_running_loop().run_in_executor(
                None, self.learner.learn, teachings)
        except Exception as exc:  # fail closed: no element, no connection; say why
            log.error("dns: could not add tcp allowances: %s", exc)
            return {"learned": f"not learned: {exc}"}
        out: dict = {"learned": [f"{t.destination}:{t.port}" for t in learned.taught]}
        if learned.refused:
            out["not_learned"] = learned.refused
        return out

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
    def _pack(query: Query, reply: DNSRecord, udp: bool) -> bytes:
        if query.edns is not None:
            reply.add_ar(EDNS0(udp_len=UDP_EDNS_LIMIT))
        wire = reply.pack()
        limit = UDP_EDNS_LIMIT if query.edns is not None else UDP_PLAIN_LIMIT
        if udp and len(wire) > limit:
            header = DNSHeader(id=query.id, qr=1, ra=1, rd=int(query.rd), tc=1,
                               rcode=reply.header.rcode)
            wire = DNSRecord(header, q=reply.q).pack()
        return wire


def _reply(query: Query) -> DNSRecord:
    """An empty reply to `query`: its ID, RD and question (as sent), QR and RA set."""
    header = DNSHeader(id=query.id, qr=1, ra=1, rd=int(query.rd))
    return DNSRecord(header, q=DNSQuestion(DNSLabel(query.labels), query.qtype, query.qclass))


MAX_PENDING = 10_000
"""Queries waiting for an upstream at once, all sessions together (each has [dns]
max_pending of them: the budget takes only as many sessions as this holds)."""


class UdpServer:
    """DNS over UDP on a bound socket. Reads up to BATCH datagrams per wake-up (asyncio's
    datagram transport reads one per event-loop turn); what can be answered at once is
    answered right here, the rest in a task each (at most MAX_PENDING of them)."""

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
            first = self.dns.first(data, addr[0], udp=True)
        except Exception:  # a bug must not cost the client its answer
            self.dns.failures.log(log, self.dns.store.lookup(addr[0])[0], time.monotonic(),
                                  "dns: failed answering %s", addr[0])
            first = error_reply(data, RCODE.SERVFAIL) if len(data) >= 12 else None
        if first is None:
            return
        if not isinstance(first, PendingQuery):
            self.sendto(first, addr)
            return
        if len(self.tasks) >= MAX_PENDING:
            self.dns.limits.end(first.session)
            self.sendto(refusal(first.query, RCODE.REFUSED), addr)
            return
        task = self.loop.create_task(self._reply(data, addr, first), name="dns-udp")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reply(self, data: bytes, addr, pending: PendingQuery) -> None:
        self.sendto(await self.dns.finish(data, addr[0], True, pending), addr)


async def serve_tcp(dns: DnsFilter, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
    """RFC 7766 framing: 2-byte length, any number of queries, idle timeout. A session
    holding `max_tcp` connections already gets this one closed at once."""
    client = writer.get_extra_info("peername")[0]
    admitted, session = dns.tcp_opened(client)
    if not admitted:
        writer.close()
        return
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
            await asyncio.sleep(0)  # queries already buffered never wait: others go first
    finally:
        dns.tcp_closed(session)
        writer.close()
