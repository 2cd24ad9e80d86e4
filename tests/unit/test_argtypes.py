"""Seconds on a command line: `float()` reads nan and inf, which a bare `type=float` let
through (`manifest check --settle nan` then raised in time.sleep)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from appliance.argtypes import seconds


@pytest.mark.parametrize("check", [seconds(), seconds(zero=True)])
@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "-1", "soon", ""])
def test_what_is_no_number_of_seconds_is_refused(check, text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not a number of seconds"):
        check(text)


def test_zero_is_seconds_only_where_it_is_asked_for():
    assert seconds(zero=True)("0") == 0
    assert seconds()("1.5") == 1.5
    with pytest.raises(argparse.ArgumentTypeError, match="above 0"):
        seconds()("0")


def test_manifest_check_refuses_a_settle_of_nan_with_a_message():
    done = subprocess.run([sys.executable, "-m", "appliance.manifest", "check", "m.json",
                           "--settle", "nan"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "'nan' is not a number of seconds of 0 or more" in \
        done.stderr, done.stderr
