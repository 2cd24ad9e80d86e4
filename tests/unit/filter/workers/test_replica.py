"""What each worker is sent of a change, and the store it builds from it: the policies of
its own sessions, compiled from the coordinator's rules (never from a file), and nothing
allowed to another worker's session. Pure: real PolicyStores, no processes."""

from __future__ import annotations

import dataclasses
import pickle

from appliance.filter.changes import Before
from appliance.filter.workers import replica
from appliance.policy import Host
from appliance.policystore import PolicyStore
from tests.unit.filterconfig import one_session

NAMES = ["w1", "w3", "w4", "w6"]
"""Registered in this order: w1 and w4 on worker 0, w3 and w6 on worker 1 (s1, the config
file's, came first: on worker 0)."""


def store(tmp_path) -> PolicyStore:
    (tmp_path / "p.toml").write_text('[http]\nallow = ["allowed.test"]\n')
    made = PolicyStore(one_session(tmp_path))
    for index, name in enumerate(NAMES):
        made.register(name, f"10.214.{index}.0/24", files=[str(tmp_path / "p.toml")])
    return made


def before(store: PolicyStore) -> Before:
    return Before(store.registered, store.sessions, store.base)


def shards(source: PolicyStore, count: int = 2) -> replica.Shards:
    made = replica.Shards(count)
    made.assign(source.sessions)
    return made


def workers_of(source: PolicyStore, count: int = 2) -> list[PolicyStore]:
    made, assigned = [], shards(source, count)
    for index in range(count):
        worker = replica.replica(source.config)
        # as it travels: pickled
        state = pickle.loads(pickle.dumps(replica.state_for(None, source,
                                                         assigned.serves(index))))
        worker.commit(replica.apply(worker, state))
        made.append(worker)
    return made


def allowed(store: PolicyStore, client: str, name: str) -> bool:
    _, policy = store.lookup(client)
    return policy.decide_http(Host(name=name), 443).allowed


def test_a_session_goes_to_the_least_loaded_worker_and_stays_there():
    assigned = replica.Shards(2)
    assigned.assign(["s1", *NAMES])
    assert assigned.of == {"s1": 0, "w1": 1, "w3": 0, "w4": 1, "w6": 0}
    assigned.assign(["s1", "w1", "w4", "w6"])  # w3 went
    assigned.assign(["s1", "w1", "w4", "w6", "new"])
    assert assigned.of["new"] == 0 and assigned.of["w1"] == 1  # the others stay
    assigned.assign([])
    assert assigned.of == {} and assigned._load == [0, 0]
    four = replica.Shards(4)
    four.assign([f"session-{i}" for i in range(10)])
    assert sorted(four._load) == [2, 2, 3, 3]


def test_a_worker_holds_its_own_sessions_policies_and_nothing_for_the_others(tmp_path):
    source = store(tmp_path)
    zero, one = workers_of(source)
    assert set(zero.sessions) == set(one.sessions) == {"s1", *NAMES}
    for index, name in enumerate(NAMES):
        client = f"10.214.{index}.2"
        mine, theirs = (zero, one) if shards(source).of[name] == 0 else (one, zero)
        assert mine.lookup(client)[0] == theirs.lookup(client)[0] == name
        assert allowed(source, client, "allowed.test")
        assert allowed(mine, client, "allowed.test")
        assert mine.sessions[name].policy.rules == source.sessions[name].policy.rules
        assert not allowed(theirs, client, "allowed.test")  # FOREIGN: nothing
        assert theirs.sessions[name].policy is replica.FOREIGN
    assert zero.lookup("192.0.2.1") == (None, zero.outside)
    assert zero.outside.rules == source.outside.rules


def test_a_change_sends_only_the_session_it_changed_to_its_worker(tmp_path):
    source = store(tmp_path)
    zero, one = workers_of(source)  # zero: s1, w3, w6; one: w1, w4
    owns = shards(source).serves
    kept = zero.sessions["w6"]
    was = before(source)
    source.commit(source.plan_add("w3", "http", "granted.test"))
    to_zero = replica.state_for(was, source, owns(0))
    to_one = replica.state_for(was, source, owns(1))
    assert list(to_zero["policies"]) == ["w3"] and "base" not in to_zero
    assert to_one["policies"] == {} and "base" not in to_one
    zero.commit(replica.apply(zero, to_zero))
    one.commit(replica.apply(one, to_one))
    assert allowed(zero, "10.214.1.2", "granted.test")
    assert not allowed(zero, "10.214.3.2", "granted.test")
    assert zero.sessions["w6"] is kept  # not compiled again
    # the revoke
    was = before(source)
    source.commit(source.plan_remove("w3", "http", "granted.test"))
    zero.commit(replica.apply(zero, replica.state_for(was, source, owns(0))))
    assert not allowed(zero, "10.214.1.2", "granted.test")


def test_a_session_that_goes_is_gone_from_every_worker_and_applying_twice_is_the_same(
        tmp_path):
    source = store(tmp_path)
    zero, one = workers_of(source)
    owns = shards(source).serves
    was = before(source)
    source.commit(source.plan_unregister("w6"))
    state = replica.state_for(was, source, owns(0))
    for _ in range(2):  # a worker that started meanwhile is sent it again: the same
        zero.commit(replica.apply(zero, state))
    one.commit(replica.apply(one, replica.state_for(was, source, owns(1))))
    for worker in (zero, one):
        assert "w6" not in worker.sessions
        assert worker.lookup("10.214.3.2")[0] is None


def test_a_reload_sends_the_appliance_rules_and_every_session_again(tmp_path):
    source = store(tmp_path)
    zero, _ = workers_of(source)
    policy = tmp_path / "appliance.toml"
    policy.write_text('[http]\nallow = ["everyone.test"]\n')
    source.config = dataclasses.replace(source.config, policy_files=(str(policy),))
    was = before(source)
    source.commit(source.plan_reload())
    state = replica.state_for(was, source, shards(source).serves(0))
    assert "base" in state and sorted(state["policies"]) == ["s1", "w3", "w6"]
    policy.write_text('[http]\nallow = ["changed-on-disk.test"]\n')  # read by no worker
    zero.commit(replica.apply(zero, state))
    assert allowed(zero, "10.214.1.2", "everyone.test")
    assert allowed(zero, "192.0.2.1", "everyone.test")  # outside every session
    assert not allowed(zero, "10.214.1.2", "changed-on-disk.test")
    assert replica.served(zero) == ["s1", "w3", "w6"]


def test_heard_is_what_a_frontends_book_reads():
    heard = replica.Heard(["192.0.2.7"], 30)
    assert heard.addresses("any.test") == ("192.0.2.7",)
