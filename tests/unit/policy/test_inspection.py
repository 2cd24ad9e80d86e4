"""Per-request rules on inspected hosts: decisions, evasions, layers, presets, properties."""

from __future__ import annotations

import itertools
import re
import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.policy import (
    DEFAULT_RULES,
    Policy,
    Rule,
    dedupe,
    parse_host,
    policy_file_rules,
    preset_rules,
)
from appliance.policy.parameters import PresetRef

from . import lax

HOST = parse_host("api.github.com")
EXAMPLE = """
[http]
allow = ["api.github.com"]
[[inspect]]
host = "api.github.com"
allow = ["GET /**", "POST /repos/acme/widget/pulls", "PATCH /repos/acme/widget/pulls/*"]
deny  = ["* /gists/**", "PUT /repos/*/*/pulls/*/merge"]
"""


GITHUB_PR = PresetRef("github-pr", (("repos", ("o/r",)),))
"""github-pr as the tables below read it: its writes on the repository o/r."""


def policy_of(*texts: str, layers: tuple[str, ...] = ()) -> Policy:
    rules = [*DEFAULT_RULES]
    for text, layer in zip(texts, layers or ("project",) * len(texts), strict=True):
        rules.extend(policy_file_rules(text, f"{layer}.toml", layer))
    return Policy(dedupe(rules))


@pytest.fixture(scope="module")
def github():
    return policy_of(EXAMPLE).inspection(HOST)


@pytest.mark.parametrize(("method", "target", "allowed", "rule"), [
    ("GET", "/repos/acme/widget", True, "api.github.com GET /**"),
    ("GET", "/", True, "api.github.com GET /**"),
    ("GET", "/search/code?q=x", True, "api.github.com GET /**"),
    ("POST", "/repos/acme/widget/pulls", True, "api.github.com POST /repos/acme/widget/pulls"),
    ("PATCH", "/repos/acme/widget/pulls/7", True,
     "api.github.com PATCH /repos/acme/widget/pulls/*"),
    ("PATCH", "/repos/acme/widget/pulls/7/x", False, None),
    ("POST", "/repos/acme/other/pulls", False, None),
    ("HEAD", "/repos/acme/widget", False, None),  # GET does not imply HEAD
    ("GET", "/gists", False, "!api.github.com * /gists/**"),  # ** is zero segments too
    ("GET", "/gists/abc", False, "!api.github.com * /gists/**"),  # deny wins over GET /**
    ("POST", "/gists", False, "!api.github.com * /gists/**"),
    ("PUT", "/repos/acme/widget/pulls/7/merge", False,
     "!api.github.com PUT /repos/*/*/pulls/*/merge"),
    ("GET", "/repos/acme/widget/pulls/7/merge", True, "api.github.com GET /**"),
    # a deny covers its path's format suffixes (Rails and Grape route /gists.json as /gists)
    ("GET", "/gists.json", False, "!api.github.com * /gists/**"),
    ("GET", "/Gists.JSON", False, "!api.github.com * /gists/**"),
    ("PUT", "/repos/acme/widget/pulls/7/merge.json", False,
     "!api.github.com PUT /repos/*/*/pulls/*/merge"),
    ("PUT", "/repos/acme/widget/pulls/7/merge.json.xml", False,
     "!api.github.com PUT /repos/*/*/pulls/*/merge"),
    ("GET", "/gistsy.json", True, "api.github.com GET /**"),
    ("GET", "/repos/acme/widget.js", True, "api.github.com GET /**"),
    ("POST", "/repos/acme/widget/pulls.json", False, None),  # an allow: what it names only
])
def test_the_documented_example(github, method, target, allowed, rule):
    decision = github.decide(method, target)
    assert decision.allowed is allowed, decision.reason
    assert (decision.rule.text if decision.rule else None) == rule


@pytest.mark.parametrize(("method", "target"), [
    ("GET", "/%67ists/1"),  # percent-encoded unreserved: decoded, then denied
    ("GET", "/%67%69%73%74%73"),
    ("GET", "/GISTS/1"),  # a deny ignores case
    ("GET", "/Gists"),
    ("get", "/gists/1"),
    ("put", "/repos/acme/widget/pulls/1/merge"),
    ("Put", "/repos/ACME/Widget/pulls/1/MERGE"),
    ("PUT", "/repos/acme/widget/pulls/1/merge/"),  # trailing slash: same route
    ("GET", "/gists/"),
    ("GET", "//gists"),
    ("GET", "/./gists"),
    ("GET", "/x/../gists"),
    ("GET", "/x/%2e%2e/gists"),
    ("GET", "/x/.%2E/gists"),
    ("GET", "/gists%2F1"),  # encoded slash: the split reading is /gists/1
    ("GET", "/x%2F..%2Fgists"),
    ("PUT", "/repos%2Facme%2Fwidget/pulls/1/merge"),
    ("PUT", "/repos/acme/widget/pulls/1%2Fmerge"),
    ("GET", "\\gists"),
    ("GET", "/x\\..\\gists"),
    ("GET", "/x%5C..%5Cgists"),
    ("GET", "/gists;x/1"),
    ("GET", "/%2567ists"),  # double encoding
    ("GET", "/x%252F..%252Fgists"),
    ("GET", "/gists%00"),
    ("GET", "/gists\x00"),
    ("GET", "/gists\r\nX: y"),
    ("GET", "/%C0%AFgists"),
    ("GET", "/gists#x"),
    ("GET", "https://api.github.com/gists"),  # absolute-form: judged only in origin-form
    ("GET", "api.github.com/gists"),
    ("OPTIONS", "*"),  # asterisk-form names no path
    ("G ET", "/gists"),
    ("", "/gists"),
    ("GET", "/gists.json"),  # format suffixes
    ("GET", "/%67ists%2Ejson"),
    ("GET", "/gists.json/"),
    ("GET", "/gists%EF%BC%8Ejson"),  # a fullwidth '.'
    ("PUT", "/repos/acme/widget/pulls/1/merge.json"),
    ("GET", "/gists%3Bx/1"),  # escaped forms of what is refused raw
    ("GET", "/gists%3b"),
    ("GET", "/gists%3F/x"),
    ("GET", "/gists%23x"),
    ("GET", "/gists%253B"),
    ("GET", "/x/..%3B/gists"),
    ("GET", "/x%u002F..%u002Fgists"),
    ("GET", "/x%EF%BC%8F..%EF%BC%8Fgists"),  # fullwidth '/'
    ("GET", "/x%C2%A5..%C2%A5gists"),  # the yen sign is '\\' in Japanese Windows
    ("GET", "/x/%EF%BC%8E%EF%BC%8E/gists"),
    ("GET", "/%EF%BD%87ists"),  # Unicode a server normalises
    ("GET", "/%EF%BD%87%EF%BD%89%EF%BD%93%EF%BD%94%EF%BD%93/1"),
    ("GET", "/g%C4%B1sts"),  # dotless i: 'GISTS' upper-cased
    ("GET", "/gi%C5%BFts"),  # long s
    ("GET", "/gi%E2%80%8Bsts"),  # zero-width space
    ("GET", "/gis%C2%ADts"),  # soft hyphen
    ("PUT", "/repos/acme/widget/pulls/1/%E2%80%8Bmerge"),
])
def test_no_spelling_evades_a_deny(github, method, target):
    decision = github.decide(method, target)
    assert not decision.allowed, decision.reason
    assert decision.hint


@pytest.mark.parametrize(("method", "target", "reason"), [
    ("GET", "/x/../gists", "dot segment"),
    ("GET", "//gists", "empty segment ('//')"),
    ("GET", "/a\\b", "backslash"),
    ("GET", "https://api.github.com/x", "not an origin-form target"),
    ("OPTIONS", "*", "asterisk-form target names no path"),
    ("G ET", "/x", "not an HTTP method name"),
])
def test_refusals_say_why(github, method, target, reason):
    assert reason in github.decide(method, target).reason


def test_escaped_reserved_characters_are_read_both_ways():
    """Django, Flask and Go route the decoded path (`%40` is `@`), Express the path as sent:
    a deny matches either reading, an allow must match both."""
    guard = policy_of('[[inspect]]\nhost = "g.example"\ndeny = ["PUT /@acme/**"]\n')
    inspection = guard.inspection(parse_host("g.example"))  # no allow list: denies alone
    for target in ("/%40acme/x", "/%40ACME%2Fx", "/%40acme.json", "/%EF%BC%A0acme/x"):
        assert not inspection.decide("PUT", target).allowed, target
    assert inspection.decide("PUT", "/@other/x").allowed
    policy = policy_of("""
[[inspect]]
host = "registry.example"
allow = ["GET /**", "PUT /@acme/*", "PUT /plain/*"]
deny = ["PUT /@acme/secret", "POST /v1/*:cancel"]
""")
    inspection = policy.inspection(parse_host("registry.example"))

    def allowed(method: str, target: str) -> bool:
        return inspection.decide(method, target).allowed

    assert not allowed("PUT", "/%40acme/secret")
    assert not allowed("PUT", "/%40acme/secret.json")
    assert not allowed("POST", "/v1/job%3Acancel")
    assert allowed("PUT", "/@acme/widget")
    decision = inspection.decide("PUT", "/%40acme/widget")  # Express routes it elsewhere
    assert not decision.allowed and "@" in decision.reason, decision.reason
    assert allowed("PUT", "/plain/a%2Cb")  # one segment either way


def test_the_reason_says_a_format_suffix_or_a_normalised_reading_was_denied(github):
    reason = github.decide("GET", "/gists.json").reason
    assert reason.endswith("(project layer), which covers its format suffixes"), reason
    reason = github.decide("GET", "/%EF%BD%87ists").reason
    assert "as servers that normalise Unicode read it (/gists)" in reason, reason


def test_a_request_rule_with_query_matches_by_parameter():
    policy = policy_of("""
[[inspect]]
host = "search.example"
allow = ["GET /search?q=*", "GET /static/**"]
deny = ["GET /search?debug=1"]
""")
    inspection = policy.inspection(parse_host("search.example"))

    def allowed(target: str) -> bool:
        return inspection.decide("GET", target).allowed

    assert allowed("/search?q=corral")
    assert allowed("/search?page=2&q=")
    assert not allowed("/search")  # q must be there
    assert not allowed("/search?debug=1&q=x")
    assert not allowed("/search?q=x&DEBUG=1")  # a deny ignores case
    assert not allowed("/search?q=x&%64ebug=%31")  # and sees through unreserved escapes
    assert not allowed("/search?q=%zz")  # a named query must parse
    assert allowed("/static/app.js?v=%zz")  # a query no pattern of the path names is ignored


def test_a_host_with_no_request_rules_passes_everything():
    policy = policy_of('[[inspect]]\nhost = "creds.example"\n')
    inspection = policy.inspection(parse_host("creds.example"))
    assert not inspection.restricted
    for method, target in (("GET", "/"), ("DELETE", "/x/../y"), ("OPTIONS", "*")):
        decision = inspection.decide(method, target)
        assert decision.allowed and decision.rule.kind == "inspect"


def test_no_allow_list_allows_what_no_deny_names():
    policy = policy_of('[[inspect]]\nhost = "r.example"\ndeny = ["DELETE /**"]\n')
    inspection = policy.inspection(parse_host("r.example"))
    assert inspection.decide("PUT", "/anything").allowed
    assert not inspection.decide("DELETE", "/x").allowed
    assert not inspection.decide("GET", "/a/../b").allowed  # a rule exists to be evaded


def test_an_empty_allow_list_allows_nothing():
    policy = policy_of('[[inspect]]\nhost = "r.example"\nallow = []\n')
    inspection = policy.inspection(parse_host("r.example"))
    assert inspection.restricted
    assert not inspection.decide("GET", "/").allowed
    assert [r.text for r in policy.rules if r.kind == "request"] == ["r.example nothing"]


def test_tables_combine_across_layers_union_of_allows_union_of_denies():
    appliance = """
[[inspect]]
host = "*.example.com"
deny = ["DELETE /**"]
"""
    project = """
[[inspect]]
host = "api.example.com"
[[inspect]]
host = "api.example.com"
allow = ["GET /**"]
"""
    session = [Rule.parse("request", "api.example.com POST /items"),
               Rule.parse("request", "!api.example.com GET /secret/**")]
    rules = [*policy_file_rules(appliance, "a.toml", "appliance"),
             *policy_file_rules(project, "corral.toml", "project"), *session]
    policy = Policy(dedupe(rules))
    api = policy.inspection(parse_host("api.example.com"))

    def allowed(method: str, target: str) -> bool:
        return api.decide(method, target).allowed

    assert allowed("GET", "/x") and allowed("POST", "/items")  # allows add up
    assert not allowed("PUT", "/x")  # one table's allow list restricts the host
    assert not allowed("DELETE", "/x")  # a wildcard's deny covers it
    assert not allowed("GET", "/secret/1")  # a session deny wins over a project allow
    other = policy.inspection(parse_host("www.example.com"))  # the wildcard alone
    assert other.decide("PUT", "/x").allowed and not other.decide("DELETE", "/x").allowed
    assert policy.inspection(parse_host("example.com")) is None  # never the apex
    assert policy.inspection(parse_host("api.example.org")) is None


def test_an_empty_allow_list_restricts_next_to_another_table():
    policy = policy_of('[[inspect]]\nhost = "r.example"\nallow = []\n',
                       '[[inspect]]\nhost = "r.example"\nallow = ["GET /**"]\n',
                       layers=("appliance", "project"))
    inspection = policy.inspection(parse_host("r.example"))
    assert inspection.decide("GET", "/x").allowed
    assert not inspection.decide("POST", "/x").allowed


def test_a_request_rule_alone_makes_its_host_inspected():
    policy = Policy([Rule.parse("request", "!x.example DELETE /**")])
    inspection = policy.inspection(parse_host("x.example"))
    assert inspection is not None and not inspection.decide("DELETE", "/a").allowed


def test_inspection_does_not_allow_the_host():
    policy = policy_of('[[inspect]]\nhost = "api.github.com"\nallow = ["GET /**"]\n')
    decision = policy.decide_http(HOST, 443)
    assert not decision.allowed
    assert "[[inspect]] table does not allow a host; [http] allow does" in decision.reason
    assert decision.hint == "corral allow-http api.github.com:443"
    assert "inspect" not in policy.decide_http(parse_host("other.example"), 443).reason
    assert not policy.decide_dns(HOST).allowed


def test_denials_name_the_rule_and_the_command():
    session = Policy([Rule.parse("inspect", "api.github.com"),
                      Rule.parse("request", "!api.github.com * /gists/**"),
                      Rule.parse("request", "api.github.com GET /user")])
    inspection = session.inspection(HOST)
    denied = inspection.decide("GET", "/gists")
    assert denied.reason == ("GET /gists on api.github.com denied by request rule "
                             "!api.github.com * /gists/** (session layer)")
    assert denied.hint == ("remove request rule !api.github.com * /gists/** from the session "
                           "layer")
    unmatched = inspection.decide("POST", "/user/repos")
    assert unmatched.reason == "no allow pattern matches POST /user/repos on api.github.com"
    assert unmatched.hint == ("corral allow-request api.github.com POST /user/repos (or add "
                              "'POST /user/repos' to an allow list of an [[inspect]] table for "
                              "api.github.com)")
    preset = policy_of('presets = [{name = "github-pr", repos = ["o/r"]}]').inspection(
        HOST).decide("PUT", "/gists/1")
    assert preset.hint == ("remove request rule !api.github.com * /gists/** from the project "
                           "layer (preset:github-pr)")


@pytest.mark.parametrize(("method", "target"), [
    ("POST", "/user/repos"),
    ("GET", "/@types%2Fnode"),
    ("DELETE", "/a/b/"),
    ("GET", "/x$(sh$IFS/tmp/p)"),  # the agent's path: quoted, never run by the shell
])
def test_the_hint_names_a_rule_that_allows_the_request(method, target):
    policy = Policy([Rule.parse("request", "api.github.com nothing")])
    hint = policy.inspection(HOST).decide(method, target).hint
    pattern = re.fullmatch(r"corral allow-request api\.github\.com (\S+ \S+) \(or add '(.+)' "
                           r"to an allow list of an \[\[inspect\]\] table for "
                           r"api\.github\.com\)", hint)
    # the command (quoted for a shell) and the file say the same
    assert " ".join(shlex.split(pattern.group(1))) == pattern.group(2)
    pattern = pattern.group(2)
    widened = Policy([*policy.rules, Rule.parse("request", f"api.github.com {pattern}")])
    assert widened.inspection(HOST).decide(method, target).allowed


def test_an_allow_must_hold_under_both_readings_of_an_encoded_slash():
    policy = policy_of('[[inspect]]\nhost = "registry.example"\nallow = ["GET /*"]\n')
    inspection = policy.inspection(parse_host("registry.example"))
    assert inspection.decide("GET", "/left-pad").allowed
    decision = inspection.decide("GET", "/@types%2Fnode")
    assert not decision.allowed and "not with the encoded slash (%2F) read as '/'" in \
        decision.reason
    both = policy_of('[[inspect]]\nhost = "registry.example"\nallow = ["GET /**"]\n')
    assert both.inspection(parse_host("registry.example")).decide("GET", "/@types%2fnode").allowed


def test_request_rules_keep_their_identity_as_text():
    rules = [r for name in (GITHUB_PR, "github-readonly", "npm-no-publish", "pypi-no-upload")
             for r in preset_rules(name, "project")]
    for rule in rules:
        again = Rule.parse(rule.kind, rule.text, rule.layer, rule.source)
        assert again == rule and again.key() == rule.key()
    spelt = Rule.parse("request", "API.GitHub.com  GET  /%67ists/")
    assert spelt.text == "api.github.com GET /gists"
    assert Rule.parse("request", "! api.github.com GET /x").text == "!api.github.com GET /x"
    assert Rule.parse("request", "[::1] GET /").text == "[::1] GET /"
    allow = Rule.parse("request", "h.example GET /x")
    assert allow.key() != Rule.parse("request", "!h.example GET /x").key()


def test_repeated_tables_fold_and_to_json_lists_each_pattern():
    text = EXAMPLE + '[[inspect]]\nhost = "api.github.com"\ndeny = ["* /gists/**"]\n'
    policy = policy_of(text)
    shown = [(r["kind"], r["rule"]) for r in policy.to_json() if r["kind"] in ("inspect",
                                                                                "request")]
    assert shown == [
        ("inspect", "api.github.com"),
        ("request", "api.github.com GET /**"),
        ("request", "api.github.com POST /repos/acme/widget/pulls"),
        ("request", "api.github.com PATCH /repos/acme/widget/pulls/*"),
        ("request", "!api.github.com * /gists/**"),
        ("request", "!api.github.com PUT /repos/*/*/pulls/*/merge"),
    ]


@pytest.mark.parametrize(("text", "message"), [
    ("api.github.com", "is not 'HOST METHOD /path'"),
    ("api.github.com get /x", "write 'GET'"),
    ("api.github.com:443 GET /x", "drop ':443'"),
    ("!api.github.com nothing", "empty allow list"),
    ("*.com GET /", "whole top-level domain"),
])
def test_bad_request_rules(text, message):
    from appliance.policy import RuleError

    with pytest.raises(RuleError, match=message):
        Rule.parse("request", text)
    with pytest.raises(RuleError, match="names a host only"):
        Rule.parse("inspect", "api.github.com GET /")


# -- presets ------------------------------------------------------------------------------

@pytest.mark.parametrize(("preset", "host", "method", "target", "allowed"), [
    ("github-readonly", "api.github.com", "GET", "/repos/o/r/pulls", True),
    ("github-readonly", "api.github.com", "HEAD", "/repos/o/r", True),
    ("github-readonly", "api.github.com", "POST", "/repos/o/r/pulls", False),
    ("github-readonly", "api.github.com", "POST", "/graphql", False),
    ("github-readonly", "api.github.com", "DELETE", "/repos/o/r", False),
    ("github-readonly", "github.com", "GET", "/o/r.git/info/refs?service=git-upload-pack", True),
    ("github-readonly", "github.com", "GET", "/o/r/info/refs?service=git-upload-pack", True),
    ("github-readonly", "github.com", "POST", "/o/r.git/git-upload-pack", True),
    ("github-readonly", "github.com", "GET", "/o/r/info/refs?service=git-receive-pack", False),
    ("github-readonly", "github.com", "GET",
     "/o/r/info/refs?service=git-upload-pack&service=git-receive-pack", False),
    ("github-readonly", "github.com", "GET", "/o/r/info/refs", False),
    ("github-readonly", "github.com", "POST", "/o/r.git/git-receive-pack", False),
    ("github-readonly", "github.com", "GET", "/o/r/releases/download/v1/x.tar.gz", True),
    ("github-readonly", "github.com", "GET", "/o/r/archive/refs/tags/v1.tar.gz", True),
    ("github-pr", "api.github.com", "GET", "/repos/o/r/pulls/1/files", True),
    ("github-pr", "api.github.com", "POST", "/repos/o/r/pulls", True),
    ("github-pr", "api.github.com", "POST", "/repos/o/other/pulls", False),  # not named
    ("github-pr", "api.github.com", "POST", "/repos/x/r/issues/3/comments", False),
    ("github-pr", "api.github.com", "PATCH", "/repos/o/r/pulls/3", True),
    ("github-pr", "api.github.com", "POST", "/repos/o/r/pulls/3/comments", True),
    ("github-pr", "api.github.com", "POST", "/repos/o/r/pulls/3/comments/9/replies", True),
    ("github-pr", "api.github.com", "PATCH", "/repos/o/r/pulls/comments/9", True),
    ("github-pr", "api.github.com", "POST", "/repos/o/r/issues/3/comments", True),
    ("github-pr", "api.github.com", "PATCH", "/repos/o/r/issues/comments/9", True),
    ("github-pr", "api.github.com", "PUT", "/repos/o/r/pulls/3/merge", False),
    ("github-pr", "api.github.com", "PUT", "/repos/O/R/pulls/3/merge/", False),
    ("github-pr", "api.github.com", "POST", "/gists", False),
    ("github-pr", "api.github.com", "GET", "/gists/abc", False),
    ("github-pr", "api.github.com", "POST", "/user/repos", False),
    ("github-pr", "api.github.com", "POST", "/orgs/acme/repos", False),
    ("github-pr", "api.github.com", "POST", "/repos/o/r/forks", False),
    ("github-pr", "api.github.com", "POST", "/repos/o/r/generate", False),
    ("github-pr", "api.github.com", "DELETE", "/repos/o/r", False),
    ("github-pr", "api.github.com", "PUT", "/repos/o/r/contents/README.md", False),
    ("github-pr", "api.github.com", "POST", "/graphql", False),
    ("github-pr", "github.com", "POST", "/o/r/git-upload-pack", True),
    ("github-pr", "github.com", "POST", "/o/r/git-receive-pack", False),
    ("github-pr", "github.com", "GET", "/o/r/info/refs?service=git-receive-pack", False),
    ("pypi-no-upload", "upload.pypi.org", "POST", "/legacy/", False),
    ("pypi-no-upload", "upload.pypi.org", "POST", "/legacy", False),
    ("pypi-no-upload", "upload.pypi.org", "post", "/%6Cegacy/", False),
    ("pypi-no-upload", "test.pypi.org", "POST", "/legacy/", False),
    ("pypi-no-upload", "test.pypi.org", "GET", "/simple/corral/", True),
    # its CDN neighbours are read too (a name on an inspected host's address is refused)
    ("pypi-no-upload", "pypi.org", "GET", "/simple/corral/", True),
    ("pypi-no-upload", "files.pythonhosted.org", "GET", "/packages/ab/cd/corral.whl", True),
    ("npm-no-publish", "registry.npmjs.org", "GET", "/left-pad", True),
    ("npm-no-publish", "registry.npmjs.org", "GET", "/@types%2fnode", True),
    ("npm-no-publish", "registry.npmjs.org", "GET", "/left-pad/-/left-pad-1.3.0.tgz", True),
    ("npm-no-publish", "registry.npmjs.org", "POST", "/-/npm/v1/security/advisories/bulk", True),
    ("npm-no-publish", "registry.npmjs.org", "PUT", "/left-pad", False),
    ("npm-no-publish", "registry.npmjs.org", "PUT", "/@acme%2fwidget", False),
    ("npm-no-publish", "registry.npmjs.org", "PUT", "/@acme/widget", False),
    ("npm-no-publish", "registry.npmjs.org", "PUT", "/left-pad/-rev/3-abc", False),
    ("npm-no-publish", "registry.npmjs.org", "PUT", "/-/package/left-pad/dist-tags/latest",
     False),
    ("npm-no-publish", "registry.npmjs.org", "DELETE", "/left-pad/-rev/3-abc", False),
    ("npm-no-publish", "registry.npmjs.org", "POST", "/-/package/@acme%2fwidget/access", False),
    ("npm-no-publish", "registry.yarnpkg.com", "PUT", "/left-pad", False),
])
def test_presets_decide_as_documented(preset, host, method, target, allowed):
    policy = Policy(preset_rules(GITHUB_PR if preset == "github-pr" else preset, "project"))
    decision = policy.inspection(parse_host(host)).decide(method, target)
    assert decision.allowed is allowed, decision.reason


def test_github_presets_allow_their_hosts_and_no_ssh():
    for name in ("github-readonly", GITHUB_PR):
        policy = Policy(preset_rules(name, "project"))
        assert policy.decide_http(HOST, 443).allowed
        assert not policy.tcp_rules(parse_host("github.com"))
    for name in ("pypi-no-upload", "npm-no-publish"):  # guards: they allow no host
        assert not [r for r in preset_rules(name, "project") if r.kind == "http"]


# -- properties ---------------------------------------------------------------------------

segment = st.text("abcXYZ019-_~.@:+i", min_size=1, max_size=4).filter(
    lambda s: s not in (".", ".."))
pattern_item = st.one_of(segment, st.just("*"), st.just("**"))
METHODS = ("GET", "PUT", "POST", "DELETE")


@st.composite
def pattern_and_path(draw):
    """A pattern (no '**/**') and a path that matches it."""
    items = draw(st.lists(pattern_item, max_size=5).filter(
        lambda xs: all(not (a == b == "**") for a, b in itertools.pairwise(xs))))
    path = []
    for item in items:
        if item == "*":
            path.append(draw(segment))
        elif item == "**":
            path.extend(draw(st.lists(segment, max_size=2)))
        else:
            path.append(item)
    return "/" + "/".join(items), path


def _encode(char: str, upper: bool) -> str:
    text = f"%{ord(char):02X}"
    return text if upper else text.lower()


LOOKALIKES = {"i": ["%C4%B1", "%C4%B0"], "s": ["%C5%BF"], "K": ["%E2%84%AA"], ".": [
    "%EF%BC%8E", "%EF%B9%92", "%E2%80%A4"]}
"""Escaped characters that servers normalising Unicode (NFKC, case mapping) read as ASCII."""


def _fullwidth(char: str) -> str:
    return "".join(f"%{b:02X}" for b in chr(ord(char) + 0xFEE0).encode())


@st.composite
def spelling(draw, path: list[str], fold: bool):
    """A target an upstream may route to `path`: escapes, case and Unicode lookalikes (when
    `fold`), a trailing slash, a format suffix (when `fold`: a deny covers it), and the
    tricks that some servers resolve (dot segments, '//', backslashes, ';', '%3B', encoded
    and double-encoded slashes, fullwidth and invisible characters)."""
    out = []
    for index, seg in enumerate(path):
        chars = []
        for char in seg:
            trick = draw(st.sampled_from(["plain", "escape", "case", "unicode"]))
            if trick == "escape":
                char = _encode(char, draw(st.booleans()))
            elif trick == "case" and fold:
                char = char.swapcase()
            elif trick == "unicode" and fold:
                char = draw(st.sampled_from([*LOOKALIKES.get(char, []), _fullwidth(char),
                                             "%E2%80%8B" + char, char + "%C2%AD"]))
            chars.append(char)
        sep = "/" if index == 0 else draw(st.sampled_from(
            ["/", "/", "/", "%2F", "%2f", "\\", "%5C", "//", "/./", "/x/../", "/%2e%2e/../",
             "/x;y/", "%252F", "/x%3By/", "%EF%BC%8F", "/%EF%BC%8E%EF%BC%8E/../"]))
        out.append(sep + "".join(chars))
    target = "".join(out) or "/"
    if fold and path:
        target += draw(st.sampled_from(["", "", ".json", ".json.xml", "%2Ejson", "."]))
    target += draw(st.sampled_from(["", "", "/", "?a=b", "/?x", ";p", "#f", "%3Bp", "%3Fx",
                                    "%23f"]))
    return target


@settings(max_examples=300)
@given(data=st.data(), method=st.sampled_from(METHODS), restricted=st.booleans())
def test_a_denied_pattern_is_never_evaded_by_another_spelling(data, method, restricted):
    pattern, path = data.draw(pattern_and_path())
    rules = [Rule.parse("request", f"!h.example {method} {pattern}")]
    if restricted:
        rules.append(Rule.parse("request", "h.example * /**"))
    inspection = Policy(rules).inspection(parse_host("h.example"))
    target = data.draw(spelling(path, fold=True))
    sent = data.draw(st.sampled_from([method, method.lower(), method.title()]))
    decision = inspection.decide(sent, target)
    assert not decision.allowed, (target, decision.reason)


@settings(max_examples=300)
@given(data=st.data(), method=st.sampled_from(METHODS),
       allows=st.lists(st.tuples(st.sampled_from((*METHODS, "*")), pattern_and_path()),
                       max_size=3),
       denies=st.lists(st.tuples(st.sampled_from((*METHODS, "*")), pattern_and_path()),
                       max_size=2))
def test_another_spelling_never_gains_what_the_plain_path_is_denied(data, method, allows,
                                                                     denies):
    rules = [Rule.parse("inspect", "h.example")]
    rules += [Rule.parse("request", f"h.example {m} {p}") for m, (p, _) in allows]
    rules += [Rule.parse("request", f"!h.example {m} {p}") for m, (p, _) in denies]
    inspection = Policy(rules).inspection(parse_host("h.example"))
    path = data.draw(st.one_of(st.sampled_from([p for _, (_, p) in allows] or [[]]),
                               st.lists(segment, max_size=4)))
    plain = "/" + "/".join(path)
    target = data.draw(spelling(path, fold=False))
    if inspection.decide(method, target).allowed:
        assert inspection.decide(method, plain).allowed, (target, plain)


@settings(max_examples=300)
@given(allows=st.lists(st.tuples(st.sampled_from((*METHODS, "*")), pattern_and_path()),
                       min_size=1, max_size=3),
       path=st.lists(segment, max_size=4), method=st.sampled_from(METHODS))
def test_allows_cover_what_they_name_and_no_suffixed_form(allows, path, method):
    """A format suffix widens denies only: with allows alone, a plain target passes exactly
    when an allow pattern matches it as written."""
    rules = [Rule.parse("request", f"h.example {m} {p}") for m, (p, _) in allows]
    inspection = Policy(rules).inspection(parse_host("h.example"))
    target = "/" + "/".join(path)
    expected = any(r.request.matches(method, tuple(path), ()) for r in rules)
    assert inspection.decide(method, target).allowed is expected


LAX_DENIES = ("* /gists/**", "PUT /repos/*/*/pulls/*/merge", "PUT /@acme/**", "POST /v1/*:run")
LAX_PATHS = ("/gists", "/gists/1", "/repos/o/r/pulls/1/merge", "/@acme/w", "/v1/x:run",
             "/repos/o/r", "/ok/gists", "/v1/x:walk", "/@acme2/w")
TRICKS = st.sampled_from(["plain"] * 6 + ["escape", "twice", "upper", "fullwidth", "invisible",
                                          "lookalike", "overlong"])


@st.composite
def lax_target(draw):
    """A path (denied or not) spelt with the tricks a lax server undoes."""
    path = draw(st.sampled_from(LAX_PATHS))
    out = []
    for char in path:
        trick = draw(TRICKS)
        if char == "/" and trick != "plain":
            char = draw(st.sampled_from(["%2F", "%252F", "\\", "%5C", "%EF%BC%8F", "%C0%AF",
                                         "//", "/./", "/x/../", "/%2e%2E/", ";x/", "%3Bx/"]))
        elif trick == "escape":
            char = _encode(char, draw(st.booleans()))
        elif trick == "twice":
            char = "%25" + _encode(char, True)[1:]
        elif trick == "upper":
            char = char.upper()
        elif trick == "fullwidth" and "!" <= char <= "~":
            char = _fullwidth(char)
        elif trick == "invisible":
            char = draw(st.sampled_from(["%E2%80%8B", "%C2%AD", "%EF%BB%BF"])) + char
        elif trick == "lookalike" and char in LOOKALIKES:
            char = draw(st.sampled_from(LOOKALIKES[char]))
        elif trick == "overlong" and char in "./":
            char = "%C0%AE" if char == "." else "%C0%AF"
        out.append(char)
    tail = draw(st.sampled_from(["", "", ".json", ".json.json", "/", "%3Fx", "%23x", ";x",
                                 "%3Bx", "?a=b", "%2Ejson"]))
    return "".join(out) + tail


@settings(max_examples=1000)
@given(target=lax_target(), method=st.sampled_from(("GET", "PUT", "POST")))
def test_no_path_a_lax_server_reads_as_denied_is_allowed(target, method):
    """The differential: whatever a lax server (tests/unit/policy/lax.py: decoding once or
    twice, overlong UTF-8, NFKC and best fit, '\\', '%3F' and '%23' split after decoding,
    path parameters, merged slashes, dot segments, format suffixes) routes a target to, if
    a deny covers it, the proxy does not allow the target."""
    rules = [Rule.parse("request", "h.example * /**")]
    rules += [Rule.parse("request", f"!h.example {d}") for d in LAX_DENIES]
    inspection = Policy(rules).inspection(parse_host("h.example"))
    if not inspection.decide(method, target).allowed:
        return
    for reading in lax.readings(target):
        for deny in LAX_DENIES:
            deny_method, deny_path = deny.split()
            assert not (deny_method in ("*", method) and lax.covers(deny_path, reading)), (
                target, reading, deny)


def test_the_lax_differential_is_not_vacuous():
    """The reference does read the tricks, and the proxy does allow plain targets."""
    assert ("gists",) in lax.readings("/x/..%252F%EF%BD%87ists%3Bq.json")
    assert ("repos", "o", "r", "pulls", "1", "merge") in lax.readings(
        "/repos/o/r/pulls/1/merge.json.json")
    rules = [Rule.parse("request", "h.example * /**")]
    assert Policy(rules).inspection(parse_host("h.example")).decide("GET", "/ok/gists").allowed


@given(method=st.text(max_size=10), target=st.text(max_size=60))
def test_decide_answers_whatever_it_is_given(github, method, target):
    decision = github.decide(method, target)
    assert isinstance(decision.reason, str) and decision.reason


@pytest.mark.parametrize("target", [
    "//x?access_token=SECRET123",
    "/a/../b?token=SECRET123",
    "http://api.github.com/x?key=SECRET123",
    "/%zz?sig=SECRET123",
])
def test_a_refused_target_is_shown_without_its_query(target):
    """Reasons go into events and the audit log; credentials ride in queries too."""
    decision = policy_of('[[inspect]]\nhost = "api.github.com"\nallow = ["GET /**"]\n'
                         ).inspection(HOST).decide("GET", target)
    assert not decision.allowed
    assert "SECRET123" not in decision.reason and "SECRET123" not in (decision.hint or "")
    assert "(query not shown)" in decision.reason
