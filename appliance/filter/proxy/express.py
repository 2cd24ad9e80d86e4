"""The express lane: plain HTTP on the explicit and transparent listeners, served by protocol
callbacks rather than a task and a pair of streams per connection.

A connection starts here. Each request head is parsed, routed, decided and planned by the
same pure functions forward.py uses; the lane serves a request that is a GET or HEAD
without a body, allowed by the policy outright, whose plan is a plain Send, and whose
response is framed by its length (or has none). That is most of an agent's plain HTTP, and
it costs two callbacks a request: the request's bytes in, the response's bytes in.

Anything else is forward.py's, with everything the lane read: a request that is not the
lane's (a body, a refusal, a hold, CONNECT, an upgrade, a malformed head) before anything
of it was decided aloud; a response that is not (chunked, unframed, 1xx, too large a head)
at its head, the request's flow and decision event going with it. Both connections become
streams then (`_streams`), and the connection goes on there as if forward.py had served it
from the start. A connection once handed over stays there. A CONNECT on the explicit
listener is handed over with its head read and parsed here (the tunnel's bytes after it
still to read there): forward.py opens the tunnel from it.

Timeouts are one timer per connection (`_expect`), moved by each phase, as relay.within
does for a task.
"""

from __future__ import annotations

import asyncio
import logging
import time

from appliance.sessionconfig import SCAN_BYTES

from ..approvals import REQUEST_NAME
from ..denied import Denied
from ..http import Head, HttpError, parse_request, parse_response, serialise_response
from ..relay import Counters, PeerWriter, original_port
from .forward import Upstream
from .pipeline import Explicit, Mode, Transparent, framing, outgoing, route, wants_close
from .plan import KEPT, Request, Send, plan

log = logging.getLogger(__name__)

HEAD, DIAL, ANSWER, BODY, DRAIN, OFF = range(6)
"""A lane's phases: waiting for (or reading) a request head; dialling its origin; waiting
for the response head; relaying the response body; waiting for the client to take the
response; handed over or closed."""

METHODS = ("GET", "HEAD")
"""The methods the lane serves (without a body)."""
STARTS = tuple(f"{method} ".encode() for method in METHODS)
"""How a request the lane may take begins: anything else is handed over at its first word
(but a CONNECT on the explicit listener)."""
CONNECT = b"CONNECT "
"""A tunnel's request: its head is read and parsed here, for forward.py to open the tunnel
with (as it would have read it: it is not read twice)."""


def _streams(transport: asyncio.Transport, buffered: bytes, limit: int, eof: bool,
             paused: bool) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A reader and writer on a transport a protocol of the lane served until now, holding
    what it had read (`buffered`, then the end of the stream if it came): as if streams had
    been there from the start. `paused`: the transport asked for no more writes."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=limit, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport.set_protocol(protocol)
    protocol.connection_made(transport)
    if paused:
        protocol.pause_writing()  # its drain() waits for the resume_writing to come
    if buffered:
        reader.feed_data(buffered)
    if eof:
        reader.feed_eof()
    transport.resume_reading()  # the reader pauses it again itself if it holds too much
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


class Origin(asyncio.Protocol):
    """A connection to an origin, served by callbacks: what it receives goes to the lane
    that owns it (none while it is kept in the pool: then any byte spoils it). It may be
    kept between client connections (forward.py's pool) as an Upstream is."""

    def __init__(self, lane: Lane | None, limit: int):
        self.lane, self.limit = lane, limit
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.scanned = 0
        """How much of `buffer` was searched for the end of a head (a head trickled in a
        byte at a time is searched once, not once per byte)."""
        self.ended = False
        """It sent its end, or the connection was lost."""
        self.key: tuple[str, int] = ("", 0)
        self.address = ""
        self.session: str | None = None
        self.generation = -1
        self.adopted: tuple[Upstream, asyncio.BaseProtocol] | None = None
        """The forward.py Upstream this connection was, and its streams' protocol (adopt):
        kept, because a StreamWriter closes its transport when it is collected (Python
        3.11.8 on, the appliance's 3.13 among them), and given back by `streams`."""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.lane is None:
            self.spoil()  # sent unasked (kept in the pool, or dialling)
        else:
            self.lane.from_origin(self, data)

    def spoil(self) -> None:
        """Bytes nobody asked for: the connection is closed, never reused, and what it sent
        is dropped (kept, an origin could fill the filter's memory with it)."""
        self.ended = True
        self.buffer.clear()
        self.close()

    def eof_received(self) -> bool:
        self.ended = True
        if self.lane is not None:
            self.lane.origin_ended(self)
        return False  # close it

    def connection_lost(self, exc) -> None:
        self.ended = True
        if self.lane is not None:
            self.lane.origin_ended(self)
        self.adopted = None  # its streams end with it (closed: their writer closes nothing)

    @property
    def reusable(self) -> bool:
        """Open both ways, with nothing received past the last response."""
        return (not self.ended and not self.buffer and self.transport is not None
                and not self.transport.is_closing())

    def close(self) -> None:
        self.lane = None
        if self.transport is not None:
            self.transport.close()

    def streams(self) -> Upstream:
        """This connection as forward.py's Upstream (it is forward.py's from now on)."""
        self.lane = None
        if self.adopted is not None:  # its streams, where they were left, given what came
            (upstream, protocol), self.adopted = self.adopted, None
            self.transport.set_protocol(protocol)
            if self.buffer:
                upstream.reader.feed_data(bytes(self.buffer))
            if self.ended:
                upstream.reader.feed_eof()
            self.transport.resume_reading()
            return upstream
        reader, writer = _streams(self.transport, bytes(self.buffer), self.limit, self.ended,
                                  False)
        return Upstream(self.key, reader, PeerWriter(writer), self.address, self.session,
                        self.generation)

    @classmethod
    def adopt(cls, kept: Upstream | Origin, lane: Lane, limit: int) -> Origin:
        """A kept connection taken from the pool, served by the lane from now on."""
        if isinstance(kept, Origin):
            kept.lane = lane
            return kept
        origin = cls(lane, limit)
        transport = kept.writer.transport
        protocol = transport.get_protocol()
        transport.set_protocol(origin)  # reusable: the reader held nothing, nor its end
        origin.transport = transport
        origin.key, origin.address = kept.key, kept.address
        origin.session, origin.generation = kept.session, kept.generation
        origin.adopted = (kept, protocol)
        return origin


class Exchange:
    """The request a lane has in flight."""

    __slots__ = (
        "close_client",
        "counters",
        "event",
        "flow",
        "head",
        "keep_origin",
        "left",
        "method",
        "send",
        "session",
        "where",
    )

    def __init__(self, where, session, send: Send):
        self.head, self.where, self.session, self.send = send.head, where, session, send
        self.method = send.head.start[0]
        self.flow = self.event = None
        self.counters = Counters()
        self.left = 0
        self.close_client = wants_close(send.head, send.head.start[2])
        self.keep_origin = False


class Lane(asyncio.Protocol):
    """One client connection on the express lane (see the module's words)."""

    def __init__(self, proxy, mode: Mode | None):
        from . import Client

        self.proxy, self.forward, self.config = proxy, proxy.forward, proxy.config
        self.mode = mode
        """Explicit, or Transparent with the port the client dialled (None: read from the
        connection, as the transparent listener is)."""
        self.client: Client | None = None
        self._client_type = Client  # proxy/__init__ imports this module: Client, late
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.scanned = 0
        """How much of `buffer` was searched for the end of a head (Origin.scanned)."""
        self.phase = HEAD
        self.origin: Origin | None = None
        """The origin connection kept from this connection's earlier requests."""
        self.exchange: Exchange | None = None
        self.dialling: asyncio.Task | None = None
        self.served = 0
        """Requests served here: 0 until the first is done (forward.py's `opening`)."""
        self.eof = False
        self.closing = False
        """The response out is the last: the connection closes once the client took it."""
        self.writing_paused = False
        self.reading_paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.due = self.timer_at = 0.0
        self.on_due = None

    # -- the client's connection ---------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername") or ("?", 0)
        if self.mode is None:
            self.mode = Transparent(original_port(transport, 80))
        self.client = self._client_type(None, None, peer[0], peer[1], abort=self.cut)
        if not self.proxy.admit(self.client, transport.abort):
            self.phase = OFF
            return
        self.proxy.lanes.add(self)
        self._expect(self.config.header_timeout, self._late_head)

    def data_received(self, data: bytes) -> None:
        if self.phase == OFF:
            return
        self.buffer += data
        try:
            if self.phase == HEAD:
                self._next()
            elif len(self.buffer) > self.config.max_header_bytes and not self.reading_paused:
                self.transport.pause_reading()  # pipelined past a head's worth: it waits
                self.reading_paused = True
        except Exception:  # one broken connection must never reach the loop
            self._failed()

    def eof_received(self) -> bool:
        self.eof = True
        if self.phase == HEAD:
            try:
                self._next()
            except Exception:
                self._failed()
        return True  # half-closed: the response in flight still goes out

    def connection_lost(self, exc) -> None:
        if self.phase == OFF:
            return
        self._end()

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self.origin is not None and self.origin.transport is not None:
            self.origin.transport.pause_reading()

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.origin is not None and self.origin.transport is not None:
            self.origin.transport.resume_reading()
        if self.phase == DRAIN:
            try:
                self._ready()
            except Exception:
                self._failed()

    # -- requests --------------------------------------------------------------------------

    def _next(self) -> None:
        """The next request, if its head is here: served, or handed over."""
        data = self.buffer
        if len(data) >= 5 and not data.startswith(STARTS) and not (
                isinstance(self.mode, Explicit) and CONNECT.startswith(data[:8])):
            self._hand_over()  # any other method: its head is forward.py's to read
            return
        end = data.find(b"\r\n\r\n", self.scanned)
        if end < 0:
            self.scanned = max(len(data) - 3, 0)  # a head trickled in is searched once
            if len(data) > self.config.max_header_bytes or data.startswith(b"\r\n"):
                self._hand_over()
            elif self.eof:
                self._close()  # ended without (the rest of) a request: nobody to answer
            elif data and self.on_due == self._idle:  # a request begun: its head has a limit
                self._expect(self.config.header_timeout, self._late_head)
            return
        if end + 4 > self.config.max_header_bytes or data.startswith(b"\r\n"):
            self._hand_over()
            return
        try:
            head = parse_request(bytes(data[:end + 4]))
            if head.start[0] == "CONNECT":  # the rest of the buffer: the tunnel's
                del data[:end + 4]
                self.scanned = 0
                self._hand_over(head)
                return
            if (head.start[0] not in METHODS or head.chunked or head.content_length
                    or head.get("expect") is not None or head.get("upgrade") is not None):
                self._hand_over()
                return
            where = route(head, self.mode)
        except HttpError:
            self._hand_over()  # forward.py answers it, with its event
            return
        if where.conflict is not None or where.host.name == REQUEST_NAME:
            self._hand_over()
            return
        proxy, client = self.proxy, self.client
        session, policy, decision = proxy.decide(client.address, where.host, where.port)
        if not decision.allowed:
            self._hand_over()  # judged there: a hold, a refusal, its event
            return
        inspector = proxy.inspector
        origin = self.origin
        send = next(plan(Request(
            head, where, session, policy, decision, proxy.credentials, False, False,
            origin.key if origin is not None else None,
            inspector.config.scan_bytes if inspector is not None else SCAN_BYTES)))
        if not isinstance(send, Send) or send.attached or send.body is not None:
            self._hand_over()
            return
        del self.buffer[:end + 4]
        self.scanned = 0
        self.exchange = Exchange(where, session, send)
        self._send(self.exchange)

    def _send(self, exchange: Exchange) -> None:
        """Send the request on the origin this connection kept (as forward._send would),
        one the session kept in the pool, or one dialled now."""
        forward, proxy, where = self.forward, self.proxy, exchange.where
        origin, send = self.origin, exchange.send
        if not (send.upstream == KEPT and origin is not None
                and forward.may_reuse(origin, exchange.session)):
            pooled = forward.pooled(exchange.session, (str(where.host), where.port))
            if origin is not None:
                origin.close()
            origin = self.origin = (Origin.adopt(pooled, self, self.config.max_header_bytes)
                                    if pooled is not None else None)
        if origin is None:
            self.phase = DIAL
            self._expect(None, None)
            self.dialling = asyncio.get_running_loop().create_task(self._dial(exchange))
            return
        exchange.flow = proxy.track(self.client, exchange.session, "http", where.host,
                                    where.port, origin.address)
        exchange.event = proxy.event(send.decision, self.client, exchange.session, "http",
                                     where.host, where.port, origin.address,
                                     event_id=exchange.flow.id, **send.event)
        self._sent(exchange, origin)

    async def _dial(self, exchange: Exchange) -> None:
        where, proxy = exchange.where, self.proxy
        dialled_at = self.forward.generation
        limit = self.config.max_header_bytes

        async def opener(address: str, port: int) -> Origin:
            _, origin = await asyncio.get_running_loop().create_connection(
                lambda: Origin(None, limit), address, port)
            return origin

        try:
            origin, exchange.event, exchange.flow = await proxy.open(
                self.client, where.host, where.port, "http", where.target, opener,
                **exchange.send.event)
        except Denied as denied:  # recorded: answered as forward.py answers it
            self.dialling = None
            self.exchange = None
            self._answer_and_close(proxy.refusal(denied))
            return
        except (ConnectionError, TimeoutError, OSError):
            self.dialling = None
            self.exchange = None
            self._close()
            return
        except Exception:  # one broken connection must never hang (no timer runs here)
            self.dialling = None
            self.exchange = None
            self._failed()
            return
        self.dialling = None
        origin.lane = self
        origin.key, origin.address = (str(where.host), where.port), exchange.event["address"]
        origin.session, origin.generation = exchange.session, dialled_at
        self.origin = origin
        try:
            if origin.ended:  # it ended (or spoke unasked, and was closed) as it answered:
                self.phase = ANSWER  # forward.py reads that end and answers 502
                self._hand_over_answer(origin)
                return
            self._sent(exchange, origin)
        except Exception:
            self._failed()

    def _sent(self, exchange: Exchange, origin: Origin) -> None:
        send = exchange.send
        origin.scanned = 0
        origin.transport.write(outgoing(send.head, exchange.where, drop_expect=False,
                                        upgrade=False))
        if self.writing_paused:
            origin.transport.pause_reading()
        self.phase = ANSWER
        self._expect(self.config.idle_timeout, self._stalled)

    # -- the origin's answer ---------------------------------------------------------------

    def from_origin(self, origin: Origin, data: bytes) -> None:
        if origin is not self.origin or self.phase not in (ANSWER, BODY):
            origin.spoil()  # nothing was asked: past its response, or before its request
            if origin is self.origin:
                self.origin = None
            return
        try:
            if self.phase == BODY:
                self._relay(origin, data)
                return
            origin.buffer += data
            self._response_head(origin)
        except Exception:
            self._failed()

    def _response_head(self, origin: Origin) -> None:
        exchange, data = self.exchange, origin.buffer
        end = data.find(b"\r\n\r\n", origin.scanned)
        if end < 0:
            origin.scanned = max(len(data) - 3, 0)
            if len(data) > self.config.max_header_bytes:
                self._hand_over_answer(origin)  # forward.py says "too large", as ever
            return
        if end + 4 > self.config.max_header_bytes:
            self._hand_over_answer(origin)  # forward.py says "too large", as ever
            return
        try:
            reply = parse_response(bytes(data[:end + 4]))
        except HttpError:
            self._hand_over_answer(origin)
            return
        no_body, framed = framing(exchange.method, reply)
        if int(reply.start[1]) < 200 or not framed or (reply.chunked and not no_body):
            self._hand_over_answer(origin)  # 1xx, 101, chunked, unframed: forward.py's
            return
        del data[:end + 4]
        exchange.keep_origin = not wants_close(reply, reply.start[0])
        reply_head = serialise_response(reply, close=exchange.close_client)
        self.phase = BODY
        self._expect(self.config.idle_timeout, self._stalled)
        if no_body:
            self.transport.write(reply_head)
            self._answered(origin)
            return
        exchange.left = reply.content_length
        body = bytes(data)
        data.clear()
        self._relay(origin, body, reply_head)

    def _relay(self, origin: Origin, data: bytes, prefix: bytes = b"") -> None:
        exchange = self.exchange
        if len(data) > exchange.left:  # past the response: never reused
            origin.buffer += data[exchange.left:]
            data = data[:exchange.left]
        if data:
            exchange.left -= len(data)
            exchange.counters.add(len(data), False)
            self.due = time.monotonic() + self.config.idle_timeout
        if prefix or data:
            self.transport.write(prefix + data if prefix else data)
        if not exchange.left:
            self._answered(origin)

    def _answered(self, origin: Origin) -> None:
        """The response is out (to the transport): the flow ends, and the connection waits
        for the next request once the client has taken this one."""
        exchange, proxy = self.exchange, self.proxy
        self.exchange = None
        self.served += 1
        proxy.stats["express_requests"] += 1
        proxy.untrack(exchange.flow)
        proxy.closed(exchange.event, exchange.counters)
        if not exchange.keep_origin or not origin.reusable:
            origin.close()
            self.origin = None
        self.closing = exchange.close_client
        if self.writing_paused:  # as forward.py drains: the client has idle_timeout to take it
            self.phase = DRAIN
            self._expect(self.config.idle_timeout, self._stalled)
            return
        self._ready()

    def _ready(self) -> None:
        if self.closing:
            self._close()
            return
        self.phase = HEAD
        self._expect(self.config.idle_timeout, self._idle)
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
        if self.buffer or self.eof:
            self._next()

    def origin_ended(self, origin: Origin) -> None:
        """The origin closed: in the middle of an answer, as forward.py ends it (no response
        yet: a 502; half a body: the connection cut)."""
        if origin is not self.origin or self.phase not in (ANSWER, BODY):
            return
        try:
            if self.phase == ANSWER:
                self._hand_over_answer(origin)  # forward.py reads what came, and says so
                return
            self._close()
        except Exception:
            self._failed()

    # -- handing over ------------------------------------------------------------------------

    def _hand_over(self, parsed: Head | None = None) -> None:
        """The connection, from the request at the head of the buffer (or `parsed`, taken
        from it), to forward.py."""
        origin, kept = self.origin, None
        if origin is not None and not origin.reusable:
            origin.close()
            origin = self.origin = None
        if origin is not None:
            kept = origin.streams()
            self.origin = None
        mode, opening = self.mode, not self.served
        try:
            self._to_streams(lambda client: self.forward.serve(client, mode, kept,
                                                               opening=opening,
                                                               parsed=parsed))
        except BaseException:
            if kept is not None:
                kept.close()
            raise

    def _hand_over_answer(self, origin: Origin) -> None:
        """The response whose head is coming, and the connection after it, to forward.py."""
        exchange, mode = self.exchange, self.mode
        up = origin.streams()
        self.origin = None
        try:
            self._to_streams(lambda client: self.forward.resume(
                client, mode, up, exchange.head, exchange.counters, exchange.flow,
                exchange.event))
        except BaseException:
            up.close()  # the flow ends with the lane (_end: it still holds the exchange)
            raise
        self.exchange = None

    def _to_streams(self, handler) -> None:
        """Both ends of the connection to forward.py's streams, and a task to serve it: the
        lane gives up what it holds only once that is done (if it fails, _failed ends the
        connection with everything the lane held)."""
        client = self.client
        reader, writer = _streams(self.transport, bytes(self.buffer),
                                  self.config.max_header_bytes, self.eof, self.writing_paused)
        self._leave()
        self.proxy.stats["express_handed_over"] += 1
        self.buffer.clear()
        client.reader, client.writer, client.abort = reader, PeerWriter(writer), None
        client.task = asyncio.get_running_loop().create_task(self.proxy.run(client, handler))

    # -- ends --------------------------------------------------------------------------------

    def _expect(self, seconds: float | None, then) -> None:
        """`then` runs once `seconds` pass (None: nothing is awaited). One timer per
        connection: moved later, it is left alone and set again when it fires early."""
        self.on_due = then
        if seconds is None:
            return
        self.due = time.monotonic() + seconds
        if self.timer is not None and self.timer_at > self.due:  # due sooner than it fires
            self.timer.cancel()
            self.timer = None
        if self.timer is None:
            self.timer_at = self.due
            self.timer = asyncio.get_running_loop().call_later(seconds, self._fire)

    def _fire(self) -> None:
        self.timer = None
        if self.phase == OFF or self.on_due is None:
            return
        left = self.due - time.monotonic()
        if left > 0:
            self.timer_at = self.due
            self.timer = asyncio.get_running_loop().call_later(left, self._fire)
            return
        self.on_due()

    def _idle(self) -> None:
        self._close()  # sat idle between requests: closed, as forward.py does

    def _late_head(self) -> None:
        exc = HttpError(408, "request head not received in time")
        self.proxy.error_event(self.client, exc)
        self._answer_and_close(self.proxy.failed(exc.status, str(exc)))

    def _stalled(self) -> None:
        """The origin, or the client taking the response, idle too long: the connection is
        reset (closed, its unsent bytes would hold it for as long as the client reads
        nothing)."""
        if self.phase != OFF:
            self._end()
        self.transport.abort()

    def _answer_and_close(self, answer: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(answer)
        self._close()

    def _failed(self) -> None:
        self.proxy.failures.log(log, self.client.session if self.client else None,
                                time.monotonic(), "proxy: connection from %s failed",
                                self.client.label if self.client else "?")
        self._close()

    def cut(self) -> None:
        """A policy change ended a flow of this connection, or the filter stops: it ends at
        once, its origin connection with it."""
        if self.origin is not None:
            self.origin.close()
            self.origin = None
        self._close()

    def _close(self) -> None:
        if self.phase != OFF:
            self._end()
        self.transport.close()

    def _leave(self) -> None:
        """This lane serves the connection no more."""
        self.phase = OFF
        self.on_due = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.proxy.lanes.discard(self)

    def _end(self) -> None:
        """The connection is over: what it held is given back, its kept origin pooled."""
        self._leave()
        proxy, client = self.proxy, self.client
        if self.dialling is not None:
            self.dialling.cancel()  # proxy.open untracks the flow it registered
            self.dialling = None
        exchange, self.exchange = self.exchange, None
        if exchange is not None and exchange.flow is not None:
            proxy.untrack(exchange.flow)
            proxy.closed(exchange.event, exchange.counters)
            if self.origin is not None:  # half a message went up or came back
                self.origin.close()
                self.origin = None
        if self.origin is not None:
            self.origin.lane = None
            if self.origin.transport is not None:  # paused for a client that was behind
                self.origin.transport.resume_reading()
            self.forward._keep(client, self.origin)
            self.origin = None
        proxy.release(client)


def listener(proxy, mode: Mode | None):
    """The protocol factory of a listener on the express lane: Explicit(), or None for
    the transparent HTTP listener (each connection's port read from it)."""
    return lambda: Lane(proxy, mode)

