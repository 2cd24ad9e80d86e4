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
