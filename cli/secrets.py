"""`corral secret set|ls|rm`: secrets the appliance holds and attaches for sessions.

A value is read from standard input (or typed, unechoed, at a terminal), never taken as an
argument: arguments end up in shell histories and in every process listing.
"""

from __future__ import annotations

import getpass
import sys

from . import exitcodes, output
from .client import CliError
from .control import client_for

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


def cmd_set(args) -> int:
    if not args.host:
        raise CliError(f"secret {args.name}: which hosts may it go to?",
                       "name each with --host (e.g. --host api.anthropic.com)", exitcodes.USAGE)
    body = {"value": read_value(args.name), "hosts": args.host}
    if args.header:
        body.update(scheme="header", header=args.header)
    elif args.basic:
        body.update(scheme="basic", user=args.basic)
    else:
        body["scheme"] = "bearer"
    if args.only:
        body["requests"] = args.only
    answer = client_for(args).request("PUT", f"/secrets/{args.name}", body)
    secret = answer["secret"]
    if args.json:
        output.data(answer)
    else:
        output.line(f"secret {secret['name']} stored for {', '.join(secret['hosts'])} "
                    f"({_form(secret)}); sessions started from now have a placeholder in "
                    f"${secret['name']}")
    return exitcodes.OK


def _form(secret: dict) -> str:
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
