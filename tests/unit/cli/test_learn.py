"""Learning a policy from denials, and writing rules into a project's corral.toml, without an
appliance: records in, additions out; TOML text in, TOML text out."""

from __future__ import annotations

import os
import stat

import pytest

from appliance.policy import Policy, parse_policy
from appliance.policy.layers import policy_file_rules
from cli import projectfile
from cli.client import CliError
from cli.learn import candidates, propose
from cli.projectfile import Addition


def denied(hint: str, kind: str = "connect", session: str = "s1", **extra) -> dict:
    return {"session": session, "kind": kind, "verdict": "deny", "hint": hint,
            "reason": "not in the policy", "rule": None, **extra}


RECORDS = [
    denied("corral allow-http pypi.org:443"),
    denied("corral allow-http pypi.org:443"),
    denied("corral allow-http files.pythonhosted.org:443", kind="tls"),
    denied("corral allow-dns a.cdn.example.com", kind="dns"),
    denied("corral allow-http b.cdn.example.com:443"),
    denied("corral allow-http c.cdn.example.com:80", kind="http"),
    denied("corral allow-http api.example.org:443"),
    denied("corral allow-http api.example.org:8443"),
    {"session": "s1", "kind": "approval", "verdict": "pending", "grant_kind": "tcp",
     "target": "git.example.net:22", "note": "to push the branch"},
]
NEVER = [
    denied("corral allow-http 10.0.0.1:443"),          # an IP literal: a blocked range's way in
    denied("corral allow-http metadata.corral:80"),    # the appliance's own names
    {**denied("corral allow-http denied-by-rule.test:443"), "rule": "denied-by-rule.test"},
    {**denied(""), "name": "placeholder.test"},        # no command allows it
    denied("corral allow-http other-session.test:443", session="s2"),
    {"session": "s1", "kind": "approval", "verdict": "pending", "grant_kind": "http",
     "target": "held.test:443"},                        # a held request's: counted by its denial
    {**denied("corral allow-http allowed.test:443"), "verdict": "allow"},
]


def test_only_what_a_person_could_allow_in_that_session_is_a_candidate():
    found = {(c.kind, c.name): c for c in candidates(RECORDS + NEVER, "s1")}
    assert set(found) == {("http", "pypi.org"), ("http", "files.pythonhosted.org"),
                          ("http", "a.cdn.example.com"), ("http", "b.cdn.example.com"),
                          ("http", "c.cdn.example.com"), ("http", "api.example.org"),
                          ("tcp", "git.example.net")}
    assert found[("http", "pypi.org")].asked == 2
    assert found[("http", "a.cdn.example.com")].by == {"dns": 1}  # a name: wanted for http
    assert found[("http", "api.example.org")].rules == ["api.example.org",
                                                        "api.example.org:8443"]
    assert found[("tcp", "git.example.net")].rules == ["git.example.net:22"]
    assert found[("tcp", "git.example.net")].reasons == ["to push the branch"]


def test_the_proposal_is_a_preset_a_wildcard_and_each_name_left():
    current = Policy(policy_file_rules('[http]\nallow = ["api.example.org:8443"]\n',
                                       "corral.toml", "project"))
    found = candidates(RECORDS, "s1")
    proposal = propose(found, current)
    # the file allows api.example.org:8443 already: only its port 443 is proposed
    assert [(a.kind, a.rule) for a in proposal.additions] == [
        ("preset", "pypi"), ("http", "*.cdn.example.com"), ("http", "api.example.org"),
        ("tcp", "git.example.net:22")]
    assert proposal.covered["preset pypi"] == ["pypi.org", "files.pythonhosted.org"]
    assert "3 names under cdn.example.com" in proposal.additions[1].comment
    assert proposal.additions[3].comment == "asked 1x (agent 1)"
    assert proposal.already == []
    exact = propose(found, wildcards=False)
    assert ("http", "b.cdn.example.com") in [(a.kind, a.rule) for a in exact.additions]
    assert ("http", "api.example.org") in [(a.kind, a.rule) for a in exact.additions]
    everything = '[http]\nallow = ["api.example.org", "api.example.org:8443"]\n'
    assert "api.example.org" in propose(found, Policy(policy_file_rules(
        everything, "corral.toml", "project"))).already


def test_a_wildcard_never_covers_a_top_level_domain():
    found = candidates([denied(f"corral allow-http n{i}.com:443") for i in range(5)], "s1")
    assert [a.rule for a in propose(found).additions] == [f"n{i}.com" for i in range(5)]


TOML = """# the project's own comment
[http]
allow = ["a.test"]  # the API

[workspace]
exclude = ["secrets/"]
"""


def test_rules_are_added_keeping_what_a_person_wrote():
    after = projectfile.added(TOML, [Addition("http", "b.test:8080", "asked 3x"),
                                     Addition("preset", "pypi", "2 of its names"),
                                     Addition("tcp", "git.test:22"),
                                     Addition("http", "a.test", "there already")])
    assert after.startswith("# the project's own comment\npresets = [")
    assert "# the API" in after and 'exclude = ["secrets/"]' in after
    document = parse_policy(after, "corral.toml", "project")
    assert document.presets == ("pypi",)
    assert {(r.kind, r.text) for r in document.rules} >= {
        ("http", "a.test"), ("http", "b.test:8080"), ("tcp", "git.test:22")}
    assert after.count('"a.test"') == 1 and '"b.test:8080", # asked 3x' in after
    assert projectfile.added(after, [Addition("http", "b.test:8080")]) == after
    fresh = projectfile.added("", [Addition("http", "b.test")])
    assert parse_policy(fresh, "corral.toml", "project").rules[0].text == "b.test"
    with pytest.raises(CliError, match=r"corral\.toml"):
        projectfile.added("[http\n", [Addition("http", "b.test")])
    with pytest.raises(CliError, match=r"\[http\] allow is not a list"):
        projectfile.added('[http]\nallow = "a.test"\n', [Addition("http", "b.test")])


def test_the_file_is_written_only_when_told_atomically_and_keeping_its_mode(tmp_path,
                                                                              capsys):
    path = tmp_path / "corral.toml"
    path.write_text(TOML)
    os.chmod(path, 0o640)
    after = projectfile.added(TOML, [Addition("http", "b.test")])
    with pytest.raises(CliError, match="not written"):  # no terminal to ask on, no --yes
        projectfile.write(path, TOML, after, yes=False, as_json=False)
    assert path.read_text() == TOML
    assert "+    \"b.test\"," in capsys.readouterr().out  # the diff was shown
    assert projectfile.write(path, TOML, after, yes=True, as_json=False)
    assert path.read_text() == after and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["corral.toml"]  # no temporary left
    broken = after.replace('"b.test"', '"b.test:99999"')
    with pytest.raises(CliError, match=r"would make .* unusable"):
        projectfile.write(path, after, broken, yes=True, as_json=False)
    assert path.read_text() == after
