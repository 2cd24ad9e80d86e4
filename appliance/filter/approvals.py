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
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from appliance.policy import Decision

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
MAX_NOTE = 300
"""Characters of a reason or a refusal's note kept (untrusted text, shown escaped)."""


def approvable(decision: Decision) -> bool:
    """Denied by the default alone: no deny rule, no placeholder, no host port, and a
    command that would allow it (`corral allow-http|dns|tcp TARGET`)."""
    return (not decision.allowed and decision.rule is None
            and decision.hint.startswith(("corral allow-http ", "corral allow-dns ",
                                          "corral allow-tcp ")))


def grant_of(decision: Decision) -> tuple[str, str]:
    """(rule kind, rule text) the decision's hint would add: what a grant adds."""
    _, command, target = decision.hint.split(" ", 2)
    return command.removeprefix("allow-"), target


def clean(text: str) -> str:
    """Untrusted text as it is kept and shown: printable ASCII (no terminal escapes, nothing
    a header cannot carry), one line, bounded."""
    kept = "".join(c if c.isprintable() and c.isascii() else "?" for c in text)
    return kept[:MAX_NOTE]


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
    """Who asked: proxy (a held request), dns (a query answered NXDOMAIN)."""
    created: float = field(default_factory=time.time)
    last: float = field(default_factory=time.monotonic)
    asked: int = 1
    waiting: int = 0
    """Requests held for it right now (the edge counts them)."""

    def to_json(self) -> dict:
        return {"id": self.id, "session": self.session, "kind": self.kind,
                "target": self.target, "why": self.why, "origin": self.origin,
                "created": round(self.created, 3), "asked": self.asked,
                "waiting": self.waiting}


@dataclass(frozen=True)
class Verdict:
    """What a held request learns: a grant (and whether it needs a rule to pass) or not."""

    grant: str | None
    """One of GRANTS, or None: refused or no decision in time."""
    reason: str
    by: str | None = None


class ApprovalError(ValueError):
    """A decision that cannot be taken (unknown approval, grant, duration): says why."""


class Approvals:
    def __init__(self, max_pending: int = MAX_PENDING, keep: float = KEEP):
        self.max_pending, self.keep = max_pending, keep
        self.pending: dict[str, Pending] = {}
        self._by_target: dict[tuple[str, str, str], str] = {}

    def ask(self, session: str, kind: str, target: str, why: str, origin: str,
            now: float | None = None) -> tuple[Pending | None, bool]:
        """The approval for (session, kind, target), made if new: (pending, new). (None,
        False) when the session already has max_pending others: deny at once."""
        now = time.monotonic() if now is None else now
        self.expire(now)
        found = self._by_target.get((session, kind, target))
        if found is not None:
            pending = self.pending[found]
            pending.asked += 1
            pending.last = now
            return pending, False
        if sum(1 for p in self.pending.values() if p.session == session) >= self.max_pending:
            return None, False
        pending = Pending(f"ap-{secrets.token_hex(4)}", session, kind, target, why, origin,
                          last=now)
        while pending.id in self.pending:  # 32 bits: a clash is rare, never a merge
            pending.id = f"ap-{secrets.token_hex(4)}"
        self.pending[pending.id] = pending
        self._by_target[(session, kind, target)] = pending.id
        return pending, True

    def take(self, approval_id: str, grant: str | None) -> Pending:
        """Remove the approval a person decided (grant None: refused); raises ApprovalError
        as check() does."""
        pending = self.check(approval_id, grant)
        self._drop(pending)
        return pending

    def check(self, approval_id: str, grant: str | None) -> Pending:
        """The approval, if this decision can be taken: ApprovalError for an unknown id or
        grant, and for `once` when no request is waiting for it."""
        pending = self.pending.get(approval_id)
        if pending is None:
            raise ApprovalError(f"no pending approval {approval_id!r} (decided already, or "
                                "expired: `corral approvals` lists the open ones)")
        if grant is not None and grant not in GRANTS:
            raise ApprovalError(f"grant {grant!r}: expected one of {', '.join(GRANTS)}")
        if grant == "once" and not pending.waiting:
            raise ApprovalError(f"{approval_id}: no request is waiting for it, so there is "
                                "nothing to let through once; grant it for a while or for "
                                "the session")
        return pending

    def expire(self, now: float | None = None) -> list[Pending]:
        """Approvals nobody waits for and nobody asked again for `keep` seconds: dropped."""
        now = time.monotonic() if now is None else now
        stale = [p for p in self.pending.values()
                 if not p.waiting and now - p.last >= self.keep]
        for pending in stale:
            self._drop(pending)
        return stale

    def forget(self, session: str) -> list[Pending]:
        """A session that ended: its approvals go with it."""
        gone = [p for p in self.pending.values() if p.session == session]
        for pending in gone:
            self._drop(pending)
        return gone

    def listing(self, session: str | None = None) -> list[dict]:
        return [p.to_json() for p in sorted(self.pending.values(), key=lambda p: p.created)
                if session is None or p.session == session]

    def _drop(self, pending: Pending) -> None:
        self.pending.pop(pending.id, None)
        self._by_target.pop((pending.session, pending.kind, pending.target), None)


class Holds:
    """The requests waiting on approvals (a future per approval), and the approval events.

    `emit` publishes an event (kind `approval`): `pending` when an approval opens, then
    `approved`, `refused` or `expired`. Nothing here decides: the control socket does."""

    def __init__(self, emit: Callable[[dict], None], book: Approvals | None = None):
        self.book = book or Approvals()
        self.emit = emit
        self._decided: dict[str, asyncio.Future[Verdict]] = {}

    def ask(self, session: str, decision: Decision, origin: str, client: str | None = None,
            name: str | None = None, port: int | None = None) -> Pending | None:
        """Open (or join) the approval for what `decision` denied; None: the session has
        too many open, deny at once."""
        self.expire()
        kind, target = grant_of(decision)
        pending, new = self.book.ask(session, kind, target, decision.reason, origin)
        if new:
            self._event(pending, "pending", f"waiting for a person: corral approve {pending.id}"
                        f" (allows {kind} {target}) or corral refuse {pending.id}",
                        client=client, name=name, port=port)
        return pending

    async def wait(self, pending: Pending, hold: float) -> Verdict:
        """Hold the caller until the approval is decided, or for `hold` seconds."""
        future = self._decided.get(pending.id)
        if future is None:
            future = self._decided[pending.id] = asyncio.get_running_loop().create_future()
        pending.waiting += 1
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for may swallow a cancel
            async with asyncio.timeout(hold):
                return await asyncio.shield(future)
        except TimeoutError:
            return Verdict(None, f"no decision within {hold:g}s (ask mode); the approval "
                           f"{pending.id} stays open for {self.book.keep:.0f}s: a grant lets "
                           "the next attempt through")
        finally:
            pending.waiting -= 1
            if not pending.waiting and (future.done() or pending.id not in self.book.pending):
                self._decided.pop(pending.id, None)

    def decide(self, approval_id: str, grant: str | None, by: str, note: str = "",
               detail: str = "") -> Pending:
        """Close the approval and tell the requests held for it (a grant's rule must be in
        force already). Raises ApprovalError as Approvals.check does."""
        pending = self.book.take(approval_id, grant)
        if grant is None:
            reason = f"refused by {by}" + (f": {clean(note)}" if note else "")
        else:
            reason = f"approved by {by}: {grant}{detail}"
        future = self._decided.pop(pending.id, None)
        if future is not None and not future.done():
            future.set_result(Verdict(grant, reason, by))
        self._event(pending, "approved" if grant else "refused", reason, grant=grant, by=by)
        return pending

    def expire(self) -> None:
        """Drop the approvals nobody waits for or asked again for a while, each an event."""
        for stale in self.book.expire():
            self._event(stale, "expired", f"no decision within {self.book.keep:.0f}s of the "
                        "last request for it")

    def forget(self, session: str) -> None:
        for pending in self.book.forget(session):
            future = self._decided.pop(pending.id, None)
            if future is not None and not future.done():
                future.set_result(Verdict(None, f"session {session} ended"))

    def _event(self, pending: Pending, action: str, reason: str, client: str | None = None,
               name: str | None = None, port: int | None = None, **extra) -> None:
        self.emit({"session": pending.session, "client": client, "kind": "approval",
                   "name": name, "port": port, "address": None,
                   "verdict": "pending" if action == "pending" else "change",
                   "action": action, "approval": pending.id, "grant_kind": pending.kind,
                   "target": pending.target, "rule": None, "layer": None,
                   "reason": reason, **extra})
