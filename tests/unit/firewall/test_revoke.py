"""A policy change takes back the learned tcp allowances it no longer gives: the filter's
service judges each element by the names that taught it, under the policy in force, and
records every cut. The real store, bus, DNS filter, service and ledger; nftables and
conntrack are recorders here (tests/e2e/test_tcp_revoke.py has the real ones)."""

from __future__ import annotations

import asyncio

import pytest
from dnslib import QTYPE, RR, A

from appliance.filter.dns.reply import from_dnslib
from appliance.filter.service import Service
from appliance.firewall.learned import LearnedSet
from appliance.policy import Rule
from tests.unit.filterconfig import one_session

from .test_learned import Conntrack, Nft

S1, S3 = "10.213.1.2", "10.213.3.2"
SSH, DB = "203.0.113.22", "203.0.113.30"


@pytest.fixture
def service(tmp_path):
    (tmp_path / "s1.toml").write_text('[tcp]\nallow = ["ssh.test:22", "db.test:5432"]\n')
    config = one_session(tmp_path, session=f'files = ["{tmp_path}/s1.toml"]')
    service = Service(config)
    log: list = []
    learned = LearnedSet(Nft(log), service.reach.may_reach, Conntrack(log, ended=2))
    # the recorders in place of nftables, wherever the learned set is used
    service.learned = service.dns.learner = service.revocation.learned = learned
    service.firewall.learned = learned
    service.log = log
    yield service
    service.blocking.shutdown()


async def learn(service, session, client, name, address, port):
    """What the DNS filter does with an allowed answer for a name a tcp rule covers."""
    rules = [Rule.parse("tcp", f"{name}:{port}", "session")]
    record = from_dnslib(RR(name, QTYPE.A, ttl=300, rdata=A(address)))
    return await service.dns._learn(session, client, name, [record], rules, 300)


async def settle(service):
    """Until the pass that the last change asked for has run (one that never ends fails)."""
    if service.revocation.running is not None:
        try:
            await asyncio.wait_for(service.revocation.running, 10)
        except TimeoutError:
            raise AssertionError("the revocation pass still running after 10s") from None


def cuts(service) -> list[dict]:
    return [e for e in service.bus.recent if e["reason"].startswith("cut:")]


def test_removing_a_tcp_rule_cuts_what_its_name_taught_and_records_it(service):
    store = service.store

    async def main():
        await service.changes.change(lambda: store.plan_add("s1", "tcp", "stream.test:7007"))
        assert (await learn(service, "s1", S1, "stream.test", SSH, 7007)) == {
            "learned": [f"{SSH}:7007"]}
        await learn(service, "s1", S1, "ssh.test", SSH, 22)
        await service.changes.change(lambda: store.plan_remove("s1", "tcp", "stream.test:7007"))
        await settle(service)

    asyncio.run(main())
    (event,) = cuts(service)
    assert event == {**event, "session": "s1", "client": S1, "kind": "firewall",
                     "name": "stream.test", "address": SSH, "port": 7007, "verdict": "deny",
                     "connections": 2, "names": ["stream.test"]}
    assert event["reason"] == (f"cut: s1 -> {SSH}:7007 (stream.test): stream.test is not in "
                               "the tcp policy; 2 connections ended")
    assert ("forget", [(S1, SSH, 7007)]) in service.log
    assert (S1, SSH, 22) in service.learned.ledger.elements  # ssh.test keeps its own


def test_a_deny_that_covers_a_name_a_tcp_rule_allows_cuts_it(service):
    store = service.store

    async def main():
        await learn(service, "s1", S1, "db.test", DB, 5432)
        await service.changes.change(lambda: store.plan_add("s1", "deny", "db.test"))
        await settle(service)

    asyncio.run(main())
    (event,) = cuts(service)
    assert event["address"] == DB and event["rule"] == "db.test" and event["layer"] == "session"
    assert "denied by deny rule db.test" in event["reason"]


def test_a_change_that_still_allows_every_name_cuts_nothing(service):
    store = service.store

    async def main():
        await learn(service, "s1", S1, "ssh.test", SSH, 22)
        await service.changes.change(lambda: store.plan_add("s1", "dns", "unrelated.test"))
        await settle(service)

    asyncio.run(main())
    assert cuts(service) == [] and not any(entry[0] == "forget" for entry in service.log)


def test_a_session_that_goes_loses_every_allowance_and_its_connections(service, tmp_path):
    (tmp_path / "s3.toml").write_text('[tcp]\nallow = ["ssh.test:22"]\n')

    async def main():
        await service.registration.register("s3", "10.213.3.0/24", None,
                                            [str(tmp_path / "s3.toml")])
        await learn(service, "s3", S3, "ssh.test", SSH, 22)
        await learn(service, "s1", S1, "ssh.test", SSH, 22)
        await service.registration.unregister("s3", forget_rules=False)
        await settle(service)

    asyncio.run(main())
    (event,) = cuts(service)
    assert event["session"] == "s3" and event["client"] == S3
    assert event["reason"] == f"cut: s3 -> {SSH}:22 (ssh.test): session s3 is gone; " \
                              "2 connections ended"
    assert set(service.learned.ledger.elements) == {(S1, SSH, 22)}


def test_an_answer_for_a_name_revoked_while_it_waited_teaches_nothing(service):
    """The DNS filter decided with the policy it read when the query came; the rule went
    while the upstream answered. The firewall judges again, with the policy in force."""
    store = service.store

    async def main():
        await service.changes.change(lambda: store.plan_add("s1", "tcp", "late.test:7007"))
        await service.changes.change(lambda: store.plan_remove("s1", "tcp", "late.test:7007"))
        return await learn(service, "s1", S1, "late.test", SSH, 7007)

    result = asyncio.run(main())
    assert result["learned"] == [] and "late.test is not in the tcp policy" in result[
        "not_learned"]
    assert not service.learned.nft.kernel


def test_many_changes_at_once_take_one_pass_each_at_most_and_one_more(service):
    """A pass judges every element: changes that come while one runs ask for one more pass,
    not one each."""
    store = service.store
    passes = []
    revoke = service.learned.revoke
    service.learned.revoke = lambda: passes.append(1) or revoke()

    async def main():
        await learn(service, "s1", S1, "ssh.test", SSH, 22)
        for i in range(20):
            store.commit(store.plan_add("s1", "dns", f"n{i}.test"))  # on the loop, at once
        await settle(service)

    asyncio.run(main())
    assert len(passes) <= 2


def test_a_take_back_nftables_refuses_is_tried_again_until_it_goes_through(service,
                                                                          monkeypatch):
    """No later change is needed: the allowance must not stay until its timeout."""
    from appliance.filter import revocation

    monkeypatch.setattr(revocation, "RETRY", 0.01)
    store = service.store

    async def main():
        await learn(service, "s1", S1, "db.test", DB, 5432)
        service.learned.nft.fail = "forget"
        refused = service.bus.subscribe(verdict="error")
        await service.changes.change(lambda: store.plan_add("s1", "deny", "db.test"))
        await asyncio.wait_for(refused.ready.wait(), 5)
        await asyncio.sleep(0.05)  # a few attempts more, refused too
        service.learned.nft.fail = None  # nftables lets go
        await settle(service)

    asyncio.run(main())
    errors = [e for e in service.bus.recent if e["verdict"] == "error"]
    assert len(errors) == 1 and "trying again" in errors[0]["reason"]
    (event,) = cuts(service)
    assert event["address"] == DB and not service.learned.nft.kernel
