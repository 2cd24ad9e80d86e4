"""The DNS filter's decisions in process: the real store, bus and filter, no socket bound.

What needs no upstream is checked here (refusals, limits, exfiltration, malformed input);
answers from an upstream are in tests/integration/filter/test_dns.py."""

from __future__ import annotations

import asyncio
import struct

import pytest
from dnslib import EDNS0, RCODE, DNSRecord

from appliance.filter.dns.filter import DnsFilter, PendingQuery, _reply
from appliance.filter.dns.resolver import Resolver
from appliance.filter.dns.wire import parse_query, pointer_bomb
from appliance.filter.events import EventBus
from appliance.policystore import PolicyStore
from appliance.sessionconfig import parse_config

S1, S2 = "10.213.1.2", "10.213.2.2"


@pytest.fixture
def dns(tmp_path):
    (tmp_path / "s1.toml").write_text('[dns]\nallow = ["*.wild.example", "exact.example"]\n')
    (tmp_path / "s2.toml").write_text('[dns]\nallow = ["*.zone.example"]\n')
    config = parse_config(f"""
[dns]
listen = ["127.0.0.1:0"]
upstream = ["127.0.0.1:9"]
rate = 0.01
burst = 20
max_pending = 3
max_tcp = 2
exfil_names = 4
[state]
dir = "{tmp_path}/state"
[[session]]
name = "s1"
subnet = "10.213.1.0/24"
files = ["{tmp_path}/s1.toml"]
[[session]]
name = "s2"
subnet = "10.213.2.0/24"
files = ["{tmp_path}/s2.toml"]
""", "filter.toml")
    store = PolicyStore(config)
    resolver = Resolver(config.dns.upstream, 0.05, share=config.dns.cache_share)
    return DnsFilter(store, resolver, EventBus(recent=1000), config=config.dns)


def query(name: str, qid: int = 7, qtype: str = "A") -> bytes:
    record = DNSRecord.question(name, qtype)
    record.header.id = qid
    return record.pack()


def rcode(wire: bytes) -> int:
    return wire[3] & 0x0F


def answer(dns: DnsFilter, data: bytes, client: str = S1) -> bytes | None:
    return asyncio.run(dns.answer(data, client, udp=True))


@pytest.mark.parametrize("layout", ["questions", "records"])
def test_the_pointer_bomb_is_answered_formerr_at_once_and_never_parsed_by_dnslib(
        dns, layout, monkeypatch):
    def refuse(*args):
        raise AssertionError("dnslib parsed a client's bytes")

    monkeypatch.setattr(DNSRecord, "parse", refuse)
    reply = dns.first(pointer_bomb(layout=layout, qid=0xABCD), S1, udp=True)
    assert isinstance(reply, bytes)  # answered without awaiting anything
    assert reply[:2] == b"\xab\xcd" and rcode(reply) == RCODE.FORMERR
    assert "malformed query: query of" in dns.bus.recent[-1]["reason"]


def test_a_denied_name_is_answered_from_the_policy_without_dnslib_parsing_it(dns, monkeypatch):
    monkeypatch.setattr(DNSRecord, "parse", None)  # the filter must not need it
    reply = answer(dns, query("Other.Example", 99))
    assert reply[:2] == struct.pack("!H", 99) and rcode(reply) == RCODE.NXDOMAIN
    assert b"\x05Other\x07Example\x00" in reply  # the question echoed as sent
    monkeypatch.undo()
    assert str(DNSRecord.parse(reply).q.qname) == "Other.Example."


def test_what_the_policy_answers_alone_is_answered_at_once_without_dnslib(dns, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("dnslib built a reply the policy decided alone")

    queries = [query("Random0123.Other.Example", 5), query("a.wild.example", 6, "HTTPS"),
               query("Random0123.Other.Example", 8)]
    monkeypatch.setattr(DNSRecord, "pack", refuse)
    denied = dns.first(queries[0], S1, udp=True)
    assert isinstance(denied, bytes) and rcode(denied) == RCODE.NXDOMAIN  # no task, no await
    assert denied[:2] == struct.pack("!H", 5)
    assert b"\x0aRandom0123\x05Other\x07Example\x00" in denied  # the question as sent
    empty = dns.first(queries[1], S1, udp=True)  # a type the policy answers empty
    assert isinstance(empty, bytes) and rcode(empty) == RCODE.NOERROR
    assert [(e["name"], e["verdict"]) for e in list(dns.bus.recent)[-2:]] == [
        ("random0123.other.example", "deny"), ("a.wild.example", "allow")]
    escaped = []
    monkeypatch.setattr("appliance.filter.events.printable_fields", escaped.append)
    again = dns.first(queries[2], S1, udp=True)  # from the wire cache
    assert again[:2] == struct.pack("!H", 8) and again[2:] == denied[2:]
    # its event is the first's copy, published as escaped already (EventBus.emit's
    # `escaped`): its strings are not gone through again
    first, hit = [e for e in dns.bus.recent if e["name"] == "random0123.other.example"]
    assert hit is not first and {**hit, "id": 0, "ts": 0} == {**first, "id": 0, "ts": 0}
    assert not escaped
    monkeypatch.undo()
    parsed = DNSRecord.parse(denied)
    assert (parsed.header.qr, parsed.header.ra, parsed.header.rd, parsed.header.q,
            parsed.header.a) == (1, 1, 1, 1, 0)
    # with EDNS the reply carries the OPT record the full path packs, byte for byte
    with_edns = DNSRecord.question("x.other.example")
    with_edns.header.id = 11
    with_edns.add_ar(EDNS0(udp_len=4096))
    reply = dns.first(with_edns.pack(), S1, udp=True)
    parsed_query = parse_query(with_edns.pack())
    expected = _reply(parsed_query)
    expected.header.rcode = RCODE.NXDOMAIN
    assert reply == DnsFilter._pack(parsed_query, expected, udp=True)
    assert [r.rtype for r in DNSRecord.parse(reply).ar] == [41]


def test_over_the_rate_a_session_is_refused_at_once_and_told_once_a_report(dns):
    replies = [answer(dns, query(f"n{i}.other.example", i), S2) for i in range(25)]
    assert [rcode(r) for r in replies[:20]] == [RCODE.NXDOMAIN] * 20  # the burst
    assert [rcode(r) for r in replies[20:]] == [RCODE.REFUSED] * 5
    # each with its ID and question: a stub resolver ignores a reply without the question
    assert [(r.header.id, str(r.q.qname), r.header.q) for r in map(DNSRecord.parse,
            replies[20:])] == [(i, f"n{i}.other.example.", 1) for i in range(20, 25)]
    reports = [e for e in dns.bus.recent if e.get("limit") == "rate"]
    assert reports and sum(e["refused"] for e in reports) <= 5 and reports[0]["refused"] == 1
    assert reports[0]["session"] == "s2" and reports[0]["verdict"] == "deny"
    assert "DNS rate limit: more than 0.01 queries a second (burst 20)" in reports[0]["reason"]
    # s1 has a bucket of its own
    assert rcode(answer(dns, query("x.other.example"), S1)) == RCODE.NXDOMAIN
    stats = dns.stats()
    assert stats["rate_limited"] == 5 and stats["sessions"]["s2"]["rate_limited"] == 5
    assert stats["sessions"]["s1"]["rate_limited"] == 0


def denied_limited(tmp_path, burst: int) -> DnsFilter:
    """A filter whose session s1 (allowed: exact.example) may have `burst` denied names
    answered, and next to none more."""
    (tmp_path / "s1.toml").write_text('[dns]\nallow = ["exact.example"]\n')
    config = parse_config(f"""
[dns]
listen = ["127.0.0.1:0"]
upstream = ["127.0.0.1:9"]
denied_rate = 0.01
denied_burst = {burst}
[state]
dir = "{tmp_path}/state"
[[session]]
name = "s1"
subnet = "10.213.1.0/24"
files = ["{tmp_path}/s1.toml"]
""", "filter.toml")
    return DnsFilter(PolicyStore(config), Resolver(config.dns.upstream, 0.05),
                     EventBus(recent=1000), config=config.dns)


def test_past_its_denied_names_limit_a_session_gets_refused_for_new_denied_names_only(tmp_path):
    dns = denied_limited(tmp_path, 5)
    replies = [dns.first(query(f"n{i}.flood.example", i), S1, udp=True) for i in range(8)]
    assert [rcode(r) for r in replies] == [RCODE.NXDOMAIN] * 5 + [RCODE.REFUSED] * 3
    assert [DNSRecord.parse(r).header.id for r in replies[5:]] == [5, 6, 7]  # echoed
    # a denied name answered before is a cached answer: no token, still NXDOMAIN
    assert rcode(dns.first(query("n0.flood.example", 20), S1, udp=True)) == RCODE.NXDOMAIN
    # a name the policy allows is not this limit's: on its way to the upstream
    assert isinstance(dns.first(query("exact.example", 21), S1, udp=True), PendingQuery)
    reports = [e for e in dns.bus.recent if e.get("limit") == "denied"]
    assert len(reports) == 1 and reports[0]["refused"] == 1 and reports[0]["session"] == "s1"
    assert ("DNS rate limit on denied names: more than 0.01 names the policy denies a "
            "second (burst 5)") in reports[0]["reason"]
    events = [e for e in dns.bus.recent if (e.get("name") or "").startswith("n")]
    assert len(events) == 6  # one per NXDOMAIN answer (the cached one too), none refused
    stats = dns.stats()
    assert stats["denied_limited"] == 3 and stats["sessions"]["s1"]["denied_limited"] == 3
    assert stats["rate_limited"] == 0


def test_names_that_are_no_host_names_and_refused_types_take_from_the_denied_limit(tmp_path):
    """A leading hyphen (`-n1.flood.example`) is no host name: never answered but NXDOMAIN,
    and counted as a denied name, so a flood of them meets the same limit."""
    dns = denied_limited(tmp_path, 3)
    replies = [answer(dns, query(f"-n{i}.flood.example", i), S1) for i in range(3)]
    assert RCODE.REFUSED not in [rcode(r) for r in replies]  # the burst: answered
    over = dns.first(query("-n9.flood.example", 9), S1, udp=True)
    assert rcode(over) == RCODE.REFUSED and dns.stats()["denied_limited"] == 1
    assert rcode(dns.first(query("x.flood.example", 10, "ANY"), S1, udp=True)) == RCODE.REFUSED
    assert dns.stats()["denied_limited"] == 2


def test_a_session_has_a_bounded_number_of_queries_waiting_for_an_upstream(dns):
    waiting = [dns.first(query(f"n{i}.zone.example", i), S2, udp=True) for i in range(3)]
    assert all(isinstance(w, PendingQuery) for w in waiting)
    refused = DNSRecord.parse(dns.first(query("n9.zone.example", 9), S2, udp=True))
    assert (refused.header.rcode, refused.header.id, str(refused.q.qname)) == (
        RCODE.REFUSED, 9, "n9.zone.example.")
    assert isinstance(dns.first(query("a.wild.example"), S1, udp=True), PendingQuery)  # s1's own
    assert dns.stats()["sessions"]["s2"]["pending"] == 3
    assert dns.stats()["sessions"]["s2"]["pending_refused"] == 1
    # one finishes (the upstream here refuses at once: SERVFAIL), and its place is free
    assert rcode(asyncio.run(dns.finish(query("n0.zone.example", 0), S2, True, waiting[0]))
                 ) == RCODE.SERVFAIL
    assert isinstance(dns.first(query("n8.zone.example", 8), S2, udp=True), PendingQuery)
    event = next(e for e in dns.bus.recent if e.get("limit") == "pending")
    assert "more than 3 queries of this session waiting" in event["reason"]


def test_dns_over_tcp_connections_are_capped_per_session(dns):
    assert [dns.tcp_opened(S2) for _ in range(3)] == [(True, "s2"), (True, "s2"),
                                                      (False, "s2")]
    assert dns.tcp_opened(S1) == (True, "s1")
    dns.tcp_closed("s2")
    assert dns.tcp_opened(S2) == (True, "s2")
    assert dns.stats()["sessions"]["s2"]["tcp_refused"] == 1
    assert next(e for e in dns.bus.recent if e.get("limit") == "tcp")["refused"] == 1


def test_a_wildcard_name_shaped_for_exfiltration_never_goes_upstream(dns):
    chosen = ".".join(["a" * 63, "b" * 63, "c"])
    reply = answer(dns, query(f"{chosen}.wild.example"))
    assert rcode(reply) == RCODE.NXDOMAIN
    event = dns.bus.recent[-1]
    assert event["verdict"] == "deny" and event["rule"] == "*.wild.example"
    assert event["reason"].startswith("looks like DNS exfiltration: 129 characters chosen")
    assert dns.resolver.stats["upstream_queries"] == 0
    assert dns.stats()["sessions"]["s1"]["exfil_denied"] == 1


def test_distinct_names_under_a_wildcard_are_limited_but_an_exact_name_is_no_channel(dns):
    for i in range(4):  # under the limit: asked upstream (which fails here: SERVFAIL)
        assert rcode(answer(dns, query(f"n{i}.wild.example"))) == RCODE.SERVFAIL
    asked = dns.resolver.stats["upstream_queries"]
    assert rcode(answer(dns, query("n4.wild.example"))) == RCODE.NXDOMAIN
    assert "more than 4 distinct names under *.wild.example" in dns.bus.recent[-1]["reason"]
    assert dns.resolver.stats["upstream_queries"] == asked  # not asked
    assert rcode(answer(dns, query("exact.example"))) == RCODE.SERVFAIL  # asked: exact rule
    assert rcode(answer(dns, query("n0.wild.example"))) == RCODE.SERVFAIL  # seen already


def test_a_session_that_goes_leaves_no_state_behind(dns, tmp_path):
    dns.store.register("s3", "10.213.3.0/24", files=[str(tmp_path / "s2.toml")])
    client = "10.213.3.2"
    answer(dns, query("x.other.example"), client)  # a cached denial
    assert dns.stats()["sessions"]["s3"]["wire_cache_entries"] == 1
    dns.tcp_opened(client)
    dns.store.unregister("s3")
    assert "s3" not in dns.stats()["sessions"] and "s3" not in dns.limits.buckets
    assert dns.wire.entries.owned("s3") == 0


def raw_query(labels: list[bytes], qid: int = 21) -> bytes:
    """A query for a name of these labels, whatever bytes they hold (dnslib would refuse)."""
    name = b"".join(bytes([len(label)]) + label for label in labels) + b"\x00"
    return struct.pack("!6H", qid, 0x0100, 1, 0, 0, 0) + name + b"\x00\x01\x00\x01"


@pytest.mark.parametrize("labels, shown", [
    ([b"\r\x1b[2Kgithub", b"com"], "\\x0d\\x1b[2Kgithub.com"),
    ([b"\x1b]52;c;eA==\x07", b"test"], "\\x1b]52;c;eA==\\x07.test"),
    ([b"a.b", b"c d", b"e\\f"], "a\\x2eb.c\\x20d.e\\x5cf"),  # a label's dot is not a label's end
    ([b"\x9b2J\xe2\x80\xae", b"test"], "\\x9b2J\\xe2\\x80\\xae.test"),  # C1, UTF-8 of an RLO
], ids=["csi-cr", "osc52", "dot-space-backslash", "c1-bidi"])
def test_a_name_that_is_no_host_name_is_recorded_escaped_never_as_sent(dns, labels, shown):
    """Its event and audit record carry the labels' bytes as printable ASCII, every byte
    outside it (and a label's own dot, space, backslash) as \\xNN: the record replays
    safely wherever it is read, and no two names look alike."""
    reply = answer(dns, raw_query(labels))
    assert rcode(reply) == RCODE.NXDOMAIN
    event = dns.bus.recent[-1]
    assert event["name"] == shown and event["verdict"] == "deny"
    assert event["reason"] == f"'{shown}' is not a valid host name"
