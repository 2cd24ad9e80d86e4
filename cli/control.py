"""Commands that talk to an appliance's admin API about its policy and health: runtime rules
(allow-*, deny, inspect, *-request, revoke, rules), monitor, audit, status."""

from __future__ import annotations

import os
import sys
import time

from . import approvals, exitcodes, heads, output, render, vm
from .arguments import appliance_command, granted
from .client import Client, CliError, load_appliance
from .targets import client_for, pick_session
from .times import clock, parse_duration, parse_since

KIND_OF_COMMAND = {"allow-http": "http", "allow-dns": "dns", "allow-tcp": "tcp", "deny": "deny",
                   "inspect": "inspect", "allow-request": "request", "deny-request": "request"}


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
        return approvals.monitor_ask(client, args, _color(args))
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


VERIFY_TIMEOUT = 600.0
"""Seconds `corral audit --verify` waits: the filter reads every segment (512 MiB by default
takes seconds on an appliance, more under emulation)."""


def cmd_audit(args) -> int:
    appliance = load_appliance(args.appliance)
    client = Client(appliance)
    if args.verify:
        return _verify_audit(args, client, appliance)
    _keep_heads(client, appliance)
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


def _verify_audit(args, client: Client, appliance) -> int:
    """The chain as the appliance checks it, and every signed head kept on this host
    checked against the log (cli/heads.py): a log rewritten whole passes the first only."""
    verdict = client.request("GET", "/audit/verify", timeout=VERIFY_TIMEOUT)
    try:
        kept = heads.verify(client, appliance)
    except heads.KeyChanged as exc:
        kept = {"intact": False, "error": f"{exc} ({exc.hint})", "seq": None, "kept": 0,
                "checked": 0, "retired": 0, "key": None}
    intact = verdict["intact"] and kept["intact"]
    if args.json:
        output.data({**verdict, "intact": intact, "chain_intact": verdict["intact"],
                     "heads": kept})
        return exitcodes.OK if intact else exitcodes.AUDIT_BROKEN
    if verdict["intact"]:
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
    if kept["intact"]:
        output.line(f"signed heads: {kept['kept']} kept on this host, {kept['checked']} found "
                    f"in the log with their hashes (key {kept['key']})"
                    + (f"; {kept['retired']} older than the log's first record (retention)"
                       if kept["retired"] else ""))
    else:
        at = f" at seq {kept['seq']}" if kept.get("seq") is not None else ""
        output.error(f"signed heads{at}: {render.text(kept['error'])}",
                     "the log on the appliance is not the one whose heads were signed: keep "
                     "the appliance as it is and compare with `corral evidence` bundles and "
                     "the heads kept here")
    return exitcodes.OK if intact else exitcodes.AUDIT_BROKEN


def _keep_heads(client: Client, appliance) -> dict | None:
    """Keep the heads signed since the last look; a changed key is said, not fatal here
    (`corral audit --verify` fails on it)."""
    try:
        return heads.keep(client, appliance)
    except heads.KeyChanged as exc:
        output.warning(f"{exc}; {exc.hint}")
        return None
    except CliError as exc:  # an appliance from before signed heads: 404
        output.warning(f"signed audit heads not kept: {exc}")
        return None


def cmd_status(args) -> int:
    appliance = load_appliance(args.appliance)
    machine = None
    if appliance.backend == "vm":
        machine = vm.vm_state(appliance)
        if machine["state"] != "running":
            if args.json:
                output.data({"vm": machine})
            else:
                output.line(f"appliance {args.appliance}: VM {machine['state']}"
                            + (f" ({machine['error']})" if "error" in machine else ""))
            return exitcodes.FAILURE
    client = Client(appliance)
    status = client.request("GET", "/status")
    if status["filter"].get("healthy"):
        kept = _keep_heads(client, appliance)
        if kept is not None:
            status["audit_heads"] = kept
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
    workers = health.get("workers") or []
    if workers:
        output.line(workers_line(workers))
    trouble = render.text(firewall.get("error", "unknown"))
    output.line("firewall: " + (f"loaded, {firewall['rules']} rules" if firewall.get("loaded")
                                else f"NOT LOADED: {trouble}"))
    audit = health.get("audit") or {}
    if audit.get("head"):
        output.line(f"audit: up to seq {audit['head']['seq']}, {audit.get('segments', 1)} "
                    f"segment(s), {audit.get('bytes', 0) / 2**20:.1f} MiB"
                    + (f"; ERROR: {render.text(audit['error'])}" if audit.get("error")
                       else ""))
    if status.get("audit_heads"):
        kept = status["audit_heads"]
        output.line(f"audit heads: {kept['kept']} signed heads kept on this host ({kept['new']} "
                    f"new), key {kept['key']}")
    if health.get("journal"):
        output.line(journal_line(health["journal"]))
    sandbox = status.get("sandbox")
    if sandbox is not None:
        output.line(f"sandbox: healthy, {sandbox['sessions']} sessions, image {sandbox['image']}"
                    + ("" if sandbox["image_present"] else " MISSING: `corral image build`")
                    if sandbox["healthy"] else f"sandbox: DOWN: {render.text(sandbox['error'])}")
    return exitcodes.OK if health["healthy"] and firewall.get("loaded") and (
        sandbox is None or sandbox["healthy"]) and all(
        w["up"] for w in workers) else exitcodes.FAILURE


def workers_line(workers: list[dict]) -> str:
    """`status`'s line for the filter's worker processes ([filter] workers)."""
    def one(w: dict) -> str:
        if not w["up"]:
            return f"{w['index']} DOWN (its sessions get no answer; restarting)"
        return f"{w['index']} up, {len(w.get('sessions', []))} sessions"
    restarts = sum(w["restarts"] for w in workers)
    return (f"workers: {'; '.join(one(w) for w in workers)}"
            + (f"; {restarts} restarts" if restarts else ""))


def journal_line(journal: dict) -> str:
    """`status`'s line for the export to journald ([events] journal): what went, what not."""
    line = f"journal: {journal['sent']} events sent to {journal['socket']}"
    if journal["lost"]:
        line += f"; {journal['lost']} NOT sent (the audit log has them)"
        if journal.get("error"):
            line += f": {render.text(journal['error'])}"
    if journal.get("waiting"):
        line += f"; journald full, {journal['queued']} waiting"
    return line


def register(sub) -> None:
    examples = {"allow-http": "HOST[:PORT]   e.g. api.example.com, *.example.org:8443",
                "allow-dns": "NAME          e.g. example.com, *.example.org",
                "allow-tcp": "HOST:PORT     e.g. github.com:22",
                "deny": "NAME          wins over every allow, e.g. upload.example.org"}
    for name, example in examples.items():
        metavar, _, text = example.partition(" ")
        command = appliance_command(
            sub, name, f"add a {KIND_OF_COMMAND[name]} rule to a session's runtime layer",
            cmd_allow)
        command.add_argument("rule", metavar=metavar.strip(), help=text.strip())
        granted(command)
    inspect = appliance_command(sub, "inspect", "have the filter end TLS to a host and judge "
                                "each request (a session's runtime layer)", cmd_allow)
    inspect.add_argument("rule", metavar="HOST", help="e.g. api.github.com, *.example.org")
    granted(inspect)
    for name, verb in (("allow-request", "allow"), ("deny-request", "deny")):
        command = appliance_command(
            sub, name, f"{verb} a method and path on an inspected host (a session's runtime "
            "layer)", cmd_allow, description=f"{verb.capitalize()} requests on an inspected "
            "host by method and path glob (`*` one segment, `**` any): deny wins; a runtime "
            "allow only widens a host's allow list.")
        command.add_argument("rule", metavar="HOST")
        command.add_argument("method", metavar="METHOD", help="GET, POST, ... or *")
        command.add_argument("path", metavar="PATH", help="e.g. /repos/acme/widget/pulls/*")
        granted(command)
    revoke = appliance_command(sub, "revoke", "remove a rule from a session's runtime layer",
                               cmd_revoke)
    revoke.add_argument("rule", nargs="+", metavar="[KIND] RULE",
                        help="the rule as `corral rules` shows it, optionally after its kind")
    appliance_command(sub, "rules", "a session's effective rules: rule, kind, layer, source",
                      cmd_rules)
    monitor = appliance_command(sub, "monitor", "watch decisions live (reconnects by itself)",
                                cmd_monitor)
    monitor.add_argument("--denied", action="store_true", help="only denials")
    monitor.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    monitor.add_argument("--ask", action="store_true", help="also the open approvals, oldest "
                         "first, each shown whole on lines of the CLI's own (marked) and "
                         "decided with a key: o once, s session, a always (the project's "
                         "corral.toml, after a diff), r refuse, n next, q quit")
    monitor.add_argument("--project", metavar="DIR", help="with --ask: where `a` writes "
                         "(default: the current directory)")
    audit = appliance_command(sub, "audit", "read the audit log, or verify its hash chain",
                              cmd_audit, session=False)
    audit.add_argument("--since", metavar="T", help="10m, 2h, 3d, or an ISO time")
    audit.add_argument("--limit", type=int, default=1000, help="at most this many records")
    audit.add_argument("--verify", action="store_true", help="check the chain, and every "
                       "signed head kept on this host against it (exit 5 if broken)")
    audit.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    appliance_command(sub, "status", "the appliance's health: API, filter, firewall",
                      cmd_status, session=False)
