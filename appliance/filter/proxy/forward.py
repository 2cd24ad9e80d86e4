"""Plain HTTP: the explicit proxy's absolute-form requests, the transparent port-80
listener, and HTTP inside CONNECT tunnels — one loop for all three, each request routed and
judged by the pipeline, re-serialised, and its body re-framed on the way (relay.copy_body),
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
from typing import TYPE_CHECKING

from appliance.policy import Decision
from appliance.policy.targets import Ambiguous
from appliance.sessionconfig import SCAN_BYTES

from ..approvals import REQUEST_NAME, approvable
from ..git import http as git
from ..http import (
    HttpError,
    check_request_line,
    parse_request,
    parse_response,
    serialise_response,
)
from ..relay import CHUNK, Counters, copy_body, copy_until_eof, drain, read_body, tunnel, within
from .content import codings
from .credentials import Leak
from .overrides import body_kinds, header_paths
from .pipeline import (
    MAX_EMPTY_LINES,
    Denied,
    Explicit,
    InTunnel,
    Mode,
    asked_methods,
    judge_asked,
    judge_request,
    keeps_after_refusal,
    outgoing,
    request_fields,
    response,
    route,
    strip_empty_lines,
    switch_refusal,
    wants_close,
    websocket,
)
from .reading import BodyReading, examine

ECHOING = frozenset({"TRACE", "TRACK"})
"""Methods whose response is the request itself."""


def _echoing(methods) -> str | None:
    """The first of `methods` (the request's own, then those it asks to be read as) whose
    response is the request itself."""
    return next((m for m in methods if m.upper() in ECHOING), None)
OFF_LOOP = 1 << 10
"""Bodies larger than this (or content-coded) are read (reading.examine) on a judge's
thread, in the session's judge slot: the readers cost up to ~0.4 µs a byte (a multipart
body of empty parts, a form of escaped names), so a body read on the loop costs it at most
about half a millisecond (DESIGN 10). At 64 KiB such a body held the loop 20-25 ms. (A
judge's thread still shares the interpreter: while one reads, each wake-up of the loop may
wait out the switch interval, 5 ms.)"""
HELD_MAX = 256 << 20
"""Request bodies held in memory to be judged (pushes, bodies read for leaks), all sessions
together; one session may hold half."""
JUDGES = 2
"""Pushes judged and bodies read (past OFF_LOOP) at once, each on a thread of the judges'
own pool."""
_POOL: list[ThreadPoolExecutor] = []


def _judges() -> ThreadPoolExecutor:
    """The pool pushes are judged and large bodies read on: its own, so that a hostile pack
    or body never queues ahead of what the loop's default executor runs for every session
    (DNS learning)."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(JUDGES, thread_name_prefix="corral-git"))
    return _POOL[0]


def judge_push(raw: bytes, encodings: tuple[str, ...], spec, session: str) -> git.Verdict:
    """Inflate (gzip) and judge a push, on a judge's thread."""
    try:
        return git.judge(git.decode_body(raw, list(encodings)), spec, session)
    except git.GitProtocolError as exc:
        return git.Verdict((), frozenset(), (), str(exc))

if TYPE_CHECKING:
    from . import Client, Proxy


@dataclass
class Upstream:
    """An open connection to an origin, kept for the next request to the same place."""

    key: tuple[str, int]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    address: str


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
                    first: bytes = b"", tunnel_event: dict | None = None) -> None:
        """Every request on the connection, until it closes or one ends it. In a tunnel,
        `upstream` is the tunnel's own connection (its owner closes it), `first` the byte the
        tunnel read to tell HTTP from TLS, and `tunnel_event` the CONNECT's decision."""
        in_tunnel = isinstance(mode, InTunnel)
        kept = upstream
        opening = True
        try:
            while True:
                try:
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
                            kept.writer.close()
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
                    return
                except HttpError as exc:
                    self.proxy.error_event(client, exc)
                    client.writer.write(self.proxy.failed(exc.status, str(exc)))
                    return
                if not keep:
                    return
        finally:
            if kept is not None and not in_tunnel:
                kept.writer.close()

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
            return line + rest
        except asyncio.IncompleteReadError:
            raise ConnectionError("the client closed inside the tunnel") from None
        except asyncio.LimitOverrunError:
            raise HttpError(431, f"request head larger than {self.config.max_header_bytes} "
                            "bytes") from None
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
                    return data
                data = await within(reader.readuntil(b"\r\n\r\n"), self.config.header_timeout)
        except asyncio.IncompleteReadError:
            return None  # the client hung up, mid-head or between requests: nobody to answer
        except asyncio.LimitOverrunError:
            raise HttpError(431, f"request head larger than {self.config.max_header_bytes} "
                            "bytes") from None
        except TimeoutError:
            raise HttpError(408, "request head not received in time") from None

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
        proxy = self.proxy
        if decision.allowed and where.conflict is not None:
            decision = Decision(False, where.conflict)
        if not decision.allowed:
            proxy.event(decision, client, session, "http", where.host, where.port)
            raise Denied(decision, where.target, recorded=True)
        inspection = policy.inspection(where.host)
        fields = request_fields(where, head) if inspection is not None else {}
        ended = isinstance(mode, InTunnel) and mode.inspected  # TLS the filter ended
        # what the head asks to be read as: read once (each reading of a long query costs
        # the loop), for the host's request rules and for the secrets attached
        asked = asked_methods(head, where.path) if (
            (inspection is not None and inspection.judges)
            or (ended and proxy.credentials.bound(where.host))) else []
        decision = judge_request(inspection, head, where, decision, asked)
        if not decision.allowed:  # by the host's request rules: the connection may go on
            proxy.event(decision, client, session, "http", where.host, where.port, **fields)
            target = f"{fields['method']} {fields['path']} on {where.target}"
            return await self._refuse(client, head, Denied(decision, target)), kept
        read = inspection is not None or ended  # a secret's host is read without a table too
        if read:  # a value the agent holds, written into a field (before any is attached)
            leaked = proxy.credentials.leaks(session).in_fields(head.headers)
            if leaked is not None:
                return await self._leaked(client, head, where, session, fields, leaked), kept
        paths = header_paths(head)
        try:
            applied = proxy.credentials.apply(session, where.host, head.start[1], head.headers,
                                              ended, head.start[0],
                                              tuple(m for _, m in asked) if ended else (),
                                              tuple(p for _, p in paths) if ended else ())
        except Leak as leak:  # nothing of it leaves; the connection may go on
            decision = proxy.leaked(client, session, where.host, leak)
            proxy.event(decision, client, session, "http", where.host, where.port, **fields)
            return await self._refuse(client, head, Denied(decision, where.target)), kept
        attached: tuple[bytes, ...] = ()
        if applied.used:
            echoing = _echoing([head.start[0], *(m for _, m in asked)])
            if echoing:
                decision = Decision(False, f"{echoing} sends the request back: never with "
                                    f"a secret attached ({', '.join(applied.used)})")
                proxy.event(decision, client, session, "http", where.host, where.port, **fields)
                return await self._refuse(client, head, Denied(decision, where.target)), kept
            head = replace(head, headers=applied.headers)
            fields = {**fields, "secrets": list(applied.used)}
            attached = proxy.credentials.values(applied.used)
        body: bytes | None = None  # read whole here when it must be judged before it goes
        access = policy.git(where.host) if inspection is not None else None
        if access is not None:
            refused, body = await self._git(client, head, where, access, session, fields,
                                            holding)
            if refused is not None:
                return refused, kept
        if read:
            # a secret attached is judged by every method the body asks for too: its request
            # patterns, and an echo (TRACE) that would hand its value back
            attached_any = bool(applied.used)
            reading, body = await self._read(client, head, inspection, session, body, holding,
                                             attached_any)
            if reading.finding is not None:
                return await self._leaked(client, head, where, session, fields,
                                          reading.finding, body is not None), kept
            refusal = Decision(False, reading.refusal) if reading.refusal else None
            if refusal is None and reading.methods:  # judged with what the head asks for
                methods = [*asked, *reading.methods]
                refusal = judge_asked(inspection, head, where, methods, paths) if (
                    inspection is not None) else None
                unpermitted = proxy.credentials.unpermitted(
                    applied.used, [m for _, m in methods], head.start[1],
                    [p for _, p in paths])
                if refusal is None and unpermitted:
                    refusal = Decision(False, unpermitted)
                echoing = _echoing([m for _, m in reading.methods]) if applied.used else None
                if refusal is None and echoing:
                    refusal = Decision(False, f"the body asks for {echoing}, which sends the "
                                       "request back: never with a secret attached "
                                       f"({', '.join(applied.used)})")
            if refusal is not None:
                proxy.event(refusal, client, session, "http", where.host, where.port, **fields)
                return await self._refuse(client, head, Denied(refusal, where.target),
                                          read=body is not None), kept
        key = (str(where.host), where.port)
        if isinstance(mode, InTunnel) or (
                kept is not None and kept.key == key and not kept.reader.at_eof()):
            flow = proxy.track(client, session, "http", where.host, where.port, kept.address)
            event = proxy.event(decision, client, session, "http", where.host, where.port,
                                kept.address, event_id=flow.id, **fields)
        else:
            if kept is not None:
                kept.writer.close()
                kept = None
            up_r, up_w, event, flow = await proxy.open(client, where.host, where.port, "http",
                                                       where.target, **fields)
            kept = Upstream(key, up_r, up_w, event["address"])
        counters = Counters()
        try:
            keep = await self._exchange(client, head, where, kept, counters, attached, body)
        except BaseException:
            if not isinstance(mode, InTunnel):  # half a message went up: never reuse it
                kept.writer.close()
            raise
        finally:
            proxy.untrack(flow)
            proxy.closed(event, counters)
        keep_client, keep_upstream = keep
        if isinstance(mode, InTunnel):  # the tunnel has one upstream: it ends with it
            return keep_client and keep_upstream, kept
        if not keep_upstream:
            kept.writer.close()
            kept = None
        return keep_client, kept

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

    async def _git(self, client: Client, head, where, access, session: str | None,
                   fields: dict, holding: list):
        """A request to a host a [[git]] table names: (None, None) when it is not git's or
        may go on as sent; (None, body) for a push that may go on (its body read here to be
        judged: send it); (keep the connection, None) when it was refused and answered.
        What it holds in memory is added to `holding` (the caller gives it back)."""
        proxy, host = self.proxy, where.host

        async def refuse(reason: str, hint: str = "", kind: str = "http"):
            decision = Decision(False, reason, hint=hint)
            proxy.event(decision, client, session, kind, host, where.port, **fields)
            return await self._refuse(client, head, Denied(decision, where.target)), None

        try:
            call = git.classify(where.path)
        except Ambiguous as exc:
            return await refuse(f"a request to {host} (a [[git]] host) that servers read in "
                                f"different ways: {exc}")
        method = head.start[0]
        if method in git.WEBDAV:  # MOVE and COPY write where a header says, not the target
            return await refuse(f"{method} on {host} (a [[git]] host): WebDAV, which git "
                                "http-push uses to move refs unread; corral confines git's "
                                "smart protocol (git push over HTTPS)")
        if call is None:
            repo = git.bare_file(where.path) if method in ("PUT", "DELETE") else None
            if repo is None:
                return None, None
            return await refuse(f"{method} on {where.path[:100]!r}: the files of a bare "
                                f"repository ({repo[:100]!r}) on {host}, a [[git]] host, are "
                                "written only by git push over the smart protocol")
        spec = access.repository(call.repo)
        if spec is None:
            return await refuse(
                f"git repository {call.repo[:100]!r} on {host} is not listed (listed: "
                f"{access.listed()})", f'add "{call.repo[:100]}" to repos of the [[git]] '
                f"table for {host} in corral.toml")
        reads = ("GET", "HEAD") if call.discovery or call.service == git.OTHER else ("POST",)
        if call.service == git.OTHER and method == "POST" and git.lfs_batch(where.path):
            return None, None  # LFS asks what to fetch (or upload: refused where it goes)
        if method not in reads:  # WebDAV on git's own paths would move refs unread
            return await refuse(f"{method[:20]} on git repository {call.repo[:100]!r}: corral "
                                "confines git's smart protocol (git push over HTTPS) and "
                                "refuses other writes (WebDAV, git http-push, LFS uploads)")
        if call.service != git.RECEIVE or call.discovery:
            return None, None
        if session is None:
            return await refuse("a git push from an address no session holds")
        if body_kinds(head):  # its body is read for refs only, never for a _method in it
            return await refuse(f"a push to {call.repo[:100]!r} whose Content-Type is not "
                                "git's (application/x-git-receive-pack-request): servers "
                                "read a form, multipart or JSON body (or one with no type) "
                                "for a method override, which a push's body is not judged "
                                "for")
        if (head.content_length or 0) > git.MAX_PUSH:
            raise HttpError(413, f"a push of {head.content_length} bytes; the filter holds at "
                            f"most {git.MAX_PUSH} to judge one")
        self.hold(session, head.content_length or git.MAX_PUSH, holding)
        if (head.get("expect") or "").lower() == "100-continue":
            client.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        raw = await read_body(head, client.reader, git.MAX_PUSH, self.config.idle_timeout)
        verdict = await self.judged(session, judge_push, raw,
                                    tuple(head.get_all("content-encoding")), spec, session)
        if verdict.allowed:
            return None, raw
        decision = Decision(False, verdict.reason[:500],
                            hint=git.hint(verdict, spec, session, host))
        proxy.event(decision, client, session, "git", host, where.port, **fields)
        keep = not wants_close(head, head.start[2])
        if verdict.commands and not verdict.reportable:  # it would read a 200 as success
            client.writer.write(self.proxy.refusal(Denied(decision, where.target), keep))
        else:
            answer = git.report(verdict)
            client.writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/x-git-receive-pack-result\r\n"
                b"Cache-Control: no-cache\r\nContent-Length: %d\r\n%s\r\n%s" % (
                    len(answer), b"" if keep else b"Connection: close\r\n", answer))
        await drain(client.writer, self.config.idle_timeout)
        return keep, None

    async def _leaked(self, client: Client, head, where, session: str | None, fields: dict,
                      found, read: bool = False) -> bool:
        """Refuse a request that carries a leak out (leaks.py): an event of kind `leak`
        naming the detector and where, never the value."""
        decision = Decision(False, found.reason)
        self.proxy.event(decision, client, session, "leak", where.host, where.port, **fields,
                         detector=found.detector)
        return await self._refuse(client, head, Denied(decision, where.target), read=read)

    async def _read(self, client: Client, head, inspection, session: str | None,
                    body: bytes | None, holding: list, attached_any: bool = False
                    ) -> tuple[BodyReading, bytes | None]:
        """Read what a request to an inspected host carries out (reading.py): (what was
        found, the body if it has been read whole). The target is always scanned for leaks;
        the body is read whole when it is scanned (unless the host says `scan = false`) or
        may carry a method override its host's rules or a secret attached to it
        (`attached_any`) would judge, and was not read already (a push on a
        [[git]] host: its pack is compressed, judged by its refs). Raises HttpError for a
        body too large to hold."""
        leaks = self.proxy.credentials.leaks(session)
        found = leaks.scan(head.start[1].encode("latin-1", "replace"), "the target")
        if found is not None or body is not None or not (head.chunked or head.content_length):
            return BodyReading(finding=found), body
        scanned = inspection is None or inspection.scanned
        names = attached_any or (inspection is not None and inspection.names_methods)
        methods = names and bool(body_kinds(head))
        if not scanned and not methods:
            return BodyReading(), None
        inspector = self.proxy.inspector
        limit = inspector.config.scan_bytes if inspector is not None else SCAN_BYTES
        why = ("for leaks; a host that takes bulk uploads says scan = false in its [[inspect]] "
               "table") if scanned else (
               "to find a method override (its type can carry one, and the host's request "
               "rules or a secret attached to it name methods)")
        if (head.content_length or 0) > limit:  # before a 100 Continue sends it on its way
            raise HttpError(413, f"request body of {head.content_length} bytes; the filter "
                            f"reads at most {limit} {why}")
        self.hold(session, head.content_length or limit, holding)
        if (head.get("expect") or "").lower() == "100-continue":
            client.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            body = await read_body(head, client.reader, limit, self.config.idle_timeout)
        except HttpError as exc:
            if exc.status == 413:
                raise HttpError(413, f"{exc} {why}") from None
            raise
        args = (body, head, leaks if scanned else None, methods)
        if len(body) > OFF_LOOP or codings(head):  # parsing, scanning or inflating a body
            return await self.judged(session, examine, *args), body  # of any size: not here
        return examine(*args), body

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
        await drain(client.writer, self.config.idle_timeout)
        return False

    async def _refuse(self, client: Client, head, denied: Denied, read: bool = False) -> bool:
        """Answer a request its host's request rules refuse; whether the connection goes on.
        It does when HTTP allows: not closing, no body waiting on 100 Continue, and a body
        (if any) small enough to read and drop (or `read` already). Nothing of it reached
        the upstream."""
        if read:
            keep = not wants_close(head, head.start[2])
            client.writer.write(self.proxy.refusal(denied, keep))
            await drain(client.writer, self.config.idle_timeout)
            return keep
        keep = keeps_after_refusal(head)
        if keep:
            left, idle = head.content_length or 0, self.config.idle_timeout
            while left:
                data = await within(client.reader.read(min(left, CHUNK)), idle)
                if not data:
                    raise ConnectionError("the client closed in the middle of a refused body")
                left -= len(data)
        client.writer.write(self.proxy.refusal(denied, keep))
        await drain(client.writer, self.config.idle_timeout)
        return keep

    async def _exchange(self, client: Client, head, where, up: Upstream, counters: Counters,
                        attached: tuple[bytes, ...] = (), body: bytes | None = None
                        ) -> tuple[bool, bool]:
        """Send the request, relay the response. Returns (keep the client connection, keep
        the upstream connection). A response head that carries back a secret the request
        was given (`attached`) is not passed on (its body is not read for it). `body`: the
        request's body when it was read already (to be judged), sent with its length."""
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
        while True:
            try:
                data = await within(up.reader.readuntil(b"\r\n\r\n"), idle)
            except asyncio.LimitOverrunError:
                raise HttpError(502, "upstream response head too large") from None
            except asyncio.IncompleteReadError:
                raise HttpError(502, "upstream closed without a response") from None
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
        no_body = head.start[0] == "HEAD" or status in (204, 304)
        framed = no_body or reply.chunked or reply.content_length is not None
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
            await copy_body(reply, up.reader, client.writer, counters, False, idle, reply_head)
        else:
            client.writer.write(reply_head)
            await copy_until_eof(up.reader, client.writer, counters, idle)
        await drain(client.writer, idle)
        return not close, framed and not wants_close(reply, reply.start[0])
