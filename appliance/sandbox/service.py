"""`corral-sandbox`: the one privileged process that runs podman for the admin API.

  corral-sandbox serve --config FILE     the session service on its unix socket
  corral-sandbox image build [--rebuild] build (or keep) the sandbox image

Rootful podman needs root and the admin API must not have it, so sessions live here,
behind a socket the API's group may use (0660) — the same JSON-lines protocol as the
filter's control socket. A request may carry a payload (a project archive): its size is
"payload" in the request line and the bytes follow the line. Requests:

  {"op": "status"}
  {"op": "list"}
  {"op": "create", "name": N, "presets": [P]?, "project_id": ID?, "uid": U?, "gid": G?,
   "max_uptime": S?, "idle": S?, "memory": "8g"?, "cpus": "4"?, "pids": N?,
   "agent": TOML?, "agent_name": NAME?,                an agent's profile (agents.py)
   "payload": BYTES?}                                  the payload is a tar of the project
  {"op": "stop", "name": N}          {"op": "remove", "name": N, "home": BOOL?}
  {"op": "diff", "name": N}          the diff to read, the changes listed, the notes, and
                                     the digest of the snapshot it was rendered from
  {"op": "changes", "name": N, "digest": D}            that snapshot's changes, to apply
                                                       (format 2), or a refusal
  {"op": "fold", "name": N, "changes": [CHANGE]}       what the host applied
  {"op": "selftest", "name": N, "options": {...}}      the battery inside the session, its
                                                       denials checked against the records
  {"op": "trust-refresh"}                              every running session's trust anew
  {"op": "stop-all"}                                   before the firewall goes away
"""

from __future__ import annotations

import argparse
import contextlib
import grp
import json
import logging
import os
import signal
import socketserver
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from appliance import workspace
from appliance.control_client import ControlClient, ServiceUnavailable
from appliance.policy import ConfigError, preset_names
from appliance.policy.layers import preset_parameters
from appliance.policy.parameters import ParameterError, PresetRef, arguments
from appliance.selftest.review import REVIEW_DIR, SNAPSHOT_DIR
from appliance.settings import load_table, non_empty, positive
from appliance.workspace.compare import Reader
from appliance.workspace.tree import Unreadable

from . import agents, battery, hardening, image, lifetime
from .podman import Podman, PodmanError
from .sessions import SessionError, SessionManager

log = logging.getLogger("corral.sandbox")
MAX_LINE = 64 * 1024 * 1024
"""A `fold` carries file contents: the CLI sends at most FOLD_BATCH (cli/sessions.py) of
them, or one file of at most workspace.MAX_FILE, per request, base64 in JSON."""
MAX_MEMBERS = 200_000
SELFTEST_TIMEOUT = 600  # seconds: the battery waits on purpose (silence, floods, caps)
SNAPSHOT_WAIT = 10.0
"""Seconds the changed-after-diff probe's writer has to change its file after the diff."""


@dataclass(frozen=True)
class SandboxConfig:
    socket: str = "/run/corral-sandbox/control.sock"
    """The service's unix socket (corral_sandbox_control_socket, as the role sets it)."""
    group: str = ""
    """Owner group of the socket (0660): the admin API's. Empty: 0600, root only."""
    state_dir: str = "/var/lib/corral-sandbox"
    """Sessions, workspaces and homes (corral_sandbox_state_dir)."""
    filter_socket: str = "/run/corral-filter/control.sock"
    """The filter's control socket (corral_filter_control_socket)."""
    pool: str = "10.213.0.0/16"
    image: str = image.IMAGE
    containers_conf: str = ""
    """A containers.conf for podman (the host's defaults when empty)."""
    proxy_port: int = 3128
    max_project: int = 512 * 1024**2
    """The most a project may hold once unpacked, in bytes."""


def load(path: str) -> SandboxConfig:
    config, where = load_table(path, "sandbox", SandboxConfig)
    non_empty(path, "sandbox", config, where, "socket", "state_dir", "filter_socket", "pool",
              "image")
    positive(path, "sandbox", config, where, "proxy_port", "max_project")
    return config


class RequestError(Exception):
    pass


def _string_list(request: dict, key: str) -> list[str]:
    value = request.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RequestError(f"{key!r} must be a list of strings")
    return value


def _name(request: dict) -> str:
    name = request.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError("'name' must be a session name")
    return name


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _extract_checked(archive: tarfile.TarFile, members: list[tarfile.TarInfo],
                     target: Path) -> None:
    """tarfile's "data" filter, where Python predates it (Debian 12's 3.11.2, a local
    backend's on Debian 12): each member judged at its turn, against what is on disk then
    (a link extracted before it is followed, as writing the member would follow it), then
    extracted. Refused: absolute names and `..`; a name or a link that resolves outside the
    project; absolute link targets; anything but files, directories and links. Permissions
    made plain (no set-id bits, nobody else's write), owners root."""
    root = os.path.realpath(target)
    for member in members:
        name = member.name
        if name.startswith("/") or ".." in Path(name).parts:
            raise RequestError(f"the project archive names {name!r}: absolute paths "
                               "and '..' are refused")
        if not _inside(os.path.realpath(os.path.join(root, name)), root):
            raise RequestError(f"the project archive names {name!r}, which a link before "
                               "it leads outside the destination")
        if member.issym() or member.islnk():
            if os.path.isabs(member.linkname):
                raise RequestError(f"the project archive's link {name!r} points to "
                                   f"{member.linkname!r}: absolute link targets are refused")
            base = os.path.join(root, os.path.dirname(name)) if member.issym() else root
            if not _inside(os.path.realpath(os.path.join(base, member.linkname)), root):
                raise RequestError(f"the project archive's link {name!r} points outside "
                                   "the destination")
        elif not (member.isreg() or member.isdir()):
            raise RequestError(f"the project archive holds {name!r}, which is not a "
                               "regular file, directory or link")
        if member.isdir():
            member.mode = 0o755
        elif not member.issym():
            member.mode = (member.mode & 0o755) | 0o600
            if not member.mode & 0o100:
                member.mode &= ~0o111
        member.uid = member.gid = 0
        member.uname = member.gname = ""
        # judged just above; where tarfile has filters (3.12+, 3.11.4+: the tests' Python,
        # perhaps), none of theirs: what is extracted is what this judged
        archive.extract(member, target, set_attrs=True,
                        **({"filter": "fully_trusted"} if hasattr(tarfile, "data_filter")
                           else {}))


class Sessions:
    """The requests, answered with a SessionManager; one mutation at a time."""

    def __init__(self, config: SandboxConfig, manager: SessionManager):
        self.config, self.manager = config, manager
        self.lock = threading.Lock()
        self.workspace_lock = threading.Lock()
        """Held while a base/ is read for a diff or written by a fold (inside `lock`)."""
        mapped = manager.uid + hardening.Sandbox.userns_base
        self.installs = agents.Installs(manager.state_dir / "agents", self._install,
                                        (mapped, manager.gid + hardening.Sandbox.userns_base))

    def answer(self, request: dict, payload: BinaryIO | None) -> dict:
        op = request.get("op")
        manager = self.manager
        if op == "status":
            return {"image": manager.image, "image_present": manager.podman.image_exists(
                manager.image), "sessions": len(manager.records())}
        if op == "list":
            return {"sessions": manager.list()}
        if op == "create":
            return {"session": self._create(request, payload)}
        if op == "diff":
            return self._diff(_name(request))
        if op == "changes":
            digest = request.get("digest")
            if not isinstance(digest, str) or not digest:
                raise RequestError("'digest' must name the changeset to apply: the digest "
                                   "`corral diff` printed")
            with self.workspace_lock:
                return workspace.changes_answer(self.manager.reviewed(_name(request), digest))
        if op == "selftest":
            return self._selftest(_name(request), request.get("options"))
        with self.lock:
            if op == "stop":
                return {"session": vars(manager.stop(_name(request)))}
            if op == "remove":
                home = request.get("home", False)
                if not isinstance(home, bool):
                    raise RequestError("'home' must be true or false")
                manager.remove(_name(request), home=home)
                return {}
            if op == "fold":
                changes = request.get("changes")
                if not isinstance(changes, list):
                    raise RequestError("'changes' must be a list of changes")
                with self.workspace_lock:
                    refused = manager.fold(_name(request),
                                           [workspace.from_json(c) for c in changes])
                return {"folded": len(changes) - len(refused), "refused": [
                    {**workspace.wire_path(r.path), "reason": r.reason} for r in refused]}
            if op == "trust-refresh":
                refreshed, failed = manager.refresh_trust()
                return {"refreshed": refreshed, "failed": failed}
            if op == "stop-all":
                stopped = [manager.stop(r.name, reason="appliance going down").name
                           for r in manager.records() if r.state == "running"]
                return {"stopped": stopped}
        raise RequestError(f"unknown op {op!r}; expected status, list, create, stop, remove, "
                           "diff, changes, fold, selftest, trust-refresh, stop-all")

    def reap(self, now: float) -> list[str]:
        """Stop the running sessions whose limits say so (the workspace stays); what it did,
        for the log. The filter says how active each one was."""
        if not any(r.state == "running" and (r.max_uptime or r.idle)
                   for r in self.manager.records()):
            return []
        answer = self.manager.control({"op": "sessions"})
        if not answer.get("ok"):
            raise ServiceUnavailable(f"the filter did not list its sessions: "
                                     f"{answer.get('error')}")
        activity = {s.get("name"): s for s in answer.get("sessions") or []}
        done = []
        with self.lock:
            for name, why in self.manager.due(activity, now):
                try:  # one that cannot be stopped must not keep the others running
                    self.manager.stop(name, reason=why)
                    done.append(f"stopped {name}: {why}")
                except (SessionError, PodmanError, ServiceUnavailable, OSError) as exc:
                    done.append(f"could not stop {name} ({why}): {exc}; tried again later")
        return done

    def _diff(self, name: str) -> dict:
        """What a person reads (every byte escaped for a terminal), rendered from a snapshot
        kept under the digest it carries, so that `changes` with that digest is exactly
        what was read. Whatever the agent left in /work, it answers (appliance.workspace).
        The base cannot change meanwhile: `fold` waits for the same lock."""
        with self.workspace_lock:
            taken, not_paused = self.manager.review(name)
            answer = workspace.diff_answer(taken, self.manager.workspace(name)[1])
        return {**answer, **({"not_paused": not_paused} if not_paused else {})}

    def _create(self, request: dict, payload: BinaryIO | None) -> dict:
        if _name(request).startswith(agents.INSTALL_PREFIX):
            raise RequestError(f"session names starting {agents.INSTALL_PREFIX!r} are agent "
                               "installs' (an install removes a session of its name): "
                               "choose another name")
        presets = _string_list(request, "presets")
        unknown = sorted(set(presets) - set(preset_names()))
        if unknown:
            raise RequestError(f"unknown preset(s) {', '.join(unknown)}; presets: "
                               f"{', '.join(preset_names())}")
        for name in presets:  # named alone here: one that takes parameters goes in a file
            try:
                arguments(PresetRef(name), preset_parameters(name))
            except ParameterError as exc:
                raise RequestError(f"{exc} (in the project's corral.toml: a preset given "
                                   "by name alone takes no parameters)") from None
        options = {k: request[k] for k in ("uid", "gid") if k in request}
        try:
            options["limits"] = lifetime.Limits.parse(request)
        except lifetime.LimitError as exc:
            raise RequestError(str(exc)) from None
        project_id = request.get("project_id") or ""
        if not isinstance(project_id, str):
            raise RequestError("'project_id' must be a string")
        if "agent" in request or "agent_name" in request:
            # before the lock: an install takes minutes, and other sessions go on meanwhile
            options.update(self._agent(request, project_id))
        with self.lock, tempfile.TemporaryDirectory(
                dir=self.manager.workspaces.parent, prefix="upload-") as tmp:
            project = None
            if payload is not None:
                project = Path(tmp) / "project"
                self._unpack(payload, project)
            record = self.manager.create(_name(request), project=project, presets=presets,
                                         project_id=project_id, **options)
        log.info("created session %s on %s%s", record.name, record.subnet,
                 f" running agent {record.agent['name']}" if record.agent else "")
        return vars(record)

    def _agent(self, request: dict, project_id: str) -> dict:
        """What a session of the requested agent gets: its installed tree (installed first
        if need be) read-only at MOUNT, PATH and its environment, its policy as a layer of
        its own, its home's directories; refused naming what is wrong."""
        try:
            profile = agents.parse(request.get("agent"), request.get("agent_name"))
        except agents.AgentError as exc:
            raise RequestError(str(exc)) from None
        if not project_id:
            raise RequestError(f"agent {profile.name} keeps its sign-in and settings in the "
                               "project's home: send a project_id")
        image_id, image_path = self.manager.image_facts()
        installed = self.installs.ensure(profile, profile.install.key(image_id))
        return {"read_only": ((str(installed.tree), agents.MOUNT),
                              (str(self.installs.profile_script()), agents.PROFILE_D)),
                "environment": agents.session_environment(profile, image_path),
                "layers": {f"agent-{profile.name}.toml": profile.policy} if profile.policy
                else {},
                "home_directories": agents.home_directories(profile.persist),
                "agent": agents.record(profile, installed.key)}

    def _install(self, profile, key: str, scratch: Path) -> None:
        """One install, in a throwaway session whose only layer is the install's policy,
        with `scratch` at MOUNT; AgentError with the tail of its output when it fails. The
        session is created under the lock (subnets are handed out there), waited for
        without it."""
        name = agents.install_session(agents.tree_name(profile, key))
        with self.lock:
            if any(r.name == name for r in self.manager.records()):
                self.manager.remove(name)  # left by a service stopped mid-install
            record = self.manager.create(
                name, command=profile.install.command(),
                layers={"install.toml": profile.install.policy_text()},
                mounts=((str(scratch), agents.MOUNT),),
                environment=agents.INSTALL_ENVIRONMENT, secrets=False)
        try:
            try:
                waited = self.manager.podman.run("wait", record.container,
                                                 timeout=agents.INSTALL_TIMEOUT)
                code = int(waited.stdout.split()[-1])
            except (PodmanError, ValueError, IndexError) as exc:
                code, waited = None, exc
            # its last lines only: the package decides how much it prints, the sandbox
            # service (root, on a small appliance) reads it all into memory otherwise
            said = self.manager.podman.run("logs", "--tail", str(agents.LOG_LINES),
                                           record.container, check=False)
            output = said.stdout + said.stderr
        finally:
            with self.lock:
                self.manager.remove(name)
        if code != 0:
            how = f"exit {code}" if code is not None else str(waited)
            raise agents.AgentError(
                f"installing agent {profile.name} ({profile.install.spec} from "
                f"{profile.install.index}) failed ({how}); its last words:\n"
                f"{agents.tail(output)}\nthe install may reach only what this allows: "
                f"{profile.install.policy_text().strip()!r} (the profile's [install] index "
                "and hosts)")

    def _unpack(self, payload: BinaryIO, target: Path) -> None:
        """A project archive from the host, unpacked with tarfile's "data" filter: no
        absolute paths, no `..`, no links out, no devices, no set-uid bits."""
        try:
            with tarfile.open(fileobj=payload, mode="r:*") as archive:
                members = archive.getmembers()
                if len(members) > MAX_MEMBERS:
                    raise RequestError(f"the project has {len(members)} entries; the limit is "
                                       f"{MAX_MEMBERS}")
                size = sum(m.size for m in members)
                if size > self.config.max_project:
                    raise RequestError(f"the project unpacks to {size} bytes; the limit is "
                                       f"{self.config.max_project} ([sandbox] max_project)")
                target.mkdir()
                if hasattr(tarfile, "data_filter"):
                    archive.extractall(target, filter="data")
                else:
                    _extract_checked(archive, members, target)
        except tarfile.TarError as exc:
            raise RequestError(f"the project archive is unusable: {exc}") from None

    def _selftest(self, name: str, options: object) -> dict:
        """The battery inside the session, then the appliance's own check of it: every denial
        a probe met must be in the filter's records (battery.confirm), and the files the
        review probe wrote must survive the session's diff (battery.judge_review)."""
        if not isinstance(options, dict) or not isinstance(options.get("allowed"), str):
            raise RequestError("'options' must be an object with at least 'allowed'")
        try:
            flags = battery.arguments(options)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        record = self.manager.get(name)
        try:
            mark = battery.mark_before(self.manager.control)
        except battery.RecordsUnavailable as exc:
            raise SessionError(f"the battery's denials could not be checked: {exc}") from None
        # the session named: its container's hostname is the container's name (corral-NAME)
        result = self.manager.podman.run("exec", record.container, "corral-selftest", "--json",
                                         *flags, "--session", name, check=False,
                                         timeout=SELFTEST_TIMEOUT)
        probes, summary = battery.parse(result.stdout.decode(errors="replace"))
        if not probes:
            raise SessionError(f"the selftest did not run in {name}: "
                               f"{result.stderr.decode(errors='replace').strip()[-500:]}")
        probes = battery.confirm(probes, self.manager.control, mark, name)
        if any(p.get("group") == "review" for p in probes):
            probes = self._review(name, record.container, probes)
        return {"probes": probes, "summary": summary, "tally": battery.tally(probes),
                "passed": result.returncode == 0 and summary is not None
                and battery.passed(probes)}

    def _review(self, name: str, container: str, probes: list[dict]) -> list[dict]:
        """Ask for the session's diff as `corral diff` does (when a review probe wrote its
        files); for the changed-after-diff probe, apply that diff's digest as `corral apply
        --digest` does (`_applied`). Then take the files away again, from inside, as the
        agent (which also stops its writer): they must not reach anyone's project."""
        try:
            kinds = {(p.get("expect") or {}).get("kind") for p in probes
                     if p.get("state") == battery.PASSED}
            if not kinds & set(battery.REVIEWED):
                return probes
            try:
                answer, error = self.answer({"op": "diff", "name": name}, None), None
                json.dumps(answer)  # what the handler would send must be sendable
            except Exception as exc:  # whatever the diff raises is the finding
                answer, error = None, f"{type(exc).__name__}: {exc}"
            probes = battery.judge_review(probes, answer, error)
            return [self._applied(name, p, answer, error)
                    if p.get("state") == battery.PASSED
                    and (p.get("expect") or {}).get("kind") == "review-snapshot" else p
                    for p in probes]
        finally:  # the writer's directory is moved away first: it stops, and cannot write
            gone = f"/work/.{SNAPSHOT_DIR}-gone"  # a file back in while rm empties it
            self.manager.podman.run("exec", container, "mv", "-T", "--", f"/work/{SNAPSHOT_DIR}",
                                    gone, check=False)
            self.manager.podman.run("exec", container, "rm", "-rf", "--", f"/work/{REVIEW_DIR}",
                                    gone, check=False)

    def _applied(self, name: str, probe: dict, answer: dict | None, error: str | None) -> dict:
        """The diff was taken while the agent's writer ran: wait until the file changed
        since, then apply the diff's digest into a scratch project, and judge."""
        path = probe["expect"]["path"]
        if answer is None:
            return battery.judge_snapshot(probe, "", None, None, f"the diff failed: {error}")
        shown_change = next((c for c in answer["changes"] if c.get("path") == path), None)
        if shown_change is None:
            return battery.judge_snapshot(probe, "", None, None, f"the diff does not list {path}")
        work = self.manager.workspace(name)[0]
        applied = now = None
        try:
            got = self.answer({"op": "changes", "name": name, "digest": answer["digest"]}, None)
            received = [workspace.from_json(c) for c in got["changes"]]
            workspace.verify(received, [workspace.note_from(n) for n in got["notes"]],
                             answer["digest"])
            kept = {c.path: c for c in received}
            shown = kept[path].after.data if kept[path].after is not None else None
            deadline = time.monotonic() + SNAPSHOT_WAIT
            with Reader(work) as reader:
                while now is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                    try:
                        current, _ = reader.read(path, workspace.MAX_FILE)
                    except Unreadable:
                        continue
                    now = current if current != shown else None
            with tempfile.TemporaryDirectory(prefix="corral-snapshot-") as scratch:
                workspace.apply(Path(scratch), list(kept.values()), [SNAPSHOT_DIR])
                written = Path(scratch) / path
                applied = written.read_bytes() if written.is_file() else None
        except (SessionError, ValueError, OSError, KeyError, workspace.Conflict) as exc:
            return battery.judge_snapshot(probe, "", None, None, f"{type(exc).__name__}: {exc}")
        return battery.judge_snapshot(probe, answer["diff"], applied, now)


class Handler(socketserver.StreamRequestHandler):
    timeout = 120  # seconds a client may stall mid-request

    def handle(self) -> None:
        sessions: Sessions = self.server.sessions  # type: ignore[attr-defined]
        while True:
            try:
                line = self.rfile.readline(MAX_LINE + 1)
            except OSError:
                return
            if not line:
                return
            close = False
            try:
                if len(line) > MAX_LINE:
                    close = True
                    raise RequestError("request line too long")
                request = json.loads(line)
                if not isinstance(request, dict):
                    raise RequestError("a request is a JSON object")
                close = "payload" in request  # after a payload the stream is spent or out of step
                with self._payload(request, sessions.config.max_project) as payload:
                    answer = {"ok": True, **sessions.answer(request, payload)}
            except json.JSONDecodeError as exc:
                answer = {"ok": False, "error": f"not JSON: {exc}"}
            except (RequestError, SessionError, PodmanError, workspace.Conflict, ValueError,
                    ServiceUnavailable) as exc:  # agents.AgentError is a ValueError
                answer = {"ok": False, "error": str(exc)}
            except Exception as exc:  # answer everything; the service stays up
                log.exception("request failed")
                answer = {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"}
            try:
                self.wfile.write(json.dumps(answer, separators=(",", ":")).encode() + b"\n")
                self.wfile.flush()
            except OSError:
                return
            if close:
                return

    def _payload(self, request: dict, limit: int):
        """The request's payload as a temporary file (never whole in memory), or None."""
        size = request.pop("payload", None)
        if size is None:
            return contextlib.nullcontext()
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise RequestError("'payload' must be a size in bytes")
        if size > limit:
            raise RequestError(f"the payload is {size} bytes; the limit is {limit} "
                               "([sandbox] max_project)")
        spool = tempfile.SpooledTemporaryFile(max_size=8 << 20)  # noqa: SIM115 - returned
        remaining = size
        while remaining:
            chunk = self.rfile.read(min(remaining, 1 << 20))
            if not chunk:
                spool.close()
                raise RequestError(f"the payload ended after {size - remaining} of {size} "
                                   "bytes")
            spool.write(chunk)
            remaining -= len(chunk)
        spool.seek(0)
        return spool


class Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, group: str, sessions: Sessions):
        self.sessions = sessions
        Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        Path(path).unlink(missing_ok=True)
        old = os.umask(0o177)  # born 0600: no window where others can connect
        try:
            super().__init__(path, Handler)
        finally:
            os.umask(old)
        if group:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
            os.chmod(path, 0o660)


def _manager(config: SandboxConfig) -> SessionManager:
    podman = Podman(Path(config.containers_conf) if config.containers_conf else None)
    filter_client = ControlClient(config.filter_socket, "the filter", timeout=60)
    state = Path(config.state_dir)
    state.mkdir(parents=True, exist_ok=True, mode=0o711)
    return SessionManager(podman, filter_client.request, state, pool=config.pool,
                          image=config.image, proxy_port=config.proxy_port)


def serve(config: SandboxConfig) -> int:
    manager = _manager(config)
    try:
        for line in manager.reconcile():
            log.info("reconcile: %s", line)
    except (SessionError, PodmanError, ServiceUnavailable) as exc:
        log.error("reconcile failed (sessions are listed as podman reports them): %s", exc)
    try:  # the filter may have a new CA since (made at its start, rotated meanwhile)
        refreshed, _ = manager.refresh_trust()  # each failure is logged by itself
        if refreshed:
            log.info("trust refreshed for %s", ", ".join(refreshed))
    except ServiceUnavailable as exc:
        log.error("trust not refreshed (the filter did not answer): %s", exc)
    sessions = Sessions(config, manager)
    server = Server(config.socket, config.group, sessions)
    done = threading.Event()

    def reaper():  # sessions whose --max-uptime or --idle ran out are stopped
        while not done.wait(lifetime.CHECK_EVERY):
            try:
                for line in sessions.reap(time.time()):
                    log.info("%s", line)
            except Exception:  # whatever it was, the next look must still come
                log.exception("checking the sessions' limits failed (tried again in %.0fs)",
                              lifetime.CHECK_EVERY)

    threading.Thread(target=reaper, daemon=True, name="corral-reaper").start()

    def stop(signum, frame):
        done.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("serving on %s (image %s)", config.socket, config.image)
    with server:
        server.serve_forever()
    Path(config.socket).unlink(missing_ok=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="corral-sandbox", description="corral's session "
                                     "service: the only process that runs podman.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_parser = sub.add_parser("serve", help="answer session requests on the socket")
    serve_parser.add_argument("--config", required=True, metavar="FILE")
    image_parser = sub.add_parser("image", help="the sandbox image")
    image_parser.add_argument("action", choices=["build"])
    image_parser.add_argument("--config", metavar="FILE", help="for containers_conf")
    image_parser.add_argument("--rebuild", action="store_true",
                              help="rebuild the Debian base too, not only the top layer")
    image_parser.add_argument("--mirror", default="http://deb.debian.org/debian")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = load(args.config) if args.config else SandboxConfig()
    except ConfigError as exc:
        print(f"corral-sandbox: {exc}", file=sys.stderr)
        return 2
    if args.command == "image":
        conf = Path(config.containers_conf) if config.containers_conf else None
        try:
            image.build(Podman(conf), mirror=args.mirror, rebuild=args.rebuild,
                        progress=lambda line: print(line, flush=True))
        except (PodmanError, subprocess.SubprocessError) as exc:
            print(f"corral-sandbox: {exc}", file=sys.stderr)
            return 1
        return 0
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
