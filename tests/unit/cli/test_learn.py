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
                          ("dns", "a.cdn.example.com"), ("http", "b.cdn.example.com"),
                          ("http", "c.cdn.example.com"), ("http", "api.example.org"),
                          ("tcp", "git.example.net")}
    assert found[("http", "pypi.org")].asked == 2
    assert found[("dns", "a.cdn.example.com")].rules == ["a.cdn.example.com"]  # a lookup only
    assert found[("http", "api.example.org")].rules == ["api.example.org:443",
                                                        "api.example.org:8443"]
    assert found[("tcp", "git.example.net")].rules == ["git.example.net:22"]
    assert found[("tcp", "git.example.net")].reasons == ["to push the branch"]


def test_what_a_person_refused_is_never_proposed_again():
    refused = {"session": "s1", "kind": "approval", "verdict": "change", "action": "refused",
               "grant_kind": "http", "target": "pypi.org:443"}
    refused_name = {**refused, "target": "api.example.org"}  # a DNS-opened one: every port
    found = {c.name for c in candidates([*RECORDS, refused, refused_name], "s1")}
    assert "pypi.org" not in found and "api.example.org" not in found
    assert "files.pythonhosted.org" in found


def test_records_naming_what_no_file_should_get_are_left_out():
    hostile = [denied(f"corral allow-http {target}") for target in (
        "*.co.uk:443", "example.com:*", "host.\uff23\uff2f\uff32\uff32\uff21\uff2c:443",
        "[::1]:443", "0x7f.1:443", "a b.test:443", "ok.test:99999", "ok.test:0443x")]
    hostile.append(denied("corral allow-ssh x.test:22"))
    found = candidates([*hostile, denied("corral allow-http Fine.TEST.:0443")], "s1")
    assert [(c.kind, c.name, c.rules) for c in found] == [("http", "fine.test",
                                                           ["fine.test:443"])]


def test_the_proposal_is_each_name_unless_folding_is_asked_for():
    current = Policy(policy_file_rules('[http]\nallow = ["api.example.org:8443"]\n',
                                       "corral.toml", "project"))
    found = candidates(RECORDS, "s1")
    exact = propose(found, current)
    # the file allows api.example.org:8443 already: only its port 443 is proposed
    assert [(a.kind, a.rule) for a in exact.additions] == [
        ("http", "api.example.org:443"), ("http", "pypi.org:443"),
        ("dns", "a.cdn.example.com"), ("http", "b.cdn.example.com:443"),
        ("http", "c.cdn.example.com:80"), ("http", "files.pythonhosted.org:443"),
        ("tcp", "git.example.net:22")]
    assert exact.additions[-1].comment == "asked 1x (agent 1)"
    assert exact.foldable == ["preset pypi (2 of the names)"]  # a.cdn... was a DNS lookup
    folded = propose(found, current, fold=True)
    assert [(a.kind, a.rule) for a in folded.additions][:1] == [("preset", "pypi")]
    assert folded.covered["preset pypi"] == ["pypi.org", "files.pythonhosted.org"]
    three = candidates([*RECORDS, denied("corral allow-http d.cdn.example.com:443")], "s1")
    wildcard = [a for a in propose(three, fold=True).additions if a.rule.startswith("*")]
    assert [a.rule for a in wildcard] == ["*.cdn.example.com"]  # asked on 80 and 443
    assert "allows any name under it" in wildcard[0].comment
    assert propose(three).foldable[-1] == "*.cdn.example.com (3 names)"
    everything = '[http]\nallow = ["api.example.org", "api.example.org:8443"]\n'
    assert "api.example.org" in propose(found, Policy(policy_file_rules(
        everything, "corral.toml", "project"))).already


def test_a_wildcard_never_covers_a_top_level_domain():
    found = candidates([denied(f"corral allow-http n{i}.com:443") for i in range(5)], "s1")
    assert [a.rule for a in propose(found, fold=True).additions] == [f"n{i}.com:443"
                                                                     for i in range(5)]


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
    assert after.startswith('presets = [\n    "pypi", # 2 of its names\n]\n\n# the project')
    assert "# the API" in after and 'exclude = ["secrets/"]' in after
    document = parse_policy(after, "corral.toml", "project")
    assert [p.name for p in document.presets] == ["pypi"]
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
        projectfile.confirm(path, TOML, after, yes=False, as_json=False)
    assert "+    \"b.test\"," in capsys.readouterr().out  # the diff was shown
    with pytest.raises(CliError, match=r"with --json, .* only with --yes"):
        projectfile.confirm(path, TOML, after, yes=False, as_json=True)
    assert projectfile.confirm(path, TOML, after, yes=True, as_json=False)
    projectfile.replace(path, TOML, after)
    assert path.read_text() == after and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["corral.toml"]  # no temporary left
    broken = after.replace('"b.test"', '"b.test:99999"')
    with pytest.raises(CliError, match=r"would make .* unusable"):
        projectfile.confirm(path, after, broken, yes=True, as_json=False)
    assert path.read_text() == after
    with pytest.raises(CliError, match="changed since it was read"):  # edited meanwhile
        projectfile.replace(path, TOML, projectfile.added(TOML, [Addition("http", "c.test")]))
    assert path.read_text() == after


def test_through_a_symlink_the_file_it_points_to_is_written(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "corral.toml").write_text(TOML)
    project = tmp_path / "project"
    project.mkdir()
    (project / "corral.toml").symlink_to("../shared/corral.toml")
    path, before = projectfile.read(project)
    assert before == TOML
    after = projectfile.added(before, [Addition("http", "b.test")])
    projectfile.replace(path, before, after)
    assert (project / "corral.toml").is_symlink()
    assert (shared / "corral.toml").read_text() == after
    (project / "corral.toml").unlink()
    (project / "corral.toml").symlink_to("../nowhere/corral.toml")
    path, before = projectfile.read(project)
    with pytest.raises(CliError, match="whose directory is not there"):
        projectfile.replace(path, before, projectfile.added(before, [Addition("http", "x")]))


def test_a_preset_goes_before_the_tables_and_comments_stay_with_their_keys():
    text = "# about the project\ndescription = \"x\"  # ours\n\n# the http rules\n" \
           "[http]\nallow = [\"a.test\"]\n"
    after = projectfile.added(text, [Addition("preset", "pypi")])
    assert after.index("presets") < after.index("[http]")
    assert "# the http rules\n[http]" in after and 'description = "x"  # ours' in after
    assert [p.name for p in parse_policy(after, "corral.toml", "project").presets] == [
        "pypi"]


def test_the_monitor_asks_about_the_oldest_open_approval_until_it_is_decided():
    from cli.approvals import Asking, prompt

    asking = Asking([{"id": "ap-1", "session": "s1", "kind": "http", "target": "a.test:443",
                      "note": "", "waiting": 1}])
    asking.see({"kind": "approval", "verdict": "pending", "approval": "ap-2",
                "session": "s1", "grant_kind": "tcp", "target": "b.test:22",
                "note": "push\x1b[31m"})
    asking.see({"kind": "connect", "verdict": "deny", "approval": None})
    assert asking.first["id"] == "ap-1"
    asking.later()
    assert prompt(asking.first) == (
        ["  ap-2: the agent says: push\\x1b[31m"],
        ["ap-2: session s1 asks for tcp b.test:22",
         "[o]nce [s]ession [a]lways [r]efuse [n]ext [q]uit: a key decides ap-2"])
    asking.see({"kind": "approval", "verdict": "change", "action": "refused",
                "approval": "ap-2"})
    assert asking.first["id"] == "ap-1"
    asking.see({"kind": "approval", "verdict": "change", "action": "expired",
                "approval": "ap-1"})
    assert asking.first is None


def test_what_learning_open_let_through_is_a_candidate_too():
    learned = {"session": "s1", "kind": "connect", "verdict": "allow", "learning": "open",
               "hint": "corral allow-http open.test:443", "rule": None}
    plain_allow = {**learned, "learning": None, "hint": "corral allow-http plain.test:443"}
    found = candidates([learned, plain_allow], "s1")
    assert [(c.kind, c.name, c.rules) for c in found] == [("http", "open.test",
                                                           ["open.test:443"])]


# -- never wider than what a person left open (issue 26, E11) -------------------------------


def refused(target: str, kind: str = "http", session: str = "s1") -> dict:
    return {"session": session, "kind": "approval", "verdict": "change", "action": "refused",
            "grant_kind": kind, "target": target}


def proposed(records: list[dict], fold: bool = False, denies: Policy | None = None,
             current: Policy | None = None) -> list[tuple[str, str]]:
    from cli.learn import refusals

    found = candidates(records, "s1")
    proposal = propose(found, current, fold, refused=refusals(records, "s1"), denies=denies)
    return [(a.kind, a.rule) for a in proposal.additions]


def test_a_port_a_person_refused_is_not_opened_by_the_bare_name_for_another():
    records = [refused("site.test:443"), denied("corral allow-http site.test:80", kind="http")]
    assert proposed(records) == [("http", "site.test:80")]  # never "site.test": 443 too


def test_a_name_is_proposed_bare_only_where_both_http_ports_were_asked():
    one = [denied("corral allow-http one.test:443")]
    both = [denied("corral allow-http both.test:443"),
            denied("corral allow-http both.test:80", kind="http"),
            denied("corral allow-http both.test:8443")]
    assert proposed(one) == [("http", "one.test:443")]
    assert proposed(both) == [("http", "both.test"), ("http", "both.test:8443")]


def test_a_wildcard_never_folds_over_a_name_a_person_refused():
    siblings = [denied(f"corral allow-http {n}.cdn.test:443") for n in "abc"]
    assert proposed(siblings, fold=True) == [("http", "*.cdn.test:443")]
    for refusal in (refused("x.cdn.test:443"), refused("x.cdn.test"), refused("x.cdn.test",
                                                                              "dns")):
        assert proposed([*siblings, refusal], fold=True) == [
            ("http", f"{n}.cdn.test:443") for n in "abc"], refusal
    # a refusal on a port the wildcard would not open leaves it folded
    assert proposed([*siblings, refused("x.cdn.test:22", "tcp")], fold=True) == [
        ("http", "*.cdn.test:443")]


def test_a_preset_never_folds_over_a_name_a_person_refused():
    asked = [denied("corral allow-http api.github.com:443"),
             denied("corral allow-http codeload.github.com:443")]
    assert ("preset", "github") in proposed(asked, fold=True)
    # the github preset also opens uploads.github.com and github.com:22
    for refusal in (refused("uploads.github.com:443"), refused("github.com:22", "tcp")):
        assert proposed([*asked, refusal], fold=True) == [
            ("http", "api.github.com:443"), ("http", "codeload.github.com:443")], refusal


def test_a_refused_tcp_port_is_never_proposed_whatever_asked_for_it():
    records = [refused("db.test:5432", "tcp"), denied("corral allow-tcp db.test:5432"),
               denied("corral allow-http db.test:5432"), denied("corral allow-tcp db.test:6432")]
    assert proposed(records) == [("tcp", "db.test:6432")]


def test_a_fold_never_covers_a_name_the_sessions_own_deny_rules_cover():
    from appliance.policy import Rule

    siblings = [denied(f"corral allow-http {n}.cdn.test:443") for n in "abc"]
    for layer in ("session",):  # a runtime deny does not go with the project's next session
        denies = Policy([Rule.parse("deny", "x.cdn.test", layer, "api")])
        assert ("http", "*.cdn.test:443") not in proposed(siblings, fold=True, denies=denies)
    kept = Policy([Rule.parse("deny", "x.cdn.test", "appliance", "/etc/corral/policy.toml")])
    assert ("http", "*.cdn.test:443") in proposed(siblings, fold=True, denies=kept)


def test_approve_always_and_learn_write_one_rule_for_one_grant():
    from cli.approvals import always_addition

    for target, port in (("Docs.Example.org:443", "443"), ("docs.example.org:80", "80"),
                         ("docs.example.org:8443", "8443")):
        approval = {"id": "ap-1", "session": "s1", "kind": "http", "target": target}
        learned = proposed([denied(f"corral allow-http docs.example.org:{port}")])
        assert [(always_addition(approval, "2026-01-01").kind,
                 always_addition(approval, "2026-01-01").rule)] == learned
    # a name looked up in ask mode is granted as the bare name, and written so
    looked_up = {"id": "ap-2", "session": "s1", "kind": "http", "target": "docs.example.org"}
    assert always_addition(looked_up, "2026-01-01").rule == "docs.example.org"
