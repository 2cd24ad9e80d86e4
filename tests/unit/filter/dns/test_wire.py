"""The bounded DNS parsers: the filter's query parser and the resolver's reply reader, on
good, malformed and hostile packets; their work bounded by construction (steps counted)."""

from __future__ import annotations

import contextlib
import ipaddress
import math
import struct

import pytest
from dnslib import EDNS0, QTYPE, RR, DNSError, DNSRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.filter.dns.reply import (
    MAX_JUMPS,
    MAX_RECORDS,
    REPLY_STEPS_MAX,
    Question,
    _BoundedBuffer,
    from_dnslib,
    labels_of,
    matching,
    parse_reply,
)
from appliance.filter.dns.wire import (
    FORMERR,
    MAX_MESSAGE,
    NOTIMP,
    QUERY_STEPS_MAX,
    ParseBudget,
    WireError,
    error_reply,
    pack_reply,
    parse_query,
    pointer_bomb,
    refusal,
)


def header(qd=1, an=0, ns=0, ar=0, flags=0x0100, qid=0xBEEF) -> bytes:
    return struct.pack("!6H", qid, flags, qd, an, ns, ar)


def name(*labels: bytes) -> bytes:
    return b"".join(bytes([len(label)]) + label for label in labels) + b"\x00"


A_IN = b"\x00\x01\x00\x01"
OPT_RECORD = b"\x00" + struct.pack("!HHIH", 41, 1232, 0, 0)
QUERY = header() + name(b"Example", b"COM") + A_IN


# -- queries ---------------------------------------------------------------------------


def test_a_query_parses_with_its_name_as_sent():
    query = parse_query(QUERY)
    assert (query.id, query.rd, query.labels, query.qtype, query.qclass, query.edns) == (
        0xBEEF, True, (b"Example", b"COM"), 1, 1, None)
    assert query.name == "Example.COM"  # case kept for the echo; the policy lower-cases


def test_a_query_with_an_opt_record_parses_as_dnslib_writes_it():
    record = DNSRecord.question("a.example", "AAAA")
    record.add_ar(EDNS0(udp_len=4096, flags="do"))
    query = parse_query(record.pack())
    assert (query.qtype, query.edns, query.labels) == (28, 4096, (b"a", b"example"))


@pytest.mark.parametrize(("labels", "text"), [
    ((b"a.b", b"example"), None),  # a dot inside a label is no host name
    ((b"caf\xc3\xa9", b"example"), None),  # nor is a byte that is not ASCII
    ((), ""),  # the root
])
def test_a_name_that_is_no_host_name_has_no_text(labels, text):
    assert parse_query(header() + name(*labels) + A_IN).name == text


@pytest.mark.parametrize("data", [b"", b"\x12\x34", header()[:11], header(flags=0x8180) +
                                  name(b"a") + A_IN])
def test_nothing_is_answered_without_an_id_or_to_a_response(data):
    assert parse_query(data) is None


@pytest.mark.parametrize(("data", "rcode", "message"), [
    (QUERY + OPT_RECORD[:0] + b"\x00" * (MAX_MESSAGE - len(QUERY) + 1), FORMERR, "1232"),
    (header(flags=0x2800) + name(b"a") + A_IN, NOTIMP, "opcode 5"),
    (header(flags=0x1000) + name(b"a") + A_IN, NOTIMP, "opcode 2"),
    (header(qd=0), FORMERR, "this one has 0, 0, 0 and 0"),
    (header(qd=2) + name(b"a") + A_IN + name(b"b") + A_IN, FORMERR, "has 2, 0, 0 and 0"),
    (header(an=1) + name(b"a") + A_IN, FORMERR, "has 1, 1, 0 and 0"),
    (header(ns=1) + name(b"a") + A_IN, FORMERR, "has 1, 0, 1 and 0"),
    (header(ar=2) + name(b"a") + A_IN + OPT_RECORD * 2, FORMERR, "has 1, 0, 0 and 2"),
    (header(qd=65535, ar=65535), FORMERR, "65535"),
    (header() + b"\x01a\xc0\x0c" + A_IN, FORMERR, "a query's name holds none"),
    (header() + b"\xc0\x0c" + A_IN, FORMERR, "compression pointer"),
    (header() + b"\x41" + b"a" * 65 + b"\x00" + A_IN, FORMERR, "not a plain label"),
    (header() + b"\x81a\x00" + A_IN, FORMERR, "not a plain label"),
    (header() + b"\x3fa" * 1 + b"\x00", FORMERR, "runs past the end"),
    (header() + name(*[b"a" * 63] * 4) + A_IN, FORMERR, "longer than 255"),
    (header() + b"\x01a", FORMERR, "runs past the end"),
    (header() + name(b"a") + b"\x00\x01", FORMERR, "type and class"),
    (header(ar=1) + name(b"a") + A_IN + OPT_RECORD[:7], FORMERR, "cut off"),
    (header(ar=1) + name(b"a") + A_IN + b"\x01a\x00" + OPT_RECORD[1:], FORMERR, "root name"),
    (header(ar=1) + name(b"a") + A_IN + b"\x00" + struct.pack("!HHIH", 1, 1, 0, 0), FORMERR,
     "type 1, not OPT"),
    (header(ar=1) + name(b"a") + A_IN + b"\x00" + struct.pack("!HHIH", 41, 512, 0, 8)
     + b"\x00" * 4, FORMERR, "runs past the end"),
    (QUERY + b"\x00", FORMERR, "1 bytes after the end"),
    (header(ar=1) + name(b"a") + A_IN + OPT_RECORD + b"xx", FORMERR, "2 bytes after"),
])
def test_anything_but_a_plain_query_is_refused_with_a_reason(data, rcode, message):
    with pytest.raises(WireError, match=message) as caught:
        parse_query(data)
    assert caught.value.rcode == rcode
    reply = error_reply(data, caught.value.rcode)
    assert reply[:2] == data[:2] and reply[3] & 0x0F == rcode and reply[2] & 0x80


def test_a_name_of_exactly_255_bytes_is_a_name():
    labels = [b"a" * 63] * 3 + [b"b" * 61]  # 4 + 63*3 + 61 + 1 = 255
    assert len(parse_query(header() + name(*labels) + A_IN).labels) == 4


def test_a_refusal_carries_the_question_as_sent():
    data = header(ar=1) + name(b"Mixed", b"CASE") + b"\x00\x1c\x00\x01" + OPT_RECORD
    reply = refusal(parse_query(data), 5)
    assert reply == struct.pack("!6H", 0xBEEF, 0x8185, 1, 0, 0, 0) + name(
        b"Mixed", b"CASE") + b"\x00\x1c\x00\x01"
    parsed = DNSRecord.parse(reply)
    assert (str(parsed.q.qname), parsed.header.rcode, parsed.header.rd) == ("Mixed.CASE.", 5, 1)


def test_the_error_reply_echoes_id_opcode_and_rd_and_nothing_else():
    reply = error_reply(b"\xab\xcd\x29\x00", 4)  # opcode 5, RD
    assert reply == b"\xab\xcd\xa9\x84" + b"\x00" * 8


@pytest.mark.parametrize("layout", ["questions", "records"])
def test_the_pointer_bomb_is_refused_in_a_few_steps(layout):
    bomb = pointer_bomb(layout=layout)
    assert len(bomb) > 11_000
    budget = ParseBudget(math.inf)
    with pytest.raises(WireError, match="1232"):
        parse_query(bomb, budget)
    assert budget.used == 1
    # the same shape inside 1232 bytes is refused by its counts before any name is read
    small = pointer_bomb(size=1200, chain=100, layout=layout)
    budget = ParseBudget(math.inf)
    with pytest.raises(WireError, match="a query has 1 question"):
        parse_query(small, budget)
    assert budget.used == 1


def test_the_pointer_bomb_is_what_it_says_for_a_parser_that_follows_pointers():
    bomb = pointer_bomb(size=600, chain=30)
    record = DNSRecord.parse(bomb)  # small enough for dnslib to finish
    refs = (600 - 12 - 30 * 8 + 1) // 6
    assert len(record.questions) == 30 + refs
    # every reference expands to the whole chain: the work is refs x chain labels (and
    # dnslib copies the labels at every pointer, chain^2 / 2 per reference)
    assert all(len(q.qname.label) == 30 for q in record.questions[30:])


# -- the work bound, over generated hostile packets --------------------------------------

labels = st.binary(min_size=0, max_size=70)
chains = st.integers(1, 400).map(lambda n: pointer_bomb(size=n * 10, chain=max(1, n // 4)))


@st.composite
def hostile(draw):
    """Packets an agent could send: random bytes, pointer chains, huge counts, truncated OPT
    records, mutated valid queries."""
    kind = draw(st.sampled_from(["random", "header", "chain", "opt", "mutated", "labels",
                                 "backward"]))
    if kind == "random":
        return draw(st.binary(max_size=1400))
    flags = draw(st.integers(0, 0xFFFF))
    counts = draw(st.tuples(*[st.sampled_from([0, 1, 2, 255, 65535])] * 4))
    qid = struct.pack("!HH", draw(st.integers(0, 0xFFFF)), flags)
    if kind == "header":
        return qid + struct.pack("!4H", *counts) + draw(st.binary(max_size=1300))
    if kind == "chain":
        return draw(chains)
    if kind == "opt":
        cut = draw(st.integers(0, len(OPT_RECORD) + 8))
        return (header(ar=1) + name(b"a") + A_IN + (OPT_RECORD + b"\x00\x0a\x00\x04abcd")[:cut])
    if kind == "backward":  # labels, and pointers back to what came before: long walks
        data = bytearray(header())
        previous = 12
        for token, length, where in draw(st.lists(st.tuples(
                st.sampled_from(["label", "pointer", "previous"]),
                st.one_of(st.integers(1, 3), st.integers(0, 63)), st.floats(0, 1)),
                max_size=400)):
            start = len(data)
            if token == "label":
                data += bytes([length]) + b"a" * length
            else:
                target = previous if token == "previous" else int(where * (start - 1))
                data += struct.pack("!H", 0xC000 | target)
            previous = start
        return bytes(data[:MAX_MESSAGE])
    if kind == "labels":  # long names, pointers and reserved label types in the question
        parts = draw(st.lists(st.one_of(
            labels.map(lambda b: bytes([len(b) & 0xFF]) + b),
            st.integers(0, 0x3FFF).map(lambda p: struct.pack("!H", 0xC000 | p)),
            st.integers(0x40, 0xBF).map(lambda t: bytes([t]))), max_size=300))
        return header() + b"".join(parts) + draw(st.binary(max_size=20))
    data = bytearray(QUERY + OPT_RECORD)
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data) - 1))
        data[at] = draw(st.integers(0, 255))
    return bytes(data)


@settings(max_examples=1500)
@given(hostile())
def test_any_packet_is_parsed_or_refused_within_a_fixed_number_of_steps(data):
    budget = ParseBudget(math.inf)  # counts, never stops: the bound is the parser's own
    try:
        query = parse_query(data, budget)
    except WireError as exc:
        assert exc.rcode in (FORMERR, NOTIMP)
        assert len(error_reply(data, exc.rcode)) == 12
    else:
        assert query is None or len(data) <= MAX_MESSAGE
    assert budget.used <= QUERY_STEPS_MAX


def test_the_step_bound_is_reached_by_the_longest_name():
    labels = [b"a"] * 127  # 127 labels of one byte: 255 bytes with the root
    budget = ParseBudget(math.inf)
    parse_query(header(ar=1) + name(*labels) + A_IN + OPT_RECORD, budget)
    assert budget.used == QUERY_STEPS_MAX


# -- upstream replies ------------------------------------------------------------------


def reply_to(query: DNSRecord, *zone_lines: str, auth: str = "") -> bytes:
    reply = query.reply()
    for line in zone_lines:
        reply.add_answer(*RR.fromZone(line))
    if auth:
        reply.add_auth(*RR.fromZone(auth))
    return reply.pack()


@pytest.mark.parametrize("lines", [
    ["www.example.com. 60 IN CNAME cdn.example.net.", "cdn.example.net. 60 IN A 192.0.2.1",
     "cdn.example.net. 60 IN A 192.0.2.2"],
    ["www.example.com. 60 IN MX 10 mail.example.com."],
    ["www.example.com. 60 IN SRV 1 2 443 srv.example.com."],
    ["www.example.com. 60 IN TXT \"v=spf1 include:example.net ~all\""],
    ["www.example.com. 60 IN AAAA 2001:db8::1"],
    [f"www.example.com. 60 IN A 198.51.100.{i}" for i in range(MAX_RECORDS - 1)],
])
def test_a_reply_reads_as_dnslib_reads_it(lines):
    query = DNSRecord.question("www.example.com")
    data = reply_to(query, *lines, auth="example.com. 60 IN SOA ns.example.com. "
                                         "host.example.com. 1 2 3 4 5")
    assert parse_reply(data) == DNSRecord.parse(data)
    assert read_as_dnslib(matching(data, question_of(query)), DNSRecord.parse(data))


def read_as_dnslib(reply, record: DNSRecord) -> bool:
    """Whether `reply` (upstream.Reply) holds what dnslib reads in the same bytes."""
    assert (reply.rcode, reply.truncated) == (record.header.rcode, bool(record.header.tc))
    assert len(reply.records) == len(record.rr)
    for ours, rr in zip(reply.records, record.rr, strict=True):
        assert (ours.name, ours.rtype, ours.rclass, ours.ttl) == (
            tuple(rr.rname.label), rr.rtype, rr.rclass, rr.ttl)
        if rr.rtype in (QTYPE.A, QTYPE.AAAA):
            assert ours.address == ipaddress.ip_address(str(rr.rdata))
        elif rr.rtype == QTYPE.CNAME:
            assert ours.rdata == tuple(rr.rdata.label.label)
        else:
            assert ours.rr == rr and ours.rdata is None
    return True


def question_of(query: DNSRecord) -> Question:
    return Question(query.header.id, labels_of(str(query.q.qname)), query.q.qtype)


def test_a_reply_is_matched_by_id_and_question_before_anything_else():
    query = DNSRecord.question("www.example.com")
    question = question_of(query)
    other = DNSRecord.question("www.example.com")
    other.header.id = query.header.id ^ 1
    assert matching(reply_to(other, "www.example.com. 60 IN A 192.0.2.1"), question) is None
    evil = DNSRecord.question("evil.example")
    evil.header.id = query.header.id
    assert matching(reply_to(evil, "evil.example. 60 IN A 192.0.2.1"), question) is None
    aaaa = DNSRecord.question("www.example.com", "AAAA")
    aaaa.header.id = query.header.id
    assert matching(reply_to(aaaa, "www.example.com. 60 IN AAAA 2001:db8::1"), question) is None
    longer = DNSRecord.question("www.example.com.evil.example")
    longer.header.id = query.header.id
    assert matching(reply_to(longer), question) is None
    assert matching(query.pack(), question) is None  # not a response
    shouted = DNSRecord.question("WWW.Example.COM")  # a 0x20-style echo is the question
    shouted.header.id = query.header.id
    assert matching(reply_to(shouted, "WWW.Example.COM. 60 IN A 192.0.2.1"), question)


def test_a_matching_reply_is_read_without_its_additional_section_which_is_still_bounded():
    query = DNSRecord.question("www.example.com")
    reply = DNSRecord.parse(reply_to(query, "www.example.com. 60 IN A 192.0.2.1"))
    reply.add_ar(EDNS0(udp_len=1232))
    data = reply.pack()
    assert len(parse_reply(data).ar) == 1 and parse_reply(data, additional=False).ar == []
    assert str(matching(data, question_of(query)).records[0].address) == "192.0.2.1"
    flooded = data[:10] + struct.pack("!H", MAX_RECORDS) + data[12:]  # counted all the same
    assert matching(flooded, question_of(query)) is None


@pytest.mark.parametrize(("data", "message"), [
    (pointer_bomb(response=True), "1 and at most"),
    (pointer_bomb(layout="records", response=True), "1 and at most"),
    (pointer_bomb(size=70_000, layout="records", response=True), "bytes; at most"),
])
def test_the_pointer_bomb_from_an_upstream_is_refused_before_dnslib_sees_it(data, message):
    with pytest.raises(WireError, match=message):
        parse_reply(data)


def longest_name_referenced(times: int) -> bytes:
    """Within every size and count bound: a name of 127 labels, and CNAME records whose
    owner and target point at it."""
    qname = b"\x01a" * 127 + b"\x00"
    ref = b"\xc0\x0c" + struct.pack("!HHIH", 5, 1, 0, 2) + b"\xc0\x0c"
    return header(an=times, flags=0x8180) + qname + A_IN + ref * times


def test_a_reply_within_every_size_bound_still_gets_only_its_budget_of_name_work():
    data = longest_name_referenced(MAX_RECORDS)
    with pytest.raises(DNSError, match=f"more than {REPLY_STEPS_MAX} steps"):
        parse_reply(data)
    assert parse_reply(longest_name_referenced(2)).a.rname == parse_reply(
        longest_name_referenced(2)).q.qname


def pointer_chain(pointers: int) -> bytes:
    """A reply whose CNAME target is the last of `pointers` pointers, each to the one
    before, the first to the question name (the chain sits in an opaque record's data)."""
    data = bytearray(header(an=2, flags=0x8180) + name(b"a") + A_IN)
    data += b"\xc0\x0c" + struct.pack("!HHIH", 65280, 1, 0, 2 * pointers)
    tip = 12
    for _ in range(pointers):
        offset = len(data)
        data += struct.pack("!H", 0xC000 | tip)
        tip = offset
    return bytes(data) + b"\xc0\x0c" + struct.pack("!HHIH", 5, 1, 0, 2) + struct.pack(
        "!H", 0xC000 | tip)


def test_a_name_in_a_reply_follows_a_bounded_number_of_pointers_each_pointing_back():
    assert str(parse_reply(pointer_chain(MAX_JUMPS - 1)).rr[1].rdata) == "a."
    with pytest.raises(DNSError, match=f"more than {MAX_JUMPS} in one name"):
        parse_reply(pointer_chain(MAX_JUMPS))
    forward = header(an=1, flags=0x8180) + name(b"a") + A_IN + b"\xc0\x40" + struct.pack(
        "!HHIH", 1, 1, 0, 4) + b"\x01\x02\x03\x04"
    with pytest.raises(DNSError, match="does not point back"):
        parse_reply(forward)


@settings(max_examples=500)
@given(hostile())
def test_any_reply_is_read_or_refused_and_its_names_cost_at_most_the_budget(data):
    data = data[:2] + bytes([data[2] | 0x80]) + data[3:] if len(data) > 2 else data
    steps = []
    real = _BoundedBuffer.decode_name

    def counted(self, last=-1):
        try:
            return real(self, last)
        finally:
            steps.append(self.budget.used)

    _BoundedBuffer.decode_name = counted
    try:
        with contextlib.suppress(WireError, DNSError):
            parse_reply(data)
    finally:
        _BoundedBuffer.decode_name = real
    assert not steps or steps[-1] <= REPLY_STEPS_MAX + 1


ZONE = [
    "{q}. 60 IN A 192.0.2.1", "{q}. 60 IN AAAA 2001:db8::1", "{q}. 60 IN CNAME cdn.example.net.",
    "cdn.example.net. 60 IN CNAME {q}.", "cdn.example.net. 60 IN A 198.51.100.7",
    "{q}. 60 IN MX 10 mail.{q}.", "{q}. 60 IN TXT \"v=spf1 -all\"",
    "{q}. 60 IN SRV 1 2 443 srv.example.net.", "other.example. 60 IN NS ns.{q}.",
    "{q}. 60 IN A 10.0.0.1", "x.{q}. 60 IN CNAME {q}.",
]


def dnslib_reply(query, rcode: int, records, ttl: int, udp: bool) -> bytes:
    """The reply as the filter packed it with dnslib before pack_reply."""
    from appliance.filter.dns.filter import DnsFilter, _reply
    reply = _reply(query)
    reply.header.rcode = rcode
    for rr in records:
        reply.add_answer(RR(rr.rname, rr.rtype, rr.rclass, ttl, rr.rdata))
    return DnsFilter._pack(query, reply, udp)


@settings(max_examples=300)
@given(st.sampled_from(["www.example.com", "WWW.Example.COM", "a.b.c.d.example"]),
       st.lists(st.sampled_from(ZONE[:5] + ZONE[-2:]), max_size=40)
       | st.lists(st.sampled_from(ZONE), max_size=40), st.booleans(), st.booleans(),
       st.sampled_from([0, 3]), st.integers(1, 86400))
def test_a_reply_is_packed_as_dnslib_packed_it(qname, lines, edns, udp, rcode, ttl):
    record = DNSRecord.question(qname)
    if edns:
        record.add_ar(EDNS0(udp_len=4096))
    query = parse_query(record.pack())
    records = tuple(RR.fromZone(line.format(q=qname.lower()))[0] for line in lines)
    ours = tuple(from_dnslib(rr) for rr in records)
    packable = all(record.rdata is not None for record in ours)
    assert packable == all(rr.rtype in (QTYPE.A, QTYPE.AAAA, QTYPE.CNAME) for rr in records)
    if packable:
        assert pack_reply(query, rcode, list(ours), ttl, udp) == dnslib_reply(
            query, rcode, records, ttl, udp)


@settings(max_examples=300)
@given(st.sampled_from(["www.example.com", "WWW.Example.COM", "x_y.example", "b\\.ad.example"]),
       st.lists(st.sampled_from(ZONE[:5] + ZONE[-2:] + ["{q}. 60 IN CNAME we\\ird.example."]),
                max_size=40),
       st.sampled_from([0, 3]))
def test_an_answer_read_without_dnslib_is_what_dnslib_reads(qname, lines, rcode):
    query = DNSRecord.question(qname)
    reply = query.reply()
    reply.header.rcode = rcode
    for line in lines:
        reply.add_answer(*RR.fromZone(line.format(q=qname)))
    data = reply.pack()
    got = matching(data, Question(query.header.id, tuple(label.lower() for label in
                                                         query.q.qname.label), QTYPE.A))
    assert read_as_dnslib(got, DNSRecord.parse(data))
    assert got.records == tuple(from_dnslib(rr) for rr in DNSRecord.parse(data).rr)
