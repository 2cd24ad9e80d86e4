"""How long a session may live, and what it may use: `corral run --max-uptime 8h --idle 1h
--memory 8g --cpus 4 --pids 4096`.

Pure: a request's settings in, checked `Limits` out; a session's record and its activity
(from the filter) in, whether it is due to stop, and why, out. The sandbox service asks
every CHECK_EVERY seconds and stops what is due, keeping the workspace (service.py).

Idle means no network activity: no decision by the filter for the session (a DNS query, a
connection, a request) and no connection of its open through the proxy, for the whole
`idle` span. An agent works through its model's API, so a session that is silent that long
has nobody working in it; one compiling offline for longer than `idle` is stopped too,
which is what `--idle` asks for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CHECK_EVERY = 5.0
"""Seconds between two looks at the running sessions."""
MAX_SPAN = 30 * 86400
"""The longest --max-uptime or --idle: 30 days."""
_MEMORY = re.compile(r"[1-9][0-9]{0,6}[kmg]")
_CPUS = re.compile(r"(?:[1-9][0-9]{0,2}|0)(?:\.[0-9]{1,2})?")


class LimitError(ValueError):
    """A setting that cannot be used; the message names it and says what it takes."""


@dataclass(frozen=True)
class Limits:
    max_uptime: int = 0
    """Seconds from its start after which the session is stopped; 0: never."""
    idle: int = 0
    """Seconds without network activity after which it is stopped; 0: never."""
    memory: str = ""
    """podman's --memory (`8g`, `512m`); "": the sandbox's default."""
    cpus: str = ""
    """podman's --cpus (`4`, `1.5`); "": the default."""
    pids: int = 0
    """podman's --pids-limit; 0: the default."""

    @classmethod
    def parse(cls, settings: dict) -> Limits:
        """From a create request's fields (each optional). Raises LimitError."""
        values = {}
        for key in ("max_uptime", "idle"):
            value = settings.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or not (
                    0 <= value <= MAX_SPAN):
                raise LimitError(f"'{key}' must be whole seconds, 0 (none) to {MAX_SPAN}")
            values[key] = value
        memory = settings.get("memory", "")
        if memory and (not isinstance(memory, str) or not _MEMORY.fullmatch(memory)):
            raise LimitError("'memory' must be a size such as 512m, 8g (k, m or g)")
        cpus = settings.get("cpus", "")
        if cpus and (not isinstance(cpus, str) or not _CPUS.fullmatch(cpus)
                     or float(cpus) <= 0):
            raise LimitError("'cpus' must be a number of CPUs such as 2 or 1.5")
        pids = settings.get("pids", 0)
        if isinstance(pids, bool) or not isinstance(pids, int) or not (
                pids == 0 or 64 <= pids <= 1_000_000):
            raise LimitError("'pids' must be 64 to 1000000 processes (0: the default)")
        return cls(values["max_uptime"], values["idle"], memory or "", cpus or "", pids)


def idle_for(created: float, activity: dict | None, now: float) -> float:
    """Seconds without network activity: since the filter's last event for the session (or
    its start, or the filter's: `last_activity` is at least that), 0 while a connection of
    its is open."""
    activity = activity or {}
    if activity.get("open_connections"):
        return 0.0
    return max(0.0, now - max(created, activity.get("last_activity") or 0.0))


def due(created: float, limits: Limits, activity: dict | None, now: float) -> str | None:
    """Why a running session must stop now, or None."""
    if limits.max_uptime and now - created >= limits.max_uptime:
        return f"ran for its --max-uptime ({span(limits.max_uptime)})"
    if limits.idle and idle_for(created, activity, now) >= limits.idle:
        return f"no network activity for its --idle ({span(limits.idle)})"
    return None


def left(created: float, limits: Limits, activity: dict | None, now: float) -> float | None:
    """Seconds until it stops by itself if nothing happens (None: no limit)."""
    spans = []
    if limits.max_uptime:
        spans.append(created + limits.max_uptime - now)
    if limits.idle:
        spans.append(limits.idle - idle_for(created, activity, now))
    return max(0.0, min(spans)) if spans else None


def span(seconds: float) -> str:
    """`8h`, `1h30m`, `45s`: as `corral run` takes them."""
    seconds = int(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size or (unit == "s" and not parts):
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(parts)
