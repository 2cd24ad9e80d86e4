"""The per-session budget for what the filter logs about a failure (ratelimit.py): a session
whose connections keep failing is logged a few times, then at a trickle, each line saying
how many of its failures went unlogged since the last; another session is never held back
by it."""

from __future__ import annotations

import logging

import pytest

from appliance.filter.ratelimit import BURST, RATE, SESSIONS_MAX, LogBudget


@pytest.mark.parametrize(("steps", "expected"), [
    # (session, seconds since start) -> what take() says: None (not logged), else how many
    # of the session's failures went unlogged before this one
    ([("s1", 0.0)] * BURST, [0] * BURST),
    ([("s1", 0.0)] * (BURST + 3), [0] * BURST + [None] * 3),
    ([("s1", 0.0)] * (BURST + 3) + [("s1", 1 / RATE)], [0] * BURST + [None] * 3 + [3]),
    ([("s1", 0.0)] * (BURST + 1) + [("s2", 0.0)], [0] * BURST + [None, 0]),
    ([("s1", 0.0)] * (BURST + 1) + [(None, 0.0)], [0] * BURST + [None, 0]),
    ([("s1", 0.0)] * (BURST + 2) + [("s1", 0.5 / RATE)], [0] * BURST + [None, None, None]),
])
def test_a_session_is_logged_within_its_budget(steps, expected):
    budget = LogBudget()
    assert [budget.take(session, now) for session, now in steps] == expected


def test_a_flood_of_failures_costs_a_trickle_of_lines():
    """500 failing connections a second (the firewall's rate for new connections) for a
    minute: the burst, then one line for every 1/RATE seconds."""
    budget = LogBudget()
    logged = sum(budget.take("s1", i / 500) is not None for i in range(500 * 60))
    assert logged <= BURST + 60 * RATE + 1
    assert budget.dropped_total == 500 * 60 - logged


def test_the_buckets_are_bounded_and_forgotten_with_their_sessions():
    budget = LogBudget()
    for i in range(SESSIONS_MAX + 10):
        budget.take(f"s{i}", 0.0)
    assert len(budget.buckets) <= SESSIONS_MAX
    budget.forget({"s1"})
    assert set(budget.buckets) <= {"s1", None}


def test_log_writes_the_traceback_when_the_budget_allows_and_says_what_was_dropped(caplog):
    budget = LogBudget()
    logger = logging.getLogger("test.loglimit")
    with caplog.at_level(logging.ERROR, logger="test.loglimit"):
        for i in range(BURST + 2):
            try:
                raise ValueError(f"bug {i}")
            except ValueError:
                budget.log(logger, "s1", 0.0, "proxy: connection from %s failed", "c")
        try:
            raise ValueError("later")
        except ValueError:
            budget.log(logger, "s1", 1 / RATE, "proxy: connection from %s failed", "c")
    assert len(caplog.records) == BURST + 1
    assert all(r.exc_info is not None for r in caplog.records)
    assert caplog.records[-1].getMessage() == (
        "proxy: connection from c failed (session s1; 2 more of its failures not logged)")
