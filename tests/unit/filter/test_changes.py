"""Changes to the policy store: worked out and written off the loop, swapped in on it, one at
a time, all or nothing; and the control socket that asks for them always answers."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading

import pytest

from appliance.filter import control
from appliance.filter.control import ControlError, answer_for
from appliance.filter.service import Service
from appliance.firewall.nft import NftError
from appliance.policy import ConfigError, RuleError, parse_host
from appliance.policystore import PolicyStore
from appliance.sessionconfig import parse_config


@pytest.fixture
def config(tmp_path):
    (tmp_path / "appliance.toml").write_text('[http]\nallow = ["base.test"]\n')
    (tmp_path / "s1.toml").write_text('[http]\nallow = ["project.test"]\n')
    (tmp_path / "s3.toml").write_text('[http]\nallow = ["three.test"]\n')
    text = f"""
[policy]
files = ["{tmp_path}/appliance.toml"]
[state]
dir = "{tmp_path}/state"
[control]
socket = "{tmp_path}/control.sock"
[[session]]
name = "s1"
subnet = "10.1.0.0/24"
files = ["{tmp_path}/s1.toml"]
"""
    return parse_config(text, str(tmp_path / "filter.toml"))


def runtime_rules(store: PolicyStore, session: str = "s1") -> list[str]:
    return [r.text for r in store.sessions[session].runtime]


# -- the store: plan, write, commit ----------------------------------------------------------


def test_a_planned_change_touches_neither_the_store_nor_the_disk(config):
    store = PolicyStore(config)
    calls = []
    store.on_change(lambda: calls.append(1))
    sessions = store.sessions
    change = store.plan_add("s1", "http", "new.test")
    assert store.sessions is sessions and runtime_rules(store) == []
    assert not store.runtime_dir.exists() and calls == []
    change.write()
    assert json.loads((store.runtime_dir / "s1.json").read_text())["rules"] == [
        {"kind": "http", "rule": "new.test"}]
    assert runtime_rules(store) == [] and calls == []  # written, not yet in force
    store.commit(change)
    assert runtime_rules(store) == ["new.test"] and calls == [1]
    assert store.sessions["s1"].policy.decide_http(parse_host("new.test"), 443).allowed


def test_undo_puts_every_file_back_as_it_was(config):
    store = PolicyStore(config)
    store.add("s1", "dns", "kept.test")
    store.register("s3", "10.3.0.0/24", None, [str(config.policy_files[0])])
    store.add("s3", "dns", "three-runtime.test")
    registered = store.registered_path.read_bytes()
    runtime = (store.runtime_dir / "s3.json").read_bytes()
    change = store.plan_unregister("s3", forget_rules=True)
    change.write()
    assert not (store.runtime_dir / "s3.json").exists()
    change.undo()  # the firewall refused it, say
    assert store.registered_path.read_bytes() == registered
    assert (store.runtime_dir / "s3.json").read_bytes() == runtime
    assert "s3" in store.sessions

    fresh = store.plan_add("s1", "dns", "brand-new.test")
    before = (store.runtime_dir / "s1.json").read_bytes()
    fresh.write()
    fresh.undo()
    assert (store.runtime_dir / "s1.json").read_bytes() == before


def test_a_write_that_fails_half_way_puts_back_what_it_wrote(config):
    store = PolicyStore(config)
    store.register("s3", "10.3.0.0/24")
    registered = store.registered_path.read_bytes()
    (store.runtime_dir / "s3.json").mkdir(parents=True)  # cannot be deleted as a file
    change = store.plan_unregister("s3", forget_rules=True)
    with pytest.raises(OSError):
        change.write()
    assert store.registered_path.read_bytes() == registered
    assert "s3" in store.sessions and any(s.name == "s3" for s in store.registered)


def test_a_reload_that_fails_changes_nothing_not_even_the_appliance_layer(config, tmp_path):
    store = PolicyStore(config)
    base = store.base
    (tmp_path / "appliance.toml").write_text('[http]\nallow = ["other-base.test"]\n')
    (tmp_path / "s1.toml").write_text('[http]\nallow = ["not valid"]\n')
    with pytest.raises(ConfigError):
        store.reload()
    assert store.base is base
    assert store.outside.decide_http(parse_host("base.test"), 443).allowed


def test_an_existing_rule_or_session_is_no_change(config):
    store = PolicyStore(config)
    store.add("s1", "dns", "a.test")
    change = store.plan_add("s1", "dns", "a.test")
    assert not change.changed and change.files == () and change.result[1] is False
    store.register("s3", "10.3.0.0/24")
    again = store.plan_register("s3", "10.3.0.0/24")
    assert not again.changed and again.result[1] is False


# -- the service: one change at a time, the swap on the loop ---------------------------------


def test_changes_run_one_at_a_time_off_the_loop_and_swap_in_on_it(config):
    service = Service(config)
    store = service.store
    loop_thread, callback_threads, plan_threads = [], [], []
    store.on_change(lambda: callback_threads.append(threading.get_ident()))
    running, most = [0], [0]
    second_started = threading.Event()

    def plan(name, first):
        def work():
            plan_threads.append(threading.get_ident())
            running[0] += 1
            most[0] = max(most[0], running[0])
            if first:
                second_started.wait(0.5)  # would overlap with the second if nothing stopped it
            else:
                second_started.set()
            try:
                return store.plan_add("s1", "dns", name)
            finally:
                running[0] -= 1
        return work

    async def main():
        loop_thread.append(threading.get_ident())
        await asyncio.gather(service.changes.change(plan("one.test", True)),
                             service.changes.change(plan("two.test", False)))

    try:
        asyncio.run(main())
    finally:
        service.blocking.shutdown()
    assert most[0] == 1, "two changes were worked out at once"
    assert sorted(runtime_rules(store)) == ["one.test", "two.test"]
    assert set(callback_threads) == set(loop_thread)
    assert loop_thread[0] not in plan_threads


def test_a_firewall_that_cannot_follow_leaves_the_session_unregistered(config):
    import dataclasses

    managed = dataclasses.replace(config, firewall=dataclasses.replace(config.firewall,
                                                                        manage=True))
    service = Service(managed)
    service.firewall.nft = None  # what a filter without the nftables bindings has
    store = service.store
    sessions = store.sessions

    async def main():
        with pytest.raises(ControlError, match=r"s3 not registered: the firewall could not "
                           r"follow: .*nftables is unavailable"):
            await service.registration.register("s3", "10.3.0.0/24", None, [])
        # a rule needs no firewall: it goes through
        return await service.changes.change(lambda: store.plan_add("s1", "dns", "fine.test"))

    try:
        change = asyncio.run(main())
    finally:
        service.blocking.shutdown()
    assert change.result[1] is True
    assert "s3" not in store.sessions and store.registered == ()
    assert not store.registered_path.exists()
    assert set(store.sessions) == set(sessions)


# -- the control socket ----------------------------------------------------------------------


def test_the_handler_table_answers_every_documented_op():
    documented = set(re.findall(r'"op": "([a-z-]+)"', control.__doc__))
    assert documented == {*control.HANDLERS, "subscribe"}


@pytest.mark.parametrize(("exc", "expected"), [
    (json.JSONDecodeError("Expecting value", "x", 0),  # from a handler: not the request's
     "internal error: JSONDecodeError: Expecting value: line 1 column 1 (char 0)"),
    (ValueError("a bug"), "internal error: ValueError: a bug"),
    (ConfigError("/p.toml", "", "cannot read: No such file"), "/p.toml: cannot read: No such file"),
    (ControlError("'rule' must be a str"), "'rule' must be a str"),
    (RuleError("bad rule"), "bad rule"),
    (KeyError("no session 'x'; sessions: s1"), "no session 'x'; sessions: s1"),
    (NftError("Could not process rule: Operation not permitted"),
     "add: nftables refused: Could not process rule: Operation not permitted"),
    (OSError(28, "No space left on device"), "add: [Errno 28] No space left on device"),
    (RuntimeError("boom"), "internal error: RuntimeError: boom"),
])
def test_every_failure_has_an_answer(exc, expected):
    assert answer_for("add", exc) == {"ok": False, "error": expected}


def test_an_unexpected_failure_is_answered_logged_and_the_connection_goes_on(
        config, caplog, tmp_path):
    service = Service(config)
    path = str(tmp_path / "control.sock")

    def broken(session):
        raise RuntimeError("a bug")

    service.store.effective = broken

    async def main():
        server = await service.control.start(path)
        reader, writer = await asyncio.open_unix_connection(path)
        answers = []
        for request in ({"op": "policy", "session": "s1"}, {"op": "sessions"},
                        {"op": "audit", "limit": 0}, {"op": "events", "last": 2}):
            writer.write(json.dumps(request).encode() + b"\n")
            try:  # a request the server never answers fails here, never waits for ever
                answers.append(json.loads(await asyncio.wait_for(reader.readline(), 10)))
            except TimeoutError:
                raise AssertionError(f"no answer to {request['op']} within 10s") from None
        writer.close()
        server.close()
        await server.wait_closed()
        return answers

    try:
        with caplog.at_level(logging.ERROR, "appliance.filter.control"):
            failed, sessions, bad_limit, events = asyncio.run(main())
    finally:
        service.blocking.shutdown()
    assert failed == {"ok": False, "error": "internal error: RuntimeError: a bug"}
    assert sessions["ok"] and [s["name"] for s in sessions["sessions"]] == ["s1"]
    assert bad_limit == {"ok": False, "error": "'limit' must be at least 1, got 0"}
    assert events == {"ok": True, "events": []}
    logged = [r for r in caplog.records if "policy failed" in r.getMessage()]
    assert logged and logged[0].exc_info[0] is RuntimeError  # with its traceback


def test_hosts_are_inspected_and_requests_ruled_at_run_time_and_that_survives(config):
    store = PolicyStore(config)
    api = parse_host("api.project.test")
    assert store.sessions["s1"].policy.inspection(api) is None
    store.add("s1", "inspect", "api.project.test")
    inspection = store.sessions["s1"].policy.inspection(api)
    assert inspection is not None and inspection.decide("DELETE", "/x").allowed
    store.add("s1", "request", "!api.project.test DELETE /**")
    assert not store.sessions["s1"].policy.inspection(api).decide("DELETE", "/x").allowed
    # an allow on a host with no allow list would make one and refuse everything else
    with pytest.raises(RuleError, match="has no allow list"):
        store.add("s1", "request", "api.project.test GET /x")
    with pytest.raises(RuleError, match="is not inspected"):
        store.add("s1", "request", "other.project.test GET /x")
    with pytest.raises(RuleError, match="one host"):
        store.add("s1", "request", "*.project.test GET /x")
    store.add("s1", "request", "api.project.test nothing")  # allow = [] written at run time
    assert not store.sessions["s1"].policy.inspection(api).decide("GET", "/x").allowed
    store.add("s1", "request", "api.project.test GET /x")  # now it widens a list
    assert store.sessions["s1"].policy.inspection(api).decide("GET", "/x").allowed
    again = PolicyStore(config)  # a restart reads them back
    assert runtime_rules(again) == runtime_rules(store)
    assert again.sessions["s1"].policy.inspection(api).decide("GET", "/x").allowed
    assert not again.sessions["s1"].policy.inspection(api).decide("GET", "/y").allowed
    again.remove("s1", "request", "!api.project.test DELETE /**")
    assert "!api.project.test DELETE /**" not in runtime_rules(again)


# -- rules granted for a while -----------------------------------------------------------------


def test_a_rule_granted_for_a_while_ends_on_disk_and_is_taken_back_when_due(config):
    store = PolicyStore(config)
    rule, added = store.add("s1", "http", "grant.test", until=1000.0)
    assert added and store.until("s1", rule) == 1000.0 and store.next_end() == 1000.0
    assert json.loads((store.runtime_dir / "s1.json").read_text())["rules"] == [
        {"kind": "http", "rule": "grant.test", "expires": 1000.0}]
    (shown,) = [r for r in store.effective("s1") if r["rule"] == "grant.test"]
    assert shown["layer"] == "session" and shown["expires"] == 1000.0
    assert store.sessions["s1"].policy.decide_http(parse_host("grant.test"), 443).allowed

    again = PolicyStore(config)  # a restart: the end comes back from the disk
    assert again.until("s1", rule) == 1000.0
    assert again.plan_expire(999.0).changed is False
    change = again.plan_expire(1000.0)
    assert [(s, r.text) for s, r in change.result] == [("s1", "grant.test")]
    again._now(change)
    assert runtime_rules(again) == [] and again.next_end() is None
    assert not again.sessions["s1"].policy.decide_http(parse_host("grant.test"), 443).allowed
    assert json.loads((again.runtime_dir / "s1.json").read_text())["rules"] == []


def test_granting_again_keeps_the_later_end_and_a_rule_for_good_stays_for_good(config):
    store = PolicyStore(config)
    rule, _ = store.add("s1", "http", "grant.test", until=1000.0)
    assert store.add("s1", "http", "grant.test", until=500.0)[1] is False  # earlier: kept
    assert store.until("s1", rule) == 1000.0
    assert store.add("s1", "http", "grant.test", until=2000.0)[1] is True  # later: extended
    assert store.until("s1", rule) == 2000.0
    assert store.add("s1", "http", "grant.test")[1] is True  # for good now
    assert store.until("s1", rule) is None and store.next_end() is None
    assert store.add("s1", "http", "grant.test", until=3000.0)[1] is False  # stays for good
    store.add("s1", "dns", "other.test", until=10.0)
    store.remove("s1", "dns", "other.test")  # revoked: its end goes with it
    assert store.next_end() is None


@pytest.mark.parametrize("bad", ['"soon"', "NaN", "Infinity", "true"])
def test_a_bad_end_on_disk_is_an_error_naming_the_rule(config, bad):
    store = PolicyStore(config)
    store.add("s1", "http", "grant.test", until=1000.0)
    path = store.runtime_dir / "s1.json"
    path.write_text(path.read_text().replace("1000.0", bad))
    with pytest.raises(ConfigError, match=r"rules\[0\]\.expires"):
        PolicyStore(config)


def test_a_rule_whose_end_passed_while_the_filter_was_down_is_not_in_force_at_load(config):
    import time

    store = PolicyStore(config)
    store.add("s1", "http", "past.test", until=time.time() - 1)
    store.add("s1", "http", "future.test", until=time.time() + 3600)
    again = PolicyStore(config)
    policy = again.sessions["s1"].policy
    assert not policy.decide_http(parse_host("past.test"), 443).allowed
    assert policy.decide_http(parse_host("future.test"), 443).allowed
    due = again.plan_expire(time.time()).result  # still to take back, with its event
    assert [(session, rule.text) for session, rule in due] == [("s1", "past.test")]
