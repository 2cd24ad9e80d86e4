"""judge_query, table-style: a query's bytes and a policy in, a verdict out; no socket, no
filter. Then the guard: the resolver is asked with an Allowed verdict only, which only
judge_query makes."""

from __future__ import annotations

import asyncio
import struct
import time

import pytest
from dnslib import QTYPE, RCODE
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.filter.dns.filter import DnsFilter, PendingQuery
from appliance.filter.dns.judge import (
    Allowed,
    HostGateway,
    NotHostName,
    PolicyAnswer,
    RefusedQuestion,
    judge_query,
)
from appliance.filter.dns.resolver import Resolver
from appliance.filter.dns.wire import Query, parse_query
from appliance.filter.events import EventBus
from appliance.policy import Decision, Policy, parse_host, policy_file_rules
from appliance.policystore import PolicyStore
from appliance.sessionconfig import parse_config

POLICY = Policy(policy_file_rules("""
[dns]
allow = ["exact.example", "*.wild.example"]
[deny]
names = ["bad.wild.example"]
[host]
ports = [5432]
""", "corral.toml", "project"))
IN, CH = 1, 3
HTTPS, SVCB = 65, 64


def wire(labels: list[bytes], qtype: int = QTYPE.A, qclass: int = IN, qid: int = 7) -> bytes:
    """A query for a name of these labels, whatever bytes they hold."""
    name = b"".join(bytes([len(label)]) + label for label in labels) + b"\x00"
    return struct.pack("!6H", qid, 0x0100, 1, 0, 0, 0) + name + struct.pack("!HH", qtype,
                                                                           qclass)


def judged(name: str | list[bytes], qtype: int = QTYPE.A, qclass: int = IN):
    labels = name if isinstance(name, list) else [p.encode() for p in name.split(".")]
    return judge_query(parse_query(wire(labels, qtype, qclass)), POLICY)


@pytest.mark.parametrize("name, qtype, qclass, kind, counted, detail", [
    # the class, and the types no policy answers: before anything is read of the name
    ("exact.example", QTYPE.A, CH, RefusedQuestion, True, None),
    ("exact.example", QTYPE.A, 255, RefusedQuestion, True, None),  # class ANY
    ("exact.example", QTYPE.ANY, IN, RefusedQuestion, True, None),
    ("exact.example", QTYPE.AXFR, IN, RefusedQuestion, True, None),
    ("exact.example", QTYPE.IXFR, IN, RefusedQuestion, True, None),
    ("host.corral", QTYPE.ANY, IN, RefusedQuestion, True, None),
    ([b"a.b", b"example"], QTYPE.ANY, IN, RefusedQuestion, True, None),
    # names that are no host names: counted, but an address written as a name is not
    ([b"a.b", b"example"], QTYPE.A, IN, NotHostName, True, "a\\x2eb.example"),
    ([b"caf\xc3\xa9", b"example"], QTYPE.A, IN, NotHostName, True, "caf\\xc3\\xa9.example"),
    ("-x.flood.example", QTYPE.A, IN, NotHostName, True, "-x.flood.example"),
    ([b"a b", b"example"], QTYPE.A, IN, NotHostName, True, "a\\x20b.example"),
    ("*.wild.example", QTYPE.A, IN, NotHostName, True, "*.wild.example"),
    ([], QTYPE.A, IN, NotHostName, True, ""),  # the root
    ("192.0.2.1", QTYPE.A, IN, NotHostName, False, "192.0.2.1"),
    # host.corral, whatever the case and type (HTTPS too: before the empty types)
    ("host.corral", QTYPE.A, IN, HostGateway, False, None),
    ("HOST.Corral", QTYPE.AAAA, IN, HostGateway, False, None),
    ("host.corral", HTTPS, IN, HostGateway, False, None),
    # denied: NXDOMAIN, by the default deny or a deny rule, whatever the type
    ("other.example", QTYPE.A, IN, PolicyAnswer, True, (RCODE.NXDOMAIN, None)),
    ("other.example", HTTPS, IN, PolicyAnswer, True, (RCODE.NXDOMAIN, None)),
    ("www.exact.example", QTYPE.A, IN, PolicyAnswer, True, (RCODE.NXDOMAIN, None)),
    ("bad.wild.example", QTYPE.A, IN, PolicyAnswer, True,
     (RCODE.NXDOMAIN, "bad.wild.example")),
    # allowed, of the types answered empty: NOERROR without records, not counted
    ("exact.example", HTTPS, IN, PolicyAnswer, False, (RCODE.NOERROR, "exact.example")),
    ("a.wild.example", SVCB, IN, PolicyAnswer, False, (RCODE.NOERROR, "*.wild.example")),
    # allowed: the one verdict that may go upstream
    ("exact.example", QTYPE.A, IN, Allowed, False, ("exact.example", "exact.example")),
    ("EXACT.Example", QTYPE.AAAA, IN, Allowed, False, ("exact.example", "exact.example")),
    ("x.a.wild.example", QTYPE.TXT, IN, Allowed, False, ("x.a.wild.example", "*.wild.example")),
], ids=lambda v: v if isinstance(v, str) else None)
def test_each_query_gets_the_verdict_of_its_first_matching_check(name, qtype, qclass, kind,
                                                                 counted, detail):
    verdict = judged(name, qtype, qclass)
    assert type(verdict) is kind and verdict.counted is counted
    if kind is NotHostName:
        assert verdict.shown == detail
        assert verdict.decision == Decision(False, f"'{detail}' is not a valid host name")
    elif kind is PolicyAnswer:
        rcode, rule = detail
        assert verdict.rcode == rcode
        assert (verdict.decision.rule.host if verdict.decision.rule else None) == rule
    elif kind is Allowed:
        shown, rule = detail
        assert verdict.host.name == shown and verdict.decision.allowed
        assert verdict.decision.rule.host == rule


labels = st.lists(st.binary(min_size=1, max_size=20), min_size=0, max_size=5)


@settings(max_examples=500, deadline=None)
@given(labels=labels, qtype=st.sampled_from([1, 28, 16, 64, 65, 255, 252, 251, 5]),
       qclass=st.sampled_from([1, 3, 255]), suffix=st.sampled_from(
           [[], [b"exact", b"example"], [b"wild", b"example"], [b"host", b"corral"]]))
def test_whatever_the_query_allowed_means_the_policy_allows_that_name(labels, qtype, qclass,
                                                                      suffix):
    query = Query(1, True, tuple(labels + suffix), qtype, qclass, None)
    verdict = judge_query(query, POLICY)
    assert type(verdict) in (RefusedQuestion, NotHostName, HostGateway, PolicyAnswer, Allowed)
    if type(verdict) is Allowed:
        assert qclass == IN and qtype not in (255, 252, 251, 64, 65)
        assert POLICY.decide_dns(parse_host(query.name)).allowed
        assert verdict.host == parse_host(query.name)


def test_an_allowed_verdict_is_made_by_judge_query_only():
    host, decision = parse_host("exact.example"), Decision(True, "forged")
    for forged in ((host, decision), (host, decision, object()), (host, decision, None)):
        with pytest.raises(TypeError, match=r"made by judge\.judge_query only"):
            Allowed(*forged)


@pytest.fixture
def dns(tmp_path):
    (tmp_path / "s1.toml").write_text('[dns]\nallow = ["exact.example"]\n')
    config = parse_config(f"""
[dns]
listen = ["127.0.0.1:0"]
upstream = ["127.0.0.1:9"]
denied_rate = 0.01
denied_burst = 1
[state]
dir = "{tmp_path}/state"
[[session]]
name = "s1"
subnet = "10.213.1.0/24"
files = ["{tmp_path}/s1.toml"]
""", "filter.toml")
    return DnsFilter(PolicyStore(config), Resolver(config.dns.upstream, 0.05),
                     EventBus(recent=100), config=config.dns)


S1 = "10.213.1.2"


def forgeries():
    """Everything but a judged Allowed (verdicts that say allowed, look-alikes), and what
    finish() answers a pending query carrying it: never an upstream's answer."""
    host = parse_host("exact.example")

    class LooksAllowed:
        counted = False

        def __init__(self):
            self.host, self.decision = host, Decision(True, "forged")

    return [(PolicyAnswer(host, Decision(True, "allowed, but answered by the policy")),
             RCODE.SERVFAIL), (NotHostName("exact.example", False), RCODE.NXDOMAIN),
            (LooksAllowed(), RCODE.SERVFAIL), (None, RCODE.SERVFAIL)]


def test_the_resolver_is_never_asked_without_an_allowed_verdict(dns):
    query = parse_query(wire([b"exact", b"example"]))
    for forged, _ in forgeries():
        with pytest.raises(TypeError, match="asked with an Allowed verdict of judge_query"):
            asyncio.run(dns._ask_upstream(forged, query, S1, "s1", POLICY, {}, True))
    # a pending query carrying one is answered, its place freed, nothing asked upstream
    for forged, rcode in forgeries():
        assert dns.limits.begin("s1")
        pending = PendingQuery(("k",), "s1", POLICY, query, forged)
        reply = asyncio.run(dns.finish(wire([b"exact", b"example"]), S1, True, pending))
        assert reply[3] & 0x0F == rcode and dns.limits.pending["s1"] == 0
    assert dns.resolver.stats["upstream_queries"] == 0 and not dns.resolver._inflight
    # the judged verdict goes: the upstream is asked (and refuses here: SERVFAIL)
    verdict = judge_query(query, POLICY)
    reply = asyncio.run(dns._ask_upstream(verdict, query, S1, "s1", POLICY, {}, True))
    assert reply[3] & 0x0F == RCODE.SERVFAIL
    assert dns.resolver.stats["upstream_queries"] == 1


@pytest.mark.parametrize("name, qtype, qclass, at_once, after_limit", [
    # (what first() gives with tokens left, and once the denied-names limit is spent):
    # an rcode sent at once, or the verdict that waits in a PendingQuery
    ("x.other.example", QTYPE.A, IN, RCODE.NXDOMAIN, RCODE.REFUSED),
    ("exact.example", HTTPS, IN, RCODE.NOERROR, RCODE.NOERROR),
    ("exact.example", QTYPE.ANY, IN, RefusedQuestion, RCODE.REFUSED),
    ("exact.example", QTYPE.A, CH, RefusedQuestion, RCODE.REFUSED),
    ("-x.other.example", QTYPE.A, IN, NotHostName, RCODE.REFUSED),
    ("192.0.2.1", QTYPE.A, IN, NotHostName, NotHostName),
    ("host.corral", QTYPE.A, IN, HostGateway, HostGateway),
    ("exact.example", QTYPE.A, IN, Allowed, Allowed),
], ids=lambda v: v if isinstance(v, str) else None)
def test_what_the_filter_does_with_each_verdict_before_and_past_the_denied_limit(
        dns, name, qtype, qclass, at_once, after_limit):
    data = wire([p.encode() for p in name.split(".")], qtype, qclass)
    for expected in (at_once, after_limit):
        first = dns.first(data, S1, udp=True)
        if isinstance(expected, type):
            assert isinstance(first, PendingQuery) and type(first.verdict) is expected
            dns.limits.end("s1")
        else:
            assert isinstance(first, bytes) and first[3] & 0x0F == expected
        dns.wire.drop_session("s1")  # judged again, not served from the wire cache
        dns.limits.admit_denied("s1", time.monotonic())  # the one token: spent now if not yet
