"""Ask mode from the host: `corral approvals`, `corral approve`, `corral refuse`, `corral ask`.

A session in ask mode holds a request the policy does not name while a person decides (the
appliance's approvals.py); these commands list what waits and decide it over mTLS. Nothing
inside a sandbox can reach them.
"""

from __future__ import annotations

import re
import time
from urllib.parse import quote

from appliance.policy import HostNameError, parse_host, split_host_port
from appliance.policy.grants import rule_texts
from appliance.policy.rules import HOLD_DEFAULT, HOLD_MAX

from . import exitcodes, output, projectfile, render
from .arguments import appliance_command, project_file
from .client import CliError
from .targets import client_for, pick_session, project_of
from .times import clock, parse_duration

NOTE_WIDTH = 60
"""Characters of an agent's reason shown in a table or above a prompt (`--json` has all)."""


def _what(approval: dict) -> str:
    """`KIND TARGET` of an approval, as render draws them: the target whole."""
    return f"{render.text(approval.get('kind'))} {render.host(approval.get('target'))}"


def cmd_approvals(args) -> int:
    client = client_for(args)
    answer = client.request("GET", "/approvals", **({"session": args.session}
                                                    if args.session else {}))
    if args.json:
        output.data(answer)
        return exitcodes.OK
    rows = [[a["id"], a["session"], _what(a), a["asked"], "yes" if a["waiting"] else "",
             _ago(a["created"]), a["origin"], render.text(a.get("note") or "", NOTE_WIDTH)]
            for a in answer["approvals"]]
    if not rows:
        output.line("no approvals are open (a session in ask mode opens one for each host "
                    "the policy does not name)")
        return exitcodes.OK
    output.table(rows, ["ID", "SESSION", "WOULD ALLOW", "ASKED", "WAITING", "AGE", "FROM",
                        "AGENT'S REASON"])
    output.line("decide: corral approve ID [--once | --for 10m | --session | --always]; "
                "corral refuse ID")
    return exitcodes.OK


def cmd_approve(args) -> int:
    client = client_for(args)
    if args.always:
        return _always(client, args)
    given = [f"--{n}" for n in ("project", "yes", "force") if getattr(args, n)]
    if given:
        raise CliError(f"{', '.join(given)}: only with --always (they say where the rule "
                       "is written)", code=exitcodes.USAGE)
    if args.duration is not None:
        request = {"grant": "for", "duration": parse_duration(args.duration)}
    else:
        request = {"grant": "session" if args.session_grant else "once"}
    answer = client.request("POST", f"/approvals/{quote(args.id, safe='')}", request)
    if args.json:
        output.data(answer)
        return exitcodes.OK
    approval = answer["approval"]
    what = f"{_what(approval)} in session {render.text(approval['session'])}"
    if request["grant"] == "once":
        released = answer.get("released", 0)
        output.line(f"approved once: {what}: {released} request{'s' * (released != 1)} let "
                    "through (a tunnel for its life, a plain HTTP request alone; no rule "
                    "added)")
    elif answer.get("expires"):
        output.line(f"approved {what} until {clock(answer['expires'])} (a runtime rule, taken "
                    "back then)")
    else:
        output.line(f"approved {what} for the session (a runtime rule: `corral revoke` takes "
                    "it back)")
    return exitcodes.OK


def _always(client, args) -> int:
    """`--always`: the rule goes into the project's corral.toml on this host as well as to
    the session for its life, so that a new session of the project starts with it. The
    diff is shown and agreed to first; then the session's grant (if the approval went
    meanwhile, nothing is written); then the file. The appliance never writes a project."""
    listed = client.request("GET", "/approvals")["approvals"]
    approval = next((a for a in listed if a["id"] == args.id), None)
    if approval is None:
        raise CliError(f"no pending approval {args.id!r} (decided already, or expired)",
                       "`corral approvals` lists the open ones", exitcodes.USAGE)
    if approval.get("kind") not in projectfile.KINDS:
        raise CliError(f"approval {args.id} would add a {render.text(approval.get('kind'))!r} "
                       "rule, which corral.toml has no list for",
                       "grant it with --session instead")
    project = project_of(client, approval["session"], args.project, args.force)
    path, before = projectfile.read(project)
    projectfile.policy_of(path, before)  # a file that is broken already is named as such
    addition = always_addition(approval, time.strftime("%Y-%m-%d"))
    after = projectfile.added(before, [addition], str(path))
    if after != before and not projectfile.confirm(path, before, after, args.yes, args.json):
        output.notice(f"approval {args.id} is still open: decide it another way")
        return exitcodes.FAILURE
    answer = client.request("POST", f"/approvals/{quote(args.id, safe='')}",
                            {"grant": "session", "note": "always: the project's corral.toml "
                                                         "has it too"})
    if after != before:
        try:
            projectfile.replace(path, before, after)
        except CliError as exc:
            raise CliError(f"session {render.text(approval['session'])} has the rule, but "
                           f"{exc}", f"add `{render.text(addition.rule)}` to "
                           f"[{render.text(addition.kind)}] allow in "
                           f"{path} by hand") from None
    if args.json:
        output.data({**answer, "file": str(path), "written": after != before})
    else:
        output.line(f"approved {render.text(addition.kind)} {render.text(addition.rule)}: "
                    f"in {path} for every new session of the project"
                    + (" (it was there already)" if after == before else "")
                    + f", and in session {render.text(approval['session'])} for its life")
    return exitcodes.OK


def always_addition(approval: dict, when: str) -> projectfile.Addition:
    """The line `--always` adds for an approval: the rule its grant adds, formed as every
    granted rule is (grants.rule_texts: the port asked, `NAME:PORT`; the bare name only
    for a name looked up without one), so that it is the line `corral learn` would
    propose for the same ask. Raises CliError for a target that is no plain name."""
    try:
        name, port = split_host_port(str(approval["target"]))
        host = parse_host(name).name
        if host is None or (port is not None and not (port.isascii() and port.isdigit())):
            raise HostNameError("not a name with a number port")
        (rule,) = rule_texts(approval["kind"], host, () if port is None else (int(port),))
    except (HostNameError, ValueError):
        raise CliError(f"approval {approval['id']}: its target is not a name a file can "
                       "allow", "grant it with --session instead") from None
    return projectfile.Addition(approval["kind"], rule,
                                f"approved {when} (session {approval['session']})")


def cmd_refuse(args) -> int:
    client = client_for(args)
    request = {"grant": "refuse", **({"note": args.reason} if args.reason else {})}
    answer = client.request("POST", f"/approvals/{quote(args.id, safe='')}", request)
    if args.json:
        output.data(answer)
    else:
        approval = answer["approval"]
        output.line(f"refused {_what(approval)} in session "
                    f"{render.text(approval['session'])}")
    return exitcodes.OK


def cmd_ask(args) -> int:
    """Turn ask mode on (or off) for a running session: an approval rule in its runtime
    layer, which wins over corral.toml's [approval]."""
    client = client_for(args)
    session = pick_session(client, args.session)
    if args.off and args.hold is not None:
        raise CliError("--off and --hold do not go together", code=exitcodes.USAGE)
    if args.hold is not None and not 1 <= args.hold <= HOLD_MAX:
        raise CliError(f"--hold {args.hold}: give 1 to {HOLD_MAX} seconds", code=exitcodes.USAGE)
    text = "deny" if args.off else f"ask {args.hold}" if args.hold is not None else "ask"
    answer = client.request("POST", "/policy/rules",
                            {"session": session, "kind": "approval", "rule": text})
    if args.json:
        output.data(answer)
    elif args.off:
        output.line(f"session {session}: denied requests are refused at once (ask mode off)")
    else:
        output.line(f"session {session}: a request the policy does not name waits "
                    f"{args.hold or HOLD_DEFAULT}s for `corral approve` (`corral approvals` "
                    "lists them)")
    return exitcodes.OK


def _ago(ts: float) -> str:
    seconds = max(0, time.time() - ts)
    return f"{seconds / 60:.0f}m" if seconds >= 60 else f"{seconds:.0f}s"


# -- corral monitor --ask: decide with a key, next to the live decisions -------------------

KEYS = {"o": "once", "s": "session", "a": "always", "r": "refuse"}
PROMPT = "[o]nce [s]ession [a]lways [r]efuse [n]ext [q]uit"


class Asking:
    """The approvals a person is asked about, oldest first: opened by `pending` events (or
    open when the monitor started), closed by their `change` event whoever decided. Pure:
    events in, the approval to show out."""

    def __init__(self, open_now: list[dict]):
        self.waiting: dict[str, dict] = {}
        for a in open_now:
            self.waiting[a["id"]] = {k: a.get(k) for k in ("id", "session", "kind", "target",
                                                             "note")}

    def see(self, event: dict) -> None:
        if event.get("kind") != "approval" or not event.get("approval"):
            return
        if event.get("verdict") == "pending":
            self.waiting.setdefault(event["approval"], {
                "id": event["approval"], "session": event.get("session"),
                "kind": event.get("grant_kind"), "target": event.get("target"),
                "note": event.get("note")})
        else:
            self.waiting.pop(event["approval"], None)

    @property
    def first(self) -> dict | None:
        return next(iter(self.waiting.values()), None)

    def later(self) -> None:
        """The first one goes to the end of the line (`n`)."""
        first = self.first
        if first is not None:
            del self.waiting[first["id"]]
            self.waiting[first["id"]] = first


def prompt(approval: dict) -> tuple[list[str], list[str]]:
    """What `monitor --ask` prints for an approval: (the agent's words, the decision). The
    agent's words come first, cut and escaped, after a label of the CLI's; the decision
    last, for output.decision to draw with its mark: the id a key applies to, the session,
    the kind and the exact target, whole (a long name is never cut to look like another),
    then the keys. Nothing the agent wrote is on a decision line, and nothing printed
    before one can pass for it: every value in a line is drawn by render."""
    ident = render.text(approval.get("id"))
    said = ([f"  {ident}: the agent says: {render.text(approval['note'], NOTE_WIDTH)}"]
            if approval.get("note") else [])
    return said, [f"{ident}: session {render.text(approval.get('session'))} asks for "
                  f"{_what(approval)}",
                  f"{PROMPT}: a key decides {ident}"]


def monitor_ask(client, args, color: bool) -> int:
    """`corral monitor --ask`: the live decisions, and the oldest open approval with a key
    for each grant, read from the terminal without Enter. The stream is read in a thread
    (and reconnects, listing the open approvals again each time it has subscribed); keys
    and decisions happen here. A key is for the approval whose line was on the screen when
    it was pressed: if that one was decided meanwhile, the key is dropped; keys typed
    before a new line are dropped too (a `q` among them still quits), and so are escape
    sequences (arrows, F-keys)."""
    import queue
    import select
    import signal
    import sys
    import termios
    import threading
    import tty

    if not sys.stdin.isatty():
        raise CliError("--ask takes keys from a terminal", "run it in one, or decide with "
                       "`corral approve` / `corral refuse`", exitcodes.USAGE)
    events: queue.Queue = queue.Queue()
    stop = threading.Event()
    only = {"session": args.session} if args.session else {}

    def pump():
        delay = 0.5
        while not stop.is_set():
            try:
                live = client.stream("/events/stream", **only)  # subscribed when it returns
                events.put({"listed": client.request("GET", "/approvals", **only)[
                    "approvals"]})
                for event in live:
                    events.put(event)
                    delay = 0.5
                    if stop.is_set():
                        return
            except CliError as exc:
                events.put({"notice": f"{exc}; reconnecting"})
            except Exception as exc:
                events.put({"notice": f"the event stream failed ({exc}); reconnecting"})
            stop.wait(delay)
            delay = min(delay * 2, 5.0)

    def terminate(signum, frame):
        raise KeyboardInterrupt

    asking = Asking([])
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    previous = signal.signal(signal.SIGTERM, terminate)
    shown_id = None
    threading.Thread(target=pump, daemon=True, name="corral-monitor").start()
    tty.setcbreak(fd)
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], 0.2)
            key = _key(fd) if ready else ""
            on_screen = shown_id  # what the key, if any, was pressed for
            while not events.empty():
                event = events.get()
                if "notice" in event:
                    output.notice(event["notice"])
                elif "listed" in event:
                    asking = Asking(event["listed"])
                else:
                    if not args.denied or event.get("verdict") == "deny":
                        output.event(event, color)
                    asking.see(event)
            if key == "q":
                return exitcodes.OK
            if key == "n" and on_screen in asking.waiting:
                asking.later()
            elif key in KEYS and on_screen is not None:
                if on_screen in asking.waiting:
                    _decide(client, asking, asking.waiting[on_screen], KEYS[key], args, fd,
                            saved)
                else:
                    output.notice(f"{render.text(on_screen)} was decided meanwhile: that key "
                                  "is dropped")
            first = asking.first
            if first is not None and (first["id"] != shown_id or key in KEYS):
                if _quits(_typed_before(fd)):  # nothing typed before it is for it,
                    return exitcodes.OK          # but a `q` still quits
                said, decided = prompt(first)
                for text in said:
                    output.line(text)
                output.decision(decided, color)
            shown_id = first["id"] if first is not None else None
    except KeyboardInterrupt:
        return exitcodes.OK
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        signal.signal(signal.SIGTERM, previous)
        stop.set()


ESCAPE_SEQUENCE = re.compile(rb"\x1b+(?:\[[0-?]*[ -/]*[@-~]|O[0-9;]*.|.)?", re.DOTALL)
"""A key's escape sequence as terminals send them: CSI (arrows), SS3 (F1-F4, the keypad
in application mode, whose `1` is ESC O q, with a modifier ESC O 5 q) and Alt with a key
(Alt with an arrow: two ESCs)."""


def _quits(typed: bytes) -> bool:
    """Whether these keys hold a `q` of its own, not one inside an escape sequence."""
    return b"q" in ESCAPE_SEQUENCE.sub(b"", typed)


def _typed_before(fd: int) -> bytes:
    """What was typed and not read yet, read and dropped (where tcflush would lose a `q`)."""
    import os
    import select

    typed = b""
    while select.select([fd], [], [], 0)[0]:
        try:
            chunk = os.read(fd, 1024)
        except OSError:  # the terminal went away
            break
        if not chunk:
            break
        typed += chunk
        if len(typed) > 1 << 16:  # pasted, or held down: what is left is dropped unread
            import termios

            termios.tcflush(fd, termios.TCIFLUSH)
            break
    return typed


def _key(fd: int) -> str:
    """One key pressed, exactly as typed; "" for an escape sequence (read whole, dropped)."""
    import os
    import select

    first = os.read(fd, 1)
    if first != b"\x1b":
        return first.decode(errors="replace")
    while select.select([fd], [], [], 0.05)[0]:
        os.read(fd, 64)
    return ""


def _decide(client, asking: Asking, approval: dict, grant: str, args, fd: int, saved) -> None:
    """One decision from the monitor; the approval leaves the line only when it was taken."""
    import termios
    import tty

    try:
        if grant == "always":
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)  # the diff's question
            try:
                code = _always(client, _AlwaysArgs(approval["id"], args.project))
            finally:  # now, not after a flush: a `q` typed meanwhile is still read
                tty.setcbreak(fd, termios.TCSANOW)
            if code != exitcodes.OK:
                return
        else:
            answer = client.request("POST", f"/approvals/{quote(approval['id'], safe='')}",
                                    {"grant": grant})
            released = (f", {answer.get('released', 0)} request(s) let through"
                        if grant == "once" else "")
            output.line(f"{grant}: {_what(approval)} ({render.text(approval['id'])}"
                        f"{released})")
    except CliError as exc:
        output.error(str(exc), exc.hint)
        return
    asking.waiting.pop(approval["id"], None)  # its change event may come later


class _AlwaysArgs:
    """What `_always` reads of `corral approve`'s arguments, from the monitor's."""

    def __init__(self, approval_id: str, project: str | None):
        self.id, self.project = approval_id, project
        self.yes = self.force = self.json = False


def register(sub) -> None:
    asks = appliance_command(
        sub, "ask", "ask mode for a session: a request the policy does not name waits for "
        "`corral approve`", cmd_ask, description="Ask mode for a running session "
        "(a runtime rule that wins over corral.toml's [approval]): a request or name the "
        "policy does not name is held (DNS: answered NXDOMAIN) while an approval is open; "
        "deny rules, IP literals and the appliance's own names are never held.")
    asks.add_argument("--hold", type=int, metavar="SECONDS",
                      help=f"how long a request waits for a decision (default {HOLD_DEFAULT})")
    asks.add_argument("--off", action="store_true", help="deny at once again")
    appliance_command(sub, "approvals", "what sessions in ask mode wait for", cmd_approvals)
    approve = appliance_command(sub, "approve", "grant an open approval", cmd_approve,
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
    refuse = appliance_command(sub, "refuse", "refuse an open approval: the requests waiting "
                               "get the usual denial", cmd_refuse, session=False)
    refuse.add_argument("id", metavar="ID")
    refuse.add_argument("--reason", metavar="TEXT", help="recorded with the decision")
