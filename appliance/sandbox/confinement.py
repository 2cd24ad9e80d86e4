"""The two files every sandbox starts with, written into the sandbox service's state
directory before each session starts (the appliance's, the local backend's and the tests'
alike, so no installer can forget them):

  seccomp.json  podman's default profile on this host, hardened (seccomp.py)
  init          podman's init (catatonit), exec-only (0711): the agent runs it as PID 1
                but may not read it, so the kernel marks PID 1 non-dumpable; the agent can
                then neither ptrace it nor open its /proc/1/mem (which could freeze or steer
                the session's init), while it may still trace its own processes (gdb,
                strace) where the host allows that at all.

Both are written atomically (temp file, fsync, rename): a session that starts meanwhile
gets the old file or the new one, whole. Any failure is a ConfinementError and no session
starts without them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from appliance.atomic import write_atomic

from . import seccomp

DEFAULT_PROFILE = Path("/usr/share/containers/seccomp.json")
"""containers-common's default profile: what podman itself uses when told nothing."""
INITS = (Path("/usr/libexec/podman/catatonit"), Path("/usr/bin/catatonit"))
"""podman's own default init path first, then the catatonit package's binary."""


class ConfinementError(RuntimeError):
    """A file a sandbox needs could not be made; the message says which and how to fix it."""


@dataclass(frozen=True)
class Files:
    profile: Path
    """The hardened seccomp profile (`--security-opt seccomp=`)."""
    init: Path
    """The exec-only init (`--init-path`)."""


def install(directory: Path, profile_source: Path | None = None,
            inits: tuple[Path, ...] | None = None) -> Files:
    """Write both files into `directory` (from DEFAULT_PROFILE and the first of INITS unless
    told otherwise); raises ConfinementError."""
    directory = Path(directory)
    return Files(profile=_profile(directory / "seccomp.json", profile_source or DEFAULT_PROFILE),
                 init=_init(directory / "init", inits or INITS))


def _profile(target: Path, source: Path) -> Path:
    try:
        default = json.loads(source.read_bytes())
    except FileNotFoundError:
        raise ConfinementError(f"podman's default seccomp profile {source} is missing: "
                               "apt-get install golang-github-containers-common") from None
    except (OSError, ValueError) as exc:
        raise ConfinementError(f"podman's default seccomp profile {source} is unreadable: "
                               f"{exc}") from None
    try:
        profile = seccomp.harden(default, where=str(source))
    except seccomp.ProfileError as exc:
        raise ConfinementError(str(exc)) from None
    _write(target, json.dumps(profile, indent=1).encode(), 0o644)
    return target


def _init(target: Path, candidates: tuple[Path, ...]) -> Path:
    source = next((p for p in candidates if p.is_file()), None)
    if source is None:
        raise ConfinementError(f"no init for sandboxes: none of {', '.join(map(str, candidates))}"
                               " exists; apt-get install catatonit")
    _write(target, source.read_bytes(), 0o711)  # exec-only: the agent may run it, not read it
    return target


def _write(target: Path, data: bytes, mode: int) -> None:
    """Replace `target` with `data` and `mode` unless it has them already; the mode is set
    before the rename, so no reader ever sees the file without it."""
    try:
        if target.stat().st_mode & 0o7777 == mode and target.read_bytes() == data:
            return
    except FileNotFoundError:
        pass
    write_atomic(target, data, mode)
