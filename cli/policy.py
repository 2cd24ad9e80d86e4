"""`corral check` and `corral presets`: a project's policy read on this host, exactly as the
appliance will read it; no appliance is asked."""

from __future__ import annotations

from pathlib import Path

from appliance.policy import (
    DEFAULT_RULES,
    ConfigError,
    Policy,
    dedupe,
    policy_file_rules,
    preset_description,
    preset_names,
    preset_parameters,
)
from appliance.policy.lint import lint

from . import exitcodes, output


def cmd_check(args) -> int:
    path = Path(args.file)
    try:
        text = path.read_text("utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "", "no such file") from None
    rules = dedupe([*DEFAULT_RULES, *policy_file_rules(text, str(path), "project")])
    policy = Policy(rules)
    warnings = lint(policy)
    if args.json:
        output.data({"file": str(path), "rules": policy.to_json(), "warnings": warnings})
        return exitcodes.OK
    output.table([[r.text, r.kind, r.layer, r.source] for r in rules],
                 ["RULE", "KIND", "LAYER", "SOURCE"])
    for warning in warnings:
        output.warning(f"warning: {warning}")
    output.line(f"\n{path}: ok, {len(rules)} rules" + (f", {len(warnings)} warning(s)"
                                                         if warnings else ""))
    return exitcodes.OK


def cmd_presets(args) -> int:
    names = preset_names()
    if args.json:
        output.data([{"name": n, "description": preset_description(n),
                      "parameters": preset_parameters(n)} for n in names])
    else:
        output.table([[n, ", ".join(preset_parameters(n)), preset_description(n)]
                      for n in names], ["PRESET", "TAKES", "DESCRIPTION"])
        output.line('\na preset that takes parameters is named with them in corral.toml: '
                    'presets = [{name = "github-pr", repos = ["OWNER/REPO"]}]')
    return exitcodes.OK


def register(sub) -> None:
    check = sub.add_parser("check", help="validate a project's corral.toml and show its rules",
                           description="Parse a corral.toml (and the presets it names) exactly "
                           "as the appliance will, print every rule with its source, and warn "
                           "about rules that do not do what they look like (a tcp rule to an "
                           "inspected host reaches it uninspected).")
    check.add_argument("file", nargs="?", default="corral.toml", help="default: ./corral.toml")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(run=cmd_check)

    presets = sub.add_parser("presets", help="list the presets a corral.toml can name")
    presets.add_argument("--json", action="store_true", help="machine-readable output")
    presets.set_defaults(run=cmd_presets)
