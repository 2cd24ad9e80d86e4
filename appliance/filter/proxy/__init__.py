"""The HTTP proxy: explicit (CONNECT, absolute-form HTTP) and transparent (Host, SNI).

Every connection is decided by name — CONNECT target, absolute URI, Host header or TLS SNI,
never the IP a client aimed at — then resolved by the appliance's own resolver, each
address checked against the blocked ranges, and exactly that checked address dialled.
Denials are answered (403 + X-Corral-Deny, or a TLS access_denied alert), never left to hang.

The rooms: `pipeline` routes and re-serialises HTTP requests (no I/O), `flows` keeps the
per-session caps and the open flows (no I/O), `forward` relays plain HTTP (explicit,
transparent, inside tunnels, inside inspected TLS), `tunnel` handles CONNECT and transparent
TLS, `inspect` holds the interception CA and the leaf certificates (no sockets). This module
is the edge they share: listeners, deciding, dialling, events, and cutting flows that a new
policy denies.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import select
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from appliance.event import Event, closing
from appliance.policy import HOST_NAME, Decision, Host, Policy
from appliance.policystore import PolicyStore
from appliance.sessionconfig import ProxyConfig

from .. import dial
from ..approvals import ApprovalError, Holds, approvable, decide_kind, parse_agent_ask
from ..denied import Denied
from ..dns.guard import ExfilGuard
from ..dns.resolver import Resolver
from ..events import EventBus
from ..http import HttpError
from ..ratelimit import LogBudget, TokenBucket
from ..redact import Redactor
from ..relay import Counters, PeerWriter, original_port, within
from .credentials import Credentials, Leak
from .flows import Cap, Flow, Flows
from .forward import Forward
from .frontends import Frontends
from .inspect import Inspector
from .pipeline import deny_response, error_response
from .tunnel import TLS_ACCESS_DENIED, Tunnels

__all__ = ["TLS_ACCESS_DENIED", "Client", "Proxy"]
log = logging.getLogger(__name__)


ASK_RATE, ASK_BURST = 1.0, 5
"""Requests an agent may make at request.corral: a second, and saved up."""


@dataclass(eq=False)
class Client:
    """One client connection and who it belongs to."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    address: str
    port: int
    session: str | None = None
    """The session it was counted against when it was accepted."""
    task: asyncio.Task | None = field(default=None, repr=False)
    abort: Callable[[], None] | None = field(default=None, repr=False)
    """How a connection served without a task (express.py) is ended."""
    cut: bool = False
    """Set when a policy change ended it (its task is cancelled: not an error)."""
    once: set[tuple[str, int]] = field(default_factory=set)
    """host:port approved once on this connection (ask mode), no rule added: a tunnel's
    requests for its life; a plain HTTP request's entry is dropped when it ends."""

    @property
    def label(self) -> str:
        return f"{self.address}:{self.port}"

    def end(self) -> None:
        """Close this connection at once, whatever it is doing (its finally blocks release
        everything it holds)."""
        if self.cut:
            return
        if self.task is not None:
            self.cut = True
            self.task.cancel()
        elif self.abort is not None:
            self.cut = True
            self.abort()


def _gone(client: Client) -> bool:
    """The client closed, reset or half-closed its connection (a client that stops sending
    while it waits for an answer is treated as gone: held requests are not for it). Asked
    of the socket itself: the stream's reader stops reading once its buffer is full (a
    large body sent early), and would never see the end behind it."""
    if client.writer is None:  # served by the express lane, which hands no hold over
        return client.cut
    if client.writer.transport.is_closing():
        return True
    sock = client.writer.get_extra_info("socket")
    if sock is None:
        return bool(client.reader.at_eof())
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


class Proxy:
    def __init__(self, store: PolicyStore, resolver: Resolver, bus: EventBus,
                 config: ProxyConfig, gateway=None, exfil: ExfilGuard | None = None,
                 inspector: Inspector | None = None, credentials: Credentials | None = None,
                 holds: Holds | None = None, frontends: Frontends | None = None):
        self.store, self.resolver, self.bus, self.config = store, resolver, bus, config
        self.holds = holds or Holds(bus.emit)
        """Requests held in ask mode for a person's decision (approvals.py)."""
        self.asking: dict[str, TokenBucket] = {}
        """Each session's allowance of requests at request.corral (ASK_RATE, ASK_BURST)."""
        self.gateway = gateway
        self.exfil = exfil
        """The DNS filter's exfiltration limits: a name under a wildcard that the proxy
        resolves leaves the appliance too (shared, so DNS and proxy count one window)."""
        self.inspector = inspector
        """TLS inspection (the interception CA, its leaves); None when no CA is configured,
        and a host the policy inspects is then denied."""
        self.frontends = frontends or Frontends(store, resolver)
        """Where the inspected hosts live: a name that is not inspected gets no tunnel to
        one of their addresses (neighbours.py)."""
        self.frontends.listeners.append(lambda: self.rejudge(
            "an inspected host was seen at its address while it was open"))
        self._credentials = credentials or Credentials(b"", {})
        self.bus.redactor = self._credentials.redactor
        self.frontends.use(self._credentials)
        self.failures = LogBudget()
        """What is logged of connections that failed unexpectedly: a budget per session."""
        self.active = 0
        self.lanes: set = set()
        """Connections the express lane serves now (express.py), closed when the filter stops."""
        self.stats = {"connections": 0, "rejected_over_limit": 0, "refused_connections": 0,
                      "refused_tunnels": 0, "cut": 0, "express_requests": 0,
                      "express_handed_over": 0}
        self.flows = Flows(config.max_connections_per_session, config.max_tunnels_per_session)
        self.forward = Forward(self)
        self.tunnels = Tunnels(self)
        store.on_change(self.rejudge)
        store.on_change(lambda: [self.asking.pop(s, None) for s in set(self.asking)
                                 if s not in store.sessions])
        store.on_change(lambda: self.failures.forget(set(store.sessions)))
        if inspector is not None:
            store.on_change(lambda: inspector.leaves.forget(set(store.sessions)))
            store.on_change(lambda: inspector.forget_upstream_tls(set(store.sessions)))

    @property
    def credentials(self) -> Credentials:
        """The secrets, as requests get them (replaced whole when one changes): a host a
        secret is bound to is inspected, so that its placeholder can be swapped. Setting
        them sets the redaction of every event too (redact.py)."""
        return self._credentials

    @credentials.setter
    def credentials(self, credentials: Credentials) -> None:
        self._credentials = credentials
        self.bus.redactor = credentials.redactor
        self.frontends.use(credentials)  # their hosts are inspected: watched, as [[inspect]]
        self.rejudge("a secret changed while it was open")  # a host bound now is inspected

    def inspects(self, policy: Policy, host: Host) -> bool:
        """Does the filter end TLS to `host` under `policy`: named in an [[inspect]] or
        [[git]] table, or bound to a secret (its placeholder is swapped inside)? Else a
        tunnel to it is spliced."""
        return policy.inspection(host) is not None or bool(self._credentials.bound(host))

    @property
    def redactor(self) -> Redactor:
        """What the proxy's answers pass their words through (the secrets' values out)."""
        return self._credentials.redactor

    def refusal(self, denied: Denied, keep: bool = False) -> bytes:
        """The answer to a request the proxy refuses (its words redacted)."""
        return deny_response(denied, keep, redactor=self.redactor)

    def failed(self, status: int, message: str) -> bytes:
        """The answer to a request the proxy cannot serve (its words redacted)."""
        return error_response(status, message, redactor=self.redactor)

    # -- listeners -----------------------------------------------------------------------

    async def serve_transparent_tls(self, reader, writer) -> None:
        port = original_port(writer, 443)
        await self._serve(reader, writer, lambda c: self.tunnels.transparent(c, port))

    async def _serve(self, reader, writer, handler) -> None:
        peer = writer.get_extra_info("peername") or ("?", 0)
        client = Client(reader, PeerWriter(writer), peer[0], peer[1])
        if self.admit(client, writer.transport.abort):
            client.task = asyncio.current_task()
            await self.run(client, handler)

    def admit(self, client: Client, abort: Callable[[], None]) -> bool:
        """Count a new connection against the filter's and its session's limits; over
        either, `abort` it (a reset, at once: the client knows) and say False. Admitted,
        `run` (or the express lane's end) gives its place back."""
        session, _ = self.store.lookup(client.address)
        if self.active >= self.config.max_connections:
            self.stats["rejected_over_limit"] += 1
            abort()
            return False
        if not self.flows.connections.admit(session):
            self.stats["refused_connections"] += 1
            self.refused(client, session, self.flows.connections)
            abort()
            return False
        client.session = session
        self.active += 1
        self.stats["connections"] += 1
        return True

    def release(self, client: Client) -> None:
        """An admitted connection ended: its place is given back."""
        self.active -= 1
        self.flows.connections.release(client.session)

    async def run(self, client: Client, handler) -> None:
        """Serve an admitted connection with `handler` (on its own task, `client.task`),
        whatever it ends with, then close it and give its place back."""
        session = client.session
        try:
            await handler(client)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass  # the client or the upstream went away (tlsstream.ClientGone too)
        except asyncio.CancelledError:
            if not client.cut:
                raise  # the filter is stopping
            client.task.uncancel()
        except Exception:  # one broken connection must never take the listener down
            self.failures.log(log, session, time.monotonic(),
                              "proxy: connection from %s failed", client.label)
        finally:
            self.release(client)
            client.writer.close()
            with contextlib.suppress(Exception):
                await client.writer.wait_closed()

    def leaked(self, client: Client, session: str | None, host: Host, leak: Leak,
               decision: Decision) -> None:
        """A placeholder going where it may not: an event of its own (kind "secret"), before
        the one of the request it refuses (`decision`: plan.leak_decision)."""
        self.bus.emit(Event(session=session, client=client.label, kind="secret",
                            name=str(host), port=None, address=None, verdict="deny",
                            rule=None, layer=None, secret=leak.secret,
                            reason=decision.reason))

    def refused(self, client: Client, session: str | None, cap: Cap) -> None:
        """A connection or tunnel over its session's cap: an event, once a second."""
        count = cap.report(session, time.monotonic())
        if count:
            self.bus.emit(Event(
                session=session, client=client.label, kind="http", name=None,
                port=None, address=None, verdict="deny", rule=None, layer=None,
                reason=f"session {session or '(outside every session)'} has {cap.limit} "
                       f"{cap.what} open: the limit ([proxy] max_{cap.what}_per_session); "
                       f"{count} refused"))

    def close_lanes(self) -> None:
        """The filter stops: every connection the express lane serves is closed (those on
        tasks end with their tasks)."""
        for lane in list(self.lanes):
            lane.cut()

    # -- deciding, dialling, events ---------------------------------------------------------

    def decide(self, address: str, host: Host, port: int) -> tuple[str | None, Policy, Decision]:
        """(session, policy, decision) under the policy in force right now."""
        session, policy = self.store.lookup(address)
        if host.name == HOST_NAME:
            return session, policy, policy.decide_host_port(port)
        return session, policy, policy.decide_http(host, port)

    async def dial(self, policy: Policy, host: Host, port: int, target: str,
                   session: str | None = None, splice: bool = False, opener=None):
        """Resolve (the lookup counted against `session`'s cache share), check each address,
        connect to the first that is allowed and answers. Returns (connection, address): a
        (reader, writer) pair, or what `opener(address, port)` made of the connection
        (express.py: a protocol). Raises Denied (403: refused; 502: unreachable). With
        `splice` (a tunnel to a host that is not inspected), an address where an inspected
        host lives is refused too (neighbours.py)."""
        try:
            found = await dial.candidates(host, self.gateway, self.resolver, session)
        except dial.Undialable as exc:
            raise Denied(exc.decision, target, 502 if exc.failed else 403) from None
        if splice and host.name != HOST_NAME:
            unknown = await self.frontends.ready(policy)
            if unknown is not None:  # fail closed: nobody can tell what is shared
                raise Denied(Decision(False, f"cannot tell whether {host} shares an address "
                                      f"with an inspected host: {unknown}"), target, 502)

        def check(address) -> Decision:
            verdict = dial.decide(policy, address, host, port)
            if verdict.allowed and splice and host.name != HOST_NAME:
                verdict = self.frontends.refusal(policy, host, address) or verdict
            return verdict

        async def streams(address: str, port: int):
            up_r, up_w = await asyncio.open_connection(address, port,
                                                       limit=self.config.max_header_bytes)
            return up_r, PeerWriter(up_w)

        async def connect(address):
            try:
                return await within((opener or streams)(str(address), port),
                                    self.config.connect_timeout)
            except (OSError, TimeoutError) as exc:
                raise dial.Unanswered(f"connect to {address}:{port} failed: "
                                      f"{exc or 'timed out'}") from None

        try:
            address, connection = await dial.first_answering(found, check, connect, host)
        except dial.Undialable as exc:
            raise Denied(exc.decision, target, 502 if exc.failed else 403) from None
        return connection, address

    async def open(self, client: Client, host: Host, port: int, kind: str, target: str,
                   opener=None, dialled=None, **extra):
        """Decide, register the flow (a policy change cuts it even while it dials), dial
        (with `opener`, as dial() says), call `dialled()` (a tunnel's 200: the client waits
        for it, and nothing of the tunnel moves before the event is out, in this same step),
        emit the decision event (with `extra` fields).
        Returns (connection, event, flow): the caller untracks the flow when it ends. Raises
        Denied, recorded, with nothing left registered."""
        session, policy, decision = await self.judge(client, host, port)
        rule = decision.rule
        if decision.allowed and self.exfil is not None and rule is not None and rule.wildcard:
            breach = self.exfil.check(session, host.name, rule.suffix, time.monotonic())
            if breach is not None:  # the name is chosen by the client: resolving it sends it
                decision = Decision(False, f"looks like DNS exfiltration: {breach}", rule,
                                    f"allow the exact name (corral allow-http {target}) or "
                                    "raise the filter's [dns] exfil_* limits")
        if not decision.allowed:
            self.event(decision, client, session, kind, host, port)
            raise Denied(decision, target, recorded=True)
        flow = self.track(client, session, kind, host, port)
        splice = kind in ("connect", "tls") and not self.inspects(policy, host)
        try:
            connection, address = await self.dial(policy, host, port, target, session, splice,
                                                  opener)
        except Denied as denied:
            self.untrack(flow)
            verdict = "deny" if denied.status == 403 else "error"
            self.event(denied.decision, client, session, kind, host, port, verdict=verdict,
                       event_id=flow.id)
            denied.recorded = True
            raise
        except BaseException:
            self.untrack(flow)
            raise
        flow.address = address
        if dialled is not None:
            # the client left as it was dialled: the event still says what was dialled, and
            # the caller, finding the client gone next, ends the flow it holds
            with contextlib.suppress(ConnectionError):
                dialled()
        return connection, self.event(decision, client, session, kind, host, port, address,
                                      event_id=flow.id, **extra), flow

    async def judge(self, client: Client, host: Host, port: int
                    ) -> tuple[str | None, Policy, Decision]:
        """decide(), and in ask mode, for what the default alone denies: let through what
        this connection was granted once, or hold it for a person (approvals.py)."""
        session, policy, decision = self.decide(client.address, host, port)
        if decision.allowed or session is None or not approvable(decision):
            return session, policy, decision
        if (str(host), port) in client.once:
            return session, policy, Decision(True, f"{host}:{port} approved once for this "
                                             "connection")
        if not policy.hold:
            return session, policy, decision
        return await self._held(client, session, policy, decision, host, port)

    async def _held(self, client: Client, session: str, policy: Policy, decision: Decision,
                    host: Host, port: int) -> tuple[str | None, Policy, Decision]:
        """Ask mode: hold the request (before any answer to the client: no 200 to CONNECT,
        no ServerHello) until a person decides or the session's hold runs out. Returns what
        it is judged by then: (session, policy, decision)."""
        pending = await self.holds.open(session, decision, "proxy", client.label, str(host),
                                        port)
        if pending is None:
            return session, policy, decision._replace(
                reason=f"{decision.reason}; {self.holds.refused(session)}")
        verdict = await self.holds.wait(pending, policy.hold, gone=lambda: _gone(client))
        now_session, now_policy, now = self.decide(client.address, host, port)
        if verdict.grant is None:
            if not now.allowed and not approvable(now):  # a deny rule since: its reason
                return now_session, now_policy, now._replace(
                    reason=f"{now.reason}; {verdict.reason}")
            return session, policy, decision._replace(
                reason=f"{decision.reason}; {verdict.reason}")
        if verdict.grant == "once" and now_session == session and approvable(now):
            # still denied by the default alone (a deny rule since then wins)
            client.once.add((str(host), port))
            return session, now_policy, Decision(True, f"{host}:{port} {verdict.reason} "
                                                 f"({pending.id})")
        return now_session, now_policy, now

    async def agent_ask(self, client: Client, path: str) -> tuple[int, dict]:
        """An agent asking for a host at request.corral, with a reason: the approval it
        opens (or joins), and with `wait` the decision. Answered in any approval mode (the
        agent may always ask; only a person grants); rate-limited per session. Returns
        (HTTP status, JSON answer)."""
        session, policy = self.store.lookup(client.address)
        if session is None:
            return 403, {"error": "outside every session: nothing to ask for"}
        bucket = self.asking.get(session)
        now = time.monotonic()
        if bucket is None:
            bucket = self.asking[session] = TokenBucket(ASK_RATE, ASK_BURST, now)
        if not bucket.take(now):
            return 429, {"error": f"at most {ASK_RATE:g} request a second (a burst of "
                                  f"{ASK_BURST}) per session: try again later"}
        try:
            ask = parse_agent_ask(path)
        except ApprovalError as exc:
            return 400, {"error": str(exc)}
        decision = decide_kind(policy, ask.kind, ask.host, ask.port)
        if decision.allowed:
            return 200, {"status": "allowed", "reason": decision.reason}
        if not approvable(decision):
            return 403, {"status": "refused", "reason": f"{decision.reason}: not something a "
                         "person can approve (a deny rule, a placeholder, the VM host's "
                         "ports, an IP literal or the appliance's own names)"}
        pending = await self.holds.open(session, decision, "agent", client.label,
                                        str(ask.host), ask.port, note=ask.reason)
        if pending is None:
            return 429, {"error": self.holds.refused(session)}
        answer = {"id": pending.id, "kind": pending.kind, "target": pending.target}
        if not ask.wait:
            return 202, {"status": "pending", **answer}
        # not counted as waiting: asking is no request that a grant `once` could let through
        verdict = await self.holds.wait(pending, ask.wait, counted=False,
                                        gone=lambda: _gone(client))
        if verdict.grant is None and pending.id in self.holds.book.pending:
            return 202, {"status": "pending", **answer, "reason": verdict.reason}
        if verdict.grant is None:
            return 403, {"status": "refused", **answer, "reason": verdict.reason}
        return 200, {"status": "approved" if verdict.grant != "policy" else "allowed",
                     "grant": verdict.grant, **answer, "reason": verdict.reason}

    def event(self, decision, client: Client, session, kind, host, port, address=None,
              **extra) -> dict:
        return self.bus.decision(decision, session=session, client=client.label, kind=kind,
                                 name=str(host), port=port, address=address, **extra)

    def error_event(self, client: Client, exc: HttpError, kind: str = "http") -> None:
        """Requests refused as malformed are visible too (verdict "error")."""
        session, _ = self.store.lookup(client.address)
        self.bus.emit(Event(session=session, client=client.label, kind=kind, name=None,
                            verdict="error", reason=f"{exc.status}: {exc}"[:200]))

    def closed(self, opened: dict, counters: Counters) -> None:
        """The second event of an allowed flow: same id, with bytes and duration."""
        self.bus.emit(closing(opened, round(time.time(), 6), counters.up, counters.down,
                              counters.duration()))

    # -- flows that a policy change may cut -------------------------------------------------

    def track(self, client: Client, session: str | None, kind: str, host: Host, port: int,
              address: str | None = None) -> Flow:
        """Register an allowed flow (until `untrack`): a policy that stops allowing it, its
        name or the address it reached, cuts it. Its id is its decision event's."""
        flow = Flow(self.bus.next_id(), session, client.address, client.label, kind, host,
                    port, client.end, address, once=(str(host), port) in client.once)
        self.flows.add(flow)
        return flow

    def untrack(self, flow: Flow) -> None:
        self.flows.remove(flow.id)

    def neighbour(self, policy: Policy, host: Host, address: str) -> Decision | None:
        """The refusal of a splice to `host` at `address`: an inspected host lives there
        (neighbours.py); None when there is none."""
        if host.name == HOST_NAME:
            return None
        return self.frontends.refusal(policy, host, address)

    def rejudge(self, because: str = "the policy changed while it was open") -> None:
        """The policy changed (the store calls this on the loop's thread), or an inspected
        host was seen at a new address (`frontends`): every open flow is judged again, and
        those now denied are cut at once, each with an event."""
        for flow, decision in self.flows.denied_by(self._judge):
            self.flows.remove(flow.id)
            self.stats["cut"] += 1
            rule = decision.rule
            self.bus.emit(Event(
                id=flow.id, session=flow.session, client=flow.label,
                kind=flow.kind, name=str(flow.host), port=flow.port,
                address=flow.address,
                verdict="deny", rule=rule.text if rule else None,
                layer=rule.layer if rule else None,
                reason=f"cut: {decision.reason} ({because})"))
            flow.cut()

    def _judge(self, flow: Flow) -> Decision:
        """The flow under the policy in force now: its name and port, whether a spliced
        tunnel's host has come to be inspected or its address to be an inspected host's,
        then the address it reached (a cidr rule that let a blocked address through may be
        gone)."""
        session, policy, decision = self.decide(flow.client, flow.host, flow.port)
        if flow.once and session == flow.session and approvable(decision):
            decision = Decision(True, "approved once")  # a deny rule, or its session's end, cut it
        if decision.allowed and flow.spliced and self.inspects(policy, flow.host):
            return Decision(False, f"{flow.host} is inspected now: a tunnel spliced before "
                            "could carry any request")
        if decision.allowed and flow.spliced and flow.address is not None:
            shared = self.neighbour(policy, flow.host, flow.address)
            if shared is not None:
                return shared
        if decision.allowed and flow.address is not None and flow.host.name != HOST_NAME:
            check = policy.decide_address(ipaddress.ip_address(flow.address), flow.host,
                                          flow.port)
            if not check.allowed:
                return check
        return decision
