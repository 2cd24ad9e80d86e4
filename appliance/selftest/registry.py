"""The battery's machinery: a probe, the registry probes join with `@probe(id, threat, ...)`,
the three states a probe ends in, which probes run, and the runner that times them.

Nothing here touches the network; the probes (network, smuggling, starvation, kernel, review)
register themselves at import, in the order the package imports them.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

FAST = 3.0  # seconds: a denial slower than this counts as a hang
GROUPS = ("network", "kernel", "review")
PASSED, FAILED, NOT_RUN = "passed", "failed", "not-run"
"""How a probe ends (appliance/sandbox/battery.py judges the --json output by these)."""


class ProbeContext(Protocol):
    """What the runner reads of the context a probe is given: its arguments. The battery
    gives wire.Context (which adds the lookups probes share); declared here so that the
    registry needs nothing of wire, which needs the registry."""

    args: argparse.Namespace


class NotRun(Exception):
    """The probe could not even be tried here; the message says why."""


@dataclass
class Outcome:
    ok: bool
    """The attack failed (or, for a legitimate flow, the flow worked)."""
    detail: str
    expect: dict | None = None
    """The event or counter that must record this denial (the appliance checks it)."""


@dataclass(frozen=True)
class Probe:
    id: str
    threat: int
    """The class in THREATS.md (0: a legitimate flow of no class)."""
    group: str
    legit: bool
    """A flow that must work, next to the attacks."""
    records: str
    """What records a denial, in words (`--list`, docs/threats.md)."""
    run: Callable[[ProbeContext], Outcome]
    needs: str | None = None
    """An option without which the probe cannot be tried (it is not selected then)."""
    budget: float | Callable[[argparse.Namespace], float] | None = FAST
    """Seconds a passing attack may take (None for legitimate flows): slower is a hang."""

    def budget_for(self, args: argparse.Namespace) -> float | None:
        return self.budget(args) if callable(self.budget) else self.budget


class Registry:
    def __init__(self):
        self.probes: dict[str, Probe] = {}

    def probe(self, id: str, threat: int, *, group: str = "network", legit: bool = False,
              records: str = "", needs: str | None = None,
              budget: float | Callable | None = FAST):
        if group not in GROUPS:
            raise ValueError(f"probe {id}: group {group!r} is not one of {GROUPS}")

        def register(run):
            if id in self.probes:
                raise ValueError(f"probe {id!r} is registered twice")
            described = "nothing: a legitimate flow" if legit and not records else records
            self.probes[id] = Probe(id, threat, group, legit, described, run, needs,
                                    None if legit else budget)
            return run
        return register

    def __iter__(self):
        return iter(self.probes.values())


REGISTRY = Registry()
probe = REGISTRY.probe


# -- running -----------------------------------------------------------------------------


@dataclass
class Result:
    probe: Probe
    state: str
    detail: str
    ms: float
    expect: dict | None = None

    def to_json(self) -> dict:
        p = self.probe
        return {"id": p.id, "threat": p.threat, "legit": p.legit, "group": p.group,
                "state": self.state, "ok": self.state == PASSED, "ms": self.ms,
                "detail": self.detail, "expect": self.expect}


def run_probe(probe: Probe, ctx: ProbeContext, clock=time.monotonic) -> Result:
    """One probe, whatever it does: an exception of its own is a failure, NotRun is not run,
    and an attack that failed too slowly (past its budget) is a hang, so a failure too."""
    started = clock()
    if probe.needs and not getattr(ctx.args, probe.needs, None):
        return Result(probe, NOT_RUN, f"needs --{probe.needs.replace('_', '-')}", 0.0)
    try:
        outcome = probe.run(ctx)
        state, detail, expect = (PASSED if outcome.ok else FAILED), outcome.detail, outcome.expect
    except NotRun as exc:
        state, detail, expect = NOT_RUN, str(exc), None
    except Exception as exc:  # a probe's own failure is a failed probe, not a crash
        state, detail, expect = FAILED, f"{type(exc).__name__}: {exc}", None
    ms = round((clock() - started) * 1000, 1)
    budget = probe.budget_for(ctx.args)
    if state == PASSED and budget is not None and ms > budget * 1000:
        state, detail = FAILED, f"too slow ({ms} ms, budget {budget:g} s): {detail}"
    return Result(probe, state, detail, ms, expect)


@dataclass
class Selection:
    run: list[Probe]
    skipped: dict[str, list[str]] = field(default_factory=dict)
    """group -> the probe ids --skip-group deselected."""
    unselected: dict[str, str] = field(default_factory=dict)
    """probe id -> why it was left out (an option it needs was not given)."""


def select(registry: Registry, only: list[str] | None, skip_groups: list[str] | None,
           args: argparse.Namespace) -> Selection:
    """Which probes run. --only names probes (one it cannot try is then not run, which
    fails the run); --skip-group removes a group, and is reported; without --only, a probe
    whose option was not given is left out and listed."""
    selection = Selection([])
    for p in registry:
        if only and p.id not in only:
            continue
        if p.group in (skip_groups or ()):
            selection.skipped.setdefault(p.group, []).append(p.id)
        elif not only and p.needs and not getattr(args, p.needs, None):
            selection.unselected[p.id] = f"needs --{p.needs.replace('_', '-')}"
        else:
            selection.run.append(p)
    return selection


def exit_status(results: list[Result]) -> int:
    return 0 if all(r.state == PASSED for r in results) else 1

