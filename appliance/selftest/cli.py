"""The command line: the arguments (the gateway from HTTPS_PROXY or /etc/resolv.conf), which
probes run, one line per probe as it ends (`--json`: one object per probe, then one with the
summary), and the exit status: 0 only when every selected probe passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
from collections import Counter
from urllib.parse import urlsplit

from .registry import (
    FAILED,
    GROUPS,
    NOT_RUN,
    PASSED,
    REGISTRY,
    Registry,
    Result,
    Selection,
    exit_status,
    run_probe,
    select,
)
from .wire import Context


def defaults_from_environment():
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") or ""
    gateway, port = None, 3128
    if proxy:
        parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        gateway, port = parts.hostname, parts.port or 3128
    if gateway is None:
        with contextlib.suppress(OSError), open("/etc/resolv.conf") as f:
            for line in f:
                if line.startswith("nameserver"):
                    gateway = line.split()[1]
                    break
    return gateway, port


def parse_args(argv, registry: Registry, prog: str | None = None) -> argparse.Namespace:
    gateway, proxy_port = defaults_from_environment()
    parser = argparse.ArgumentParser(prog=prog, description="Probe every bypass class from "
                                     "inside a corral sandbox; each must fail, fast.")
    parser.add_argument("--gateway", default=gateway, help="the session gateway (default: "
                        "from HTTPS_PROXY or /etc/resolv.conf)")
    parser.add_argument("--proxy-port", type=int, default=proxy_port)
    parser.add_argument("--dns-port", type=int, default=53)
    parser.add_argument("--allowed", help="a name the policy allows for http (port 80 and 443)")
    parser.add_argument("--denied", default="denied.corral-selftest.example",
                        help="a name the policy does not allow")
    parser.add_argument("--foreign-resolver", default="9.9.9.9")
    parser.add_argument("--v6-target", default="2620:fe::fe")
    parser.add_argument("--private-name", help="an allowed name that resolves to a private address")
    parser.add_argument("--tcp-name", help="NAME:PORT allowed by a tcp rule; expects a banner")
    parser.add_argument("--inspected", help="a host the session's policy allows and inspects "
                        "(an [[inspect]] or [[git]] table), its body scan on, no request "
                        "rule refusing GET or POST /selftest")
    parser.add_argument("--denied-request", metavar="'METHOD /PATH'",
                        help="a request a request rule of the session denies on --inspected")
    parser.add_argument("--git-repo", metavar="OWNER/REPO",
                        help="a repository a [[git]] table lists for --inspected, whose "
                        "refs/heads/main the session may not push, and no push option")
    parser.add_argument("--git-ssh", metavar="HOST",
                        help="a git host the session reaches over SSH through the git gateway "
                        "(its [[git]] table lists --git-repo): the push probes run over SSH")
    parser.add_argument("--fake-upgrade", metavar="PATH",
                        help="a path on --inspected that answers 101 without switching "
                        "(httpbin's /status/101): the fake-upgrade probe runs")
    parser.add_argument("--echo-secret", metavar="NAME@HOST",
                        help="a bearer secret of the session (its placeholder in $NAME) whose "
                        "host echoes the request (httpbin's /headers): the probes of a value "
                        "the agent came to hold run")
    parser.add_argument("--session", default=socket.gethostname(),
                        help="the session's name, for a branch of its own (default: the "
                        "hostname; `corral selftest` passes it)")
    parser.add_argument("--neighbour", metavar="NAME",
                        help="a name the session allows and does not inspect, on an address "
                        "--inspected uses (one front-end serving both)")
    parser.add_argument("--other-gateway", help="another session's gateway")
    parser.add_argument("--ask-hold", type=float, metavar="SECONDS",
                        help="the session is in ask mode with this hold: the approval probes "
                        "run (the others expect denials at once: run these apart, with --only)")
    parser.add_argument("--api-port", type=int, default=7443)
    parser.add_argument("--cafile", help="verify TLS on the allowed flows with this CA")
    parser.add_argument("--silence", type=float, default=11.0, metavar="SECONDS",
                        help="how long sni-after-silence waits: longer than the filter's "
                        "[proxy] header_timeout (default 11; the appliance's is 10)")
    parser.add_argument("--connections", type=int, default=2000, metavar="N",
                        help="most connections proxy-connection-cap holds (default 2000)")
    parser.add_argument("--flood", type=int, default=20_000, metavar="N",
                        help="queries dns-flood-rate-limited sends at most (default 20000; "
                             "it stops at the first REFUSED answers)")
    parser.add_argument("--recover", type=float, default=8.0, metavar="SECONDS",
                        help="how long the allowed name may stay refused after the flood")
    parser.add_argument("--workdir", default="/work", help="the workspace the review probe "
                        "writes into (default /work)")
    parser.add_argument("--only", action="append", metavar="PROBE",
                        help="run only these probe ids")
    parser.add_argument("--skip-group", action="append", choices=GROUPS, metavar="GROUP",
                        help=f"deselect a group ({', '.join(GROUPS)}); reported, not silent")
    parser.add_argument("--list", action="store_true", help="list the probes and exit")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per probe, then one with the summary")
    args = parser.parse_args(argv)
    if args.list:
        return args
    unknown = sorted(set(args.only or ()) - set(registry.probes))
    if unknown:
        parser.error(f"unknown probe(s) {', '.join(unknown)}; --list shows them")
    if not args.allowed:
        parser.error("--allowed is required: a name the policy allows")
    if not args.gateway:
        parser.error("no gateway: pass --gateway (no HTTPS_PROXY, no nameserver found)")
    return args


def summarize(results: list[Result], selection: Selection) -> dict:
    states = Counter(r.state for r in results)
    return {"passed": states[PASSED], "failed": states[FAILED], "not_run": states[NOT_RUN],
            "skipped_groups": selection.skipped, "unselected": selection.unselected}


def summary_line(summary: dict) -> str:
    text = (f"{summary['passed']} passed, {summary['failed']} failed, {summary['not_run']} "
            "not run")
    for group, ids in summary["skipped_groups"].items():
        text += f"; group {group} skipped by --skip-group ({len(ids)} probes)"
    if summary["unselected"]:
        text += "; not selected: " + ", ".join(f"{k} ({v})" for k, v in
                                               summary["unselected"].items())
    return text


def main(argv=None, registry: Registry = REGISTRY, out=None, prog: str | None = None) -> int:
    """`prog` names the program in usage lines (default: the file run, `corral-selftest` in
    the image)."""
    out = out or sys.stdout
    args = parse_args(argv, registry, prog)
    if args.list:
        for p in registry:
            kind = "allow" if p.legit else f"T{p.threat}"
            out.write(f"{p.id:32} {kind:5} {p.group:8} {p.records}\n")
        return 0
    selection = select(registry, args.only, args.skip_group, args)
    ctx = Context(args)
    results = []
    for p in selection.run:
        result = run_probe(p, ctx)
        results.append(result)
        if args.json:
            out.write(json.dumps(result.to_json()) + "\n")
        else:
            kind = "allow" if p.legit else f"T{p.threat:<2}"
            label = {PASSED: "PASS", FAILED: "FAIL", NOT_RUN: "NOT RUN"}[result.state]
            out.write(f"{label:7}  {kind:5} {p.id:32} {result.ms:8.1f} ms  {result.detail}\n")
        out.flush()
    summary = summarize(results, selection)
    out.write((json.dumps({"summary": summary}) if args.json else summary_line(summary)) + "\n")
    out.flush()
    return exit_status(results)

