"""Plain HTTP: the explicit proxy's absolute-form requests, the transparent port-80
listener, and HTTP inside CONNECT tunnels — one loop for all three, each request routed and
judged by the pipeline, its checks made as its plan says (plan.py: this module only
executes the steps), re-serialised, and its body re-framed on the way (relay.copy_body),
for as long as the connection lives. Keep-alive to the same origin reuses the upstream
connection; every request on it is judged again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from appliance.policy import Decision
from appliance.sessionconfig import SCAN_BYTES

from ..approvals import REQUEST_NAME, approvable
from ..http import (
    Head,
    HttpError,
    check_request_line,
    parse_request,
    parse_response,
    serialise_response,
)
from ..relay import (
    CHUNK,
    Counters,
    copy_body,
    copy_until_eof,
    drain,
    linger,
    read_body,
    settled,
    tunnel,
    within,
)
from .pipeline import (
    MAX_EMPTY_LINES,
    Denied,
    Explicit,
    InTunnel,
    Mode,
    framing,
    outgoing,
    response,
    route,
    strip_empty_lines,
    switch_refusal,
    wants_close,
    websocket,
)
from .plan import KEPT, OPEN, TUNNEL, OnJudgeThread, ReadBody, Refuse, Request, Send, plan
from .pool import Pool

HELD_MAX = 256 << 20
"""Request bodies held in memory to be judged (pushes, bodies read for leaks), all sessions
together; one session may hold half."""
JUDGES = 2
"""Pushes judged and bodies read (past plan.OFF_LOOP) at once, each on a thread of the judges'
own pool."""
_POOL: list[ThreadPoolExecutor] = []


def _judges() -> ThreadPoolExecutor:
    """The pool pushes are judged and large bodies read on: its own, so that a hostile pack
    or body never queues ahead of what the loop's default executor runs for every session
    (DNS learning)."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(JUDGES, thread_name_prefix="corral-git"))
    return _POOL[0]


if TYPE_CHECKING:
    from . import Client, Proxy


class PooledConnection(Protocol):
    """What the pool keeps: an Upstream, or the express lane's Origin (express.py)."""

    key: tuple[str, int]
    address: str
    session: str | None
    generation: int

    @property
    def reusable(self) -> bool: ...

    def close(self) -> None: ...


@dataclass
class Upstream:
    """An open connection to an origin, kept for the next request to the same place."""

    key: tuple[str, int]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    address: str
    session: str | None = None
    """The session it was dialled for (plain HTTP)."""
    generation: int = -1
    """Forward.generation when it was dialled: the policy its address was judged by."""

    def close(self) -> None:
        """Close it, and take the error it ends with (relay.settled)."""
        self.writer.close()
        settled(self.writer)

    @property
    def reusable(self) -> bool:
        """Open both ways, with nothing buffered past the last response: bytes an origin
        sent after a response would be read as the next request's answer (fails closed
        where the reader does not say what it holds)."""
        buffered = getattr(self.reader, "_buffer", None)
        return (not self.writer.is_closing() and not self.reader.at_eof()
                and self.reader.exception() is None and buffered is not None
                and not buffered)


class Forward:
    def __init__(self, proxy: Proxy):
        self.proxy = proxy
        self.config = proxy.config
        self.judging = asyncio.Semaphore(JUDGES)
        self.judging_session: dict[str | None, list] = {}
        """Per session, [its lock, pushes and bodies waiting or being read]: a session has
        one judged at a time, so it never holds both judges while another session waits."""
        self.held_total = 0
        self.held: dict[str | None, int] = {}
        """Bytes of request bodies held to be judged, per session (None: no session's)."""
        self.pool: Pool[PooledConnection] = Pool(self.config.kept_upstreams_per_session)
        """Idle upstream connections kept per (session, origin) between client connections,
        as this module's Upstreams or the express lane's Origins (each path turns the
        other's into its own when it takes one); emptied by every policy change (the
        address each reached was judged by the policy of its dial)."""
        self._sweep: asyncio.TimerHandle | None = None
        self.generation = 0
        """Counts policy changes: an upstream dialled under an earlier one is never reused,
        a request judged under an earlier one never sent on a reused upstream."""
        proxy.store.on_change(self.drop_kept)

    def hold(self, session: str | None, n: int, holding: list) -> None:
        """Count `n` bytes as held for `session` until the request ends (`holding`: what
        the request holds, given back by _request); HttpError 503 past the budgets."""
        mine = self.held.get(session, 0)
        if self.held_total + n > HELD_MAX or mine + n > HELD_MAX // 2:
            raise HttpError(503, "the filter holds as many request bodies to judge as it may "
                            "now; send this one again in a moment")
        self.held_total += n
        self.held[session] = mine + n
        holding.append((session, n))

    def release(self, holding: list) -> None:
        for session, n in holding:
            self.held_total -= n
            left = self.held[session] - n
            if left:
                self.held[session] = left
            else:
                del self.held[session]

    async def serve(self, client: Client, mode: Mode, upstream: Upstream | None = None,
                    first: bytes = b"", tunnel_event: dict | None = None,
                    opening: bool = True, parsed: Head | None = None) -> None:
        """Every request on the connection, until it closes or one ends it. In a tunnel,
        `upstream` is the tunnel's own connection (its owner closes it), `first` the byte the
        tunnel read to tell HTTP from TLS, and `tunnel_event` the CONNECT's decision. Else
        `upstream` is the one kept from the connection's earlier requests (express.py hands
        a connection over with it, and `opening` False once it served a request; `parsed`
        the head it read of a CONNECT, served first)."""
        in_tunnel = isinstance(mode, InTunnel)
        kept = upstream
        try:
            while True:
                try:
                    if parsed is not None:
                        head, parsed = parsed, None
                    else:
                        data = await (self._read_lines(client, first) if in_tunnel and opening
                                      else self._read_head(client, opening, first))
                        if data is None:
                            return
                        head = parse_request(data)
                except HttpError as exc:
                    if in_tunnel and opening and mode.inspected:
                        exc = HttpError(400, f"not HTTP/1.x inside the inspected TLS to "
                                        f"{mode.target} ({exc}): only HTTP/1.x can be "
                                        "inspected")
                        self._tunnel_refused(client, mode, tunnel_event, str(exc))
                    elif in_tunnel and opening:  # the tunnel's first bytes: not HTTP at all
                        exc = HttpError(400, f"neither TLS nor HTTP/1.x inside a tunnel to "
                                        f"{mode.target} ({exc}); other protocols need a tcp "
                                        "rule")
                        self._tunnel_refused(client, mode, tunnel_event, str(exc))
                    else:
                        self.proxy.error_event(client, exc)
                    client.writer.write(self.proxy.failed(exc.status, str(exc)))
                    return
                opening, first = False, b""
                try:
                    if head.start[0] == "CONNECT" and isinstance(mode, Explicit):
                        if kept is not None:  # the tunnel needs no other upstream
                            kept.close()
                            kept = None
                        await self.proxy.tunnels.connect(client, head)
                        return
                    keep, kept = await self._request(client, head, mode, kept)
                except Denied as denied:
                    if not denied.recorded:
                        session, _ = self.proxy.store.lookup(client.address)
                        kind = "connect" if head.start[0] == "CONNECT" else "http"
                        self.proxy.bus.decision(denied.decision, session=session,
                                                client=client.label, kind=kind,
                                                name=denied.target, port=None)
                    client.writer.write(self.proxy.refusal(denied))
                    if head.chunked or head.content_length:
                        await linger(client.reader, client.writer)
                    return
                except HttpError as exc:
                    self.proxy.error_event(client, exc)
                    client.writer.write(self.proxy.failed(exc.status, str(exc)))
                    if head.chunked or head.content_length:
                        await linger(client.reader, client.writer)
                    return
                if not keep:
                    return
        finally:
            if kept is not None and not in_tunnel:
                self._keep(client, kept)

    # -- upstream connections kept between client connections (pool.py) -------------------

    def _keep(self, client: Client, kept: Upstream) -> None:
        """Keep the upstream of a client connection that ended for the session's next
        request to its origin, if it may be reused; else close it."""
        session, _ = self.proxy.store.lookup(client.address)
        if session is None or not self.may_reuse(kept, session):
            kept.close()
            return
        for idle in self.pool.put(session, kept.key, kept, time.monotonic()):
            idle.close()
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.pool.idle + 0.05,
                                                                self._expire)

    def may_reuse(self, kept: PooledConnection, session: str | None) -> bool:
        """May a connection kept from an earlier request carry `session`'s next one: open
        with nothing unread (`reusable`), dialled for that session, under the policy in
        force (a change of policy moves `generation` on: its address is judged again).
        Both paths ask this (forward.py, express.py)."""
        return (kept.reusable and kept.generation == self.generation
                and kept.session == session)

    def _kept(self, session: str | None, key: tuple[str, int]) -> Upstream | None:
        """An open connection the session kept to `key`, as an Upstream, or None."""
        found = self.pooled(session, key)
        if found is not None and not isinstance(found, Upstream):
            found = found.streams()  # kept by the express lane (express.Origin)
        return found

    def pooled(self, session: str | None, key: tuple[str, int]) -> PooledConnection | None:
        """An open connection the session kept to `key`, as it was kept (an Upstream, or
        the express lane's Origin), or None."""
        if session is None:
            return None
        while True:
            found, idle = self.pool.take(session, key, time.monotonic())
            for connection in idle:
                connection.close()
            if found is None or found.reusable:  # the origin may have closed it meanwhile
                return found
            found.close()

    def _expire(self) -> None:
        self._sweep = None
        for idle in self.pool.expire(time.monotonic()):
            idle.close()
        due = self.pool.next_expiry()
        if due is not None:  # when the oldest outlives idle, not a whole idle from now
            self._sweep = asyncio.get_running_loop().call_later(
                max(due - time.monotonic(), 0) + 0.05, self._expire)

    def drop_kept(self) -> None:
        """Close every kept upstream (the policy changed, or the filter stops)."""
        self.generation += 1
        for idle in self.pool.clear():
            idle.close()

    def _tunnel_refused(self, client: Client, mode: InTunnel, tunnel_event, reason: str):
        session, _ = self.proxy.store.lookup(client.address)
        self.proxy.event(Decision(False, reason), client, session, "connect", mode.host,
                         mode.port, event_id=tunnel_event["id"] if tunnel_event else None)

    async def _read_lines(self, client: Client, first: bytes) -> bytes:
        """A tunnel's opening request head: its request line first, so that bytes that are
        not HTTP (an SSH banner, say) are refused at that line, not after `header_timeout`;
        then the rest in one read, as any head. Raises HttpError."""
        deadline = time.monotonic() + self.config.header_timeout
        reader = client.reader

        def left() -> float:
            return max(deadline - time.monotonic(), 0.001)

        try:
            line, empty = first + await within(reader.readuntil(b"\r\n"), left()), 0
            while line == b"\r\n":  # empty lines before the request line
                empty += 1
                if empty > MAX_EMPTY_LINES:
                    raise HttpError(400, f"more than {MAX_EMPTY_LINES} empty lines before "
                                    "the request line")
                line = await within(reader.readuntil(b"\r\n"), left())
            check_request_line(line[:-2])
            rest = await within(reader.readexactly(2), left())
            if rest != b"\r\n":  # fields follow: up to the empty line that ends them
                rest += await within(reader.readuntil(b"\r\n\r\n"), left())
            return self._bounded(line + rest)
        except asyncio.IncompleteReadError:
            raise ConnectionError("the client closed inside the tunnel") from None
        except asyncio.LimitOverrunError:
            raise self._too_large() from None
        except TimeoutError:
            raise HttpError(408, "request head not received in time") from None

    async def _read_head(self, client: Client, opening: bool, first: bytes) -> bytes | None:
        """A request head (leading empty lines dropped), None when the client hung up or sat
        idle between requests. Once a request has begun, its head must be complete within
        `header_timeout`. Raises HttpError."""
        reader = client.reader
        try:
            if not opening and not first:  # between requests: wait for the next one to begin
                try:
                    first = await within(reader.read(1), self.config.idle_timeout)
                except TimeoutError:
                    return None
                if not first:
                    return None
            data = first + await within(reader.readuntil(b"\r\n\r\n"),
                                        self.config.header_timeout)
            empty = 0
            while True:
                data, count = strip_empty_lines(data)
                empty += count
                if empty > MAX_EMPTY_LINES:
                    raise HttpError(400, f"more than {MAX_EMPTY_LINES} empty lines before "
                                    "the request line")
                if data:
                    return self._bounded(data)
                data = await within(reader.readuntil(b"\r\n\r\n"), self.config.header_timeout)
        except asyncio.IncompleteReadError:
            return None  # the client hung up, mid-head or between requests: nobody to answer
        except asyncio.LimitOverrunError:
            raise self._too_large() from None
        except TimeoutError:
            raise HttpError(408, "request head not received in time") from None

    def _bounded(self, head: bytes) -> bytes:
        """`head`, unless it is longer than `max_header_bytes`: a reader's limit lets the
        read that ends a head run past it by the separator's length, and a tunnel's first
        head is two reads. Raises HttpError 431."""
        if len(head) > self.config.max_header_bytes:
            raise self._too_large()
        return head

    def _too_large(self) -> HttpError:
        return HttpError(431, f"request head larger than {self.config.max_header_bytes} bytes")

    async def _request(self, client: Client, head, mode: Mode, kept: Upstream | None):
        """Route, judge, forward one request and its response. Returns (keep the client
        connection, the upstream connection to keep). Raises Denied or HttpError."""
        holding: list = []  # request bodies held to be judged, until the request is over
        try:
            return await self._judged(client, head, mode, kept, holding)
        finally:
            self.release(holding)

    async def _judged(self, client: Client, head, mode: Mode, kept: Upstream | None,
                      holding: list):
        proxy = self.proxy
        where = route(head, mode)
        if where.host.name == REQUEST_NAME and not isinstance(mode, InTunnel):
            return await self._agent_ask(client, head, where), kept
        if where.conflict is None:
            session, policy, decision = await proxy.judge(client, where.host, where.port)
        else:  # refused whatever a person says: never held, never a prompt, no advice to ask
            session, policy, decision = proxy.decide(client.address, where.host, where.port)
            if approvable(decision):  # no grant would let it through: no command to offer
                decision = decision._replace(hint="")
        # granted once on this connection: this request alone (a tunnel's grant is for the
        # tunnel's life), so the next one, to any host, is judged and held again
        key = (str(where.host), where.port)
        once_here = not isinstance(mode, InTunnel) and key in client.once
        try:
            return await self._judged_as(client, head, mode, kept, holding, where, session,
                                         policy, decision)
        finally:
            if once_here:
                client.once.discard(key)

    async def _judged_as(self, client: Client, head, mode: Mode, kept: Upstream | None,
                         holding: list, where, session, policy, decision):
        """Execute the request's plan (plan.py): each step it asks for, fed back, until its
        last: a refusal, or the request sent upstream."""
        in_tunnel = isinstance(mode, InTunnel)
        inspector = self.proxy.inspector
        judged_at = self.generation
        steps = plan(Request(
            head, where, session, policy, decision, self.proxy.credentials, in_tunnel,
            in_tunnel and mode.inspected, kept.key if kept is not None else None,
            inspector.config.scan_bytes if inspector is not None else SCAN_BYTES))
        step = next(steps)
        while True:
            if isinstance(step, ReadBody):
                step = steps.send(await self._read_body(client, session, step, holding))
            elif isinstance(step, OnJudgeThread):
                step = steps.send(await self.judged(session, step.work, *step.args))
            else:
                break
        if isinstance(step, Refuse):
            return await self._refuse(client, where, session, step), kept
        return await self._send(client, mode, kept, where, session, step, judged_at)

    async def _send(self, client: Client, mode: Mode, kept: Upstream | None, where,
                    session, send: Send, judged_at: int):
        """Send the request upstream (reusing the kept connection when the plan says so and
        it is still open), relay the response. Returns (keep the client connection, the
        upstream connection to keep)."""
        proxy, fields = self.proxy, send.event
        if send.upstream == KEPT and (not self.may_reuse(kept, session)
                                      or judged_at != self.generation):
            send = replace(send, upstream=OPEN)  # dialled under another policy: dial again
        if (send.upstream == OPEN and not isinstance(mode, InTunnel)
                and judged_at == self.generation):  # else Proxy.open judges it again
            # one the session kept from an earlier client connection to this origin, judged
            # by this policy when it was dialled (a change empties the pool)
            pooled = self._kept(session, (str(where.host), where.port))
            if pooled is not None:
                if kept is not None:
                    kept.close()
                kept, send = pooled, replace(send, upstream=KEPT)
        if send.upstream in (TUNNEL, KEPT):
            flow = proxy.track(client, session, "http", where.host, where.port, kept.address)
            event = proxy.event(send.decision, client, session, "http", where.host,
                                where.port, kept.address, event_id=flow.id, **fields)
        else:
            if kept is not None:
                kept.close()
                kept = None
            dialled_at = self.generation
            (up_r, up_w), event, flow = await proxy.open(client, where.host, where.port, "http",
                                                       where.target, **fields)
            kept = Upstream((str(where.host), where.port), up_r, up_w, event["address"],
                            session, dialled_at)
        counters = Counters()
        try:
            # a tunnel that serves HTTP holds the descriptors of a splice it does not use
            # (limits.py): a long response body may take them (relay.splice_exact)
            splice = isinstance(mode, InTunnel) and not mode.inspected
            keep = await self._exchange(client, send.head, where, kept, counters,
                                        send.attached, send.body, splice)
        except BaseException:
            if not isinstance(mode, InTunnel):  # half a message went up: never reuse it
                kept.close()
            raise
        finally:
            proxy.untrack(flow)
            proxy.closed(event, counters)
        keep_client, keep_upstream = keep
        if isinstance(mode, InTunnel):  # the tunnel has one upstream: it ends with it
            return keep_client and keep_upstream, kept
        if not keep_upstream:
            kept.close()
            kept = None
        return keep_client, kept

    async def resume(self, client: Client, mode: Mode, up: Upstream, head, counters: Counters,
                     flow, event: dict) -> None:
        """A request the express lane sent on `up` (`head`, as sent: its flow tracked and
        its decision recorded), whose response it hands over at the response's head: the
        response relayed from there as _exchange does, then the connection served on."""
        proxy = self.proxy
        try:
            try:
                keep_client, keep_upstream = await self._answer(client, head, up, counters,
                                                                (), False)
            except BaseException:
                up.close()  # half a message went up or came back: never reuse it
                raise
            finally:
                proxy.untrack(flow)
                proxy.closed(event, counters)
        except HttpError as exc:
            proxy.error_event(client, exc)
            client.writer.write(proxy.failed(exc.status, str(exc)))
            return
        if not keep_upstream:
            up.close()
            up = None
        if not keep_client:
            if up is not None:
                self._keep(client, up)
            return
        await self.serve(client, mode, up, opening=False)

    async def judged(self, session: str | None, work, *args):
        """`work(*args)` on a judge's thread, in the session's judge slot: how a push is
        read and judged, over HTTPS and over SSH (sshgate.py) alike, and a request body
        read (_read)."""
        async with self._judge_slot(session):  # on a pool of its own: an agent writes the pack
            done = asyncio.get_running_loop().run_in_executor(_judges(), work, *args)
            try:
                return await asyncio.shield(done)
            except asyncio.CancelledError:
                # the thread runs on: its slot (and the caller's budget) stay taken until
                # it is done, so that a cut call frees nothing it still holds
                await asyncio.wait([done])
                raise

    @contextlib.asynccontextmanager
    async def _judge_slot(self, session: str | None):
        """A judge for one push or body: one per session at a time, JUDGES in all, so that
        one session never holds every judge while another session's work waits."""
        share = self.judging_session.setdefault(session, [asyncio.Lock(), 0])
        share[1] += 1
        try:
            async with share[0], self.judging:
                yield
        finally:
            share[1] -= 1
            if not share[1]:
                del self.judging_session[session]

    async def _read_body(self, client: Client, session: str | None, step: ReadBody,
                         holding: list) -> bytes:
        """A body the plan reads whole to judge it, held (counted against the session's
        budget, given back by _request) until the request is over. Raises HttpError."""
        self.hold(session, step.hold, holding)
        if step.expects_continue:
            client.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            return await read_body(step.head, client.reader, step.limit,
                                   self.config.idle_timeout)
        except HttpError as exc:
            if exc.status == 413 and step.why:
                raise HttpError(413, f"{exc} {step.why}") from None
            raise

    async def _agent_ask(self, client: Client, head, where) -> bool:
        """An agent asking a person for a host (request.corral): answered here, in JSON, and
        the connection closed (it is never dialled, nor its body read)."""
        if head.start[0] not in ("GET", "POST"):
            status, answer = 405, {"error": "ask with GET (or POST) and a query"}
        else:
            status, answer = await self.proxy.agent_ask(client, where.path)
        client.writer.write(response(status, json.dumps(answer) + "\n",
                                     content_type="application/json",
                                     redactor=self.proxy.redactor))
        if head.chunked or head.content_length:  # a POST's body, never read: still coming
            await linger(client.reader, client.writer)
        else:
            await drain(client.writer, self.config.idle_timeout)
        return False

    async def _refuse(self, client: Client, where, session: str | None,
                      refusal: Refuse) -> bool:
        """Answer a request the plan refuses (after its event); whether the connection goes
        on (the plan says when HTTP allows: its body, if any, read already or read and
        dropped here). Nothing of it reached the upstream."""
        proxy = self.proxy
        if refusal.leak is not None:
            proxy.leaked(client, session, where.host, refusal.leak, refusal.decision)
        proxy.event(refusal.decision, client, session, refusal.kind, where.host, where.port,
                    **refusal.event)
        denied = Denied(refusal.decision, refusal.target, recorded=True)
        if refusal.ends:
            raise denied
        left, idle = refusal.discard, self.config.idle_timeout
        while left:
            data = await within(client.reader.read(min(left, CHUNK)), idle)
            if not data:
                raise ConnectionError("the client closed in the middle of a refused body")
            left -= len(data)
        client.writer.write(refusal.report if refusal.report is not None
                            else proxy.refusal(denied, refusal.keep))
        if refusal.unread:
            await linger(client.reader, client.writer)
        else:
            await drain(client.writer, idle)
        return refusal.keep

    async def _exchange(self, client: Client, head, where, up: Upstream, counters: Counters,
                        attached: tuple[bytes, ...] = (), body: bytes | None = None,
                        splice: bool = False) -> tuple[bool, bool]:
        """Send the request, relay the response. Returns (keep the client connection, keep
        the upstream connection). A response head that carries back a secret the request
        was given (`attached`) is not passed on (its body is not read for it). `body`: the
        request's body when it was read already (to be judged), sent with its length.
        `splice`: a long response body framed by length may be spliced."""
        idle = self.config.idle_timeout
        upgrade = websocket(head)
        # Expect: 100-continue is answered here, now that the request is allowed and the
        # upstream connected: the client sends its body, and the upstream never waits for it.
        expects = (head.get("expect") or "").lower() == "100-continue"
        if expects and body is None:  # a body read already had its 100 Continue
            client.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if body is not None:
            held = tuple((k, v) for k, v in head.headers
                         if k.lower() not in ("content-length", "transfer-encoding"))
            head = replace(head, headers=(*held, ("Content-Length", str(len(body)))))
            up.writer.write(outgoing(head, where, drop_expect=expects) + body)
            counters.add(len(body), True)
        else:
            up.writer.write(outgoing(head, where, drop_expect=expects, upgrade=upgrade))
            await copy_body(head, client.reader, up.writer, counters, True, idle)
        return await self._answer(client, head, up, counters, attached, upgrade, splice)

    async def _answer(self, client: Client, head, up: Upstream, counters: Counters,
                      attached: tuple[bytes, ...], upgrade: bool, splice: bool = False
                      ) -> tuple[bool, bool]:
        """Relay the response to `head` (sent on `up`), from its head on. Returns (keep the
        client connection, keep the upstream connection)."""
        idle = self.config.idle_timeout
        while True:
            try:
                data = await within(up.reader.readuntil(b"\r\n\r\n"), idle)
            except asyncio.LimitOverrunError:
                raise HttpError(502, "upstream response head too large") from None
            except asyncio.IncompleteReadError:
                raise HttpError(502, "upstream closed without a response") from None
            if len(data) > self.config.max_header_bytes:  # the limit, past by the separator
                raise HttpError(502, "upstream response head too large")
            if any(value in data for value in attached):
                raise HttpError(502, "the upstream's response head holds the secret attached "
                                "to the request: not passed on")
            reply = parse_response(data)
            status = int(reply.start[1])
            if 100 <= status < 200 and status != 101:
                client.writer.write(data)  # 100 Continue and friends pass through
                continue
            break
        client_close = wants_close(head, head.start[2])
        no_body, framed = framing(head.start[0], reply)
        if status == 101:
            if not upgrade:
                raise HttpError(502, "the upstream switched protocols unasked")
            refusal = switch_refusal(head, reply)
            if refusal is not None:  # not a switch: never raw relay (the upstream is dropped)
                raise HttpError(502, f"{refusal}: not relayed")
            # the frames are not inspected (the WebSocket's own protocol); relayed by the
            # streams, not spliced: a splice would take descriptors no cap counts
            client.writer.write(serialise_response(reply, keep=frozenset({"upgrade"})))
            await drain(client.writer, idle)
            await tunnel(client.reader, client.writer, up.reader, up.writer, counters, idle,
                         splice=False)
            return False, False
        close = client_close or not framed
        reply_head = serialise_response(reply, close=close)
        if no_body:
            client.writer.write(reply_head)
        elif framed:
            await copy_body(reply, up.reader, client.writer, counters, False, idle, reply_head,
                            up.writer if splice else None)
        else:
            client.writer.write(reply_head)
            await copy_until_eof(up.reader, client.writer, counters, idle)
        await drain(client.writer, idle)
        return not close, framed and not wants_close(reply, reply.start[0])
