"""A loaded corral table against the rendered one: what the kernel changes by itself (counter
values, learned elements, handles) is no drift; a rule more or less is, by name."""

from __future__ import annotations

import copy

from appliance.manifest import ruleset

LISTED = [
    {"metainfo": {"version": "1.0.6", "json_schema_version": 1}},
    {"table": {"family": "inet", "name": "corral", "handle": 7}},
    {"set": {"family": "inet", "table": "corral", "name": "learned", "handle": 3,
             "type": ["ipv4_addr", "ipv4_addr", "inet_service"], "flags": ["timeout"],
             "elem": [{"elem": {"val": {"concat": ["10.213.1.2", "1.2.3.4", 22]},
                                "expires": 41}}]}},
    {"counter": {"family": "inet", "table": "corral", "name": "deny_unknown", "handle": 4,
                 "packets": 12, "bytes": 720}},
    {"chain": {"family": "inet", "table": "corral", "name": "filter_input", "handle": 1,
               "type": "filter", "hook": "input", "prio": -5, "policy": "accept"}},
    {"rule": {"family": "inet", "table": "corral", "chain": "filter_input", "handle": 9,
              "expr": [{"jump": {"target": "deny_unknown"}}]}},
]


def test_counters_learned_elements_and_handles_are_not_drift():
    running = copy.deepcopy(LISTED)
    running[2]["set"]["elem"] = []
    running[3]["counter"].update(packets=0, bytes=0, handle=40)
    running[5]["rule"]["handle"] = 99
    assert ruleset.normalise(running) == ruleset.normalise(LISTED)
    assert ruleset.digest(running) == ruleset.digest(LISTED)
    assert ruleset.differences(running, LISTED) == []


def test_a_rule_added_or_taken_out_is_named():
    running = [*copy.deepcopy(LISTED), {"rule": {
        "family": "inet", "table": "corral", "chain": "filter_input", "handle": 10,
        "expr": [{"accept": None}]}}]
    assert ruleset.digest(running) != ruleset.digest(LISTED)
    assert ruleset.differences(running, LISTED) == [
        '+ rule filter_input: [{"accept": null}] (loaded, not rendered)']
    assert ruleset.differences(LISTED[:-1], LISTED) == [
        '- rule filter_input: [{"jump": {"target": "deny_unknown"}}] (rendered, not loaded)']


def test_the_same_rules_in_another_order_differ():
    rules = [{"rule": {"chain": "c", "expr": [{"accept": None}]}},
             {"rule": {"chain": "c", "expr": [{"drop": None}]}}]
    assert ruleset.differences(rules[::-1], rules) == ["the same objects in another order"]


def test_a_long_list_of_differences_is_cut_with_a_count():
    extra = [{"rule": {"chain": "c", "expr": [{"counter": n}]}} for n in range(15)]
    lines = ruleset.differences(extra, [], limit=10)
    assert len(lines) == 11 and lines[-1] == "... and 5 more"


def test_an_anonymous_counters_values_are_not_drift_its_name_is():
    def rule(counter):
        return [{"rule": {"chain": "c", "expr": [{"counter": counter}, {"drop": None}]}}]

    assert ruleset.normalise(rule({"packets": 5, "bytes": 300})) == ruleset.normalise(
        rule({"packets": 0, "bytes": 0}))
    assert ruleset.normalise(rule("deny_a")) != ruleset.normalise(rule("deny_b"))


def test_a_source_more_in_the_sessions_set_is_drift():
    """Only the learned set's elements change by themselves: `sessions` holds the sources a
    sandbox may use, and one added behind the filter's back is named."""
    sessions = {"set": {"family": "inet", "table": "corral", "name": "sessions", "handle": 5,
                        "type": "ipv4_addr", "flags": ["interval"],
                        "elem": [{"prefix": {"addr": "10.213.1.0", "len": 24}}]}}
    rendered = [*copy.deepcopy(LISTED), sessions]
    loaded = copy.deepcopy(rendered)
    loaded[-1]["set"]["elem"].append({"prefix": {"addr": "10.99.0.0", "len": 16}})
    assert ruleset.normalise(loaded) != ruleset.normalise(rendered)
    assert ruleset.differences(loaded, rendered) == [
        "- set sessions (rendered, not loaded)", "+ set sessions (loaded, not rendered)"]
