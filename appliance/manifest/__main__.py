"""`python -m appliance.manifest`: the appliance's manifest, run as root in corral's venv.

  collect                    print the running appliance's manifest (JSON)
  write FILE                 collect and write FILE atomically, only if its content changed;
                             prints `written` or `unchanged` (site.yml's last step); refuses
                             (exit 1) while the loaded ruleset is not the rendered one
  check FILE                 compare the running appliance with FILE; each difference on a
                             line, by name; exit 1 if there is any (verify.yml)
  render-ruleset --config F  (inside a scratch network namespace: collect runs it there)

Exit 0: done, or no difference; 1: differences; 2: a fact could not be read, or FILE is not
a manifest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from appliance.argtypes import seconds
from appliance.atomic import write_atomic
from appliance.firewall.nft import NftError
from appliance.policy import ConfigError

from . import AS_RENDERED, ManifestError, compare, dumps, loads
from .collect import CollectError, collect, render_in_this_namespace


def _collect(args, recorded: dict | None = None) -> tuple[dict, list[str]]:
    """The running appliance's manifest. Checking, the name and commit it cannot read are
    the recorded ones (the commit is the control machine's: provisioning passes it)."""
    name = args.name or (recorded or {}).get("appliance", {}).get("name", "")
    commit = args.commit or (recorded or {}).get("corral", {}).get("commit", "unknown")
    venv = Path(args.venv)
    return collect(Path(args.root), venv, name, commit, wheel_dir=_default(args.wheels, venv,
                   "wheels"), lock=_default(args.lock, venv, "wheels/appliance.txt"),
                   settle=args.settle)


def _default(given: str | None, venv: Path, beside: str) -> Path:
    """A path given, or the one beside the venv (the base role's layout: /opt/corral)."""
    return Path(given) if given else venv.parent / beside


def cmd_collect(args) -> int:
    manifest, notes = _collect(args)
    sys.stdout.buffer.write(dumps(manifest))
    for note in notes:
        print(f"ruleset: {note}", file=sys.stderr)
    return 0


def cmd_write(args) -> int:
    path = Path(args.file)
    manifest, notes = _collect(args)
    if manifest["ruleset"]["loaded"] != AS_RENDERED:
        # an appliance is recorded only as it should be: a wrong ruleset is not "as built"
        print(f"manifest: not written: the loaded ruleset is {manifest['ruleset']['loaded']} "
              "(is corral-filter running? `journalctl -u corral-filter`)", file=sys.stderr)
        for note in notes:
            print(f"  {note}", file=sys.stderr)
        return 1
    data = dumps(manifest)
    if path.exists() and path.read_bytes() == data:
        print("unchanged")
        return 0
    write_atomic(path, data, mode=0o644)
    print("written")
    return 0


def cmd_check(args) -> int:
    path = Path(args.file)
    try:
        recorded = loads(path.read_bytes(), str(path))
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest: provisioning writes it (run site.yml, "
                            "`corral provision`)") from None
    live, notes = _collect(args, recorded)
    comparison = compare(recorded, live)
    if args.json:
        print(json.dumps({**comparison.to_json(), "ruleset_notes": notes}, indent=1))
    else:
        for difference in comparison.differences:
            print(difference)
        for note in notes:
            print(f"  ruleset: {note}")
        if not comparison.differences:
            print(f"as provisioned: the appliance matches {path}")
    return 1 if comparison.differences else 0


def cmd_render(args) -> int:
    print(json.dumps(render_in_this_namespace(args.config, args.sessions)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m appliance.manifest",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"collect": (cmd_collect, "print the running appliance's manifest"),
                "write": (cmd_write, "write the manifest to FILE when its content changed"),
                "check": (cmd_check, "compare the running appliance with the manifest FILE")}
    for name, (run, text) in commands.items():
        command = sub.add_parser(name, help=text)
        if name != "collect":
            command.add_argument("file", metavar="FILE")
        command.add_argument("--root", default="/", help="where the files are (default /)")
        command.add_argument("--venv", default=sys.prefix, help="corral's venv (this one)")
        command.add_argument("--wheels", help="the wheels it was installed from (default: "
                             "wheels/ beside the venv)")
        command.add_argument("--lock", help="the hashed lock file (default: "
                             "wheels/appliance.txt beside the venv, as corral_base unpacks it)")
        command.add_argument("--name", help="the appliance's name (check: the recorded one)")
        command.add_argument("--commit", help="corral's git commit, from the control machine")
        command.add_argument("--settle", type=seconds(zero=True), default=0, metavar="SECONDS",
                             help="wait this long for the loaded ruleset to be the rendered one")
        command.add_argument("--json", action="store_true", help="check: machine-readable")
        command.set_defaults(run=run)
    render = sub.add_parser("render-ruleset", help=argparse.SUPPRESS)
    render.add_argument("--config", required=True)
    render.add_argument("--sessions", action="store_true")
    render.set_defaults(run=cmd_render)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ManifestError, CollectError, ConfigError, NftError, OSError) as exc:
        print(f"manifest: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
