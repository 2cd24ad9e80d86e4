"""`corral`: the host CLI. `main(argv) -> int`; only this module maps errors to exit codes.

The CLI imports nothing from `appliance` but `appliance.policy` and `appliance.pki`
(a test enforces it), so it never pulls in the filter, Flask or podman code.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import version
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
from appliance.policy.rules import HOLD_DEFAULT

from . import (
    agents,
    approvals,
    box,
    control,
    exitcodes,
    learn,
    local,
    output,
    secrets,
    sessions,
    vm,
)
from .client import CliError, load_appliance


def _dashboard(args) -> int:
    from .dashboard import cmd_dashboard  # Flask and werkzeug: only this command needs them

    return cmd_dashboard(args)


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


def cmd_up(args) -> int:
    if args.backend == "local":
        if args.trust_ca:
            raise CliError("--trust-ca is for a VM: a local appliance trusts this host's store",
                           "add the CA to this host's store (update-ca-certificates)",
                           exitcodes.USAGE)
        return local.up(args)
    return vm.up(args)


def cmd_down(args) -> int:
    if load_appliance(args.appliance).backend == "local":
        return local.down(args)
    return vm.halt(args)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="corral", description="Run AI coding agents with default-deny egress.")
    top.add_argument("--version", action="version", version=f"corral {version('corral')}")
    top.add_argument("--debug", action="store_true", help="show stack traces on errors")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

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

    agent_list = sub.add_parser(
        "agents", help="the agent profiles `corral run --agent` can run",
        description="List the agent profiles (the project's .corral/agents/, yours in "
        "~/.config/corral/agents/, then corral's), or show one: what it installs, runs, "
        "keeps in the project's home and which secrets it needs. Reads no appliance.")
    agent_list.add_argument("name", nargs="?", metavar="NAME", help="show this one, checked")
    agent_list.add_argument("--project", metavar="DIR", help="whose .corral/agents/ to read "
                            "(default: the current directory)")
    agent_list.add_argument("--json", action="store_true", help="machine-readable output")
    agent_list.set_defaults(run=agents.cmd_agents)

    def appliance_command(name, help, run, session=True, description=None):
        command = sub.add_parser(name, help=help, description=description or help)
        command.add_argument("--appliance", default="default", metavar="NAME",
                             help="which appliance (default: %(default)s)")
        if session:
            command.add_argument("--session", metavar="NAME",
                                 help="which session (default: the only one)")
        command.add_argument("--json", action="store_true", help="machine-readable output")
        command.set_defaults(run=run)
        return command

    def granted(command):
        command.add_argument("--for", dest="duration", metavar="DURATION",
                             help="only for this long (90s, 10m, 1h30m, 2d): the appliance "
                             "takes the rule back then, with an event (a deny or inspect "
                             "rule that ends loosens the policy)")

    examples = {"allow-http": "HOST[:PORT]   e.g. api.example.com, *.example.org:8443",
                "allow-dns": "NAME          e.g. example.com, *.example.org",
                "allow-tcp": "HOST:PORT     e.g. github.com:22",
                "deny": "NAME          wins over every allow, e.g. upload.example.org"}
    for name, example in examples.items():
        metavar, _, text = example.partition(" ")
        command = appliance_command(
            name, f"add a {control.KIND_OF_COMMAND[name]} rule to a session's runtime layer",
            control.cmd_allow)
        command.add_argument("rule", metavar=metavar.strip(), help=text.strip())
        granted(command)
    inspect = appliance_command("inspect", "have the filter end TLS to a host and judge each "
                                "request (a session's runtime layer)", control.cmd_allow)
    inspect.add_argument("rule", metavar="HOST", help="e.g. api.github.com, *.example.org")
    granted(inspect)
    for name, verb in (("allow-request", "allow"), ("deny-request", "deny")):
        command = appliance_command(
            name, f"{verb} a method and path on an inspected host (a session's runtime layer)",
            control.cmd_allow, description=f"{verb.capitalize()} requests on an inspected host "
            "by method and path glob (`*` one segment, `**` any): deny wins; a runtime allow "
            "only widens a host's allow list.")
        command.add_argument("rule", metavar="HOST")
        command.add_argument("method", metavar="METHOD", help="GET, POST, ... or *")
        command.add_argument("path", metavar="PATH", help="e.g. /repos/acme/widget/pulls/*")
        granted(command)
    revoke = appliance_command("revoke", "remove a rule from a session's runtime layer",
                               control.cmd_revoke)
    revoke.add_argument("rule", nargs="+", metavar="[KIND] RULE",
                        help="the rule as `corral rules` shows it, optionally after its kind")
    appliance_command("rules", "a session's effective rules: rule, kind, layer, source",
                      control.cmd_rules)
    monitor = appliance_command("monitor", "watch decisions live (reconnects by itself)",
                                control.cmd_monitor)
    monitor.add_argument("--denied", action="store_true", help="only denials")
    monitor.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    monitor.add_argument("--ask", action="store_true", help="also the open approvals, oldest "
                         "first, each shown whole on lines of the CLI's own (marked) and "
                         "decided with a key: o once, s session, a always (the project's "
                         "corral.toml, after a diff), r refuse, n next, q quit")
    monitor.add_argument("--project", metavar="DIR", help="with --ask: where `a` writes "
                         "(default: the current directory)")
    audit = appliance_command("audit", "read the audit log, or verify its hash chain",
                              control.cmd_audit, session=False)
    audit.add_argument("--since", metavar="T", help="10m, 2h, 3d, or an ISO time")
    audit.add_argument("--limit", type=int, default=1000, help="at most this many records")
    audit.add_argument("--verify", action="store_true", help="check the chain (exit 5 if broken)")
    audit.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    appliance_command("status", "the appliance's health: API, filter, firewall",
                      control.cmd_status, session=False)

    asks = appliance_command(
        "ask", "ask mode for a session: a request the policy does not name waits for "
        "`corral approve`", approvals.cmd_ask, description="Ask mode for a running session "
        "(a runtime rule that wins over corral.toml's [approval]): a request or name the "
        "policy does not name is held (DNS: answered NXDOMAIN) while an approval is open; "
        "deny rules, IP literals and the appliance's own names are never held.")
    asks.add_argument("--hold", type=int, metavar="SECONDS",
                      help=f"how long a request waits for a decision (default {HOLD_DEFAULT})")
    asks.add_argument("--off", action="store_true", help="deny at once again")
    appliance_command("approvals", "what sessions in ask mode wait for", approvals.cmd_approvals)
    def project_file(command):
        command.add_argument("--project", metavar="DIR", help="the project whose corral.toml "
                             "gets the rules (default: the current directory)")
        command.add_argument("--yes", action="store_true", help="write it without asking "
                             "(the diff is still shown)")
        command.add_argument("--force", action="store_true", help="even if the session was "
                             "started from another project")

    approve = appliance_command("approve", "grant an open approval", approvals.cmd_approve,
                                session=False)
    approve.add_argument("id", metavar="ID", help="as `corral approvals` shows it")
    how = approve.add_mutually_exclusive_group()
    how.add_argument("--once", action="store_true",
                     help="the requests waiting now whose client is still there go on (a "
                     "tunnel for its life, a plain HTTP request alone), no rule is added (the "
                     "default); refused when every client has left")
    how.add_argument("--for", dest="duration", metavar="DURATION",
                     help="a runtime rule for this long (90s, 10m, 1h30m, 2d)")
    how.add_argument("--session", dest="session_grant", action="store_true",
                     help="a runtime rule for the session's life")
    how.add_argument("--always", action="store_true",
                     help="also for every new session of the project: the rule is written "
                     "into its corral.toml on this host, after a diff (and for this session's "
                     "life)")
    project_file(approve)
    refuse = appliance_command("refuse", "refuse an open approval: the requests waiting get "
                               "the usual denial", approvals.cmd_refuse, session=False)
    refuse.add_argument("id", metavar="ID")
    refuse.add_argument("--reason", metavar="TEXT", help="recorded with the decision")

    board = appliance_command(
        "dashboard", "a web page for approvals, sessions, decisions, rules and health",
        _dashboard, session=False,
        description="Serve a local web page on 127.0.0.1 that talks to the appliance with "
        "this CLI's client certificate (the browser needs none). The address it prints "
        "carries a random token: anyone with it acts as you.")
    board.add_argument("--port", type=int, default=0, help="default: a free one")
    board.add_argument("--no-open", action="store_true", help="print the address only (no "
                       "browser is started)")

    learning = appliance_command(
        "learn", "propose the corral.toml rules a session needed, from its denials",
        learn.cmd_learn, session=False,
        description="Read what the session was denied that a person could allow (the audit "
        "log; never what a person refused or a deny rule covers) and propose the corral.toml "
        "change letting exactly that through, each line saying how often and by what it was "
        "asked (--fold: presets and wildcards where they cover several). Shown as a diff and "
        "written only when you say so.")
    learning.add_argument("session", nargs="?", help="default: the only one")
    learning.add_argument("--fold", action="store_true", help="propose a preset where one "
                          "covers two or more names, and *.parent where three or more share "
                          "a parent (each lets through more than was asked for)")
    project_file(learning)

    run = appliance_command("run", "start a session for a project and attach to it",
                            sessions.cmd_run, session=False,
                            description="Copy the project (without .corral/) into a new "
                            "hardened session and open a shell in it (or run CMD). With "
                            "--agent NAME: `corral run --agent NAME [PROJECT] [-- ARGS...]` "
                            "runs that agent there instead (installed once per appliance, "
                            "its policy and secrets as its profile says; see `corral "
                            "agents`), with ARGS after its own command.")
    run.add_argument("--project", metavar="DIR", help="default: the current directory")
    run.add_argument("--agent", metavar="NAME", help="run this agent's profile (`corral "
                     "agents` lists them): the first word is then the project directory, "
                     "and words after -- go to the agent")
    run.add_argument("--preset", action="append", metavar="P",
                     help="a policy preset that takes no parameters (repeatable); see "
                     "`corral presets`; one that takes them goes in corral.toml")
    run.add_argument("--name", metavar="N", help="the session's name (default: from the "
                     "project's)")
    run.add_argument("--detach", action="store_true", help="start it, do not attach")
    run.add_argument("--ask", action="store_true", help="ask mode: a request the policy does "
                     "not name waits for `corral approve` (see `corral ask`)")
    run.add_argument("--max-uptime", metavar="DURATION", help="stop the session this long "
                     "after it starts (8h, 90m; the workspace stays)")
    run.add_argument("--idle", metavar="DURATION", help="stop it after this long without "
                     "activity the filter sees: no DNS query, connection or request of its, "
                     "none open (direct TCP and an attached shell are not seen)")
    run.add_argument("--memory", metavar="SIZE", help="memory it may use (default 4g)")
    run.add_argument("--cpus", metavar="N", help="CPUs it may use (default 2; 1.5 works)")
    run.add_argument("--pids", type=int, metavar="N", help="processes it may have (default "
                     "2048)")
    run.add_argument("--learn", nargs="?", const="closed", choices=["closed", "open"],
                     help="when you leave the session, propose the corral.toml rules it "
                     "needed (`corral learn`); --learn=open: meanwhile allow (and record) "
                     "whatever a person could approve, for bootstrapping a policy on a "
                     "throwaway project")
    run.add_argument("--allow-secrets", action="store_true", help="copy the project even if "
                     "files in it look like secrets (they are read first; see [workspace] "
                     "exclude in corral.toml)")
    run.add_argument("cmd", nargs="*", metavar="-- CMD", help="run this instead of a shell "
                     "(with --agent: [PROJECT] [-- ARGS...])")
    shell = appliance_command("shell", "another terminal in a running session (re-attach)",
                              sessions.cmd_shell, session=False)
    shell.add_argument("session", nargs="?", help="default: the only one")
    shell.add_argument("cmd", nargs="*", metavar="-- CMD", help="run this instead of a shell")
    appliance_command("ls", "sessions: state, age, time left, allowed/denied counters, "
                      "limits", sessions.cmd_ls, session=False)
    for name, text, run_fn in (
            ("stop", "stop a session: container and network go, the workspace stays",
             sessions.cmd_stop),
            ("rm", "remove a session and its workspace", sessions.cmd_rm),
            ("diff", "what the agent changed, as a unified diff with a summary, and the "
             "digest that `apply --digest` takes to apply exactly it", sessions.cmd_diff),
            ("apply", "write the agent's changes into the project on this host",
             sessions.cmd_apply)):
        command = appliance_command(name, text, run_fn, session=False)
        command.add_argument("name", metavar="SESSION")
        if name == "rm":
            command.add_argument("--home", action="store_true",
                                 help="also remove the project's home directory")
        if name == "apply":
            command.add_argument("--project", metavar="DIR",
                                 help="default: the current directory")
            command.add_argument("--path", action="append", metavar="P",
                                 help="only this file or directory (repeatable)")
            command.add_argument("--force", action="store_true",
                                 help="overwrite files changed on this host meanwhile")
            command.add_argument("--digest", metavar="D",
                                 help="apply exactly the changeset `corral diff` showed under "
                                 "this digest (or refuse); without it, a diff is taken and "
                                 "shown now, and applied when you say so")
            command.add_argument("--yes", action="store_true",
                                 help="without --digest: apply the diff shown now without "
                                 "asking")
    selftest = appliance_command(
        "selftest", "the bypass battery inside a session (or a throwaway one)",
        sessions.cmd_selftest, session=False,
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
                           secrets.cmd_set)
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
    secret_command("ls", "the secrets: name, hosts and how each is sent (never values)",
                   secrets.cmd_ls)
    forget = secret_command("rm", "remove a secret", secrets.cmd_rm)
    forget.add_argument("name", metavar="NAME")

    image = sub.add_parser("image", help="the sandbox image")
    image_sub = image.add_subparsers(dest="image_command", required=True, metavar="COMMAND")
    build = image_sub.add_parser("build", help="build the sandbox image on the appliance "
                                 "(keeps it when current)")
    build.add_argument("--appliance", default="default", metavar="NAME")
    build.add_argument("--rebuild", action="store_true", help="rebuild the Debian base too")
    build.set_defaults(run=sessions.cmd_image_build)

    up = sub.add_parser("up", help="bring an appliance up (a VM by default)",
                        description="Bring an appliance up. The VM backend (default): check "
                        "prerequisites, build the box if missing (`corral box build`), "
                        "`vagrant up` with libvirt, provision it with playbooks/site.yml and "
                        "wait for the API. --backend local runs the services on this Linux "
                        "host (root) instead, supervised, with state and logs in --state-dir.")
    up.add_argument("--backend", choices=["vm", "local"], default="vm")
    up.add_argument("--name", default="default", help="the appliance's name for --appliance")
    up.add_argument("--api-port", type=int, default=8443, metavar="PORT",
                    help="vm: the host's 127.0.0.1 port the API is forwarded to")
    up.add_argument("--trust-ca", action="append", metavar="FILE",
                    help="vm: a CA certificate (PEM) the appliance trusts besides Debian's "
                    "store, for a network that ends TLS with its own CA (the filter verifies "
                    "inspected hosts against it); repeatable, recorded for `corral provision`")
    up.add_argument("--state-dir", default=str(local.DEFAULT_STATE), metavar="DIR",
                    help="local: where config, state and logs live")
    up.add_argument("--upstream", action="append", metavar="IP:PORT",
                    help="local: the filter's upstream resolvers (default: the host's)")
    up.add_argument("--api-listen", default="127.0.0.1:7443", metavar="IP:PORT", help="local")
    up.add_argument("--no-image", action="store_true",
                    help="local: do not build the sandbox image")
    up.set_defaults(run=cmd_up)

    def vm_command(name, help, run):
        command = sub.add_parser(name, help=help, description=help)
        command.add_argument("--appliance", default="default", metavar="NAME")
        command.set_defaults(run=run)
        return command

    vm_command("down", "stop an appliance: the VM halts (local backend: sessions, services, "
               "then the ruleset stop)", cmd_down)
    vm_command("provision", "re-run playbooks/site.yml on the VM (safe: idempotent)",
               vm.provision)
    vm_command("destroy", "delete the appliance's VM (its credentials stay)", vm.destroy)
    vm_command("verify", "run playbooks/verify.yml: services, ruleset, API and the bypass "
               "battery in a throwaway session", vm.verify)
    ssh = vm_command("ssh", "a shell on the appliance's VM", vm.ssh)
    ssh.add_argument("command", nargs=argparse.REMAINDER, help="run this instead of a shell")

    box_parser = sub.add_parser("box", help="the Debian 12 box the VM is made from")
    box_sub = box_parser.add_subparsers(dest="box_command", required=True, metavar="COMMAND")
    box_build = box_sub.add_parser(
        "build", help="build the box from Debian packages (mmdebstrap; root) and add it to "
        "vagrant", description="Build a Debian 12 libvirt box from Debian packages alone, "
        "with the appliance's packages baked in, and add it to vagrant as corral/debian12.")
    box_build.add_argument("--output", metavar="DIR", help="default: ~/.cache/corral/box")
    box_build.add_argument("--rebuild", action="store_true", help="even when an image is there")
    box_build.add_argument("--key", action="append", metavar="FILE.pub",
                           help="another SSH public key for the vagrant user (repeatable)")
    box_build.add_argument("--no-add", action="store_true",
                           help="only build the image, do not add the box to vagrant")
    box_build.set_defaults(run=box.cmd_build)

    certs = sub.add_parser("certs", help="the control plane's certificates, and the "
                           "interception CA")
    certs_sub = certs.add_subparsers(dest="certs_command", required=True, metavar="COMMAND")
    rotate = certs_sub.add_parser(
        "rotate", help="issue a new CA and certificates; the old client certificate stops "
        "working (--interception: a new interception CA instead)",
        description="Without options: a new control-plane CA, server and client certificate "
        "for an appliance on this host; the old client certificate stops working. With "
        "--interception: the filter makes a new interception CA and signs inspected hosts' "
        "certificates with it at once; every running session is given it to trust.")
    rotate.add_argument("--appliance", default="default", metavar="NAME")
    rotate.add_argument("--interception", action="store_true",
                        help="rotate the interception CA (any appliance, through its API)")
    rotate.add_argument("--json", action="store_true", help="machine-readable output")
    rotate.set_defaults(run=control.cmd_certs_rotate)
    shown = certs_sub.add_parser(
        "interception", help="the interception CA sessions trust for inspected hosts",
        description="The filter's interception CA: subject, SHA-256 fingerprint, validity; "
        "--pem prints the certificate (to trust it outside a session).")
    shown.add_argument("--appliance", default="default", metavar="NAME")
    shown.add_argument("--pem", action="store_true", help="print the certificate (PEM)")
    shown.add_argument("--refresh", action="store_true", help="give every running session "
                       "the CA again (after a rotation that could not reach one)")
    shown.add_argument("--json", action="store_true", help="machine-readable output")
    shown.set_defaults(run=control.cmd_certs_interception)
    return top


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line. argparse fills a positional list once: `corral run --agent A
    PROJECT --name N -- ARGS` would leave `-- ARGS` unrecognised (PROJECT took the list).
    So for `run` the words after `--` are taken off first and added to its words after;
    `args.after_dashes` keeps them apart (with --agent they are the agent's)."""
    top = parser()
    words = [w for w in argv if not w.startswith("-")]
    if words[:1] == ["run"] and "--" in argv:
        cut = argv.index("--")
        args = top.parse_args(argv[:cut])
        args.after_dashes = argv[cut + 1:]
        args.cmd = [*args.cmd, *args.after_dashes]
        return args
    args = top.parse_args(argv)
    args.after_dashes = []
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        return args.run(args)
    except ConfigError as exc:
        output.error(str(exc), "fix the file and run `corral check` again")
        return exitcodes.USAGE
    except CliError as exc:
        output.error(str(exc), exc.hint)
        return exc.code
    except Exception as exc:
        if args.debug:
            raise
        output.error(f"{type(exc).__name__}: {exc}", "run again with --debug for details")
        return exitcodes.FAILURE


if __name__ == "__main__":
    sys.exit(main())
