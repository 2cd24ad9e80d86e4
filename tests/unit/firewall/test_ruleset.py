"""The ruleset as data: one table, never a flush, the shape every session gets."""

from __future__ import annotations

import json

import pytest

from appliance.filter.config import parse_config
from appliance.firewall.ruleset import build, build_base, listener_ports

CONFIG = """
[dns]
listen = ["10.213.1.1:53"]
upstream = ["192.0.2.53:53"]
[proxy]
listen = ["10.213.1.1:3128"]
transparent_http = ["0.0.0.0:3129"]
transparent_tls = ["0.0.0.0:3130"]
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


def test_each_session_reaches_only_its_own_gateway_ports(commands):
    text = json.dumps(rules(commands, "filter_input"))
    assert '"right": "10.213.1.1"' in text and '"right": "10.213.2.254"' in text
    assert '{"set": [53, 3128, 3129, 3130]}' in text
    last = rules(commands, "filter_input")[-1]
    assert last["expr"][-1] == {"jump": {"target": "deny_unknown"}}


def test_redirects_and_static_tcp(commands):
    redirects = [r["expr"][-1] for r in rules(commands, "nat_prerouting")]
    assert redirects == [{"redirect": {"port": 3129}}, {"redirect": {"port": 3130}}] * 2
    forward = json.dumps(rules(commands, "filter_forward"))
    assert "203.0.113.7" in forward and "@learned" in forward


def test_every_session_has_a_counted_logged_reject(commands):
    counters = {c["add"]["counter"]["name"] for c in commands if "counter" in c.get("add", {})}
    assert counters == {"deny_s1", "deny_s2", "deny_unknown", "deny_ipv6"}
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
    added = [c["add"]["element"]["elem"] for c in commands if "element" in c.get("add", {})]
    assert added == [[element("10.213.1.2")]]
