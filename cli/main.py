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
import sys
from importlib.metadata import version

from appliance.policy import ConfigError

from . import (
    agents,
    approvals,
    box,
    certs,
    control,
    dashboard,
    evidence,
    exitcodes,
    image,
    learn,
    lifecycle,
    output,
    policy,
    secrets,
    selftest,
    sessions,
    vm,
)
from .client import CliError

COMMANDS = (policy, agents, control, evidence, approvals, dashboard, learn, sessions, selftest,
            secrets, image, lifecycle, vm, box, certs)
"""The command modules, in the order `corral --help` lists their commands."""


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="corral", description="Run AI coding agents with default-deny egress.")
    top.add_argument("--version", action="version", version=f"corral {version('corral')}")
    top.add_argument("--debug", action="store_true", help="show stack traces on errors")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return top


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line. argparse fills a positional list once: `corral run --agent A
    PROJECT --name N -- ARGS` would leave `-- ARGS` unrecognised (PROJECT took the list).
    So for `run` the words after `--` are taken off first and added to its words after;
    `args.after_dashes` keeps them apart (with --agent they are the agent's)."""
    top = parser()
    words = [w for w in argv if not w.startswith("-")]
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
    except ConfigError as exc:
        output.error(str(exc), "fix the file and run `corral check` again")
        return exitcodes.USAGE
    except CliError as exc:
        output.error(str(exc), exc.hint)
        return exc.code
    except Exception as exc:
        if args.debug:
            raise
        output.error(f"{type(exc).__name__}: {exc}", "run again with --debug for details")
        return exitcodes.FAILURE


if __name__ == "__main__":
    sys.exit(main())
