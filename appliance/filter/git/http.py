"""git's smart HTTP protocol, read by the proxy on hosts a `[[git]]` table names: which
repository a request reaches, and whether a push may write what it asks. Sans-IO: bytes in,
a verdict and git's own answer out (policy/git.py holds the rules).

    GET  /REPO[.git]/info/refs?service=git-upload-pack     fetch: the refs on offer
    POST /REPO[.git]/git-upload-pack                        fetch: the objects
    GET  /REPO[.git]/info/refs?service=git-receive-pack    push: the refs as they are
    POST /REPO[.git]/git-receive-pack                       push: commands, then a pack

A push's body is commands (`OLD NEW REF`, one per ref, each line may carry capabilities
after a NUL), a flush, push options when a line asked for them, then the pack: read as
git's receive-pack reads them (protocol.py). Each command must pass `judge`: a valid ref
name the rule's patterns name for this session, never a delete, never a tag moved, and an
update only when the pack shows NEW descends from OLD (a fast-forward); each push option
must be one the rule's `push_options` name (GitLab's `merge_request.create` with
`merge_request.target=main` would merge the session's branch into main). One refused
command or option refuses the whole push (none of it reaches the upstream), and the client
is answered in git's report-status format, so that `git push` prints each ref's reason:

    ! [remote rejected] main -> main (corral: refs/heads/main is not yours to push: ...)

Why the pack is read here and not left to the server: `receive.denyNonFastForwards` is the
server's setting, off on most hosts, and an agent's force-push would rewrite history there.
Only commits are read (their parents), deltas of commits resolved within the pack; a commit
the pack does not hold (the remote has it already, or it is a delta against an object the
remote has) cannot show ancestry, and the update is refused with that reason.
"""

from __future__ import annotations

import re
import time
import zlib
from dataclasses import dataclass

from appliance.filter.git.protocol import (  # noqa: F401  (git's wire, named here too)
    FLUSH,
    OID,
    Command,
    GitProtocolError,
    Push,
    pkt,
    read_push,
)
from appliance.policy.git import GitSpec
from appliance.policy.targets import ENCODED_SLASH, Ambiguous, query_pairs, read_target

from .pack import JUDGE_SECONDS, check_deadline, iter_commits

UPLOAD, RECEIVE, ARCHIVE = "git-upload-pack", "git-receive-pack", "git-upload-archive"
SERVICES = (UPLOAD, RECEIVE, ARCHIVE)
OTHER = "other"
"""A path of a git repository outside the smart protocol: dumb reads, WebDAV, LFS."""
MAX_PUSH = 64 << 20
"""The largest push body (as decoded) the proxy holds to judge; a larger one is refused."""
MAX_UPDATES = 32
"""Refs a push may move (not create) at once: each is shown a fast-forward by a walk of the
pushed commits."""
OPTION_SHOWN = 60
"""The characters of a refused push option a reason quotes."""
_DUMB = re.compile(r"(?P<repo>/.+?)/(?:head|info/(?:packs|alternates|http-alternates|lfs/.*)"
                   r"|objects/(?:info/.*|pack/.*|[0-9a-f]{2}/[0-9a-f]{38,62}))")
"""The paths of git's dumb protocol and of LFS under a repository (lower-cased)."""
_BARE = re.compile(r"(?P<repo>/.+?)/(?:head|refs/.+|packed-refs|info/refs"
                   r"|objects/(?:info/packs|[0-9a-f]{2}/.+))")
"""The files of a bare repository a WebDAV push (`git http-push`) writes: a server that
serves them at `REPO/...` without `.git` would have refs moved unread. Only for PUT and
DELETE (other WebDAV methods are refused on a git host whatever the path): as reads they
are also a forge's web pages and API (`/o/r/blob/main/refs/x`)."""
WEBDAV = frozenset({"MOVE", "COPY", "LOCK", "UNLOCK", "MKCOL", "PROPFIND", "PROPPATCH"})
"""Methods git's own protocols never send to a git host; `git http-push` does (MOVE and COPY
name where to write in a header, `Destination`, not in the target)."""
_FORBIDDEN_IN_REF = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//|/\.|\.lock(?:/|$)")


@dataclass(frozen=True, slots=True)
class GitCall:
    """A smart-HTTP request: the repository it reaches and the service it asks for."""

    repo: str
    service: str
    discovery: bool
    """The `info/refs` GET that precedes the service's POST."""


def classify(target: str) -> GitCall | None:
    """The git call an origin-form target makes, None for any other request. Raises
    Ambiguous for a target servers read in different ways. Known whatever the case of its
    letters (a server that routes without case must not see a push the proxy missed).
    Besides the smart protocol, any path under a `NAME.git` segment (git's dumb protocol,
    WebDAV pushes by `git http-push`, LFS) and any `.../info/lfs/...` path is git's too
    (service OTHER): it must name a listed repository, and only reads pass."""
    parsed = read_target(target)
    path, folded = parsed.path, parsed.path.lower()
    if ENCODED_SLASH in path:  # git never sends one; a server that decodes it routes anew
        raise Ambiguous("an encoded slash (%2F) in a git host's path")
    if folded.endswith("/info/refs"):
        services = [v.lower() for k, v in query_pairs(parsed.query or "")
                    if k.lower() == "service"]
        if len(services) > 1:
            raise Ambiguous("more than one service= in a git discovery request")
        service = services[0] if services else UPLOAD  # the dumb protocol only reads
        if service not in SERVICES:
            raise Ambiguous("an unknown git service in a discovery request")
        return GitCall(_repo(path, len("/info/refs")), service, True)
    for service in SERVICES:
        if folded.endswith("/" + service):
            return GitCall(_repo(path, len(service) + 1), service, False)
    segments = path[1:].split("/")
    for i, segment in enumerate(segments[:-1]):
        if segment.lower().endswith(".git") and len(segment) > 4:
            return GitCall(_repo("/" + "/".join(segments[: i + 1]), 0), OTHER, False)
    dumb = _DUMB.fullmatch(folded)  # without `.git`: git http-backend tries REPO.git too
    if dumb is not None:
        return GitCall(_repo(path[: dumb.end("repo")], 0), OTHER, False)
    return None


def bare_file(target: str) -> str | None:
    """The repository whose files an origin-form target names as a bare repository's
    (refs, packed-refs, objects; `classify` found no git call in it), else None. Asked for
    PUT and DELETE, which git's own protocols never send there."""
    try:
        path = read_target(target).path
    except Ambiguous:
        return None
    found = _BARE.fullmatch(path.lower())
    return _repo(path[: found.end("repo")], 0) if found is not None else None


def lfs_batch(target: str) -> bool:
    """Is this LFS's batch request (POST: which objects to fetch or upload, and where)?"""
    try:
        return read_target(target).path.lower().endswith("/info/lfs/objects/batch")
    except Ambiguous:
        return False


def _repo(path: str, suffix: int) -> str:
    repo = path[1 : len(path) - suffix]
    return repo[:-4] if repo.lower().endswith(".git") else repo


# -- refs ------------------------------------------------------------------------------


def valid_ref(ref: str) -> bool:
    """git check-ref-format's rules, as a receive-pack applies them to a pushed ref."""
    return (ref.startswith("refs/") and len(ref) <= 1024 and not ref.endswith(("/", "."))
            and _FORBIDDEN_IN_REF.search(ref) is None and "/." not in ref
            and not any(part.startswith(".") for part in ref.split("/")))


# -- the verdict -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verdict:
    refusals: tuple[tuple[Command, str], ...]
    """The refused commands and why; empty when the push may go on."""
    capabilities: frozenset[str]
    commands: tuple[Command, ...] = ()
    error: str | None = None
    """Why the push could not be read at all, or its options are refused (then `refusals`
    is empty)."""
    options: tuple[str, ...] = ()
    """The push options the rule does not name (the error says so)."""

    @property
    def allowed(self) -> bool:
        return not self.refusals and self.error is None

    @property
    def reportable(self) -> bool:
        """Did the client ask for a per-ref report (every git since 1.6 does)?"""
        return bool({"report-status", "report-status-v2"} & self.capabilities)

    @property
    def reason(self) -> str:
        if self.error is not None:
            return f"git push refused: {self.error}"
        first = self.refusals[0]
        more = f" (and {len(self.refusals) - 1} more)" if len(self.refusals) > 1 else ""
        ref = first[0].ref if valid_ref(first[0].ref) else repr(first[0].ref[:100])
        return f"git push to {ref} refused: {first[1]}{more}"


def decode_body(body: bytes, encodings: list[str]) -> bytes:
    """A request body as git wrote it, gzip undone (bounded by MAX_PUSH). `encodings`: the
    Content-Encoding fields, as sent."""
    if not encodings or [e.lower().strip() for e in encodings] == ["identity"]:
        return body
    if len(encodings) > 1 or encodings[0].lower().strip() not in ("gzip", "x-gzip"):
        raise GitProtocolError("a push body in a Content-Encoding other than gzip")
    inflater = zlib.decompressobj(wbits=31)
    try:
        data = inflater.decompress(body, MAX_PUSH + 1)
    except zlib.error as exc:
        raise GitProtocolError(f"the gzip body does not inflate: {exc}") from None
    if len(data) > MAX_PUSH:
        raise GitProtocolError(f"the push is larger than {MAX_PUSH >> 20} MiB once inflated")
    if not inflater.eof or inflater.unused_data:
        raise GitProtocolError("the gzip body is cut short, or holds more than one member")
    return data


def judge(body: bytes, spec: GitSpec, session: str | None,
          seconds: float = JUDGE_SECONDS) -> Verdict:
    """The verdict on a receive-pack body (decoded) for `session` under `spec`, within
    `seconds`. Reads the pack's commits only, and only for refs a push moves."""
    if session is None:
        return Verdict((), frozenset(), (), "a push from an address no session holds")
    try:
        push = read_push(body)
    except GitProtocolError as exc:
        return Verdict((), frozenset(), (), str(exc))
    refused = tuple(option for option in push.options if not spec.push_option(option))
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        return Verdict((), push.capabilities, push.commands, f"push option {shown(refused[0])}"
                       f"{more} is not one the [[git]] table allows (push_options): options ask "
                       "the host to act beyond the refs (merge requests, CI)", refused)
    refusals: list[tuple[Command, str]] = []
    updates: list[Command] = []
    for command in push.commands:
        why = _refusal(command, spec, session)
        if why is not None:
            refusals.append((command, why))
        elif not command.creates:
            updates.append(command)
    if len(updates) > MAX_UPDATES:
        return Verdict((), push.capabilities, push.commands, f"a push that moves {len(updates)} "
                       f"refs; corral shows at most {MAX_UPDATES} at once to be fast-forwards")
    if updates and not refusals:
        try:
            unproven = _fast_forwards(body[push.pack:], updates,
                                      time.monotonic() + seconds)
        except GitProtocolError as exc:
            return Verdict((), push.capabilities, push.commands, str(exc))
        refusals += [(command, f"{command.new[:12]} is not shown to descend from "
                      f"{command.old[:12]}: a push may only move a ref forward (no "
                      "force-push, no rewritten history); push a new branch under the same "
                      "prefix instead") for command in unproven]
    return Verdict(tuple(refusals), push.capabilities, push.commands)


def shown(option: str) -> str:
    """A push option as a reason shows it: cut, quoted, anything but printable ASCII escaped
    (git prints the reason on the agent's terminal; events and the audit log keep it)."""
    return ascii(option[:OPTION_SHOWN]) + ("..." if len(option) > OPTION_SHOWN else "")


def judge_push(raw: bytes, encodings: tuple[str, ...], spec: GitSpec, session: str | None
               ) -> Verdict:
    """Inflate (gzip) and judge a push, on a judge's thread (over HTTPS and over SSH)."""
    try:
        return judge(decode_body(raw, list(encodings)), spec, session)
    except GitProtocolError as exc:
        return Verdict((), frozenset(), (), str(exc))


def hint(verdict: Verdict, spec: GitSpec | None, session: str, host: str) -> str:
    """What to do about a refused push (the event's hint), over HTTPS and SSH alike."""
    if verdict.options:
        return (f"push without -o, or name the option in push_options of the [[git]] table "
                f"for {host}")
    pushes = spec.pushes[0] if spec is not None else "refs/heads/corral/{session}"
    return (f"push to a branch under {pushes.replace('{session}', session)}, or name the ref "
            f"in push of the [[git]] table for {host}")


def _fast_forwards(pack: bytes, updates: list[Command], deadline: float) -> list[Command]:
    """The updates the pack does not show to be fast-forwards: each old commit's
    descendants among the pushed commits, found once (a walk of the reversed parent links)."""
    commits = dict(iter_commits(pack, len(updates[0].new) == 64, deadline))
    children: dict[str, list[str]] = {}
    for oid, parents in commits.items():
        for parent in parents:
            children.setdefault(parent, []).append(oid)
    descendants: dict[str, set[str]] = {}
    for old in {c.old for c in updates}:
        check_deadline(deadline)
        seen, todo = set(), [old]
        while todo:
            for child in children.get(todo.pop(), ()):
                if child not in seen:
                    seen.add(child)
                    todo.append(child)
        descendants[old] = seen
    return [c for c in updates if c.new not in descendants[c.old]]


def _refusal(command: Command, spec: GitSpec, session: str) -> str | None:
    ref = command.ref
    if not valid_ref(ref):
        return "not a valid ref name"
    if command.deletes:
        return "a push may never delete a ref"
    if ref.startswith("refs/tags/") and not command.creates:
        return "a push may never move a tag (creating one may be allowed)"
    if spec.pushable(ref, session) is None:
        allowed = ", ".join(p.replace("{session}", session) for p in spec.pushes)
        return f"this session may push only {allowed}"
    return None


def report(verdict: Verdict) -> bytes:
    """The receive-pack result that tells `git push` each ref was refused and why, in the
    form its capabilities asked for (report-status, inside side-band when asked); a push
    whose commands could not be read gets git's error packet (`remote error: ...`)."""
    caps = verdict.capabilities
    sideband = "side-band-64k" in caps or "side-band" in caps
    # data bytes per side-band packet: git's largest pkt-line (65520, or 1000 without -64k)
    # less its 4 length bytes and its band byte
    limit = 65515 if "side-band-64k" in caps else 995
    if not verdict.commands:
        message = f"corral: {verdict.reason}".encode()[:limit]
        return pkt(b"\3" + message) + FLUSH if sideband else pkt(b"ERR " + message)
    refused = {c.ref: why for c, why in verdict.refusals}
    lines = [pkt(b"unpack ok\n")]
    for command in verdict.commands:
        why = verdict.error or refused.get(command.ref, "another ref of this push was refused")
        lines.append(pkt(f"ng {command.ref} corral: {why}\n".encode()[:65000]))
    lines.append(FLUSH)
    status = b"".join(lines)
    if not sideband:
        return status
    out = [pkt(b"\2" + f"corral: {verdict.reason}\n".encode()[:limit])]
    out += [pkt(b"\1" + status[i : i + limit]) for i in range(0, len(status), limit)]
    out.append(FLUSH)
    return b"".join(out)
