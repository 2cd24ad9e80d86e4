"""The coordinator's side of the workers: it starts them, tells them every change, hands
them their gateways' sockets, hears their events and teachings, and starts again one that
died.

Invariants it keeps, across processes:
- **One audit chain, one bus.** A worker's events are emitted again on the coordinator's
  bus (checked against the schema, made printable and redacted once more: both are
  idempotent), which alone writes the audit log and tells `monitor`.
- **A change is in every worker before the call that made it returns.** `follow` sends
  each worker its part of the change and waits for it to be committed there; a worker that
  does not answer within CHANGE_TIMEOUT is killed, and the one started after it is given the
  whole state. Changes reach a worker in the order they were made, over one link.
- **A dead worker's sessions fail closed.** Their listening sockets stay open here; their
  connections wait in the kernel's queues, unanswered, until the next worker (started
  after RESTART_DELAY, then longer while it keeps dying) takes the sockets again.
- **One learned set.** A worker's teachings are taught here, judged again by the
  coordinator's own Reach, and only for a session of that worker's shard.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import sys
import time
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
from .link import PICKLE, Link, LinkError

log = logging.getLogger("corral.filter")

CHANGE_TIMEOUT = 60.0
"""Seconds a worker may take to commit a change (compiling a session's 100k rules takes
about 0.6 s) before it is killed and started again with the whole state."""
START_TIMEOUT = 60.0
RESTART_DELAY = 0.2
"""Seconds before a dead worker is started again; doubled while it keeps dying, up to
RESTART_DELAY_MAX."""
RESTART_DELAY_MAX = 10.0
STEADY = 30.0
"""Seconds a worker must have lived for the next restart to come after RESTART_DELAY."""
STOP_TIMEOUT = 5.0
STATUS = {"pid": int, "sessions": list, "active_connections": int, "proxy": dict,
          "secrets": int, "dns": dict, "resolver": dict}
"""What a worker's `status` answer may add to what the coordinator knows of it."""
BEAT = 1.0
"""Seconds between two beats to each worker (worker.py STALE: how many it may miss)."""
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


class WorkerProcess:
    """One worker process as the coordinator sees it."""

    def __init__(self, index: int):
        self.index = index
        self.process: asyncio.subprocess.Process | None = None
        self.link: Link | None = None
        self.ready = False
        """Started with the whole state and serving its gateways: changes go to it."""
        self.turn = asyncio.Lock()
        """Held while it starts, and while a change, the secrets, a new CA or a gateway is
        sent and acknowledged: each reaches it after its start, never lost in between.
        (Questions, verdicts and heard addresses are sent as they come.)"""
        self.restarts = 0
        self.started = 0
        """How many processes have been started for this index (they tell event ids apart)."""

    def kill(self) -> None:
        self.ready = False  # (its waiting requests are forgotten by Workers._keep)
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        if self.link is not None:
            self.link.close()


class Workers:
    def __init__(self, count: int, store: PolicyStore, bus: EventBus,
                 learned: LearnedSet | None, secrets, frontends: Frontends, holds: Holds, *,
                 event_loop: str = "auto", log_level: str = "info"):
        """`secrets`: the secret store (its key and http secrets go to each worker);
        `frontends`: the coordinator's book of where inspected hosts live, told what each
        worker hears (and the other workers with it); `holds`: the approvals (ask mode),
        whose requests wait in the workers (workers/holds.py)."""
        self.count, self.store, self.bus, self.learned = count, store, bus, learned
        self.secrets, self.frontends, self.holds = secrets, frontends, holds
        holds.on_resolve = self._ruling
        self._waits: dict[tuple[int, int], tuple[str, bool, Callable[[], bool]]] = {}
        """(worker, its token) -> a request waiting there: (approval, counted, `there`)."""
        self._held_in: Counter[int] = Counter()
        """Worker index -> how many of `_waits` are its."""
        self.event_loop, self.log_level = event_loop, log_level
        self.workers = [WorkerProcess(i) for i in range(count)]
        self.shards = replica.Shards(count)
        self.gateways: dict[str, tuple[int, list[str], list[socket.socket]]] = {}
        """Gateway address -> (its worker, its listeners' keys, their sockets, kept open
        here while a worker serves them)."""
        self._keepers: list[asyncio.Task] = []
        self._closing: set[asyncio.Task] = set()
        self._stopping = False

    def shard(self, session: str) -> int | None:
        """The worker that serves `session` (None: no such session)."""
        return self.shards.of.get(session)

    # -- starting and keeping them running ----------------------------------------------
    async def start(self) -> None:
        """Every worker started and given the state; raises if one cannot be."""
        self.shards.assign(self.store.sessions)
        # beating from the first start on: the first worker must not go unheard while the
        # others start (each takes its time: imports, compiling its sessions' rules)
        beat = asyncio.get_running_loop().create_task(self._beat(), name="corral-worker-beat")
        try:
            for worker in self.workers:
                await self._spawn(worker)
        except BaseException:
            beat.cancel()
            raise
        self._keepers = [beat, *(asyncio.get_running_loop().create_task(
            self._keep(worker), name=f"corral-worker-{worker.index}")
            for worker in self.workers)]

    async def _beat(self) -> None:
        """Tell every worker, every BEAT seconds, that this loop runs: a worker that stops
        hearing it stops serving (worker.py `watch`). A coordinator that is stopped or stuck
        can neither record what the workers decide nor make a change reach them."""
        while not self._stopping:
            for worker in self.workers:
                if worker.link is not None and not worker.link.closed.done():
                    worker.link.send({"op": "beat"})
            await asyncio.sleep(BEAT)

    async def _spawn(self, worker: WorkerProcess) -> None:
        async with worker.turn:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            worker.started += 1
            # event ids apart from the coordinator's and each other's: the worker's index in
            # the top bits, how many times it started below (repeating after 256 restarts)
            first_id = ((worker.index + 1) << 48) | ((worker.started & 0xFF) << 40)
            try:  # (a worker that cannot be started leaves no descriptor behind)
                worker.process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "appliance.filter.workers",
                    "--link-fd", str(theirs.fileno()), "--index", str(worker.index),
                    "--first-id", str(first_id), "--event-loop", self.event_loop,
                    "--log-level", self.log_level, pass_fds=(theirs.fileno(),),
                    stdin=asyncio.subprocess.DEVNULL)
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            worker.link = Link(ours, sends=PICKLE, handle=lambda m, f, w=worker:
                               self.handle(w, m, f))
            try:
                reply = await worker.link.call(
                    {"op": "start", "config": self.store.config, "count": self.count,
                     "state": replica.state_for(None, self.store,
                                             self.shards.serves(worker.index)),
                     "key": self.secrets.key, "http": self.secrets.http()},
                    seconds=START_TIMEOUT)
                for address, (index, keys, socks) in list(self.gateways.items()):
                    if index == worker.index:
                        await self._serve(worker, address, keys, socks)
            except BaseException:
                worker.kill()
                raise
            worker.ready = True
            log.info("worker %d serving (pid %s)", worker.index, reply.get("pid"))

    async def _keep(self, worker: WorkerProcess) -> None:
        """Start `worker` again whenever it dies, until the filter stops. One that dies
        within STEADY seconds of its start waits twice as long as the last time first (a
        worker that cannot live is not started five times a second)."""
        delay = RESTART_DELAY
        while not self._stopping:
            started = time.monotonic()
            assert worker.link is not None and worker.process is not None
            await asyncio.wait([asyncio.ensure_future(worker.link.closed),
                                asyncio.ensure_future(worker.process.wait())],
                               return_when=asyncio.FIRST_COMPLETED)
            worker.kill()
            code = await worker.process.wait()
            self._forget_waits(worker)
            if self._stopping:
                return
            worker.restarts += 1
            if time.monotonic() - started > STEADY:
                delay = RESTART_DELAY
            log.error("worker %d (pid %d) ended (%s): its sessions are not served until it "
                      "is started again", worker.index, worker.process.pid, code)
            while not self._stopping:
                await asyncio.sleep(delay)
                delay = min(delay * 2, RESTART_DELAY_MAX)
                try:
                    await self._spawn(worker)
                    break
                except Exception as exc:
                    log.error("worker %d could not be started again: %s", worker.index, exc)
            else:
                return

    async def stop(self) -> None:
        self._stopping = True
        for task in self._keepers:
            task.cancel()
        async def stopped(worker: WorkerProcess) -> None:
            if worker.link is not None and not worker.link.closed.done():
                with contextlib.suppress(ConnectionError, LinkError, TimeoutError):
                    await worker.link.call({"op": "stop"}, seconds=STOP_TIMEOUT)
        await asyncio.gather(*(stopped(w) for w in self.workers))
        await asyncio.gather(*(self._ended(w) for w in self.workers))
        for _, _, socks in self.gateways.values():
            for sock in socks:
                sock.close()
        self.gateways.clear()

    async def _ended(self, worker: WorkerProcess) -> None:
        if worker.process is not None and worker.process.returncode is None:
            try:
                async with asyncio.timeout(STOP_TIMEOUT):
                    await worker.process.wait()
            except TimeoutError:
                worker.kill()
                await worker.process.wait()
        if worker.link is not None:
            worker.link.close()

    # -- what the coordinator tells them ------------------------------------------------
    async def follow(self, before, after) -> None:
        """`after` committed: every worker has its part before this returns (or is killed,
        and its next process starts from the whole state)."""
        self.shards.assign(after.sessions)
        await asyncio.gather(*(self._follow(w, before, after) for w in self.workers))

    async def _follow(self, worker: WorkerProcess, before, after) -> None:
        async with worker.turn:
            if not worker.ready or worker.link is None:
                return  # its next start sends the whole state, this change in it
            try:
                await worker.link.call(
                    {"op": "change",
                     "state": replica.state_for(before, after,
                                             self.shards.serves(worker.index))},
                    seconds=CHANGE_TIMEOUT)
            except (ConnectionError, LinkError, TimeoutError) as exc:
                log.error("worker %d did not take a change (%s): started again with the "
                          "whole state", worker.index, exc or type(exc).__name__)
                worker.kill()

    async def serve(self, session: str, address: str, bound: list) -> None:
        """The session's gateway listeners (bound here), served by its worker; kept here
        too, for the next worker if this one dies."""
        index = self.shard(session)
        if index is None or not bound:  # gone before its gateway was served
            for _, sock in bound:
                sock.close()
            return
        keys = [listener.key for listener, _ in bound]
        socks = [sock for _, sock in bound]
        entry = self.gateways[address] = (index, keys, socks)
        worker = self.workers[index]
        async with worker.turn:
            if self.gateways.get(address) is not entry:
                return  # closed while it waited for its turn (the session went)
            if worker.ready and worker.link is not None:
                try:
                    await self._serve(worker, address, keys, socks)
                except (ConnectionError, LinkError, TimeoutError) as exc:
                    log.error("worker %d could not serve %s (%s): started again",
                              index, address, exc)
                    worker.kill()

    async def _serve(self, worker: WorkerProcess, address: str, keys: list[str], socks) -> None:
        assert worker.link is not None
        await worker.link.call({"op": "serve", "address": address, "keys": keys,
                                "fds": len(socks)},
                               fds=[s.fileno() for s in socks], seconds=START_TIMEOUT)

    def close(self, address: str) -> None:
        """The gateway's listeners go: in its worker, and here."""
        found = self.gateways.pop(address, None)
        if found is None:
            return
        index, _, socks = found
        worker = self.workers[index]
        if worker.link is not None and not worker.link.closed.done():
            task = asyncio.get_running_loop().create_task(self._ask_now(
                worker, {"op": "close", "address": address}))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        for sock in socks:
            sock.close()

    async def closed(self) -> None:
        """Every gateway `close` asked for is closed in its worker (or the worker is gone:
        its sockets with it)."""
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def secrets_changed(self) -> None:
        """The secrets changed: every worker attaches (and redacts) the new ones before
        the call that changed them returns."""
        await asyncio.gather(*(self._call(w, lambda: {
            "op": "secrets", "key": self.secrets.key, "http": self.secrets.http()})
            for w in self.workers))

    async def held(self) -> dict[str, int]:
        """Open connections per session, in every worker."""
        found: dict[str, int] = {}
        replies = await asyncio.gather(*(self._ask_now(w, {"op": "held"}) for w in self.workers))
        for worker, reply in zip(self.workers, replies, strict=True):
            held = (reply or {}).get("held")
            if not isinstance(held, dict):
                continue
            for session, count in held.items():  # its own sessions', counted
                if type(count) is int and count >= 0 and self.shard(session) == worker.index:
                    found[session] = found.get(session, 0) + count
        return found

    async def authority_changed(self) -> None:
        """The interception CA was rotated: every worker signs with the new one before
        the rotation's call returns."""
        await asyncio.gather(*(self._call(w, lambda: {"op": "authority"})
                               for w in self.workers))

    async def _call(self, worker: WorkerProcess, message: Callable[[], dict]) -> None:
        """Tell `worker` of a change outside the store (secrets, the CA), in its turn: one
        that is starting gets it after its start (whose state may predate the change), never
        not at all. `message` is made in the turn, from what is in force then."""
        async with worker.turn:
            if not worker.ready or worker.link is None:
                return  # its next start reads the change from what it is sent
            made = message()
            try:
                await worker.link.call(made, seconds=CHANGE_TIMEOUT)
            except (ConnectionError, LinkError, TimeoutError) as exc:
                log.error("worker %d did not answer %s (%s): started again", worker.index,
                          made["op"], exc)
                worker.kill()

    async def _ask_now(self, worker: WorkerProcess, message: dict) -> dict | None:
        """A question for `worker` (nothing changes): None when it cannot answer now."""
        if not worker.ready or worker.link is None:
            return None
        try:
            return await worker.link.call(message, seconds=5.0)
        except (ConnectionError, LinkError, TimeoutError):
            return None

    def unserved(self) -> dict[str, str]:
        """Sessions whose worker is down, and why they get no answer now."""
        return {session: f"its worker ({index}) is down: its queries and connections wait "
                         f"unanswered until it is started again"
                for session, index in self.shards.of.items()
                if not self.workers[index].ready}

    async def describe(self) -> list[dict]:
        """Each worker as `status` shows it."""
        async def one(worker: WorkerProcess) -> dict:
            seen = {"index": worker.index, "up": worker.ready, "restarts": worker.restarts}
            if worker.ready and worker.link is not None:
                with contextlib.suppress(ConnectionError, LinkError, TimeoutError):
                    reply = await worker.link.call({"op": "status"}, seconds=5.0)
                    # what it says of itself, each of the type status shows: never which
                    # worker it is, nor a count `status` could not add up
                    seen.update({k: v for k, v in reply.items()
                                 if k in STATUS and type(v) is STATUS[k]})
                    seen["sessions"] = [s for s in seen.get("sessions", ())
                                        if type(s) is str and self.shard(s) == worker.index]
            return seen
        return list(await asyncio.gather(*(one(w) for w in self.workers)))

    # -- what they tell the coordinator -------------------------------------------------
    def handle(self, worker: WorkerProcess, message: dict, fds: list[int]):
        for fd in fds:  # a worker never sends descriptors
            socket.socket(fileno=fd).close()
        op = message["op"]
        if op == "event":
            try:
                raw = message["event"]
                if not isinstance(raw, dict):
                    raise TypeError("not an object")
                event = Event(raw)
                check(event)  # emit checks only the type of what it is handed
                self._own(worker, event)
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

    def _own(self, worker: WorkerProcess, event: Event) -> None:
        """A worker reports its own sessions' flows (or a client's outside every session),
        nothing else: another worker's session would spend that session's audit budget and
        write its history, and a rule, an approval, a session or the log's own records are
        the coordinator's (recorded whatever the budget, read as a person's decisions).
        ValueError (the event is dropped) for anything else, or a field of the wrong type."""
        session = event.get("session")
        if session is not None and (type(session) is not str
                                    or self.shard(session) != worker.index):
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
        if "id" in event and event["id"] >> 48 != worker.index + 1:
            # ids are unique since the filter started: each worker has its range (_spawn)
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
        if self.shard(session) != worker.index or current is None \
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

    def _forget_waits(self, worker: WorkerProcess) -> None:
        """A worker that died: nothing waits there any more."""
        self._held_in[worker.index] = 0
        for key in [k for k in self._waits if k[0] == worker.index]:
            approval, counted, there = self._waits.pop(key)
            self.holds.done_elsewhere(approval, counted, there)

    def _ruling(self, pending, verdict) -> None:
        """A verdict for an approval: to the worker of its session, where its requests
        wait (or the next will)."""
        index = self.shard(pending.session)
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
        foreign = [t for t in asked if self.shard(t.session) != worker.index]
        if foreign:
            raise LinkError(f"worker {worker.index} taught for session "
                            f"{foreign[0].session!r}, which it does not serve")
        learned = await asyncio.get_running_loop().run_in_executor(
            None, self.learned.learn, asked)
        return {"taught": [asdict(t) for t in learned.taught], "refused": learned.refused}
