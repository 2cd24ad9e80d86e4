"""The required-tiers switch (tests/conftest.py): under CORRAL_REQUIRE_ALL_TIERS, which
`.ci/run` sets, a test that did not run fails the whole run. Each case is a real pytest run,
in a subprocess, over a tiny suite that uses this repository's conftest as a plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PASSING = "def test_runs():\n    assert True\n"


def run(tmp_path: Path, files: dict[str, str], *args: str, required: bool = True):
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = suite\n")
    (tmp_path / "suite").mkdir(exist_ok=True)
    for name, text in files.items():
        (tmp_path / "suite" / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_REQUIRE_ALL_TIERS"}
    env["PYTHONPATH"] = str(ROOT)
    if required:
        env["CORRAL_REQUIRE_ALL_TIERS"] = "1"
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p",
                             "no:cacheprovider", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout + result.stderr


def test_the_ci_script_sets_the_switch_before_it_runs_the_test_command():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "export CORRAL_REQUIRE_ALL_TIERS=1" in lines
    assert lines.index("export CORRAL_REQUIRE_ALL_TIERS=1") < lines.index("exec scripts/test")


def test_a_whole_suite_that_ran_passes(tmp_path):
    code, out = run(tmp_path, {"test_a.py": PASSING})
    assert code == 0, out


@pytest.mark.parametrize("skipping", [
    'import pytest\n\n@pytest.mark.skip(reason="needs root")\ndef test_tier():\n    pass\n',
    'import pytest\n\ndef test_tier():\n    pytest.skip("needs root")\n',
    'import pytest\n\n@pytest.fixture\ndef world():\n    pytest.skip("needs root")\n\n'
    'def test_tier(world):\n    pass\n',
    'import pytest\n\npytest.skip("needs root", allow_module_level=True)\n\n'
    'def test_tier():\n    pass\n',
], ids=["marker", "in-the-test", "in-a-fixture", "whole-module"])
def test_a_skip_fails_the_run_and_says_what_and_why(tmp_path, skipping):
    code, out = run(tmp_path, {"test_a.py": PASSING, "test_tier.py": skipping})
    assert code == 1, out
    assert "CORRAL_REQUIRE_ALL_TIERS: tests that did not run" in out
    assert "suite/test_tier.py" in out and "needs root" in out


def test_without_the_switch_a_skip_is_only_a_skip(tmp_path):
    skipping = 'import pytest\n\n@pytest.mark.skip(reason="needs root")\ndef test_tier():\n'
    code, out = run(tmp_path, {"test_tier.py": skipping + "    pass\n", "test_a.py": PASSING},
                    required=False)
    assert code == 0, out
    assert "did not run" not in out


def test_an_xfail_that_ran_is_a_result_but_one_that_never_ran_fails(tmp_path):
    ran = 'import pytest\n\n@pytest.mark.xfail(reason="known")\ndef test_x():\n    assert 0\n'
    code, out = run(tmp_path, {"test_x.py": ran})
    assert code == 0, out
    never = ran.replace('reason="known"', 'reason="known", run=False')
    code, out = run(tmp_path, {"test_x.py": never})
    assert code == 1, out
    assert "xfail, not run" in out


@pytest.mark.parametrize("narrowing", [["-k", "runs"], ["-m", "slow"], ["suite/test_a.py"]])
def test_a_narrowed_run_is_refused_under_the_switch(tmp_path, narrowing):
    code, out = run(tmp_path, {"test_a.py": PASSING}, *narrowing)
    assert code == pytest.ExitCode.USAGE_ERROR, out
    assert "must be the whole suite" in out


def test_deselection_by_a_plugin_fails_the_run(tmp_path):
    code, out = run(tmp_path, {"test_a.py": PASSING + "\n\ndef test_other():\n    pass\n"},
                    "--deselect", "suite/test_a.py::test_other")
    assert code == 1, out
    assert "1 deselected" in out
