"""Durations and times as a person writes them (`--for 1h30m`, `--since 2h`) and reads them
(a wall-clock time), shared by the commands that take or show them."""

from __future__ import annotations

import datetime
import re
import time

from . import exitcodes
from .client import CliError


def parse_duration(text: str, option: str = "--for") -> int:
    """`90s`, `10m`, `1h30m`, `2d`: seconds (--for, --max-uptime, --idle)."""
    parts = re.fullmatch(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text.strip())
    if not text.strip() or parts is None:
        raise CliError(f"{option} {text!r} is not a duration",
                       "write it as 90s, 10m, 1h30m or 2d", exitcodes.USAGE)
    days, hours, minutes, seconds = (int(p or 0) for p in parts.groups())
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise CliError(f"{option} {text!r} is no time at all", "give a duration above zero",
                       exitcodes.USAGE)
    return total


def parse_since(text: str) -> float:
    """`10m`, `2h`, `3d` ago, or an ISO 8601 time."""
    match = re.fullmatch(r"(\d+)([smhd])", text)
    if match:
        seconds = int(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
        return time.time() - seconds
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise CliError(f"--since {text!r} is neither a duration (10m, 2h) nor an ISO time",
                       code=exitcodes.USAGE) from None
    if moment.tzinfo is None:
        moment = moment.astimezone()
    return moment.timestamp()


def clock(ts: float) -> str:
    """A wall-clock time for a person: the time alone today, else the date too."""
    moment = datetime.datetime.fromtimestamp(ts)
    today = datetime.datetime.now().date() == moment.date()
    return moment.strftime("%H:%M:%S" if today else "%Y-%m-%d %H:%M:%S")
