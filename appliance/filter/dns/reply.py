"""An upstream's reply, read within bounds: the question sent, and the only reply accepted.

`matching` accepts a reply only with the question's ID (compared first), the QR bit and the
same question (name, ASCII case aside, and type), before a record is read. An answer of A,
AAAA and CNAME records of plain names is read here, by wire.py's bounded name reader;
anything else by dnslib, never unbounded: at most MAX_REPLY bytes and MAX_RECORDS records,
and every name in it (owner names and the names inside CNAME, MX, SOA, SRV... data alike)
read by the bounded reader instead of dnslib's recursive one: at most MAX_JUMPS compression
pointers per name, each pointing back, and REPLY_STEPS_MAX steps for all the names of a
reply. A hostile upstream cannot freeze the loop. Pure: no I/O (upstream.py moves the
bytes).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from ipaddress import ip_address

from dnslib import QTYPE, RR, DNSError, DNSHeader, DNSLabel, DNSQuestion, DNSRecord
from dnslib.buffer import BufferError
from dnslib.label import DNSBuffer

from .wire import CNAME, MAX_LABEL, MAX_NAME, OPT, ParseBudget, Record, WireError, read_name

A, AAAA = 1, 28

MAX_REPLY = 16384
"""The largest upstream reply read (TCP may carry 65535): the filter asks with an EDNS size
of 1232, and a reply that needs more than 16 KiB for one name is refused (SERVFAIL)."""
MAX_RECORDS = 128
"""Records an upstream reply may hold in all its sections (an address set is a few dozen;
dnslib takes about 1 ms for 128)."""
MAX_JUMPS = 16
"""Compression pointers followed in one name of a reply (real names need one to three)."""
REPLY_STEPS_MAX = 4096
"""Steps (labels and pointers) the bounded reader may take over all the names of a reply:
a 1232-byte reply of 64 records needs a few hundred."""
EDNS_SIZE = 1232
"""The UDP payload size every question offers (DNS Flag Day 2020)."""


@dataclass(frozen=True, slots=True)
class Question:
    """One question to an upstream: its ID and what a reply must echo."""

    id: int
    labels: tuple[bytes, ...]
    """The name's labels, lower case (as sent)."""
    qtype: int

    def pack(self) -> bytes:
        """The query: RD, one question of class IN, an OPT record offering EDNS_SIZE."""
        return (struct.pack("!6H", self.id, 0x0100, 1, 0, 0, 1)
                + b"".join(bytes((len(label),)) + label for label in self.labels)
                + struct.pack("!xHHxHHIH", self.qtype, 1, OPT, EDNS_SIZE, 0, 0))


def labels_of(name: str) -> tuple[bytes, ...]:
    """The labels of a host name, lower case; IDNA for one that is not ASCII (as dnslib).
    Raises ValueError for a name no query can carry."""
    text = name.rstrip(".")
    try:
        raw = text.lower().encode("ascii") if text.isascii() else text.encode("idna").lower()
    except UnicodeError as exc:
        raise ValueError(f"cannot ask for {name!r}: {exc}") from None
    labels = tuple(raw.split(b".")) if raw else ()
    if len(raw) > MAX_NAME - 2 or b"" in labels or max(map(len, labels), default=0) > (
            MAX_LABEL):
        raise ValueError(f"cannot ask for {name!r}: not a name a query can carry")
    return labels


@dataclass(frozen=True, slots=True)
class Reply:
    """What the resolver keeps of an upstream's reply."""

    rcode: int
    truncated: bool
    records: tuple[Record, ...]
    """The answer section."""
    negative_ttl: int | None
    """For a reply without records: the authority's SOA TTL, or its minimum if lower."""


def matching(data: bytes, question: Question) -> Reply | None:
    """The reply to `question` in `data`, or None for anything else (a stray, a spoof, bytes
    that are no reply or exceed the bounds). The ID and the QR bit are compared first, then
    the question, before a record is read. An answer of A, AAAA and CNAME records of plain
    names is read here, by the bounded name reader; anything else by dnslib, within
    `parse_reply`'s bounds, which hold for both."""
    if len(data) < 12 or int.from_bytes(data[:2], "big") != question.id or not (
            data[2] & 0x80):
        return None
    try:
        counts = _bounded(data)
        labels, pos = read_name(data, 12, ParseBudget(MAX_NAME), MAX_JUMPS)
    except WireError:
        return None
    if (len(labels) != len(question.labels) or pos + 4 > len(data)
            or struct.unpack_from("!H", data, pos)[0] != question.qtype
            or any(a.lower() != b for a, b in zip(labels, question.labels, strict=True))):
        return None
    rcode, truncated = data[3] & 0x0F, bool(data[2] & 0x02)
    try:
        records = _plain_answer(data, pos + 4, counts[1])
    except WireError:
        return None
    if records is not None:
        return Reply(rcode, truncated, records, None)
    try:
        reply = parse_reply(data, additional=False)
    except Exception:  # hostile bytes can raise more than DNSError inside dnslib
        return None
    soa = [rr for rr in reply.auth if rr.rtype == QTYPE.SOA]
    return Reply(rcode, truncated, tuple(from_dnslib(rr) for rr in reply.rr),
                 min(soa[0].ttl, soa[0].rdata.times[-1]) if soa else None)


_PLAIN_LABEL = re.compile(rb"[A-Za-z0-9_-]{1,63}\Z")


def _plain_answer(data: bytes, pos: int, count: int) -> tuple[Record, ...] | None:
    """The answer section when it holds only A, AAAA and CNAME records of plain names
    (letters, digits, hyphens, underscores), read without dnslib; None for any other (or
    an empty one: its TTL is in the authority section), for dnslib to read. Raises
    WireError for bytes that are no such records."""
    if not count:
        return None
    budget = ParseBudget(REPLY_STEPS_MAX)
    size = len(data)
    records = []
    for _ in range(count):
        name, pos = read_name(data, pos, budget, MAX_JUMPS)
        if pos + 10 > size:
            raise WireError("record cut off")
        rtype, rclass, ttl, length = struct.unpack_from("!HHIH", data, pos)
        pos += 10
        end = pos + length
        if end > size or not all(_PLAIN_LABEL.match(label) for label in name):
            return None
        if rtype in (A, AAAA) and length == (4 if rtype == A else 16):
            rdata = bytes(data[pos:end])
            address = ip_address(rdata)
            records.append(Record(tuple(name), rtype, rclass, ttl, rdata, address,
                                  str(address)))
        elif rtype == CNAME:
            target, after = read_name(data, pos, budget, MAX_JUMPS)
            if after != end or not all(_PLAIN_LABEL.match(label) for label in target):
                return None
            records.append(Record(tuple(name), rtype, rclass, ttl, tuple(target), None,
                                  ".".join(label.decode() for label in target) + "."))
        else:
            return None
        pos = end
    return tuple(records)


def from_dnslib(rr: RR) -> Record:
    """A record as dnslib read it."""
    name = tuple(rr.rname.label)
    if rr.rtype == QTYPE.CNAME:
        return Record(name, rr.rtype, rr.rclass, rr.ttl, tuple(rr.rdata.label.label), None,
                      str(rr.rdata), rr)
    if rr.rtype in (QTYPE.A, QTYPE.AAAA):
        data = bytes(rr.rdata.data)
        address = ip_address(data)
        return Record(name, rr.rtype, rr.rclass, rr.ttl, data, address, str(address), rr)
    return Record(name, rr.rtype, rr.rclass, rr.ttl, None, None, str(rr.rdata), rr)


def _bounded(data: bytes) -> tuple[int, int, int, int]:
    """The section counts of a reply within MAX_REPLY and MAX_RECORDS. Raises WireError."""
    if len(data) > MAX_REPLY:
        raise WireError(f"reply of {len(data)} bytes; at most {MAX_REPLY} are read")
    if len(data) < 12:
        raise WireError("reply shorter than a header")
    counts = struct.unpack_from("!4H", data, 4)
    if counts[0] != 1 or sum(counts[1:]) > MAX_RECORDS:
        raise WireError(f"reply with {counts[0]} questions and {sum(counts[1:])} records; "
                        f"1 and at most {MAX_RECORDS} are read")
    return counts


class _BoundedBuffer(DNSBuffer):
    """dnslib's buffer, with names read by wire.py's bounded reader under one budget for
    the whole message (dnslib's own reader recurses and copies: see wire.py)."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.budget = ParseBudget(REPLY_STEPS_MAX)

    def decode_name(self, last=-1) -> DNSLabel:
        try:
            labels, self.offset = read_name(self.data, self.offset, self.budget, MAX_JUMPS)
            for label in labels:
                label.decode()  # dnslib refuses labels that are not UTF-8: so do we
        except (WireError, UnicodeDecodeError) as exc:
            raise BufferError(f"name at offset {self.offset}: {exc}") from None
        return DNSLabel(labels)


def parse_reply(data: bytes, additional: bool = True) -> DNSRecord:
    """An upstream reply, parsed by dnslib within bounds; without its additional section
    unless `additional` (the resolver reads the answer and authority sections only: the
    OPT record and glue are counted and bounded, not parsed). Raises DNSError or
    WireError."""
    counts = _bounded(data)
    buffer = _BoundedBuffer(data)
    try:
        header = DNSHeader.parse(buffer)
        questions = [DNSQuestion.parse(buffer)]
        sections = [[RR.parse(buffer) for _ in range(n)]
                    for n in (counts[1:] if additional else (*counts[1:3], 0))]
    except BufferError as exc:
        raise DNSError(f"malformed reply: {exc}") from None
    return DNSRecord(header, questions, sections[0], auth=sections[1], ar=sections[2])
