"""relay.within: asyncio.timeout's behaviour on one timer per task."""

from __future__ import annotations

import asyncio

import pytest

from appliance.filter import relay
from appliance.filter.relay import within


def run(coro):
    return asyncio.run(coro)


def test_a_result_in_time_is_returned_and_a_late_one_times_out():
    async def main():
        assert await within(asyncio.sleep(0.01, "done"), 1) == "done"
        started = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            await within(asyncio.sleep(5), 0.05)
        return asyncio.get_running_loop().time() - started

    assert 0.04 < run(main()) < 1


def test_each_call_has_its_own_limit_whatever_the_earlier_ones_were():
    async def main():
        for _ in range(3):  # short waits under a long limit: the timer stays where it is
            await within(asyncio.sleep(0.01), 10)
        with pytest.raises(TimeoutError):  # a shorter limit than the timer's: set earlier
            await within(asyncio.sleep(5), 0.05)
        await within(asyncio.sleep(0.1), 0.2)  # a longer one again: not cut at the old timer
        with pytest.raises(TimeoutError):
            await within(asyncio.sleep(5), 0.05)
        assert asyncio.current_task().cancelling() == 0

    run(main())


def test_a_limit_moved_later_is_kept_by_the_timer_set_for_the_earlier_one():
    async def main():
        await within(asyncio.sleep(0), 0.05)  # the timer: in 0.05 s
        await within(asyncio.sleep(0.15), 0.3)  # outlives that timer, within its own limit
        started = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            await within(asyncio.sleep(5), 0.1)
        return asyncio.get_running_loop().time() - started

    assert 0.09 < run(main()) < 1


def test_a_cancel_from_elsewhere_stays_a_cancel():
    async def waiting():
        await within(asyncio.sleep(5), 10)

    async def main():
        task = asyncio.create_task(waiting())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())


def test_a_cancel_from_elsewhere_as_the_limit_expires_stays_a_cancel():
    async def waiting():
        await within(asyncio.sleep(5), 0.05)

    async def main():
        task = asyncio.create_task(waiting())
        await asyncio.sleep(0.01)
        deadline = relay._DEADLINES[task]
        deadline.at = deadline.when  # the timer is the limit's: expire it now, then cancel
        deadline._fire()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())


def test_nested_limits_each_hold():
    async def inner():
        return await within(asyncio.sleep(5), 0.05)

    async def main():
        with pytest.raises(TimeoutError):
            await within(inner(), 10)
        with pytest.raises(TimeoutError):
            await within(within(asyncio.sleep(5), 10), 0.05)

    run(main())


def test_a_task_that_ends_leaves_no_deadline_behind():
    async def one():
        await within(asyncio.sleep(0), 10)
        return asyncio.current_task()

    async def main():
        task = asyncio.create_task(one())
        await task
        await asyncio.sleep(0)  # done callbacks run
        assert task not in relay._DEADLINES

    run(main())
