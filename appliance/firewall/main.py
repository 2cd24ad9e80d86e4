"""`corral-firewall`: load, or show, the nftables ruleset for a filter config.

  corral-firewall apply --config FILE     the full ruleset for FILE's sessions and listeners
  corral-firewall apply --base [--config FILE]   boot: sandbox interfaces reach nothing
  corral-firewall show [--json]           what is loaded, with counters and learned elements
  corral-firewall print --config FILE     the JSON transaction, without loading it
  corral-firewall remove                  delete table inet corral (`corral down`, once no
                                          sandbox is left running)

Exit 0 on success, 1 when nftables refuses (the previous ruleset stays in force), 2 on a bad
config or policy file.
"""

from __future__ import annotations

import argparse
import json
import sys

from appliance.policy import ConfigError
from appliance.policystore import PolicyStore
from appliance.sessionconfig import FirewallConfig, load_config

from .nft import Nft, NftError
from .ruleset import QUIET, build_base, for_store


def transaction(config_path: str, learned: list[dict] | None = None,
                counts: dict | None = None) -> list[dict]:
    """The ruleset for the config's sessions and those registered in its state directory."""
    return for_store(PolicyStore(load_config(config_path)), learned, counts)


def cmd_apply(args) -> int:
    nft = Nft()
    if args.base:
        interfaces = (load_config(args.config).firewall.interfaces if args.config
                      else FirewallConfig().interfaces)
        nft.apply(build_base(interfaces))
        print("corral-firewall: base ruleset loaded: sandbox interfaces reach nothing")
        return 0
    if not args.config:
        raise SystemExit("corral-firewall: apply needs --config FILE (or --base)")
    learned = nft.learned_elements()
    commands = transaction(args.config, learned, nft.counters())
    nft.apply(commands)
    print(f"corral-firewall: ruleset loaded ({len(commands)} commands, "
          f"{len(learned)} learned elements kept)")
    return 0


def cmd_show(args) -> int:
    items = Nft().list_table()
    if items is None:
        print("corral-firewall: no corral table loaded", file=sys.stderr)
        return 1
    counters = {i["counter"]["name"]: i["counter"] for i in items if "counter" in i}
    learned = [e for i in items if i.get("set", {}).get("name") == "learned"
               for e in i["set"].get("elem", [])]
    rules = [i["rule"] for i in items if "rule" in i]
    if args.json:
        print(json.dumps({"counters": counters, "learned": learned, "rules": len(rules)},
                         indent=2))
        return 0
    print(f"table inet corral: {len(rules)} rules")
    print("\nrejected (packets / bytes):")
    for name, counter in sorted(counters.items()):
        if name.startswith("deny_"):
            print(f"  {name.removeprefix('deny_'):<34} {counter['packets']:>8} / "
                  f"{counter['bytes']}")
    quiet = counters.get(QUIET)
    if quiet is not None:
        print(f"\nlink-local multicast dropped quietly: {quiet['packets']} / {quiet['bytes']}")
    print(f"\nlearned tcp allowances: {len(learned)}")
    for element in learned:
        inner = element.get("elem", element)
        src, dst, port = inner["val"]["concat"]
        print(f"  {src} -> {dst}:{port}  expires in {inner.get('expires', '?')}s")
    return 0


def cmd_print(args) -> int:
    print(json.dumps({"nftables": transaction(args.config)}, indent=1))
    return 0


def cmd_remove(args) -> int:
    nft = Nft()
    if nft.list_table() is None:
        print("corral-firewall: no corral table loaded; nothing to remove")
        return 0
    nft.run([{"delete": {"table": {"family": "inet", "name": "corral"}}}])
    print("corral-firewall: table inet corral removed")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="corral-firewall", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    apply = sub.add_parser("apply", help="load the ruleset (one atomic transaction)")
    apply.add_argument("--config", metavar="FILE", help="the filter's config file")
    apply.add_argument("--base", action="store_true", help="the boot ruleset: deny everything")
    apply.set_defaults(run=cmd_apply)
    show = sub.add_parser("show", help="the loaded ruleset's counters and learned elements")
    show.add_argument("--json", action="store_true")
    show.set_defaults(run=cmd_show)
    printer = sub.add_parser("print", help="print the JSON transaction without loading it")
    printer.add_argument("--config", metavar="FILE", required=True)
    printer.set_defaults(run=cmd_print)
    remove = sub.add_parser("remove", help="delete corral's table (only with no sandboxes)")
    remove.set_defaults(run=cmd_remove)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as exc:
        print(f"corral-firewall: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"corral-firewall: {exc}", file=sys.stderr)
        return 2
    except NftError as exc:
        print(f"corral-firewall: nftables refused the ruleset; the previous one stays in "
              f"force:\n{exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
