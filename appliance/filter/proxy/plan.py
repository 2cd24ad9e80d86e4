"""The checks one HTTP request passes before any of it reaches an upstream, in their order,
as a plan without I/O: given the judged head and what is known of the connection, it says
the next step, is fed what that step found, and ends with the request's last step.

    steps = plan(Request(...))
    step = next(steps)
    while isinstance(step, ReadBody | OnJudgeThread):   # the steps it is fed the result of
        step = steps.send(await run(step))              # the body's bytes, the work's result
    # step is Refuse or Send: nothing is asked of the plan after it

The order (each check only once every one before it let the request on):
1. the host: the decision its connection was judged by, then a conflict of the route
   (a Host header against the target, a target against the tunnel): `Refuse(ends=True)`;
2. the host's request rules, for the request's own method and target and every other its
   head asks to be read as (pipeline.judge_request);
3. a secret's value the agent wrote into a field (leaks.py), where the request is read;
4. the secrets attached (credentials.py): a placeholder left anywhere refuses it, with a
   `secret` event (`Refuse.leak`);
5. an echo (TRACE, TRACK, or a head asking to be read as one) of a request given a secret;
6. git, on a host a [[git]] table names: its calls classified and confined; a push read
   whole (`ReadBody`) and judged on a judge's thread (`OnJudgeThread`), refused with git's
   own report when git can show it;
7. the body, where the request is read: the target scanned for leaks, the body read whole
   (`ReadBody`) and examined (reading.py; on a judge's thread when large or coded) when it
   is scanned or may ask for a method its host's rules or a secret attached would judge;
   then what it asks for judged as the head's asks were (2, 5, and a secret's patterns);
8. `Send`: to the tunnel's upstream, the one kept from the previous request to the same
   place (when it is still open), or a new one.

forward.py executes the steps (the only I/O); a check the plan does not make does not
happen. Errors that end the connection (a body too large to hold) are raised as HttpError,
from the plan or from the step that read.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from typing import Any

from appliance.policy import Decision, Host, Policy
from appliance.policy.targets import Ambiguous
from appliance.sessionconfig import SCAN_BYTES

from ..git import http as git
from ..http import Head, HttpError
from .content import codings
from .credentials import Credentials, Leak
from .overrides import body_kinds, header_paths
from .pipeline import (
    Route,
    asked_methods,
    judge_asked,
    judge_request,
    keeps_after_refusal,
    request_fields,
    wants_close,
)
from .reading import BodyReading, examine

ECHOING = frozenset({"TRACE", "TRACK"})
"""Methods whose response is the request itself."""
OFF_LOOP = 1 << 10
"""Bodies larger than this (or content-coded) are read (reading.examine) on a judge's
thread, in the session's judge slot: the readers cost up to ~0.4 µs a byte (a multipart
body of empty parts, a form of escaped names), so a body read on the loop costs it at most
about half a millisecond (DESIGN 10). At 64 KiB such a body held the loop 20-25 ms. (A
judge's thread still shares the interpreter: while one reads, each wake-up of the loop may
wait out the switch interval, 5 ms.)"""

TUNNEL, KEPT, OPEN = "tunnel", "kept", "open"
"""Where `Send` sends: the tunnel's own upstream (the only one a tunnel has); the upstream
kept from the previous request to the same host and port, if it is still open (else a new
one, as OPEN); a new connection (any kept one closed)."""


@dataclass(frozen=True, slots=True)
class Request:
    """What the plan starts from: the judged head and what is known of the connection."""

    head: Head
    where: Route
    session: str | None
    policy: Policy
    """The policy the host was judged by (its request rules, its [[git]] table)."""
    decision: Decision
    """The host's decision (after any hold for a person's answer)."""
    credentials: Credentials
    """The secrets as they were when the request began: one snapshot for all its checks."""
    in_tunnel: bool = False
    ended: bool = False
    """Inside TLS the filter ended: the only place a secret is attached."""
    kept: tuple[str, int] | None = None
    """(host, port) of the upstream connection kept from the previous request, if any."""
    scan_bytes: int = SCAN_BYTES
    """The most of a body read whole to be scanned or judged ([inspect] scan_bytes)."""


@dataclass(frozen=True, slots=True)
class Refuse:
    """The request's last step: answer it with a refusal (or git's report), after an event
    of `kind` (with the `event` fields) says why. Nothing of it reached an upstream."""

    decision: Decision
    target: str
    """What the answer names as denied."""
    kind: str = "http"
    event: dict[str, Any] = field(default_factory=dict)
    keep: bool = False
    """Whether the connection goes on after the answer."""
    discard: int = 0
    """Body bytes still to be read and dropped before the answer (so that it may go on)."""
    ends: bool = False
    """Refused by its host (or its route): the event, then Denied raised, and the connection
    ends with the refusal the edge writes."""
    leak: Leak | None = None
    """A placeholder that went where it may not: a `secret` event first."""
    report: bytes | None = None
    """A refused push answered with git's own report (200: git shows why) instead."""
    unread: bool = False
    """A body comes that was not read, and the connection ends with the answer: what still
    comes is read and dropped before it closes (relay.linger), or the client meets a reset."""


@dataclass(frozen=True, slots=True)
class ReadBody:
    """Read the request's body whole, counting `hold` bytes against the session's budget
    of bodies held (first: it may refuse, 503); 100 Continue first when the client waits for
    it. Feed the plan the bytes. A body over `limit` is HttpError 413, with `why` added."""

    head: Head
    limit: int
    hold: int
    expects_continue: bool
    why: str = ""


@dataclass(frozen=True, slots=True)
class OnJudgeThread:
    """Run `work(*args)` on a judge's thread, in the session's judge slot (forward.judged);
    feed the plan its result."""

    work: Callable
    args: tuple


@dataclass(frozen=True, slots=True)
class Send:
    """The request's last step: send it upstream and relay the response."""

    head: Head
    """As sent: the secrets attached."""
    decision: Decision
    event: dict[str, Any]
    """The fields the allowed event carries (method, path, the secrets attached)."""
    attached: tuple[bytes, ...] = ()
    """The values attached, as on the wire: a response head carrying one back is refused."""
    body: bytes | None = None
    """The body when it was read whole to be judged (sent with its length)."""
    upstream: str = OPEN
    """TUNNEL, KEPT or OPEN."""


Step = Refuse | ReadBody | OnJudgeThread | Send
Plan = Generator[Step, Any, None]


def plan(request: Request) -> Plan:
    """The steps of one request (see the module's docstring for the order)."""
    head, where, session = request.head, request.where, request.session
    credentials, ended = request.credentials, request.ended
    decision = request.decision
    if decision.allowed and where.conflict is not None:
        decision = Decision(False, where.conflict)
    if not decision.allowed:
        yield Refuse(decision, where.target, ends=True)
        return
    inspection = request.policy.inspection(where.host)
    fields = request_fields(where, head) if inspection is not None else {}
    # what the head asks to be read as: read once (each reading of a long query costs
    # the loop), for the host's request rules and for the secrets attached
    asked = asked_methods(head, where.path) if (
        (inspection is not None and inspection.judges)
        or (ended and credentials.bound(where.host))) else []
    decision = judge_request(inspection, head, where, decision, asked)
    if not decision.allowed:  # by the host's request rules: the connection may go on
        target = f"{fields['method']} {fields['path']} on {where.target}"
        yield refusal(decision, target, head, fields)
        return
    read = inspection is not None or ended  # a secret's host is read without a table too
    if read:  # a value the agent holds, written into a field (before any is attached)
        leaked = credentials.leaks(session).in_fields(head.headers)
        if leaked is not None:
            yield refusal(Decision(False, leaked.reason), where.target, head, fields,
                          kind="leak", detector=leaked.detector)
            return
    paths = header_paths(head)
    try:
        applied = credentials.apply(session, where.host, head.start[1], head.headers,
                                    ended, head.start[0],
                                    tuple(m for _, m in asked) if ended else (),
                                    tuple(p for _, p in paths) if ended else ())
    except Leak as leak:  # nothing of it leaves; the connection may go on
        yield replace(refusal(leak_decision(where.host, leak), where.target, head, fields),
                      leak=leak)
        return
    attached: tuple[bytes, ...] = ()
    if applied.used:
        echo = echoing([head.start[0], *(m for _, m in asked)])
        if echo:
            yield refusal(Decision(False, f"{echo} sends the request back: never with a "
                                   f"secret attached ({', '.join(applied.used)})"),
                          where.target, head, fields)
            return
        head = replace(head, headers=applied.headers)
        fields = {**fields, "secrets": list(applied.used)}
        attached = credentials.values(applied.used)
    body: bytes | None = None  # read whole here when it must be judged before it goes
    access = request.policy.git(where.host) if inspection is not None else None
    if access is not None:
        outcome = yield from _git(request, head, access, fields)
        if isinstance(outcome, Refuse):
            yield outcome
            return
        body = outcome
    if read:
        # a secret attached is judged by every method the body asks for too: its request
        # patterns, and an echo (TRACE) that would hand its value back
        reading, body = yield from _read(request, head, inspection, body, bool(applied.used))
        if reading.finding is not None:
            yield refusal(Decision(False, reading.finding.reason), where.target, head, fields,
                          read=body is not None, kind="leak",
                          detector=reading.finding.detector)
            return
        refused = _judged_body(request, head, inspection, reading, asked, paths,
                               applied.used)
        if refused is not None:
            yield refusal(refused, where.target, head, fields, read=body is not None)
            return
    key = (str(where.host), where.port)
    upstream = TUNNEL if request.in_tunnel else KEPT if request.kept == key else OPEN
    yield Send(head, decision, fields, attached, body, upstream)


def _judged_body(request: Request, head: Head, inspection, reading: BodyReading,
                 asked: list[tuple[str, str]], paths: list[tuple[str, str]],
                 used: tuple[str, ...]) -> Decision | None:
    """The refusal of a request by what its body asks for (None: it may go): a body that
    cannot be read as its origin would; a method it asks for that its host's rules deny,
    judged with what the head asks for; a secret attached that its request patterns do not
    let go with it; an echo (TRACE) of a request given a secret."""
    if reading.refusal:
        return Decision(False, reading.refusal)
    if not reading.methods:
        return None
    where = request.where
    methods = [*asked, *reading.methods]
    refused = judge_asked(inspection, head, where, methods, paths) if (
        inspection is not None) else None
    unpermitted = request.credentials.unpermitted(
        used, [m for _, m in methods], head.start[1], [p for _, p in paths])
    if refused is None and unpermitted:
        refused = Decision(False, unpermitted)
    echo = echoing([m for _, m in reading.methods]) if used else None
    if refused is None and echo:
        refused = Decision(False, f"the body asks for {echo}, which sends the request back: "
                           f"never with a secret attached ({', '.join(used)})")
    return refused


def refusal(decision: Decision, target: str, head: Head, fields: dict, read: bool = False,
            kind: str = "http", **extra) -> Refuse:
    """A request refused after its host allowed it: the connection goes on when HTTP allows
    — not closing, and its body read already (`read`) or small enough to read and drop, and
    not waited on with 100 Continue (pipeline.keeps_after_refusal)."""
    if read:
        keep, discard = not wants_close(head, head.start[2]), 0
    else:
        keep = keeps_after_refusal(head)
        discard = (head.content_length or 0) if keep else 0
    unread = not read and not keep and bool(head.chunked or head.content_length)
    return Refuse(decision, target, kind, {**fields, **extra}, keep, discard, unread=unread)


def leak_decision(host: Host, leak: Leak) -> Decision:
    """The refusal of a placeholder going where it may not (credentials.apply)."""
    what = f"the placeholder of secret {leak.secret}" if leak.secret else (
        "a corral secret placeholder (not one of this session's secrets)")
    return Decision(False, f"{what} in {leak.where} to {host}: a placeholder goes only to its "
                    "secret's hosts, in its header, inside TLS the filter ends")


def echoing(methods) -> str | None:
    """The first of `methods` (the request's own, then those it asks to be read as) whose
    response is the request itself."""
    return next((m for m in methods if m.upper() in ECHOING), None)


def _expects_continue(head: Head) -> bool:
    return (head.get("expect") or "").lower() == "100-continue"


def _git(request: Request, head: Head, access, fields: dict
         ) -> Generator[Step, Any, Refuse | bytes | None]:
    """A request to a host a [[git]] table names: None when it is not git's or may go on
    as sent; the body of a push that may go on (read here to be judged: send it); the
    refusal when it may not."""
    where, host, session = request.where, request.where.host, request.session

    def refuse(reason: str, hint: str = "") -> Refuse:
        return refusal(Decision(False, reason, hint=hint), where.target, head, fields)

    try:
        call = git.classify(where.path)
    except Ambiguous as exc:
        return refuse(f"a request to {host} (a [[git]] host) that servers read in different "
                      f"ways: {exc}")
    method = head.start[0]
    if method in git.WEBDAV:  # MOVE and COPY write where a header says, not the target
        return refuse(f"{method} on {host} (a [[git]] host): WebDAV, which git http-push "
                      "uses to move refs unread; corral confines git's smart protocol (git "
                      "push over HTTPS)")
    if call is None:
        repo = git.bare_file(where.path) if method in ("PUT", "DELETE") else None
        if repo is None:
            return None
        return refuse(f"{method} on {where.path[:100]!r}: the files of a bare repository "
                      f"({repo[:100]!r}) on {host}, a [[git]] host, are written only by git "
                      "push over the smart protocol")
    spec = access.repository(call.repo)
    if spec is None:
        return refuse(f"git repository {call.repo[:100]!r} on {host} is not listed (listed: "
                      f"{access.listed()})", f'add "{call.repo[:100]}" to repos of the '
                      f"[[git]] table for {host} in corral.toml")
    reads = ("GET", "HEAD") if call.discovery or call.service == git.OTHER else ("POST",)
    if call.service == git.OTHER and method == "POST" and git.lfs_batch(where.path):
        return None  # LFS asks what to fetch (or upload: refused where it goes)
    if method not in reads:  # WebDAV on git's own paths would move refs unread
        return refuse(f"{method[:20]} on git repository {call.repo[:100]!r}: corral confines "
                      "git's smart protocol (git push over HTTPS) and refuses other writes "
                      "(WebDAV, git http-push, LFS uploads)")
    if call.service != git.RECEIVE or call.discovery:
        return None
    if session is None:
        return refuse("a git push from an address no session holds")
    if body_kinds(head):  # its body is read for refs only, never for a _method in it
        return refuse(f"a push to {call.repo[:100]!r} whose Content-Type is not git's "
                      "(application/x-git-receive-pack-request): servers read a form, "
                      "multipart or JSON body (or one with no type) for a method override, "
                      "which a push's body is not judged for")
    if (head.content_length or 0) > git.MAX_PUSH:
        raise HttpError(413, f"a push of {head.content_length} bytes; the filter holds at "
                        f"most {git.MAX_PUSH} to judge one")
    raw = yield ReadBody(head, git.MAX_PUSH, head.content_length or git.MAX_PUSH,
                         _expects_continue(head))
    verdict = yield OnJudgeThread(git.judge_push, (
        raw, tuple(head.get_all("content-encoding")), spec, session))
    if verdict.allowed:
        return raw
    decision = Decision(False, verdict.reason[:500], hint=git.hint(verdict, spec, session, host))
    keep = not wants_close(head, head.start[2])
    report = None
    if not (verdict.commands and not verdict.reportable):  # else it would read a 200 as
        answer = git.report(verdict)                       # success: a refusal instead
        report = (b"HTTP/1.1 200 OK\r\nContent-Type: application/x-git-receive-pack-result\r\n"
                  b"Cache-Control: no-cache\r\nContent-Length: %d\r\n%s\r\n%s" % (
                      len(answer), b"" if keep else b"Connection: close\r\n", answer))
    return Refuse(decision, where.target, "git", dict(fields), keep, report=report)


def _read(request: Request, head: Head, inspection, body: bytes | None, attached_any: bool
          ) -> Generator[Step, Any, tuple[BodyReading, bytes | None]]:
    """What a request to a read host carries out (reading.py): (what was found, the body if
    it has been read whole). The target is always scanned for leaks; the body is read whole
    when it is scanned (unless the host says `scan = false`) or may carry a method override
    its host's rules or a secret attached to it (`attached_any`) would judge, and was not
    read already (a push on a [[git]] host: its pack is compressed, judged by its refs).
    Raises HttpError for a body too large to hold."""
    leaks = request.credentials.leaks(request.session)
    found = leaks.scan(head.start[1].encode("latin-1", "replace"), "the target")
    if found is not None or body is not None or not (head.chunked or head.content_length):
        return BodyReading(finding=found), body
    scanned = inspection is None or inspection.scanned
    names = attached_any or (inspection is not None and inspection.names_methods)
    methods = names and bool(body_kinds(head))
    if not scanned and not methods:
        return BodyReading(), None
    limit = request.scan_bytes
    why = ("for leaks; a host that takes bulk uploads says scan = false in its [[inspect]] "
           "table") if scanned else (
           "to find a method override (its type can carry one, and the host's request "
           "rules or a secret attached to it name methods)")
    if (head.content_length or 0) > limit:  # before a 100 Continue sends it on its way
        raise HttpError(413, f"request body of {head.content_length} bytes; the filter "
                        f"reads at most {limit} {why}")
    body = yield ReadBody(head, limit, head.content_length or limit, _expects_continue(head),
                          why)
    args = (body, head, leaks if scanned else None, methods)
    if len(body) > OFF_LOOP or codings(head):  # parsing, scanning or inflating a body
        return (yield OnJudgeThread(examine, args)), body  # of any size: not on the loop
    return examine(*args), body
