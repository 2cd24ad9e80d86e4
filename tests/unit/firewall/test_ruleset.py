"""The ruleset as data: one table, never a flush, the shape every session gets."""

from __future__ import annotations

import json

import pytest

from appliance.firewall.ruleset import build, build_base, listener_ports
from appliance.sessionconfig import parse_config

from .verdict import Packet, Unknown, verdict

CONFIG = """
[dns]
listen = ["10.213.1.1:53"]
upstream = ["192.0.2.53:53"]
[proxy]
listen = ["10.213.1.1:3128"]
transparent_http = ["gateway:3129"]
transparent_tls = ["gateway:3130"]
[[session]]
name = "s1"
subnet = "10.213.1.0/24"
[[session]]
name = "s2"
subnet = "10.213.2.0/24"
gateway = "10.213.2.254"
"""


@pytest.fixture
def commands():
    return build(parse_config(CONFIG, "filter.toml"), {"s1": [("203.0.113.7", [22])]})


def rules(commands, chain):
    return [c["add"]["rule"] for c in commands if "rule" in c.get("add", {})
            and c["add"]["rule"]["chain"] == chain]


def test_only_the_corral_table_is_touched(commands):
    text = json.dumps(commands)
    assert "flush" not in text
    tables = {c[verb][kind].get("table", c[verb][kind].get("name"))
              for c in commands for verb in c for kind in c[verb]}
    assert tables == {"corral"}
    assert commands[:3] == [{"add": {"table": {"family": "inet", "name": "corral"}}},
                            {"delete": {"table": {"family": "inet", "name": "corral"}}},
                            {"add": {"table": {"family": "inet", "name": "corral"}}}]


def sessions_rules(commands, prefix):
    """The rules of every session's own chain behind a base chain (`input_s1`, ...)."""
    return [r for s in ("s1", "s2") for r in rules(commands, f"session_{prefix}_{s}")]


def test_each_session_reaches_only_its_own_gateway_ports(commands):
    text = json.dumps(sessions_rules(commands, "input"))
    assert '"right": "10.213.1.1"' in text and '"right": "10.213.2.254"' in text
    assert '{"set": [53, 3128, 3129, 3130]}' in text
    last = rules(commands, "filter_input")[-1]
    assert last["expr"][-1] == {"jump": {"target": "deny_unknown"}}


def test_the_git_gateway_is_reached_on_the_sessions_gateway_alone():
    config = parse_config(CONFIG.replace("[[session]]", '[sshgate]\nlisten = ["gateway:2222"]\n'
                                         "[[session]]", 1), "filter.toml")
    commands = build(config, {})
    assert '{"set": [53, 2222, 3128, 3129, 3130]}' in json.dumps(rules(commands,
                                                                      "session_input_s1"))
    assert verdict(commands, "filter_input",
                   Packet("podman3", S1, S1_GW, dport=2222, local=True)) == "accept"
    assert verdict(commands, "filter_input", Packet("podman3", S1, "10.213.2.254", dport=2222,
                                                    local=True)) == "reject:deny_s1"


def test_redirects_and_static_tcp(commands):
    redirects = [r["expr"][-1] for r in sessions_rules(commands, "nat")]
    assert redirects == [{"redirect": {"port": 3129}}, {"redirect": {"port": 3130}}] * 2
    forward = json.dumps(rules(commands, "session_forward_s1"))
    assert "203.0.113.7" in forward and "@learned" in forward


def test_every_session_has_a_counted_logged_reject(commands):
    counters = {c["add"]["counter"]["name"] for c in commands if "counter" in c.get("add", {})}
    assert counters == {"deny_s1", "deny_s2", "deny_unknown", "deny_ipv6", "quiet_multicast"}
    first = rules(commands, "deny_s1")[0]["expr"]
    assert first[0] == {"counter": "deny_s1"} and "limit" in first[1] and "log" in first[2]


def test_port_zero_cannot_be_firewalled():
    config = parse_config(CONFIG.replace("10.213.1.1:3128", "10.213.1.1:0"), "filter.toml")
    with pytest.raises(ValueError, match="fixed proxy ports"):
        listener_ports(config)


def test_base_ruleset_denies_sandbox_interfaces():
    text = json.dumps(build_base(["corral*"]))
    assert text.count('"jump": {"target": "deny_unknown"}') == 3


def test_learned_allowances_of_a_gone_session_are_not_carried_over():
    def element(source):
        return {"elem": {"val": {"concat": [source, "203.0.113.22", 22]}, "timeout": 300}}

    learned = [element("10.213.1.2"), element("10.213.9.2")]  # s1's, and a stopped session's
    commands = build(parse_config(CONFIG, "filter.toml"), learned=learned)
    added = [c["add"]["element"]["elem"] for c in commands if "element" in c.get("add", {})
             and c["add"]["element"]["name"] == "learned"]
    assert added == [[element("10.213.1.2")]]


def test_static_tcp_rules_open_the_named_address_on_the_ports_the_policy_allows(tmp_path):
    from appliance.firewall.ruleset import static_tcp_rules
    from appliance.policystore import PolicyStore

    (tmp_path / "s1.toml").write_text("""
[tcp]
allow = ["203.0.113.7:22", "10.0.0.5:5432", "198.51.100.9:22", "[2001:db8::1]:22",
         "db.example.net:5432"]
[deny]
names = ["198.51.100.9"]
""")
    config = parse_config(f"""
[state]
dir = "{tmp_path}/state"
[[session]]
name = "s1"
subnet = "10.213.1.0/24"
files = ["{tmp_path}/s1.toml"]
""", "filter.toml")
    # an IPv4 literal on its ports (in a blocked range too: the rule names it); a denied
    # literal opens nothing; v6 has no path out; names are taught by DNS answers, not here
    assert static_tcp_rules(PolicyStore(config)) == {
        "s1": [("203.0.113.7", [22]), ("10.0.0.5", [5432])]}


# What the ruleset does with packets (tests/unit/firewall/verdict.py walks its chains).
# The config's sandbox interfaces are the default, podman*; "leak3" matches no pattern.
S1, S1_GW, WEB, WEB6 = "10.213.1.2", "10.213.1.1", "203.0.113.10", "3fff:ff::10"


@pytest.fixture
def ruleset():
    return build(parse_config(CONFIG, "filter.toml"), {"s1": [("203.0.113.7", [22])]})


@pytest.mark.parametrize("iif", ["podman3", "leak3"])
@pytest.mark.parametrize(("packet", "chain", "expected"), [
    (Packet("", S1, WEB, dport=22), "filter_forward", "reject:deny_s1"),
    (Packet("", S1, WEB, l4="udp", dport=443), "filter_forward", "reject:deny_s1"),
    (Packet("", S1, "203.0.113.7", dport=22), "filter_forward", "accept"),
    (Packet("", S1, WEB, dport=22, learned={(S1, WEB, 22)}), "filter_forward", "accept"),
    (Packet("", S1, "10.213.2.2", dport=22), "filter_forward", "reject:deny_s1"),
    (Packet("", S1, S1_GW, l4="udp", dport=53, local=True), "filter_input", "accept"),
    (Packet("", S1, S1_GW, dport=3128, local=True), "filter_input", "accept"),
    (Packet("", S1, S1_GW, dport=22, local=True), "filter_input", "reject:deny_s1"),
    (Packet("", S1, "10.213.2.254", dport=53, local=True), "filter_input", "reject:deny_s1"),
    (Packet("", S1, WEB, dport=443), "nat_prerouting", "redirect:3130"),
    (Packet("", S1, WEB, dport=80), "nat_prerouting", "redirect:3129"),
], ids=["tcp-out", "udp-out", "tcp-rule-by-ip", "learned", "other-session", "dns", "proxy",
        "gateway-ssh", "other-gateway", "https-redirected", "http-redirected"])
def test_ipv4_of_a_session_is_held_by_its_subnet_on_any_interface(ruleset, iif, packet, chain,
                                                                   expected):
    """A bridge whose name matches no pattern gets the same IPv4 verdicts: the session's
    rules match its source addresses, not its interface."""
    packet.iif = iif
    assert verdict(ruleset, chain, packet) == expected


@pytest.mark.parametrize(("iif", "oif"), [("podman3", "up0"), ("leak3", "up0"),
                                           ("up0", "leak3"), ("eth0", "eth1")])
@pytest.mark.parametrize("l4", ["tcp", "udp"])
def test_no_ipv6_is_forwarded_from_any_interface(ruleset, iif, oif, l4):
    packet = Packet(iif, "2001:db8:3::2", WEB6, l4=l4, oif=oif)
    assert verdict(ruleset, "filter_forward", packet) == "reject:deny_ipv6"


@pytest.mark.parametrize(("state", "expected"), [
    ("established", "accept"),
    ("new", "reject:deny_unknown"),  # a cut flow's next packet (nf_conntrack_tcp_loose on)
    ("invalid", "drop"),  # the same with tcp_loose off: never forwarded in
])
def test_a_packet_routed_in_to_a_sandbox_passes_only_on_an_established_flow(ruleset, state,
                                                                            expected):
    """What becomes of the destination's next packet once a taken-back element's conntrack
    entry is deleted: conntrack sees it as new (or invalid), and nothing that is not an
    established flow is routed in to a sandbox."""
    packet = Packet("up0", WEB, S1, dport=40000, oif="podman3", state=state)
    assert verdict(ruleset, "filter_forward", packet) == expected


def test_a_cut_flows_next_packet_from_the_sandbox_is_rejected_as_new(ruleset):
    """The sandbox's side of a cut flow: no conntrack entry, no element: a reset. Until
    conntrack forgets it, an established flow goes on without its element (it left the set
    first, or its time ran out): only the deletion of its entry ends it, both ways at once."""
    flow = Packet("podman3", S1, WEB, dport=22, state="established")
    assert verdict(ruleset, "filter_forward", flow) == "accept"
    flow.state = "related"
    assert verdict(ruleset, "filter_forward", flow) == "accept"
    for state in ("new", "invalid"):
        flow.state = state
        assert verdict(ruleset, "filter_forward", flow) == "reject:deny_s1"
    flow.learned = {(S1, WEB, 22)}
    flow.state = "new"
    assert verdict(ruleset, "filter_forward", flow) == "accept"  # while it was allowed


def test_ipv6_flows_established_before_the_ruleset_go_on(ruleset):
    packet = Packet("eth0", "2001:db8:3::2", WEB6, oif="eth1", state="established")
    assert verdict(ruleset, "filter_forward", packet) == "accept"


def test_ipv6_to_the_appliance_is_rejected_on_sandbox_interfaces_only(ruleset):
    to_ssh = Packet("podman3", "2001:db8:3::2", "2001:db8:3::1", dport=22, local=True)
    assert verdict(ruleset, "filter_input", to_ssh) == "reject:deny_ipv6"
    to_ssh.iif = "eth0"  # the management interface: the appliance's own IPv6 is untouched
    assert verdict(ruleset, "filter_input", to_ssh) == "accept"
    solicit = Packet("podman3", "fe80::2", "ff02::1:ff00:1", l4="icmpv6",
                     icmpv6_type="nd-neighbor-solicit", local=True)
    assert verdict(ruleset, "filter_input", solicit) == "accept"  # rejects come fast


def test_spoofed_or_unrouted_sources_on_a_sandbox_interface_are_dropped(ruleset):
    assert verdict(ruleset, "raw_prerouting", Packet("podman3", "192.0.2.9", WEB)) == "drop"
    assert verdict(ruleset, "raw_prerouting",
                   Packet("podman3", S1, WEB, routed_back=False)) == "drop"
    assert verdict(ruleset, "raw_prerouting", Packet("podman3", S1, WEB)) == "accept"


def test_the_verdict_reader_refuses_what_it_does_not_know(ruleset):
    strange = [{"add": {"chain": {"name": "c"}}},
               {"add": {"rule": {"chain": "c", "expr": [{"queue": {"num": 1}}]}}}]
    with pytest.raises(Unknown):
        verdict(strange, "c", Packet("eth0", S1, WEB))


@pytest.mark.parametrize(("packet", "expected"), [
    (Packet("podman3", S1, S1_GW, l4="udp", dport=53, local=True), "accept"),
    (Packet("podman3", S1, S1_GW, l4="udp", dport=53, local=True, flooding=True),
     "reject:deny_s1"),
    (Packet("podman3", S1, S1_GW, dport=3128, local=True, flooding=True), "reject:deny_s1"),
    (Packet("podman3", S1, S1_GW, dport=3128, local=True, connections=576), "accept"),
    (Packet("podman3", S1, S1_GW, dport=3128, local=True, connections=577),
     "reject:deny_s1"),
    (Packet("podman3", S1, S1_GW, dport=53, local=True, connections=577), "reject:deny_s1"),
    # an established flow is never cut by the rate or the count of new ones
    (Packet("podman3", S1, S1_GW, dport=3128, local=True, state="established",
            flooding=True, connections=10_000), "accept"),
], ids=["dns", "dns-flood", "connection-flood", "at-the-cap", "past-the-cap", "dns-tcp-past",
        "established"])
def test_a_sessions_floods_are_stopped_in_the_kernel(ruleset, packet, expected):
    """Past `[firewall] dns_packets` / `new_connections` a second, or past twice the
    session's connection caps ((256 + 32) * 2 = 576), the kernel rejects: before the
    queues every session shares fill up."""
    assert verdict(ruleset, "filter_input", packet) == expected


# -- link-local multicast: counted quietly, never a denial (issue 26, F15) -----------------

@pytest.mark.parametrize("packet", [
    Packet("podman3", S1, "224.0.0.252", l4="udp", dport=5355, local=True),     # LLMNR
    Packet("podman3", S1_GW, "224.0.0.252", l4="udp", dport=5355, local=True),  # ours, looped
    Packet("podman3", S1, "224.0.0.251", l4="udp", dport=5353, local=True),     # mDNS
    Packet("podman3", S1, "224.0.0.22", l4="igmp", dport=0, local=True),        # IGMP reports
    Packet("podman3", "fe80::2", "ff02::1:3", l4="udp", dport=5355, local=True),
    Packet("podman3", "fe80::2", "ff02::fb", l4="udp", dport=5353, local=True),
    Packet("podman3", "fe80::2", "ff02::16", l4="icmpv6", icmpv6_type="mld2-listener-report",
           local=True),
], ids=["llmnr", "llmnr-looped", "mdns", "igmp", "llmnr6", "mdns6", "mld"])
def test_link_local_multicast_on_a_sandbox_link_is_dropped_quietly(ruleset, packet):
    """What hosts send on every new link (name queries, group reports) never leaves it:
    dropped and counted (`quiet_multicast`), not a reported reject that buries real ones."""
    assert verdict(ruleset, "filter_input", packet) == "drop"
    quiet = [r["expr"] for r in rules(ruleset, "filter_input")
             if {"counter": "quiet_multicast"} in r["expr"]]
    assert len(quiet) == 2 and all(e[-1] == {"drop": None} for e in quiet)  # v4 and v6
    assert not [s for e in quiet for s in e if "log" in s]  # counted, never reported


def test_other_multicast_and_the_management_link_are_unchanged(ruleset):
    ssdp = Packet("podman3", S1, "239.255.255.250", l4="udp", dport=1900, local=True)
    assert verdict(ruleset, "filter_input", ssdp) == "reject:deny_s1"  # not link-local
    site = Packet("podman3", "fe80::2", "ff05::1:3", l4="udp", dport=547, local=True)
    assert verdict(ruleset, "filter_input", site) == "reject:deny_ipv6"
    own = Packet("eth0", "192.0.2.7", "224.0.0.252", l4="udp", dport=5355, local=True)
    assert verdict(ruleset, "filter_input", own) == "accept"  # not a sandbox interface


def test_the_quiet_counter_is_carried_over_a_reapply():
    config = parse_config(CONFIG, "filter.toml")
    commands = build(config, counts={"quiet_multicast": {"packets": 7, "bytes": 700}})
    (counter,) = [c["add"]["counter"] for c in commands if "counter" in c.get("add", {})
                  and c["add"]["counter"]["name"] == "quiet_multicast"]
    assert (counter["packets"], counter["bytes"]) == (7, 700)


# -- a session that comes: its chains and elements alone (ruleset.additions) ---------------

def _store(tmp_path, *registered: tuple[str, str, list[str]]):
    from appliance.policystore import PolicyStore
    store = PolicyStore(parse_config(CONFIG + f'[state]\ndir = "{tmp_path}/state"\n',
                                     "filter.toml"))
    for name, subnet, files in registered:
        store.register(name, subnet, None, files)
    return store


def test_a_session_that_comes_is_added_alone_and_judged_as_in_the_whole(tmp_path):
    from appliance.firewall.ruleset import additions, for_store
    (tmp_path / "tcp.toml").write_text('[tcp]\nallow = ["203.0.113.7:22"]\n')
    store = _store(tmp_path, ("r1", "10.213.5.0/24", []))
    change = store.plan_register("late", "10.213.9.0/24", None, [str(tmp_path / "tcp.toml")])
    added = additions(store, change)
    assert not [c for c in added if "delete" in c or "table" in c.get("add", {})]
    made = [c["create"] for c in added if "create" in c]  # a second time would fail
    assert {m["chain"]["name"] for m in made if "chain" in m} == {
        "deny_late", "session_input_late", "session_forward_late", "session_nat_late"}
    assert {m["counter"]["name"] for m in made if "counter" in m} == {"deny_late"}
    loaded, whole = for_store(store) + added, for_store(change)
    packets = [Packet("podman3", "10.213.9.2", "10.213.9.1", dport=3128, local=True),
               Packet("podman3", "10.213.9.2", "10.213.5.1", dport=3128, local=True),
               Packet("podman3", "10.213.9.2", "10.213.9.1", l4="udp", dport=53, local=True),
               Packet("podman3", "10.213.9.2", "203.0.113.7", dport=22),
               Packet("podman3", "10.213.9.2", "203.0.113.8", dport=22),
               Packet("podman3", "10.213.5.2", "203.0.113.7", dport=22),
               Packet("podman3", "10.213.9.2", WEB, dport=80),
               Packet("podman3", "10.213.77.2", WEB, dport=443),
               Packet("podman3", S1, S1_GW, dport=3128, local=True)]
    for packet in packets:
        for chain in ("raw_prerouting", "nat_prerouting", "filter_input", "filter_forward"):
            assert verdict(loaded, chain, packet) == verdict(whole, chain, packet), (
                chain, packet)
    assert verdict(loaded, "filter_forward", packets[3]) == "accept"  # its tcp rule
    assert verdict(loaded, "filter_input", packets[1]) == "reject:deny_late"  # not its gateway


def test_anything_but_sessions_that_come_loads_the_whole_ruleset(tmp_path):
    from appliance.firewall.ruleset import additions, differs
    (tmp_path / "tcp.toml").write_text('[tcp]\nallow = ["203.0.113.7:22"]\n')
    store = _store(tmp_path, ("r1", "10.213.5.0/24", [str(tmp_path / "tcp.toml")]),
                   ("r2", "10.213.6.0/24", []))
    gone = store.plan_unregister("r2")
    assert additions(store, gone) is None and differs(store, gone)
    same = store.plan_register("r2", "10.213.6.0/24")  # again: nothing changes
    assert additions(store, same) is None and not differs(store, same)
    (tmp_path / "tcp.toml").write_text('[tcp]\nallow = ["203.0.113.8:22"]\n')
    reread = store.plan_reload()  # r1's tcp rule names another address now
    assert additions(store, reread) is None and differs(store, reread)
    runtime = store.plan_add("r2", "tcp", "198.51.100.4:22")
    assert additions(store, runtime) is None and differs(store, runtime)
    mere = store.plan_add("r2", "http", "example.com")  # no address: the ruleset is the same
    assert additions(store, mere) is None and not differs(store, mere)


@pytest.mark.parametrize("name", ["prerouting", "input", "forward", "nat", "input-x",
                                  "session", "learned", "sessions"])
def test_no_session_name_makes_the_name_of_another_object(name):
    """A session's chains are `session_<kind>_<name>`: a session named `prerouting` once made
    `nat_prerouting`, the base NAT chain, and the whole ruleset failed to load. (`unknown`
    and `ipv6` share the deny chains of traffic of no session: the names to avoid there.)"""
    config = parse_config(CONFIG.replace('name = "s2"', f'name = "{name}"'), "filter.toml")
    commands = build(config, {})
    made = [(kind, c["add"][kind]["name"]) for c in commands for kind in ("chain", "counter",
                                                                          "set", "map")
            if kind in c.get("add", {})]
    assert len(made) == len(set(made)), sorted(made)  # one object each: none is another's
