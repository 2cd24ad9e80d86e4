"""Approvals without sockets: the book (coalescing, bounds, decisions, expiry), the holds
(a future per approval, a hold that runs out, a session that ends), the approval rule in
policies and in the store's runtime layer."""

from __future__ import annotations

import asyncio
import re

import pytest

from appliance.filter.approvals import (
    ApprovalError,
    Approvals,
    Holds,
    approvable,
    clean,
    grant_of,
)
from appliance.policy import (
    ConfigError,
    Decision,
    Policy,
    Rule,
    RuleError,
    parse_host,
    parse_policy,
)
from appliance.policystore import PolicyStore
from tests.unit.filter.test_changes import config  # noqa: F401  (a fixture)

DEFAULT_DENY = Policy([Rule.parse("http", "a.test")]).decide_http(parse_host("b.test"), 443)


def test_only_what_the_default_alone_denies_can_be_approved():
    policy = Policy([Rule.parse("http", "a.test"), Rule.parse("deny", "bad.test"),
                     Rule.parse("host", "8080")])
    assert approvable(DEFAULT_DENY) and grant_of(DEFAULT_DENY) == ("http", "b.test:443")
    assert approvable(policy.decide_dns(parse_host("c.test")))
    assert grant_of(policy.decide_dns(parse_host("c.test"))) == ("dns", "c.test")
    assert not approvable(policy.decide_http(parse_host("a.test"), 443))  # allowed
    assert not approvable(policy.decide_http(parse_host("bad.test"), 443))  # a deny rule
    assert not approvable(policy.decide_host_port(9))  # the VM host's ports
    placeholder = policy.decide_http(parse_host("corral-secret-x-abc.test"), 443)
    assert not placeholder.allowed and not approvable(placeholder)


def test_asks_for_one_target_coalesce_and_a_session_has_a_bound():
    book = Approvals(max_pending=2, keep=10)
    first, new = book.ask("s1", "http", "b.test:443", "why", "proxy", now=0)
    again, new_again = book.ask("s1", "http", "b.test:443", "why", "proxy", now=1)
    assert new and not new_again and again is first and first.asked == 2
    other, _ = book.ask("s2", "http", "b.test:443", "why", "proxy", now=1)  # another session
    assert other.id != first.id
    book.ask("s1", "http", "c.test:443", "why", "dns", now=1)
    assert book.ask("s1", "http", "d.test:443", "why", "proxy", now=1) == (None, False)
    assert [a["target"] for a in book.listing("s1")] == ["b.test:443", "c.test:443"]


def test_decisions_are_checked_and_take_the_approval():
    book = Approvals()
    pending, _ = book.ask("s1", "http", "b.test:443", "why", "proxy")
    with pytest.raises(ApprovalError, match="no request is waiting"):
        book.take(pending.id, "once")
    with pytest.raises(ApprovalError, match="grant 'always'"):
        book.take(pending.id, "always")
    pending.waiting = 1
    assert book.take(pending.id, "once") is pending
    with pytest.raises(ApprovalError, match=f"no pending approval '{pending.id}'"):
        book.take(pending.id, None)
    fresh, new = book.ask("s1", "http", "b.test:443", "why", "proxy")
    assert new and fresh.id != pending.id  # decided: the next ask is a new approval


def test_an_approval_nobody_waits_for_expires_and_a_session_takes_its_own():
    book = Approvals(keep=10)
    old, _ = book.ask("s1", "http", "b.test:443", "why", "proxy", now=0)
    held, _ = book.ask("s1", "http", "c.test:443", "why", "proxy", now=0)
    held.held = 1  # something waits for its decision: it does not expire
    book.ask("s2", "http", "b.test:443", "why", "proxy", now=5)
    assert book.expire(now=10) == [old]
    assert {p.session for p in book.forget("s1")} == {"s1"}
    assert [a["session"] for a in book.listing()] == ["s2"]


def test_untrusted_text_is_one_printable_ascii_line_and_bounded():
    assert clean("ok\x1b[31m\nnext\u202e") == "ok?[31m?next?"
    assert len(clean("x" * 5000)) == 300


def test_a_held_request_learns_the_decision_or_runs_out():
    async def scenario():
        events = []
        holds = Holds(events.append)
        pending = holds.ask("s1", DEFAULT_DENY, "proxy", "10.0.0.2:5000", "b.test", 443)
        assert holds.ask("s1", DEFAULT_DENY, "proxy") is pending
        waiting = [asyncio.create_task(holds.wait(pending, 5)) for _ in range(2)]
        await asyncio.sleep(0)
        assert pending.waiting == 2
        holds.decide(pending.id, "once", "tester")
        verdicts = await asyncio.gather(*waiting)
        assert {v.grant for v in verdicts} == {"once"} and pending.waiting == 0
        assert verdicts[0].reason == "approved by tester: once"
        assert [e["action"] for e in events] == ["pending", "approved"]
        assert events[0]["verdict"] == "pending" and events[1]["by"] == "tester"

        late = holds.ask("s1", DEFAULT_DENY, "proxy")
        verdict = await holds.wait(late, 0.05)
        assert verdict.grant is None and "no decision within 0.05s" in verdict.reason
        assert late.waiting == 0 and holds.book.pending[late.id] is late

        cancelled = asyncio.create_task(holds.wait(late, 5))
        await asyncio.sleep(0)
        cancelled.cancel()  # the connection ended (or the filter stops): it must propagate
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert late.waiting == 0

        ended = asyncio.create_task(holds.wait(late, 5))
        await asyncio.sleep(0)
        holds.forget("s1")
        assert (await ended).reason == "session s1 ended" and not holds.book.pending
    asyncio.run(scenario())


def test_a_request_whose_client_left_stops_waiting_and_the_approval_stays(monkeypatch):
    monkeypatch.setattr("appliance.filter.approvals.GONE_POLL", 0.01)

    async def scenario():
        holds = Holds(lambda event: None)
        pending = holds.ask("s1", DEFAULT_DENY, "proxy")
        left = {"now": False}
        staying = asyncio.create_task(holds.wait(pending, 5, gone=lambda: False))
        leaving = asyncio.create_task(holds.wait(pending, 5, gone=lambda: left["now"]))
        await asyncio.sleep(0.05)
        assert pending.waiting == 2
        left["now"] = True
        verdict = await asyncio.wait_for(leaving, 1)
        assert verdict.grant is None and verdict.reason.startswith("the client left")
        assert pending.waiting == 1 and holds.book.pending[pending.id] is pending
        holds.decide(pending.id, "once", "tester")  # the one still there is let through
        assert (await staying).grant == "once"
    asyncio.run(scenario())


def test_the_approval_rule_parses_and_the_most_specific_layer_wins():
    assert Rule.parse("approval", "ask").hold == 60
    assert Rule.parse("approval", "ask 5s").text == "ask 5"
    assert Rule.parse("approval", "deny").hold is None
    for bad in ("maybe", "ask 0", "ask 601", "ask soon", "ask 5 6"):
        with pytest.raises(RuleError, match="expected 'deny', 'ask', 'ask SECONDS'"):
            Rule.parse("approval", bad)
    policy = Policy([Rule.parse("approval", "ask 30", "appliance"),
                     Rule.parse("approval", "deny", "project"),
                     Rule.parse("approval", "ask 9", "appliance")])
    assert policy.hold is None  # the project's deny wins over the appliance's ask
    assert Policy([Rule.parse("approval", "deny", "project"),
                   Rule.parse("approval", "ask 9", "session")]).hold == 9
    assert Policy([]).hold is None


def test_corral_toml_approval_table():
    rules = parse_policy('[approval]\nmode = "ask"\nhold = 20\n', "c.toml", "project").rules
    assert [(r.kind, r.text, r.layer) for r in rules] == [("approval", "ask 20", "project")]
    assert parse_policy('[approval]\nmode = "deny"\n', "c.toml", "project").rules[0].hold is None
    for text, message in [
        ('[approval]\nmode = "yes"\n', "c.toml:2: [approval] mode: 'yes': expected \"ask\""),
        ('[approval]\nmode = "deny"\nhold = 5\n', "[approval] hold: a whole number"),
        ('[approval]\nmode = "ask"\nhold = 9000\n', "[approval] hold: approval rule 'ask 9000'"),
        ('[approval]\nwait = 5\n', "c.toml:2: [approval] wait: unknown key"),
        ('approval = "ask"\n', "[approval] mode = \"ask\""),
    ]:
        with pytest.raises(ConfigError) as raised:
            parse_policy(text, "c.toml", "project")
        assert message in str(raised.value), str(raised.value)


def test_a_runtime_approval_rule_replaces_the_one_before(config):  # noqa: F811
    store = PolicyStore(config)
    store.add("s1", "approval", "ask 30")
    _, added = store.add("s1", "approval", "ask 30")
    assert not added
    store.add("s1", "approval", "deny", until=None)
    store.add("s1", "http", "kept.test")
    assert [r.text for r in store.sessions["s1"].runtime] == ["deny", "kept.test"]
    assert store.sessions["s1"].policy.hold is None
    store.add("s1", "approval", "ask", until=4102444800.0)
    session = store.sessions["s1"]
    assert [r.text for r in session.runtime] == ["kept.test", "ask"]
    assert session.policy.hold == 60 and list(session.expires) == [("approval", "ask")]


def test_a_decision_carries_its_hint_for_the_grant():
    decision = Decision(False, "b.test is not in the tcp policy", None,
                        "corral allow-tcp b.test:22")
    assert approvable(decision) and grant_of(decision) == ("tcp", "b.test:22")


def test_an_agents_ask_parses_or_says_what_is_wrong():
    from appliance.filter.approvals import parse_agent_ask

    ask = parse_agent_ask("/?host=Docs.Example.org:8443&reason=the+API+docs%0a%1b[2J&wait=30")
    assert (str(ask.host), ask.port, ask.kind, ask.wait) == ("docs.example.org", 8443, "http", 30)
    assert ask.reason == "the API docs??[2J"
    assert parse_agent_ask("/?host=git.test:22&kind=tcp&reason=ssh").kind == "tcp"
    assert parse_agent_ask("?host=[2001:db8::1]:443&reason=x").port == 443
    for path, message in [
        ("/other?host=a.test&reason=x", "ask at http://request.corral/?host="),
        ("/?host=a.test", "say why"),
        ("/?reason=x", "name the host"),
        ("/?host=a.test&reason=x&host=b.test", "field 'host' given twice"),
        ("/?host=a.test&reason=x&grant=session", "unknown field 'grant'"),
        ("/?host=a.test&reason=x&kind=udp", "kind 'udp'"),
        ("/?host=a.test&reason=x&wait=9999", "wait: a whole number of seconds"),
        ("/?host=a.test&reason=x&wait=-1", "wait: a whole number of seconds"),
        ("/?host=a.test:+5&reason=x", "is not a number"),
        ("/?host=a.test:99999&reason=x", "out of range"),
        ("/?host=-bad-.test&reason=x", "host '-bad-.test'"),
        ("/?host=a.test&kind=tcp&reason=x", "a tcp request names its port"),
        ("/?host=a.test:53&kind=dns&reason=x", "a dns request names a host without a port"),
        ("/?" + "&".join(f"f{i}=1" for i in range(20)), "does not parse"),
    ]:
        with pytest.raises(ApprovalError, match=re.escape(message)):
            parse_agent_ask(path)


def test_a_403_tells_the_agent_how_to_ask_only_when_a_person_could_grant_it():
    from appliance.filter.approvals import request_hint

    assert request_hint(DEFAULT_DENY) == ("curl -sS 'http://request.corral/?host=b.test:443"
                                          "&reason=WHY+YOU+NEED+IT&wait=60'")
    tcp = Policy([]).decide_tcp(parse_host("git.test"), 22)
    assert "host=git.test:22&kind=tcp&" in request_hint(tcp)
    denied = Policy([Rule.parse("deny", "bad.test")]).decide_http(parse_host("bad.test"), 443)
    assert request_hint(denied) is None
    own = Policy([]).decide_http(parse_host("request.corral"), 443)
    assert not approvable(own) and request_hint(own) is None


def test_an_ip_literal_is_never_approvable():
    """A rule naming a literal opens it even in a blocked range (metadata, LAN, the VM
    host): only a person typing `corral allow-*` may write one."""
    policy = Policy([])
    for host, port in (("169.254.169.254", 80), ("10.0.0.1", 443), ("2001:db8::1", 443),
                       ("93.184.216.34", 443)):
        decision = policy.decide_http(parse_host(host), port)
        assert not decision.allowed and decision.hint.startswith("corral allow-http")
        assert not approvable(decision), host
    assert not approvable(policy.decide_tcp(parse_host("10.1.2.3"), 22))
    assert not approvable(policy.decide_dns(parse_host("1.2.3.4")))
    assert Rule.parse("approval", "ask 7s").hold == 7
    with pytest.raises(RuleError):
        Rule.parse("approval", "ask \N{SUPERSCRIPT TWO}")  # a digit to isdigit(), not to int()


def test_a_claimed_approval_is_the_claimers_and_expiry_leaves_no_future_behind():
    async def scenario():
        holds = Holds(lambda e: None, Approvals(keep=0.0))
        pending = holds.ask("s1", DEFAULT_DENY, "proxy")
        claimed = holds.book.claim(pending.id, "session")
        with pytest.raises(ApprovalError, match="being decided by another request"):
            holds.book.check(pending.id, None)
        assert holds.book.expire() == []  # a claimed one does not expire meanwhile
        holds.book.release(claimed)
        holds.book.claim(pending.id, "session")
        holds.decide(pending.id, "session", "tester", claimed=True)
        assert not holds.book.pending

        for i in range(20):  # each times out, then expires: its future goes with it
            late = holds.ask("s1", DEFAULT_DENY._replace(hint=f"corral allow-http n{i}.test"),
                             "proxy")
            assert (await holds.wait(late, 0.001)).grant is None
            holds.expire()
        assert not holds.book.pending and not holds._decided
    asyncio.run(scenario())


def test_settling_releases_held_requests_when_the_policy_decides_for_the_person():
    async def scenario():
        events = []
        holds = Holds(events.append)
        allowed, denied, off, stays = (
            holds.ask("s1", DEFAULT_DENY._replace(hint=f"corral allow-http {n}.test:443"),
                      "proxy") for n in ("allowed", "denied", "off", "stays"))
        waits = {p.id: asyncio.create_task(holds.wait(p, 5)) for p in (allowed, denied, off)}
        await asyncio.sleep(0)
        holds.settle(lambda p: {allowed.id: (True, "a rule allows it now"),
                                denied.id: (False, "a deny rule covers it"),
                                off.id: (None, "ask mode was turned off")}.get(p.id,
                                                                              (None, "")))
        results = {k: await t for k, t in waits.items()}
        assert results[allowed.id].grant == "policy"
        assert results[denied.id].grant is None and "deny rule" in results[denied.id].reason
        assert results[off.id].reason == "ask mode was turned off"
        assert set(holds.book.pending) == {off.id, stays.id}  # still for a person to grant
        settled = [e for e in events if e.get("action") == "settled"]
        assert {e["approval"] for e in settled} == {allowed.id, denied.id}
    asyncio.run(scenario())


def test_an_agent_waiting_keeps_its_approval_open_but_is_no_request_to_let_through():
    async def scenario():
        holds = Holds(lambda e: None, Approvals(keep=0.0))
        pending = holds.ask("s1", DEFAULT_DENY, "agent")
        waiting = asyncio.create_task(holds.wait(pending, 5, counted=False))
        await asyncio.sleep(0)
        assert pending.held == 1 and pending.waiting == 0
        holds.expire()
        assert pending.id in holds.book.pending  # not expired under the agent
        with pytest.raises(ApprovalError, match="no request is waiting"):
            holds.book.check(pending.id, "once")
        holds.decide(pending.id, None, "tester")
        assert (await waiting).reason == "refused by tester"
        assert not approvable(Policy([]).decide_http(parse_host("corral"), 443))
    asyncio.run(scenario())


def test_learning_open_allows_what_a_person_could_approve_and_nothing_else():
    rules = [Rule.parse("http", "a.test"), Rule.parse("deny", "evil.test", "session"),
             Rule.parse("approval", "open", "session", "api")]
    policy = Policy(rules)
    assert policy.learning_open
    learned = policy.decide_http(parse_host("new.test"), 8443)
    assert learned.allowed and learned.rule is None
    assert learned.hint == "corral allow-http new.test:8443"
    assert learned.reason.startswith("learning (open): new.test is not in the http policy")
    assert policy.decide_dns(parse_host("new.test")).allowed
    # never the firewall: direct tcp still needs a rule (and a revoked one is taken back)
    assert not policy.decide_tcp(parse_host("new.test"), 22).allowed
    for host, port in (("evil.test", 443), ("x.evil.test", 443), ("10.0.0.1", 443),
                       ("169.254.169.254", 80), ("metadata.corral", 80),
                       ("corral-secret-x-0123.test", 443)):
        assert not policy.decide_http(parse_host(host), port).allowed, host
    assert not policy.decide_dns(parse_host("evil.test")).allowed
    assert not Policy(rules[:2]).decide_http(parse_host("new.test"), 443).allowed
    for layer in ("project", "appliance", "default"):  # a file can never say it
        with pytest.raises(RuleError, match="only for a running session"):
            Rule.parse("approval", "open", layer, "corral.toml")
    with pytest.raises(ConfigError, match="mode"):
        parse_policy('[approval]\nmode = "open"\n', "corral.toml", "project")


SUBNETS = {"s1": "10.1.0.0/24", "s2": "10.2.0.0/24"}.__getitem__


def dumped(book: Approvals, now: float, wall: float) -> bytes:
    return Approvals.encode(book.snapshot(SUBNETS, now=now, wall=wall))


def test_open_approvals_are_written_down_and_read_back_across_a_restart():
    book = Approvals(max_pending=2, keep=600)
    first, _ = book.ask("s1", "http", "a.test:443", "not named", "agent", now=100.0,
                        note="the docs")
    changes = book.changes
    book.ask("s1", "http", "a.test:443", "not named", "proxy", now=150.0)
    assert book.changes == changes and book.touched == 1  # asked again: only touched
    old, _ = book.ask("s1", "dns", "old.test", "not named", "dns", now=0.0)
    other, _ = book.ask("s2", "tcp", "b.test:22", "not named", "agent", now=100.0)
    data = dumped(book, now=200.0, wall=10_000.0)
    # a new process: another monotonic clock; s2 is gone, `old` past its keep by then
    again = Approvals(max_pending=2, keep=600)
    restored = again.restore(data, {"s1": "10.1.0.0/24"}, now=5.0, wall=10_450.0)
    assert [p.id for p in restored] == [first.id]
    (back,) = again.pending.values()
    assert (back.target, back.note, back.asked, back.origin) == ("a.test:443", "the docs", 2,
                                                                  "agent")
    assert back.last == pytest.approx(5.0 - 500.0)  # asked 500 s of wall time ago
    assert again.expire(now=5.0 + 99.0) == [] and again.expire(now=5.0 + 101.0) == [back]
    assert old.id not in again.pending and other.id not in again.pending
    # asking again joins the restored approval, it does not open a second one
    again.restore(data, {"s1": "10.1.0.0/24"}, now=5.0, wall=10_450.0)
    joined, new = again.ask("s1", "http", "a.test:443", "not named", "proxy", now=6.0)
    assert joined.id == first.id and not new and len(again.pending) == 1


def test_a_session_of_the_same_name_made_later_does_not_inherit_approvals():
    book = Approvals()
    book.ask("s1", "http", "a.test:443", "not named", "agent", now=0.0, note="urgent")
    data = dumped(book, now=0.0, wall=1000.0)
    later = Approvals()
    assert later.restore(data, {"s1": "10.9.0.0/24"}, now=0.0, wall=1001.0) == []


def test_a_clock_set_back_counts_as_just_asked_and_the_bound_holds():
    book = Approvals(max_pending=3)
    for i in range(3):
        book.ask("s1", "http", f"n{i}.test:443", "not named", "agent", now=0.0)
    data = dumped(book, now=0.0, wall=5000.0)
    smaller = Approvals(max_pending=2)
    restored = smaller.restore(data, {"s1": "10.1.0.0/24"}, now=0.0, wall=4000.0)
    assert len(restored) == 2  # the clock went back 1000 s: kept, within the bound
    assert all(p.last == 0.0 for p in restored)


def test_closing_an_approval_is_told_at_once():
    book = Approvals()
    told = []
    book.on_close = lambda: told.append(len(book.pending))
    pending, _ = book.ask("s1", "http", "a.test:443", "not named", "agent", now=0.0)
    assert told == []
    book.take(pending.id, None)
    assert told == [0]


GOOD = ('{"id": "ap-00000000", "session": "s1", "kind": "http", "target": "a.test", '
        '"why": "", "origin": "agent", "note": "", "identity": "10.1.0.0/24", '
        '"created": 1, "last": 1, "asked": 1}')


@pytest.mark.parametrize(("change", "error"), [
    (("\"id\": \"ap-00000000\"", "\"id\": \"ap-1\""), "id 'ap-1' is not an approval id"),
    (("\"kind\": \"http\"", "\"kind\": \"allow\""), "kind 'allow' is not one of"),
    (("\"target\": \"a.test\"", "\"target\": \"a b.test:x\""), "not a valid host name"),
    (("\"target\": \"a.test\"", "\"target\": \"a.test:70000\""), "not a port number"),
    (("\"kind\": \"http\"", "\"kind\": \"tcp\""), "a tcp target names its port"),
    (("\"origin\": \"agent\"", "\"origin\": \"person\""), "origin 'person' is not"),
    (("\"last\": 1", "\"last\": true"), "last is not a finite number"),
    (("\"asked\": 1", "\"asked\": 1e999"), "asked is not a finite number"),
    (("\"created\": 1", "\"created\": -5"), "created is not a finite number"),
    (("\"session\": \"s1\", ", ""), "session is not a string"),
])
def test_a_bad_approvals_file_restores_nothing_and_says_what_is_wrong(change, error):
    fine = GOOD.replace("ap-00000000", "ap-11111111").replace("a.test", "fine.test")
    bad = GOOD.replace(*change)
    text = f'{{"version": 1, "approvals": [{fine}, {bad}]}}'
    book = Approvals()
    with pytest.raises(ValueError, match=re.escape("approvals[1].") + ".*" + re.escape(error)):
        book.restore(text.encode(), {"s1": "10.1.0.0/24"}, now=0.0, wall=1.0)
    assert book.pending == {}  # the good one before it is not taken in either
    assert Approvals().restore(f'{{"version": 1, "approvals": [{fine}]}}'.encode(),
                               {"s1": "10.1.0.0/24"}, now=0.0, wall=1.0)  # it was good


@pytest.mark.parametrize(("text", "error"), [
    ("[]", "not a version 1 approvals file"),
    ('{"version": 1, "approvals": {}}', "'approvals' is not a list"),
    ("[" * 100_000, "nested too deeply"),
    (" " * (9 << 20), "larger than"),
])
def test_a_file_that_is_not_an_approvals_file_is_named_so(text, error):
    with pytest.raises(ValueError, match=error):
        Approvals().restore(text.encode(), {}, now=0.0, wall=1.0)


def test_a_once_grant_that_finds_every_client_gone_is_refused_and_lets_nothing_through(
        monkeypatch):
    """The client left a moment ago, before the half-second look noticed: the grant asks
    each held request's client itself, finds nobody, and says so; the approval stays."""
    monkeypatch.setattr("appliance.filter.approvals.GONE_POLL", 60.0)

    async def scenario():
        holds = Holds(lambda event: None)
        pending = holds.ask("s1", DEFAULT_DENY, "proxy")
        left = {"now": False}
        held = asyncio.create_task(holds.wait(pending, 5, gone=lambda: left["now"]))
        await asyncio.sleep(0)
        left["now"] = True  # gone, and no poll has seen it yet
        with pytest.raises(ApprovalError, match="left before the grant"):
            holds.claim(pending.id, "once")
        assert holds.book.pending[pending.id] is pending and not pending.deciding
        assert not held.done()  # still held: it learns at its next look, not from a grant
        holds.decide(pending.id, None, "tester")
        assert (await held).grant is None
    asyncio.run(scenario())


def test_a_grant_lets_through_only_the_requests_whose_client_is_still_there():
    """Counted when the grant is taken (what `corral approve` reports), and asked again
    when each request takes its turn: one that left in between dials nothing."""
    async def scenario():
        holds = Holds(lambda event: None)
        pending = holds.ask("s1", DEFAULT_DENY, "proxy")
        there = {"a": True, "b": True, "c": False}
        waits = {k: asyncio.create_task(holds.wait(pending, 5, gone=lambda k=k: not there[k]))
                 for k in there}
        await asyncio.sleep(0)
        holds.claim(pending.id, "once")
        released = holds.decide(pending.id, "once", "tester", claimed=True)
        assert released == 2  # a and b: c had left already
        there["b"] = False  # b goes before its turn comes
        verdicts = {k: await t for k, t in waits.items()}
        assert verdicts["a"].grant == "once"
        assert verdicts["b"].grant is None and "left" in verdicts["b"].reason
        assert verdicts["c"].grant is None and "left" in verdicts["c"].reason
    asyncio.run(scenario())
