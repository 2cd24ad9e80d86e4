"""argparse types that the appliance's commands and the host CLI share."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def seconds(zero: bool = False) -> Callable[[str], float]:
    """A finite number of seconds above 0 (or from 0, with `zero`), as an argparse type:
    float() reads `nan` and `inf`, and nan passes every comparison's `not`, so a bare
    `type=float` let `--settle nan` through to time.sleep, which raised. (Not for the
    selftest package: it runs in a session alone and imports nothing else of appliance.)"""
    floor = "of 0 or more" if zero else "above 0"

    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds {floor}")
        return value
    check.__name__ = "seconds"  # what argparse names it by in its own messages
    return check
