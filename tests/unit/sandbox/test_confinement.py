"""The files a sandbox starts with: written whole, with their modes, only when they change;
a default that is missing or cannot be hardened stops the session with the fix named."""

from __future__ import annotations

import json
import stat

import pytest

from appliance.sandbox import confinement, seccomp

from .test_seccomp import podman_like_default


@pytest.fixture
def sources(tmp_path):
    default = tmp_path / "usr" / "seccomp.json"
    default.parent.mkdir()
    default.write_text(json.dumps(podman_like_default()))
    init = tmp_path / "usr" / "catatonit"
    init.write_bytes(b"\x7fELF an init")
    init.chmod(0o755)
    return default, init


def test_install_writes_the_hardened_profile_and_an_exec_only_init(tmp_path, sources):
    default, init = sources
    files = confinement.install(tmp_path / "state", default, (tmp_path / "absent", init))
    assert files == confinement.Files(tmp_path / "state" / "seccomp.json",
                                      tmp_path / "state" / "init")
    assert json.loads(files.profile.read_text()) == seccomp.harden(podman_like_default())
    assert stat.S_IMODE(files.profile.stat().st_mode) == 0o644
    assert files.init.read_bytes() == init.read_bytes()
    assert stat.S_IMODE(files.init.stat().st_mode) == 0o711  # others may run it, not read it
    assert sorted(p.name for p in files.profile.parent.iterdir()) == ["init", "seccomp.json"]


def test_install_rewrites_only_what_changed(tmp_path, sources):
    default, init = sources
    first = confinement.install(tmp_path, default, (init,))
    inodes = (first.profile.stat().st_ino, first.init.stat().st_ino)
    again = confinement.install(tmp_path, default, (init,))
    assert (again.profile.stat().st_ino, again.init.stat().st_ino) == inodes
    init.write_bytes(b"\x7fELF a newer init")
    first.profile.chmod(0o600)
    confinement.install(tmp_path, default, (init,))
    assert first.init.read_bytes() == b"\x7fELF a newer init"
    assert first.init.stat().st_ino != inodes[1]
    assert stat.S_IMODE(first.profile.stat().st_mode) == 0o644


def test_a_missing_default_names_the_package(tmp_path, sources):
    _, init = sources
    with pytest.raises(confinement.ConfinementError,
                       match=r"nothing\.json is missing: apt-get install golang-github-"):
        confinement.install(tmp_path / "state", tmp_path / "nothing.json", (init,))
    assert not (tmp_path / "state" / "seccomp.json").exists()


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "unreadable"),
    ('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}', "default-deny profiles only"),
])
def test_a_default_that_cannot_be_hardened_stops_the_install(tmp_path, sources, text, message):
    default, init = sources
    default.write_text(text)
    with pytest.raises(confinement.ConfinementError, match=message) as caught:
        confinement.install(tmp_path / "state", default, (init,))
    assert str(default) in str(caught.value)
    assert not (tmp_path / "state" / "seccomp.json").exists()


def test_a_missing_init_names_the_package(tmp_path, sources):
    default, _ = sources
    with pytest.raises(confinement.ConfinementError, match="apt-get install catatonit"):
        confinement.install(tmp_path, default, (tmp_path / "a", tmp_path / "b"))
