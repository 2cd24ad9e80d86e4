"""The ledger of who taught each learned element: pure, no clock, no I/O."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.firewall.ledger import NAMES_MAX, Ledger
from appliance.policy import Decision

S1, S2 = "10.213.1.2", "10.213.2.2"
SSH = (S1, "203.0.113.22", 22)
DB = (S1, "203.0.113.30", 5432)


def judge_by(allowed: set[tuple[str, str, int]]):
    """A judge that allows exactly (session, name, port) in `allowed`, and says whom it saw."""
    seen = []

    def judge(session, key, name):
        seen.append((session, key, name))
        if (session, name, key[2]) in allowed:
            return Decision(True, f"{name}:{key[2]} allowed")
        return Decision(False, f"{name} is not in the tcp policy")

    judge.seen = seen
    return judge


def test_an_element_no_name_allows_is_doomed_with_the_reason():
    ledger = Ledger()
    ledger.record("s1", "ssh.test", SSH, 100.0)
    ledger.record("s1", "db.test", DB, 100.0)
    doomed = ledger.doomed(judge_by({("s1", "db.test", 5432)}))
    assert [(r.key, r.session, r.names) for r in doomed] == [(SSH, "s1", ("ssh.test",))]
    assert doomed[0].decision.reason == "ssh.test is not in the tcp policy"
    ledger.forget(r.key for r in doomed)
    assert set(ledger.elements) == {DB} and ledger.held["s1"] == 1


def test_an_element_stays_while_any_name_that_taught_it_is_allowed():
    ledger = Ledger()
    for name in ("a.cdn.test", "b.cdn.test"):  # two names of one CDN, one address
        ledger.record("s1", name, SSH, 100.0)
    assert ledger.doomed(judge_by({("s1", "b.cdn.test", 22)})) == []
    (revoked,) = ledger.doomed(judge_by(set()))
    assert revoked.names == ("a.cdn.test", "b.cdn.test")


def test_names_per_element_are_bounded_and_the_oldest_is_forgotten_first():
    """Past NAMES_MAX an old name is forgotten: the element may then be taken back while
    the forgotten name would still allow it: closed, never open."""
    ledger = Ledger()
    for i in range(NAMES_MAX + 3):
        ledger.record("s1", f"n{i}.test", SSH, 100.0)
    ledger.record("s1", "n3.test", SSH, 100.0)  # taught again: the newest now
    names = list(ledger.elements[SSH].names)
    assert len(names) == NAMES_MAX and names[-1] == "n3.test" and "n0.test" not in names
    assert len(ledger.doomed(judge_by({("s1", "n0.test", 22)}))) == 1


def test_a_session_at_its_share_learns_no_more_and_no_other_session_is_touched():
    ledger = Ledger(per_session=2)
    ledger.record("s1", "a.test", (S1, "192.0.2.1", 22), 100.0)
    ledger.record("s1", "b.test", (S1, "192.0.2.2", 22), 100.0)
    assert not ledger.room("s1", (S1, "192.0.2.3", 22))
    assert ledger.room("s1", (S1, "192.0.2.1", 22))  # refreshing what it holds: always
    assert ledger.room("s2", (S2, "192.0.2.3", 22))
    ledger.expire(100.0)
    assert ledger.room("s1", (S1, "192.0.2.3", 22))  # its elements timed out


def test_an_element_is_forgotten_in_the_second_it_expires_and_a_refresh_moves_it():
    ledger = Ledger()
    ledger.record("s1", "ssh.test", SSH, 60.2)
    ledger.record("s1", "db.test", DB, 60.2)
    ledger.record("s1", "db.test", DB, 120.5)  # taught again: the kernel's timeout restarts
    assert ledger.expire(60.0) == 0 and len(ledger) == 2  # 60.2 > 60: still in the set
    assert ledger.expire(61.0) == 1 and set(ledger.elements) == {DB}
    assert ledger.expire(121.0) == 1 and len(ledger) == 0 and not ledger.held


def test_refreshing_one_element_over_and_over_keeps_one_bucket_entry():
    """The work `expire` does is bounded by the elements held, not by the answers seen."""
    ledger = Ledger()
    for i in range(10_000):
        ledger.record("s1", "ssh.test", SSH, 100.0 + i * 0.5)
    assert sum(len(keys) for keys in ledger._buckets.values()) == 1
    assert ledger.expire(1e9) == 1


def test_an_address_that_changes_hands_belongs_to_the_session_that_taught_it_last():
    ledger = Ledger()
    ledger.record("old", "ssh.test", SSH, 100.0)
    ledger.record("s1", "other.test", SSH, 100.0)
    assert ledger.elements[SSH].session == "s1" and list(ledger.elements[SSH].names) == [
        "other.test"]
    assert ledger.held == {"s1": 1}


def test_live_elements_carry_their_whole_seconds_left_for_their_sessions_only():
    ledger = Ledger()
    ledger.record("s1", "ssh.test", SSH, 100.2)
    ledger.record("s2", "ssh.test", (S2, "203.0.113.22", 22), 100.2)
    ledger.record("s1", "db.test", DB, 40.0)
    assert ledger.live(50.0, {"s1"}) == [(SSH, 51)]  # never less than nftables keeps it


def test_the_judge_is_asked_about_each_element_with_its_session_and_names():
    ledger = Ledger()
    ledger.record("s1", "ssh.test", SSH, 100.0)
    judge = judge_by(set())
    ledger.doomed(judge)
    assert judge.seen == [("s1", SSH, "ssh.test")]


KEYS = st.tuples(st.sampled_from([S1, S2]), st.sampled_from(["192.0.2.1", "192.0.2.2"]),
                 st.sampled_from([22, 5432]))
OPS = st.lists(st.one_of(
    st.tuples(st.just("record"), st.sampled_from(["s1", "s2"]), st.sampled_from(
        ["a.test", "b.test"]), KEYS, st.floats(1, 50)),
    st.tuples(st.just("expire"), st.floats(0, 30)),
    st.tuples(st.just("forget"), KEYS),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_the_ledger_holds_exactly_what_a_naive_model_holds(ops):
    """Against a dict scanned in full at every step: the same elements, sessions, counts."""
    ledger, model, now = Ledger(), {}, 0.0
    for op in ops:
        if op[0] == "record":
            _, session, name, key, ttl = op
            ledger.record(session, name, key, now + ttl)
            if key in model and model[key][0] != session:
                del model[key]
            model[key] = (session, now + ttl)
        elif op[0] == "expire":
            now += op[1]
            ledger.expire(now)
            # the ledger forgets an element once its whole second has passed
            model = {k: v for k, v in model.items() if math.ceil(v[1]) > math.floor(now)}
        else:
            ledger.forget([op[1]])
            model.pop(op[1], None)
        assert {k: (e.session, e.expires) for k, e in ledger.elements.items()} == model
        held = {}
        for session, _ in model.values():
            held[session] = held.get(session, 0) + 1
        assert dict(ledger.held) == held


def test_an_element_recorded_already_expired_is_still_forgotten_by_the_next_sweep():
    ledger = Ledger()
    ledger.expire(100.0)
    ledger.record("s1", "ssh.test", SSH, 90.0)  # a clock that went wrong: never held forever
    ledger.record("s1", "ssh.test", SSH, 95.0)
    assert ledger.expire(101.0) == 1 and len(ledger) == 0 and not ledger._buckets
