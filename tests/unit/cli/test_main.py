"""How `corral` finds its command: the table of which module registers each command word is
the modules' own registration, and a command line imports its own module and not the rest
(`corral shell` is a step of every session's start)."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from cli import main


def registered() -> dict[str, str]:
    """Each command word, and the module whose register() adds it."""
    words = {}
    for name in main.COMMANDS:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"cli.{name}").register(sub)
        for word in sub.choices:
            assert word not in words, f"{word} is registered by {words[word]} and {name}"
            words[word] = name
    return words


def test_the_table_of_command_words_is_what_the_modules_register():
    assert registered() == main.WORDS


@pytest.mark.parametrize("word", sorted(main.WORDS))
def test_each_command_parses_alone_as_in_the_whole_parser(word):
    """A command's parser built alone is the same as in the whole command line: its help and
    its options' destinations."""
    def command(top):
        sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
        return sub.choices[word]

    alone, whole = command(main.parser(main.WORDS[word])), command(main.parser())
    assert alone.format_help() == whole.format_help()
    assert [a.dest for a in alone._actions] == [a.dest for a in whole._actions]


def loaded_after(argv: list[str]) -> set[str]:
    probe = ("import sys; from cli.main import parse; parse(sys.argv[1:]); "
             "print(' '.join(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True,
                          check=True)
    return set(done.stdout.split())


def test_a_session_command_imports_neither_the_other_commands_nor_cryptography():
    modules = loaded_after(["shell", "s1", "--", "true"])
    assert "cli.sessions" in modules
    others = {f"cli.{name}" for name in main.COMMANDS} - {"cli.sessions", "cli.agents",
                                                          "cli.learn"}
    assert not modules & others, sorted(modules & others)
    assert not {m for m in modules if m.split(".")[0] in ("cryptography", "flask")}
    assert "importlib.metadata" not in modules


def test_help_and_an_unknown_word_still_list_every_command(capsys):
    with pytest.raises(SystemExit):
        main.parse(["--help"])
    listed = capsys.readouterr().out
    assert all(word in listed for word in main.WORDS), listed
    with pytest.raises(SystemExit) as exited:
        main.parse(["shel"])
    assert exited.value.code == 2
    assert "invalid choice: 'shel'" in capsys.readouterr().err


def test_version_is_read_only_when_asked(capsys):
    with pytest.raises(SystemExit) as exited:
        main.parse(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("corral 0.")


@pytest.mark.parametrize("argv", [["--help", "shell"], ["-h", "run", "p"], ["--he", "ls"]])
def test_help_before_a_command_word_lists_every_command(argv, capsys):
    """`-h` before the command word is the top's help: the whole list, not the one module's
    commands the word names."""
    with pytest.raises(SystemExit) as exited:
        main.parse(argv)
    assert exited.value.code == 0
    listed = capsys.readouterr().out
    assert all(f"    {word} " in listed or f"    {word}\n" in listed for word in main.WORDS), \
        listed


def test_debug_before_the_command_word_still_imports_its_module_only():
    modules = loaded_after(["--debug", "shell", "s1"])
    assert "cli.sessions" in modules and "cli.vm" not in modules and "cli.certs" not in modules


def test_the_credentials_the_client_checks_are_those_provisioning_writes():
    """cli.client names them itself (reading three files must not import cryptography)."""
    from appliance import pki
    from cli import client

    assert client.CREDENTIALS == pki.CLIENT_FILES


def test_version_alone_loads_no_command():
    """`corral --version` is how a script checks the CLI is there: it had every command's
    module imported to print one line."""
    probe = ("import sys; from cli.main import parse\ntry: parse(sys.argv[1:])\n"
             "except SystemExit: pass\nprint(' '.join(sorted(sys.modules)))")
    for argv in (["--version"], ["--debug", "--version"]):
        done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True,
                              text=True, check=True)
        version, modules = done.stdout.splitlines()
        assert version.startswith("corral 0.")
        loaded = {f"cli.{name}" for name in main.COMMANDS} & set(modules.split())
        assert not loaded, sorted(loaded)
