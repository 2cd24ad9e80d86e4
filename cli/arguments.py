"""The options several commands share, added the same way by every module's `register(sub)`:
--appliance, --session and --json on a command that talks to an appliance, --for on one that
grants a rule, --project/--yes/--force on one that writes a project's corral.toml."""

from __future__ import annotations

import argparse
import re

from appliance import argtypes


def appliance_command(sub, name: str, help: str, run, session: bool = True,
                      description: str | None = None) -> argparse.ArgumentParser:
    """A command that talks to an appliance's API (about one session, unless session=False)."""
    command = sub.add_parser(name, help=help, description=description or help)
    command.add_argument("--appliance", default="default", metavar="NAME",
                         help="which appliance (default: %(default)s)")
    if session:
        command.add_argument("--session", metavar="NAME",
                             help="which session (default: the only one)")
    command.add_argument("--json", action="store_true", help="machine-readable output")
    command.set_defaults(run=run)
    return command


def machine_command(sub, name: str, help: str, run) -> argparse.ArgumentParser:
    """A command about the appliance's machine (its VM, or its services on this host)."""
    command = sub.add_parser(name, help=help, description=help)
    command.add_argument("--appliance", default="default", metavar="NAME")
    command.set_defaults(run=run)
    return command


def appliance_name(text: str) -> str:
    """An appliance's name (argparse type): a directory's name under the CLI's config, a
    libvirt domain's and a known_hosts alias's part, so letters, digits, `-` and `_`."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an appliance name: letters, digits, '-' and '_', starting with "
            "a letter or a digit, 63 at most")
    return text


seconds = argtypes.seconds()
"""A number of seconds above zero (argparse type)."""


def vm_timeout(command: argparse.ArgumentParser) -> None:
    command.add_argument("--timeout", type=seconds, default=3600, metavar="SECONDS",
                         help="vm: stop vagrant and its process group (ansible, ssh) if "
                         "vagrant has not finished this long after it started, printing "
                         "where it was (default 3600)")


def granted(command: argparse.ArgumentParser) -> None:
    command.add_argument("--for", dest="duration", metavar="DURATION",
                         help="only for this long (90s, 10m, 1h30m, 2d): the appliance "
                         "takes the rule back then, with an event (a deny or inspect "
                         "rule that ends loosens the policy)")


def project_file(command: argparse.ArgumentParser) -> None:
    command.add_argument("--project", metavar="DIR", help="the project whose corral.toml "
                         "gets the rules (default: the current directory)")
    command.add_argument("--yes", action="store_true", help="write it without asking "
                         "(the diff is still shown)")
    command.add_argument("--force", action="store_true", help="even if the session was "
                         "started from another project")
