"""The HTTP proxy: explicit (CONNECT, absolute-form HTTP) and transparent (Host, SNI).

Every connection is decided by name — CONNECT target, absolute URI, Host header or TLS SNI,
never the IP a client aimed at — then resolved by the appliance's own resolver, each
address checked against the blocked ranges, and exactly that checked address dialled.
Denials are answered (403 + X-Corral-Deny, or a TLS access_denied alert), never left to hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass

from appliance.policy import HOST_NAME, Decision, Host, HostNameError, Policy, parse_host

from .config import ProxyConfig
from .events import EventBus
from .http import (
    HOP_BY_HOP,
    Head,
    HttpError,
    parse_absolute,
    parse_authority,
    parse_request,
    parse_response,
    serialise_request,
    serialise_response,
)
from .relay import (
    Counters,
    copy_body,
    copy_until_eof,
    original_port,
    tunnel,
    within,
)
from .resolver import Resolver, UpstreamError
from .sni import TlsError, looks_like_tls, parse_client_hello
from .store import PolicyStore

log = logging.getLogger(__name__)

# TLS alert record: fatal (2), access_denied (49). curl prints "tlsv1 alert access denied".
TLS_ACCESS_DENIED = bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 49])
_UNSAFE = re.compile(r"[^\x20-\x7e]")
_METHOD_START = re.compile(rb"^[A-Z]+(?: |$)")  # GET /, POST , CONNE(CT): maybe HTTP
_EVENT_KEYS = ("id", "session", "client", "kind", "name", "port", "address", "verdict",
               "reason", "rule", "layer")


@dataclass
class Client:
    """One client connection and who it belongs to."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    address: str
    port: int

    @property
    def label(self) -> str:
        return f"{self.address}:{self.port}"


class Denied(Exception):
    """A decision that ends the request; carries what to tell the client."""

    def __init__(self, decision: Decision, target: str, status: int = 403,
                 recorded: bool = False):
        super().__init__(decision.reason)
        self.decision, self.target, self.status = decision, target, status
        self.recorded = recorded
        """Whether an event already says so; the edge records the ones that are not."""


def response(status: int, reason: str, body: str, extra: dict[str, str] | None = None) -> bytes:
    payload = body.encode()
    lines = [f"HTTP/1.1 {status} {reason}", "Content-Type: text/plain; charset=utf-8",
             f"Content-Length: {len(payload)}", "Connection: close"]
    lines += [f"{k}: {_UNSAFE.sub('?', v)}" for k, v in (extra or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


def deny_response(denied: Denied) -> bytes:
    d = denied.decision
    body = f"corral: {denied.target} denied: {d.reason}."
    if d.hint:
        body += f" To allow it: {d.hint}"
    status, reason = (403, "Forbidden") if denied.status == 403 else (denied.status, "Bad Gateway")
    header = "X-Corral-Deny" if denied.status == 403 else "X-Corral-Error"
    return response(status, reason, body + "\n", {header: d.reason})


_REASONS = {400: "Bad Request", 405: "Method Not Allowed", 431: "Request Header Fields Too Large",
            501: "Not Implemented", 502: "Bad Gateway", 504: "Gateway Timeout",
            505: "HTTP Version Not Supported"}


def error_response(status: int, message: str) -> bytes:
    return response(status, _REASONS.get(status, "Error"), f"corral: {message}\n",
                    {"X-Corral-Error": message})


class Proxy:
    def __init__(self, store: PolicyStore, resolver: Resolver, bus: EventBus,
                 config: ProxyConfig, gateway=None):
        self.store, self.resolver, self.bus, self.config = store, resolver, bus, config
        self.gateway = gateway
        self.active = 0
        self.stats = {"connections": 0, "rejected_over_limit": 0}

    # -- listeners -----------------------------------------------------------------------

    async def serve_explicit(self, reader, writer) -> None:
        await self._serve(reader, writer, self._http_loop, transparent_port=None)

    async def serve_transparent_http(self, reader, writer) -> None:
        await self._serve(reader, writer, self._http_loop, transparent_port=80)

    async def serve_transparent_tls(self, reader, writer) -> None:
        await self._serve(reader, writer, self._tls, transparent_port=443)

    async def _serve(self, reader, writer, handler, transparent_port) -> None:
        peer = writer.get_extra_info("peername") or ("?", 0)
        client = Client(reader, writer, peer[0], peer[1])
        if self.active >= self.config.max_connections:
            self.stats["rejected_over_limit"] += 1
            writer.transport.abort()
            return
        self.active += 1
        self.stats["connections"] += 1
        try:
            port = original_port(writer, transparent_port) if transparent_port else None
            await handler(client, port)
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass
        except Exception:  # one broken connection must never take the listener down
            log.exception("proxy: connection from %s failed", client.label)
        finally:
            self.active -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    # -- common steps ----------------------------------------------------------------------

    async def _read_head(self, client: Client, first: bool) -> bytes | None:
        """A request head, None on a clean close before one started. Raises HttpError."""
        timeout = self.config.header_timeout if first else self.config.idle_timeout
        try:
            return await within(client.reader.readuntil(b"\r\n\r\n"), timeout)
        except asyncio.IncompleteReadError:
            return None  # the client hung up, mid-head or between requests: nobody to answer
        except asyncio.LimitOverrunError:
            raise HttpError(431, f"request head larger than {self.config.max_header_bytes} "
                            "bytes") from None
        except TimeoutError:
            if first:
                raise HttpError(408, "request head not received in time") from None
            return None

    def _decide(self, client: Client, host: Host, port: int):
        """(session, policy, decision) under the policy in force right now."""
        session, policy = self.store.lookup(client.address)
        if host.name == HOST_NAME:
            return session, policy, policy.decide_host_port(port)
        return session, policy, policy.decide_http(host, port)

    async def _dial(self, policy: Policy, host: Host, port: int, target: str):
        """Resolve, check each address, connect to the first that is allowed and answers."""
        if host.name == HOST_NAME:
            if self.gateway is None:
                raise Denied(Decision(False, "no [host] gateway configured"), target)
            candidates = [self.gateway]
        elif host.address is not None:
            candidates = [host.address]
        else:
            try:
                candidates = await self.resolver.addresses(host.name)
            except UpstreamError as exc:
                reason = f"cannot resolve {host}: {exc}"
                raise Denied(Decision(False, reason), target, 502) from None
            if not candidates:
                raise Denied(Decision(False, f"{host} has no address"), target, 502)
        refusal, failure = None, None
        for address in candidates:
            if host.name != HOST_NAME:
                check = policy.decide_address(address, host)
                if not check.allowed:
                    refusal = refusal or check
                    continue
            try:
                up_r, up_w = await within(
                    asyncio.open_connection(str(address), port, limit=self.config.max_header_bytes),
                    self.config.connect_timeout)
            except (OSError, TimeoutError) as exc:
                failure = f"connect to {address}:{port} failed: {exc or 'timed out'}"
                continue
            return up_r, up_w, str(address)
        if failure is not None:
            raise Denied(Decision(False, failure), target, 502)
        raise Denied(refusal, target)

    def _error_event(self, client: Client, exc: HttpError) -> None:
        """Requests refused as malformed are visible too (verdict "error")."""
        session, _ = self.store.lookup(client.address)
        self.bus.emit({"session": session, "client": client.label, "kind": "http", "name": None,
                       "verdict": "error", "reason": f"{exc.status}: {exc}"[:200]})

    def _event(self, decision, client, session, kind, host, port, address=None, **extra):
        return self.bus.decision(decision, session=session, client=client.label, kind=kind,
                                 name=str(host), port=port, address=address, **extra)

    def _closed(self, opened: dict, counters: Counters) -> None:
        """The second event of an allowed flow: same id, with bytes and duration."""
        self.bus.emit({**{k: opened[k] for k in _EVENT_KEYS}, "ts": round(time.time(), 6),
                       "closed": True, "up": counters.up, "down": counters.down,
                       "duration": counters.duration()})

    async def _open(self, client: Client, host: Host, port: int, kind: str, target: str):
        """Decide and dial; emit the decision event. Returns (up_r, up_w, event)."""
        session, policy, decision = self._decide(client, host, port)
        if not decision.allowed:
            self._event(decision, client, session, kind, host, port)
            raise Denied(decision, target, recorded=True)
        try:
            up_r, up_w, address = await self._dial(policy, host, port, target)
        except Denied as denied:
            verdict = "deny" if denied.status == 403 else "error"
            self._event(denied.decision, client, session, kind, host, port, verdict=verdict)
            denied.recorded = True
            raise
        event = self._event(decision, client, session, kind, host, port, address)
        return up_r, up_w, event

    # -- HTTP (explicit and transparent port 80) -------------------------------------------

    async def _http_loop(self, client: Client, transparent_port: int | None) -> None:
        upstream = None  # (key, reader, writer) kept for keep-alive to the same origin
        first = True
        try:
            while True:
                try:
                    data = await self._read_head(client, first)
                    if data is None:
                        return
                    head = parse_request(data)
                except HttpError as exc:
                    self._error_event(client, exc)
                    client.writer.write(error_response(exc.status, str(exc)))
                    return
                first = False
                try:
                    if head.start[0] == "CONNECT":
                        if transparent_port is not None:
                            raise HttpError(405, "CONNECT on a transparent listener")
                        await self._connect(client, head)
                        return
                    keep, upstream = await self._request(client, head, transparent_port, upstream)
                except Denied as denied:
                    if not denied.recorded:
                        session, _ = self.store.lookup(client.address)
                        self.bus.decision(denied.decision, session=session, client=client.label,
                                          kind="http", name=denied.target, port=None)
                    client.writer.write(deny_response(denied))
                    return
                except HttpError as exc:
                    self._error_event(client, exc)
                    client.writer.write(error_response(exc.status, str(exc)))
                    return
                if not keep:
                    return
        finally:
            if upstream is not None:
                upstream[2].close()

    def _target(self, head: Head, transparent_port: int | None) -> tuple[Host, int, str]:
        """Host, port and origin-form path, with the Host header checked against the URI."""
        target = head.start[1]
        host_header = head.get("host")
        origin_form = target.startswith("/")
        if origin_form or (transparent_port is not None and not target.startswith("http")):
            if transparent_port is None:
                raise HttpError(400, "origin-form request sent to the proxy port; "
                                "set http_proxy or use an absolute URI")
            if not host_header:
                raise HttpError(400, "no Host header: cannot tell where the request goes")
            name, port = parse_authority(host_header, transparent_port)
            if port != transparent_port:
                raise Denied(Decision(False, f"Host header port {port} differs from the "
                                      f"connection's port {transparent_port}"), host_header)
            path = target
        else:
            parsed = parse_absolute(target)
            name, port, path = parsed.host, parsed.port, parsed.path
            if host_header is not None:
                h_name, h_port = parse_authority(host_header, 80)
                if _host(h_name) != _host(name) or h_port != port:
                    raise Denied(Decision(False, f"Host header {host_header!r} differs from the "
                                          f"request target {name}:{port}"), f"{name}:{port}")
        return _host(name), port, path

    async def _request(self, client: Client, head: Head, transparent_port, upstream):
        host, port, path = self._target(head, transparent_port)
        target = f"{host}:{port}"
        key = (str(host), port)
        if upstream is not None and upstream[0] == key and not upstream[1].at_eof():
            session, _, decision = self._decide(client, host, port)
            if not decision.allowed:  # the policy may have changed since the last request
                self._event(decision, client, session, "http", host, port)
                raise Denied(decision, target, recorded=True)
            up_r, up_w = upstream[1], upstream[2]
            event = self._event(decision, client, session, "http", host, port,
                                up_w.get_extra_info("peername")[0])
        else:
            if upstream is not None:
                upstream[2].close()
                upstream = None
            up_r, up_w, event = await self._open(client, host, port, "http", target)
            upstream = (key, up_r, up_w)
        counters = Counters()
        idle = self.config.idle_timeout
        upgrade = "upgrade" in head.tokens("connection") and head.get("upgrade")
        keep_fields = frozenset({"upgrade"}) if upgrade else frozenset()
        # Expect: 100-continue is answered here, now that the request is allowed and the
        # upstream connected: the client sends its body, and the upstream never waits for it.
        expects = (head.get("expect") or "").lower() == "100-continue"
        drop = HOP_BY_HOP | {"expect"} if expects else HOP_BY_HOP
        outgoing = serialise_request(head, path, drop=drop, keep=keep_fields)
        if expects:
            client.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if head.get("host") is None:
            outgoing = outgoing[:-2] + f"Host: {target}\r\n\r\n".encode()
        try:
            up_w.write(outgoing)
            await copy_body(head, client.reader, up_w, counters, True, idle)
            while True:
                try:
                    data = await within(up_r.readuntil(b"\r\n\r\n"), idle)
                except asyncio.LimitOverrunError:
                    raise HttpError(502, "upstream response head too large") from None
                except asyncio.IncompleteReadError:
                    raise HttpError(502, "upstream closed without a response") from None
                reply = parse_response(data)
                status = int(reply.start[1])
                if 100 <= status < 200 and status != 101:
                    client.writer.write(data)  # 100 Continue and friends pass through
                    continue
                break
            client_close = _wants_close(head, head.start[2])
            no_body = head.start[0] == "HEAD" or status in (204, 304)
            framed = no_body or reply.chunked or reply.content_length is not None
            if status == 101 and upgrade:
                client.writer.write(serialise_response(reply, keep=frozenset({"upgrade"})))
                await client.writer.drain()
                await tunnel(client.reader, client.writer, up_r, up_w, counters, idle)
                return False, upstream
            close = client_close or not framed
            reply_head = serialise_response(reply, close=close)
            if no_body:
                client.writer.write(reply_head)
            elif framed:
                await copy_body(reply, up_r, client.writer, counters, False, idle, reply_head)
            else:
                client.writer.write(reply_head)
                await copy_until_eof(up_r, client.writer, counters, idle)
            await client.writer.drain()
            if _wants_close(reply, reply.start[0]) or not framed:
                upstream[2].close()
                upstream = None
            return not close, upstream
        finally:
            self._closed(event, counters)

    # -- CONNECT ---------------------------------------------------------------------------

    async def _connect(self, client: Client, head: Head) -> None:
        name, port = parse_authority(head.start[1], None)
        host = _host(name)
        target = f"{host}:{port}"
        up_r, up_w, event = await self._open(client, host, port, "connect", target)
        counters = Counters()
        try:
            client.writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await client.writer.drain()
            try:
                await self._inspect_tunnel(client, host, port, up_w, counters)
            except Denied as denied:
                self._event(denied.decision, client, event["session"], "connect", host, port,
                            event["address"], event_id=event["id"])
                # Answer in the protocol the client is speaking inside the tunnel.
                client.writer.write(TLS_ACCESS_DENIED if denied.target == "tls"
                                    else deny_response(denied))
                return
            await tunnel(client.reader, client.writer, up_r, up_w, counters,
                         self.config.idle_timeout)
        finally:
            up_w.close()
            self._closed(event, counters)

    async def _inspect_tunnel(self, client: Client, host: Host, port: int, up_w,
                              counters: Counters) -> None:
        """Look at the first bytes inside a tunnel: a ClientHello's SNI must match the CONNECT
        host (no domain fronting); a plain HTTP request inside is judged on its own target
        (no relayed CONNECT, no Host smuggling). Server-speaks-first protocols are not held:
        if the client says nothing in time, the tunnel opens without inspection."""
        buf = bytearray()
        deadline = time.monotonic() + self.config.header_timeout
        while len(buf) < 5:
            try:
                more = await within(client.reader.read(5 - len(buf)),
                                              deadline - time.monotonic())
            except TimeoutError:
                more = b""
            if not more:
                break
            buf += more
        if not buf:
            return
        if looks_like_tls(buf):
            hello = await self._read_hello(client, buf)
            if hello.sni is not None and (host.name is None or hello.sni != host.name):
                raise Denied(Decision(False, f"TLS SNI {hello.sni} differs from CONNECT host "
                                      f"{host} (domain fronting)"), "tls")
        elif _METHOD_START.match(bytes(buf)):
            try:
                rest = await within(client.reader.readuntil(b"\r\n\r\n"),
                                              self.config.header_timeout)
                inner = parse_request(bytes(buf) + rest)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                    HttpError) as exc:
                raise Denied(Decision(False, f"unreadable HTTP request inside tunnel: {exc}"),
                             f"{host}:{port}") from None
            buf += rest
            self._check_inner(client, inner, host, port)
        up_w.write(bytes(buf))
        counters.add(len(buf), upward=True)

    def _check_inner(self, client: Client, inner: Head, host: Host, port: int) -> None:
        if inner.start[0] == "CONNECT":
            name, inner_port = parse_authority(inner.start[1], None)
            inner_host = _host(name)
            _, _, decision = self._decide(client, inner_host, inner_port)
            if not decision.allowed:
                raise Denied(Decision(False, f"CONNECT inside a tunnel to {inner_host}:"
                                      f"{inner_port}: {decision.reason}", None, decision.hint),
                             f"{inner_host}:{inner_port}")
            return
        host_header = inner.get("host")
        if host_header:
            h_name, _ = parse_authority(host_header, port)
            if _host(h_name) != host:
                raise Denied(Decision(False, f"Host header {host_header!r} inside the tunnel "
                                      f"differs from CONNECT host {host}"), f"{host}:{port}")

    async def _read_hello(self, client: Client, buf: bytearray):
        """Read until `buf` holds a whole ClientHello. Raises Denied (target "tls")."""
        deadline = time.monotonic() + self.config.header_timeout
        while True:
            try:
                hello = parse_client_hello(bytes(buf))
            except TlsError as exc:
                raise Denied(Decision(False, f"bad TLS ClientHello: {exc}"), "tls") from None
            if hello is not None:
                return hello
            try:
                more = await within(client.reader.read(16384),
                                              max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                raise Denied(Decision(False, "TLS ClientHello not received in time"),
                             "tls") from None
            if not more:
                raise ConnectionError("client closed during the ClientHello")
            buf += more

    # -- transparent TLS (port 443) --------------------------------------------------------

    async def _tls(self, client: Client, port: int) -> None:
        buf = bytearray()
        try:
            hello = await self._read_hello(client, buf)
            if hello.sni is None:
                raise Denied(Decision(False, "TLS without SNI: cannot tell where it goes"), "tls")
        except Denied as denied:  # not decided by name: no event yet, so say why here
            session, _ = self.store.lookup(client.address)
            self.bus.decision(denied.decision, session=session, client=client.label,
                              kind="tls", name=None, port=port)
            client.writer.write(TLS_ACCESS_DENIED)
            return
        host = Host(name=hello.sni)
        try:
            up_r, up_w, event = await self._open(client, host, port, "tls", f"{host}:{port}")
        except Denied:  # _open has emitted the event
            client.writer.write(TLS_ACCESS_DENIED)
            return
        counters = Counters()
        try:
            up_w.write(bytes(buf))
            counters.add(len(buf), upward=True)
            await tunnel(client.reader, client.writer, up_r, up_w, counters,
                         self.config.idle_timeout)
        finally:
            up_w.close()
            self._closed(event, counters)


def _host(text: str) -> Host:
    try:
        return parse_host(text)
    except HostNameError as exc:
        raise HttpError(400, str(exc)) from None


def _wants_close(head: Head, version: str) -> bool:
    """Does this message end its connection (Connection: close, or HTTP/1.0 by default)?"""
    tokens = head.tokens("connection")
    return "close" in tokens or (version == "HTTP/1.0" and "keep-alive" not in tokens)

