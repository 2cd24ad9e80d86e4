"""DNS on the wire, sans-IO, standard library only: the filter's bounded query parser, the
bounded name reader the resolver parses upstream replies with, and the hostile packets both
are tested against.

Why not dnslib for queries: its name decoder follows compression pointers recursively and
copies the labels gathered so far at every step, so a 12 KB packet made of a long chain of
pointers referenced a thousand times keeps it busy for seconds on the one event loop, and
every session's DNS and proxy traffic stops meanwhile (issue 14, B8). A query needs none of
that: one question of plain labels and at most an OPT record. `parse_query` reads exactly
that in one forward pass and refuses everything else, so its work is bounded by
construction: every step of its loop consumes at least one byte of a name of at most 255,
whatever the packet says (`QUERY_STEPS_MAX`, checked by a property test over hostile
packets). The filter never hands a client's bytes to dnslib; it builds replies from a
`Query`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address

MAX_MESSAGE = 1232
"""The largest query accepted, over UDP and TCP alike (the EDNS payload size of DNS Flag Day
2020). A query is a header, one name of at most 255 bytes, four bytes and an OPT record:
far less."""
MAX_NAME = 255
"""A name's length on the wire, its labels' length bytes and the root's zero included."""
MAX_LABEL = 63
OPT = 41
CNAME = 5
UDP_PLAIN_LIMIT = 512
UDP_EDNS_LIMIT = 1232
OPT_RECORD = b"\x00" + struct.pack("!HHIH", OPT, UDP_EDNS_LIMIT, 0, 0)
"""The OPT record of every reply to an EDNS query: root name, our UDP size, no flags, no
options (what dnslib packs for EDNS0(udp_len=UDP_EDNS_LIMIT))."""
FORMERR, NOTIMP = 1, 4
QUERY_STEPS_MAX = 3 + (MAX_NAME - 1) // 2 + 1
"""The most steps `parse_query` can take on any input: the header, the question's type and
class, the OPT record (3), and one per label of a name of at most 255 bytes (each label
takes at least 2 of them) plus its terminating zero."""


class WireError(ValueError):
    """Bytes that are not the message they should be; `rcode` is what to answer (FORMERR,
    or NOTIMP for an opcode the filter does not serve), the message says what and where."""

    def __init__(self, message: str, rcode: int = FORMERR):
        super().__init__(message)
        self.rcode = rcode


class ParseBudget:
    """Counts the steps of a parse and refuses to go past `limit`: the proof that a parse
    is bounded (tests read `used`) and the bound itself where the input decides the work
    (a reply's compressed names)."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: float):
        self.limit = limit
        self.used = 0

    def spend(self, steps: int = 1) -> None:
        self.used += steps
        if self.used > self.limit:
            raise WireError(f"more than {self.limit} steps of parsing: refused")


def read_name(data: bytes | bytearray, pos: int, budget: ParseBudget, jumps: int = 0
              ) -> tuple[list[bytes], int]:
    """The labels of the name at `pos`, and the offset just after it.

    Follows at most `jumps` compression pointers, each to an earlier offset than the
    pointer itself (so the walk cannot loop); a query allows none. The name, expanded,
    must fit in 255 bytes; only plain labels (length 1-63) and pointers are accepted. One
    budget step per label, pointer and the final zero: at most 128 + `jumps` per name."""
    labels: list[bytes] = []
    allowed = jumps
    size = 1  # the root's zero byte
    end = -1
    limit = len(data)
    while True:
        budget.spend()
        if pos >= limit:
            raise WireError(f"name runs past the end of the message (offset {pos})")
        length = data[pos]
        if length == 0:
            return labels, (pos + 1 if end < 0 else end)
        if length >= 0xC0:
            if jumps <= 0:
                raise WireError(f"compression pointer at offset {pos}: " + (
                    f"more than {allowed} in one name" if allowed
                    else "a query's name holds none (it has nothing to point back to)"))
            if pos + 1 >= limit:
                raise WireError(f"compression pointer cut off at offset {pos}")
            target = ((length & 0x3F) << 8) | data[pos + 1]
            if target >= pos:
                raise WireError(f"compression pointer at offset {pos} does not point back")
            if end < 0:
                end = pos + 2
            jumps -= 1
            pos = target
            continue
        if length > MAX_LABEL:
            raise WireError(f"label type {length >> 6:#04b} at offset {pos} is not a plain label")
        size += length + 1
        if size > MAX_NAME:
            raise WireError(f"name longer than {MAX_NAME} bytes")
        if pos + 1 + length > limit:
            raise WireError(f"label at offset {pos} runs past the end of the message")
        labels.append(bytes(data[pos + 1 : pos + 1 + length]))
        pos += 1 + length


@dataclass(frozen=True, slots=True)
class Query:
    """A query as the filter serves it: one question, maybe an OPT record, nothing else."""

    id: int
    rd: bool
    """Recursion desired: echoed in the reply."""
    labels: tuple[bytes, ...]
    """The question name's labels exactly as sent (case kept: clients check the echo)."""
    qtype: int
    qclass: int
    edns: int | None
    """The OPT record's UDP payload size, None without an OPT record."""

    @property
    def name(self) -> str | None:
        """The question name as text, or None when a label holds a dot or a byte that is
        not ASCII (no host name does; such a name is denied, never asked upstream)."""
        try:
            texts = [label.decode("ascii") for label in self.labels]
        except UnicodeDecodeError:
            return None
        if any("." in text for text in texts):
            return None
        return ".".join(texts)

    @property
    def shown(self) -> str:
        """The question name as events and the audit log record one that is no host name:
        printable ASCII, every other byte of a label (and a label's own dot, space and
        backslash) as \\xNN. Nothing in it can act on a terminal that shows it, wherever
        the record is read, and no two names look alike."""
        return ".".join("".join(chr(b) if 0x21 <= b <= 0x7E and b not in _ESCAPED
                                else f"\\x{b:02x}" for b in label) for label in self.labels)


_ESCAPED = frozenset(b".\\")
"""Printable bytes a name shown escapes too: a label's dot would read as a label's end."""


def parse_query(data: bytes, budget: ParseBudget | None = None) -> Query | None:
    """The query in `data`; None for what gets no answer at all (too short to carry an ID,
    or a response: answering those makes reflection loops). Raises WireError for anything
    else that is not a plain query; its rcode goes back with the query's ID."""
    budget = budget if budget is not None else ParseBudget(QUERY_STEPS_MAX)
    size = len(data)
    if size < 12:
        return None
    budget.spend()
    qid, flags, qdcount, ancount, nscount, arcount = struct.unpack_from("!6H", data)
    if flags & 0x8000:
        return None
    if size > MAX_MESSAGE:
        raise WireError(f"query of {size} bytes; a query fits in {MAX_MESSAGE}")
    opcode = (flags >> 11) & 0xF
    if opcode != 0:
        raise WireError(f"opcode {opcode} is not served (only standard queries)", NOTIMP)
    if qdcount != 1 or ancount or nscount or arcount > 1:
        raise WireError(f"a query has 1 question, 0 answer, 0 authority and at most 1 "
                        f"additional record; this one has {qdcount}, {ancount}, {nscount} "
                        f"and {arcount}")
    labels, pos = read_name(data, 12, budget)
    budget.spend()
    if pos + 4 > size:
        raise WireError("question cut off before its type and class")
    qtype, qclass = struct.unpack_from("!HH", data, pos)
    pos += 4
    edns = None
    if arcount:
        budget.spend()
        if pos + 11 > size:
            raise WireError("additional record cut off")
        if data[pos] != 0:
            raise WireError("the additional record must be an OPT record with the root name")
        rtype, payload, _, rdlength = struct.unpack_from("!HHIH", data, pos + 1)
        if rtype != OPT:
            raise WireError(f"the additional record is of type {rtype}, not OPT")
        pos += 11 + rdlength
        if pos > size:
            raise WireError("OPT record's data runs past the end of the query")
        edns = payload
    if pos != size:
        raise WireError(f"{size - pos} bytes after the end of the query")
    return Query(qid, bool(flags & 0x0100), tuple(labels), qtype, qclass, edns)


def refusal(query: Query, rcode: int) -> bytes:
    """A reply with `query`'s question (as sent) and no records. Stub resolvers (glibc)
    ignore a reply whose question count differs from the query's, and would wait for
    their timeout instead of hearing "refused" at once."""
    flags = 0x8000 | (0x0100 if query.rd else 0) | 0x0080 | rcode
    name = b"".join(bytes([len(label)]) + label for label in query.labels) + b"\x00"
    return (struct.pack("!6H", query.id, flags, 1, 0, 0, 0) + name
            + struct.pack("!HH", query.qtype, query.qclass))


def error_reply(data: bytes, rcode: int) -> bytes:
    """A header-only reply to a query that will not be parsed further: its ID, its opcode
    and RD echoed, QR and RA set, the rcode. `data` must hold at least 4 bytes."""
    qid, flags = struct.unpack_from("!HH", data)
    return struct.pack("!6H", qid, 0x8000 | (flags & 0x7900) | 0x0080 | rcode, 0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class Record:
    """A record of an upstream's answer, as the resolver keeps it and a reply to a client
    carries it (`upstream.matching` reads them)."""

    name: tuple[bytes, ...]
    """The owner name's labels."""
    rtype: int
    rclass: int
    ttl: int
    rdata: bytes | tuple[bytes, ...] | None
    """The data as packed; for a CNAME, the target's labels (compressed when packed); None
    for data holding names that dnslib compresses (MX, NS, SRV...): such a reply is packed
    by dnslib, from `rr`."""
    address: IPv4Address | IPv6Address | None
    """The address of an A or AAAA record (what the policy judges and the proxy dials)."""
    text: str
    """The data as events show it."""
    rr: object = field(default=None, compare=False)
    """The record as dnslib parsed it (None when read without dnslib: A, AAAA, CNAME)."""


def pack_reply(query: Query, rcode: int, records: list[Record], ttl: int, udp: bool) -> bytes:
    """The reply to `query` with `records` (each with `ttl`; none with rdata None), as
    dnslib packs one, byte for byte (names compressed, the question as sent, an OPT record
    when the query had one); over UDP, one larger than the client takes is a truncated
    reply with the question only (TC)."""
    flags = 0x8080 | (0x0100 if query.rd else 0) | (rcode & 0xF)
    edns = query.edns is not None
    out = bytearray(struct.pack("!6H", query.id, flags, 1, len(records), 0, int(edns)))
    names: dict[tuple[bytes, ...], int] = {}
    _pack_name(out, query.labels, names)
    out += struct.pack("!HH", query.qtype, query.qclass)
    for record in records:
        _pack_name(out, record.name, names)
        if record.rtype == CNAME:
            out += struct.pack("!HHIH", record.rtype, record.rclass, ttl, 0)
            start = len(out)
            _pack_name(out, record.rdata, names)
            struct.pack_into("!H", out, start - 2, len(out) - start)
        else:
            out += struct.pack("!HHIH", record.rtype, record.rclass, ttl, len(record.rdata))
            out += record.rdata
    if edns:
        out += OPT_RECORD
    if udp and len(out) > (UDP_EDNS_LIMIT if edns else UDP_PLAIN_LIMIT):
        question = bytearray(struct.pack("!6H", query.id, flags | 0x0200, 1, 0, 0, 0))
        _pack_name(question, query.labels, {})
        return bytes(question + struct.pack("!HH", query.qtype, query.qclass))
    return bytes(out)


def _pack_name(out: bytearray, labels: tuple[bytes, ...], names: dict) -> None:
    """`labels` at the end of `out`, ending in a pointer to the longest suffix written
    before (compared as bytes, as dnslib does); each suffix written is remembered."""
    for i in range(len(labels)):
        suffix = labels[i:]
        pointer = names.get(suffix)
        if pointer is not None:
            out += struct.pack("!H", 0xC000 | pointer)
            return
        if len(out) < 0x4000:
            names[suffix] = len(out)
        out.append(len(labels[i]))
        out += labels[i]
    out.append(0)


# -- hostile packets: what the parsers above refuse, for the tests, the bench and the battery


def pointer_bomb(size: int = 12_000, chain: int = 980, layout: str = "questions",
                 qid: int = 0x1234, response: bool = False) -> bytes:
    """The packet that kept dnslib's parser busy for seconds (issue 14, B8): a chain of
    `chain` names, each one label and a pointer to the one before, and then as many
    references to the chain's tip as fit in `size` bytes. Each reference costs a parser
    that follows pointers recursively and copies labels ~chain²/2 steps.

    layout "questions": the chain and the references are all questions (qdcount ~1,700 for
    12 KB). layout "records": one question, the chain inside one answer's data (type
    65280, which dnslib keeps as bytes), the references as CNAME records whose owner and
    target both point at the tip (twice the references per byte). Self-contained on
    purpose (struct only): the battery copies it into the sandbox."""
    flags = 0x8180 if response else 0x0100
    if layout == "questions":
        body = bytearray()
        tip = 0
        for i in range(chain):
            offset = 12 + len(body)
            body += b"\x01a\x00" if i == 0 else b"\x01a" + struct.pack("!H", 0xC000 | tip)
            body += b"\x00\x01\x00\x01"
            tip = offset
        refs = max(0, (size - 12 - len(body)) // 6)
        body += (struct.pack("!H", 0xC000 | tip) + b"\x00\x01\x00\x01") * refs
        return struct.pack("!6H", qid, flags, chain + refs, 0, 0, 0) + bytes(body)
    if layout != "records":
        raise ValueError(f"layout must be 'questions' or 'records', not {layout!r}")
    question = b"\x01a\x00\x00\x01\x00\x01"
    rdata_start = 12 + len(question) + 12
    rdata = bytearray()
    tip = 0
    for i in range(chain):
        offset = rdata_start + len(rdata)
        rdata += b"\x01a\x00" if i == 0 else b"\x01a" + struct.pack("!H", 0xC000 | tip)
        tip = offset
    chain_rr = b"\xc0\x0c" + struct.pack("!HHIH", 65280, 1, 0, len(rdata)) + bytes(rdata)
    pointer = struct.pack("!H", 0xC000 | tip)
    ref = pointer + struct.pack("!HHIH", 5, 1, 0, 2) + pointer
    refs = max(0, (size - 12 - len(question) - len(chain_rr)) // len(ref))
    return (struct.pack("!6H", qid, flags, 1, 1, refs, 0) + question + chain_rr
            + ref * refs)
