"""Policy decisions, table-driven, plus properties (hypothesis) for matching and layers."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from appliance.policy import (
    DEFAULT_RULES,
    HostNameError,
    Policy,
    Rule,
    RuleError,
    blocked_range,
    parse_host,
    policy_file_rules,
)

PROJECT = """
presets = ["pypi", "github"]
[dns]
allow = ["example.com", "*.example.org"]
[http]
allow = ["example.com", "api.example.net:8443", "*.cdn.example:8*", "203.0.113.7:443"]
[tcp]
allow = ["github.com:22", "db.example.net:5432"]
[cidr]
allow = ["10.9.0.0/16"]
[host]
ports = [5432]
[deny]
names = ["upload.example.org", "*.evil.example.org"]
"""


@pytest.fixture(scope="module")
def policy() -> Policy:
    return Policy([*DEFAULT_RULES, *policy_file_rules(PROJECT, "corral.toml", "project")])


@pytest.mark.parametrize(("name", "allowed", "rule"), [
    ("example.com", True, "example.com"),
    ("EXAMPLE.com.", True, "example.com"),
    ("www.example.com", False, None),  # exact rule: no subdomains
    ("a.example.org", True, "*.example.org"),
    ("a.b.example.org", True, "*.example.org"),
    ("example.org", False, None),  # a wildcard never covers the apex
    ("upload.example.org", False, "upload.example.org"),  # deny wins inside a wildcard
    ("x.evil.example.org", False, "*.evil.example.org"),
    ("pypi.org", True, "pypi.org"),  # from a preset
    ("api.example.net", True, "api.example.net:8443"),  # http rules are answered by DNS
    ("db.example.net", True, "db.example.net:5432"),  # so are tcp rules
    ("metadata.google.internal", False, "metadata.google.internal"),  # built-in deny
    ("bücher.example.com", False, None),
])
def test_dns(policy, name, allowed, rule):
    decision = policy.decide_dns(parse_host(name))
    assert decision.allowed is allowed
    assert (decision.rule.text if decision.rule else None) == rule


@pytest.mark.parametrize(("host", "port", "allowed", "reason"), [
    ("example.com", 443, True, "example.com:443 allowed by http rule example.com"),
    ("example.com", 80, True, "example.com:80 allowed by http rule example.com"),
    ("example.com", 8080, False, "example.com is allowed, but not on port 8080"),
    ("api.example.net", 8443, True,
     "api.example.net:8443 allowed by http rule api.example.net:8443"),
    ("api.example.net", 443, False, "api.example.net is allowed, but not on port 443"),
    ("img.cdn.example", 8080, True, "img.cdn.example:8080 allowed by http rule *.cdn.example:8*"),
    ("img.cdn.example", 88, True, "img.cdn.example:88 allowed by http rule *.cdn.example:8*"),
    ("img.cdn.example", 443, False, "img.cdn.example is allowed, but not on port 443"),
    ("a.example.org", 443, False, "a.example.org is not in the http policy"),  # dns-only
    ("203.0.113.7", 443, True, "203.0.113.7:443 allowed by http rule 203.0.113.7:443"),
    ("203.0.113.8", 443, False, "IP literal 203.0.113.8 is not named by any http rule"),
    ("::ffff:203.0.113.7", 443, True, "203.0.113.7:443 allowed by http rule 203.0.113.7:443"),
    ("3405803783", 443, True, "203.0.113.7:443 allowed by http rule 203.0.113.7:443"),
    ("upload.example.org", 443, False,
     "upload.example.org denied by deny rule upload.example.org (project layer)"),
])
def test_http(policy, host, port, allowed, reason):
    decision = policy.decide_http(parse_host(host), port)
    assert (decision.allowed, decision.reason) == (allowed, reason)


def test_denials_carry_the_command_that_would_allow_them(policy):
    assert policy.decide_http(parse_host("new.example"), 443).hint == (
        "corral allow-http new.example:443")
    assert policy.decide_dns(parse_host("new.example")).hint == "corral allow-dns new.example"
    assert policy.decide_http(parse_host("2001:db8::5"), 443).hint == (
        "corral allow-http [2001:db8::5]:443")


def test_tcp_rules_and_their_ports(policy):
    assert policy.decide_tcp(parse_host("github.com"), 22).allowed
    assert not policy.decide_tcp(parse_host("github.com"), 443).allowed  # http is not tcp
    assert [r.text for r in policy.tcp_rules(parse_host("db.example.net"))] == [
        "db.example.net:5432"]
    assert policy.tcp_rules(parse_host("example.com")) == []


@pytest.mark.parametrize(("address", "allowed"), [
    ("93.184.216.34", True),
    ("10.0.0.1", False),
    ("10.9.1.1", True),  # cidr rule
    ("127.0.0.1", False),
    ("169.254.169.254", False),
    ("100.64.0.1", False),
    ("0.0.0.0", False),
    ("172.16.5.4", False),
    ("192.168.1.1", False),
    ("::1", False),
    ("fd00::1", False),
    ("fe80::1", False),
    ("::ffff:10.0.0.1", False),  # v4-mapped judged as v4
    ("::ffff:93.184.216.34", True),
    ("64:ff9b::a00:1", False),  # NAT64 of 10.0.0.1
    ("2606:4700::1111", True),
    ("203.0.113.7", True),
])
def test_addresses(policy, address, allowed):
    assert policy.decide_address(ipaddress.ip_address(address)).allowed is allowed


LITERALS = Policy([Rule.parse("http", "192.168.1.10:8080"), Rule.parse("tcp", "10.0.0.5:5432"),
                   Rule.parse("http", "[fd00::7]:443"), Rule.parse("cidr", "10.9.0.0/16"),
                   Rule.parse("http", "10.0.0.6:443"), Rule.parse("deny", "10.0.0.6")])
NAME = parse_host("intranet.example")


@pytest.mark.parametrize(("address", "host", "port", "kind", "allowed", "reason"), [
    # the client asked for the literal a rule names, on a port the rule covers
    ("192.168.1.10", "192.168.1.10", 8080, "http", True,
     "192.168.1.10:8080 named by http rule 192.168.1.10:8080"),
    ("::ffff:192.168.1.10", "::ffff:192.168.1.10", 8080, "http", True,
     "192.168.1.10:8080 named by http rule 192.168.1.10:8080"),
    ("fd00::7", "fd00::7", 443, "http", True, "[fd00::7]:443 named by http rule [fd00::7]:443"),
    ("10.0.0.5", "10.0.0.5", 5432, "tcp", True, "10.0.0.5:5432 named by tcp rule 10.0.0.5:5432"),
    # ... on another port: not opened
    ("192.168.1.10", "192.168.1.10", 22, "http", False, "192.168.1.10 is in blocked range "
     "192.168.0.0/16"),
    # ... by a rule of the other kind: not opened (a tcp rule is no http rule)
    ("10.0.0.5", "10.0.0.5", 5432, "http", False, "10.0.0.5 is in blocked range 10.0.0.0/8"),
    ("192.168.1.10", "192.168.1.10", 8080, "tcp", False, "192.168.1.10 is in blocked range "
     "192.168.0.0/16"),
    # a name that resolves to the literal: a rule naming the address does not open it
    ("192.168.1.10", "intranet.example", 8080, "http", False,
     "192.168.1.10 is in blocked range 192.168.0.0/16 (intranet.example resolved to it)"),
    ("10.0.0.5", "intranet.example", 5432, "tcp", False,
     "10.0.0.5 is in blocked range 10.0.0.0/8 (intranet.example resolved to it)"),
    # a DNS answer (no port): only a cidr rule opens a blocked address
    ("192.168.1.10", None, None, "http", False, "192.168.1.10 is in blocked range 192.168.0.0/16"),
    ("192.168.1.10", "intranet.example", None, "http", False,
     "192.168.1.10 is in blocked range 192.168.0.0/16 (intranet.example resolved to it)"),
    ("192.168.1.10", "192.168.1.10", None, "http", False,
     "192.168.1.10 is in blocked range 192.168.0.0/16"),
    # a literal that is not the address being dialled opens nothing
    ("192.168.1.11", "192.168.1.10", 8080, "http", False,
     "192.168.1.11 is in blocked range 192.168.0.0/16"),
    # a deny naming the literal wins over the rule naming it
    ("10.0.0.6", "10.0.0.6", 443, "http", False, "10.0.0.6 is in blocked range 10.0.0.0/8"),
    # a cidr rule opens its range for names, literals and DNS answers alike
    ("10.9.3.4", "intranet.example", 22, "http", True, "10.9.3.4 allowed by cidr rule 10.9.0.0/16"),
    ("10.9.3.4", None, None, "http", True, "10.9.3.4 allowed by cidr rule 10.9.0.0/16"),
    # a public address needs no rule here (the name or literal was judged before)
    ("93.184.216.34", "intranet.example", 443, "http", True, "93.184.216.34 is a public address"),
])
def test_a_rule_naming_an_ip_opens_that_literal_on_its_ports_only(address, host, port, kind,
                                                                 allowed, reason):
    asked = parse_host(host) if host is not None else None
    decision = LITERALS.decide_address(ipaddress.ip_address(address), asked, port, kind)
    assert (decision.allowed, decision.reason) == (allowed, reason)


def test_a_blocked_address_denied_names_the_cidr_rule_that_would_open_it():
    decision = LITERALS.decide_address(ipaddress.ip_address("192.168.1.10"), NAME, 8080)
    assert decision.hint.startswith('add "192.168.1.10/32" to [cidr] allow')


def test_decide_address_knows_only_http_and_tcp():
    with pytest.raises(ValueError, match="http or tcp"):
        LITERALS.decide_address(ipaddress.ip_address("10.0.0.5"), parse_host("10.0.0.5"), 5432,
                                "dns")
    with pytest.raises(ValueError, match="http or tcp"):
        LITERALS.decide_address(ipaddress.ip_address("8.8.8.8"), None, None, "https")


@settings(max_examples=300)
@given(address=st.ip_addresses(v=4), port=st.integers(1, 65535), name=st.booleans())
def test_a_literal_rule_never_opens_an_address_for_a_name_or_a_dns_answer(address, port, name):
    policy = Policy([Rule.parse("http", f"{address}:*"), Rule.parse("tcp", f"{address}:{port}")])
    asked = parse_host("some.example") if name else None
    for kind in ("http", "tcp"):
        decision = policy.decide_address(address, asked, None if not name else port, kind)
        assert decision.allowed == (blocked_range(address) is None)


def test_host_ports(policy):
    assert policy.decide_host_port(5432).allowed
    assert not policy.decide_host_port(22).allowed


def test_most_specific_rule_is_reported_inner_layer_first():
    rules = [
        Rule.parse("http", "*.example.com", "appliance"),
        Rule.parse("http", "*.api.example.com", "project"),
        Rule.parse("http", "v1.api.example.com", "default"),
        Rule.parse("http", "v1.api.example.com", "session"),
    ]
    policy = Policy(rules)
    assert policy.decide_http(parse_host("v1.api.example.com"), 443).rule.layer == "session"
    assert policy.decide_http(parse_host("v2.api.example.com"), 443).rule.text == (
        "*.api.example.com")
    assert policy.decide_http(parse_host("www.example.com"), 443).rule.layer == "appliance"


@pytest.mark.parametrize(("kind", "text", "message"), [
    ("http", "exa mple.com", "not a valid host name"),
    ("http", "*.com", "whole top-level domain"),
    ("http", "a.*.example.com", "'*' may only stand alone"),
    ("http", "example.com:0", "outside 1-65535"),
    ("http", "example.com:http", "not a number, a glob"),
    ("http", "example.com:9*9999", "matches no port"),
    ("tcp", "github.com", "needs a port"),
    ("cidr", "0.0.0.0/0", "every address"),
    ("cidr", "10.0.0.0/33", "not a network"),
    ("host", "70000", "1-65535"),
    ("deny", "example.com:443", "every port"),
    ("dns", "-bad.example", "not a valid host name"),
    ("dns", "a" * 64 + ".example", "not a valid host name"),
    ("dns", "x" * 250 + ".example", "longer than 253"),
    ("dns", "1.2.3", "looks like an IP address"),
    ("quic", "x", "unknown rule kind"),
])
def test_invalid_rules_are_rejected_with_reason(kind, text, message):
    with pytest.raises(RuleError, match=message):
        Rule.parse(kind, text)


def test_blocked_ranges_cover_the_metadata_address():
    assert str(blocked_range(ipaddress.ip_address("169.254.169.254"))) == "169.254.0.0/16"


# -- properties ------------------------------------------------------------------------

label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
tld = st.from_regex(r"[a-z]{2,6}", fullmatch=True)
names = st.tuples(st.lists(label, min_size=1, max_size=4), tld).map(
    lambda parts: ".".join([*parts[0], parts[1]]))
layers = st.sampled_from(["default", "appliance", "project", "session"])


@settings(max_examples=300)
@given(name=names, spelled=st.sampled_from([str.upper, str.title, lambda s: s + "."]))
def test_normalisation_makes_spellings_equal(name, spelled):
    policy = Policy([Rule.parse("http", name)])
    assert policy.decide_http(parse_host(spelled(name)), 443).allowed
    assert policy.decide_dns(parse_host(spelled(name))).allowed


@settings(max_examples=300)
@given(name=names, extra=label)
def test_wildcard_covers_every_subdomain_but_not_apex(name, extra):
    policy = Policy([Rule.parse("http", f"*.{name}")])
    assert policy.decide_http(parse_host(f"{extra}.{name}"), 443).allowed
    assert not policy.decide_http(parse_host(name), 443).allowed


@settings(max_examples=300)
@given(name=names, allow_layers=st.lists(layers, min_size=1, max_size=4), deny_layer=layers,
       wildcard_deny=st.booleans(), extra=label, deeper=st.lists(label, max_size=3))
def test_deny_in_any_layer_wins_over_allows_in_every_layer(
        name, allow_layers, deny_layer, wildcard_deny, extra, deeper):
    host = f"{extra}.{name}"
    below = ".".join([*deeper, host])  # the denied name itself, or a name under it
    rules = [Rule.parse("http", below, layer) for layer in allow_layers]
    rules += [Rule.parse("http", f"*.{name}", layer) for layer in allow_layers]
    rules += [Rule.parse("tcp", f"*.{name}:22", layer) for layer in allow_layers]
    rules += [Rule.parse("dns", f"*.{name}", layer) for layer in allow_layers]
    rules.append(Rule.parse("deny", f"*.{name}" if wildcard_deny else host, deny_layer))
    policy = Policy(rules)
    assert not policy.decide_http(parse_host(below), 443).allowed
    assert not policy.decide_tcp(parse_host(below), 22).allowed
    assert not policy.decide_dns(parse_host(below)).allowed
    assert policy.tcp_rules(parse_host(below)) == []


@pytest.mark.parametrize(("name", "allowed", "rule"), [
    ("s3.amazonaws.com", False, "s3.amazonaws.com"),
    ("bucket.s3.amazonaws.com", False, "s3.amazonaws.com"),  # a deny covers its subdomains
    ("a.b.c.s3.amazonaws.com", False, "s3.amazonaws.com"),
    ("xs3.amazonaws.com", True, "*.amazonaws.com"),  # label boundaries, not string suffixes
    ("s3.amazonaws.com.evil.example", False, None),
    ("ec2.amazonaws.com", True, "*.amazonaws.com"),
    ("cdn.example", True, "cdn.example"),
    ("x.cdn.example", True, "*.cdn.example"),  # a wildcard deny: subdomains only
    ("x.x.cdn.example", False, "*.x.cdn.example"),
    ("w.cdn.example", True, "*.cdn.example"),
])
def test_a_deny_covers_the_name_and_its_subdomains(name, allowed, rule):
    policy = Policy([Rule.parse("http", "*.amazonaws.com"), Rule.parse("tcp", "*.amazonaws.com:22"),
                     Rule.parse("http", "cdn.example"), Rule.parse("http", "*.cdn.example"),
                     Rule.parse("deny", "s3.amazonaws.com", "appliance"),
                     Rule.parse("deny", "*.x.cdn.example")])
    host = parse_host(name)
    for decision in (policy.decide_dns(host), policy.decide_http(host, 443)):
        assert decision.allowed is allowed
        assert (decision.rule.text if decision.rule else None) == rule
    if name.endswith("amazonaws.com"):
        assert policy.decide_tcp(host, 22).allowed is allowed
        assert bool(policy.tcp_rules(host)) is allowed


def test_a_deny_of_an_ip_literal_covers_that_address_only():
    policy = Policy([Rule.parse("http", "10.0.0.5:443"), Rule.parse("http", "10.0.0.50:443"),
                     Rule.parse("http", "5.0.0.10:443"), Rule.parse("deny", "10.0.0.5")])
    assert not policy.decide_http(parse_host("10.0.0.5"), 443).allowed
    assert policy.decide_http(parse_host("10.0.0.50"), 443).allowed
    assert policy.decide_http(parse_host("5.0.0.10"), 443).allowed


@settings(max_examples=200)
@given(rules=st.lists(st.tuples(st.sampled_from(["http", "dns", "deny"]), names, layers),
                      max_size=8), probe=names, seed=st.randoms())
def test_decision_does_not_depend_on_rule_order(rules, probe, seed):
    parsed = [Rule.parse(kind, name, layer) for kind, name, layer in rules]
    shuffled = list(parsed)
    seed.shuffle(shuffled)
    a, b = Policy(parsed), Policy(shuffled)
    host = parse_host(probe)
    assert a.decide_http(host, 443).allowed == b.decide_http(host, 443).allowed
    assert a.decide_dns(host).allowed == b.decide_dns(host).allowed


@settings(max_examples=200)
@given(name=names, allowing=st.sets(layers, min_size=1), dropped=layers, other=names)
def test_dropping_a_layer_keeps_exactly_the_allows_other_layers_give(
        name, allowing, dropped, other):
    assume(other != name)
    rules = [Rule.parse("http", name, layer) for layer in allowing]
    rules += [Rule.parse("http", other, layer) for layer in ("default", "session")]
    kept = Policy([r for r in rules if r.layer != dropped])
    assert kept.decide_http(parse_host(name), 443).allowed == bool(allowing - {dropped})
    # `other` is allowed in two layers: dropping any one layer leaves it allowed
    assert kept.decide_http(parse_host(other), 443).allowed


@settings(max_examples=500)
@given(st.ip_addresses(v=4))
def test_v4_mapped_is_judged_exactly_as_v4(address):
    mapped = ipaddress.IPv6Address(f"::ffff:{address}")
    policy = Policy()
    assert policy.decide_address(mapped).allowed == policy.decide_address(address).allowed


@given(st.text(max_size=80))
def test_parse_host_never_raises_anything_but_its_error(text):
    try:
        host = parse_host(text)
    except HostNameError:
        return
    assert (host.name is None) != (host.address is None)


def test_remembered_decisions_are_the_ones_first_made_and_stay_bounded():
    from appliance.policy.decide import MEMO_MAX

    policy = Policy(policy_file_rules(PROJECT, "corral.toml", "project"))
    host = parse_host("api.example.net")
    first = [policy.decide_http(host, 8443), policy.decide_http(host, 443),
             policy.decide_tcp(host, 8443), policy.decide_dns(host)]
    assert [d.allowed for d in first] == [True, False, False, True]  # no key collides
    again = [policy.decide_http(host, 8443), policy.decide_http(host, 443),
             policy.decide_tcp(host, 8443), policy.decide_dns(host)]
    assert again == first
    for i in range(MEMO_MAX + 10):
        policy.decide_dns(parse_host(f"n{i}.example.org"))
    assert len(policy._memo) <= MEMO_MAX
    assert policy.decide_http(parse_host("upload.example.org"), 443).allowed is False



def _two_walks(policy, host, port, kind):
    """The decision as the policy made it before it merged its indexes: the deny index
    walked first, then every matching allow listed and the first covering `port` taken."""
    from appliance.policy.decide import _index
    deny = policy.denied_by(host)
    if deny is not None:
        return False, deny
    kinds = {"http": ("http",), "tcp": ("tcp",), "dns": ("dns", "http", "tcp")}[kind]
    index = _index([r for k in kinds for r in policy.rules if r.kind == k])
    exact, wild = index
    rules = list(exact.get(host.key, ()))  # then each parent suffix, most specific first
    labels = (host.name or "").split(".")
    for i in range(1, len(labels) if host.name is not None else 0):
        rules.extend(wild.get(".".join(labels[i:]), ()))
    covering = [r for r in rules if port is None or r.port.covers(port)]
    return (True, covering[0]) if covering else (False, None)


few_labels = st.lists(st.sampled_from(("a", "b", "c")), min_size=1, max_size=4).map(
    lambda labels: ".".join(labels) + ".test")
"""Names from three labels: rules and probes that nest in each other often."""


@given(rules=st.lists(st.tuples(st.sampled_from(["http", "tcp", "dns", "deny"]), few_labels,
                                st.booleans(), st.sampled_from(["", "443", "8080"]), layers),
                      max_size=10),
       probe=few_labels, port=st.sampled_from([443, 80, 8080]))
@settings(max_examples=500, deadline=None)
def test_one_walk_decides_as_the_deny_walk_then_the_allow_walk(rules, probe, port):
    """`_judge` walks a name's labels once for denies and allows together: the same verdict
    and the same deciding rule as the two walks it replaced, for every kind."""
    parsed = []
    for kind, name, wild, ports, layer in rules:
        text = ("*." if wild else "") + name
        if kind in ("http", "tcp") and ports:
            text += f":{ports}"
        elif kind == "tcp":
            text += ":22"  # a tcp rule names its ports
        parsed.append(Rule.parse(kind, text, layer=layer))
    policy, host = Policy(parsed), parse_host(probe)
    for kind, asked in (("http", port), ("tcp", port), ("dns", None)):
        decision = (policy.decide_dns(host) if kind == "dns" else
                    policy.decide_http(host, port) if kind == "http" else
                    policy.decide_tcp(host, port))
        assert (decision.allowed, decision.rule) == _two_walks(policy, host, asked, kind)


# -- overlap of host patterns (corral check, corral learn) ---------------------------------

LABELS = ("a", "b", "c")
names_of = st.lists(st.sampled_from(LABELS), min_size=2, max_size=4).map(".".join)


@given(names_of, names_of, st.booleans(), st.booleans(),
       st.sampled_from(("http", "deny")), st.sampled_from(("http", "deny")))
@settings(max_examples=400, deadline=None)
def test_two_patterns_overlap_exactly_when_some_name_is_covered_by_both(a, b, wild_a, wild_b,
                                                                         kind_a, kind_b):
    """Against the decisions themselves: every name of up to five labels over the same
    alphabet is asked of each rule alone."""
    from itertools import product

    from appliance.policy.rules import overlap

    rule_a = Rule.parse(kind_a, f"*.{a}" if wild_a else a)
    rule_b = Rule.parse(kind_b, f"*.{b}" if wild_b else b)

    def covers(rule, name):
        policy = Policy([rule])
        host = parse_host(name)
        return (policy.denied_by(host) is not None if rule.kind == "deny"
                else policy.decide_http(host, 443).allowed)

    names = [".".join(p) for n in range(2, 6) for p in product(LABELS, repeat=n)]
    both = any(covers(rule_a, n) and covers(rule_b, n) for n in names)
    assert overlap(rule_a, rule_b) is both and overlap(rule_b, rule_a) is both


@pytest.mark.parametrize(("kind", "port"), [  # a tcp rule always names its port
    (kind, port) for kind in ("http", "tcp", "dns") for port in (None, 22, 80, 443, 8443)
    if (kind, port) != ("tcp", None)])
@pytest.mark.parametrize("name", ["example.com", "203.0.113.7", "2001:db8::1"])
def test_the_one_rule_for_a_port_is_the_first_of_the_rules_for_it(kind, name, port):
    from appliance.policy.grants import rule_text, rule_texts
    assert rule_text(kind, name, port) == rule_texts(kind, name, () if port is None else
                                                     (port,))[0]
