"""pipeline.host_of: a host named again is the host parse_host reads, and a refusal stays one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.filter.http import HttpError
from appliance.filter.proxy import pipeline
from appliance.filter.proxy.pipeline import host_of
from appliance.policy import HostNameError, parse_host


def _reading(call):
    try:
        return call()
    except (HttpError, HostNameError) as exc:
        return ("refused", str(exc))


spellings = st.text(alphabet="abcXY.-_0123456789:[]%é ", max_size=24)


@settings(max_examples=400)
@given(spellings)
def test_a_host_read_again_is_what_parse_host_reads(text):
    expected = _reading(lambda: parse_host(text))
    for _ in range(2):  # the second time from the cache, when it was valid
        found = _reading(lambda: host_of(text))
        assert found == expected
        if isinstance(found, tuple):
            assert isinstance(_refusal(text), HttpError)


def _refusal(text):
    try:
        host_of(text)
    except HttpError as exc:
        assert exc.status == 400
        return exc
    return None


def test_a_full_cache_starts_again(monkeypatch):
    monkeypatch.setattr(pipeline, "HOSTS_CACHED", 3)
    monkeypatch.setattr(pipeline, "_HOSTS", {})
    for i in range(10):
        assert host_of(f"h{i}.example.com") == parse_host(f"h{i}.example.com")
        assert len(pipeline._HOSTS) <= 3
    with pytest.raises(HttpError, match="host name"):
        host_of("")
    assert "" not in pipeline._HOSTS
