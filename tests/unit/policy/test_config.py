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
    ('presets = "pypi"\n', "corral.toml:1: presets: must be a list of preset names"),
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
    from appliance.policy.layers import preset_parameters
    from appliance.policy.parameters import PresetRef

    assert set(preset_names()) >= REQUIRED_PRESETS
    examples = {"repos": ("acme/widget",)}
    for name in preset_names():
        given = tuple((key, examples[key]) for key in preset_parameters(name))
        rules = preset_rules(PresetRef(name, given), "appliance")
        assert rules, name
        assert all(r.source == f"preset:{name}" and r.layer == "appliance" for r in rules)


def test_a_preset_cannot_include_presets():
    with pytest.raises(ConfigError, match="cannot include other presets"):
        parse_policy('presets = ["pypi"]\n', "preset:x", "appliance", allow_presets=False)


INSPECT = """[http]
allow = ["api.github.com"]

[[inspect]]
host = "api.github.com"
allow = ["GET /**"]

[[inspect]]
host = "github.com"
allow = [
    "GET /*/*/info/refs?service=git-upload-pack",
    {bad},
]
"""


@pytest.mark.parametrize(("text", "expected"), [
    (INSPECT.format(bad='"get /x"'),
     "corral.toml:12: [[inspect]] allow: 'get /x': method 'get': HTTP methods are "
     "case-sensitive; write 'GET'"),
    (INSPECT.format(bad='"/x"'),
     "corral.toml:12: [[inspect]] allow: '/x': '/x' is not 'METHOD /path'"),
    (INSPECT.format(bad='"GET x"'),
     "corral.toml:12: [[inspect]] allow: 'GET x': path 'x' must start with '/'"),
    (INSPECT.format(bad='"GET /a/../b"'),
     "corral.toml:12: [[inspect]] allow: 'GET /a/../b': path '/a/../b': a dot segment"),
    (INSPECT.format(bad="3"), "corral.toml:12: [[inspect]] allow: 3 is not a string"),
    ('[[inspect]]\nhost = "a.example"\nallw = ["GET /"]\n',
     "corral.toml:3: [[inspect]] allw: unknown key; expected host, allow, deny"),
    ('[[inspect]]\nhost = "a.example"\n[[inspect]]\nallow = ["GET /"]\n',
     "corral.toml:3: [[inspect]] host: missing: name the host to inspect"),
    ('[[inspect]]\nhost = ["a.example"]\n', "corral.toml:2: [[inspect]] host: ['a.example'] is"
     " not a string"),
    ('[[inspect]]\nhost = "a.example:443"\n', "corral.toml:2: [[inspect]] host: 'a.example:443':"
     " an inspected host is inspected on every port"),
    ('[[inspect]]\nhost = "not ok"\n', "corral.toml:2: [[inspect]] host: 'not ok' is not a valid"
     " host name"),
    ('[[inspect]]\nhost = "a.example"\ndeny = "PUT /**"\n',
     "corral.toml:3: [[inspect]] deny: must be a list, got str"),
    ('[[inspect]]\nhost = "a.example"\ndeny = ["nothing"]\n',
     "corral.toml:3: [[inspect]] deny: 'nothing': 'nothing' stands for an empty allow list"),
    ('[inspect]\nhost = "a.example"\n', "corral.toml:1: inspect: write [[inspect]]"),
    ('inspect = "a.example"\n', "corral.toml:1: inspect: must be [[inspect]] tables"),
])
def test_inspect_errors_name_file_line_key_and_value(text, expected):
    with pytest.raises(ConfigError) as info:
        parse_policy(text, "corral.toml", "project")
    assert str(info.value).startswith(expected)


def test_inspect_tables_become_rules_tagged_like_the_others():
    rules = policy_file_rules(INSPECT.format(bad='"POST /*/*/git-upload-pack"'), "corral.toml",
                              "project")
    assert [(r.kind, r.text) for r in rules] == [
        ("http", "api.github.com"),
        ("inspect", "api.github.com"),
        ("request", "api.github.com GET /**"),
        ("inspect", "github.com"),
        ("request", "github.com GET /*/*/info/refs?service=git-upload-pack"),
        ("request", "github.com POST /*/*/git-upload-pack"),
    ]
    assert {(r.layer, r.source) for r in rules} == {("project", "corral.toml")}
    inline = parse_policy('inspect = [{host = "a.example", deny = ["DELETE /**"]}]\n',
                          "corral.toml", "project")
    assert [r.text for r in inline.rules] == ["a.example", "!a.example DELETE /**"]


# -- rules that undo what they look like (issue 26, F16) ------------------------------------


@pytest.mark.parametrize(("port", "what"), [(53, "DNS"), (853, "DNS over TLS")])
def test_a_host_port_that_is_a_resolver_is_refused_with_the_reason_and_the_fix(port, what):
    text = f'[http]\nallow = ["a.test"]\n\n[host]\nports = [5432, {port}]\n'
    with pytest.raises(ConfigError) as info:
        parse_policy(text, "corral.toml", "project")
    message = str(info.value)
    assert message.startswith(f"corral.toml:5: [host] ports: {port} is the host's {what}"), message
    assert "around the filter" in message and f"force_ports = [{port}]" in message


def test_a_resolver_port_of_the_host_is_reachable_only_when_forced():
    rules = parse_policy('[host]\nports = [5432]\nforce_ports = [53, 853]\n', "corral.toml",
                         "project").rules
    assert [(r.kind, r.text) for r in rules] == [("host", "5432"), ("host", "53"),
                                                 ("host", "853")]
    with pytest.raises(ConfigError, match=r"corral.toml:2: \[host\] force_ports: 5432 needs no "
                                          r"forcing: list it in \[host\] ports"):
        parse_policy('[host]\nforce_ports = [5432]\n', "corral.toml", "project")
    with pytest.raises(ConfigError, match=r"\[host\] force_ports: '53' is not a port number"):
        parse_policy('[host]\nforce_ports = ["53"]\n', "corral.toml", "project")


def github_pr(repos: str = '["acme/widget"]') -> str:
    return f'presets = ["pypi", {{name = "github-pr", repos = {repos}}}]\n'


def test_a_preset_that_acts_on_repositories_acts_on_those_named_only():
    from appliance.policy import Policy, parse_host

    policy = Policy(policy_file_rules(github_pr('["acme/widget", "acme/tools-*"]'),
                                      "corral.toml", "project"))
    api = policy.inspection(parse_host("api.github.com"))
    for method, target, allowed in [
        ("POST", "/repos/acme/widget/pulls", True),
        ("PATCH", "/repos/acme/widget/pulls/3", True),
        ("POST", "/repos/acme/widget/issues/3/comments", True),
        ("POST", "/repos/acme/tools-cli/pulls/3/comments", True),
        ("POST", "/repos/other/widget/pulls", False),          # not named: a bot acts there
        ("POST", "/repos/other/widget/issues/3/comments", False),
        ("PATCH", "/repos/acme/gadget/issues/comments/9", False),
        ("GET", "/repos/other/widget/pulls", True),             # reading stays open
        ("PUT", "/repos/acme/widget/pulls/3/merge", False),     # and merging stays closed
    ]:
        assert api.decide(method, target).allowed is allowed, (method, target)
    assert policy.decide_http(parse_host("pypi.org"), 443).allowed
    assert {r.source for r in policy.rules} == {"corral.toml", "preset:pypi", "preset:github-pr"
                                                } - {"corral.toml"}


@pytest.mark.parametrize(("text", "expected"), [
    ('# the team\npresets = ["github-pr"]\n',
     'corral.toml:2: presets: preset \'github-pr\' acts on the repositories you name'),
    (github_pr("[]"), "corral.toml:1: presets: github-pr: repos: name at least one"),
    (github_pr('["*/*"]'), "corral.toml:1: presets: github-pr: repos: '*/*' is not OWNER/REPO"),
    (github_pr('["acme"]'), "corral.toml:1: presets: github-pr: repos: 'acme' is not OWNER/REPO"),
    (github_pr('["acme/w/x"]'), "corral.toml:1: presets: github-pr: repos: 'acme/w/x' is not"),
    (github_pr('["acme/../x"]'), "corral.toml:1: presets: github-pr: repos: 'acme/../x' is not"),
    (github_pr('"acme/widget"'), "corral.toml:1: presets: github-pr: repos: must be a list"),
    ('presets = [{name = "github-pr", repo = ["a/b"]}]\n',
     "corral.toml:1: presets: github-pr: unknown parameter 'repo'; it takes repos"),
    ('presets = [{name = "pypi", repos = ["a/b"]}]\n',
     "corral.toml:1: presets: pypi takes no parameters"),
    ('presets = [{repos = ["a/b"]}]\n', 'corral.toml:1: presets: a table names its preset'),
    ('presets = [3]\n', "corral.toml:1: presets: 3 is neither a preset's name nor a table"),
])
def test_preset_parameters_are_checked_and_a_missing_one_names_the_fix(text, expected):
    with pytest.raises(ConfigError) as info:
        policy_file_rules(text, "corral.toml", "project")
    assert str(info.value).startswith(expected), str(info.value)
    if "acts on the repositories" in expected:
        assert 'presets = [{name = "github-pr", repos = ["OWNER/REPO"]}]' in str(info.value)
