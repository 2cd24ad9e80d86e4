"""Runtime rules granted for a while are taken back when their time comes (expiry.py):
when to look again as a pure function, and the taking back with the real store, the real
change runner and bus. No sockets."""

from __future__ import annotations

import asyncio
import time

import pytest

from appliance.filter.blocking import Blocking
from appliance.filter.changes import Changes
from appliance.filter.events import EventBus
from appliance.filter.expiry import LONGEST_SLEEP, GrantExpiry, due_in
from appliance.filter.firewalled import Firewall
from appliance.policystore import PolicyStore
from tests.unit.filterconfig import one_session


@pytest.mark.parametrize(("end", "now", "wait"), [
    (None, 1000.0, LONGEST_SLEEP),          # nothing granted for a while: a minute at most
    (1000.0, 1000.0, None),                 # its time has come: now
    (999.0, 1000.0, None),                  # passed (while the filter was down): now
    (1000.5, 1000.0, 0.5),                  # soon: until then
    (1000.0 + 3600, 1000.0, LONGEST_SLEEP),  # later: a minute at most (the clock may be set)
])
def test_it_looks_again_at_the_next_end_and_at_least_once_a_minute(end, now, wait):
    assert due_in(end, now) == wait


@pytest.fixture
def parts(tmp_path):
    config = one_session(tmp_path)
    store, bus, blocking = PolicyStore(config), EventBus(), Blocking()
    changes = Changes(store, blocking, Firewall(None, None), manage=False)
    yield store, bus, changes
    blocking.shutdown()


def runtime(store) -> list[str]:
    return [r.text for r in store.sessions["s1"].runtime]


def test_a_grant_whose_time_came_is_taken_back_on_disk_with_an_event(parts):
    store, bus, changes = parts
    expiry = GrantExpiry(store, changes.change, bus)

    async def main():
        await changes.change(lambda: store.plan_add("s1", "dns", "brief.test",
                                                    time.time() + 0.05))
        await changes.change(lambda: store.plan_add("s1", "dns", "kept.test"))
        await expiry.step()  # waits until the end (or a change)
        await expiry.step()  # takes it back

    asyncio.run(asyncio.wait_for(main(), 5))
    assert runtime(store) == ["kept.test"] and store.next_end() is None
    assert "brief.test" not in store._runtime_path("s1").read_text()
    (event,) = [e for e in bus.recent if e["kind"] == "rule"]
    assert event["action"] == "expired" and event["rule"] == "brief.test"
    assert event["verdict"] == "change" and event["session"] == "s1"


def test_a_grant_made_while_it_sleeps_wakes_it(parts):
    """Asleep for up to a minute with nothing granted: a change makes it look again."""
    store, bus, changes = parts
    expiry = GrantExpiry(store, changes.change, bus)
    store.on_change(expiry.changed)

    async def main():
        expired = bus.subscribe(verdict="change")
        expiry.start()
        await asyncio.sleep(0.05)  # asleep: no end to wait for
        await changes.change(lambda: store.plan_add("s1", "dns", "brief.test",
                                                    time.time() + 0.05))
        await expired.ready.wait()  # well before the minute it would otherwise sleep
        await expiry.stop()

    asyncio.run(asyncio.wait_for(main(), 5))
    assert [e["action"] for e in bus.recent if e["kind"] == "rule"] == ["expired"]


def test_a_grant_the_disk_refuses_to_take_back_goes_from_memory_anyway(parts):
    """Fail closed: the filter no longer grants it, and an error event says that the disk
    and the firewall still have it until a restart."""
    store, bus, changes = parts

    async def refused(plan, first=None):
        raise OSError(28, "No space left on device")

    expiry = GrantExpiry(store, refused, bus)

    async def main():
        await changes.change(lambda: store.plan_add("s1", "dns", "brief.test", time.time()))
        await expiry.step()

    asyncio.run(main())
    assert runtime(store) == []
    assert "brief.test" in store._runtime_path("s1").read_text()  # a restart takes it back
    error, expired = [e for e in bus.recent if e["kind"] == "rule"]
    assert error["verdict"] == "error" and "No space left on device" in error["reason"]
    assert expired["action"] == "expired"
