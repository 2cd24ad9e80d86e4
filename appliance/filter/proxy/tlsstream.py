"""Server-side TLS driven by hand over a connection's streams: an ssl.SSLObject between two
memory BIOs, with a plaintext StreamReader and a writer on top, so that forward.py serves an
inspected connection with the very code that serves plain HTTP.

Why not `loop.start_tls(server_side=True)`: by the time the filter knows a host is
inspected it has read the ClientHello (its SNI decides), and start_tls cannot be handed
bytes already taken from the transport. Driving the SSLObject ourselves can: the hello
goes into the incoming BIO first. It also behaves the same on asyncio's loop and on uvloop
(both only see the raw streams). Like relay.py: bytes moved, nothing decided.

A client that goes away is no failure, however it goes: a reset or a FIN in the middle of a
record, close_notify in the middle of a request, any of them while a response is being
written. Reading, the plaintext reader ends (EOF) or raises ConnectionError; writing raises
ClientGone, a ConnectionError (OpenSSL says SSLEOFError or "protocol is shutdown" once the
client's end came, uvloop a RuntimeError for a closed transport): the proxy's edge takes
every ConnectionError as a client that left, records the connection's end in its closing
event, and logs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable

from ..relay import CHUNK, Counters, within

log = logging.getLogger("corral.filter")

SLICE = 8 * 1024
"""Raw bytes given to TLS per turn of the event loop. A read of CHUNK (256 KiB) may hold
ten thousand one-byte records (or key updates), each a trip through OpenSSL and Python of
about a microsecond: decrypted at once they would hold the loop for ten milliseconds.
8 KiB holds at most ~370 records (invariant 10: about a millisecond at most)."""


class ClientGone(ConnectionError):
    """The client's TLS is over (its EOF, reset, alert or close_notify came), and something
    was still to be written to it."""


class _Gate:
    """The plaintext reader's "transport": StreamReader pauses it when more than twice its
    limit is buffered and resumes it when read below; the pump waits on it (back-pressure
    towards the client, as for any stream)."""

    def __init__(self):
        self.open = asyncio.Event()
        self.open.set()

    def pause_reading(self) -> None:
        self.open.clear()

    def resume_reading(self) -> None:
        self.open.set()


class TlsServer:
    """One client's TLS, terminated here. `handshake()`, then `reader`/`writer` carry the
    plaintext (the pump task decrypts as bytes arrive) until `close()`."""

    def __init__(self, context: ssl.SSLContext, raw_reader: asyncio.StreamReader,
                 raw_writer: asyncio.StreamWriter, counters: Counters, limit: int,
                 failed: Callable[[], None] | None = None):
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.backlog = bytearray()
        """Raw bytes read from the client and not yet given to TLS (at most SLICE a turn)."""
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.raw_reader, self.raw_writer = raw_reader, raw_writer
        self.counters = counters
        self.reader = asyncio.StreamReader(limit=limit)
        self.gate = _Gate()
        self.reader.set_transport(self.gate)
        self.writer = TlsWriter(self)
        self.pump: asyncio.Task | None = None
        self.failed = failed
        """Logs a failure of the pump (a bug), called in its `except` block: the proxy's,
        within the session's budget (ratelimit.py). None: logged here, unbudgeted."""

    async def handshake(self, received: bytes, seconds: float) -> None:
        """Complete the handshake, `received` (the ClientHello and anything after it) first.
        Raises ssl.SSLError (the client refused our certificate, or spoke no TLS),
        ConnectionError, TimeoutError."""
        self.backlog += received
        deadline = time.monotonic() + seconds
        while True:
            self._feed()
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.flush()
            except ssl.SSLError:
                self.flush()  # our alert, so that the client hears why
                raise
            if self.backlog:
                await asyncio.sleep(0)  # the loop's turn between two slices, as in _pump
                continue
            data = await within(self.raw_reader.read(CHUNK),
                                max(deadline - time.monotonic(), 0.001))
            if not data:
                raise ConnectionError("the client closed during the TLS handshake")
            self.counters.add(len(data), upward=True)
            self.backlog += data
        self.flush()
        self.pump = asyncio.get_running_loop().create_task(self._pump(), name="tls-decrypt")

    def _feed(self) -> None:
        """Give TLS the next SLICE of the backlog."""
        if self.backlog:
            self.incoming.write(self.backlog[:SLICE])
            del self.backlog[:SLICE]

    def flush(self) -> None:
        """Send what TLS has written (records, alerts) to the client. Raises ClientGone
        when the client's connection is closed already."""
        if self.outgoing.pending:
            data = self.outgoing.read()
            if self.raw_writer.is_closing():
                raise ClientGone("the client's connection is closed")
            self.counters.add(len(data), upward=False)
            self.raw_writer.write(data)

    async def _pump(self) -> None:
        """Decrypt into `reader` until the client closes: its close_notify, or its EOF. At
        most SLICE raw bytes a turn of the loop."""
        try:
            while True:
                if self._decrypt():
                    self.reader.feed_eof()
                    return
                await self.gate.open.wait()
                if self.backlog:
                    await asyncio.sleep(0)  # the loop's turn between two slices
                    self._feed()
                    continue
                data = await self.raw_reader.read(CHUNK)
                if data:
                    self.counters.add(len(data), upward=True)
                    self.backlog += data
                    self._feed()
                else:
                    self.incoming.write_eof()  # decrypts what is left, then ends
        except (ssl.SSLError, ConnectionError) as exc:
            self.reader.set_exception(ConnectionError(f"client TLS: {exc}"))
        except Exception as exc:  # a bug: the reader must hear of it, not wait out idle
            if self.failed is not None:
                self.failed()
            else:
                log.exception("tls: decrypting the client's stream failed")
            self.reader.set_exception(ConnectionError(f"client TLS: internal error: {exc!r}"))

    def _decrypt(self) -> bool:
        """Move every decrypted byte to `reader`; True when the client's stream has ended."""
        ended = False
        while True:
            try:
                data = self.tls.read(CHUNK)
            except ssl.SSLWantReadError:
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                # close_notify, or EOF without it: HTTP's own framing tells a cut message
                ended = True
                break
            if not data:
                ended = True
                break
            self.reader.feed_data(data)
        self.flush()  # post-handshake records a read can produce (TLS 1.3 key updates)
        return ended

    def close(self) -> None:
        """Say close_notify (best effort) and stop decrypting. The raw stream is its
        owner's to close."""
        if self.pump is not None:
            self.pump.cancel()  # not awaited: a cut (this task cancelled) must stay one
        with contextlib.suppress(ssl.SSLError, ValueError):
            self.tls.unwrap()  # writes close_notify; the client's own is not waited for
        with contextlib.suppress(Exception):
            self.flush()


class TlsWriter:
    """The write side of a TlsServer, with what forward.py and relay.py use of a
    StreamWriter: encrypted on `write`, flow control from the raw writer."""

    def __init__(self, server: TlsServer):
        self.server = server
        self.raw = server.raw_writer

    def write(self, data: bytes) -> None:
        """Encrypt and send `data`. Raises ClientGone when the client's TLS is over: the
        data is ours, so an error here can only be the connection's state."""
        if data:
            try:
                self.server.tls.write(data)
            except ssl.SSLError as exc:
                raise ClientGone(f"client TLS: {exc}") from None
            self.server.flush()

    async def drain(self) -> None:
        await self.raw.drain()

    def can_write_eof(self) -> bool:
        return False  # TLS has no half-close; close_notify ends both directions

    def write_eof(self) -> None:
        raise NotImplementedError

    def is_closing(self) -> bool:
        return self.raw.is_closing()

    def close(self) -> None:
        self.server.close()  # close_notify first
        self.raw.close()

    async def wait_closed(self) -> None:
        await self.raw.wait_closed()

    @property
    def transport(self):
        return self.raw.transport

    def get_extra_info(self, name: str, default=None):
        if name == "ssl_object":
            return self.server.tls
        return self.raw.get_extra_info(name, default)
