"""`corral`: the host CLI. `main(argv) -> int`; only this module maps errors to exit codes.

The CLI imports nothing from `appliance` but `appliance.policy` and `appliance.pki`
(a test enforces it), so it never pulls in the filter, Flask or podman code.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import version
from pathlib import Path

from appliance.policy import (
    DEFAULT_RULES,
    ConfigError,
    Policy,
    dedupe,
    policy_file_rules,
    preset_description,
    preset_names,
)

from . import exitcodes, output


def cmd_check(args) -> int:
    path = Path(args.file)
    try:
        text = path.read_text("utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "", "no such file") from None
    rules = dedupe([*DEFAULT_RULES, *policy_file_rules(text, str(path), "project")])
    policy = Policy(rules)
    if args.json:
        output.data({"file": str(path), "rules": policy.to_json()})
        return exitcodes.OK
    output.table([[r.text, r.kind, r.layer, r.source] for r in rules],
                 ["RULE", "KIND", "LAYER", "SOURCE"])
    output.line(f"\n{path}: ok, {len(rules)} rules")
    return exitcodes.OK


def cmd_presets(args) -> int:
    names = preset_names()
    if args.json:
        output.data([{"name": n, "description": preset_description(n)} for n in names])
    else:
        output.table([[n, preset_description(n)] for n in names], ["PRESET", "DESCRIPTION"])
    return exitcodes.OK


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="corral", description="Run AI coding agents with default-deny egress.")
    top.add_argument("--version", action="version", version=f"corral {version('corral')}")
    top.add_argument("--debug", action="store_true", help="show stack traces on errors")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = sub.add_parser("check", help="validate a project's corral.toml and show its rules",
                           description="Parse a corral.toml (and the presets it names) exactly "
                           "as the appliance will, and print every rule with its source.")
    check.add_argument("file", nargs="?", default="corral.toml", help="default: ./corral.toml")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(run=cmd_check)

    presets = sub.add_parser("presets", help="list the presets a corral.toml can name")
    presets.add_argument("--json", action="store_true", help="machine-readable output")
    presets.set_defaults(run=cmd_presets)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as exc:
        output.error(str(exc), "fix the file and run `corral check` again")
        return exitcodes.USAGE
    except Exception as exc:
        if args.debug:
            raise
        output.error(f"{type(exc).__name__}: {exc}", "run again with --debug for details")
        return exitcodes.FAILURE


if __name__ == "__main__":
    sys.exit(main())
