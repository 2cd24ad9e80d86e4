"""What the coordinator takes from a worker, judged as if the worker were hostile: an
approval only for its own sessions, in ask mode, for something a person may approve; a
wait counted once and forgotten with its worker; heard answers checked. No
processes: the coordinator's handlers, with real stores, books and buses."""

from __future__ import annotations

import asyncio

import pytest

from appliance.filter.approvals import Holds
from appliance.filter.dns.resolver import Resolver
from appliance.filter.events import EventBus
from appliance.filter.proxy.frontends import Frontends
from appliance.filter.workers.coordinator import LOG_BURST, Workers, relay_log
from appliance.filter.workers.link import LinkError
from appliance.policystore import PolicyStore
from tests.unit.filterconfig import one_session

ASK = {"op": "ask", "reason": "not allowed by any rule", "origin": "proxy", "note": "",
       "hint": "corral allow-http other.test:443", "client": "10.214.1.2",
       "name": "other.test", "port": 443}


@pytest.fixture
def coordinator(tmp_path):
    (tmp_path / "ask.toml").write_text('[approval]\nmode = "ask"\nhold = 30\n'
                                       '[deny]\nnames = ["blocked.test"]\n')
    (tmp_path / "deny.toml").write_text("")
    store = PolicyStore(one_session(tmp_path))
    # the least loaded worker takes each as it comes: s1 (the config file's) 0, w3 1, w1 0,
    # w6 1
    store.register("w3", "10.214.1.0/24", files=[str(tmp_path / "ask.toml")])
    store.register("w1", "10.214.3.0/24", files=[str(tmp_path / "ask.toml")])
    store.register("w6", "10.214.2.0/24", files=[str(tmp_path / "deny.toml")])
    bus = EventBus()
    resolver = Resolver([("127.0.0.1", 9)])
    made = Workers(2, store, bus, None, None, Frontends(store, resolver), Holds(bus.emit))
    made.shards.assign(store.sessions)
    assert made.shards.of == {"s1": 0, "w3": 1, "w1": 0, "w6": 1}
    yield made
    resolver.close()


def test_an_ask_opens_an_approval_only_where_a_person_may_grant_it(coordinator):
    one = coordinator.workers[1]
    opened = coordinator.inbox._ask(one, {**ASK, "session": "w3"})["pending"]
    assert opened["session"] == "w3" and opened["target"] == "other.test:443"
    assert list(coordinator.inbox.holds.book.pending) == [opened["id"]]
    assert [e["action"] for e in coordinator.bus.recent] == ["pending"]
    refused = [
        {**ASK, "session": "w1"},    # another worker's session
        {**ASK, "session": "gone"},  # no such session
        {**ASK, "session": "w3", "hint": "corral allow-http 192.0.2.1:443"},  # a literal
        {**ASK, "session": "w3", "hint": "corral allow-http api.corral:443"},
        {**ASK, "session": "w3", "hint": "corral deny everything"},
        {**ASK, "session": "w3", "origin": "person"},
        # a deny rule's target, which the worker calls approvable: the coordinator's policy
        # says otherwise
        {**ASK, "session": "w3", "hint": "corral allow-http blocked.test:443"},
    ]
    for message in refused:
        assert coordinator.inbox._ask(one, message) == {"pending": None}, message
    assert len(coordinator.inbox.holds.book.pending) == 1
    # an agent may ask in any approval mode (request.corral): w6 denies at once
    asked = coordinator.inbox._ask(coordinator.workers[1],
                                   {**ASK, "session": "w6", "origin": "agent"})
    assert asked["pending"]["session"] == "w6"
    for broken in ({**ASK, "session": 3}, {**ASK, "session": "w3", "port": "443"},
                   {k: v for k, v in ASK.items() if k != "reason"}):
        with pytest.raises(LinkError):
            coordinator.inbox._ask(one, broken)


def test_a_wait_is_counted_once_and_forgotten_with_its_worker(coordinator):
    one = coordinator.workers[1]
    pending_id = coordinator.inbox._ask(one, {**ASK, "session": "w3"})["pending"]["id"]
    pending = coordinator.inbox.holds.book.pending[pending_id]
    wait = {"op": "waiting", "approval": pending_id, "counted": True}
    coordinator.inbox._waiting(one, {**wait, "token": 1, "delta": 1})
    coordinator.inbox._waiting(one, {**wait, "token": 1, "delta": 1})  # said twice: counted once
    coordinator.inbox._waiting(one, {**wait, "token": 2, "delta": 1})
    assert (pending.waiting, pending.held, coordinator.inbox.holds.present(pending_id)) == (2, 2, 2)
    coordinator.inbox._waiting(one, {**wait, "token": 2, "delta": -1})
    coordinator.inbox._waiting(one, {**wait, "token": 2, "delta": -1})  # again: nothing
    assert (pending.waiting, pending.held) == (1, 1)
    coordinator.inbox.forget_waits(one)  # the worker died
    assert (pending.waiting, pending.held, coordinator.inbox.holds.present(pending_id)) == (0, 0, 0)
    coordinator.inbox._waiting(one, {**wait, "token": 3, "delta": 1, "approval": "ap-none"})
    assert coordinator.inbox._waits == {}  # a closed approval: nothing waits for it
    with pytest.raises(LinkError):
        coordinator.inbox._waiting(one, {**wait, "token": 4, "delta": 2})


def test_a_heard_answer_is_checked_before_it_reaches_the_book(coordinator):
    async def main():
        zero = coordinator.workers[0]
        coordinator.inbox._heard(zero, {"op": "heard", "name": "x.test", "addresses": ["192.0.2.9"],
                                  "ttl": 30})
        for broken in ({"name": "x.test", "addresses": ["not an address"], "ttl": 30},
                       {"name": "x.test", "addresses": [], "ttl": 30},
                       {"name": "x.test", "addresses": ["192.0.2.9"] * 65, "ttl": 30},
                       {"name": "x" * 300, "addresses": ["192.0.2.9"], "ttl": 30},
                       {"name": "x.test", "addresses": ["192.0.2.9"], "ttl": -1}):
            with pytest.raises(LinkError):
                coordinator.inbox._heard(zero, {"op": "heard", **broken})
    asyncio.run(main())


def test_a_workers_log_is_relayed_whole_lines_within_its_budget(capsys, caplog):
    """Its lines reach the filter's stderr as they were written, the last one without a
    newline too; a flood past LOG_BURST is counted, not relayed."""
    async def relayed(data: bytes) -> None:
        stream = asyncio.StreamReader()
        stream.feed_data(data)
        stream.feed_eof()
        await relay_log(stream)

    asyncio.run(relayed(b"one\ntwo\nlast words"))
    assert capsys.readouterr().err == "one\ntwo\nlast words\n"
    flood = LOG_BURST * 3
    asyncio.run(relayed(b"".join(b"line %d\n" % n for n in range(flood)) + b"after\n"))
    written = capsys.readouterr().err.splitlines()
    assert LOG_BURST <= len(written) < flood / 2, len(written)
    assert written[:2] == ["line 0", "line 1"]
    assert any("log lines past" in r.getMessage() for r in caplog.records)
