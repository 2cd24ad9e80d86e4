"""Every event to journald as well (`[events] journal`), for the team's log system to carry.

journald's native protocol (systemd's "Native Journal Protocol"): one datagram to
/run/systemd/journal/socket per entry, holding its fields one after another, each
`NAME=value\\n`, or, for a value with a newline in it, `NAME\\n`, the value's length as a
64-bit little-endian number, the value, `\\n`. An entry too large for a datagram goes as a
sealed memfd whose descriptor an empty datagram carries (SCM_RIGHTS), as sd_journal_send
does it. rsyslog's imjournal, Vector's and Fluent Bit's journald sources and
systemd-journal-upload read the journal from there: corral ships nothing itself.

Each entry (`entry`, a pure function of the event, tested as bytes):
  MESSAGE            the event as one JSON line, as the control socket, the API's event
                     stream and `corral monitor --json` give it
  SYSLOG_IDENTIFIER  corral-events (`journalctl -t corral-events`)
  PRIORITY           4 (warning): an error, a leak, a secret astray; 5 (notice): a denial,
                     an approval waiting; 6 (info): everything else
  CORRAL_<FIELD>     each of the event's SCHEMA fields (appliance/event.py), upper-cased:
                     CORRAL_KIND=dns; a list or a table as compact JSON, true/false, numbers
                     as JSON writes them; a field absent or null is no field
  CORRAL_OCSF_CLASS_UID  the OCSF class an event of the kind maps to, where one fits: DNS
                     Activity 4003 (dns), HTTP Activity 4002 (http), Network Activity 4001
                     (connect, tls, firewall)

`Journal` is the socket edge: a bus subscriber (a bounded queue, the oldest lost when it is
full, as any subscriber's) whose task sends each entry without ever waiting on journald:
the socket is non-blocking; a full journal (EAGAIN) parks the entry until the socket is
writable again while the bus goes on; a missing or refusing socket loses the entry. What
is lost is counted (`status`: journal.lost) and logged at most once a minute. The audit
log, not this copy, is the record that keeps everything.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Mapping
from json.encoder import JSONEncoder, c_make_encoder, encode_basestring_ascii

from appliance.event import FIELDS

from .events import EventBus

log = logging.getLogger("corral.filter")

SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "corral-events"
PREFIX = "CORRAL_"
JOURNAL_NAMES: dict[str, str] = {name: PREFIX + name.upper() for name in FIELDS}
"""SCHEMA's field -> its journald field (upper case, digits and `_`, as journald wants)."""
OCSF_FIELD = PREFIX + "OCSF_CLASS_UID"
OCSF_CLASSES = {"dns": "4003", "http": "4002", "connect": "4001", "tls": "4001",
                "firewall": "4001"}
"""kind -> OCSF class_uid. Only where the class is the event's: a CONNECT or transparent
TLS tunnel and a firewall reject are connections opened or refused; git (HTTP or SSH), the
changes and the approvals (OCSF's 3003 is "Authorize Session", a logon's privileges: not a
person letting a request through) have none."""
WARNING, NOTICE, INFO = 4, 5, 6
DATAGRAM_MAX = 64 * 1024
"""Entries larger than this go as a memfd (as do those the kernel refuses as too large for
a datagram: EMSGSIZE, below a small socket buffer). An event is a few hundred bytes."""
RETRY_CONNECT = 1.0
"""Seconds between attempts to reach a socket that is missing or refused: in between,
entries are lost at the cost of a check, not of a system call each."""
WAIT_WRITABLE = 1.0
"""Seconds to wait for a full journal to take an entry before trying again (journald
restarted meanwhile: a new socket at the same path)."""
REPORT_EVERY = 60.0
"""Seconds between two log lines about lost entries."""


PRIORITIES = {"error": WARNING, "deny": NOTICE, "pending": NOTICE}
"""verdict -> PRIORITY (a denied leak or secret astray: WARNING, `priority`)."""
if c_make_encoder is None:  # no C accelerator: the same text, slower
    _json = JSONEncoder(separators=(",", ":")).encode
else:
    # JSONEncoder.encode makes this C encoder anew for every call; made once, it costs a
    # third less, and the MESSAGE is half an entry's cost
    _encoder = c_make_encoder(None, JSONEncoder().default, encode_basestring_ascii, None,
                              ":", ",", False, False, True)

    def _json(value) -> str:
        """The control socket's and `monitor --json`'s form: compact, ASCII."""
        return "".join(_encoder(value, 0))


def priority(event: Mapping) -> int:
    verdict = event.get("verdict")
    if verdict == "deny" and event.get("kind") in ("leak", "secret"):
        return WARNING
    return PRIORITIES.get(verdict, INFO)


def value_text(value) -> str:
    """A field's value as journald gets it: text as it is, the rest as JSON writes it."""
    kind = type(value)
    if kind is str:
        return value
    if kind is int or kind is float:
        return repr(value)  # JSON's own digits for a finite number
    return _json(value)


def fields(event: Mapping) -> list[tuple[str, str]]:
    """The entry of `event`, field by field, in order (a name outside SCHEMA is left out:
    the entry's names are the documented ones and no other)."""
    found = [("MESSAGE", _json(event)), ("PRIORITY", str(priority(event))),
             ("SYSLOG_IDENTIFIER", IDENTIFIER)]
    for name, value in event.items():
        if value is not None:
            journal_name = JOURNAL_NAMES.get(name)
            if journal_name is not None:
                found.append((journal_name, value if type(value) is str
                              else value_text(value)))
    ocsf = OCSF_CLASSES.get(event.get("kind"))
    if ocsf is not None:
        found.append((OCSF_FIELD, ocsf))
    return found


def encode(entry: list[tuple[str, str]]) -> bytes:
    """journald's native form of the fields: `NAME=value\\n`, or the binary-safe
    `NAME\\n<length, 64-bit little-endian><value>\\n` for a value with a newline (none
    from the bus, which escapes them: the text is joined and encoded once then)."""
    text = "".join([f"{name}={value}\n" for name, value in entry])
    if text.count("\n") != len(entry):  # a value holds one (names never do)
        return _binary_safe(entry)
    return text.encode("utf-8", "backslashreplace")  # a lone surrogate: visible, kept


def _binary_safe(entry: list[tuple[str, str]]) -> bytes:
    parts = []
    for name, value in entry:
        data = value.encode("utf-8", "backslashreplace")
        if b"\n" in data:
            parts += (name.encode(), b"\n", len(data).to_bytes(8, "little"), data, b"\n")
        else:
            parts += (name.encode(), b"=", data, b"\n")
    return b"".join(parts)


def entry(event: Mapping) -> bytes:
    """The datagram that carries `event` to journald."""
    return encode(fields(event))


def sealed_memfd(data: bytes) -> int:
    """A memfd holding `data`, sealed (journald takes a passed descriptor only sealed: it
    maps it and must know nobody changes it)."""
    fd = os.memfd_create(IDENTIFIER, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Journal:
    """The exporter: subscribed to `bus`, it sends each event's entry to journald's socket
    at `path` (`start`, `stop`; `describe` for status)."""

    def __init__(self, bus: EventBus, path: str = SOCKET, queue: int = 10000):
        self.bus, self.path, self.queue = bus, path, queue
        self.sent = 0
        self.failed = 0
        """Entries that could not be sent (socket missing, refused, an error)."""
        self.error: str | None = None
        """Why the last entry lost was lost (None once one is sent again)."""
        self.waiting = False
        """True while the journal is full and an entry waits for room."""
        self._sock: socket.socket | None = None
        self._retry_at = 0.0
        self._reported_at = -REPORT_EVERY
        self._reported_lost = 0
        self._subscription = None
        self._task: asyncio.Task | None = None
        self._pending: bytes | None = None
        """The entry waiting for room in a full journal."""

    @property
    def lost(self) -> int:
        """Events that did not reach journald: failed, or pushed out of the queue while
        journald was full."""
        return self.failed + (self._subscription.dropped if self._subscription else 0)

    def describe(self) -> dict:
        return {"socket": self.path, "sent": self.sent, "lost": self.lost,
                "queued": len(self._subscription.queue) if self._subscription else 0,
                "waiting": self.waiting, "error": self.error}

    def start(self) -> None:
        self._subscription = self.bus.subscribe(size=self.queue)
        self._task = asyncio.get_running_loop().create_task(self._run(),
                                                            name="journal export")

    async def stop(self) -> None:
        """Send what is queued as far as journald takes it now (never waiting; the rest is
        counted lost), then close."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._subscription is not None:
            self._subscription.close()
            queue, full = self._subscription.queue, False
            if self._pending is not None:
                full = not self._deliver(self._pending)
            while queue and not full:
                data = self._encoded(queue.popleft())
                full = data is not None and not self._deliver(data)
            if full:
                self.failed += 1 + len(queue)
                queue.clear()
            self._pending = None
        self._report()
        self._close()

    async def _run(self) -> None:
        async for event in self._subscription:
            data = self._encoded(event)
            if data is None:
                continue
            self._pending = data
            while not self._deliver(data):
                await self._writable()
            self._pending = None

    def _encoded(self, event: dict) -> bytes | None:
        try:
            return entry(event)
        except Exception:  # a value JSON cannot write: a bug, not a reason to stop
            log.exception("journal export: event %s cannot be encoded", event.get("id"))
            self._lost("an event could not be encoded (see the log)")
            return None

    def _deliver(self, data: bytes) -> bool:
        """Send one entry; True when it is done with (sent, or lost and counted), False
        when the journal is full (try again once the socket is writable)."""
        for again in (False, True):
            try:
                if self._sock is None:
                    if time.monotonic() < self._retry_at:
                        self._lost(self.error or "journald's socket is unavailable")
                        return True
                    self._connect()
                if len(data) > DATAGRAM_MAX:
                    self._send_file(data)
                else:
                    try:
                        self._sock.send(data)
                    except OSError as exc:
                        if exc.errno != errno.EMSGSIZE:
                            raise
                        self._send_file(data)
            except BlockingIOError:
                self.waiting = True
                return False
            except OSError as exc:
                self._close()
                if not again and exc.errno in (errno.ECONNREFUSED, errno.ENOTCONN,
                                               errno.ECONNRESET):
                    continue  # journald restarted since: a new socket at the same path
                self._retry_at = time.monotonic() + RETRY_CONNECT
                self._lost(f"{self.path}: {os.strerror(exc.errno) if exc.errno else exc}")
                return True
            self.sent += 1
            self.waiting, self.error = False, None
            if self.lost != self._reported_lost and (
                    time.monotonic() - self._reported_at >= REPORT_EVERY):
                self._report(resumed=True)
            return True
        raise AssertionError("unreachable: the second attempt returns")

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                             | socket.SOCK_CLOEXEC)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self._sock = sock

    def _send_file(self, data: bytes) -> None:
        fd = sealed_memfd(data)
        try:
            self._sock.sendmsg([], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                     array.array("i", [fd]))])
        finally:
            os.close(fd)

    async def _writable(self) -> None:
        loop = asyncio.get_running_loop()
        if self._sock is None:
            await asyncio.sleep(WAIT_WRITABLE)
            return
        ready = loop.create_future()
        fd = self._sock.fileno()
        loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(ready, WAIT_WRITABLE)
        except TimeoutError:
            pass
        finally:
            loop.remove_writer(fd)

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _lost(self, why: str) -> None:
        self.failed += 1
        self.error = why
        if time.monotonic() - self._reported_at >= REPORT_EVERY:
            self._report()

    def _report(self, resumed: bool = False) -> None:
        """A log line about entries lost since the last one (at most one a minute, and one
        when sending resumes)."""
        lost = self.lost - self._reported_lost
        if lost <= 0:
            return
        self._reported_at, self._reported_lost = time.monotonic(), self.lost
        if resumed:
            log.warning("journal export: resumed; %d events were not exported (%d in all; "
                        "the audit log has them)", lost, self.lost)
        else:
            log.warning("journal export: %d events not exported (%d in all; the audit log "
                        "has them): %s", lost, self.lost, self.error or "journald was full")
