"""`corral run --agent NAME [PROJECT] [-- ARGS...]`: which word is the project, which go to
the agent, and what is refused before any appliance is reached."""

from __future__ import annotations

import pytest

from cli.client import CliError
from cli.main import main, parse
from cli.sessions import agent_words


@pytest.mark.parametrize(("argv", "project", "extra"), [
    (["run", "--agent", "claude"], None, []),
    (["run", "--agent", "claude", "proj"], "proj", []),
    (["run", "--agent", "claude", "proj", "--name", "n", "--", "--model", "m"], "proj",
     ["--model", "m"]),
    (["run", "--agent", "claude", "--", "proj"], None, ["proj"]),  # after --: the agent's
    (["run", "--agent", "claude", "--project", "p", "--detach"], "p", []),
])
def test_the_first_word_is_the_project_and_words_after_dashes_the_agents(argv, project,
                                                                          extra):
    assert agent_words(parse(argv)) == (project, extra)


def test_without_agent_the_words_are_the_command_as_before():
    args = parse(["run", "--name", "n", "--", "bash", "-c", "echo --"])
    assert args.cmd == ["bash", "-c", "echo --"] and args.agent is None
    assert parse(["run", "--detach"]).cmd == []


@pytest.mark.parametrize(("argv", "message"), [
    (["run", "--agent", "claude", "a", "b"], "one project directory, not a b"),
    (["run", "--agent", "claude", "--project", "a", "b"], "two projects"),
])
def test_two_projects_are_refused(argv, message):
    with pytest.raises(CliError, match=message):
        agent_words(parse(argv))


def test_an_unknown_agent_is_named_before_any_appliance_is_reached(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "nowhere"))  # no appliance at all
    assert main(["run", "--agent", "nope", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no agent profile 'nope' (known: aider, claude, codex, opencode)" in err
