"""Sessions: one agent container on its own podman bridge network, registered with the filter.

create:  allocate a /24 from the pool -> `podman network create` (no podman DNS) ->
         register subnet and project files with the filter (which re-applies the firewall)
         -> start the hardened container -> write the record (atomically).
         Any step that fails undoes the ones before it: nothing half-made is left.
stop:    remove the container, unregister from the filter, remove the network; the record
         stays (state "stopped") until `remove`.
A record is what the manager meant; `list()` reconciles it with what podman reports.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from appliance.filter.config import SESSION_NAME
from appliance.filter.store import write_atomic

from . import hardening, workspace
from .image import IMAGE
from .podman import Podman, PodmanError

LABEL = "io.corral.session"


class SessionError(RuntimeError):
    """A session could not be created or found; the message says why."""


@dataclass
class Record:
    name: str
    subnet: str
    gateway: str
    network: str
    container: str
    image: str
    created: float
    state: str = "running"
    """running | stopped (as meant; `list()` adds what podman says)."""


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    """The workspace belongs to the agent's user as the user namespace maps it."""
    for directory, dirs, files in os.walk(root):
        os.chown(directory, uid, gid)
        for name in [*dirs, *files]:
            os.chown(os.path.join(directory, name), uid, gid, follow_symlinks=False)


class SessionManager:
    def __init__(self, podman: Podman, control: Callable[[dict], dict], state_dir: Path,
                 pool: str = "10.213.0.0/16", image: str = IMAGE, uid: int = 1000,
                 gid: int = 1000, proxy_port: int = 3128):
        self.podman, self.control = podman, control
        self.records_dir = Path(state_dir) / "sessions"
        self.workspaces = Path(state_dir) / "workspaces"
        self.pool = ipaddress.IPv4Network(pool)
        self.image, self.uid, self.gid, self.proxy_port = image, uid, gid, proxy_port

    # -- records ---------------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        return self.records_dir / f"{name}.json"

    def _save(self, record: Record) -> None:
        write_atomic(self._path(record.name), json.dumps(asdict(record), indent=1).encode())

    def records(self) -> list[Record]:
        out = []
        for path in sorted(self.records_dir.glob("*.json")):
            out.append(Record(**json.loads(path.read_text())))
        return out

    def get(self, name: str) -> Record:
        try:
            return Record(**json.loads(self._path(name).read_text()))
        except FileNotFoundError:
            known = ", ".join(r.name for r in self.records()) or "none"
            raise SessionError(f"no session {name!r}; sessions: {known}") from None

    # -- life cycle --------------------------------------------------------------------------

    def _candidates(self):
        """Free-looking /24s of the pool: not a record's, a podman network's or a filter
        session's. The host may still use one (podman checks): the caller moves on then."""
        taken = {ipaddress.IPv4Network(r.subnet) for r in self.records()}
        for network in self.podman.json("network", "ls", "--format", "json") or []:
            for subnet in network.get("subnets") or []:
                taken.add(ipaddress.ip_network(subnet["subnet"]))
        for session in self.control({"op": "sessions"}).get("sessions", []):
            taken.add(ipaddress.ip_network(session["subnet"]))
        for candidate in self.pool.subnets(new_prefix=24):
            if not any(candidate.overlaps(t) for t in taken):
                yield candidate

    def _network(self, name: str, network: str) -> ipaddress.IPv4Network:
        """Create the session's bridge network on the first free /24."""
        for subnet in self._candidates():
            try:
                self.podman.run("network", "create", "--driver", "bridge", "--subnet",
                                str(subnet), "--gateway", str(next(subnet.hosts())),
                                "--disable-dns", "--label", f"{LABEL}={name}", network)
                return subnet
            except PodmanError as exc:
                if "already used on the host" not in str(exc):
                    raise
        raise SessionError(f"no free /24 left in {self.pool}")

    def workspace(self, name: str) -> tuple[Path, Path]:
        """(work, base): what the agent changes, and what it started from."""
        return self.workspaces / name / "work", self.workspaces / name / "base"

    def create(self, name: str, project_files: list[str] = (), project: Path | None = None,
               command: list[str] = ("sleep", "infinity")) -> Record:
        if not SESSION_NAME.match(name):
            raise SessionError(f"session name {name!r} must be 1-32 of a-z, 0-9 and '-'")
        if self._path(name).exists():
            raise SessionError(f"session {name!r} exists; `corral rm {name}` first")
        network = container = f"corral-{name}"
        undo: list[Callable[[], object]] = []
        volumes: tuple[tuple[str, str], ...] = ()
        try:
            subnet = self._network(name, network)
            gateway = str(next(subnet.hosts()))
            undo.append(lambda: self.podman.run("network", "rm", "--force", network,
                                                check=False))
            if project is not None:
                work, base = self.workspace(name)
                shutil.rmtree(work.parent, ignore_errors=True)  # a stopped session's old copy
                undo.append(lambda: shutil.rmtree(work.parent, ignore_errors=True))
                workspace.copy_in(Path(project), work, base)
                _chown_tree(work, hardening.Sandbox.userns_base + self.uid,
                            hardening.Sandbox.userns_base + self.gid)
                volumes = ((str(work), "/work"),)
            answer = self.control({"op": "session-add", "name": name, "subnet": str(subnet),
                                   "gateway": gateway, "files": list(project_files)})
            if not answer.get("ok"):
                raise SessionError(f"the filter refused session {name}: {answer.get('error')}")
            undo.append(lambda: self.control({"op": "session-remove", "name": name}))
            spec = hardening.Sandbox(name=container, image=self.image, network=network,
                                     gateway=gateway, uid=self.uid, gid=self.gid,
                                     proxy_port=self.proxy_port, volumes=volumes)
            arguments = hardening.run_arguments(spec, list(command))
            # before the run: a run that fails half-way may have created the container
            undo.append(lambda: self.podman.remove_container(container))
            self.podman.run("run", "--label", f"{LABEL}={name}", *arguments)
            record = Record(name, str(subnet), gateway, network, container, self.image,
                            round(time.time(), 3))
            self._save(record)
            return record
        except BaseException:
            for step in reversed(undo):
                step()
            raise

    def stop(self, name: str) -> Record:
        """Container, filter session and network go; the record stays, marked stopped."""
        record = self.get(name)
        self.podman.remove_container(record.container)
        answer = self.control({"op": "session-remove", "name": name})
        if not answer.get("ok") and "no session" not in answer.get("error", ""):
            raise SessionError(f"the filter kept session {name}: {answer.get('error')}")
        self.podman.run("network", "rm", "--force", record.network, check=False)
        record.state = "stopped"
        self._save(record)
        return record

    def diff(self, name: str) -> list[workspace.Change]:
        self.get(name)
        return workspace.changes(*reversed(self.workspace(name)))

    def apply(self, name: str, project: Path, paths: list[str] | None = None,
              force: bool = False) -> list[workspace.Change]:
        """The agent's changes into the host project; raises workspace.Conflict."""
        self.get(name)
        work, base = self.workspace(name)
        return workspace.apply(Path(project), base, work, paths, force)

    def remove(self, name: str) -> None:
        """Stop if needed, then forget the session and its workspace."""
        record = self.get(name)
        if record.state != "stopped":
            self.stop(name)
        shutil.rmtree(self.workspaces / name, ignore_errors=True)
        self._path(name).unlink()

    def list(self) -> list[dict]:
        """Records, each with what podman reports now (a crash or reboot shows up here)."""
        try:
            running = {c["Names"][0]: c["State"] for c in self.podman.json(
                "ps", "--all", "--filter", f"label={LABEL}", "--format", "json") or []}
        except PodmanError as exc:
            raise SessionError(f"cannot ask podman about sessions: {exc}") from None
        return [{**asdict(r), "container_state": running.get(r.container, "absent")}
                for r in self.records()]
