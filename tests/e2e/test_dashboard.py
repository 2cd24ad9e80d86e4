"""`corral dashboard` in a real browser: a request held in a real session is approved by a
click on the page, and completes; what the agent wrote is shown as text. The browser runs
where the dashboard listens (the appliance namespace, as the CLI does):
tests/e2e/dashboard_driver.py drives it, and saves a screenshot of each page."""

from __future__ import annotations

import json
import select
import shutil
import subprocess
import sys

import pytest

from . import netns
from .conftest import APPLIANCE_NAME, BIN, ROOT
from .test_cli_sessions import corral


def _skip_reason() -> str | None:
    missing = [p for p in ("/usr/bin/chromium", "/usr/bin/chromedriver")
               if shutil.which(p) is None]
    return f"{', '.join(missing)} not installed (scripts/setup installs them)" if missing \
        else None


@pytest.fixture(scope="module")
def d1(world, sandbox_image):
    if (reason := _skip_reason()) is not None:
        pytest.skip(reason)
    project = world.dir / "dashboard-project"
    project.mkdir(exist_ok=True)
    (project / "corral.toml").write_text('[http]\nallow = ["allowed.test"]\n')
    corral(world, "run", "--project", str(project), "--name", "d1", "--detach")
    yield "d1"
    corral(world, "rm", "d1", check=False)


def in_appliance(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(["nsenter", f"--net=/run/netns/{netns.APPLIANCE}", *args], **kw)


def test_a_held_request_is_approved_from_the_page(world, d1, tmp_path):
    corral(world, "ask", "--session", d1, "--hold", "120")
    board = in_appliance(str(BIN / "corral"), "dashboard", "--appliance", APPLIANCE_NAME,
                         "--no-open", "--json", stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=world.cli_env)
    fetch = None
    try:  # its first line says where it is: one that never comes fails, never a read for ever
        assert select.select([board.stdout], [], [], 60)[0], "corral dashboard said nothing in 60s"
        url = json.loads(board.stdout.readline())["url"]
        fetch = in_appliance(str(BIN / "corral"), "shell", "--appliance", APPLIANCE_NAME, d1,
                             "--", "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}",
                             "--max-time", "120", "http://other.test/",
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=world.cli_env)
        asked = corral(world, "shell", d1, "--", "corral-request", "docs.test", "--reason",
                       "<img src=x onerror=alert(1)> the docs", check=False)
        assert asked.returncode == 3, asked
        shots = tmp_path / "screens"
        driven = subprocess.run(
            ["nsenter", f"--net=/run/netns/{netns.APPLIANCE}", sys.executable, "-m",
             "tests.e2e.dashboard_driver", url, "other.test:80", d1, str(shots)],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
            env={**world.cli_env, "PYTHONPATH": str(ROOT)})
        seen = json.loads(driven.stdout.strip().splitlines()[-1] if driven.stdout else "{}")
        assert driven.returncode == 0, (seen, driven.stderr[-2000:])
        assert fetch.communicate(timeout=60)[0] == "200"  # the click let it through
        assert "<img src=x onerror=alert(1)> the docs" in seen["reasons"]
        assert seen["elements_in_reasons"] == 0  # shown as text, never as markup
        assert seen["approved_event"] and seen["audit"].startswith("intact"), seen
        assert not seen["trouble"], seen
        assert sorted(p.name for p in shots.iterdir()) == [
            "approvals.png", "decisions.png", "health.png", "rules.png", "sessions.png"]
        records = world.control({"op": "events", "last": 500, "session": d1})["events"]
        approved = [e for e in records if e.get("action") == "approved"]
        assert approved and approved[-1]["grant"] == "once"
        assert approved[-1]["by"].startswith("corral-cli#")  # the CLI's certificate decided
    finally:
        if fetch is not None:
            if fetch.poll() is None:
                fetch.kill()
            fetch.communicate()  # and its pipes closed
        board.terminate()
        board.communicate(timeout=10)
        for approval in world.control({"op": "approvals"})["approvals"]:
            world.control({"op": "approval-decide", "id": approval["id"], "grant": "refuse",
                           "by": "e2e"})
        corral(world, "ask", "--session", d1, "--off", check=False)
