"""Commands that talk to an appliance's admin API: rules, monitor, audit, status, certs."""

from __future__ import annotations

import datetime
import os
import re
import signal
import sys
import time

from appliance import pki

from . import exitcodes, output, render
from .client import Client, CliError, load_appliance

KIND_OF_COMMAND = {"allow-http": "http", "allow-dns": "dns", "allow-tcp": "tcp", "deny": "deny",
                   "inspect": "inspect", "allow-request": "request", "deny-request": "request"}


def client_for(args) -> Client:
    return Client(load_appliance(args.appliance))


def pick_session(client: Client, given: str | None) -> str:
    """The named session, or the only one there is."""
    if given:
        return given
    names = [s["name"] for s in client.request("GET", "/sessions")["sessions"]]
    if len(names) == 1:
        return names[0]
    raise CliError("which session? " + (f"there are {len(names)}: {', '.join(names)}" if names
                                         else "there are none"),
                   "pass --session NAME" if names else "start one with `corral run`",
                   exitcodes.USAGE)


def cmd_allow(args) -> int:
    client = client_for(args)
    kind = KIND_OF_COMMAND[args.command]
    session = pick_session(client, args.session)
    rule = args.rule
    if kind == "request":  # HOST METHOD PATH, as three words; a deny starts with '!'
        rule = f"{'!' if args.command == 'deny-request' else ''}{args.rule} {args.method} " \
               f"{args.path}"
    request = {"session": session, "kind": kind, "rule": rule}
    if args.duration is not None:
        request["expires_in"] = parse_duration(args.duration)
    answer = client.request("POST", "/policy/rules", request)
    if args.json:
        output.data(answer)
    else:
        verb = "added" if answer["added"] else "already there:"
        ends = answer.get("expires")
        until = f", until {clock(ends)}" if ends else (
            ", for good (it was already)" if args.duration is not None else "")
        output.line(f"{verb} {kind} {render.text(answer['rule']['rule'])} (session {session}"
                    f"{until})")
    return exitcodes.OK


def parse_duration(text: str, option: str = "--for") -> int:
    """`90s`, `10m`, `1h30m`, `2d`: seconds (--for, --max-uptime, --idle)."""
    parts = re.fullmatch(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text.strip())
    if not text.strip() or parts is None:
        raise CliError(f"{option} {text!r} is not a duration",
                       "write it as 90s, 10m, 1h30m or 2d", exitcodes.USAGE)
    days, hours, minutes, seconds = (int(p or 0) for p in parts.groups())
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise CliError(f"{option} {text!r} is no time at all", "give a duration above zero",
                       exitcodes.USAGE)
    return total


def clock(ts: float) -> str:
    """A wall-clock time for a person: the time alone today, else the date too."""
    moment = datetime.datetime.fromtimestamp(ts)
    today = datetime.datetime.now().date() == moment.date()
    return moment.strftime("%H:%M:%S" if today else "%Y-%m-%d %H:%M:%S")


def cmd_revoke(args) -> int:
    client = client_for(args)
    session = pick_session(client, args.session)
    words = args.rule
    if len(words) >= 2 and words[0] in set(KIND_OF_COMMAND.values()):
        kind, text = words[0], " ".join(words[1:])
    else:
        text = " ".join(words)
        rules = client.request("GET", "/policy", session=session)["rules"]
        matches = [r for r in rules if r["rule"] == text and r["layer"] == "session"]
        if len(matches) != 1:
            kinds = sorted({r["kind"] for r in rules if r["rule"] == text})
            raise CliError(f"{len(matches) or 'no'} runtime rule(s) read {text!r} in session "
                           f"{session}", f"name the kind: `corral revoke KIND {text}`"
                           + (f" (kinds: {', '.join(kinds)})" if kinds else ""), exitcodes.USAGE)
        kind = matches[0]["kind"]
    answer = client.request("DELETE", "/policy/rules",
                            {"session": session, "kind": kind, "rule": text})
    if args.json:
        output.data(answer)
    else:
        output.line(f"revoked {kind} {render.text(answer['rule']['rule'])} (session "
                    f"{session})")
    return exitcodes.OK


def cmd_rules(args) -> int:
    client = client_for(args)
    session = pick_session(client, args.session)
    rules = client.request("GET", "/policy", session=session)["rules"]
    if args.json:
        output.data({"session": session, "rules": rules})
    else:
        output.table([[r["rule"], r["kind"], r["layer"], r["source"],
                       clock(r["expires"]) if r.get("expires") else ""] for r in rules],
                     ["RULE", "KIND", "LAYER", "SOURCE", "UNTIL"])
    return exitcodes.OK


def cmd_monitor(args) -> int:
    client = client_for(args)
    if args.ask:
        from .approvals import monitor_ask

        return monitor_ask(client, args, _color(args))
    if args.project is not None:
        raise CliError("--project: only with --ask (where `a` writes the rule)",
                       code=exitcodes.USAGE)
    verdict = "deny" if args.denied else None
    delay = 0.5
    while True:
        try:
            for event in client.stream("/events/stream", session=args.session, verdict=verdict):
                delay = 0.5
                if args.json:
                    output.data_line(event)
                else:
                    output.event(event, color=_color(args))
            output.notice("the stream ended; reconnecting")
        except CliError as exc:
            if exc.code != exitcodes.UNREACHABLE:
                raise
            output.notice(f"{exc}; reconnecting in {delay:.1f}s")
        except KeyboardInterrupt:
            return exitcodes.OK
        try:
            time.sleep(delay)
        except KeyboardInterrupt:
            return exitcodes.OK
        delay = min(delay * 2, 5.0)


def _color(args) -> bool:
    if args.color == "auto":
        return sys.stdout.isatty() and "NO_COLOR" not in os.environ
    return args.color == "always"


def parse_since(text: str) -> float:
    """`10m`, `2h`, `3d` ago, or an ISO 8601 time."""
    match = re.fullmatch(r"(\d+)([smhd])", text)
    if match:
        seconds = int(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
        return time.time() - seconds
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise CliError(f"--since {text!r} is neither a duration (10m, 2h) nor an ISO time",
                       code=exitcodes.USAGE) from None
    if moment.tzinfo is None:
        moment = moment.astimezone()
    return moment.timestamp()


VERIFY_TIMEOUT = 600.0
"""Seconds `corral audit --verify` waits: the filter reads every segment (512 MiB by default
takes seconds on an appliance, more under emulation)."""


def cmd_audit(args) -> int:
    client = client_for(args)
    if args.verify:
        verdict = client.request("GET", "/audit/verify", timeout=VERIFY_TIMEOUT)
        if args.json:
            output.data(verdict)
        elif verdict["intact"]:
            first, head = verdict.get("first") or 1, verdict["head"]["seq"]
            output.line(f"audit log intact: {verdict['lines']} records in "
                        f"{verdict.get('segments', 1)} segment(s), chain verified from seq "
                        f"{first} to seq {head}")
            if verdict.get("note"):
                output.line(f"note: {render.text(verdict['note'])}")
        else:
            where = render.text(verdict.get("segment") or "its end")
            if verdict.get("line"):
                where += f" line {render.text(verdict['line'])}"
            output.error(f"audit log broken at {where}: {render.text(verdict['error'])}")
        return exitcodes.OK if verdict["intact"] else exitcodes.AUDIT_BROKEN
    since = parse_since(args.since) if args.since else None
    after, shown, records = 0, 0, []
    while shown < args.limit:
        page = client.request("GET", "/audit", after=after, since=since,
                              limit=min(1000, args.limit - shown))
        records = page["records"]
        for record in records:
            if args.json:
                output.data_line(record)
            else:
                output.event(record, color=_color(args))
        shown += len(records)
        if not page["more"] or not records:
            break
        after = records[-1]["seq"]
    return exitcodes.OK


def cmd_status(args) -> int:
    appliance = load_appliance(args.appliance)
    machine = None
    if appliance.backend == "vm":
        from .vm import vm_state

        machine = vm_state(appliance)
        if machine["state"] != "running":
            if args.json:
                output.data({"vm": machine})
            else:
                output.line(f"appliance {args.appliance}: VM {machine['state']}"
                            + (f" ({machine['error']})" if "error" in machine else ""))
            return exitcodes.FAILURE
    status = Client(appliance).request("GET", "/status")
    if machine is not None:
        status["vm"] = machine
    if args.json:
        output.data(status)
        return exitcodes.OK
    if machine is not None:
        output.line(f"vm: {machine['state']}, domain {machine['domain']}, {machine['cpus']} "
                    f"CPUs, {machine['memory_mib']} MiB")
    health = status["filter"]
    firewall = status.get("firewall") or {}
    output.line(f"appliance {args.appliance}: api {status['version']}, up {status['uptime']:.0f}s")
    if health["healthy"]:
        output.line(f"filter: healthy, up {health['uptime']:.0f}s, {health['sessions']} sessions,"
                    f" {health['active_connections']} connections")
    else:
        output.line(f"filter: DOWN: {render.text(health['error'])}")
    trouble = render.text(firewall.get("error", "unknown"))
    output.line("firewall: " + (f"loaded, {firewall['rules']} rules" if firewall.get("loaded")
                                else f"NOT LOADED: {trouble}"))
    audit = health.get("audit") or {}
    if audit.get("head"):
        output.line(f"audit: up to seq {audit['head']['seq']}, {audit.get('segments', 1)} "
                    f"segment(s), {audit.get('bytes', 0) / 2**20:.1f} MiB"
                    + (f"; ERROR: {render.text(audit['error'])}" if audit.get("error")
                       else ""))
    sandbox = status.get("sandbox")
    if sandbox is not None:
        output.line(f"sandbox: healthy, {sandbox['sessions']} sessions, image {sandbox['image']}"
                    + ("" if sandbox["image_present"] else " MISSING: `corral image build`")
                    if sandbox["healthy"] else f"sandbox: DOWN: {render.text(sandbox['error'])}")
    return exitcodes.OK if health["healthy"] and firewall.get("loaded") and (
        sandbox is None or sandbox["healthy"]) else exitcodes.FAILURE


def cmd_certs_interception(args) -> int:
    """The filter's interception CA: what sessions trust for the hosts it inspects."""
    client = client_for(args)
    if args.refresh:
        answer = client.request("POST", "/certs/interception/refresh", {})
        if args.json:
            output.data(answer)
        elif answer["sessions"] is not None:
            output.line(f"given the CA again: {', '.join(answer['sessions']) or 'no session'}")
        if answer["failed"]:
            raise CliError("not given the CA: " + "; ".join(
                f"{name}: {why}" for name, why in answer["failed"].items()))
        return exitcodes.OK
    answer = client.request("GET", "/certs/interception")
    ca = answer.get("ca")
    if args.json:
        output.data(answer)
    elif ca is None:
        output.line("inspection is off: the filter has no interception CA (set [inspect] "
                    "ca_dir in its config, as the roles do)")
    elif args.pem:
        output.line(ca["pem"].rstrip("\n"))
    else:
        _show_ca(ca)
    return exitcodes.OK


def _show_ca(ca: dict) -> None:
    output.line(f"interception CA  {ca['subject']}\n"
                f"sha256           {ca['sha256']}\n"
                f"valid            {ca['not_before']} to {ca['not_after']} "
                f"({ca['days_left']} days left)\n"
                "rotate           " + ("`corral certs rotate --interception`" if ca["rotatable"]
                                       else "given as files ([inspect] ca_cert): by hand"))


def cmd_certs_rotate(args) -> int:
    """A new CA, server and client certificate; the old client certificate stops working.
    With --interception: a new interception CA instead, trusted by every running session."""
    if args.interception:
        answer = client_for(args).request("POST", "/certs/interception/rotate", {})
        if args.json:
            output.data(answer)
            return exitcodes.OK
        _show_ca(answer["ca"])
        sessions = answer["sessions"]
        output.line(f"rotated: the filter signs with the new CA now (was {answer['previous']})"
                    + ("" if sessions is None else f"; {len(sessions)} running session(s) "
                       f"given it: {', '.join(sessions) or 'none'}") + ". Processes started "
                    "before in a session (a running node, a JVM) keep the old one: restart "
                    "them")
        if answer["failed"]:
            raise CliError("not given the new CA: " + "; ".join(
                f"{name}: {why}" for name, why in answer["failed"].items()),
                "fix that, then `corral certs interception --refresh`")
        return exitcodes.OK
    appliance = load_appliance(args.appliance)
    if appliance.server_dir is None:
        raise CliError(f"appliance {appliance.name} does not run on this host",
                       "rotate a VM appliance's certificates by re-provisioning it "
                       "(playbooks/rotate-certs.yml)", exitcodes.USAGE)
    host = appliance.host_port[0]
    bundle = pki.issue([host] if host[:1].isdigit() or ":" in host else ["127.0.0.1"],
                       [] if host[:1].isdigit() or ":" in host else [host])
    pki.write_server(bundle, appliance.server_dir)
    pki.write_client(bundle, appliance.directory)
    if appliance.api_pidfile:
        try:
            os.kill(int(appliance.api_pidfile.read_text().split()[0]), signal.SIGHUP)
        except (OSError, ValueError, IndexError) as exc:
            raise CliError(f"new certificates written, but the API could not be told to load "
                           f"them ({appliance.api_pidfile}: {exc})",
                           "restart corral-api: it loads them when it starts") from None
    output.line(f"rotated: new CA and certificates for {appliance.name}; the API reloads them, "
                "and the previous client certificate no longer works")
    return exitcodes.OK
