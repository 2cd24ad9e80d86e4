"""The e2e appliance runs two filter workers (`[filter] workers = 2` in the World's config):
s1 is served by worker 0 and s2 by worker 1 (the least loaded when each came). From inside
both sandboxes: a runtime rule and its revoke, and an approval decided by a person, take
effect in each worker when the call returns; a killed worker's sandbox gets no answer until
the next worker serves it, and its neighbour is served throughout."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.e2e
SANDBOXES = {1: "s1", 2: "s2"}


def code(world, index: int, url: str, seconds: int = 10) -> str:
    """The HTTP status a request through the sandbox's proxy got ("000": no answer)."""
    return world.in_sandbox(index, "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}",
                            "--max-time", str(seconds), "-x", f"http://10.213.{index}.1:3128",
                            url, timeout=seconds + 30).stdout.strip()


def workers(world) -> list[dict]:
    return world.control({"op": "status"})["workers"]


def test_each_sandbox_is_served_by_a_worker_of_its_own(world):
    seen = workers(world)
    assert [w["up"] for w in seen] == [True, True]
    assert "s1" in seen[0]["sessions"] and "s2" in seen[1]["sessions"]
    assert code(world, 1, "http://allowed.test/") == "200"
    assert code(world, 2, "http://other.test/") == "200"


def test_a_runtime_rule_and_its_revoke_are_in_force_in_every_worker(world):
    try:
        for index, session in SANDBOXES.items():
            assert code(world, index, "http://denied.test/") == "403"
            assert world.control({"op": "add", "session": session, "kind": "http",
                                  "rule": "denied.test"})["ok"]
        for index in SANDBOXES:  # no wait: both workers took it before the calls returned
            assert code(world, index, "http://denied.test/") == "200"
    finally:
        for session in SANDBOXES.values():
            world.control({"op": "remove", "session": session, "kind": "http",
                           "rule": "denied.test"})
    for index in SANDBOXES:
        assert code(world, index, "http://denied.test/") == "403"


def _approval(world, session: str) -> dict:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for approval in world.control({"op": "approvals", "session": session})["approvals"]:
            if approval["target"].startswith("denied.test") and approval["waiting"]:
                return approval
        time.sleep(0.1)
    raise AssertionError(f"no approval for denied.test waiting in {session}")


def test_a_request_held_in_each_worker_goes_on_when_a_person_approves_it(world):
    try:
        for session in SANDBOXES.values():
            assert world.control({"op": "add", "session": session, "kind": "approval",
                                  "rule": "ask 30"})["ok"]
        with ThreadPoolExecutor(2) as pool:
            for index, session in SANDBOXES.items():
                held = pool.submit(code, world, index, "http://denied.test/", 40)
                approval = _approval(world, session)
                decided = world.control({"op": "approval-decide", "id": approval["id"],
                                         "grant": "once", "by": "e2e"})
                assert decided["ok"] and decided["released"] == 1, decided
                assert held.result(60) == "200"
    finally:
        for session in SANDBOXES.values():
            world.control({"op": "remove", "session": session, "kind": "approval",
                           "rule": "ask 30"})
    for index in SANDBOXES:  # once: the next request is denied again
        assert code(world, index, "http://denied.test/") == "403"


def test_a_worker_down_fails_its_sandbox_closed_and_a_killed_one_comes_back(world):
    before = workers(world)[1]
    os.kill(before["pid"], signal.SIGSTOP)  # down, its sockets still open: nobody answers
    try:
        assert code(world, 2, "http://other.test/", seconds=2) == "000"
        assert code(world, 1, "http://allowed.test/") == "200"  # its neighbour's worker does
    finally:  # (gone already if it was stopped past its silence: the coordinator's kill)
        with contextlib.suppress(ProcessLookupError):
            os.kill(before["pid"], signal.SIGCONT)
    with contextlib.suppress(ProcessLookupError):
        os.kill(before["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = workers(world)[1]
        if now["up"] and now["restarts"] == before["restarts"] + 1:
            break
        time.sleep(0.1)
    assert now["up"] and now["pid"] != before["pid"] and "s2" in now["sessions"]
    assert code(world, 2, "http://other.test/") == "200"
    assert code(world, 2, "http://denied.test/") == "403"
