"""Policy files and presets: errors name file, line, key and value; layers are recorded."""

from __future__ import annotations

import pytest

from appliance.policy import (
    ConfigError,
    parse_policy,
    policy_file_rules,
    preset_names,
    preset_rules,
)

REQUIRED_PRESETS = {"pypi", "npm", "github", "debian", "anthropic", "openai", "rubygems",
                    "crates", "golang"}


def test_the_documented_example_parses():
    text = """
presets = ["pypi", "github"]
[dns]
allow = ["example.com", "*.example.org"]
[http]
allow = ["example.com", "api.example.net:8443", "*.cdn.example:8*"]
[tcp]
allow = ["github.com:22"]
[cidr]
allow = ["203.0.113.0/24"]
[host]
ports = [5432]
[deny]
names = ["upload.example.org"]
"""
    rules = policy_file_rules(text, "corral.toml", "project")
    own = [(r.kind, r.text) for r in rules if r.source == "corral.toml"]
    assert own == [("dns", "example.com"), ("dns", "*.example.org"), ("http", "example.com"),
                   ("http", "api.example.net:8443"), ("http", "*.cdn.example:8*"),
                   ("tcp", "github.com:22"), ("cidr", "203.0.113.0/24"), ("host", "5432"),
                   ("deny", "upload.example.org")]
    assert {r.source for r in rules} == {"corral.toml", "preset:pypi", "preset:github"}
    assert {r.layer for r in rules} == {"project"}


@pytest.mark.parametrize(("text", "expected"), [
    ('[http]\nallow = [\n  "ok.example",\n  "not ok",\n]\n',
     "corral.toml:4: [http] allow: 'not ok' is not a valid host name"),
    ('[http]\nallow = "x.example"\n', "corral.toml:2: [http] allow: must be a list, got str"),
    ('[http]\nalow = ["x.example"]\n', "corral.toml:2: [http] alow: unknown key; expected allow"),
    ('[deny]\nallow = ["x.example"]\n', "corral.toml:2: [deny] allow: unknown key; expected names"),
    ('[htttp]\nallow = ["x.example"]\n', "corral.toml:1: htttp: unknown key"),
    ('[host]\nports = ["5432"]\n', "corral.toml:2: [host] ports: '5432' is not a port number"),
    ('[tcp]\nallow = [22]\n', "corral.toml:2: [tcp] allow: 22 is not a string"),
    ('presets = "pypi"\n', "corral.toml:1: presets: must be a list of strings"),
    ('[http\nallow = []\n', "corral.toml:1: not valid TOML"),
    ('owner = 3\n', "corral.toml:1: owner: unknown key"),
])
def test_errors_name_file_line_key_and_value(text, expected):
    with pytest.raises(ConfigError) as info:
        parse_policy(text, "corral.toml", "project")
    assert str(info.value).startswith(expected)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown preset 'pipy'; known: anthropic"):
        policy_file_rules('presets = ["pipy"]\n', "corral.toml", "project")


def test_every_required_preset_ships_and_parses():
    assert set(preset_names()) >= REQUIRED_PRESETS
    for name in preset_names():
        rules = preset_rules(name, "appliance")
        assert rules, name
        assert all(r.source == f"preset:{name}" and r.layer == "appliance" for r in rules)


def test_a_preset_cannot_include_presets():
    with pytest.raises(ConfigError, match="cannot include other presets"):
        parse_policy('presets = ["pypi"]\n', "preset:x", "appliance", allow_presets=False)
