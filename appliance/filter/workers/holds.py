"""Ask mode in a worker: the book is the coordinator's, the waiting is the worker's.

An approval is one thing whichever process asked for it: the coordinator's `Holds` opens it
(its id, the session's bound, its events, approvals.json), lists it, lets a person decide
it, settles, expires and ends it. A request held for it waits in the worker that serves its
session (`RemoteHolds.wait`), which tells the coordinator when it starts and stops waiting
(a grant `once` is for requests still waiting) and is told each verdict (`ruling`).

A verdict can reach the worker before the request that asked starts waiting (the person was
quick): it is kept for that approval (`_ruled`) and taken by the next wait.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Callable

from appliance.policy import Decision

from ..approvals import KEEP, MAX_PENDING, Pending, Ruling, held_for
from .link import Link, LinkError

ASK_TIMEOUT = 10.0
"""Seconds a worker waits for the coordinator to open an approval: past it, denied."""
RULED_KEPT = 1024
"""Verdicts kept for approvals no request waited for yet."""


class RemoteBook:
    """What the proxy reads of the book: its bound, and which approvals this worker knows
    to be open (an agent asking with `wait` is told "pending" for one still open)."""

    def __init__(self):
        self.max_pending, self.keep = MAX_PENDING, KEEP
        self.pending: dict[str, Pending] = {}


class RemoteHolds:
    def __init__(self, link: Link):
        self.link = link
        self.book = RemoteBook()
        self._decided: dict[str, asyncio.Future[Ruling]] = {}
        self._ruled: OrderedDict[str, Ruling] = OrderedDict()
        self._tokens = itertools.count(1)
        self._settled: list[tuple[str, str | None, str, bool]] = []
        """Verdicts "policy" waiting for the change that gave them (`changed`)."""

    @staticmethod
    def _asked(session: str, decision: Decision, origin: str, client, name, port,
               note: str) -> dict:
        return {"op": "ask", "session": session, "reason": decision.reason,
                "hint": decision.hint, "origin": origin, "client": client, "name": name,
                "port": port, "note": note}

    def ask(self, session: str, decision: Decision, origin: str, client: str | None = None,
            name: str | None = None, port: int | None = None, note: str = "") -> None:
        """Open the approval and wait for nothing (the DNS filter: it answers NXDOMAIN)."""
        if not self.link.closed.done():
            self.link.send(self._asked(session, decision, origin, client, name, port, note))

    async def open(self, session: str, decision: Decision, origin: str,
                   client: str | None = None, name: str | None = None,
                   port: int | None = None, note: str = "") -> Pending | None:
        """The approval as the coordinator opened (or joined) it; None when the session
        has too many open, or the coordinator could not be asked (denied either way)."""
        try:
            reply = await self.link.call(
                self._asked(session, decision, origin, client, name, port, note),
                seconds=ASK_TIMEOUT)
        except (ConnectionError, LinkError, TimeoutError):
            return None
        opened = reply.get("pending")
        if opened is None:
            return None
        pending = Pending(opened["id"], opened["session"], opened["kind"], opened["target"],
                          opened["why"], opened["origin"], opened["note"])
        self.book.pending[pending.id] = pending
        return pending

    def refused(self, session: str) -> str:
        return (f"session {session} has {self.book.max_pending} approvals open already, or "
                "the filter could not open one")

    async def wait(self, pending: Pending, hold: float, counted: bool = True,
                   gone: Callable[[], bool] | None = None) -> Ruling:
        """As Holds.wait, the verdict coming from the coordinator."""
        ruled = self._ruled.pop(pending.id, None)
        if ruled is not None:  # decided before this request waited (a quick person)
            if ruled.grant is not None and gone is not None and gone():
                return Ruling(None, f"the client left before the grant ({pending.id}) "
                              "reached it")
            return ruled
        future = self._decided.get(pending.id)
        if future is None:
            future = self._decided[pending.id] = asyncio.get_running_loop().create_future()
        token = next(self._tokens)
        self._tell(pending.id, token, counted, 1)
        try:
            return await held_for(future, pending.id, hold, gone, self.book.keep)
        finally:
            self._tell(pending.id, token, counted, -1)

    def _tell(self, approval_id: str, token: int, counted: bool, delta: int) -> None:
        if not self.link.closed.done():
            self.link.send({"op": "waiting", "approval": approval_id, "token": token,
                            "counted": counted, "delta": delta})

    def ruling(self, approval_id: str, grant: str | None, reason: str, still_open: bool
               ) -> None:
        """The coordinator's verdict for an approval: to the requests waiting for it here,
        or kept for the next one that waits. A "policy" one (a change allows it now) is
        given while that change commits in the coordinator, and so sent before the change
        itself: told now, the request would be judged again by the policy before it and
        refused. It waits for the next change committed here (`changed`)."""
        if grant == "policy":
            self._settled.append((approval_id, grant, reason, still_open))
            return
        self._rule(approval_id, grant, reason, still_open)

    def changed(self) -> None:
        """A store listener: the change the "policy" verdicts came with is in force here."""
        settled, self._settled = self._settled, []
        for approval_id, grant, reason, still_open in settled:
            self._rule(approval_id, grant, reason, still_open)

    def _rule(self, approval_id: str, grant: str | None, reason: str, still_open: bool
              ) -> None:
        verdict = Ruling(grant, reason)
        if not still_open:
            self.book.pending.pop(approval_id, None)
        future = self._decided.pop(approval_id, None)
        if future is not None and not future.done():
            future.set_result(verdict)
        elif not still_open:  # closed before its request waited (a quick person)
            self._ruled[approval_id] = verdict
            while len(self._ruled) > RULED_KEPT:
                self._ruled.popitem(last=False)
