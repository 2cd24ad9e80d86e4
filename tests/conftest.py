"""Settings for every tier, and the required-tiers switch.

Every tier that needs root or a tool skips itself with the reason when it cannot run, so that
a developer's `pytest` works anywhere. CI must not go green that way: `.ci/run` exports
CORRAL_REQUIRE_ALL_TIERS=1, and under it a run fails when any test did not run — skipped
(marker, `pytest.skip` in a test or a fixture, a module skipped at collection) or an
`xfail(run=False)` — with a summary of what and why. An xfail that ran is a result, not a
skip. The switch is for the whole suite: narrowing the run (paths, -k, -m, --lf, --deselect)
under it is a usage error, since a deselected test is as silent as a skipped one.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# No time limit per generated example: these machines are shared and noisy (and the VM tier
# keeps both cores busy), and speed is measured in bench/, never asserted in tests.
settings.register_profile("corral", deadline=None)
settings.load_profile("corral")

REQUIRE_ALL_TIERS = "CORRAL_REQUIRE_ALL_TIERS"


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(REQUIRE_ALL_TIERS, "") in ("", "0"):
        return
    narrowed = []
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        narrowed.append(f"paths {' '.join(config.args)}")
    for option, flag in (("keyword", "-k"), ("markexpr", "-m")):
        if getattr(config.option, option, ""):
            narrowed.append(f"{flag} {getattr(config.option, option)!r}")
    if narrowed:
        raise pytest.UsageError(
            f"{REQUIRE_ALL_TIERS} is set: the run must be the whole suite, but it is narrowed "
            f"by {', '.join(narrowed)}. Unset it to run a part.")
    config.pluginmanager.register(RequiredTiers(), "corral-required-tiers")


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: why")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


class RequiredTiers:
    """Under the switch: remembers every test that did not run, and fails the session."""

    def __init__(self):
        self.not_run: list[tuple[str, str]] = []
        """(node id, why) of each test or module that was skipped or not run."""
        self.deselected: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        xfail = getattr(report, "wasxfail", None)
        if xfail is not None:
            if str(xfail).startswith("[NOTRUN]"):  # xfail(run=False) never ran
                self.not_run.append((report.nodeid, f"xfail, not run: {xfail}"))
        elif report.skipped:
            self.not_run.append((report.nodeid, _reason(report)))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:
            self.not_run.append((report.nodeid or ".", _reason(report)))

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected += [item.nodeid for item in items]

    def problems(self) -> list[str]:
        lines = [f"{nodeid}: {why}" for nodeid, why in self.not_run]
        if self.deselected:
            lines.append(f"{len(self.deselected)} deselected (first: {self.deselected[0]})")
        return lines

    def pytest_terminal_summary(self, terminalreporter) -> None:
        problems = self.problems()
        if problems:
            terminalreporter.section(f"{REQUIRE_ALL_TIERS}: tests that did not run", red=True)
            for line in problems:
                terminalreporter.line(line, red=True)
            terminalreporter.line(f"{len(problems)} did not run, so this run fails: run it "
                                  "where every tier can run (root, after scripts/setup).",
                                  red=True)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.problems() and exitstatus in (pytest.ExitCode.OK,
                                              pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
