"""What the workers tell the coordinator, each message checked as if its worker were
hostile (a worker parses what agents send): events of its own sessions' flows into the one
bus and audit chain, teachings for the one learned set, inspected names' addresses heard,
approvals asked for and requests waiting for them. A message that is not what it says is
refused (LinkError: the link closes, the worker is started again) or dropped, never taken
as it comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict

from appliance.event import Event, check
from appliance.firewall.learned import LearnedSet, Teaching
from appliance.policy import Decision, Host
from appliance.policy.grants import grant_of
from appliance.policy.names import HostNameError, split_host_port
from appliance.policystore import PolicyStore

from ..approvals import Holds, approvable, decide_kind
from ..events import EventBus
from ..proxy.frontends import Frontends
from . import replica
from .link import LinkError
from .process import ID_BITS, WorkerProcess

log = logging.getLogger("corral.filter")

WORKER_KINDS = frozenset({"dns", "http", "connect", "tls", "git", "leak", "secret"})
"""The kinds of event a worker emits: its sessions' flows and what was found in them."""


def _denied_by_default(policy, decision: Decision) -> bool:
    """Would the coordinator's policy deny what the grant names by its default alone (no
    deny rule, no placeholder)? A worker's decision says so, but is not taken at its word."""
    kind, target = grant_of(decision)
    try:
        name, port = split_host_port(target)
        mine = decide_kind(policy, kind, Host(name=name), int(port) if port else None)
    except (HostNameError, ValueError):
        return False
    return approvable(mine)


def _there() -> bool:
    """A request waiting in a worker is there until the worker says it stopped (it looks
    for its client every half second, and again before a grant lets it go)."""
    return True


def _teaching(item) -> Teaching:
    """A teaching as a worker wrote it, every field checked (the coordinator judges it
    again, but does not trust its types)."""
    fields = {"session": str, "name": str, "sandbox": str, "destination": str, "port": int,
              "timeout": int}
    if not isinstance(item, dict) or set(item) != set(fields) or not all(
            type(item[k]) is kind for k, kind in fields.items()):
        raise LinkError(f"not a teaching: {item!r:.200}")
    if not 0 < item["port"] < 65536 or not 0 < item["timeout"] <= 1 << 31:
        raise LinkError(f"a teaching's port or timeout out of range: {item!r:.200}")
    try:
        for key in ("sandbox", "destination"):
            ipaddress.ip_address(item[key])
    except ValueError as exc:
        raise LinkError(f"a teaching's address: {exc}") from None
    return Teaching(**item)


STATUS = {"sessions": list, "active_connections": int, "proxy": dict,
          "secrets": int, "dns": dict, "resolver": dict}
"""What a worker's `status` answer may add to what the coordinator knows of it (its pid is
the coordinator's to say: a person kills the process `status` names)."""


class Inbox:
    def __init__(self, store: PolicyStore, bus: EventBus, learned: LearnedSet | None,
                 holds: Holds, frontends: Frontends, shards: replica.Shards,
                 workers: list[WorkerProcess]):
        """`holds`: the approvals' book, whose verdicts go to the worker of their session
        (`ruling`); `frontends`: the coordinator's book of inspected hosts' addresses;
        `shards`: which worker serves which session; `workers`: where heard addresses and
        verdicts are sent."""
        self.store, self.bus, self.learned, self.holds = store, bus, learned, holds
        self.frontends, self.shards, self.workers = frontends, shards, workers
        holds.on_resolve = self.ruling
        self._waits: dict[tuple[int, int], tuple[str, bool, Callable[[], bool]]] = {}
        """(worker, its token) -> a request waiting there: (approval, counted, `there`)."""
        self._held_in: Counter[int] = Counter()
        """Worker index -> how many of `_waits` are its."""

    def handle(self, worker: WorkerProcess, message: dict, fds: list[int], block: int):
        """One message from a worker's process, the one started with ids in `block`."""
        for fd in fds:  # a worker never sends descriptors
            os.close(fd)
        op = message["op"]
        if op == "event":
            try:
                raw = message["event"]
                if not isinstance(raw, dict):
                    raise TypeError("not an object")
                event = Event(raw)
                check(event)  # emit checks only the type of what it is handed
                self._own(worker, event, block)
                self.bus.emit(event)
            except (TypeError, KeyError, ValueError) as exc:
                log.error("worker %d sent an event that is not one (%s): dropped",
                          worker.index, exc)
            return None
        if op == "learn":
            return self._learn(worker, message.get("teachings"))
        if op == "heard":
            self._heard(worker, message)
            return None
        if op == "ask":
            return self._ask(worker, message)
        if op == "waiting":
            self._waiting(worker, message)
            return None
        raise LinkError(f"unknown op {op!r}")

    def _own(self, worker: WorkerProcess, event: Event, block: int) -> None:
        """A worker reports its own sessions' flows (or a client's outside every session),
        nothing else: another worker's session would spend that session's audit budget and
        write its history, and a rule, an approval, a session or the log's own records are
        the coordinator's (recorded whatever the budget, read as a person's decisions).
        ValueError (the event is dropped) for anything else, or a field of the wrong type."""
        session = event.get("session")
        if session is not None and (type(session) is not str
                                    or self.shards.of.get(session) != worker.index):
            raise ValueError(f"an event for session {session!r:.80}, not the worker's")
        if event["kind"] not in WORKER_KINDS:
            raise ValueError(f"an event of kind {event['kind']!r:.40}")
        for key in ("kind", "verdict", "reason", "client", "name", "address", "rule",
                    "layer", "hint"):
            if event.get(key) is not None and type(event[key]) is not str:
                raise ValueError(f"an event whose {key} is not text")
        for key, kinds in (("id", (int,)), ("port", (int,)), ("ts", (int, float))):
            if event.get(key) is not None and type(event[key]) not in kinds:
                raise ValueError(f"an event whose {key} is not a number")
        if "id" in event and event["id"] >> ID_BITS != block:
            # ids are unique since the filter started: each worker process has its block
            raise ValueError(f"an event id {event['id']} outside worker {worker.index}'s")

    def _ask(self, worker: WorkerProcess, message: dict) -> dict:
        """A worker's request to open (or join) an approval. The coordinator judges what it
        may be: a session of that worker's, and something a person can approve under the
        coordinator's own policy (approvable: never an IP literal, a deny rule's, the
        appliance's own). Any approval mode: an agent may always ask (request.corral); the
        worker holds requests in ask mode alone, as the proxy does in one process."""
        fields = {"session": str, "reason": str, "hint": str, "origin": str, "note": str}
        if not all(isinstance(message.get(k), kind) for k, kind in fields.items()) or not all(
                message.get(k) is None or isinstance(message.get(k), kind)
                for k, kind in (("client", str), ("name", str), ("port", int))):
            raise LinkError(f"worker {worker.index} sent an ask that is not one")
        session = message["session"]
        current = self.store.sessions.get(session)
        decision = Decision(False, message["reason"][:2000], None, message["hint"][:600])
        if self.shards.of.get(session) != worker.index or current is None \
                or not approvable(decision) \
                or message["origin"] not in ("proxy", "dns", "agent") \
                or not _denied_by_default(current.policy, decision):
            return {"pending": None}
        pending = self.holds.ask(session, decision, message["origin"], message.get("client"),
                                 message.get("name"), message.get("port"), message["note"])
        return {"pending": None if pending is None else pending.to_json()}

    def _waiting(self, worker: WorkerProcess, message: dict) -> None:
        approval, token, counted, delta = (message.get("approval"), message.get("token"),
                                           message.get("counted"), message.get("delta"))
        if not isinstance(approval, str) or type(token) is not int or \
                type(counted) is not bool or delta not in (1, -1):
            raise LinkError(f"worker {worker.index} sent a wait that is not one")
        key = (worker.index, token)
        if delta == 1 and key not in self._waits:
            # each wait is a connection held open there: no more than it may hold
            if self._held_in[worker.index] >= self.store.config.proxy.max_connections:
                raise LinkError(f"worker {worker.index} says more requests wait than it "
                                "may hold connections")
            there = _there
            if self.holds.waiting_elsewhere(approval, counted, there):
                self._waits[key] = (approval, counted, there)
                self._held_in[worker.index] += 1
        elif delta == -1 and key in self._waits:
            approval, counted, there = self._waits.pop(key)
            self._held_in[worker.index] -= 1
            self.holds.done_elsewhere(approval, counted, there)

    def forget_waits(self, worker: WorkerProcess) -> None:
        """A worker that died: nothing waits there any more."""
        self._held_in[worker.index] = 0
        for key in [k for k in self._waits if k[0] == worker.index]:
            approval, counted, there = self._waits.pop(key)
            self.holds.done_elsewhere(approval, counted, there)

    def ruling(self, pending, verdict) -> None:
        """A verdict for an approval: to the worker of its session, where its requests
        wait (or the next will)."""
        index = self.shards.of.get(pending.session)
        if index is None:
            return  # its session went: its worker closed its connections
        worker = self.workers[index]
        if worker.link is not None and not worker.link.closed.done():
            worker.link.send({"op": "ruling", "approval": pending.id, "grant": verdict.grant,
                              "reason": verdict.reason,
                              "open": pending.id in self.holds.book.pending})

    def _heard(self, worker: WorkerProcess, message: dict) -> None:
        """An inspected name's addresses, as a worker's resolver fetched them: into the
        coordinator's book (revocation judges learned elements by it) and every other
        worker's (their neighbours' tunnels are judged by theirs). A worker can only make
        more addresses count as an inspected host's: more is refused, never less."""
        name, addresses, ttl = message.get("name"), message.get("addresses"), message.get("ttl")
        if not isinstance(name, str) or len(name) > 253 or not isinstance(addresses, list) \
                or not 0 < len(addresses) <= 64 or type(ttl) is not int or not 0 <= ttl < 1 << 31:
            raise LinkError(f"worker {worker.index} sent a heard answer that is not one")
        try:
            heard = replica.Heard([ipaddress.ip_address(a) for a in addresses], ttl)
        except (ValueError, TypeError) as exc:
            raise LinkError(f"a heard answer's address: {exc}") from None
        self.frontends.heard(name, heard)
        relayed = {"op": "heard", "name": name, "addresses": addresses, "ttl": ttl}
        for other in self.workers:
            if other is not worker and other.ready and other.link is not None \
                    and not other.link.closed.done():
                other.link.send(relayed)

    async def _learn(self, worker: WorkerProcess, teachings) -> dict:
        if self.learned is None:
            return {"taught": [], "refused": "the filter has no firewall to teach"}
        if not isinstance(teachings, list):
            raise LinkError("teachings must be a list")
        asked = [_teaching(t) for t in teachings]
        foreign = [t for t in asked if self.shards.of.get(t.session) != worker.index]
        if foreign:
            raise LinkError(f"worker {worker.index} taught for session "
                            f"{foreign[0].session!r}, which it does not serve")
        learned = await asyncio.get_running_loop().run_in_executor(
            None, self.learned.learn, asked)
        return {"taught": [asdict(t) for t in learned.taught], "refused": learned.refused}

    # -- what they answer when asked (status, sessions) --------------------------------
    async def held(self) -> dict[str, int]:
        """Open connections per session, in every worker."""
        found: dict[str, int] = {}
        replies = await asyncio.gather(*(w.ask({"op": "held"}) for w in self.workers))
        for worker, reply in zip(self.workers, replies, strict=True):
            held = (reply or {}).get("held")
            if not isinstance(held, dict):
                continue
            for session, count in held.items():  # its own sessions', counted
                if type(count) is int and count >= 0 and \
                        self.shards.of.get(session) == worker.index:
                    found[session] = found.get(session, 0) + count
        return found

    async def describe(self) -> list[dict]:
        """Each worker as `status` shows it."""
        async def one(worker: WorkerProcess) -> dict:
            seen = {"index": worker.index, "up": worker.ready, "restarts": worker.restarts}
            if worker.process is not None and worker.process.returncode is None:
                seen["pid"] = worker.process.pid
            if worker.ready and worker.link is not None:
                with contextlib.suppress(ConnectionError, LinkError, TimeoutError):
                    reply = await worker.link.call({"op": "status"}, seconds=5.0)
                    # what it says of itself, each of the type status shows: never which
                    # worker it is, nor a count `status` could not add up
                    seen.update({k: v for k, v in reply.items()
                                 if k in STATUS and type(v) is STATUS[k]})
                    seen["sessions"] = [s for s in seen.get("sessions", ())
                                        if type(s) is str and self.shards.of.get(s) == worker.index]
            return seen
        return list(await asyncio.gather(*(one(w) for w in self.workers)))
