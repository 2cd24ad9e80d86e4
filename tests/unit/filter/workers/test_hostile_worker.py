"""A worker made to misbehave (it parses what agents send) against its coordinator: what it
says reaches the one audit chain only as a worker's own flows' events, for its own
sessions; descriptors it sends are not kept. The coordinator's handlers with a real store
and bus; the link over a real Unix socketpair."""

from __future__ import annotations

import array
import asyncio
import os
import socket

import pytest

from appliance.filter.approvals import Holds
from appliance.filter.dns.resolver import Resolver
from appliance.filter.events import EventBus
from appliance.filter.proxy.frontends import Frontends
from appliance.filter.workers.coordinator import Workers
from appliance.filter.workers.link import JSON, PICKLE, Link, LinkError, encode
from appliance.filter.workers.process import ID_BITS
from appliance.policy import Decision
from appliance.policystore import PolicyStore
from tests.unit.filterconfig import one_session


class Audit:
    def __init__(self):
        self.records: list[dict] = []

    def append(self, event) -> None:
        self.records.append(dict(event))


@pytest.fixture
def coordinator(tmp_path):
    (tmp_path / "p.toml").write_text("")
    store = PolicyStore(one_session(tmp_path))
    store.register("w3", "10.214.1.0/24", files=[str(tmp_path / "p.toml")])  # worker 1
    store.register("w1", "10.214.3.0/24", files=[str(tmp_path / "p.toml")])  # worker 0
    bus = EventBus(audit=Audit(), audit_rate=1, audit_burst=1)
    resolver = Resolver([("127.0.0.1", 9)])
    made = Workers(2, store, bus, None, None, Frontends(store, resolver), Holds(bus.emit))
    made.shards.assign(store.sessions)  # s1 (the config file's) 0, w3 1, w1 0
    yield made
    resolver.close()


BLOCK = 300
"""The block of ids the worker's process was started with: past 256 starts, where ids once
began to repeat."""


def flow(**fields) -> dict:
    return {"id": (BLOCK << ID_BITS) + 1, "session": "w3", "client": "10.214.1.2", "kind": "dns",
            "name": "x.test",
            "verdict": "deny", "reason": "not allowed", "rule": None, "layer": None,
            **fields}


def test_a_worker_records_only_its_own_sessions_flows(coordinator):
    one, bus = coordinator.workers[1], coordinator.bus
    forged = [
        flow(session="w1"),  # worker 0's session: its audit budget, its history
        flow(kind="approval", verdict="change", action="approved", approval="ap-1",
             grant="always", by="alice", reason="approved by alice"),  # a person's decision
        flow(kind="rule", verdict="change", action="added", reason="added: http evil.test"),
        flow(kind="session", verdict="change", action="stopped"),
        flow(kind="audit", verdict="error", reason="0 events not recorded"),
        flow(session={"w3": 1}),   # not a name
        flow(id="seven"),          # ids and times are numbers
        flow(id=7),                # the coordinator's own ids (a flow of its, closed)
        flow(id=((BLOCK - 1) << ID_BITS) + 7),  # another process's: worker 0's, or its own
        #                                         process before it was restarted
        flow(id=((BLOCK + 1) << ID_BITS) + 7),  # one not started yet
        flow(verdict=["deny"]),
    ]
    for event in forged:
        coordinator.inbox.handle(one, {"op": "event", "event": event}, [], BLOCK)
    assert list(bus.recent) == [] and bus.audit.records == []
    coordinator.inbox.handle(one, {"op": "event", "event": flow()}, [], BLOCK)
    assert [(e["session"], e["kind"]) for e in bus.recent] == [("w3", "dns")]
    assert len(bus.audit.records) == 1
    # a session that is nobody's (a client outside every session) is the worker's to report
    coordinator.inbox.handle(one, {"op": "event", "event": flow(session=None)}, [], BLOCK)
    assert len(bus.recent) == 2


def test_descriptors_a_worker_sends_are_not_kept():
    """The coordinator never takes a descriptor from a worker: one that sends some with
    every frame must not fill the coordinator's table (the audit log, the control socket
    and every session's gateway need it)."""
    async def main():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        link = Link(ours, sends=PICKLE, handle=lambda message, fds: None)
        before = len(os.listdir("/proc/self/fd"))
        frame = encode({"op": "event", "event": flow()}, JSON)
        junk = [os.open("/dev/null", os.O_RDONLY) for _ in range(8)]
        try:
            for _ in range(50):
                try:
                    theirs.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                              array.array("i", junk))])
                except OSError:
                    break  # the coordinator closed the link: nothing more arrives
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.05)
            assert len(os.listdir("/proc/self/fd")) - before < 8
        finally:
            for fd in junk:
                os.close(fd)
            link.close()
            theirs.close()
    asyncio.run(main())


def test_what_a_worker_answers_for_status_and_sessions_is_its_own_and_typed(coordinator):
    """`status` shows each worker as the coordinator knows it (index, up, restarts, pid) and
    sums their connections; `sessions` adds what each holds. A worker's answer could say it
    was another index or another process (a person would kill that one), make the sum fail
    (`status` answered an internal error), or count connections for another worker's
    session."""
    answers = {"status": {"index": 0, "up": True, "restarts": 0, "pid": 1,
                          "active_connections": "many", "sessions": ["w1"]},
               "held": {"held": {"w1": 10 ** 9, "w3": 2}}}

    async def main():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        one = coordinator.workers[1]
        one.link = Link(ours, sends=PICKLE, handle=lambda message, fds: None)
        hostile = Link(theirs, sends=JSON,
                       handle=lambda message, fds: answers.get(message["op"]))
        one.ready, one.restarts = True, 3
        try:
            described = {w["index"]: w for w in await coordinator.describe()}
            assert described[1]["up"] and described[1]["restarts"] == 3
            assert "pid" not in described[1]  # its pid is the coordinator's to say (none here)
            assert described[0] == {"index": 0, "up": False, "restarts": 0}
            assert type(described[1].get("active_connections", 0)) is int
            assert described[1].get("sessions", []) in ([], ["w3"])
            assert await coordinator.held() == {"w3": 2}
            answers["held"] = {"held": ["w3"]}
            assert await coordinator.held() == {}
        finally:
            one.link.close()
            hostile.close()
    asyncio.run(main())


def test_a_worker_cannot_say_more_requests_wait_than_it_can_hold(coordinator):
    """Each wait a worker reports is kept (and counted for a grant `once`) until it says it
    ended: one saying it started waits it never ends, each with a new token, grew the
    coordinator's memory for as long as it cared to."""
    most = coordinator.store.config.proxy.max_connections  # what a worker can hold open
    one = coordinator.workers[1]
    pending = coordinator.inbox.holds.ask("w3", Decision(False, "not allowed", None,
                                                   "corral allow-http other.test:443"), "proxy")
    for token in range(most + 1000):
        try:
            coordinator.inbox._waiting(one, {"op": "waiting", "approval": pending.id,
                                       "token": token, "counted": True, "delta": 1})
        except LinkError:
            break
    assert len(coordinator.inbox._waits) <= most
