"""Where the filter listens, decided from its config (gateways.py), without sockets."""

from __future__ import annotations

import ipaddress

import pytest

from appliance.filter.gateways import Listener, _proc_address, fixed_hosts, planned
from appliance.policy import ConfigError
from appliance.sessionconfig import parse_config

CONFIG = """
[dns]
listen = [{dns}]
upstream = ["192.0.2.53:53"]
[proxy]
listen = ["gateway:3128", "127.0.0.1:0"]
transparent_http = ["gateway:3129"]
transparent_tls = ["gateway:3130"]
[sshgate]
listen = ["gateway:3122"]
"""


def test_gateway_listeners_are_every_service_on_each_sessions_gateway():
    config = parse_config(CONFIG.format(dns='"gateway:53"'), "filter.toml")
    assert planned(config) == (
        Listener("dns_udp", 53, "udp"), Listener("dns_tcp", 53), Listener("proxy", 3128),
        Listener("transparent_http", 3129), Listener("transparent_tls", 3130),
        Listener("sshgate", 3122))
    assert fixed_hosts(config) == ["127.0.0.1"]
    assert planned(config, "127.0.0.1") == (Listener("proxy", 0),)


@pytest.mark.parametrize(("listen", "message"), [
    ('"0.0.0.0:53"', "a wildcard address takes the port on every address of the host, from "
     "its own resolvers too (systemd-resolved, dnsmasq); write \"gateway:53\""),
    ('"[::]:53"', "write \"gateway:53\""),
    ('"gateway:0"', "needs a fixed port number, as in gateway:53"),
    ('"gateway:dns"', "needs a fixed port number"),
    ('"gateway"', "needs a fixed port number"),
])
def test_a_listener_wider_than_the_gateways_is_refused_with_the_fix(listen, message):
    with pytest.raises(ConfigError) as raised:
        parse_config(CONFIG.format(dns=listen), "filter.toml")
    assert "[dns] listen" in str(raised.value) and message in str(raised.value)


def test_an_upstream_is_never_the_gateway_word():
    text = CONFIG.format(dns='"gateway:53"').replace('"192.0.2.53:53"', '"gateway:53"')
    with pytest.raises(ConfigError, match="must be IP addresses, not names"):
        parse_config(text, "filter.toml")


@pytest.mark.parametrize(("text", "address"), [
    ("3500007F", "127.0.0.53"),
    ("017AA8C0", "192.168.122.1"),
    ("00000000", "0.0.0.0"),
    ("00000000000000000000000001000000", "::1"),
    ("000080FE00000000FF0F00000100A8FE", "fe80::fff:fea8:1"),
])
def test_proc_net_addresses_read_in_host_order(text, address):
    assert _proc_address(text) == ipaddress.ip_address(address)
