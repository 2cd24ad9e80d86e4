"""The policy store: which compiled Policy judges which client, and the runtime layer on disk.

Each session has its own Policy built from every layer (defaults, appliance, project,
session runtime). A change compiles a new Policy off to the side and swaps one reference,
so a request holding the old one finishes under it and no request ever sees half a policy.
Runtime rules are persisted before the swap (temp file, fsync, rename, fsync directory):
a rule the caller was told about survives a crash.
"""

from __future__ import annotations

import ipaddress
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from appliance.policy import (
    DEFAULT_RULES,
    ConfigError,
    Policy,
    Rule,
    RuleError,
    dedupe,
    policy_file_rules,
)

from .config import FilterConfig, SessionConfig, SessionError, make_session, read_text

RUNTIME_KINDS = ("dns", "http", "tcp", "deny")
"""What the control socket may add to a session's runtime layer. Not cidr or host ports:
opening blocked ranges or host services is a change to a file a person reviews."""
CLIENTS_MAX = 65536
"""Client addresses remembered by `lookup` (parsing one is a third of a cached DNS answer)."""
_UNKNOWN = object()


def read_policy_file(path: str, layer: str) -> list[Rule]:
    return policy_file_rules(read_text(path), path, layer)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves the old or the new file, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dirfd = os.open(path.parent, os.O_DIRECTORY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


@dataclass
class Session:
    name: str
    subnet: ipaddress.IPv4Network | ipaddress.IPv6Network
    project: tuple[Rule, ...]
    runtime: tuple[Rule, ...]
    policy: Policy


class PolicyStore:
    def __init__(self, config: FilterConfig):
        """Load every layer; raises ConfigError (file, key, line) on any bad file."""
        self.config = config
        self.runtime_dir = Path(config.state_dir) / "runtime"
        self.registered_path = Path(config.state_dir) / "sessions.json"
        self.registered: tuple[SessionConfig, ...] = self._load_registered()
        """Sessions registered at run time (by the sandbox manager), kept across restarts."""
        self.base: tuple[Rule, ...] = ()
        self.outside = Policy()
        self.sessions: dict[str, Session] = {}
        self._clients: dict[str, str | None] = {}
        """Client address -> the session whose subnet holds it (None: no session). Emptied
        whenever a session comes or goes; a session's policy is always read fresh."""
        self.reload()

    def session_configs(self) -> tuple[SessionConfig, ...]:
        """Every session: from the config file, then those registered at run time."""
        return (*self.config.sessions, *self.registered)

    def reload(self) -> None:
        """Re-read the appliance and project files; all or nothing."""
        base = [*DEFAULT_RULES]
        for path in self.config.policy_files:
            base.extend(read_policy_file(path, "appliance"))
        self.base = tuple(dedupe(base))
        sessions = {s.name: self._build(s) for s in self.session_configs()}
        self.outside = Policy(self.base)
        self.sessions = sessions
        self._clients.clear()

    def _build(self, s: SessionConfig) -> Session:
        project = tuple(rule for path in s.files for rule in read_policy_file(path, "project"))
        runtime = tuple(self._load_runtime(s.name))
        return Session(s.name, s.subnet, project, runtime, self._compile(project, runtime))

    def register(self, name: str, subnet: str, gateway: str | None = None,
                 files: list[str] | tuple[str, ...] = ()) -> tuple[SessionConfig, bool]:
        """Add a session at run time; (its config, whether it is new). Raises SessionError or
        ConfigError (a project file that does not parse): nothing changes then."""
        for existing in self.registered:
            if existing.name == name:
                again = make_session(name, subnet, gateway, files, [])
                if again == existing:
                    return existing, False
                raise SessionError("name", f"session {name!r} exists with other settings: "
                                   f"{existing.subnet}, files {list(existing.files)}", name)
        config = make_session(name, subnet, gateway, files, self.session_configs())
        session = self._build(config)  # may raise: before anything is written
        self._save_registered((*self.registered, config))
        self.sessions[name] = session
        self._clients.clear()
        return config, True

    def unregister(self, name: str, forget_rules: bool = False) -> None:
        """Remove a session registered at run time; `forget_rules` deletes its runtime layer."""
        if any(s.name == name for s in self.config.sessions):
            raise SessionError("name", f"session {name!r} is in {self.config.path}; "
                               "remove it there", name)
        if not any(s.name == name for s in self.registered):
            raise KeyError(f"no session {name!r} registered at run time")
        self._save_registered(tuple(s for s in self.registered if s.name != name))
        self.sessions.pop(name, None)
        self._clients.clear()
        if forget_rules:
            self._runtime_path(name).unlink(missing_ok=True)

    def _save_registered(self, registered: tuple[SessionConfig, ...]) -> None:
        document = {"version": 1, "sessions": [
            {"name": s.name, "subnet": str(s.subnet), "gateway": str(s.gateway),
             "files": list(s.files)} for s in registered]}
        write_atomic(self.registered_path, json.dumps(document, indent=1).encode() + b"\n")
        self.registered = registered

    def _load_registered(self) -> tuple[SessionConfig, ...]:
        try:
            document = json.loads(self.registered_path.read_text("utf-8"))
            entries = document["sessions"]
        except FileNotFoundError:
            return ()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(str(self.registered_path), "", f"unreadable: {exc!r}") from None
        out: list[SessionConfig] = []
        for index, entry in enumerate(entries):
            try:
                out.append(make_session(entry.get("name"), entry.get("subnet"),
                                        entry.get("gateway"), entry.get("files", []),
                                        [*self.config.sessions, *out]))
            except (SessionError, AttributeError) as exc:
                raise ConfigError(str(self.registered_path), f"sessions[{index}]", str(exc)
                                  ) from None
        return tuple(out)

    def _compile(self, project, runtime) -> Policy:
        return Policy(dedupe([*self.base, *project, *runtime]))

    def lookup(self, client: str) -> tuple[str | None, Policy]:
        """The session a client address belongs to and the policy that judges it."""
        name = self._clients.get(client, _UNKNOWN)
        if name is _UNKNOWN:
            name = self._session_of(client)
            if len(self._clients) >= CLIENTS_MAX:
                self._clients.clear()
            self._clients[client] = name
        session = self.sessions.get(name)  # None: no session, or it has gone since
        return (name, session.policy) if session is not None else (None, self.outside)

    def _session_of(self, client: str) -> str | None:
        try:
            address = ipaddress.ip_address(client)
        except ValueError:
            return None
        if address.version == 6 and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        for session in self.sessions.values():
            if address.version == session.subnet.version and address in session.subnet:
                return session.name
        return None

    def session(self, name: str) -> Session:
        try:
            return self.sessions[name]
        except KeyError:
            known = ", ".join(sorted(self.sessions)) or "none"
            raise KeyError(f"no session {name!r}; sessions: {known}") from None

    def add(self, name: str, kind: str, text: str) -> tuple[Rule, bool]:
        """Add a rule to a session's runtime layer. Returns the rule and whether it is new."""
        session = self.session(name)
        if kind not in RUNTIME_KINDS:
            raise RuleError(f"kind {kind!r} cannot be added at run time; expected one of "
                            f"{', '.join(RUNTIME_KINDS)} (cidr and host ports go in corral.toml)")
        rule = Rule.parse(kind, text, "session", "api")
        if any(r.key() == rule.key() for r in session.runtime):
            return rule, False
        self._replace(session, (*session.runtime, rule))
        return rule, True

    def remove(self, name: str, kind: str, text: str) -> Rule:
        """Remove a runtime rule, named by kind and text as `rules` shows it."""
        session = self.session(name)
        wanted = Rule.parse(kind, text, "session").key()
        for rule in session.runtime:
            if rule.key() == wanted:
                self._replace(session, tuple(r for r in session.runtime if r is not rule))
                return rule
        others = [r for r in session.policy.rules if r.key() == wanted]
        if others:
            r = others[0]
            raise LookupError(f"{kind} {text} comes from the {r.layer} layer ({r.source}); "
                              "only session rules can be revoked at run time")
        raise LookupError(f"session {name} has no runtime {kind} rule {text}")

    def _replace(self, session: Session, runtime: tuple[Rule, ...]) -> None:
        policy = self._compile(session.project, runtime)  # compile first: may not fail after
        self._save_runtime(session.name, runtime)
        session.runtime, session.policy = runtime, policy

    def _runtime_path(self, name: str) -> Path:
        return self.runtime_dir / f"{name}.json"

    def _save_runtime(self, name: str, runtime) -> None:
        document = {"version": 1, "session": name,
                    "rules": [{"kind": r.kind, "rule": r.text} for r in runtime]}
        write_atomic(self._runtime_path(name), json.dumps(document, indent=1).encode() + b"\n")

    def _load_runtime(self, name: str) -> list[Rule]:
        path = self._runtime_path(name)
        try:
            document = json.loads(path.read_text("utf-8"))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise ConfigError(str(path), "", f"runtime rules unreadable: {exc}") from None
        rules = []
        items = document.get("rules") if isinstance(document, dict) else None
        if not isinstance(items, list):
            raise ConfigError(str(path), "rules", "missing or not a list")
        for index, item in enumerate(items):
            try:
                rules.append(Rule.parse(item["kind"], item["rule"], "session", "api"))
            except (KeyError, TypeError):
                raise ConfigError(str(path), f"rules[{index}]", "needs kind and rule") from None
            except RuleError as exc:
                raise ConfigError(str(path), f"rules[{index}]", str(exc)) from None
        return rules

    def effective(self, name: str | None) -> list[dict]:
        policy = self.outside if name is None else self.session(name).policy
        return policy.to_json()
