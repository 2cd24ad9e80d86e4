"""Names on an inspected host's address (THREATS 29), sans-IO: which names the filter
remembers addresses of (Watch), what it remembers (AddressBook), and the decision
(neighbour): a name that is not inspected, dialled at an address where a name the session
inspects was seen, gets no tunnel."""

from __future__ import annotations

import ipaddress

import pytest

from appliance.filter.proxy.neighbours import PER_PATTERN, REMEMBER, AddressBook, Watch, neighbour
from appliance.policy import DEFAULT_RULES, Policy, dedupe, parse_host, policy_file_rules
from appliance.policy.names import unmap

ip = ipaddress.ip_address
EDGE, OTHER, EDGE6 = ip("192.0.2.1"), ip("192.0.2.2"), ip("2001:db8::1")


def policy_of(text: str) -> Policy:
    return Policy(dedupe([*DEFAULT_RULES, *policy_file_rules(text, "corral.toml", "project")]))


INSPECTS = policy_of("""
[http]
allow = ["front.test", "api.test", "*.wild.test", "192.0.2.9", "*.cdn.test"]
[[inspect]]
host = "api.test"
deny = ["DELETE /**"]
[[inspect]]
host = "*.wild.test"
[[git]]
host = "git.test"
repos = ["a/b"]
[[inspect]]
host = "192.0.2.9"
""")
NOTHING = policy_of('[http]\nallow = ["front.test", "api.test"]\n')
"""Another session's policy: it inspects nothing, so nothing is its neighbour."""


def book_with(*entries: tuple[str, str, object], until: float = 100.0) -> AddressBook:
    """A book where each (pattern, name, address) was seen, remembered until `until`."""
    book = AddressBook()
    for pattern, name, address in entries:
        book.record(pattern, name, [address], until)
    return book


def never_bound(name: str) -> bool:
    return False


@pytest.mark.parametrize(("policy", "host", "address", "entries", "refused_for"), [
    # the inspected host's exact name seen at the address: its neighbour is refused
    (INSPECTS, "front.test", EDGE, [("api.test", "api.test", EDGE)], "api.test"),
    # another address: nothing shared
    (INSPECTS, "front.test", OTHER, [("api.test", "api.test", EDGE)], None),
    # the session does not inspect api.test (another session does): nothing to evade
    (NOTHING, "front.test", EDGE, [("api.test", "api.test", EDGE)], None),
    # a name under an inspected wildcard seen there
    (INSPECTS, "front.test", EDGE, [("*.wild.test", "x.wild.test", EDGE)], "x.wild.test"),
    # a [[git]] host is inspected too
    (INSPECTS, "front.test", EDGE, [("git.test", "git.test", EDGE)], "git.test"),
    # IPv6, and v4-mapped judged as the IPv4 address it carries
    (INSPECTS, "front.test", EDGE6, [("api.test", "api.test", EDGE6)], "api.test"),
    (INSPECTS, "front.test", ip("::ffff:192.0.2.1"), [("api.test", "api.test", EDGE)],
     "api.test"),
    # an inspected IP literal: every name on it, whatever the book says
    (INSPECTS, "front.test", ip("192.0.2.9"), [], "192.0.2.9"),
    # a CONNECT to an IP literal that an inspected name uses
    (INSPECTS, "192.0.2.1", EDGE, [("api.test", "api.test", EDGE)], "api.test"),
    # a name is no neighbour of itself (a wildcard of another session saw it)
    (NOTHING, "x.wild.test", EDGE, [("*.wild.test", "x.wild.test", EDGE)], None),
])
def test_a_name_on_an_inspected_hosts_address_is_refused(policy, host, address, entries,
                                                        refused_for):
    decision = neighbour(policy, parse_host(host), address, book_with(*entries).at(
        address, 0.0), never_bound)
    if refused_for is None:
        assert decision is None
        return
    assert decision is not None and not decision.allowed
    assert str(unmap(address)) in decision.reason and refused_for in decision.reason
    assert decision.hint.startswith(f"corral inspect {host} ")
    assert "[http] allow" in decision.hint
    assert decision.rule is None and not decision.hint.startswith("corral allow-")


def test_a_secrets_host_counts_as_inspected():
    book = book_with(("vault.test", "vault.test", EDGE))
    bound = {"vault.test"}.__contains__
    decision = neighbour(NOTHING, parse_host("front.test"), EDGE, book.at(EDGE, 0.0), bound)
    assert decision is not None and "vault.test" in decision.reason


def test_what_was_seen_is_forgotten_when_its_time_comes():
    book = book_with(("api.test", "api.test", EDGE), until=10.0)
    assert book.at(EDGE, 9.9) != ()
    assert book.at(EDGE, 10.0) == ()


def test_record_says_which_addresses_are_new_to_an_inspected_name():
    book = AddressBook()
    assert book.record("api.test", "api.test", [EDGE], 10.0) == [EDGE]
    assert book.record("api.test", "api.test", [EDGE], 20.0) == []  # later, not new
    assert book.at(EDGE, 15.0)[0].until == 20.0
    assert book.record("api.test", "api.test", [EDGE, OTHER], 20.0) == [OTHER]
    assert book.record("*.wild.test", "x.wild.test", [EDGE], 20.0) == [EDGE]  # new pattern


def test_a_flood_under_a_wildcard_evicts_only_its_own_addresses():
    """An agent choosing names under an inspected wildcard (and their answers, if it serves
    the zone) fills that pattern's share, never the exact names' ones."""
    book = book_with(("api.test", "api.test", EDGE))
    for i in range(PER_PATTERN * 3):
        book.record("*.wild.test", f"n{i}.wild.test", [ip(f"198.51.{i // 256}.{i % 256}")],
                    100.0)
    assert [s.name for s in book.at(EDGE, 0.0)] == ["api.test"]
    assert len(book) == 1 + PER_PATTERN


def test_thousands_of_names_on_one_address_cost_one_entry_per_pattern():
    """A CDN: many names under one inspected wildcard on one address are one entry (the
    latest name) — a decision looks at the patterns seen there, never at the names."""
    book = AddressBook()
    for i in range(10_000):
        book.record("*.wild.test", f"n{i}.wild.test", [EDGE], 100.0)
    seen = book.at(EDGE, 0.0)
    assert len(seen) == 1 and seen[0].name == "n9999.wild.test"


def test_keep_drops_what_no_policy_inspects_any_more():
    book = book_with(("api.test", "api.test", EDGE), ("*.wild.test", "x.wild.test", EDGE))
    book.keep({"*.wild.test"})
    assert [s.name for s in book.at(EDGE, 0.0)] == ["x.wild.test"]
    assert len(book) == 1


@pytest.mark.parametrize(("name", "patterns"), [
    ("api.test", ["api.test"]),
    ("x.wild.test", ["*.wild.test"]),
    ("a.x.wild.test", ["*.wild.test"]),
    ("wild.test", []),  # a wildcard covers subdomains, not the apex
    ("git.test", ["git.test"]),
    ("front.test", []),
    ("x.vault.test", ["*.vault.test"]),  # a secret's wildcard host
])
def test_watch_names_the_patterns_a_resolved_name_falls_under(name, patterns):
    watch = Watch.of([INSPECTS, NOTHING], ["*.vault.test", "vault.test"])
    assert list(watch.patterns(name)) == patterns


def test_watch_resolves_the_exact_names_of_a_policy_never_its_literals():
    watch = Watch.of([INSPECTS], ["vault.test", "*.vault.test"])
    assert watch.names(INSPECTS) == ("api.test", "git.test", "vault.test")
    assert watch.names(NOTHING) == ("vault.test",)
    assert set(watch.all_patterns()) == {"api.test", "git.test", "*.wild.test", "vault.test",
                                         "*.vault.test"}


def test_remember_outlasts_short_ttls():
    """Round-robin answers change at every TTL: an address an inspected name was given an
    hour ago is still one where its front-end serves it."""
    assert REMEMBER >= 3600


def test_a_tcp_rules_refusal_points_to_the_proxy_not_to_inspection():
    """Nothing reads a tcp rule's bytes: inspecting the name would not help it."""
    book = book_with(("api.test", "api.test", EDGE))
    decision = neighbour(INSPECTS, parse_host("front.test"), EDGE, book.at(EDGE, 0.0),
                         never_bound, "tcp")
    assert "a direct connection to front.test" in decision.reason
    assert "through the proxy" in decision.hint and "tcp rule" in decision.hint
    assert not decision.hint.startswith("corral ")
