"""`corral selftest`: the bypass battery run inside a session through the API (or in a
throwaway session this command starts and removes), and its result for a person."""

from __future__ import annotations

import io
import json
import secrets
import tarfile
import time

from . import exitcodes, output
from .arguments import appliance_command
from .client import SLOW, Client, CliError
from .targets import client_for


def plain_allowed(rules: list[dict], avoid: list[str]) -> str | None:
    """The first exact http host of these rules (a wildcard names no host) that is none of
    `avoid`, or None."""
    for rule in rules:
        name = rule["rule"].split(":")[0]
        if rule["kind"] == "http" and not name.startswith("*") and name not in avoid:
            return name
    return None


def _default_allowed(client: Client, session: str, args) -> str:
    """An allowed name to prove the legitimate path works: the session's first exact http
    rule for a host the other probes do not treat otherwise: not --inspected (they expect a
    host whose TLS the filter does not end), not --neighbour (on an inspected host's
    address, it gets no tunnel), not --echo-secret's host (its secret inspects it)."""
    avoid = [args.inspected, args.neighbour, (args.echo_secret or "").partition("@")[2]]
    found = plain_allowed(client.request("GET", "/policy", session=session)["rules"],
                          [h for h in avoid if h])
    if found is None:
        raise CliError(f"session {session} allows no http host to test the allowed path with",
                       "pass --allowed NAME (a host the policy allows)", exitcodes.USAGE)
    return found


PROBE_DENIED = "GET /corral-selftest-denied"
"""A request the throwaway session's request rule (`GET /corral-selftest-denied/**`) denies
on its inspected host (the battery's --denied-request; `/corral-selftest-denied.json` is
how the format-suffix probe spells it)."""
PROBE_REPO = "corral-selftest/probe"
"""The repository its [[git]] table lists for that host, only the session's own branches
pushable (the battery's --git-repo)."""


def _empty_project(inspected: str | None = None, neighbour: str | None = None,
                   echo_secret: str | None = None) -> tuple[io.BytesIO, int]:
    """A project with nothing in it: the throwaway session gets a workspace, so the review
    probe has a /work to write into and a diff to check. With `inspected`, a corral.toml
    that allows that host and inspects it, for the inspection probes: with a request rule
    denying PROBE_DENIED and a [[git]] table listing PROBE_REPO, which the probes run into
    (never reaching the host); and allows `neighbour` (not inspected) too. With
    `echo_secret` (NAME@HOST), it allows HOST: a secret's value goes only to a host
    `[http]` allows (its secret has it inspected)."""
    echo_host = (echo_secret or "").partition("@")[2] or None
    allowed = [h for h in (inspected, neighbour if inspected else None, echo_host) if h]
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        if allowed:
            # TOML basic strings, quoted as JSON quotes them
            hosts = ", ".join(json.dumps(h) for h in dict.fromkeys(allowed))
            text = f"[http]\nallow = [{hosts}]\n"
            if inspected:
                host = json.dumps(inspected)
                method, path = PROBE_DENIED.split(" ")
                text += (f'\n[[inspect]]\nhost = {host}\ndeny = ["{method} {path}/**"]\n\n'
                         f'[[git]]\nhost = {host}\nrepos = ["{PROBE_REPO}"]\n')
            encoded = text.encode()
            info = tarfile.TarInfo("corral.toml")
            info.size, info.mode, info.mtime = len(encoded), 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(encoded))
    size = data.tell()
    data.seek(0)
    return data, size


STATES = {"passed": "ok", "failed": "FAIL", "not-run": "NOT RUN"}


def cmd_selftest(args) -> int:
    if args.ask_hold is not None and args.session is None:
        raise CliError("--ask-hold runs the approval probes in a session in ask mode: name "
                       "one (a throwaway session does not ask)",
                       "corral ask --session S --hold 2, then corral selftest S --ask-hold 2 "
                       "--only held-request-sends-nothing --only approval-flood-bounded",
                       exitcodes.USAGE)
    client = client_for(args)
    throwaway = None
    if args.session is None:
        throwaway = f"selftest-{secrets.token_hex(3)}"
        output.notice(f"starting throwaway session {throwaway} ...")
        data, size = _empty_project(args.inspected, args.neighbour, args.echo_secret)
        client.request("POST", "/sessions", upload=(data, size, "application/gzip"),
                       timeout=SLOW, name=throwaway, preset=args.preset or [])
    session = args.session or throwaway
    try:
        options = {"allowed": args.allowed or _default_allowed(client, session, args)}
        if throwaway and args.inspected:  # what its corral.toml forbids there
            options.update(denied_request=PROBE_DENIED, git_repo=PROBE_REPO)
        for key in ("denied", "foreign_resolver", "v6_target", "private_name", "tcp_name",
                    "inspected", "other_gateway", "silence", "connections", "ask_hold", "only",
                    "skip_group", "denied_request", "git_repo", "git_ssh", "fake_upgrade",
                    "echo_secret", "neighbour"):
            if getattr(args, key) is not None:
                options[key] = getattr(args, key)
        output.notice(f"running the bypass battery in {session} ...")
        result = client.request("POST", f"/sessions/{session}/selftest", options, timeout=SLOW)
    finally:
        if throwaway:
            client.request("DELETE", f"/sessions/{throwaway}", timeout=SLOW)
    if args.json:
        output.data(result)
    else:
        probes = result["probes"]
        output.table([[STATES.get(p.get("state"), "FAIL"), p["id"], p.get("threat", ""),
                       f"{p.get('ms', 0):.1f}", p.get("detail", "")] for p in probes],
                     ["", "PROBE", "THREAT", "MS", "DETAIL"])
        output.line("\n" + selftest_summary(result, session))
    return exitcodes.OK if result["passed"] else exitcodes.FAILURE


def selftest_summary(result: dict, session: str) -> str:
    """`N/M probes passed in SESSION`, then what did not pass and what was left out."""
    probes = result["probes"]
    count = {state: sum(p.get("state") == state for p in probes) for state in STATES}
    unrecorded = sum(bool(p.get("unrecorded")) for p in probes)
    text = f"{count['passed']}/{len(probes)} probes passed in {session}"
    if count["failed"]:
        text += f"; {count['failed']} failed"
        if unrecorded:
            text += f" ({unrecorded} denied but not recorded)"
    if count["not-run"]:
        text += f"; {count['not-run']} not run (could not be tried: see DETAIL)"
    summary = result.get("summary") or {}
    for group, ids in (summary.get("skipped_groups") or {}).items():
        text += f"; group {group} skipped ({len(ids)} probes)"
    if summary.get("unselected"):
        text += f"; {len(summary['unselected'])} not selected (an option they need was " \
            "not given)"
    if result.get("summary") is None:
        text += "; the battery did not finish"
    return text


def register(sub) -> None:
    selftest = appliance_command(
        sub, "selftest", "the bypass battery inside a session (or a throwaway one)",
        cmd_selftest, session=False,
        description="Run every escape attempt THREATS.md lists from inside a session; each "
        "must fail, fast. Without SESSION a throwaway session is started and removed.")
    selftest.add_argument("session", nargs="?")
    selftest.add_argument("--allowed", metavar="HOST", help="a host the policy allows "
                          "(default: the session's first exact http rule)")
    selftest.add_argument("--preset", action="append", metavar="P",
                          help="presets of the throwaway session")
    for option, text in (("denied", "a name the policy denies"),
                         ("foreign-resolver", "a resolver outside, to try DNS around the filter"),
                         ("v6-target", "an IPv6 address outside"),
                         ("private-name", "an allowed name that resolves to a private address"),
                         ("tcp-name", "NAME:PORT allowed by a tcp rule (expects a banner)"),
                         ("inspected", "a host the policy allows and inspects, its body "
                          "scan on, no request rule refusing GET or POST /selftest"),
                         ("denied-request", "'METHOD /PATH' a request rule denies on "
                          "--inspected (a throwaway session has one)"),
                         ("git-repo", "OWNER/REPO a [[git]] table lists for --inspected, "
                          "refs/heads/main not pushable, no push option allowed (a "
                          "throwaway session has one)"),
                         ("git-ssh", "a git host the session reaches over SSH through "
                          "the git gateway, its [[git]] table listing --git-repo"),
                         ("fake-upgrade", "a path on --inspected that answers 101 without "
                          "switching (httpbin's /status/101)"),
                         ("echo-secret", "NAME@HOST: a bearer secret whose host echoes the "
                          "request (httpbin's /headers; a throwaway session allows HOST)"),
                         ("neighbour", "a name the policy allows and does not inspect, on "
                          "an address --inspected uses (a throwaway session allows it)"),
                         ("other-gateway", "another session's gateway")):
        selftest.add_argument(f"--{option}", metavar="X", help=text)
    selftest.add_argument("--silence", type=int, metavar="SECONDS",
                          help="how long sni-after-silence waits (longer than the filter's "
                          "header_timeout; default 11)")
    selftest.add_argument("--connections", type=int, metavar="N",
                          help="most connections the connection-cap probe holds (default 2000)")
    selftest.add_argument("--ask-hold", type=int, metavar="SECONDS",
                          help="the session is in ask mode with this hold (`corral ask`): run "
                          "the approval probes, apart (--only held-request-sends-nothing "
                          "--only approval-flood-bounded); nobody must decide meanwhile")
    selftest.add_argument("--only", action="append", metavar="PROBE",
                          help="run only this probe (repeatable)")
    selftest.add_argument("--skip-group", action="append", metavar="GROUP",
                          choices=["network", "kernel", "review"],
                          help="leave out a group of probes: network, kernel, review "
                          "(repeatable; the result says so)")
