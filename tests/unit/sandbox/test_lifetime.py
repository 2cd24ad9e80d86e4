"""A session's limits without a container: what a request may set, and when a session is
due to stop (its start, the filter's last event for it, its open connections, the clock)."""

from __future__ import annotations

import pytest

from appliance.sandbox.lifetime import LimitError, Limits, due, idle_for, left, span


def test_limits_parse_or_say_which_setting_is_wrong():
    assert Limits.parse({}) == Limits()
    assert Limits.parse({"max_uptime": 28800, "idle": 3600, "memory": "8g", "cpus": "1.5",
                         "pids": 4096, "name": "x"}) == Limits(28800, 3600, "8g", "1.5", 4096)
    for bad, named in (({"max_uptime": -1}, "max_uptime"), ({"idle": True}, "idle"),
                       ({"idle": "1h"}, "idle"), ({"max_uptime": 31 * 86400}, "max_uptime"),
                       ({"memory": "8"}, "memory"), ({"memory": "8 g"}, "memory"),
                       ({"memory": "-1g"}, "memory"), ({"cpus": "0"}, "cpus"),
                       ({"cpus": "two"}, "cpus"), ({"cpus": 2}, "cpus"), ({"pids": 10}, "pids"),
                       ({"pids": "100"}, "pids")):
        with pytest.raises(LimitError, match=f"'{named}'"):
            Limits.parse(bad)


def test_a_session_is_idle_from_its_last_event_and_never_while_a_connection_is_open():
    assert idle_for(100.0, None, 130.0) == 30.0
    assert idle_for(100.0, {"last_activity": 120.0, "open_connections": 0}, 130.0) == 10.0
    assert idle_for(100.0, {"last_activity": 50.0}, 130.0) == 30.0  # an event before its start
    assert idle_for(100.0, {"last_activity": 101.0, "open_connections": 2}, 9999.0) == 0.0


def test_a_session_is_due_when_either_limit_runs_out():
    limits = Limits(max_uptime=3600, idle=600)
    assert due(0.0, limits, {"last_activity": 3000.0}, 3599.0) is None
    assert due(0.0, limits, {"last_activity": 3000.0}, 3600.0) == "ran for its --max-uptime (1h)"
    assert due(0.0, limits, {"last_activity": 2000.0}, 2600.0) == (
        "no network activity for its --idle (10m)")
    assert due(0.0, limits, {"last_activity": 2000.0, "open_connections": 1}, 2600.0) is None
    assert due(0.0, Limits(), None, 10**9) is None
    assert left(0.0, limits, {"last_activity": 3000.0}, 3100.0) == 500.0
    assert left(0.0, limits, {"last_activity": 3500.0}, 3590.0) == 10.0
    assert left(0.0, Limits(), None, 5.0) is None
    assert [span(s) for s in (45, 90, 3600, 5400, 86400 + 60)] == [
        "45s", "1m30s", "1h", "1h30m", "1d1m"]
