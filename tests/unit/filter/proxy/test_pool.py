"""The pool of idle plain-HTTP upstream connections, as transcripts: what is kept, what is
taken for whom, and what the caller is told to close."""

from __future__ import annotations

from appliance.filter.proxy.pool import Pool

A, B = ("a.test", 80), ("b.test", 80)


def test_a_kept_connection_goes_to_its_sessions_next_request_to_its_origin_only():
    pool = Pool(per_session=4, idle=10)
    assert pool.put("s1", A, "c1", now=0) == []
    assert pool.take("s2", A, now=1) == (None, [])  # never another session's
    assert pool.take("s1", B, now=1) == (None, [])  # never another origin's
    assert pool.take("s1", A, now=1) == ("c1", [])
    assert pool.take("s1", A, now=1) == (None, [])  # taken: it is that request's now
    assert len(pool) == 0


def test_the_most_recently_kept_goes_first_and_the_oldest_give_way():
    pool = Pool(per_session=2, idle=10)
    pool.put("s1", A, "c1", now=0)
    pool.put("s1", A, "c2", now=1)
    assert pool.put("s1", B, "c3", now=2) == ["c1"]  # past the session's share
    assert pool.put("s2", A, "d1", now=2) == []  # another session's share
    assert pool.take("s1", A, now=3) == ("c2", [])
    assert len(pool) == 2


def test_connections_idle_too_long_are_closed_not_reused():
    pool = Pool(per_session=4, idle=10)
    pool.put("s1", A, "c1", now=0)
    pool.put("s1", A, "c2", now=8)
    assert pool.take("s1", A, now=12) == ("c2", ["c1"])
    pool.put("s1", A, "c3", now=12)
    pool.put("s2", B, "d1", now=13)
    assert pool.expire(now=22.5) == ["c3"] and len(pool) == 1
    assert pool.expire(now=30) == ["d1"] and len(pool) == 0


def test_a_change_of_policy_closes_everything_kept():
    pool = Pool(per_session=4, idle=10)
    pool.put("s1", A, "c1", now=0)
    pool.put("s2", B, "d1", now=0)
    assert sorted(pool.clear()) == ["c1", "d1"]
    assert pool.take("s1", A, now=1) == (None, [])


def test_a_pool_of_none_keeps_nothing():
    pool = Pool(per_session=0, idle=10)
    assert pool.put("s1", A, "c1", now=0) == ["c1"] and len(pool) == 0


def test_the_setting_takes_zero_to_keep_none_and_refuses_less():
    import pytest

    from appliance.policy import ConfigError
    from appliance.sessionconfig import parse_config
    assert parse_config("[proxy]\nkept_upstreams_per_session = 0\n",
                        "filter.toml").proxy.kept_upstreams_per_session == 0
    assert parse_config("", "filter.toml").proxy.kept_upstreams_per_session == 8
    with pytest.raises(ConfigError, match="kept_upstreams_per_session: must be greater than -1"):
        parse_config("[proxy]\nkept_upstreams_per_session = -1\n", "filter.toml")


def test_the_next_expiry_is_when_the_oldest_outlives_idle():
    pool = Pool(per_session=4, idle=10)
    assert pool.next_expiry() is None
    pool.put("s1", A, "c1", now=3)
    pool.put("s2", B, "d1", now=1)
    pool.put("s1", B, "c2", now=5)
    assert pool.next_expiry() == 11  # d1's: the sweep comes then, not a whole idle later
