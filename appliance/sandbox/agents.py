"""Agents in sessions: each profile's install, made once per appliance and install key, and
what a session of the agent gets besides any session's.

  STATE/agents/NAME-KEY/           the installed tree, renamed into place when complete
  STATE/agents/NAME-KEY.json       written after the rename: the tree is done (what, when)
  STATE/agents/.NAME-KEY-XXXX/     an install under way (removed whether it fails or not)
  STATE/agents/profile.sh          mounted at PROFILE_D: a login shell keeps MOUNT/bin first

The install runs in a throwaway session of its own, through the filter, whose only layer
is the install's policy (its registry, `Install.policy_text`), with a scratch directory at
MOUNT; sessions then mount the finished tree read-only there. It never runs again for the
same key (package, version, source and sandbox image); a profile at a new version installs
anew beside the old tree, which stays (nothing collects old trees yet).

The decisions are pure functions; `Installs` does the file system and the locking, and is
handed the function that runs one install (the sandbox service's, with its sessions).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from appliance.agents.profile import MOUNT, Profile, parse_profile
from appliance.atomic import write_atomic
from appliance.workspace import remove_tree

log = logging.getLogger("corral.sandbox")

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""podman's PATH for an image that sets none (the sandbox image's base is imported)."""
PROFILE_D = "/etc/profile.d/corral-agent.sh"
PROFILE_SCRIPT = (
    "# corral: the agent's installed tree first (Debian's /etc/profile sets PATH anew for a\n"
    "# login shell, as `corral shell` opens; podman exec alone keeps the session's PATH)\n"
    f'case ":$PATH:" in *":{MOUNT}/bin:"*) ;; *) PATH="{MOUNT}/bin:$PATH" ;; esac\n'
    "export PATH\n")
INSTALL_TIMEOUT = 480.0
"""Seconds an install may take: the CLI waits at most 600 for its session (cli SLOW)."""
INSTALL_ENVIRONMENT = (("npm_config_cache", "/tmp/npm-cache"),  # noqa: S108 - in the container
                       ("npm_config_update_notifier", "false"),
                       ("PIP_NO_CACHE_DIR", "1"))
"""The install session's own: caches in its /tmp (the root is read-only, and nothing of
them belongs in the tree)."""
MAX_PROFILE = 16 * 1024
"""Bytes of profile text a session may be asked for with."""
LOG_LINES = 200
"""Lines of a failed install's output read back (`tail` keeps the last of them)."""
MAX_TREE_DEPTH = 128
"""Levels an installed tree may have (npm's and pip's trees are a few dozen deep): a deeper
one is the package's doing, refused rather than kept."""


class AgentError(ValueError):
    """The profile or its install refuses the session; the message says why and the fix."""


def parse(text: object, name: object) -> Profile:
    """The profile as the host sent it, parsed again here (the appliance trusts no host's
    reading of it): AgentError naming what is wrong."""
    if not isinstance(name, str) or not isinstance(text, str):
        raise AgentError("'agent' (the profile's TOML text) and 'agent_name' go together, "
                         "both strings")
    if len(text.encode()) > MAX_PROFILE:
        raise AgentError(f"the profile of agent {name!r} is {len(text.encode())} bytes; the "
                         f"limit is {MAX_PROFILE}")
    from appliance.policy.config import ConfigError

    try:
        return parse_profile(text, f"agent {name}", name)
    except ConfigError as exc:
        raise AgentError(str(exc)) from None


def tree_name(profile: Profile, key: str) -> str:
    return f"{profile.name}-{key}"


INSTALL_PREFIX = "agent-install-"
"""Names of install sessions: no one else's session takes one (an install removes a
session of its name, as one left by a service stopped mid-install)."""


def install_session(tree: str) -> str:
    """The throwaway session's name for one tree (a session name: 1-32 of a-z, 0-9, '-'):
    two profiles of one package share a key, not a tree, and may install at once."""
    return f"{INSTALL_PREFIX}{hashlib.sha256(tree.encode()).hexdigest()[:12]}"


def is_ready(tree: bool, marker: bool) -> str:
    """What to do with a key's tree: "ready" (both there), "install" (neither), "redo" (a
    tree without its marker: the service stopped between the rename and the marker, or
    someone removed the marker to have it installed again)."""
    if tree and marker:
        return "ready"
    return "redo" if tree else "install"


def session_environment(profile: Profile, image_path: str) -> tuple[tuple[str, str], ...]:
    """PATH with the agent's bin first, then the profile's own variables (the profile
    parser refuses those the confinement sets)."""
    path = f"{MOUNT}/bin:{image_path or DEFAULT_PATH}"
    return (("PATH", path), *profile.environment)


def image_path(environment: list[str] | None) -> str:
    """The image's PATH from its config's Env (`podman image inspect`), or podman's."""
    for item in environment or []:
        if item.startswith("PATH="):
            return item[5:] or DEFAULT_PATH
    return DEFAULT_PATH


def home_directories(persist: tuple[str, ...]) -> list[str]:
    """The directories to make in the project's home before the session starts, so that the
    agent finds each persisted path's place writable: the path itself, or for a file (a dot
    past the name's leading one: `.claude.json`) its parent only — an empty file is not the
    JSON or YAML the agent expects, and it writes the file itself. Parents come first."""
    wanted: list[str] = []
    for item in persist:
        path = PurePosixPath(item)
        is_file = "." in path.name.lstrip(".")  # .claude.json, .aider.conf.yml
        target = path.parent if is_file else path
        for depth in range(1, len(target.parts) + 1):
            step = PurePosixPath(*target.parts[:depth]).as_posix()
            if step not in wanted:
                wanted.append(step)
    return wanted


def record(profile: Profile, key: str) -> dict:
    """What a session's record keeps of its agent (`corral ls --json` shows it)."""
    return {"name": profile.name, "package": profile.install.package,
            "version": profile.install.version, "kind": profile.install.kind, "key": key}


def tail(output: bytes, lines: int = 25, limit: int = 3000) -> str:
    """The end of an install's output, for the refusal: what npm or pip said last, each
    line quoted (`  | `): the package wrote them, and the person reads them among corral's
    own lines (the CLI escapes controls, not line breaks)."""
    text = output.decode(errors="replace").replace("\r", "\n").strip()
    kept = "\n".join(line for line in text.splitlines() if line.strip())
    kept = "\n".join(kept.splitlines()[-lines:])[-limit:]
    return "\n".join(f"  | {line}" for line in kept.splitlines())


def make_home_directories(home: Path, directories: list[str], uid: int, gid: int) -> list[str]:
    """Make `directories` (relative, parents first) under `home`, each new one owned by
    uid:gid. The home is the agent's, and was written by earlier sessions: nothing in it is
    followed (a link the agent left would have root make and chown directories elsewhere),
    so a path it made into something else is left as it is, and named in the answer."""
    skipped: list[str] = []
    root = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for directory in directories:
            fd = os.dup(root)
            try:
                for part in PurePosixPath(directory).parts:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                        os.chown(part, uid, gid, dir_fd=fd, follow_symlinks=False)
                    except FileExistsError:
                        pass
                    try:
                        step = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                                       dir_fd=fd)
                    except OSError:  # a link, a file: the agent's own doing, left alone
                        skipped.append(directory)
                        break
                    os.close(fd)
                    fd = step
            finally:
                os.close(fd)
    finally:
        os.close(root)
    return skipped


@dataclass(frozen=True)
class Installed:
    tree: Path
    key: str
    fresh: bool
    """Installed by this call (False: found from before)."""


class Installs:
    """The appliance's installed agents under `root`. `run(profile, key, scratch)` installs
    one into `scratch` (a directory owned by the sandbox's mapped user, mounted at MOUNT) or
    raises AgentError with what the install said."""

    def __init__(self, root: Path, run: Callable[[Profile, str, Path], None],
                 owner: tuple[int, int]):
        self.root, self.run, self.owner = Path(root), run, owner
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    def profile_script(self) -> Path:
        path = self.root / "profile.sh"
        if not path.is_file() or path.read_text() != PROFILE_SCRIPT:
            self._root()
            write_atomic(path, PROFILE_SCRIPT.encode(), mode=0o644)
        return path

    def _root(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o711)  # the trees are read through their mounts, not listed

    def _lock(self, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(name, threading.Lock())

    def ensure(self, profile: Profile, key: str) -> Installed:
        """The tree for this profile and key, installed first when it is not there. Two
        sessions asking at once wait for one install."""
        name = tree_name(profile, key)
        tree, marker = self.root / name, self.root / f"{name}.json"
        with self._lock(name):
            state = is_ready(tree.is_dir(), marker.is_file())
            if state == "ready":
                return Installed(tree, key, fresh=False)
            if state == "redo":
                log.warning("agent %s: %s has no marker (an install cut short after its "
                            "rename?): installing it again", profile.name, tree)
                remove_tree(tree)  # the package made it: as deep as it liked
            self._root()
            for stale in self.root.glob(f".{name}-*"):  # a service stopped mid-install
                try:
                    remove_tree(stale)
                except OSError as exc:
                    log.warning("agent %s: could not remove %s: %s", profile.name, stale, exc)
            started = time.monotonic()
            log.info("agent %s: installing %s (%s, install key %s) through the filter",
                     profile.name, profile.install.spec, profile.install.index, key)
            scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=self.root))
            try:
                os.chown(scratch, *self.owner)
                os.chmod(scratch, 0o755)  # noqa: S103 - the install writes it, as its user
                self.run(profile, key, scratch)
                _read_only(scratch)
                scratch.rename(tree)  # complete, or not there at all
            finally:
                if scratch.exists():
                    remove_tree(scratch)
            seconds = time.monotonic() - started
            write_atomic(marker, json.dumps({
                **record(profile, key), "spec": profile.install.spec,
                "index": profile.install.index, "installed": round(time.time(), 3),
                "seconds": round(seconds, 1)}, indent=1).encode(), mode=0o644)
            log.info("agent %s: %s installed in %.1fs into %s (older versions' trees stay "
                     "beside it)", profile.name, profile.install.spec, seconds, tree)
            return Installed(tree, key, fresh=True)


def _read_only(tree: Path) -> None:
    """The tree as sessions see it: nobody's to write, even if it were mounted writable
    (write bits off, so a mistake in a mount does not make it the agent's), and no set-uid,
    set-gid or sticky bit (on the appliance's disk the files are the sandbox's mapped user's:
    a set-uid one would let any local account act as that user, who owns every session's
    workspace). Walked by descriptor, without recursion, never through a link (the package
    made the tree: as deep and as long-named as it liked); AgentError past MAX_TREE_DEPTH.
    Nothing writes the tree meanwhile: its install session is gone."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    stack = [(os.open(tree, flags), iter(()))]
    try:
        stack[0] = (stack[0][0], iter(os.listdir(stack[0][0])))
        while stack:
            fd, names = stack[-1]
            name = next(names, None)
            if name is None:
                os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) & 0o555)
                os.close(stack.pop()[0])
                continue
            mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode):
                continue
            if not stat.S_ISDIR(mode):
                os.chmod(name, stat.S_IMODE(mode) & 0o555, dir_fd=fd)
                continue
            if len(stack) >= MAX_TREE_DEPTH:
                raise AgentError(f"the install made a tree more than {MAX_TREE_DEPTH} levels "
                                 f"deep (under {tree.name}): refused, and removed")
            child = os.open(name, flags, dir_fd=fd)
            try:
                stack.append((child, iter(os.listdir(child))))
            except BaseException:
                os.close(child)
                raise
    finally:
        for fd, _ in stack:
            os.close(fd)
