"""100k generated inputs per parser: each may refuse, none may crash or misbehave; and 100k
request targets, none allowed where a lax server reads a denied path.

Inputs are mutations (bit flips, truncations, insertions, deletions, duplications, splices)
of real seeds, from a fixed random seed so a failure reproduces. These are the same parsers
the services run on hostile bytes; "crash" here means any exception other than the parser's
own error type.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from dnslib import DNSRecord

from appliance.filter.dns.filter import DnsFilter
from appliance.filter.dns.resolver import Resolver
from appliance.filter.events import EventBus
from appliance.filter.http import HOP_BY_HOP, HttpError, parse_request
from appliance.filter.proxy.pipeline import OWN, Route, outgoing
from appliance.filter.proxy.sni import TlsError, parse_client_hello
from appliance.policy import Host, Policy, Rule, parse_host
from appliance.policystore import PolicyStore
from appliance.sessionconfig import parse_config
from tests.unit.filter.hello import client_hello, split_records
from tests.unit.policy import lax

pytestmark = pytest.mark.slow
CASES = 100_000


def mutations(seeds: list[bytes], count: int, rng: random.Random):
    for _ in range(count):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(7)
            if not data:
                data = bytearray(rng.randbytes(rng.randint(1, 40)))
            i = rng.randrange(len(data))
            if op == 0:
                data[i] ^= 1 << rng.randrange(8)
            elif op == 1:
                data[i] = rng.choice((0, 0xFF, 0x7F, 0x80, 0x2E, 0x0D, 0x0A, 0x20, 0x3A))
            elif op == 2:
                del data[i : i + rng.randint(1, 16)]
            elif op == 3:
                data[i:i] = rng.randbytes(rng.randint(1, 16))
            elif op == 4:
                data[i:i] = data[i : i + rng.randint(1, 64)]
            elif op == 5:
                data = data[: rng.randrange(len(data) + 1)]
            else:
                other = rng.choice(seeds)
                data = data[:i] + other[rng.randrange(len(other) + 1) :]
        yield bytes(data)


def test_dns_answer_path_survives_generated_packets(tmp_path):
    config = parse_config(f"""
[dns]
listen = ["127.0.0.1:0"]
upstream = ["127.0.0.1:9"]
rate = 1000000  # one client sends them all: the parser is under test here, not the rate
burst = 1000000
denied_rate = 1000000
denied_burst = 1000000
[state]
dir = "{tmp_path}"
""", "test")
    store = PolicyStore(config)
    dns = DnsFilter(store, Resolver(config.dns.upstream, 0.01), EventBus(recent=10),
                    config=config.dns)
    seeds = [DNSRecord.question(n, t).pack() for n, t in
             [("example.com", "A"), ("a.b.c.example.org", "AAAA"), ("host.corral", "A"),
              ("x" * 60 + ".example", "TXT"), ("example.com", "ANY"), ("y.test", "HTTPS")]]

    async def run():
        answered = 0
        for packet in mutations(seeds, CASES, random.Random(20261122)):
            reply = await dns.answer(packet, "127.0.0.1", udp=True)
            if reply is None:  # only what cannot be answered: no ID, or itself a response
                assert len(packet) < 12 or packet[2] & 0x80, packet
                continue
            answered += 1
            assert reply[:2] == packet[:2]  # the client's ID
            assert reply[2] & 0x80  # QR: it is a response
            assert len(reply) <= 1232
        return answered

    answered = asyncio.run(run())
    assert answered > CASES // 2


def test_http_request_parser_survives_generated_heads():
    seeds = [
        b"GET http://a.example/x HTTP/1.1\r\nHost: a.example\r\nAccept: */*\r\n\r\n",
        b"CONNECT a.example:443 HTTP/1.1\r\nHost: a.example:443\r\n\r\n",
        b"POST /u HTTP/1.0\r\nContent-Length: 10\r\nConnection: keep-alive\r\n\r\n",
        b"PUT http://[::1]:8080/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
    ]
    accepted = 0
    for data in mutations(seeds, CASES, random.Random(7)):
        if not data.endswith(b"\r\n\r\n"):
            data += b"\r\n\r\n"  # the reader delivers heads up to the blank line
        try:
            head = parse_request(data)
        except HttpError as exc:
            assert 400 <= exc.status < 600
            continue
        accepted += 1
        # What we accept, we re-serialise to something we read back the same way: Host from
        # the route, then the end-to-end fields in order.
        again = parse_request(outgoing(head, Route(Host(name="a.example"), 80, "/")))
        dropped = HOP_BY_HOP | head.tokens("connection") | OWN
        framing = ((("Transfer-Encoding", "chunked"),) if head.chunked else
                   (("Content-Length", str(head.content_length)),)
                   if head.content_length is not None else ())
        # an HTTP/1.0 request asks the origin to keep its connection (the proxy's own hop)
        kept = (("Connection", "keep-alive"),) if head.start[2] == "HTTP/1.0" else ()
        assert again.headers == (("Host", "a.example"), *(
            (k, v) for k, v in head.headers if k.lower() not in dropped), *framing, *kept)
        assert again.start == (head.start[0], "/", head.start[2])
    assert accepted > 1000


def test_client_hello_parser_survives_generated_hellos():
    seeds = [client_hello("example.com"), client_hello(None), client_hello("a.b.example", ()),
             split_records(client_hello("split.example"), 100)]
    parsed = 0
    for data in mutations(seeds, CASES, random.Random(13)):
        try:
            hello = parse_client_hello(data)
        except TlsError:
            continue
        if hello is not None:
            parsed += 1
            assert hello.sni is None or hello.sni == hello.sni.lower()
    assert parsed > 1000


DENIED_PATHS = ("* /gists/**", "PUT /repos/*/*/pulls/*/merge", "PUT /@acme/**", "POST /v1/*:run")


def test_request_targets_are_never_allowed_where_a_lax_server_reads_a_deny():
    """Mutations of targets spelt with every known trick (escapes once and twice, overlong
    and fullwidth forms, invisible characters, dotless i, '%3B', '%3F', '%23', format
    suffixes), judged on a host whose only allow is `* /**`: whenever one is allowed, no
    reading a lax server makes of it (tests/unit/policy/lax.py) is one a deny covers."""
    rules = [Rule.parse("request", "h.example * /**")]
    rules += [Rule.parse("request", f"!h.example {d}") for d in DENIED_PATHS]
    inspection = Policy(rules).inspection(parse_host("h.example"))
    denies = [d.split() for d in DENIED_PATHS]
    seeds = [s.encode() for s in (
        "/gists.json", "/%67ists/1", "/x/..%252F%EF%BD%87ists", "/g%C4%B1sts%3Bx",
        "/gi%E2%80%8Bsts.json.xml", "/repos/o/r/pulls/1/merge.json", "/%40acme/w%3Fx",
        "/v1/x%3Arun%23f", "/repos/o/r/pulls/1/%EF%BD%8Derge", "/ok/gists%C0%AF..%C0%AFx",
        "/a%EF%BC%8F..%EF%BC%8Fgists", "/gists%C2%AD?a=b", "/x/%E2%80%A5/gists", "/v1/x:run.")]
    allowed = 0
    for data in mutations(seeds, CASES, random.Random(21)):
        target = data.decode("latin-1")
        for method in ("GET", "PUT", "POST"):
            decision = inspection.decide(method, target)
            assert decision.reason
            if not decision.allowed:
                continue
            allowed += 1
            for reading in lax.readings(target):
                for deny_method, deny_path in denies:
                    assert not (deny_method in ("*", method) and lax.covers(deny_path, reading)), (
                        method, target, reading)
    assert allowed > 1000
