"""`corral`: the host CLI. `main(argv) -> int`; only this module maps errors to exit codes.

The CLI imports nothing from `appliance` but `appliance.policy` and `appliance.pki`
(a test enforces it), so it never pulls in the filter, Flask or podman code.

Each command module adds its own commands (`register(sub)`); COMMANDS is the order
`corral --help` lists them in. Helpers more than one command uses live in shared modules
(targets, times, arguments), never in a command module, so the command modules do not
import each other in a circle (tests/unit/test_import_graph.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import exitcodes, output
from .client import CliError

COMMANDS = ("policy", "agents", "control", "evidence", "approvals", "dashboard", "learn",
            "sessions", "selftest", "secrets", "image", "lifecycle", "vm", "box", "certs")
"""The command modules, in the order `corral --help` lists their commands."""

WORDS = {
    "check": "policy", "presets": "policy",
    "agents": "agents",
    "allow-http": "control", "allow-dns": "control", "allow-tcp": "control", "deny": "control",
    "inspect": "control", "allow-request": "control", "deny-request": "control",
    "revoke": "control", "rules": "control", "monitor": "control", "audit": "control",
    "status": "control",
    "evidence": "evidence",
    "ask": "approvals", "approvals": "approvals", "approve": "approvals", "refuse": "approvals",
    "dashboard": "dashboard",
    "learn": "learn",
    "run": "sessions", "shell": "sessions", "ls": "sessions", "stop": "sessions",
    "rm": "sessions", "diff": "sessions", "apply": "sessions",
    "selftest": "selftest",
    "secret": "secrets",
    "image": "image",
    "up": "lifecycle", "down": "lifecycle",
    "provision": "vm", "destroy": "vm", "verify": "vm", "inventory": "vm", "ssh": "vm",
    "box": "box",
    "certs": "certs",
}
"""Which module registers each command (tests/unit/cli/test_main.py keeps it true): a
command line imports only its command's module. `corral shell` is a step of every session's
start, and importing all fifteen (the agents' profiles, the workspace, cryptography) doubled
the CLI's own start."""


class _Version(argparse.Action):
    """--version, read from the package's metadata only when asked (importlib.metadata is
    a tenth of the CLI's start)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import version

        print(f"corral {version('corral')}")
        parser.exit()


def parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with `only`, the top and that one module's commands (with
    `only` empty, the top alone: `--version`)."""
    top = argparse.ArgumentParser(
        prog="corral", description="Run AI coding agents with default-deny egress.")
    top.add_argument("--version", action=_Version,
                     help="show program's version number and exit")
    top.add_argument("--debug", action="store_true", help="show stack traces on errors")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS if only is None else (only,) if only else ():
        importlib.import_module(f"{__package__}.{name}").register(sub)
    return top


def command_module(argv: list[str]) -> str | None:
    """The module registering the command `argv` names, or None for the whole command line:
    when no command word is known, and when anything but `--debug` (or its abbreviation)
    comes before it, since `-h` there asks for the top's help, every command listed. ""
    for `--version` alone (with `--debug` or not): no command's module."""
    first = next((at for at, word in enumerate(argv) if not word.startswith("-")), None)
    if first is None and "--version" in argv and all(
            w == "--version" or (len(w) > 2 and "--debug".startswith(w)) for w in argv):
        return ""  # the version alone: no command's module
    if first is None or not all(len(w) > 2 and "--debug".startswith(w) for w in argv[:first]):
        return None
    return WORDS.get(argv[first])


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line. argparse fills a positional list once: `corral run --agent A
    PROJECT --name N -- ARGS` would leave `-- ARGS` unrecognised (PROJECT took the list).
    So for `run` the words after `--` are taken off first and added to its words after;
    `args.after_dashes` keeps them apart (with --agent they are the agent's)."""
    words = [w for w in argv if not w.startswith("-")]
    top = parser(command_module(argv))
    if words[:1] == ["run"] and "--" in argv:
        cut = argv.index("--")
        args = top.parse_args(argv[:cut])
        args.after_dashes = argv[cut + 1:]
        args.cmd = [*args.cmd, *args.after_dashes]
        return args
    args = top.parse_args(argv)
    args.after_dashes = []
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        return args.run(args)
    except CliError as exc:
        output.error(str(exc), exc.hint)
        return exc.code
    except Exception as exc:
        from appliance.policy import ConfigError  # loaded already where one was raised

        if isinstance(exc, ConfigError):
            output.error(str(exc), "fix the file and run `corral check` again")
            return exitcodes.USAGE
        if args.debug:
            raise
        output.error(f"{type(exc).__name__}: {exc}", "run again with --debug for details")
        return exitcodes.FAILURE


if __name__ == "__main__":
    sys.exit(main())
