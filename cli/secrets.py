"""`corral secret set|ls|rm`: secrets the appliance holds and attaches for sessions.

A value is read from standard input (or typed, unechoed, at a terminal), never taken as an
argument: arguments end up in shell histories and in every process listing.
"""

from __future__ import annotations

import getpass
import sys
from pathlib import Path

from . import exitcodes, output
from .client import CliError
from .targets import client_for

MAX_VALUE = 8192


def read_value(name: str) -> str:
    if sys.stdin.isatty():
        value = getpass.getpass(f"value of {name} (not shown): ")
    else:
        value = sys.stdin.read(MAX_VALUE + 2)
        value = value[:-1] if value.endswith("\n") else value  # `echo` adds one
        value = value[:-1] if value.endswith("\r") else value
    if not value:
        raise CliError(f"no value for {name} on standard input",
                       f"pipe it in: `printenv {name} | corral secret set {name} --host H`",
                       exitcodes.USAGE)
    return value


def read_key(name: str) -> str:
    """An SSH private key, whole, from standard input (never typed: it is many lines)."""
    if sys.stdin.isatty():
        raise CliError(f"secret {name}: an SSH key is read from standard input",
                       f"`corral secret set {name} --ssh ... < ~/.ssh/deploy_key`",
                       exitcodes.USAGE)
    value = sys.stdin.read(MAX_VALUE + 1)
    if not value.strip():
        raise CliError(f"no key for {name} on standard input", "redirect the key file in",
                       exitcodes.USAGE)
    return value


def known_host_keys(path: str, hosts: list[str], port: int) -> list[str]:
    """The keys (`TYPE BASE64`) a known_hosts file holds for these hosts: lines as
    ssh-keyscan prints them (`HOST TYPE BASE64`), or a bare `TYPE BASE64`. Hashed lines and
    other hosts' are passed over. The keys are pinned for the secret: each of its hosts may
    show any of them (one secret per host keeps them apart)."""
    try:
        text = Path(path).read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}", "give a file ssh-keyscan wrote",
                       exitcodes.USAGE) from None
    names = set(hosts) | {f"[{h}]:{port}" for h in hosts}
    keys = []
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0].startswith(("#", "@")):
            continue
        if fields[0].startswith(("ssh-", "ecdsa-", "sk-")):
            keys.append(" ".join(fields[:2]))
        elif len(fields) >= 3 and names & set(fields[0].split(",")):
            keys.append(" ".join(fields[1:3]))
    if not keys:
        raise CliError(f"{path} holds no key for {', '.join(hosts)}",
                       f"`ssh-keyscan {hosts[0]} > FILE`, then check the keys against the "
                       "host's published fingerprints", exitcodes.USAGE)
    return keys


def cmd_set(args) -> int:
    if not args.host:
        raise CliError(f"secret {args.name}: which hosts may it go to?",
                       "name each with --host (e.g. --host api.anthropic.com)", exitcodes.USAGE)
    if args.ssh:
        if not args.known_hosts:
            raise CliError(f"secret {args.name}: which keys do the hosts have?",
                           f"--known-hosts FILE (`ssh-keyscan {args.host[0]} > FILE`)",
                           exitcodes.USAGE)
        if args.only:
            raise CliError("--only is for HTTP secrets: an ssh key goes to its hosts' git "
                           "calls alone", "", exitcodes.USAGE)
        port = 22 if args.port is None else args.port
        body = {"value": read_key(args.name), "hosts": args.host, "scheme": "ssh",
                "user": args.user or "git", "port": port,
                "host_keys": known_host_keys(args.known_hosts, args.host, port)}
        return _store(args, body)
    for given, option in ((args.known_hosts, "--known-hosts"), (args.user, "--user"),
                          (args.port, "--port")):
        if given is not None:
            raise CliError(f"{option} goes with --ssh", "", exitcodes.USAGE)
    body = {"value": read_value(args.name), "hosts": args.host}
    if args.header:
        body.update(scheme="header", header=args.header)
    elif args.basic:
        body.update(scheme="basic", user=args.basic)
    else:
        body["scheme"] = "bearer"
    if args.only:
        body["requests"] = args.only
    return _store(args, body)


def _store(args, body: dict) -> int:
    answer = client_for(args).request("PUT", f"/secrets/{args.name}", body)
    secret = answer["secret"]
    if args.json:
        output.data(answer)
    elif secret["scheme"] == "ssh":
        output.line(f"secret {secret['name']} stored: the git gateway logs in to "
                    f"{', '.join(secret['hosts'])} with it ({_form(secret)}); sessions "
                    "push there over SSH through the gateway, never holding the key")
    else:
        output.line(f"secret {secret['name']} stored for {', '.join(secret['hosts'])} "
                    f"({_form(secret)}); sessions started from now have a placeholder in "
                    f"${secret['name']}")
    return exitcodes.OK


def _form(secret: dict) -> str:
    if secret["scheme"] == "ssh":
        keys = len(secret.get("host_keys") or [])
        return (f"ssh key, as {secret['user']} on port {secret.get('port', 22)}, "
                f"{keys} pinned host key{'s' if keys != 1 else ''}")
    if secret["scheme"] == "header":
        form = f"header {secret['header']}"
    elif secret["scheme"] == "basic":
        form = f"basic auth as {secret['user']}"
    else:
        form = "Authorization: Bearer"
    only = secret.get("requests") or []
    return f"{form}, only with {' | '.join(only)}" if only else form


def cmd_ls(args) -> int:
    answer = client_for(args).request("GET", "/secrets")
    if args.json:
        output.data(answer)
        return exitcodes.OK
    rows = [[s["name"], ", ".join(s["hosts"]), _form(s)] for s in answer["secrets"]]
    if rows:
        output.table(rows, ["SECRET", "HOSTS", "SENT AS"])
    else:
        output.line("no secrets: `corral secret set NAME --host H` stores one")
    return exitcodes.OK


def cmd_rm(args) -> int:
    answer = client_for(args).request("DELETE", f"/secrets/{args.name}")
    if args.json:
        output.data(answer)
    else:
        output.line(f"secret {args.name} removed: running sessions' placeholders for it now "
                    "reach nothing")
    return exitcodes.OK


def register(sub) -> None:
    secret = sub.add_parser(
        "secret", help="secrets the appliance holds for sessions (they get placeholders)",
        description="A secret's value stays on the appliance: a session is given a "
        "placeholder in the variable NAME, and the filter puts the value in place of it on "
        "requests to the secret's hosts (their TLS ended by the filter), in the form given.")
    secret_sub = secret.add_subparsers(dest="secret_command", required=True, metavar="COMMAND")

    def secret_command(name, help, run):
        command = secret_sub.add_parser(name, help=help, description=help)
        command.add_argument("--appliance", default="default", metavar="NAME",
                             help="which appliance (default: %(default)s)")
        command.add_argument("--json", action="store_true", help="machine-readable output")
        command.set_defaults(run=run)
        return command

    store = secret_command("set", "store a secret; its value is read from standard input",
                           cmd_set)
    store.add_argument("name", metavar="NAME", help="the variable sessions find its "
                       "placeholder in, e.g. ANTHROPIC_API_KEY (with --ssh: a name alone)")
    store.add_argument("--host", action="append", metavar="H",
                       help="a host it may go to (repeatable; *.example.com for subdomains, "
                       "not with --ssh)")
    form = store.add_mutually_exclusive_group()
    form.add_argument("--bearer", action="store_true",
                      help="sent as `Authorization: Bearer VALUE` (the default)")
    form.add_argument("--header", metavar="FIELD", help="sent as `FIELD: VALUE`, e.g. x-api-key")
    form.add_argument("--basic", metavar="USER", help="sent as basic auth USER:VALUE (git "
                      "over HTTPS)")
    form.add_argument("--ssh", action="store_true", help="an SSH private key (no passphrase) "
                      "the git gateway logs in to the hosts with; sessions get nothing for "
                      "it. Needs --known-hosts")
    store.add_argument("--known-hosts", metavar="FILE", help="with --ssh: the hosts' public "
                       "keys, as ssh-keyscan prints them; the gateway reaches no other")
    store.add_argument("--user", metavar="LOGIN",
                       help="with --ssh: the login on the hosts (default: git)")
    store.add_argument("--port", type=int,
                       help="with --ssh: the hosts' SSH port (default: 22)")
    store.add_argument("--only", action="append", metavar="'METHOD /path'",
                       help="attach it only to these requests (repeatable; patterns as in "
                       "[[inspect]] allow lists, e.g. 'POST /v1/messages'); any other request "
                       "carrying its placeholder is refused")
    secret_command("ls", "the secrets: name, hosts and how each is sent (never values)", cmd_ls)
    forget = secret_command("rm", "remove a secret", cmd_rm)
    forget.add_argument("name", metavar="NAME")
