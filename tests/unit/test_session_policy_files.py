"""A session's policy files are written by the sandbox service (root, umask 0077) and read by
the filter, which runs as its own user: the path to them must be passable, and only that."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from appliance.sandbox.sessions import SessionManager


def test_the_filter_user_can_open_the_files_by_path_and_list_nothing(tmp_path):
    state = tmp_path / "state"
    project = tmp_path / "project"
    project.mkdir()
    (project / "corral.toml").write_text('[http]\nallow = ["example.org"]\n')
    manager = SessionManager(None, None, state)
    old = os.umask(0o077)  # the unit's UMask
    try:
        files = manager._policy_files("s1", [], ["debian"], project)
    finally:
        os.umask(old)
    policy = state / "workspaces" / "s1" / "policy"
    assert files == [str(policy / "corral.toml"), str(policy / "presets.toml")]
    for step in (state, state / "workspaces", policy.parent, policy):
        assert stat.S_IMODE(step.stat().st_mode) == 0o711, step
    for path in files:
        assert stat.S_IMODE(Path(path).stat().st_mode) == 0o644, path
