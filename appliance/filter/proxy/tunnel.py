"""Tunnels: CONNECT on the explicit proxy, and TLS redirected to the transparent listener.

A CONNECT tunnel is inspected before any client byte reaches the upstream, however late
that byte comes: what the upstream says first is passed to the client at once (protocols
where the server speaks first), but the client's bytes wait. A TLS ClientHello must be
complete within `header_timeout` of its first byte and name the CONNECT host (no domain
fronting); anything else must be HTTP/1.x and goes through the same per-request pipeline as
plain HTTP, for the life of the tunnel. No timeout and no error opens a tunnel uninspected.
Once its hello is checked, a TLS tunnel's bytes are spliced (relay.tunnel): they never
enter Python, and no certificate of ours is on the wire.

Unless the policy marks the host inspected: then the filter ends the client's TLS itself,
with a leaf certificate for the host (inspect.py), its ClientHello replayed into a TLS
object driven by hand (tlsstream.py); opens verified TLS to the upstream; and serves every
request in between with forward.py, as plain HTTP in a tunnel is served. Each failure —
no CA, a client that refuses ours, an upstream that fails verification — ends the
connection with a reason and an event; none falls back to a splice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from typing import TYPE_CHECKING

from appliance.policy import Decision, Host

from ..denied import Denied
from ..http import Head, parse_authority
from ..relay import CHUNK, Counters, drain, settled, tunnel, within
from .flows import Flow
from .forward import Upstream
from .inspect import UPSTREAM_TLS, ResumingContext, no_inspector
from .pipeline import InTunnel, host_of
from .sni import TlsError, parse_client_hello
from .tlsstream import TlsServer

if TYPE_CHECKING:
    from . import Client, Proxy

log = logging.getLogger("corral.filter")

# TLS alert record: fatal (2), access_denied (49). curl prints "tlsv1 alert access denied".
TLS_ACCESS_DENIED = bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 49])
TLS_HANDSHAKE = 0x16
ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"


class Tunnels:
    def __init__(self, proxy: Proxy):
        self.proxy = proxy
        self.config = proxy.config

    async def connect(self, client: Client, head: Head) -> None:
        proxy = self.proxy
        name, port = parse_authority(head.start[1], None)
        host = host_of(name)
        if not self._admit(client):
            message = (f"too many tunnels open for this session ([proxy] "
                       f"max_tunnels_per_session = {proxy.flows.tunnels.limit})")
            client.writer.write(self.proxy.failed(503, message))
            return
        try:
            async with self._upstream(client, host, port, "connect", ESTABLISHED) as (
                    up, event, flow, counters):
                await drain(client.writer, self.config.idle_timeout)
                first = await self._first_byte(client, up.reader, counters)
                if not first:
                    return  # either side left, or both sat idle, before the client spoke
                if first[0] != TLS_HANDSHAKE:
                    await proxy.forward.serve(client, InTunnel(host, port), up, first, event)
                    return
                buf = bytearray(first)
                try:
                    await self._check_hello(client, buf, host, port)
                except Denied as denied:
                    proxy.event(denied.decision, client, event["session"], "connect", host,
                                port, event["address"], event_id=event["id"])
                    client.writer.write(TLS_ACCESS_DENIED)
                    return
                await self._onward(client, bytes(buf), host, port, up, event, flow, counters)
        except Denied as denied:  # refused before the tunnel opened: answered in HTTP
            if not denied.recorded:
                proxy.event(denied.decision, client, client.session, "connect", host, port)
            client.writer.write(self.proxy.refusal(denied))
        finally:
            proxy.flows.tunnels.release(client.session)

    def _admit(self, client: Client) -> bool:
        """Whether the client's session may open one more tunnel (released by the caller
        when it ends); a refusal is counted and logged."""
        tunnels = self.proxy.flows.tunnels
        if tunnels.admit(client.session):
            return True
        self.proxy.stats["refused_tunnels"] += 1
        self.proxy.refused(client, client.session, tunnels)
        return False

    @contextlib.asynccontextmanager
    async def _upstream(self, client: Client, host: Host, port: int, kind: str,
                        answer: bytes = b""):
        """The tunnel's upstream, opened (proxy.open: judged, dialled, `answer` written to
        the client, its event emitted and its flow tracked; Denied, recorded, if not) and,
        however the tunnel ends, closed, untracked and its closing event emitted with what
        was counted."""
        proxy = self.proxy
        # set before the dial: uvloop starts a transport's TLS in the context the transport
        # was made in, asyncio in the task's (this connection's alone, either way)
        UPSTREAM_TLS.set((client.session, host.key, port))
        (up_r, up_w), event, flow = await proxy.open(
            client, host, port, kind, f"{host}:{port}",
            dialled=(lambda: client.writer.write(answer)) if answer else None)
        counters = Counters()
        try:
            yield (Upstream((str(host), port), up_r, up_w, event["address"]), event, flow,
                   counters)
        finally:
            _close_upstream(up_w)
            proxy.untrack(flow)
            proxy.closed(event, counters)

    # -- after the ClientHello: splice, or inspect ---------------------------------------------

    async def _onward(self, client: Client, hello: bytes, host: Host, port: int,
                      up: Upstream, event: dict, flow: Flow, counters: Counters) -> None:
        """`hello` (every byte read so far) has been checked: splice the tunnel, unless the
        policy in force now inspects the host, or a secret is bound to it (its placeholder
        is swapped in the requests)."""
        _, policy = self.proxy.store.lookup(client.address)
        if not self.proxy.inspects(policy, host):
            # dial() refused an inspected host's address; checked again for what changed
            # since (the policy, the addresses seen), with no await in between
            shared = self.proxy.neighbour(policy, host, up.address)
            if shared is not None:
                self._tunnel_denied(client, Denied(shared, str(host)), event, host, port)
                client.writer.write(TLS_ACCESS_DENIED)
                return
            flow.spliced = True
            up.writer.write(hello)
            counters.add(len(hello), upward=True)
            await tunnel(client.reader, client.writer, up.reader, up.writer, counters,
                         self.config.idle_timeout)
            return
        inspector = self.proxy.inspector
        try:
            if inspector is None:
                raise no_inspector(host)
            context = await inspector.leaf(host, event["session"])
        except Denied as denied:
            self._tunnel_denied(client, denied, event, host, port)
            client.writer.write(TLS_ACCESS_DENIED)
            return
        server = TlsServer(context, client.reader, client.writer, counters,
                           self.config.max_header_bytes, failed=lambda: self.proxy.failures.log(
                               log, client.session, time.monotonic(),
                               "tls: decrypting the stream of %s failed", client.label))
        try:
            await self._inspect(client, server, hello, host, port, up, event)
        finally:
            server.close()

    async def _inspect(self, client: Client, server: TlsServer, hello: bytes, host: Host,
                       port: int, up: Upstream, event: dict) -> None:
        proxy, config = self.proxy, self.config
        # Both handshakes at once: the host was allowed by its name and dialled already, so
        # TLS to it reveals nothing the client's handshake would decide, and its round
        # trips overlap the client's instead of following them (a new connection's added
        # latency). Nothing is sent upstream but the handshake until the client's is done.
        resume = UPSTREAM_TLS.get()  # (session, host, port): whose TLS it may resume

        async def upstream_handshake() -> None:  # made in the task: it may never start
            await within(up.writer.start_tls(proxy.inspector.upstream,
                                             server_hostname=host.key,
                                             ssl_handshake_timeout=config.connect_timeout),
                         config.connect_timeout)

        upstream_tls = asyncio.ensure_future(upstream_handshake())
        try:
            await server.handshake(hello, config.header_timeout)
        except (ssl.SSLError, ConnectionError, TimeoutError) as exc:  # never a splice instead
            await _abandon(upstream_tls)
            reason = getattr(exc, "reason", None)  # TLSV1_ALERT_UNKNOWN_CA, as curl says it
            reason = reason.lower().replace("_", " ") if reason else str(exc) or "timed out"
            self._tunnel_denied(client, Denied(Decision(
                False, f"TLS handshake with the client failed ({reason}): a client must "
                "trust the corral interception CA to reach an inspected host"), str(host)),
                event, host, port)
            return
        except BaseException:  # cut, or the filter stopping: the upstream handshake too
            await _abandon(upstream_tls)
            raise
        try:
            await upstream_tls
        except ssl.SSLCertVerificationError as exc:  # a decision: 403
            refusal = Denied(Decision(False, f"upstream {host}:{port} failed TLS verification:"
                                      f" {exc.verify_message}"), f"{host}:{port}")
        except (ssl.SSLError, OSError, TimeoutError) as exc:  # a failure: 502
            refusal = Denied(Decision(False, f"TLS to upstream {host}:{port} failed: "
                                      f"{str(exc) or 'timed out'}"), f"{host}:{port}", 502)
        else:
            refusal = None
        if refusal is not None:
            self._tunnel_denied(client, refusal, event, host, port)
            await self._answer_in_tls(server, refusal)
            return
        # from here the client's connection carries the plaintext (its raw streams stay
        # with Proxy._serve, which closes them)
        client.reader, client.writer = server.reader, server.writer
        try:
            await proxy.forward.serve(client, InTunnel(host, port, inspected=True), up, b"",
                                      event)
        finally:  # its TLS session, for this session's next connection there
            upstream = proxy.inspector.upstream
            if isinstance(upstream, ResumingContext) and resume is not None:
                upstream.keep(resume, up.writer.get_extra_info("ssl_object"))

    def _tunnel_denied(self, client: Client, denied: Denied, event: dict, host: Host,
                       port: int) -> None:
        """The tunnel's decision event becomes a denial (same id; "error" when something
        failed rather than was refused): it was allowed by name, and ended after its hello."""
        self.proxy.event(denied.decision, client, event["session"], event["kind"], host, port,
                         event["address"], event_id=event["id"],
                         verdict="deny" if denied.status == 403 else "error")

    async def _answer_in_tls(self, server: TlsServer, denied: Denied) -> None:
        """A 403 the client can read (curl prints it, `monitor` shows it): after its first
        request head, or at once if none comes in time."""
        with contextlib.suppress(asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                                 ConnectionError, TimeoutError):
            await within(server.reader.readuntil(b"\r\n\r\n"), self.config.header_timeout)
        server.writer.write(self.proxy.refusal(denied))
        with contextlib.suppress(ConnectionError):
            await drain(server.writer, self.config.idle_timeout)

    async def _first_byte(self, client: Client, up_r, counters: Counters) -> bytes:
        """The client's first byte inside the tunnel, however late it comes; b"" when the
        tunnel ends first (the client closed, or nothing moved for `idle_timeout`).
        Meanwhile whatever the upstream says is passed to the client. An upstream that
        closes or resets first (a CDN ends a connection that says nothing for a few
        seconds) does not end the tunnel: what the client sends, whenever it comes, is still
        inspected and a denial answered and recorded, whatever became of the upstream. (A
        server that speaks first and then closes leaves its client without EOF until then;
        inside a CONNECT only TLS and HTTP are carried, whose servers never speak first.)

        The client is read on this task (a read cancelled by its timeout loses nothing: the
        bytes stay in the reader); the upstream on a task of its own, every tunnel's only
        other one here."""
        early = asyncio.get_running_loop().create_task(
            self._upstream_first(up_r, client.writer, counters), name="tunnel-server-first")
        idle = self.config.idle_timeout
        try:
            while True:
                try:
                    return await within(client.reader.read(1), idle)
                except TimeoutError:  # the upstream's bytes, passed on, keep the tunnel up
                    if time.monotonic() - counters.last >= idle:
                        return b""
        finally:
            early.cancel()
            await asyncio.gather(early, return_exceptions=True)

    async def _upstream_first(self, up_r, client_w, counters: Counters) -> None:
        with contextlib.suppress(ConnectionError):  # a reset ends it as a close does
            await self._relay_first(up_r, client_w, counters)

    async def _relay_first(self, up_r, client_w, counters: Counters) -> None:
        while data := await up_r.read(CHUNK):
            counters.add(len(data), upward=False)
            client_w.write(data)
            await drain(client_w, self.config.idle_timeout)

    async def _check_hello(self, client: Client, buf: bytearray, host: Host, port: int):
        hello = await self.read_hello(client, buf)
        if hello.sni is None and host.name is not None:  # the server would pick any vhost
            raise Denied(Decision(False, f"TLS without SNI inside a tunnel to {host}: the "
                                  "name it reaches cannot be checked"), "tls")
        if hello.sni is not None and (host.name is None or hello.sni != host.name):
            raise Denied(Decision(False, f"TLS SNI {hello.sni} differs from CONNECT host "
                                  f"{host} (domain fronting)"), "tls")

    async def read_hello(self, client: Client, buf: bytearray):
        """Read until `buf` holds a whole ClientHello, within `header_timeout`. Raises Denied
        (target "tls"): a hello that is late or malformed is never passed on."""
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

    async def transparent(self, client: Client, port: int) -> None:
        proxy = self.proxy
        buf = bytearray()
        try:
            hello = await self.read_hello(client, buf)
            if hello.sni is None:
                raise Denied(Decision(False, "TLS without SNI: cannot tell where it goes"), "tls")
        except Denied as denied:  # not decided by name: no event yet, so say why here
            proxy.bus.decision(denied.decision, session=client.session, client=client.label,
                               kind="tls", name=None, port=port)
            client.writer.write(TLS_ACCESS_DENIED)
            return
        host = Host(name=hello.sni)
        if not self._admit(client):
            client.writer.transport.abort()
            return
        opened = False
        try:
            async with self._upstream(client, host, port, "tls") as (up, event, flow,
                                                                     counters):
                opened = True
                await self._onward(client, bytes(buf), host, port, up, event, flow, counters)
        except Denied:
            if opened:  # _onward answers its own refusals: one that escapes it is a bug
                raise
            client.writer.write(TLS_ACCESS_DENIED)  # open() has emitted the event
        finally:
            proxy.flows.tunnels.release(client.session)


async def _abandon(task: asyncio.Future) -> None:
    """Cancel work this connection no longer needs and wait for it to end (its own error
    taken, so that nothing logs it as never retrieved); a cut of the caller still ends the
    caller."""
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()


def _close_upstream(writer) -> None:
    """End a tunnel's upstream connection with the tunnel. TLS the filter began (an
    inspected host) is aborted: a close would send close_notify and wait for the host's,
    which a host the filter stopped reading never delivers, keeping the socket past the
    tunnel's share until TLS's 30 s shutdown timeout. HTTP framed what was exchanged:
    nothing more is owed to the host. The error it ends with is taken (relay.settled)."""
    if writer.get_extra_info("ssl_object") is not None:
        writer.transport.abort()
    else:
        writer.close()
    settled(writer)
