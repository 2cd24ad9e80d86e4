"""What a firewall reject becomes: an event whose hint fits what was rejected (issue 26,
F15). The real service and bus; the drops as the NFLOG reader makes them."""

from __future__ import annotations

import pytest

from appliance.filter.service import Service
from appliance.firewall.nflog import Drop
from appliance.sessionconfig import parse_config
from tests.unit.filterconfig import one_session

S1, GW = "10.213.1.2", "10.213.1.1"


@pytest.fixture
def service(tmp_path):
    config = one_session(tmp_path)
    service = Service(config)
    yield service
    service.blocking.shutdown()


def event_of(service, drop: Drop) -> dict | None:
    before = len(service.bus.recent)
    service.drops.event(drop)
    fresh = list(service.bus.recent)[before:]
    assert len(fresh) <= 1
    return fresh[0] if fresh else None


@pytest.mark.parametrize(("drop", "says", "never"), [
    (Drop("s1", "udp", S1, "8.8.8.8", 53), "the session's resolver", "HTTP_PROXY"),
    (Drop("s1", "tcp", S1, "8.8.8.8", 53), "the session's resolver", "allow-tcp"),
    (Drop("s1", "udp", S1, "203.0.113.10", 443), "falls back to TCP", "tcp rule"),
    (Drop("s1", "udp", S1, "203.0.113.10", 51820), "UDP is not forwarded", "HTTP_PROXY"),
    (Drop("s1", "icmp", S1, "203.0.113.10", None), "ICMP is not forwarded", "HTTP_PROXY"),
    (Drop("s1", "tcp", S1, "203.0.113.10", 22), "corral allow-tcp NAME:22", "UDP"),
    (Drop("s1", "tcp", S1, GW, 22), "host.corral", "allow-tcp"),
    (Drop("ipv6", "tcp", "fd00::2", "2001:db8::1", 443), "IPv6 is not forwarded", "allow-tcp"),
    (Drop("s1", "47", S1, "203.0.113.10", None), "only TCP", "HTTP_PROXY"),
], ids=["udp-dns", "tcp-dns", "quic", "udp", "icmp", "tcp", "gateway-port", "ipv6", "gre"])
def test_each_reject_gets_a_hint_that_fits_its_protocol(service, drop, says, never):
    event = event_of(service, drop)
    assert says in event["hint"] and never not in event["hint"], event["hint"]
    assert event["kind"] == "firewall" and event["verdict"] == "deny"


@pytest.mark.parametrize("drop", [
    Drop("s1", "udp", S1, "224.0.0.252", 5355), Drop("ipv6", "udp", "fe80::2", "ff02::1:3", 5355),
    Drop("s1", "udp", GW, "224.0.0.251", 5353), Drop("ipv6", "icmpv6", "fe80::2", "ff02::16",
                                                      None)])
def test_link_local_multicast_is_never_a_denial_event(service, drop):
    """The ruleset drops it quietly; a report of one (a ruleset from before) is no event."""
    assert event_of(service, drop) is None


@pytest.fixture
def listening(tmp_path):
    """The service with the listeners a session reaches on its gateway, as the role sets."""
    config = parse_config(f"""
[dns]
listen = ["gateway:53"]
upstream = ["192.0.2.53:53"]
[proxy]
listen = ["gateway:3128"]
transparent_http = ["gateway:3129"]
transparent_tls = ["gateway:3130"]
[sshgate]
listen = ["gateway:2222"]
[state]
dir = "{tmp_path}/state"
[control]
socket = "{tmp_path}/control.sock"
[[session]]
name = "s1"
subnet = "10.213.1.0/24"
""", str(tmp_path / "filter.toml"))
    service = Service(config)
    yield service
    service.blocking.shutdown()


@pytest.mark.parametrize("drop", [
    Drop("s1", "udp", S1, GW, 53),      # past the session's DNS packet rate
    Drop("s1", "tcp", S1, GW, 3128),    # past its connection caps, on the proxy
    Drop("s1", "tcp", S1, GW, 3130),    # ... on the transparent TLS listener
    Drop("s1", "tcp", S1, GW, 2222),    # ... on the git gateway
], ids=["dns-rate", "proxy-caps", "transparent-caps", "sshgate-caps"])
def test_a_reject_at_a_listener_of_the_gateway_is_a_limit_not_a_closed_door(listening, drop):
    """The ruleset refuses a session's packets to the filter's own listeners only past its
    limits (DNS packets per second, open and new connections): the hint says so, not that
    the port is closed or that DNS goes to some other resolver."""
    hint = event_of(listening, drop)["hint"]
    assert "limit" in hint and "host.corral" not in hint and "anywhere else" not in hint, hint


def test_other_ports_of_the_gateway_keep_their_hint(listening):
    assert "host.corral" in event_of(listening, Drop("s1", "tcp", S1, GW, 22))["hint"]


def test_a_drop_is_judged_without_the_service_or_a_socket():
    """drops.drop_event is pure: a session that is gone is not named (its name in the
    prefix may be a later session's), the gateway is told by the addresses given."""
    from appliance.filter.drops import drop_event

    gone = drop_event(Drop("s9", "tcp", S1, GW, 22), {"s1"}, {GW}, frozenset())
    assert gone["session"] is None and "host.corral" in gone["hint"]
    named = drop_event(Drop("s1", "tcp", S1, GW, 22), {"s1"}, set(), frozenset())
    assert named["session"] == "s1" and "host.corral" not in named["hint"]
    assert drop_event(Drop("s1", "udp", S1, "224.0.0.251", 5353), {"s1"}, {GW},
                      frozenset()) is None
