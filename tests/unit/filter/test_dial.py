"""dial.py: the addresses the proxy and the git gateway try for a host, each decided before
it is tried, and the first allowed one that answers. Without sockets: `connect` is a stand-in
that answers or not, per address."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from appliance.filter import dial
from appliance.filter.dns.resolver import UpstreamError
from appliance.policy import DEFAULT_RULES, Decision, Policy, parse_host, policy_file_rules


class Resolver:
    """Answers one name, counting the lookups (host.corral and literals make none)."""

    def __init__(self, answer):
        self.answer, self.asked = answer, []

    async def addresses(self, name, session):
        self.asked.append((name, session))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def candidates(host, gateway, answer):
    resolver = Resolver(answer)
    return asyncio.run(dial.candidates(parse_host(host), gateway, resolver, "s1")), resolver


def test_host_corral_is_the_given_gateway_and_nothing_is_looked_up():
    gateway = ipaddress.ip_address("192.168.121.1")
    found, resolver = candidates("host.corral", gateway, [])
    assert found == [gateway] and resolver.asked == []
    with pytest.raises(dial.Undialable) as refused:
        candidates("host.corral", None, [])
    assert not refused.value.failed and "has no [host] gateway" in refused.value.decision.reason
    assert "corral_filter_host_gateway" in refused.value.decision.hint


def test_a_literal_is_itself_and_a_name_what_the_resolver_answers():
    found, resolver = candidates("203.0.113.9", None, [])
    assert found == [ipaddress.ip_address("203.0.113.9")] and resolver.asked == []
    found, resolver = candidates("a.test", None, ["203.0.113.1"])
    assert found == ["203.0.113.1"] and resolver.asked == [("a.test", "s1")]
    for answer, says in ((UpstreamError("all upstreams timed out"), "cannot resolve a.test"),
                         ([], "a.test has no address")):
        with pytest.raises(dial.Undialable) as failed:
            candidates("a.test", None, answer)
        assert failed.value.failed and says in failed.value.decision.reason


def first(addresses, allowed, answering):
    tried = []

    async def connect(address):
        tried.append(address)
        if address not in answering:
            raise dial.Unanswered(f"connect to {address} failed")
        return f"connection to {address}"

    def check(address):
        verdict = "allowed" if address in allowed else "refused"
        return Decision(address in allowed, f"{address} {verdict}")

    return asyncio.run(dial.first_answering(addresses, check, connect, parse_host("a.test"))), tried


def test_the_first_allowed_address_that_answers_is_dialled_and_no_refused_one_is_tried():
    (address, connection), tried = first(["1", "2", "3", "4"], {"2", "3", "4"}, {"3", "4"})
    assert (address, connection) == ("3", "connection to 3") and tried == ["2", "3"]


def test_a_failure_outranks_a_refusal_and_the_first_refusal_is_told():
    with pytest.raises(dial.Undialable) as failed:
        first(["1", "2"], {"2"}, set())
    assert failed.value.failed and failed.value.decision.reason == "connect to 2 failed"
    with pytest.raises(dial.Undialable) as refused:
        first(["1", "2"], set(), set())
    assert not refused.value.failed and refused.value.decision.reason == "1 refused"


@pytest.mark.parametrize("address", ["192.168.121.1", "127.0.0.1", "10.0.2.2"])
def test_only_host_corral_is_dialled_in_a_blocked_range(address):
    """The VM host's address is the one the appliance was given ([host] gateway), and
    private; every other name's addresses are checked against the blocked ranges, however
    they are spelt."""
    policy = Policy([*DEFAULT_RULES, *policy_file_rules(
        '[[git]]\nhost = "git.example.com"\nrepos = ["acme/widget"]\n', "corral.toml",
        "project")])
    ip = ipaddress.ip_address(address)
    assert dial.decide(policy, ip, parse_host("host.corral"), 2222).allowed
    assert dial.decide(policy, ip, parse_host("HOST.corral."), 22).allowed
    for name in ("git.example.com", "host.corral.example.com", "corral"):
        assert not dial.decide(policy, ip, parse_host(name), 22).allowed, name
