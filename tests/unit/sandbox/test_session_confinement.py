"""A session starts under corral's profile and init, written into the manager's state
directory; when they cannot be made, no session starts and nothing is left to undo."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from appliance import pki
from appliance.sandbox import confinement
from appliance.sandbox.sessions import SessionError, SessionManager

from .test_seccomp import podman_like_default


class Recorder:
    """Stands in for podman and the filter's control socket (neither runs in unit tests):
    records every call and answers as they would for an empty host."""

    def __init__(self):
        self.calls: list[tuple[str, ...]] = []

    def run(self, *args, **kwargs):
        self.calls.append(args)
        if args[:2] == ("run", "--rm"):  # the image's own CA bundle, read once
            return SimpleNamespace(stdout=pki.intercept_ca()[0])
        return None

    def json(self, *args):
        self.calls.append(args)
        return [{"Id": "0" * 64}] if args[:2] == ("image", "inspect") else []

    def remove_container(self, name):
        self.calls.append(("remove", name))

    def control(self, request):
        self.calls.append(("control", request["op"]))
        return {"ok": True, "sessions": [], "environment": {}}


@pytest.fixture
def host(tmp_path, monkeypatch):
    default = tmp_path / "seccomp.json"
    default.write_text(json.dumps(podman_like_default()))
    init = tmp_path / "catatonit"
    init.write_bytes(b"\x7fELF")
    monkeypatch.setattr(confinement, "DEFAULT_PROFILE", default)
    monkeypatch.setattr(confinement, "INITS", (init,))
    return default


def test_the_container_runs_with_the_profile_and_init_of_the_state_dir(tmp_path, host):
    recorder = Recorder()
    manager = SessionManager(recorder, recorder.control, tmp_path / "state")
    manager.create("s1")
    (run,) = [c for c in recorder.calls if c[:2] == ("run", "--label")]
    profile, init = tmp_path / "state" / "seccomp.json", tmp_path / "state" / "init"
    assert f"seccomp={profile}" in run and run[run.index("--init-path") + 1] == str(init)
    assert profile.is_file() and init.is_file()


def test_no_session_starts_without_its_profile(tmp_path, host):
    host.write_text('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}')
    recorder = Recorder()
    manager = SessionManager(recorder, recorder.control, tmp_path / "state")
    with pytest.raises(SessionError, match=r"s1 cannot be confined: .*default-deny"):
        manager.create("s1")
    assert recorder.calls == []  # no network, no filter session, no container
    assert manager.records() == []


def test_a_session_whose_trust_cannot_be_written_stops_no_other_refresh(
        tmp_path, host, monkeypatch):
    from appliance.sandbox import trust

    recorder = Recorder()
    manager = SessionManager(recorder, recorder.control, tmp_path / "state")
    manager.create("a1")
    manager.create("b1")
    reads = [c for c in recorder.calls if c[:2] == ("run", "--rm")]
    assert len(reads) == 1  # the image's bundle is read once, then kept by the image's id
    real = trust.write

    def write(directory, *args):
        if directory.parent.name == "a1":
            raise OSError(28, "No space left on device")
        return real(directory, *args)

    monkeypatch.setattr(trust, "write", write)
    refreshed, failed = manager.refresh_trust()
    assert refreshed == ["b1"] and "No space left" in failed["a1"]


class Holding(Recorder):
    """... on an appliance that holds a secret, and under an install that succeeds."""

    def run(self, *args, **kwargs):
        if args[0] == "wait":
            return SimpleNamespace(stdout=b"0\n")
        if args[0] == "logs":
            return SimpleNamespace(stdout=b"", stderr=b"")
        return super().run(*args, **kwargs)

    def control(self, request):
        answer = super().control(request)
        return {**answer, "environment": {"NPM_TOKEN": f"corral-secret-{request.get('session')}"},
                "ssh": {"hosts": ["github.com"], "host_key": "ssh-ed25519 AAAAC3Nz", "port": 2222,
                        "key": "-----BEGIN OPENSSH PRIVATE KEY-----\n"}}


def test_an_agents_install_gets_no_secrets_placeholder(tmp_path, host):
    """The install runs every script of the package's dependencies, with the registry
    reachable: given the session's placeholder, one of them could have the filter attach a
    token the appliance holds for the registry (npm publish as the person). A session of
    the agent itself still gets its secrets."""
    from appliance.agents.profile import parse_profile, shipped
    from appliance.sandbox.service import SandboxConfig, Sessions

    recorder = Holding()
    manager = SessionManager(recorder, recorder.control, tmp_path / "state")
    sessions = Sessions(SandboxConfig(), manager)
    claude = parse_profile((shipped() / "claude.toml").read_text(), "claude.toml")
    sessions._install(claude, "k", tmp_path)
    manager.create("s1")
    install, session = [c for c in recorder.calls if c[:2] == ("run", "--label")]
    assert "corral-agent-install-" in " ".join(install)
    assert not [a for a in install if a.startswith("NPM_TOKEN=")], install
    assert "NPM_TOKEN=corral-secret-s1" in session
    assert not [a for a in install if "ssh_config" in a], install  # no key for the gateway
    assert [a for a in session if "ssh_config" in a]
