"""`[filter] workers`: a number, or "cores" (the CPUs the filter may run on)."""

from __future__ import annotations

import os

import pytest

from appliance.policy import ConfigError
from appliance.sessionconfig import parse_config


def workers(value: str) -> int:
    return parse_config(f"[filter]\nworkers = {value}\n", "filter.toml").workers


def test_a_number_or_the_cores():
    assert parse_config("", "filter.toml").workers == 1
    assert workers("3") == 3
    assert workers('"cores"') == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("value", ["0", "-2", "1.5", '"many"', "true"])
def test_anything_else_names_the_key_and_the_choices(value):
    with pytest.raises(ConfigError, match=r'filter.toml:2: \[filter\] workers: .*\(or "cores"\)'):
        workers(value)


def test_a_worker_may_be_silent_a_minute_unless_told_otherwise():
    assert parse_config("", "filter.toml").worker_silence == 60.0
    assert parse_config("[filter]\nworker_silence = 3\n", "filter.toml").worker_silence == 3.0


@pytest.mark.parametrize(("value", "said"), [
    ("0", "must be greater than 2"), ("2", "must be greater than 2"),
    ("1e-9", "must be greater than 2"), ("nan", "must be a finite number, got nan"),
    ("inf", "must be a finite number, got inf"), ('"long"', "must be a number")])
def test_a_silence_that_is_no_number_of_seconds_names_the_key(value, said):
    """TOML reads `nan` and `inf` as floats: nan passed `> 0` (it compares as nothing),
    and a worker could then be silent for ever, or killed at once."""
    with pytest.raises(ConfigError, match=rf"\[filter\] worker_silence: {said}"):
        parse_config(f"[filter]\nworker_silence = {value}\n", "filter.toml")
