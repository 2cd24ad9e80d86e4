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
import itertools
import logging
import os
import socket
import sys
import time
from collections.abc import Callable

from appliance.firewall.learned import LearnedSet
from appliance.policystore import PolicyStore

from ..approvals import Holds
from ..events import EventBus
from ..proxy.frontends import Frontends
from ..ratelimit import TokenBucket
from . import confine, replica
from .inbox import Inbox
from .link import PICKLE, Link, LinkError
from .process import ID_BITS, WorkerProcess

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
BEAT = 1.0
"""Seconds between two beats to each worker (worker.py STALE: how many it may miss)."""


class Workers:
    def __init__(self, count: int, store: PolicyStore, bus: EventBus,
                 learned: LearnedSet | None, secrets, frontends: Frontends, holds: Holds, *,
                 event_loop: str = "auto", log_level: str = "info", silence: float = 60.0):
        """`secrets`: the secret store (its key and http secrets go to each worker);
        `frontends`: the coordinator's book of where inspected hosts live, told what each
        worker hears (and the other workers with it); `holds`: the approvals (ask mode),
        whose requests wait in the workers (workers/holds.py); `silence`: seconds a serving
        worker may answer nothing before it is killed (`[filter] worker_silence`)."""
        self.count, self.store, self.bus, self.learned = count, store, bus, learned
        self.secrets = secrets
        self.event_loop, self.log_level, self.silence = event_loop, log_level, silence
        self.workers = [WorkerProcess(i) for i in range(count)]
        self._blocks = itertools.count(1)
        self.shards = replica.Shards(count)
        self.inbox = Inbox(store, bus, learned, holds, frontends, self.shards, self.workers)
        """What the workers say, checked (inbox.py)."""
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
        confine.undumpable()
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
        can neither record what the workers decide nor make a change reach them.

        The other way round: a serving worker not heard from for `silence` seconds (each
        beat asks for an answer) is stuck, and is killed; `_keep` starts the next. Counted
        only while this loop ran on time (late, the answers may be waiting unread, and a
        whole filter frozen and thawed heard nobody meanwhile), and not while a change,
        a start or a gateway is in flight to it: those have their own time limit, and
        reading a large change (its pickle) is a worker busy, not stuck."""
        loop = asyncio.get_running_loop()
        last = resumed = loop.time()
        keep = Link.beats_for(self.silence, BEAT)
        while not self._stopping:
            now = loop.time()
            if now - last > 2 * BEAT:
                resumed = now
            last = now
            for worker in self.workers:
                link = worker.link
                if link is None or link.closed.done():
                    continue
                silent = now - max(link.heard, resumed)
                if worker.ready and not worker.turn.locked() and silent > self.silence:
                    log.error("worker %d (pid %s) answered nothing for %.0f s: killed, and "
                              "started again", worker.index,
                              worker.process.pid if worker.process else "?", silent)
                    worker.kill()
                    continue
                link.beat(keep)
            await asyncio.sleep(BEAT)

    async def _spawn(self, worker: WorkerProcess) -> None:
        async with worker.turn:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            worker.block = next(self._blocks)  # ids apart from every other process's
            first_id = worker.block << ID_BITS
            try:  # (a worker that cannot be started leaves no descriptor behind)
                worker.process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "appliance.filter.workers",
                    "--link-fd", str(theirs.fileno()), "--index", str(worker.index),
                    "--first-id", str(first_id), "--event-loop", self.event_loop,
                    "--log-level", self.log_level, *self._reads(),
                    pass_fds=(theirs.fileno(),),
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.PIPE)
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            worker.relay = asyncio.get_running_loop().create_task(
                relay_log(worker.process.stderr), name=f"corral-worker-{worker.index}-log")
            # (the block as this process was given it: its last events, read after it died
            # and the next began, are still its own)
            worker.link = Link(ours, sends=PICKLE, handle=lambda m, f, w=worker,
                               b=worker.block: self.inbox.handle(w, m, f, b))
            try:
                await worker.link.call(
                    {"op": "start", "config": self.store.config,
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
            log.info("worker %d serving (pid %d)", worker.index, worker.process.pid)

    def _reads(self) -> list[str]:
        """The files a worker reads besides its code (its Landlock ruleset's): the
        interception CA's, which it loads as it starts and again after a rotation, and the
        upstreams' CA bundle; and what no path it is given may hold, however spelt: the
        state directory and the control socket's."""
        config = self.store.config
        inspect = config.inspect
        paths = (inspect.ca_dir, inspect.ca_cert, inspect.ca_key, inspect.upstream_ca)
        shut = (config.state_dir, os.path.dirname(os.path.abspath(config.control_socket)))
        return [*(arg for path in paths if path for arg in ("--read", path)),
                *(arg for path in shut for arg in ("--keep-out", path))]

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
            self.inbox.forget_waits(worker)
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
        await asyncio.gather(*(w.stop() for w in self.workers))
        for _, _, socks in self.gateways.values():
            for sock in socks:
                sock.close()
        self.gateways.clear()

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
        task = asyncio.get_running_loop().create_task(self._close(self.workers[index],
                                                                  address))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        for sock in socks:
            sock.close()

    async def _close(self, worker: WorkerProcess, address: str) -> None:
        """In its turn: a worker starting meanwhile may have served the gateway already
        (its start serves every gateway it is given); once started, it is told."""
        async with worker.turn:
            await worker.ask({"op": "close", "address": address})

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

    def unserved(self) -> dict[str, str]:
        """Sessions whose worker is down, and why they get no answer now."""
        return {session: f"its worker ({index}) is down: its queries and connections wait "
                         f"unanswered until it is started again"
                for session, index in self.shards.of.items()
                if not self.workers[index].ready}

    async def held(self) -> dict[str, int]:
        """Open connections per session, in every worker (inbox.py)."""
        return await self.inbox.held()

    async def describe(self) -> list[dict]:
        """Each worker as `status` shows it (inbox.py)."""
        return await self.inbox.describe()


LOG_LINES, LOG_BURST = 100.0, 1000
"""A worker's log lines relayed a second, and at once: past them they are counted, not
written (a worker made to flood its log must not spend the coordinator's loop, which every
session's changes and events go through, on relaying it)."""


async def relay_log(stream: asyncio.StreamReader) -> None:
    """A worker's log lines onto the filter's own stderr (under systemd, the unit's journal
    stream), line by line so they do not cut into the filter's, within LOG_LINES. Each worker
    writes to a pipe of its own: given the filter's stream itself, a worker could shut it
    down (journald's stream is a socket, and shutdown() a call every connection makes), and
    the filter's lines, those naming that worker among them, would go nowhere."""
    out = sys.stderr.buffer
    budget = TokenBucket(LOG_LINES, LOG_BURST, time.monotonic())
    dropped = 0
    while True:
        try:
            line = await stream.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:  # its last words, without a newline
            line = exc.partial + b"\n" if exc.partial else b""
        except asyncio.LimitOverrunError as exc:  # longer than a line should be: in parts
            line = await stream.readexactly(exc.consumed)
        if line and not budget.take(time.monotonic()):
            dropped += 1
            continue
        if dropped:  # before the next line it relays, or as it ends
            log.warning("a worker wrote %d log lines past %g a second: not relayed",
                        dropped, LOG_LINES)
            dropped = 0
        if not line:
            return
        out.write(line)
        out.flush()
