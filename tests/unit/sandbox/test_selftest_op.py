"""The sandbox service's `selftest` op: how it runs the battery inside a session. podman
cannot run in unit tests: a recorder stands in for it, answering the exec with what the
battery prints; the service and the battery's own parser are real."""

from __future__ import annotations

import json
from types import SimpleNamespace

from appliance.sandbox.service import SandboxConfig, Sessions
from appliance.sandbox.sessions import Record, SessionManager
from appliance.selftest import cli
from appliance.selftest.registry import REGISTRY

PROBE = {"id": "dns-allowed", "threat": 0, "legit": True, "group": "network",
         "state": "passed", "ok": True, "ms": 1.0, "detail": "", "expect": None}


class Podman:
    def __init__(self):
        self.calls: list[tuple[str, ...]] = []

    def run(self, *args, check=True, **kwargs):
        self.calls.append(args)
        out = b""
        if args[0] == "exec" and "corral-selftest" in args:
            out = (json.dumps(PROBE) + "\n" + json.dumps({"summary": {}}) + "\n").encode()
        return SimpleNamespace(returncode=0, stdout=out, stderr=b"")


def test_the_battery_is_told_the_sessions_name_not_left_to_guess_it(tmp_path):
    """The push-options probes push onto the session's own branch, refs/heads/corral/NAME/;
    the container's hostname is its container's name (corral-NAME), so the service names
    the session to the battery itself."""
    podman = Podman()
    manager = SessionManager(podman, lambda request: {"ok": True}, tmp_path / "state")
    manager._save(Record("s1", "10.213.9.0/24", "10.213.9.1", "corral-s1", "corral-s1",
                         "img", 0.0, state="running"))
    Sessions(SandboxConfig(), manager).answer(
        {"op": "selftest", "name": "s1", "options": {"allowed": "allowed.test"}}, None)
    (call,) = [c for c in podman.calls if c[0] == "exec"]
    argv = list(call[call.index("corral-selftest") + 1:])
    parsed = cli.parse_args(argv, REGISTRY)
    assert parsed.session == "s1" and parsed.allowed == "allowed.test", argv
