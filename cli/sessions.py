"""Session commands: run, shell, ls, stop, rm, diff, apply.

The appliance keeps sessions (through the admin API); terminals are `podman exec` on the
appliance, run with the words its appliance.toml gives (`podman = [...]`): directly for the
local backend, over SSH for a VM. `apply` writes on this host: the appliance sends the
changes, `appliance.workspace` checks them against the project here and writes them.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from appliance import workspace
from appliance.policy.config import ConfigError, parse_policy

from . import agents, exitcodes, output, render, scan
from .arguments import appliance_command
from .client import SLOW, Client, CliError, config_home, known_appliances, load_appliance
from .learn import learn
from .projectfile import drop_typeahead
from .targets import client_for, pick_session, project_id
from .times import parse_duration


def _session_name(project: Path) -> str:
    return f"{project_id(project).rsplit('-', 1)[0][:26]}-{secrets.token_hex(2)}"


def _excludes(project: Path) -> tuple[str, ...]:
    """`[workspace] exclude` of the project's corral.toml (none without one)."""
    path = project / "corral.toml"
    if not path.is_file():
        return ()
    try:
        exclude = parse_policy(path.read_text(encoding="utf-8"), str(path), "project").exclude
    except (ConfigError, OSError, UnicodeDecodeError) as exc:
        raise CliError(str(exc), "fix corral.toml (`corral check` prints what it says)",
                       code=exitcodes.USAGE) from None
    if scan.excluded("corral.toml", exclude):
        raise CliError(f"{path}: [workspace] exclude leaves out corral.toml itself, and with it "
                       "the session's project policy", "exclude other paths",
                       code=exitcodes.USAGE)
    return exclude


def _archive(project: Path, exclude: tuple[str, ...] = ()
             ) -> tuple[tempfile.SpooledTemporaryFile, int, int]:
    """The project as a gzipped tar, without the top-level `.corral/` (its credentials) and
    what `[workspace] exclude` names."""
    excluded = {project / name for name in workspace.EXCLUDED}
    count = 0

    def keep(info: tarfile.TarInfo):
        nonlocal count
        if project / info.name in excluded or any(
                (project / info.name).is_relative_to(e) for e in excluded):
            return None
        relative = (project / info.name).relative_to(project).as_posix()
        if relative != "." and scan.excluded(relative, exclude):
            return None
        count += 1
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    spool = tempfile.SpooledTemporaryFile(max_size=64 << 20)  # noqa: SIM115 - returned
    with tarfile.open(fileobj=spool, mode="w:gz", compresslevel=3) as archive:
        archive.add(project, arcname=".", filter=keep)
    size = spool.tell()
    spool.seek(0)
    return spool, size, count


def _check_secrets(project: Path, exclude: tuple[str, ...], as_json: bool) -> None:
    """Refuse to copy a project holding secrets (cli/scan.py), naming each finding."""
    started = time.monotonic()
    output.notice(f"reading {project} for secrets before copying it (--allow-secrets skips this)")
    try:
        report = scan.scan(project, exclude, workspace.EXCLUDED)
    except scan.ScanUnavailable as exc:
        raise CliError(f"{exc}, which is not installed", "pip install detect-secrets (it comes "
                       "with corral[host]), or pass --allow-secrets to copy unread") from None
    large = f", {report.too_large} too large to read" if report.too_large else ""
    if report.unread:
        large += f", {report.unread} under dependency and cache directories not read"
    output.notice(f"read {report.files} files for secrets in {time.monotonic() - started:.1f}s"
                  f"{large}")
    if not report.findings:
        return
    if as_json:
        output.data({"findings": [f.to_json() for f in report.findings]})
    else:
        for finding in report.findings:
            # a file name may be an agent's (applied from an earlier session)
            output.line(f"  {workspace.shown(finding.path)}:{finding.line}  "
                        f"{render.text(finding.detector)}")
    raise CliError(f"{len(report.findings)} possible secret(s) in what would be copied into the "
                   "session (above: path, line, detector)", "leave them out with [workspace] "
                   'exclude = ["PATH", ...] in corral.toml, or pass --allow-secrets to copy '
                   "them anyway")


def _terminal(client: Client, container: str, command: list[str]) -> int:
    """An interactive process in the session (a TTY when we have one)."""
    tty = ["-it"] if sys.stdin.isatty() and sys.stdout.isatty() else ["-i"]
    argv = [*client.appliance.podman, "exec", *tty, "--workdir", "/work", container,
            *(command or ["bash", "-l"])]
    try:
        return subprocess.call(argv)
    except FileNotFoundError:
        raise CliError(f"cannot run {argv[0]!r} to reach the session",
                       "check `podman = [...]` in the appliance's appliance.toml") from None


def agent_words(args) -> tuple[str | None, list[str]]:
    """With --agent, the positional words are `[PROJECT] [-- ARGS...]`: the project
    directory, then extra arguments to the agent's command (cli/main.py `parse` keeps the
    words after `--` apart)."""
    extra = list(getattr(args, "after_dashes", None) or [])
    before = list(args.cmd[:len(args.cmd) - len(extra)])
    if len(before) > 1:
        raise CliError(f"--agent takes one project directory, not {' '.join(before)}",
                       "write the agent's own arguments after `--`: corral run --agent "
                       f"{args.agent} [PROJECT] -- ARGS...", exitcodes.USAGE)
    if before and args.project:
        raise CliError(f"two projects: --project {args.project} and {before[0]}",
                       "name it once", exitcodes.USAGE)
    return (before[0] if before else args.project), extra


def cmd_run(args) -> int:
    given, extra = agent_words(args) if args.agent else (args.project, list(args.cmd))
    project = Path(given or os.getcwd()).resolve()
    if not project.is_dir():
        raise CliError(f"no project directory {project}", code=exitcodes.USAGE)
    if args.ask and args.learn == "open":
        raise CliError("--ask and --learn=open do not go together (one holds what the other "
                       "lets through)", code=exitcodes.USAGE)
    exclude = _excludes(project)
    limits = _limits(args)
    profile = agents.resolve(args.agent, project) if args.agent else None
    agent = {}
    if profile is not None:  # what it needs, named with the fix, before anything is copied
        agents.check_ready(client_for(args), profile, project)
        agent = {"agent": profile.text, "agent_name": profile.name}
    if not args.allow_secrets:  # before anything of the project reaches the appliance
        _check_secrets(project, exclude, args.json)
    client = client_for(args)
    name = args.name or _session_name(project)
    uid = int(os.environ.get("SUDO_UID", os.getuid())) or 1000
    gid = int(os.environ.get("SUDO_GID", os.getgid())) or 1000
    started = time.monotonic()
    spool, size, count = _archive(project, exclude)
    with spool:
        output.notice(f"copying {project} ({count} entries, {size / 1e6:.1f} MB packed) and "
                      f"starting session {name}" + (
                          f" for agent {profile.name} (the first session of "
                          f"{profile.install.spec} on this appliance installs it first)"
                          if profile is not None else "") + " ...")
        session = client.request("POST", "/sessions", upload=(spool, size, "application/gzip"),
                                 timeout=SLOW, name=name, preset=args.preset,
                                 project_id=project_id(project), uid=uid, gid=gid,
                                 **limits, **agent)
    steps = ", ".join(f"{step} {seconds:.2f}s" for step, seconds in
                      (session.get("took") or {}).items() if isinstance(seconds, int | float))
    output.notice(f"session {name} started in {time.monotonic() - started:.1f}s on "
                  f"{session['subnet']}" + (f" (on the appliance: {steps})" if steps else ""))
    if args.learn == "open":  # a person's explicit choice, recorded (a rule event)
        client.request("POST", "/policy/rules", {"session": name, "kind": "approval",
                                                 "rule": "open"})
        output.warning(f"LEARNING OPEN: session {name} may reach any name, on any port, "
                       "that no deny rule names (deny rules go by name: another name for the "
                       "same server is not covered; IP literals and blocked ranges stay "
                       "closed). Each such request is allowed and recorded as an event, in "
                       "the audit log within the session's audit budget. Use it on a "
                       "throwaway project only; `corral ask --off` ends it.")
    elif args.ask:  # the session's runtime layer: it wins over the project's [approval]
        client.request("POST", "/policy/rules", {"session": name, "kind": "approval",
                                                 "rule": "ask"})
        output.notice("ask mode: a request the policy does not name waits for `corral "
                      "approvals` / `corral approve` (from another terminal)")
    if args.json:
        output.data(session)
    if args.detach:
        if args.learn:
            output.notice(f"when the agent is done, `corral learn {name}` proposes the rules "
                          "it was denied")
        return exitcodes.OK
    command = [*profile.command, *extra] if profile is not None else extra
    code = _terminal(client, session["container"], command)
    output.notice(f"session {name} keeps running: `corral shell {name}` re-attaches; "
                  f"`corral diff {name}`, `corral apply {name}`, `corral stop {name}`")
    if args.learn:
        try:
            learn(client, name, project, yes=False, as_json=False)
        except CliError as exc:
            output.notice(f"learning: {exc}; `corral learn {name}` proposes it again")
    return code


def _limits(args) -> dict:
    """The session's limits as the API takes them (the sandbox service checks them)."""
    limits = {}
    if args.max_uptime:
        limits["max_uptime"] = parse_duration(args.max_uptime, "--max-uptime")
    if args.idle:
        limits["idle"] = parse_duration(args.idle, "--idle")
    for key in ("memory", "cpus", "pids"):
        if getattr(args, key) is not None:
            limits[key] = getattr(args, key)
    return limits


def cmd_shell(args) -> int:
    client = client_for(args)
    name = pick_session(client, args.session)
    session = client.request("GET", f"/sessions/{name}")
    if session.get("container_state") != "running":
        raise CliError(f"session {name} is not running ({session.get('container_state')})",
                       f"start a new one with `corral run`; `corral diff {name}` still works")
    return _terminal(client, session["container"], args.cmd)


def _span(seconds: float) -> str:
    """Time left, to the minute past an hour: `7h59m`, `12m05s`, `40s`."""
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _resources(session: dict) -> str:
    """Memory, CPUs and processes a session may use, as podman was told (- for a session
    from the appliance's config, which has no container of corral's)."""
    if not session.get("memory"):
        return "-"
    return f"{session['memory']}/{session.get('cpus', '-')}/{session.get('pids', '-')}"


def _age(created: float | None) -> str:
    if not created:
        return "-"
    seconds = max(0, time.time() - created)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _agent(agent) -> str:
    """The agent a session runs, as `corral ls` shows it: `claude 2.1.90` (- for none)."""
    if not isinstance(agent, dict) or not agent.get("name"):
        return "-"
    return f"{agent['name']} {agent.get('version', '')}".strip()


def _ls_rows(sessions: list[dict]) -> list[list]:
    rows = []
    for s in sessions:
        state = s.get("container_state", s.get("state", "-"))
        if s.get("state") == "stopped":
            state = "stopped" + (f" ({s['reason']})" if s.get("reason") else "")
        left = s.get("left")
        rows.append([s["name"], state, _age(s.get("created")), _span(left) if left is not None
                     else "-", s.get("subnet", "-"), s.get("allowed", 0), s.get("denied", 0),
                     _resources(s), render.text(_agent(s.get("agent")))])
    return rows


LS_HEADER = ["SESSION", "STATE", "AGE", "LEFT", "SUBNET", "ALLOWED", "DENIED", "MEM/CPU/PIDS",
             "AGENT"]


def cmd_ls(args) -> int:
    if args.all:
        return _ls_all(args)
    answer = client_for(args).request("GET", "/sessions")
    if args.json:
        output.data(answer)
        return exitcodes.OK
    output.table(_ls_rows(answer["sessions"]), LS_HEADER)
    if answer.get("sandbox_error"):
        output.notice(f"sandbox service: {render.text(answer['sandbox_error'])}")
    return exitcodes.OK


def appliance_dir(name: str):
    return config_home() / "appliances" / name


def _ls_all(args) -> int:
    """Every appliance this host knows, asked one after the other (a few at most); one
    that does not answer is named, and the others are still listed."""
    names = known_appliances()
    if not names:
        raise CliError("this host knows no appliance", "`corral up` (or `corral up --name "
                       "NAME` for another) writes one", exitcodes.NOT_CONFIGURED)
    found, failed = {}, {}
    for name in names:
        try:
            found[name] = Client(load_appliance(name), timeout=5).request("GET", "/sessions")
        except CliError as exc:
            failed[name] = {"error": str(exc), "hint": exc.hint, "code": exc.code}
        except (OSError, ValueError) as exc:  # its credentials unreadable (ssl.SSLError too)
            failed[name] = {"error": f"{name}: its credentials in {appliance_dir(name)} do not "
                            f"load: {exc}", "hint": "provision it again (site.yml writes them): "
                            f"`corral provision --appliance {name}` for a VM",
                            "code": exitcodes.NOT_CONFIGURED}
    if args.json:
        output.data({"appliances": found, "unreachable": failed})
    else:
        rows = []
        for name, answer in found.items():
            rows += [[render.text(name), *row] for row in _ls_rows(answer["sessions"])]
            if answer.get("sandbox_error"):
                output.notice(f"{name}: sandbox service: {render.text(answer['sandbox_error'])}")
        output.table(rows, ["APPLIANCE", *LS_HEADER])
        for name, problem in failed.items():
            output.notice(f"{name}: {problem['error']}")
    # partial answers are still answers; a script learns that one appliance was missing
    return next(iter(failed.values()))["code"] if failed else exitcodes.OK


def cmd_stop(args) -> int:
    session = client_for(args).request("POST", f"/sessions/{args.name}/stop", timeout=SLOW)
    if args.json:
        output.data(session)
    else:
        output.line(f"stopped {args.name}: container and network removed; the workspace "
                    f"stays for `corral diff/apply {args.name}` until `corral rm {args.name}`")
    return exitcodes.OK


def cmd_rm(args) -> int:
    client_for(args).request("DELETE", f"/sessions/{args.name}", timeout=SLOW,
                             home=1 if args.home else None)
    output.line(f"removed {args.name}" + (" and its project's home" if args.home else ""))
    return exitcodes.OK


def _digest(answer: dict) -> str:
    digest = answer.get("digest")
    if not isinstance(digest, str) or not workspace.DIGEST.fullmatch(digest):
        raise CliError("the appliance sent a diff without the digest of what it shows",
                       "upgrade corral on this host or on the appliance (they ship together)")
    return digest


def _show(answer: dict) -> str:
    """The diff as a person reads it, then the digest that names exactly it."""
    digest = _digest(answer)
    # the appliance escaped what the agent wrote; this holds even if it had not
    output.line(workspace.terminal_safe(answer["diff"]))
    output.line(f"digest {digest}")
    if answer.get("not_paused"):
        output.notice(f"{workspace.terminal_safe(str(answer['not_paused']))}: it was read "
                      "while the agent ran (what is shown is still exactly what is applied)")
    return digest


def cmd_diff(args) -> int:
    # a big workspace takes a while to walk (the default 10 s would break the diff)
    answer = client_for(args).request("GET", f"/sessions/{args.name}/diff", timeout=SLOW)
    if args.json:
        _digest(answer)
        output.data(answer)  # JSON escapes every control character itself
    else:
        digest = _show(answer)
        output.notice(f"`corral apply {args.name} --digest {digest}` applies exactly this; "
                      "what the agent writes from now on is in the next diff")
    return exitcodes.OK


FOLD_BATCH = 16 * 1024 * 1024
"""File contents per `applied` request (one larger file goes alone): the sandbox service
reads each request as one line of at most 64 MiB."""
FOLD_COUNT = 5000


def _batches(changes: list[workspace.Change]):
    batch, size = [], 0
    for change in changes:
        data = len(change.after.data or b"") if change.after is not None else 0
        if batch and (size + data > FOLD_BATCH or len(batch) >= FOLD_COUNT):
            yield batch
            batch, size = [], 0
        batch.append(change)
        size += data
    if batch:
        yield batch


def _fold(client: Client, name: str, applied: list[workspace.Change]) -> list[str]:
    """Tell the appliance what this host now holds, in batches; what it could not record
    (it shows up in the next diff again, and the next apply finds it already in place)."""
    missed = []
    for batch in _batches(applied):
        answer = client.request("POST", f"/sessions/{name}/applied",
                                {"changes": [workspace.to_json(c) for c in batch]},
                                timeout=SLOW)
        missed += [f"{workspace.shown(str(r.get('path', '?')))}: "
                   f"{render.text(r.get('reason', ''))}" for r in answer.get("refused", [])]
    return missed


def _changes(client: Client, name: str, digest: str):
    """The snapshot a diff showed under `digest`, whole (`--path` picks from it here), its
    digest checked on this host before anything is written."""
    answer = client.request("GET", f"/sessions/{name}/changes", digest=digest, timeout=SLOW)
    if answer.get("format") != workspace.FORMAT:
        raise CliError(f"the appliance sends changesets in format {answer.get('format', 1)}; "
                       f"this corral reads format {workspace.FORMAT}",
                       "upgrade corral on this host or on the appliance (they ship together)")
    try:
        changes = [workspace.from_json(c) for c in answer["changes"]]
        notes = [workspace.note_from(n) for n in answer.get("notes", [])]
    except (ValueError, KeyError, TypeError) as exc:
        raise CliError(f"the appliance sent a changeset this corral cannot read: {exc}") from None
    try:
        workspace.verify(changes, notes, digest)
    except ValueError as exc:
        raise CliError(f"nothing applied: {exc}", "the appliance did not send what was "
                       f"reviewed; run `corral diff {name}` again") from None
    return changes, [f"{workspace.shown(n.path)}: {render.text(n.text)}" for n in notes]


def _reviewed(client: Client, args) -> str:
    """The digest to apply: --digest, or (without it) a diff taken now, shown here, and
    confirmed by the person (or by --yes): never changes nobody was shown."""
    if args.digest:
        digest = args.digest.lower().removeprefix("sha256:")
        if not workspace.DIGEST.fullmatch(digest):
            raise CliError(f"--digest {args.digest!r} is not a changeset digest (64 hex "
                           "digits)", f"copy it from `corral diff {args.name}`",
                           exitcodes.USAGE)
        return digest
    if args.json and not args.yes:
        raise CliError("with --json, apply needs --digest (from `corral diff --json`) or "
                       "--yes (apply what a diff taken now shows)", code=exitcodes.USAGE)
    answer = client.request("GET", f"/sessions/{args.name}/diff", timeout=SLOW)
    if args.json:
        return _digest(answer)
    digest = _show(answer)
    if args.yes:
        return digest
    if not sys.stdin.isatty():
        raise CliError("nothing applied: without --digest, apply asks first, and there is "
                       "no terminal to ask on", f"read the diff above, then `corral apply "
                       f"{args.name} --digest {digest}` (or pass --yes)", exitcodes.USAGE)
    drop_typeahead()  # what was typed before the question is no answer to it
    output.notice(f"apply the changes above (digest {digest[:12]}...) to this project? [y/N] ")
    if sys.stdin.readline().strip().lower() not in ("y", "yes"):
        raise CliError("nothing applied", f"`corral apply {args.name} --digest {digest}` "
                       "applies exactly the diff above later", exitcodes.FAILURE)
    return digest


def cmd_apply(args) -> int:
    client = client_for(args)
    project = Path(args.project or os.getcwd()).resolve()
    if not project.is_dir():
        raise CliError(f"no project directory {project}", code=exitcodes.USAGE)
    session = client.request("GET", f"/sessions/{args.name}")
    if session.get("project") and session["project"] != project_id(project) and not args.force:
        raise CliError(f"session {args.name} was started from another project "
                       f"({session['project']}), not {project}",
                       "run it in that project, pass --project DIR, or --force",
                       exitcodes.USAGE)
    digest = _reviewed(client, args)
    changeset, notes = _changes(client, args.name, digest)
    try:
        result = workspace.apply(project, changeset, args.path, args.force)
    except workspace.Conflict as conflict:
        if args.json:
            output.data({"digest": digest, "applied": [],
                         "conflicts": [workspace.shown(p) for p in conflict.paths],
                         "refused": [str(r) for r in conflict.refused]})
        raise CliError(f"nothing applied: {conflict}",
                       "look at `corral diff`; keep your edits, or pass --force to overwrite "
                       "them (refused paths are never written)") from None
    except OSError as exc:
        raise CliError(f"cannot write into {project}: {exc}",
                       "nothing was written; check the directory's permissions and space"
                       ) from None
    missed = _fold(client, args.name, result.changes) if result.changes else []
    if args.json:
        output.data({"digest": digest,
                     "applied": [workspace.shown(c.path) for c in result.changes],
                     "conflicts": [], "refused": [str(r) for r in result.refused],
                     "not_shown": notes, "not_recorded": missed})
    else:
        for change in result.changes:
            output.line(f"{change.action:>8}  {workspace.shown(change.path)}")
        for refusal in result.refused:
            output.line(f" refused  {refusal}")
        for note in notes:
            output.line(f"    note  {note}")
        output.line(f"applied {len(result.changes)} change(s) of {digest[:12]}... to {project}"
                    + (f"; refused {len(result.refused)} (named above, never written)"
                       if result.refused else ""))
        for line in missed:
            output.notice(f"the appliance did not record {line}; the next diff shows it "
                          "again and the next apply finds it in place")
    return exitcodes.FAILURE if result.refused else exitcodes.OK


def register(sub) -> None:
    run = appliance_command(sub, "run", "start a session for a project and attach to it",
                            cmd_run, session=False,
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
    shell = appliance_command(sub, "shell", "another terminal in a running session (re-attach)",
                              cmd_shell, session=False)
    shell.add_argument("session", nargs="?", help="default: the only one")
    shell.add_argument("cmd", nargs="*", metavar="-- CMD", help="run this instead of a shell")
    ls = appliance_command(sub, "ls", "sessions: state, age, time left, allowed/denied "
                           "counters, limits", cmd_ls, session=False)
    ls.add_argument("--all", action="store_true", help="the sessions of every appliance this "
                    "host knows, with an APPLIANCE column (one that does not answer is named "
                    "and the exit code is its error's)")
    for name, text, run_fn in (
            ("stop", "stop a session: container and network go, the workspace stays",
             cmd_stop),
            ("rm", "remove a session and its workspace", cmd_rm),
            ("diff", "what the agent changed, as a unified diff with a summary, and the "
             "digest that `apply --digest` takes to apply exactly it", cmd_diff),
            ("apply", "write the agent's changes into the project on this host",
             cmd_apply)):
        command = appliance_command(sub, name, text, run_fn, session=False)
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
