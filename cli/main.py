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

from . import control, exitcodes, output
from .client import CliError


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

    def appliance_command(name, help, run, session=True, description=None):
        command = sub.add_parser(name, help=help, description=description or help)
        command.add_argument("--appliance", default="default", metavar="NAME",
                             help="which appliance (default: %(default)s)")
        if session:
            command.add_argument("--session", metavar="NAME",
                                 help="which session (default: the only one)")
        command.add_argument("--json", action="store_true", help="machine-readable output")
        command.set_defaults(run=run)
        return command

    examples = {"allow-http": "HOST[:PORT]   e.g. api.example.com, *.example.org:8443",
                "allow-dns": "NAME          e.g. example.com, *.example.org",
                "allow-tcp": "HOST:PORT     e.g. github.com:22",
                "deny": "NAME          wins over every allow, e.g. upload.example.org"}
    for name, example in examples.items():
        metavar, _, text = example.partition(" ")
        command = appliance_command(
            name, f"add a {control.KIND_OF_COMMAND[name]} rule to a session's runtime layer",
            control.cmd_allow)
        command.add_argument("rule", metavar=metavar.strip(), help=text.strip())
    revoke = appliance_command("revoke", "remove a rule from a session's runtime layer",
                               control.cmd_revoke)
    revoke.add_argument("rule", nargs="+", metavar="[KIND] RULE",
                        help="the rule as `corral rules` shows it, optionally after its kind")
    appliance_command("rules", "a session's effective rules: rule, kind, layer, source",
                      control.cmd_rules)
    monitor = appliance_command("monitor", "watch decisions live (reconnects by itself)",
                                control.cmd_monitor)
    monitor.add_argument("--denied", action="store_true", help="only denials")
    monitor.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    audit = appliance_command("audit", "read the audit log, or verify its hash chain",
                              control.cmd_audit, session=False)
    audit.add_argument("--since", metavar="T", help="10m, 2h, 3d, or an ISO time")
    audit.add_argument("--limit", type=int, default=1000, help="at most this many records")
    audit.add_argument("--verify", action="store_true", help="check the chain (exit 5 if broken)")
    audit.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    appliance_command("status", "the appliance's health: API, filter, firewall",
                      control.cmd_status, session=False)
    certs = sub.add_parser("certs", help="the control plane's certificates")
    certs_sub = certs.add_subparsers(dest="certs_command", required=True, metavar="COMMAND")
    rotate = certs_sub.add_parser("rotate", help="issue a new CA and certificates; the old "
                                  "client certificate stops working")
    rotate.add_argument("--appliance", default="default", metavar="NAME")
    rotate.set_defaults(run=control.cmd_certs_rotate)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
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
