"""Sessions: one agent container on its own podman bridge network, registered with the filter.

create:  allocate a /24 from the pool -> `podman network create` (no podman DNS) ->
         register subnet and project files with the filter (which re-applies the firewall)
         -> start the hardened container -> write the record (atomically).
         Any step that fails undoes the ones before it: nothing half-made is left.
stop:    remove the container, unregister from the filter, remove the network; the record,
         the workspace and the project's home stay (state "stopped") until `remove`.
A record is what the manager meant; `list()` shows it next to what podman reports, and
`reconcile()` (at service start) stops what died meanwhile and removes orphans.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from appliance import workspace
from appliance.atomic import write_atomic
from appliance.sessionconfig import SESSION_NAME

from . import agents, confinement, hardening, lifetime, sshconf, trust
from .image import IMAGE
from .podman import Podman, PodmanError
from .reviews import DamagedSnapshot, Reviews

log = logging.getLogger("corral.sandbox")
LABEL = "io.corral.session"
LAYER_FILE = re.compile(r"^[a-z0-9][a-z0-9-]{0,40}\.toml$")
"""A layer the session service writes into a session's policy directory (an agent's, an
install's): never one of the project's names."""
OWNER = "io.corral.owner"
"""On every container and network: the state directory of the manager that made it, so a
manager reconciles only its own (two appliances or test runs may share one podman)."""


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
    project: str = ""
    """The project's id: sessions of one project share its home directory."""
    uid: int = 1000
    gid: int = 1000
    presets: list[str] = field(default_factory=list)
    reason: str = ""
    """Why a session stopped when nobody asked it to (reconcile, its limits)."""
    max_uptime: int = 0
    idle: int = 0
    memory: str = ""
    cpus: str = ""
    pids: int = 0
    """Its limits (lifetime.Limits; 0 or "": none, or the sandbox's default)."""
    agent: dict = field(default_factory=dict)
    """The agent it runs (`corral run --agent`): name, package, version, install key."""
    took: dict = field(default_factory=dict)
    """Seconds each step of its start took, in order: `network` (its bridge), `files` (its
    home, workspace and policy files), `filter` (registered with the filter, whose firewall
    follows, and its placeholders), `container` (podman run). Where a start's time goes."""

    @property
    def limits(self) -> lifetime.Limits:
        return lifetime.Limits(self.max_uptime, self.idle, self.memory, self.cpus, self.pids)


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    """The workspace belongs to the agent's user as the user namespace maps it."""
    for directory, dirs, files in os.walk(root):
        os.chown(directory, uid, gid)
        for name in [*dirs, *files]:
            os.chown(os.path.join(directory, name), uid, gid, follow_symlinks=False)


def _remove(path: Path) -> None:
    """A tree the agent wrote (its workspace, its home) goes, however deep it made it
    (shutil.rmtree recurses: RecursionError past ~1000 levels, even with ignore_errors)."""
    try:
        workspace.remove_tree(path)
    except OSError as exc:
        log.warning("could not remove all of %s: %s", path, exc)


def _identity(name: str, project_id: str, uid, gid) -> tuple[int, int]:
    """The session's name, project id and the agent's ids, checked: (uid, gid)."""
    if not SESSION_NAME.match(name):
        raise SessionError(f"session name {name!r} must be 1-32 of a-z, 0-9 and '-'")
    if project_id and not SESSION_NAME.match(project_id):
        raise SessionError(f"project id {project_id!r} must be 1-32 of a-z, 0-9 and '-'")
    for what, value in (("uid", uid), ("gid", gid)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 65536:
            raise SessionError(f"{what} must be 1-65535 (never root), got {value!r}")
    return uid, gid


class SessionManager:
    def __init__(self, podman: Podman, control: Callable[[dict], dict], state_dir: Path,
                 pool: str = "10.213.0.0/16", image: str = IMAGE, uid: int = 1000,
                 gid: int = 1000, proxy_port: int = 3128):
        self.podman, self.control = podman, control
        self.state_dir = Path(state_dir)
        self.records_dir = Path(state_dir) / "sessions"
        self.workspaces = Path(state_dir) / "workspaces"
        self.homes = Path(state_dir) / "homes"
        self.owner = str(Path(state_dir).resolve())
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
                                "--disable-dns", "--label", f"{LABEL}={name}",
                                "--label", f"{OWNER}={self.owner}", network)
                return subnet
            except PodmanError as exc:
                if "already used on the host" not in str(exc):
                    raise
        raise SessionError(f"no free /24 left in {self.pool}")

    def workspace(self, name: str) -> tuple[Path, Path]:
        """(work, base): what the agent changes, and what it started from."""
        return self.workspaces / name / "work", self.workspaces / name / "base"

    def home(self, project: str) -> Path:
        return self.homes / project

    def trust(self, name: str) -> Path:
        """Write the session's trust directory (its image's bundle and the filter's
        interception CA, as the filter has it now); returns its path."""
        answer = self.control({"op": "inspect-ca"})
        if not answer.get("ok"):
            raise SessionError(f"cannot ask the filter for its CA: {answer.get('error')}")
        directory = self.workspaces / name / "trust"
        trust.write(directory, (answer.get("ca") or {}).get("pem"), self.image_bundle())
        return directory

    def image_facts(self) -> tuple[str, str]:
        """The session image's id (an agent's install is kept per image: a new one may bring
        another node or python) and its PATH (an agent's bin goes before it)."""
        try:
            inspected = self.podman.json("image", "inspect", self.image)[0]
            return inspected["Id"], agents.image_path(inspected.get("Config", {}).get("Env"))
        except (PodmanError, LookupError, TypeError) as exc:
            raise SessionError(f"cannot inspect image {self.image}: {exc}") from None

    def image_bundle(self) -> bytes:
        """What the session image trusts on its own (Debian's bundle, and any CA a team's
        layer added), read from the image once and kept by its id."""
        try:
            image_id = self.podman.json("image", "inspect", self.image)[0]["Id"]
        except (PodmanError, LookupError, TypeError) as exc:
            raise SessionError(f"cannot inspect image {self.image}: {exc}") from None
        kept = self.state_dir / "trust" / f"{image_id[:64]}.crt"
        try:
            return kept.read_bytes()
        except FileNotFoundError:
            pass
        bundle = self.podman.run("run", "--rm", "--network", "none", "--entrypoint", "cat",
                                 self.image, trust.SYSTEM_BUNDLE).stdout
        if not trust.certificates(bundle):
            raise SessionError(f"image {self.image} trusts no CA ({trust.SYSTEM_BUNDLE} holds "
                               "no certificate): install ca-certificates in it")
        write_atomic(kept, bundle, mode=0o644)
        return bundle

    def refresh_trust(self) -> tuple[list[str], dict[str, str]]:
        """Every running session's trust directory anew (after the filter's CA changed):
        the files are replaced in the mounted directory, so the session's next processes
        see them. Returns (refreshed, {session: why not}): one failure stops no other."""
        done, failed = [], {}
        for record in self.records():
            if record.state != "running":
                continue
            try:
                self.trust(record.name)
                done.append(record.name)
            except (SessionError, PodmanError, OSError) as exc:
                log.error("trust of session %s not refreshed: %s", record.name, exc)
                failed[record.name] = str(exc)
        return done, failed

    def _policy_files(self, name: str, project_files: list[str], presets: list[str],
                      project: Path | None, layers: dict[str, str] | None = None) -> list[str]:
        """The session's own layers: the given files, the project's corral.toml (copied out
        of the agent's reach first: /work is the agent's, its policy is not), presets, then
        `layers` written as files of their own (`agent-NAME.toml`: the rules it adds name
        that file as their source)."""
        directory = self.workspaces / name / "policy"
        directory.mkdir(parents=True, exist_ok=True)
        # the filter runs as its own user and opens these by path: it may pass through every
        # directory on the way, not list them (the service's umask makes them 0700)
        for step in (self.workspaces.parent, self.workspaces, directory.parent, directory):
            step.chmod(0o711)
        files = list(project_files)
        if project is not None and (project / "corral.toml").is_file():
            shutil.copyfile(project / "corral.toml", directory / "corral.toml")
            files.append(str(directory / "corral.toml"))
        if presets:
            (directory / "presets.toml").write_text(f"presets = {json.dumps(list(presets))}\n")
            files.append(str(directory / "presets.toml"))
        for file_name, text in (layers or {}).items():
            if not LAYER_FILE.match(file_name) or file_name in ("corral.toml", "presets.toml"):
                raise SessionError(f"session {name}: {file_name!r} is no layer's file name")
            (directory / file_name).write_text(text)
            files.append(str(directory / file_name))
        for path in directory.iterdir():
            path.chmod(0o644)
        return files

    def create(self, name: str, project_files: list[str] = (), project: Path | None = None,
               command: list[str] = ("sleep", "infinity"), presets: list[str] = (),
               project_id: str = "", uid: int | None = None, gid: int | None = None,
               limits: lifetime.Limits | None = None, layers: dict[str, str] | None = None,
               read_only: tuple[tuple[str, str], ...] = (),
               mounts: tuple[tuple[str, str], ...] = (),
               environment: tuple[tuple[str, str], ...] = (),
               home_directories: list[str] = (), agent: dict | None = None,
               secrets: bool = True) -> Record:
        """A session. An agent's brings its own: `layers` (policy files by name), mounts
        (`read_only` and read-write `mounts`, (source, target) pairs), `environment`,
        `home_directories` made in the project's home first, and `agent` for its record.
        `secrets=False`: no secret's placeholder in its environment and no key for the git
        gateway (an agent's install: its packages' scripts have no use for the appliance's
        secrets, and without the session's placeholder the filter attaches none)."""
        uid, gid = _identity(name, project_id, self.uid if uid is None else uid,
                             self.gid if gid is None else gid)
        if not project_id and home_directories:
            raise SessionError(f"session {name} keeps {', '.join(home_directories)} in "
                               "its project's home, and has none: give it a project_id")
        if self._path(name).exists():
            raise SessionError(f"session {name!r} exists; `corral rm {name}` first")
        network = container = f"corral-{name}"
        undo: list[Callable[[], object]] = []
        took: dict[str, float] = {}
        step = [time.monotonic()]

        def done(what: str) -> None:
            now = time.monotonic()
            took[what] = round(now - step[0], 3)
            step[0] = now

        try:
            # first, before anything needs undoing; written before every start, so that a
            # containers-common update reaches the next session
            try:
                confined = confinement.install(self.state_dir)
            except (confinement.ConfinementError, OSError) as exc:
                raise SessionError(f"session {name} cannot be confined: {exc}") from None
            subnet = self._network(name, network)
            gateway = str(next(subnet.hosts()))
            undo.append(lambda: self.podman.run("network", "rm", "--force", network,
                                                check=False))
            done("network")
            volumes = self._volumes(name, project, project_id, list(home_directories),
                                    uid, gid, undo)
            files = self._policy_files(name, list(project_files), list(presets),
                                       Path(project) if project is not None else None, layers)
            trusted = self.trust(name)
            done("files")
            placeholders = self._registered(name, subnet, gateway, files, undo)
            done("filter")
            try:
                ssh = sshconf.write(trusted, gateway, placeholders.get("ssh") if secrets
                                    else None, hardening.Sandbox.userns_base)
            except (ValueError, KeyError, TypeError, OSError) as exc:
                raise SessionError(f"session {name}: the git gateway's files: {exc}") from None
            limits = limits or lifetime.Limits()
            resources = {k: v for k, v in (("memory", limits.memory), ("cpus", limits.cpus),
                                           ("pids", limits.pids)) if v}
            spec = hardening.Sandbox(name=container, image=self.image, network=network,
                                     gateway=gateway, seccomp_profile=str(confined.profile),
                                     init=str(confined.init), uid=uid, gid=gid,
                                     proxy_port=self.proxy_port,
                                     volumes=(*volumes, *mounts),
                                     trust=str(trusted), ssh=ssh, secrets=tuple(
                                         placeholders["environment"].items()) if secrets
                                     else (),
                                     read_only=tuple(read_only),
                                     environment=tuple(environment), **resources)
            arguments = hardening.run_arguments(spec, list(command))
            # before the run: a run that fails half-way may have created the container
            undo.append(lambda: self.podman.remove_container(container))
            self.podman.run("run", "--label", f"{LABEL}={name}", "--label",
                            f"{OWNER}={self.owner}", *arguments)
            done("container")
            record = Record(name, str(subnet), gateway, network, container, self.image,
                            round(time.time(), 3), project=project_id, uid=uid, gid=gid,
                            presets=list(presets), max_uptime=limits.max_uptime,
                            idle=limits.idle, memory=spec.memory, cpus=spec.cpus,
                            pids=spec.pids, agent=dict(agent or {}), took=took)
            self._save(record)
            return record
        except BaseException:
            for step in reversed(undo):
                step()
            raise

    def _volumes(self, name: str, project: Path | None, project_id: str,
                 home_directories: list[str], uid: int, gid: int,
                 undo: list[Callable[[], object]]) -> tuple[tuple[str, str], ...]:
        """The session's /work (a copy of the project, owned by the agent's mapped ids) and
        /home/agent (the project's home, kept across its sessions), each undone on failure
        by a step added to `undo`."""
        mapped = hardening.Sandbox.userns_base
        volumes: tuple[tuple[str, str], ...] = ()
        if project is not None:
            work, base = self.workspace(name)
            _remove(work.parent)  # a stopped session's old copy
            undo.append(lambda: _remove(work.parent))
            workspace.copy_in(Path(project), work, base)
            _chown_tree(work, mapped + uid, mapped + gid)
            volumes = ((str(work), "/work"),)
        else:
            undo.append(lambda: _remove(self.workspaces / name))
        if project_id:
            home = self.home(project_id)
            if not home.exists():
                home.mkdir(parents=True)
                os.chown(home, mapped + uid, mapped + gid)
            volumes = (*volumes, (str(home), "/home/agent"))
            skipped = agents.make_home_directories(home, home_directories,
                                                   mapped + uid, mapped + gid)
            for path in skipped:
                log.warning("session %s: %s in the home of project %s is not a directory "
                            "(the agent made it something else): left as it is", name,
                            path, project_id)
        return volumes

    def _registered(self, name: str, subnet: ipaddress.IPv4Network, gateway: str,
                    files: list[str], undo: list[Callable[[], object]]) -> dict:
        """Register the session with the filter (its subnet, gateway and policy files; the
        filter re-applies the firewall) and return the secrets' placeholders it hands out
        for it; unregistered by a step added to `undo`."""
        answer = self.control({"op": "session-add", "name": name, "subnet": str(subnet),
                               "gateway": gateway, "files": files})
        if not answer.get("ok"):
            raise SessionError(f"the filter refused session {name}: {answer.get('error')}")
        undo.append(lambda: self.control({"op": "session-remove", "name": name}))
        placeholders = self.control({"op": "secret-environment", "session": name})
        if not placeholders.get("ok"):
            raise SessionError(f"the filter gave no placeholders for session {name}: "
                               f"{placeholders.get('error')}")
        return placeholders

    def stop(self, name: str, reason: str = "") -> Record:
        """Container, filter session and network go; the record stays, marked stopped."""
        record = self.get(name)
        self.podman.remove_container(record.container)
        answer = self.control({"op": "session-remove", "name": name,
                               **({"reason": reason} if reason else {})})
        if not answer.get("ok") and "no session" not in answer.get("error", ""):
            raise SessionError(f"the filter kept session {name}: {answer.get('error')}")
        self.podman.run("network", "rm", "--force", record.network, check=False)
        if record.state != "stopped" or reason:  # a second stop keeps why it stopped first
            record.reason = reason
        record.state = "stopped"
        self._save(record)
        return record

    def diff(self, name: str) -> workspace.Changeset:
        self.get(name)
        work, base = self.workspace(name)
        return workspace.changes(base, work)

    def reviews(self, name: str) -> Reviews:
        return Reviews(self.workspaces / name / "reviews")

    def review(self, name: str) -> tuple[workspace.Snapshot, str]:
        """What `corral diff` shows: a snapshot of the changes, their contents read while
        the session is paused (a running agent writes nothing meanwhile, so no file is
        read half-written and the files agree with each other), kept under its digest.
        Returns it and, when the session could not be paused, why (the snapshot is still
        what is shown and applied; it was only read while the agent ran)."""
        record = self.get(name)
        work, base = self.workspace(name)
        with self._paused(record) as not_paused:
            taken = workspace.take(workspace.changes(base, work))
        self.reviews(name).save(taken)
        return taken, not_paused

    def reviewed(self, name: str, digest: str) -> workspace.Snapshot:
        """The snapshot `corral diff` showed under `digest`; SessionError naming it and the
        digest of the changes now when none is kept under it (applying anything else would
        apply what nobody reviewed)."""
        self.get(name)
        reviews = self.reviews(name)
        try:
            kept = reviews.load(digest)
        except DamagedSnapshot as exc:
            raise SessionError(f"{exc}; nothing applied: run `corral diff {name}` again"
                               ) from None
        if kept is not None:
            return kept
        work, base = self.workspace(name)
        now = workspace.take(workspace.changes(base, work))
        if now.digest == digest:  # not kept any more, but the same changes to the byte
            reviews.save(now)
            return now
        raise SessionError(
            f"session {name} has no reviewed changeset {digest} (it keeps the last "
            f"{reviews.keep} diffs); its changes now have digest {now.digest}: nothing "
            f"applied. Run `corral diff {name}`, read it, then `corral apply {name} --digest` "
            "with the digest it prints")

    @contextlib.contextmanager
    def _paused(self, record: Record):
        """The session's processes frozen (podman pause, the cgroup freezer) while the body
        runs; yields why not when they could not be ("" when they were, or nothing runs)."""
        if record.state != "running":
            yield ""
            return
        paused = self.podman.run("pause", record.container, check=False)
        if paused.returncode != 0:
            said = paused.stderr.decode(errors="replace").strip()[-300:]
            log.warning("session %s not paused for its diff: %s", record.name, said)
            yield f"the session could not be paused ({said})"
            return
        try:
            yield ""
        finally:
            resumed = self.podman.run("unpause", record.container, check=False)
            if resumed.returncode != 0:  # reconcile unpauses it at the next start
                log.error("session %s not unpaused after its diff: %s", record.name,
                          resumed.stderr.decode(errors="replace").strip()[-300:])

    def fold(self, name: str, applied: list[workspace.Change]) -> list[workspace.Refusal]:
        """The host took these changes: the next diff starts from them (what could not be
        folded is returned; the next diff shows it again)."""
        self.get(name)
        return workspace.fold(self.workspace(name)[1], applied)

    def remove(self, name: str, home: bool = False) -> None:
        """Stop if needed, then forget the session and its workspace (and with `home`, the
        project's home, unless another session of the project still has it)."""
        record = self.get(name)
        if home and record.project:
            others = [r.name for r in self.records()
                      if r.project == record.project and r.name != name]
            if others:
                raise SessionError(f"the home of project {record.project} is also used by "
                                   f"{', '.join(others)}; remove those first")
        if record.state != "stopped":
            self.stop(name)
        _remove(self.workspaces / name)
        if home and record.project:
            _remove(self.home(record.project))
        self._path(name).unlink()

    def _containers(self) -> dict[str, str]:
        """Our containers (by label) and their states, as podman reports them now."""
        try:
            return {c["Names"][0]: c["State"] for c in self.podman.json(
                "ps", "--all", "--filter", f"label={OWNER}={self.owner}", "--format", "json"
            ) or []}
        except PodmanError as exc:
            raise SessionError(f"cannot ask podman about sessions: {exc}") from None

    def due(self, activity: dict[str, dict], now: float) -> list[tuple[str, str]]:
        """(name, why) of each running session its limits stop now; `activity` is the
        filter's `sessions` answer by name."""
        return [(r.name, why) for r in self.records() if r.state == "running"
                and (why := lifetime.due(r.created, r.limits, activity.get(r.name), now))]

    def list(self) -> list[dict]:
        """Records, each with what podman reports now (a crash or reboot shows up here)."""
        containers = self._containers()
        return [{**asdict(r), "container_state": containers.get(r.container, "absent")}
                for r in self.records()]

    def reconcile(self) -> list[str]:
        """After a restart or a crash: a session whose container is no longer running is
        stopped properly (network, filter registration); a container or network of ours
        that no record knows is removed. Returns what it did, for the log."""
        done = []
        containers = self._containers()
        for record in self.records():
            state = containers.pop(record.container, "absent")
            if record.state == "running" and state == "paused":  # a diff cut short
                self.podman.run("unpause", record.container)
                done.append(f"unpaused {record.name} (paused for a diff that did not end)")
            elif record.state == "running" and state != "running":
                self.stop(record.name, reason=f"container was {state} at reconcile")
                done.append(f"stopped {record.name} (container {state})")
            elif record.state == "stopped" and state != "absent":  # a stop cut short
                self.stop(record.name, reason=record.reason)
                done.append(f"finished stopping {record.name}")
        for orphan in containers:  # labelled ours, but no record: a create cut short
            self.podman.remove_container(orphan)
            done.append(f"removed orphan container {orphan}")
        known = {r.network for r in self.records() if r.state == "running"}
        for network in self.podman.json("network", "ls", "--filter",
                                        f"label={OWNER}={self.owner}", "--format", "json") or []:
            if network["name"] not in known:
                self.podman.run("network", "rm", "--force", network["name"], check=False)
                done.append(f"removed orphan network {network['name']}")
        return done
