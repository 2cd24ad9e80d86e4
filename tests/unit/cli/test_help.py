"""`corral --help` and every subcommand's `--help`, byte for byte as help.json holds them,
and what each command line parses into (every option's dest, default, nargs, choices and the
function it runs), which the help text does not show.

The parser is built from each command module's `register(sub)`: a module moved, renamed or
registered in another order must not change a word a person or a script reads, nor what a
word does. When a command changes on purpose, write the new snapshot and review its diff:

    .venv/bin/python -m tests.unit.cli.test_help --write
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from cli.main import parser

SNAPSHOT = Path(__file__).with_name("help.json")
WRITTEN_WITH = (3, 11)
"""The Python the snapshot is written with: argparse lays help out differently from one
version to the next (3.13 aligns and wraps otherwise), so on any other (a Debian 13 control
machine's 3.13) the words are compared and not the layout."""
COLUMNS = "100"
"""argparse wraps to the terminal's width ($COLUMNS): fixed, so the text does not depend on
the terminal the tests run in."""


def parsers(top: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command line (`corral`, `corral secret set`, ...) and its parser."""
    found = {top.prog: top}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                found.update(parsers(command))
    return found


def shape(command: argparse.ArgumentParser) -> dict:
    """What a command line parses into: its options (one line each in the snapshot) and the
    defaults it sets (the function it runs, by name)."""
    def value(v):
        return getattr(v, "__name__", None) or repr(v)

    return {"actions": [json.dumps([a.option_strings, a.dest, repr(a.default), repr(a.nargs),
                                    repr(a.const), repr(a.choices), value(a.type), a.required,
                                    type(a).__name__]) for a in command._actions],
            "defaults": {k: value(v) for k, v in sorted(command._defaults.items())}}


def current() -> dict[str, dict]:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = COLUMNS
    try:
        return {name: {"help": command.format_help(), **shape(command)}
                for name, command in parsers(parser()).items()}
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def test_every_help_text_is_as_the_snapshot_holds_it():
    expected = json.loads(SNAPSHOT.read_text())
    shown = current()
    assert list(shown) == list(expected), "commands added, removed or reordered"
    def text(help_text: str) -> str:
        return help_text if sys.version_info[:2] == WRITTEN_WITH else " ".join(help_text.split())

    changed = [name for name in expected
               if text(shown[name]["help"]) != text(expected[name]["help"])]
    assert not changed, f"help text changed: {changed}; see the module docstring"


def test_every_command_line_parses_into_what_the_snapshot_holds():
    expected = json.loads(SNAPSHOT.read_text())
    shown = current()
    changed = [name for name in expected if {k: v for k, v in shown[name].items() if k != "help"}
               != {k: v for k, v in expected[name].items() if k != "help"}]
    assert not changed, f"options or defaults changed: {changed}; see the module docstring"


def test_the_snapshot_covers_every_command_and_its_subcommands():
    expected = json.loads(SNAPSHOT.read_text())
    assert {"corral", "corral run", "corral secret set", "corral certs rotate",
            "corral box build", "corral image build"} <= set(expected)
    assert len(expected) > 40


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: python -m tests.unit.cli.test_help --write  (rewrites {SNAPSHOT})")
    if sys.version_info[:2] != WRITTEN_WITH:
        sys.exit(f"write the snapshot with Python {'.'.join(map(str, WRITTEN_WITH))}: its help "
                 "layout is the one kept")
    SNAPSHOT.write_text(json.dumps(current(), indent=1) + "\n")
