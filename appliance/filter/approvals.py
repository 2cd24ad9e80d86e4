"""Approvals: what a session in ask mode waits for, and what a person decided. No sockets.

A session whose policy says `approval ask` (`[approval] mode = "ask"`, `corral run --ask`)
does not get a denial at once for a host the policy merely does not name: the request is
held while a pending approval is published, and a person decides over mTLS (`corral
approve`, `corral refuse`, the API). This module is the book of pending approvals: it
coalesces what one session asks for one target into one approval, bounds how many a session
may have, and turns a decision into what the held requests learn (`Approvals`, pure), and
holds the requests, a future per approval (`Holds`, which the proxy and the DNS filter ask
and the control socket decides through). The control socket adds the rule a grant makes
before the requests learn of it, so that they pass under the new policy.

What can never be approved: a host a deny rule covers, a placeholder, the VM host's ports,
anything not denied by the default (approvable() says which), and addresses in a blocked
range (judged after a grant, when the name is dialled). An approval is scoped to the session
that asked; nothing inside a sandbox can decide one (the control socket and the API are out
of its reach).

The open approvals outlive a restart of the filter (`snapshot`/`restore`; approvals_file.py
writes and reads the file): an agent told "pending" and a person about to type an id find
them again. The requests held for them do not (their connections went with the process); a
restored approval is one nobody waits for until the agent asks again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, urlsplit

from appliance.event import Event
from appliance.policy import (
    Decision,
    Host,
    HostNameError,
    Policy,
    parse_host,
    split_host_port,
)
from appliance.policy.grants import approvable, grant_of

log = logging.getLogger(__name__)

GRANTS = ("once", "for", "session")
"""once: the requests waiting now go on, no rule is added; for: a runtime rule that ends
after a duration; session: a runtime rule for the session's life. (`always`, written into
the project's corral.toml, is the CLI's to do: the appliance never writes a project.)"""
MAX_PENDING = 32
"""Approvals one session may have open: past it, a new target is denied at once (a flood of
names must not become a flood of prompts, nor memory)."""
KEEP = 600.0
"""Seconds an approval nobody waits for any more stays listed after it was last asked for
(a person may still grant it; the agent retries)."""
GONE_POLL = 0.5
"""Seconds between looks at whether a held request's client is still there."""
MAX_NOTE = 300
"""Characters of a reason or a refusal's note kept (untrusted text, shown escaped)."""
REQUEST_NAME = "request.corral"
"""Where an agent asks, through its session's proxy: `http://request.corral/?host=...`."""
ASK_KINDS = ("http", "dns", "tcp")
MAX_WAIT = 600
"""Seconds an agent's request may wait for the decision (`wait=`)."""
_ID = re.compile(r"ap-[0-9a-f]{8}")
ORIGINS = ("proxy", "dns", "agent")
MAX_DUMP = 8 << 20
"""The largest approvals file read back (32 per session, each a few hundred bytes)."""
MAX_ASKED = 1 << 40
SAVE_EVERY = 1.0
"""Seconds between writes of the open approvals when one opened (one closing is written at
once): a crash loses at most what opened in the last one, which the next request for it
opens again."""
TOUCH_EVERY = 30.0
"""Seconds between writes when approvals were only asked for again (their count, their last
ask): an agent retrying must not keep the disk busy."""
DUMP_VERSION = 1


def decide_kind(policy: Policy, kind: str, host: Host, port: int | None) -> Decision:
    """What the policy says of a target as a grant of `kind` would name it (an http target
    without a port stands for its default ports: 443 is asked)."""
    if kind == "dns":
        return policy.decide_dns(host)
    if kind == "tcp":
        return policy.decide_tcp(host, port)
    return policy.decide_http(host, port if port is not None else 443)


def request_hint(decision: Decision) -> str | None:
    """What a 403 tells an agent about asking a person for it (one line), or None."""
    if not approvable(decision):
        return None
    kind, target = grant_of(decision)
    suffix = "" if kind == "http" else f"&kind={kind}"
    return (f"curl -sS 'http://{REQUEST_NAME}/?host={quote(target, safe=':[]')}{suffix}"
            "&reason=WHY+YOU+NEED+IT&wait=60'")


@dataclass(frozen=True)
class AgentAsk:
    """What an agent asked for at request.corral."""

    host: Host
    port: int | None
    kind: str
    reason: str
    wait: int


def parse_agent_ask(path: str) -> AgentAsk:
    """`/?host=H[:PORT]&reason=TEXT[&kind=http|dns|tcp][&wait=SECONDS]`, as the proxy
    routed it (origin-form); ApprovalError says what is wrong."""
    parts = urlsplit(path)
    if parts.path not in ("", "/"):
        raise ApprovalError(f"ask at http://{REQUEST_NAME}/?host=HOST[:PORT]&reason=WHY "
                            "(kind=http|dns|tcp, wait=SECONDS optional)")
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query),
                          max_num_fields=8)
    except ValueError as exc:
        raise ApprovalError(f"the query does not parse: {exc}") from None
    fields: dict[str, str] = {}
    for key, value in pairs:
        if key not in ("host", "reason", "kind", "wait"):
            raise ApprovalError(f"unknown field {clean(key)[:40]!r}; expected host, reason, "
                                "kind, wait")
        if key in fields:
            raise ApprovalError(f"field {key!r} given twice")
        fields[key] = value
    if not fields.get("host"):
        raise ApprovalError("name the host: ?host=HOST[:PORT]&reason=WHY")
    if not fields.get("reason", "").strip():
        raise ApprovalError("say why: a person reads the reason (&reason=...)")
    kind = fields.get("kind", "http")
    if kind not in ASK_KINDS:
        raise ApprovalError(f"kind {clean(kind)[:20]!r}: expected one of {', '.join(ASK_KINDS)}")
    wait = fields.get("wait", "0")
    if not wait.isdigit() or int(wait) > MAX_WAIT:
        raise ApprovalError(f"wait: a whole number of seconds, 0 to {MAX_WAIT}")
    try:
        name, port_text = split_host_port(fields["host"])
        host = parse_host(name)
        if port_text is not None and not (port_text.isascii() and port_text.isdigit()):
            raise ValueError(f"port {clean(port_text)[:20]!r} is not a number")
        port = int(port_text) if port_text is not None else None
    except (HostNameError, ValueError) as exc:
        raise ApprovalError(f"host {clean(fields['host'])[:80]!r}: {exc}") from None
    if host.name is None and host.address is None:
        raise ApprovalError(f"host {clean(fields['host'])[:80]!r} is no host")
    if port is not None and not 0 < port < 65536:
        raise ApprovalError(f"port {port} is out of range")
    if kind == "tcp" and port is None:
        raise ApprovalError("a tcp request names its port: ?host=HOST:PORT&kind=tcp")
    if kind == "dns" and port is not None:
        raise ApprovalError("a dns request names a host without a port")
    return AgentAsk(host, port, kind, clean(fields["reason"].strip()), int(wait))


def clean(text: str, limit: int = MAX_NOTE) -> str:
    """Untrusted text as it is kept and shown: printable ASCII (no terminal escapes, nothing
    a header cannot carry), one line, bounded."""
    kept = "".join(c if c.isprintable() and c.isascii() else "?" for c in text[:limit])
    return kept[:limit]


@dataclass
class Pending:
    id: str
    session: str
    kind: str
    """The kind of rule a grant adds: http, dns or tcp."""
    target: str
    """The rule text a grant adds (`example.com:443`, `example.com`)."""
    why: str
    """Why the policy denied it (the policy's reason)."""
    origin: str
    """Who asked: proxy (a held request), dns (a query answered NXDOMAIN), agent (at
    request.corral, with a reason)."""
    note: str = ""
    """The agent's reason (untrusted: cleaned, bounded), when it asked."""
    created: float = field(default_factory=time.time)
    last: float = field(default_factory=time.monotonic)
    asked: int = 1
    waiting: int = 0
    """Requests held for it right now (the edge counts them): what a grant `once` lets go."""
    held: int = 0
    """Everything waiting for its decision (agents asking with `wait` too): it does not
    expire meanwhile."""
    deciding: bool = False
    """A decision has claimed it (its rule is being written)."""

    def to_json(self) -> dict:
        return {"id": self.id, "session": self.session, "kind": self.kind,
                "target": self.target, "why": self.why, "origin": self.origin,
                "note": self.note,
                "created": round(self.created, 3), "asked": self.asked,
                "waiting": self.waiting}


@dataclass(frozen=True)
class Ruling:
    """What a held request learns: a grant, or None (refused, no decision in time)."""

    grant: str | None
    """One of GRANTS, "policy" (a rule allows it now), or None."""
    reason: str


class ApprovalError(ValueError):
    """A decision that cannot be taken (unknown approval, grant, duration): says why."""


class Approvals:
    def __init__(self, max_pending: int = MAX_PENDING, keep: float = KEEP):
        self.max_pending, self.keep = max_pending, keep
        self.pending: dict[str, Pending] = {}
        self._by_target: dict[tuple[str, str, str], str] = {}
        self._open: Counter[str] = Counter()
        """Open approvals by session: the bound is checked without a scan."""
        self._scanned = float("-inf")
        self.changes = 0
        """Counts approvals opened and closed: worth writing down soon."""
        self.touched = 0
        """Counts asks for approvals already open (their count and last ask): written down
        now and then."""
        self.on_close: Callable[[], None] | None = None
        """Told when an approval closes (a decision, its expiry, its session's end): the
        service writes that down at once, so that a crash does not bring it back."""

    def ask(self, session: str, kind: str, target: str, why: str, origin: str,
            now: float | None = None, note: str = "") -> tuple[Pending | None, bool]:
        """The approval for (session, kind, target), made if new: (pending, new). (None,
        False) when the session already has max_pending others: deny at once."""
        now = time.monotonic() if now is None else now
        found = self._by_target.get((session, kind, target))
        if found is not None:
            pending = self.pending[found]
            pending.asked += 1
            pending.last = now
            pending.note = pending.note or note  # the first reason given stands
            self.touched += 1
            return pending, False
        if self._open[session] >= self.max_pending:
            return None, False
        pending = Pending(f"ap-{secrets.token_hex(4)}", session, kind, target, why, origin,
                          note, last=now)
        while pending.id in self.pending:  # 32 bits: a clash is rare, never a merge
            pending.id = f"ap-{secrets.token_hex(4)}"
        self._add(pending)
        self.changes += 1
        return pending, True

    def _add(self, pending: Pending) -> None:
        self.pending[pending.id] = pending
        self._by_target[(pending.session, pending.kind, pending.target)] = pending.id
        self._open[pending.session] += 1

    def claim(self, approval_id: str, grant: str | None) -> Pending:
        """Reserve the approval for a decision that takes a while (a grant's rule is written
        first): until take() or release(), no other decision and no expiry touches it.
        Raises ApprovalError as check() does."""
        pending = self.check(approval_id, grant)
        pending.deciding = True
        return pending

    def release(self, pending: Pending) -> None:
        """A claimed decision that failed: the approval is open again."""
        pending.deciding = False

    def take(self, approval_id: str, grant: str | None, claimed: bool = False) -> Pending:
        """Remove the approval a person decided (grant None: refused); raises ApprovalError
        as check() does (a claimed one is the claimer's to take)."""
        pending = self.pending.get(approval_id)
        if not (claimed and pending is not None and pending.deciding):
            pending = self.check(approval_id, grant)
        self.drop(pending)
        return pending

    def check(self, approval_id: str, grant: str | None) -> Pending:
        """The approval, if this decision can be taken: ApprovalError for an unknown id or
        grant, one another decision is taking, and for `once` when no request is waiting."""
        pending = self.pending.get(approval_id)
        if pending is None:
            raise ApprovalError(f"no pending approval {approval_id!r} (decided already, or "
                                "expired: `corral approvals` lists the open ones)")
        if pending.deciding:
            raise ApprovalError(f"{approval_id} is being decided by another request")
        if grant is not None and grant not in GRANTS:
            raise ApprovalError(f"grant {grant!r}: expected one of {', '.join(GRANTS)}")
        if grant == "once" and not pending.waiting:
            raise ApprovalError(f"{approval_id}: no request is waiting for it, so there is "
                                "nothing to let through once; grant it for a while "
                                "(--for 10m) or for the session (--session)")
        return pending

    def expire(self, now: float | None = None, every: float = 0.0) -> list[Pending]:
        """Approvals nobody waits for and nobody asked again for `keep` seconds: dropped.
        With `every`, at most one scan in that many seconds (asks on a hot path)."""
        now = time.monotonic() if now is None else now
        if every and now - self._scanned < every:
            return []
        self._scanned = now
        stale = [p for p in self.pending.values()
                 if not p.held and not p.deciding and now - p.last >= self.keep]
        for pending in stale:
            self.drop(pending)
        return stale

    def forget(self, session: str) -> list[Pending]:
        """A session that ended: its approvals go with it."""
        gone = [p for p in self.pending.values() if p.session == session]
        for pending in gone:
            self.drop(pending)
        return gone

    def listing(self, session: str | None = None) -> list[dict]:
        return [p.to_json() for p in sorted(self.pending.values(), key=lambda p: p.created)
                if session is None or p.session == session]

    def drop(self, pending: Pending) -> None:
        """Close an approval (decided, settled, expired, or its session's end)."""
        if self.pending.pop(pending.id, None) is not None:
            self._open[pending.session] -= 1
            if not self._open[pending.session]:
                del self._open[pending.session]
            self.changes += 1
            if self.on_close is not None:
                self.on_close()
        self._by_target.pop((pending.session, pending.kind, pending.target), None)

    def snapshot(self, identity: Callable[[str], str], now: float | None = None,
                 wall: float | None = None) -> dict:
        """The open approvals as approvals.json holds them (cheap: `encode` can run off the
        loop), each with its session's `identity` (its subnet: a session of the same name
        made later is another agent) and its last ask in wall-clock time (monotonic time
        does not survive a restart)."""
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        return {"version": DUMP_VERSION, "approvals": [
            {**p.to_json(), "last": round(wall - (now - p.last), 3),
             "identity": identity(p.session)} for p in self.pending.values()]}

    @staticmethod
    def encode(snapshot: dict) -> bytes:
        """A snapshot as the bytes of approvals.json."""
        return json.dumps(snapshot, separators=(",", ":")).encode()

    def restore(self, data: bytes, sessions: dict[str, str], now: float | None = None,
                wall: float | None = None) -> list[Pending]:
        """Open again what `encode(snapshot(...))` wrote: only for sessions that exist with
        the identity they had then (`sessions`: name -> identity), only what was asked for
        within `keep` (a clock set back since counts as just asked), within max_pending per
        session, each field checked as an agent's ask is. Raises ValueError naming what is
        wrong; nothing is restored then."""
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        if len(data) > MAX_DUMP:
            raise ValueError(f"larger than {MAX_DUMP} bytes")
        try:
            document = json.loads(data)
        except RecursionError:
            raise ValueError("nested too deeply to be an approvals file") from None
        if not isinstance(document, dict) or document.get("version") != DUMP_VERSION:
            raise ValueError(f"not a version {DUMP_VERSION} approvals file")
        items = document.get("approvals")
        if not isinstance(items, list):
            raise ValueError("'approvals' is not a list")
        staged = [self._from_json(item, f"approvals[{index}]", sessions, now, wall)
                  for index, item in enumerate(items)]
        kept = []
        for pending in staged:  # all checked: now taken in
            if (pending is None or pending.id in self.pending
                    or (pending.session, pending.kind, pending.target) in self._by_target
                    or self._open[pending.session] >= self.max_pending):
                continue
            self._add(pending)
            kept.append(pending)
        self.changes += 1
        return kept

    def _from_json(self, item, where: str, sessions: dict[str, str], now: float,
                   wall: float) -> Pending | None:
        """One approval of the file, checked (ValueError naming the field); None when its
        session is gone or another now, or its keep has passed."""
        if not isinstance(item, dict):
            raise ValueError(f"{where} is not a table")
        for key in ("id", "session", "kind", "target", "why", "origin", "note", "identity"):
            if not isinstance(item.get(key), str):
                raise ValueError(f"{where}.{key} is not a string")
        for key in ("created", "last", "asked"):
            value = item.get(key)
            if (not isinstance(value, int | float) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"{where}.{key} is not a finite number of 0 or more")
        kind = item["kind"]
        if item["origin"] not in ORIGINS:
            raise ValueError(f"{where}.origin {item['origin'][:20]!r} is not one of "
                             f"{', '.join(ORIGINS)}")
        if kind not in ASK_KINDS:
            raise ValueError(f"{where}.kind {kind!r} is not one of {', '.join(ASK_KINDS)}")
        if not _ID.fullmatch(item["id"]):
            raise ValueError(f"{where}.id {item['id'][:40]!r} is not an approval id")
        try:
            name, port = split_host_port(item["target"])
            parse_host(name)
            if port is not None and not (port.isascii() and port.isdigit()
                                         and 0 < int(port) < 65536):
                raise ValueError(f"port {port[:20]!r} is not a port number")
        except (HostNameError, ValueError) as exc:
            raise ValueError(f"{where}.target: {exc}") from None
        if kind == "tcp" and port is None:
            raise ValueError(f"{where}.target {item['target'][:80]!r}: a tcp target names its "
                             "port")
        if kind == "dns" and port is not None:
            raise ValueError(f"{where}.target {item['target'][:80]!r}: a dns target names no "
                             "port")
        age = max(0.0, wall - item["last"])  # a clock set back since: just asked
        if sessions.get(item["session"]) != item["identity"] or age >= self.keep:
            return None
        return Pending(item["id"], item["session"], kind, item["target"],
                       clean(item["why"], 2000), item["origin"], clean(item["note"]),
                       created=item["created"], last=now - age,
                       asked=max(1, min(int(item["asked"]), MAX_ASKED)))


async def held_for(future: asyncio.Future, approval_id: str, hold: float,
                   gone: Callable[[], bool] | None, keep: float) -> Ruling:
    """The verdict `future` brings within `hold` seconds, for a request waiting for it (in
    the filter, or in a worker: workers/holds.py). `gone`, asked every GONE_POLL seconds:
    its client has left, and nothing waits any more; asked again when a grant comes, so a
    client gone since is dialled nothing."""
    try:
        # asyncio.timeout, not wait_for: 3.11's wait_for may swallow a cancel
        async with asyncio.timeout(hold):
            while not future.done():
                # asyncio.wait never cancels the future it watches (other requests share it)
                await asyncio.wait([future], timeout=GONE_POLL if gone else None)
                if gone is not None and not future.done() and gone():
                    return Ruling(None, "the client left while it waited; the approval "
                                  f"{approval_id} stays open")
            verdict = future.result()
    except TimeoutError:
        return Ruling(None, f"no decision within {hold:g}s (ask mode); the approval "
                      f"{approval_id} stays open for {keep:.0f}s: a grant lets the next "
                      "attempt through")
    if verdict.grant is not None and gone is not None and gone():
        # its turn came after the grant: a client gone since is dialled nothing
        return Ruling(None, f"the client left before the grant ({approval_id}) reached it")
    return verdict


class Holds:
    """The requests waiting on approvals (a future per approval), and the approval events.

    `emit` publishes an event (kind `approval`): `pending` when an approval opens, then
    `approved`, `refused`, `settled` (the policy decided it: a rule allows it now, or a deny
    rule covers it), `expired` or `ended` (its session). Nothing here decides: the control
    socket does, and the policy (settle)."""

    def __init__(self, emit: Callable[[Event], object], book: Approvals | None = None):
        self.book = book or Approvals()
        self.emit = emit
        self._decided: dict[str, asyncio.Future[Ruling]] = {}
        self._held: dict[str, list[Callable[[], bool]]] = {}
        """Approval id -> how to ask each counted request held for it whether its client
        is still there (a grant `once` is for those alone)."""
        self.on_resolve: Callable[[Pending, Ruling], None] | None = None
        """Told every verdict given to an approval's requests: those held in a worker
        process wait there (workers/coordinator.py sends it on)."""

    def ask(self, session: str, decision: Decision, origin: str, client: str | None = None,
            name: str | None = None, port: int | None = None, note: str = ""
            ) -> Pending | None:
        """Open (or join) the approval for what `decision` denied; None: the session has
        too many open, deny at once."""
        self.expire(every=1.0)
        kind, target = grant_of(decision)
        pending, new = self.book.ask(session, kind, target, decision.reason, origin,
                                     note=clean(note))
        if new:
            said = f"; the agent says: {pending.note}" if pending.note else ""
            self._event(pending, "pending", f"waiting for a person: corral approve {pending.id}"
                        f" (allows {kind} {target}) or corral refuse {pending.id}{said}",
                        client=client, name=name, port=port, note=pending.note)
        return pending

    async def open(self, session: str, decision: Decision, origin: str,
                   client: str | None = None, name: str | None = None,
                   port: int | None = None, note: str = "") -> Pending | None:
        """`ask`, for a caller that can wait for it (in a worker, the book is the
        coordinator's: workers/holds.py)."""
        return self.ask(session, decision, origin, client, name, port, note)

    def waiting_elsewhere(self, approval_id: str, counted: bool,
                          there: Callable[[], bool]) -> bool:
        """A request held for the approval in a worker process: counted as `wait` counts
        its own, until `done_elsewhere`. False: the approval is closed already."""
        pending = self.book.pending.get(approval_id)
        if pending is None:
            return False
        pending.waiting += counted
        pending.held += 1
        if counted:
            self._held.setdefault(approval_id, []).append(there)
        return True

    def done_elsewhere(self, approval_id: str, counted: bool,
                       there: Callable[[], bool]) -> None:
        pending = self.book.pending.get(approval_id)
        if pending is not None:
            pending.waiting -= counted
            pending.held -= 1
        if counted:
            self._unhold(approval_id, there)

    def refused(self, session: str) -> str:
        """Why `ask` gave no approval (it returned None)."""
        return f"session {session} has {self.book.max_pending} approvals open already"

    async def wait(self, pending: Pending, hold: float, counted: bool = True,
                   gone: Callable[[], bool] | None = None) -> Ruling:
        """Hold the caller until the approval is decided, or for `hold` seconds. `counted`:
        a request that goes on if granted once (an agent only asking is not one). `gone`,
        asked every GONE_POLL seconds: the caller's client has left, so nothing waits any
        more (a person must not grant a request that no longer exists)."""
        future = self._decided.get(pending.id)
        if future is None:
            future = self._decided[pending.id] = asyncio.get_running_loop().create_future()
        there = (lambda: not gone()) if gone is not None else (lambda: True)
        if counted:
            self._held.setdefault(pending.id, []).append(there)
        pending.waiting += counted
        pending.held += 1
        try:
            return await held_for(future, pending.id, hold, gone, self.book.keep)
        finally:
            pending.waiting -= counted
            pending.held -= 1
            if counted:
                self._unhold(pending.id, there)

    def _unhold(self, approval_id: str, there: Callable[[], bool]) -> None:
        held = self._held.get(approval_id)
        if held is not None and there in held:
            held.remove(there)
            if not held:
                del self._held[approval_id]

    def present(self, approval_id: str) -> int:
        """The counted requests held for an approval whose client is still there, asked of
        each client now (the half-second look may not have seen one leave yet)."""
        return sum(there() for there in self._held.get(approval_id, ()))

    def check(self, approval_id: str, grant: str | None) -> Pending:
        """Approvals.check, and for `once`: a request whose client is still there waits."""
        pending = self.book.check(approval_id, grant)
        if grant == "once":
            self._someone_there(approval_id)
        return pending

    def _someone_there(self, approval_id: str) -> None:
        if not self.present(approval_id):
            raise ApprovalError(f"{approval_id}: the request(s) that waited for it left "
                                "before the grant, so nothing was let through; grant it for "
                                "a while (--for 10m) or for the session (--session) for the "
                                "agent's next attempt")

    def claim(self, approval_id: str, grant: str | None) -> Pending:
        """Approvals.claim, after check() (ApprovalError as it raises)."""
        self.check(approval_id, grant)
        return self.book.claim(approval_id, grant)

    def decide(self, approval_id: str, grant: str | None, by: str, note: str = "",
               detail: str = "", claimed: bool = False) -> int:
        """Close the approval and tell the requests held for it (a grant's rule must be in
        force already). Returns how many held requests a grant lets go on: those whose
        client is there now (each asks again when its turn comes). Raises ApprovalError as
        check() does (a `once` that finds every client gone too, claimed or not)."""
        if not claimed:
            self.check(approval_id, grant)
        elif grant == "once":
            self._someone_there(approval_id)
        pending = self.book.take(approval_id, grant, claimed)
        released = self.present(approval_id) if grant is not None else 0
        if grant is None:
            reason = f"refused by {by}" + (f": {clean(note)}" if note else "")
        else:
            reason = f"approved by {by}: {grant}{detail}" + (f" ({clean(note)})" if note
                                                              else "")
        self._resolve(pending, Ruling(grant, reason))
        self._event(pending, "approved" if grant else "refused", reason, grant=grant, by=by,
                    **({"released": released} if grant is not None else {}))
        return released

    def settle(self, judge: Callable[[Pending], tuple[bool | None, str]]) -> None:
        """The policy changed: each open approval is judged again. `judge` answers (True,
        why) when the policy allows its target now, (False, why) when no person may grant it
        any more (a deny rule covers it, its session ended), (None, why) when its waiting
        requests must stop waiting but it stays open (ask mode turned off), else (None, "")."""
        for pending in list(self.book.pending.values()):
            if pending.deciding:
                continue  # its decision is on its way
            try:
                verdict, why = judge(pending)
            except Exception:  # one approval's trouble must not keep the others waiting
                log.exception("approvals: judging %s again failed", pending.id)
                continue
            if verdict is None:
                if why:  # the approval stays; its requests get the denial now
                    self._resolve(pending, Ruling(None, why))
                continue
            self.book.drop(pending)
            self._resolve(pending, Ruling("policy" if verdict else None, why))
            self._event(pending, "settled", why)

    def expire(self, every: float = 0.0) -> None:
        """Drop the approvals nobody waits for or asked again for a while, each an event."""
        for stale in self.book.expire(every=every):
            self._resolve(stale, Ruling(None, "expired"))
            self._event(stale, "expired", f"no decision within {self.book.keep:.0f}s of the "
                        "last request for it")

    def forget(self, session: str) -> None:
        for pending in self.book.forget(session):
            self._resolve(pending, Ruling(None, f"session {session} ended"))
            self._event(pending, "ended", f"session {session} ended")

    def _resolve(self, pending: Pending, verdict: Ruling) -> None:
        """Tell the requests waiting for `pending` (if any) the verdict."""
        future = self._decided.pop(pending.id, None)
        if future is not None and not future.done():
            future.set_result(verdict)
        if self.on_resolve is not None:
            self.on_resolve(pending, verdict)

    def _event(self, pending: Pending, action: str, reason: str, client: str | None = None,
               name: str | None = None, port: int | None = None, **extra) -> None:
        self.emit(Event(session=pending.session, client=client, kind="approval",
                        name=name, port=port, address=None,
                        verdict="pending" if action == "pending" else "change",
                        action=action, approval=pending.id, grant_kind=pending.kind,
                        target=pending.target, rule=None, layer=None,
                        reason=reason, **extra))
