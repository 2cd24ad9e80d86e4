"""The learned set's edge: the ledger, nftables and conntrack kept in step under one lock.

nftables and conntrack stand in as recorders here (what was asked of them, in what order);
the real ones answer in tests/e2e/test_tcp_revoke.py."""

from __future__ import annotations

import threading

import pytest

from appliance.firewall.learned import LearnedSet, Teaching
from appliance.firewall.nft import NftError
from appliance.policy import Decision

S1 = "10.213.1.2"
SSH = (S1, "203.0.113.22", 22)
DB = (S1, "203.0.113.30", 5432)


class Nft:
    def __init__(self, log: list):
        self.log = log
        self.kernel: set = set()
        self.fail: str | None = None

    def _maybe_fail(self, what):
        if self.fail == what:
            raise NftError(f"{what} refused")

    def learn(self, entries):
        self._maybe_fail("learn")
        self.log.append(("learn", [e[:3] for e in entries]))
        self.kernel |= {e[:3] for e in entries}

    def forget(self, keys):
        self._maybe_fail("forget")
        self.log.append(("forget", list(keys)))
        self.kernel -= set(keys)

    def apply(self, commands):
        self._maybe_fail("apply")
        self.log.append(("apply", commands))
        self.kernel = {tuple(e["elem"]["val"]["concat"]) for e in commands}

    def learned_keys(self):
        return set(self.kernel)


class Conntrack:
    def __init__(self, log: list, ended: int = 1):
        self.log, self.ended, self.fail = log, ended, False

    def end(self, flows):
        self.log.append(("end", list(flows)))
        if self.fail:
            raise OSError(1, "conntrack refused")
        return dict.fromkeys(flows, self.ended)


class Policy:
    """Which (session, name, port) may be reached: what the store's policies would say."""

    def __init__(self, *allowed):
        self.allowed = set(allowed)

    def __call__(self, session, key, name):
        if (session, name, key[2]) in self.allowed:
            return Decision(True, "allowed")
        return Decision(False, f"{name} is not in the tcp policy")


@pytest.fixture
def world():
    log: list = []
    policy = Policy(("s1", "ssh.test", 22), ("s1", "db.test", 5432))
    clock = [1000.0]
    learned = LearnedSet(Nft(log), policy, Conntrack(log), clock=lambda: clock[0])
    return learned, policy, log, clock


def teach(name, key, session="s1", timeout=300):
    return Teaching(session, name, key[0], key[1], key[2], timeout)


def test_a_policy_change_takes_back_what_it_denies_then_ends_its_connections(world):
    learned, policy, log, _ = world
    learned.learn([teach("ssh.test", SSH), teach("db.test", DB)])
    policy.allowed.discard(("s1", "ssh.test", 22))
    (cut,) = learned.revoke()
    assert cut.revoked.key == SSH and cut.revoked.names == ("ssh.test",)
    assert cut.connections == 1 and cut.error is None
    assert log[-2:] == [("forget", [SSH]), ("end", [SSH])]  # the element first, then flows
    assert learned.nft.kernel == {DB} and set(learned.ledger.elements) == {DB}
    assert learned.revoke() == []  # nothing more to take back


def test_an_answer_decided_under_a_policy_since_changed_teaches_nothing(world):
    """The DNS filter judged the name before it waited for its upstream; the policy changed
    meanwhile. Judged again under the lock, nothing reaches nftables."""
    learned, policy, _, _ = world
    policy.allowed.clear()
    result = learned.learn([teach("ssh.test", SSH)])
    assert result.taught == [] and "ssh.test is not in the tcp policy" in result.refused
    assert learned.nft.kernel == set() and len(learned.ledger) == 0


def test_a_session_at_its_share_is_refused_and_says_so(world):
    learned, _, _, _ = world
    learned.ledger.per_session = 1
    result = learned.learn([teach("ssh.test", SSH), teach("db.test", DB)])
    assert [t.key for t in result.taught] == [SSH]
    assert "holds 1 learned allowances already" in result.refused
    assert learned.nft.kernel == {SSH}


def test_nothing_is_recorded_when_nftables_refuses_to_learn(world):
    learned, _, _, _ = world
    learned.nft.fail = "learn"
    with pytest.raises(NftError):
        learned.learn([teach("ssh.test", SSH)])
    assert len(learned.ledger) == 0


def test_what_nftables_refused_to_take_back_is_taken_back_by_the_next_change(world):
    learned, policy, log, _ = world
    learned.learn([teach("ssh.test", SSH)])
    policy.allowed.clear()
    learned.nft.fail = "forget"
    with pytest.raises(NftError):
        learned.revoke()
    assert SSH in learned.ledger.elements and not any(e[0] == "end" for e in log)
    learned.nft.fail = None
    assert [c.revoked.key for c in learned.revoke()] == [SSH]


def test_connections_that_cannot_be_ended_are_reported_and_the_element_is_gone(world):
    learned, policy, _, _ = world
    learned.learn([teach("ssh.test", SSH)])
    policy.allowed.clear()
    learned.conntrack.fail = True
    (cut,) = learned.revoke()
    assert cut.error == "connections not ended: [Errno 1] conntrack refused"
    assert learned.nft.kernel == set() and len(learned.ledger) == 0


def test_a_new_ruleset_carries_over_the_ledgers_live_elements_of_its_sessions(world):
    learned, policy, log, clock = world
    policy.allowed.add(("other", "db.test", 5432))
    learned.learn([teach("ssh.test", SSH, timeout=60)])
    learned.learn([teach("db.test", ("10.213.9.2", *DB[1:]), session="other")])
    assert len(learned.ledger) == 2
    clock[0] += 10
    assert learned.apply(lambda elements: elements, {"s1"}) == []
    assert log[-1] == ("apply", [{"elem": {"val": {"concat": list(SSH)}, "timeout": 50}}])


def test_an_element_learned_while_a_ruleset_is_built_is_not_lost(world):
    """The ruleset is built and loaded under the learned set's lock: a DNS answer arriving
    meanwhile teaches after the load, not between the read and the load."""
    learned, _, log, _ = world
    building, learned_meanwhile = threading.Event(), threading.Event()

    def build(elements):
        building.set()
        assert not learned_meanwhile.wait(0.3)  # the learn below is held at the lock
        return elements

    applying = threading.Thread(target=learned.apply, args=(build, {"s1"}))
    applying.start()
    building.wait(5)
    learning = threading.Thread(target=lambda: (learned.learn([teach("ssh.test", SSH)]),
                                                learned_meanwhile.set()))
    learning.start()
    applying.join(5)
    learning.join(5)
    assert [entry[0] for entry in log] == ["apply", "learn"]
    assert learned.nft.kernel == {SSH}


def test_at_start_up_what_a_previous_filter_left_is_dropped_and_its_flows_ended(world):
    learned, _, log, _ = world
    learned.nft.kernel = {SSH}  # in the set before this filter learned anything
    (cut,) = learned.apply(lambda elements: elements, {"s1"}, end_strangers=True)
    assert cut.revoked.key == SSH and cut.revoked.session == "" and cut.connections == 1
    assert "the filter restarted" in cut.revoked.decision.reason
    assert log[-2:] == [("apply", []), ("end", [SSH])]
