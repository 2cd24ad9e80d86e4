"""The policy store: which compiled Policy judges which client, and the runtime layer on disk.

Each session has its own Policy built from every layer (defaults, appliance, project,
session runtime). A change compiles a new Policy off to the side and swaps one reference,
so a request holding the old one finishes under it and no request ever sees half a policy.
Runtime rules are persisted before the swap (temp file, fsync, rename, fsync directory):
a rule the caller was told about survives a crash.

Every change has two halves. `plan_*()` works it out (compiles, reads policy files, makes
the bytes of each file it touches) and `Change.write()` puts it on disk: both block, and
the running filter does them off the event loop. `commit()` then swaps the new state in:
on the loop's thread, which reads the store without locks.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from appliance.atomic import fsync_dir, write_atomic
from appliance.policy import (
    DEFAULT_RULES,
    ConfigError,
    Policy,
    Rule,
    RuleError,
    dedupe,
    parse_host,
    policy_file_rules,
)
from appliance.sessionconfig import (
    FilterConfig,
    SessionConfig,
    SessionError,
    make_session,
    read_text,
)

log = logging.getLogger(__name__)
RUNTIME_KINDS = ("dns", "http", "tcp", "deny", "inspect", "request", "approval")
"""What the control socket may add to a session's runtime layer. Not cidr or host ports:
opening blocked ranges or host services is a change to a file a person reviews."""
MAX_GRANT = 366 * 86400.0
"""The longest a runtime rule may be granted for, in seconds (longer: grant it for good)."""
CLIENTS_MAX = 65536
"""Client addresses remembered by `lookup` (parsing one is a third of a cached DNS answer)."""
_UNKNOWN = object()


def read_policy_file(path: str, layer: str) -> list[Rule]:
    return policy_file_rules(read_text(path), path, layer)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _put(path: Path, data: bytes | None) -> None:
    """Write `data` to `path` atomically, or delete it (None)."""
    if data is not None:
        write_atomic(path, data)
    elif path.exists():
        path.unlink()
        fsync_dir(path.parent)


@dataclass(frozen=True)
class Session:
    name: str
    subnet: ipaddress.IPv4Network | ipaddress.IPv6Network
    project: tuple[Rule, ...]
    runtime: tuple[Rule, ...]
    policy: Policy
    expires: dict[tuple, float] = field(default_factory=dict)
    """Runtime rules granted for a while (`rule.key()` -> when it ends, wall-clock seconds,
    kept on disk with the rule): the filter takes each back when its time comes."""


@dataclass
class Change:
    """A change to the store, worked out off to the side: the whole state it leads to, and
    the bytes of every file it touches. The state has the store's shape (`config`,
    `sessions`, `session_configs()`), so the firewall's ruleset can be built from it before
    it is committed."""

    config: FilterConfig
    registered: tuple[SessionConfig, ...]
    sessions: dict[str, Session]
    base: tuple[Rule, ...]
    outside: Policy
    files: tuple[tuple[Path, bytes | None], ...] = ()
    """Each file's new bytes (None: delete it), written in this order."""
    result: object = None
    """What the caller is told: (rule, added), (session config, added), the removed rule."""
    changed: bool = True
    """False when there is nothing to do (the rule or the session is already there)."""
    _written: list[tuple[Path, bytes | None]] = field(default_factory=list)
    """What each file held before `write()` replaced it, for `undo()`."""

    def session_configs(self) -> tuple[SessionConfig, ...]:
        return (*self.config.sessions, *self.registered)

    def write(self) -> None:
        """Put the files on disk, each atomically; if one fails, put back those written
        before it and raise: the disk is as it was. Blocks (fsync)."""
        try:
            for path, data in self.files:
                before = _read(path)
                _put(path, data)
                self._written.append((path, before))
        except BaseException:
            self.undo()
            raise

    def undo(self) -> None:
        """Put back what `write()` changed (when the firewall then refuses the change)."""
        while self._written:
            path, before = self._written.pop()
            try:
                _put(path, before)
            except OSError as exc:
                log.error("could not put %s back after a refused change: %s", path, exc)


class PolicyStore:
    def __init__(self, config: FilterConfig, read: bool = True):
        """Load every layer; raises ConfigError (file, key, line) on any bad file. With
        `read` False, nothing is read and the store is empty: a worker's, filled by the
        changes it is sent (filter/workers/replica.py)."""
        self.config = config
        self.runtime_dir = Path(config.state_dir) / "runtime"
        self.registered_path = Path(config.state_dir) / "sessions.json"
        self.registered: tuple[SessionConfig, ...] = self._load_registered() if read else ()
        """Sessions registered at run time (by the sandbox manager), kept across restarts."""
        self.base: tuple[Rule, ...] = ()
        self.outside = Policy()
        self.sessions: dict[str, Session] = {}
        self._clients: dict[str, str | None] = {}
        """Client address -> the session whose subnet holds it (None: no session). Emptied
        whenever a session comes or goes; a session's policy is always read fresh."""
        self._listeners: list = []
        if read:
            self.reload()

    def on_change(self, callback) -> None:
        """Call `callback()` after every change to a policy or to the set of sessions (the
        proxy re-judges its open flows then). Changes, and so the calls, happen on the
        event loop's thread: the loop reads this store without locks."""
        self._listeners.append(callback)

    def _changed(self) -> None:
        self._clients.clear()
        for callback in self._listeners:
            try:
                callback()
            except Exception:  # the change is in force: one listener's bug must not hide it
                log.exception("store: a listener failed after a change")

    def commit(self, change: Change) -> None:
        """Make a written change the store's state, in one step. On the loop's thread."""
        if not change.changed:
            return
        self.registered, self.sessions = change.registered, change.sessions
        self.base, self.outside = change.base, change.outside
        self._changed()

    def _now(self, change: Change) -> Change:
        """Write and commit at once: for start-up and callers without an event loop."""
        change.write()
        self.commit(change)
        return change

    def _change(self, **state) -> Change:
        """A change from the current state, with `state` replacing parts of it."""
        current = {"config": self.config, "registered": self.registered,
                   "sessions": self.sessions, "base": self.base, "outside": self.outside}
        return Change(**{**current, **state})

    def session_configs(self) -> tuple[SessionConfig, ...]:
        """Every session: from the config file, then those registered at run time."""
        return (*self.config.sessions, *self.registered)

    def reload(self) -> None:
        """Re-read the appliance and project files; all or nothing."""
        self._now(self.plan_reload())

    def plan_reload(self) -> Change:
        base = [*DEFAULT_RULES]
        for path in self.config.policy_files:
            base.extend(read_policy_file(path, "appliance"))
        base = tuple(dedupe(base))
        sessions = {s.name: self._build(s, base) for s in self.session_configs()}
        return self._change(base=base, outside=Policy(base), sessions=sessions)

    def _build(self, s: SessionConfig, base: tuple[Rule, ...]) -> Session:
        project = tuple(rule for path in s.files for rule in read_policy_file(path, "project"))
        runtime, expires = self._load_runtime(s.name)
        now = time.time()  # a rule whose end passed while the filter was down is not in force
        live = tuple(r for r in runtime if expires.get(r.key(), math.inf) > now)
        return Session(s.name, s.subnet, project, runtime, self._compile(project, live, base),
                       expires)

    def register(self, name: str, subnet: str, gateway: str | None = None,
                 files: list[str] | tuple[str, ...] = ()) -> tuple[SessionConfig, bool]:
        """Add a session at run time; (its config, whether it is new). Raises SessionError or
        ConfigError (a project file that does not parse): nothing changes then."""
        return self._now(self.plan_register(name, subnet, gateway, files)).result

    def plan_register(self, name: str, subnet: str, gateway: str | None = None,
                      files: list[str] | tuple[str, ...] = ()) -> Change:
        for existing in self.registered:
            if existing.name == name:
                again = make_session(name, subnet, gateway, files, [])
                if again == existing:
                    return self._change(result=(existing, False), changed=False)
                raise SessionError("name", f"session {name!r} exists with other settings: "
                                   f"{existing.subnet}, files {list(existing.files)}", name)
        config = make_session(name, subnet, gateway, files, self.session_configs())
        session = self._build(config, self.base)  # may raise: before anything is written
        registered = (*self.registered, config)
        return self._change(registered=registered, sessions={**self.sessions, name: session},
                            files=((self.registered_path, _registered_bytes(registered)),),
                            result=(config, True))

    def unregister(self, name: str, forget_rules: bool = False) -> None:
        """Remove a session registered at run time; `forget_rules` deletes its runtime layer."""
        self._now(self.plan_unregister(name, forget_rules))

    def plan_unregister(self, name: str, forget_rules: bool = False) -> Change:
        if any(s.name == name for s in self.config.sessions):
            raise SessionError("name", f"session {name!r} is in {self.config.path}; "
                               "remove it there", name)
        if not any(s.name == name for s in self.registered):
            raise KeyError(f"no session {name!r} registered at run time")
        registered = tuple(s for s in self.registered if s.name != name)
        files: tuple[tuple[Path, bytes | None], ...] = (
            (self.registered_path, _registered_bytes(registered)),)
        if forget_rules:
            files += ((self._runtime_path(name), None),)
        return self._change(registered=registered, files=files, sessions={
            k: v for k, v in self.sessions.items() if k != name})

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

    def _compile(self, project, runtime, base=None) -> Policy:
        return Policy(dedupe([*(self.base if base is None else base), *project, *runtime]))

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

    def identity(self, name: str) -> str:
        """What tells a session from a later one of the same name: its subnet ("" for
        none)."""
        found = self.sessions.get(name)
        return str(found.subnet) if found is not None else ""

    def session(self, name: str) -> Session:
        try:
            return self.sessions[name]
        except KeyError:
            known = ", ".join(sorted(self.sessions)) or "none"
            raise KeyError(f"no session {name!r}; sessions: {known}") from None

    def add(self, name: str, kind: str, text: str, until: float | None = None
            ) -> tuple[Rule, bool]:
        """Add a rule to a session's runtime layer, for good or `until` a wall-clock time.
        Returns the rule and whether the layer changed."""
        return self._now(self.plan_add(name, kind, text, until)).result

    def plan_add(self, name: str, kind: str, text: str, until: float | None = None) -> Change:
        """A rule already there for good stays so; one granted for a while gets the later
        end, or none when this one is for good."""
        session = self.session(name)
        if kind not in RUNTIME_KINDS:
            raise RuleError(f"kind {kind!r} cannot be added at run time; expected one of "
                            f"{', '.join(RUNTIME_KINDS)} (cidr and host ports go in corral.toml)")
        rule = Rule.parse(kind, text, "session", "api")
        if rule.unscanned:  # at run time a session's layer only inspects more, never reads less
            raise RuleError(f"inspect rule {text!r}: 'unscanned' (scan = false) goes in "
                            "corral.toml, not at run time")
        if rule.request is not None and not rule.request.deny and rule.request.text != "nothing":
            _only_adds(session.policy, rule)  # `HOST nothing` restricts on purpose
        key = rule.key()
        runtime, expires = session.runtime, session.expires
        if rule.kind == "approval":  # one setting per layer: a new one replaces the one before
            runtime = tuple(r for r in runtime if r.kind != "approval" or r.key() == key)
            expires = {k: v for k, v in expires.items() if k[0] != "approval" or k == key}
        replaced = len(runtime) != len(session.runtime)
        if any(r.key() == key for r in runtime):
            ends = expires.get(key)
            if not replaced and (ends is None or (until is not None and until <= ends)):
                return self._change(result=(rule, False), changed=False)
            expires = {k: v for k, v in expires.items() if k != key}
            if until is not None:
                expires[key] = until
            return self._replace(session, runtime, (rule, True), expires)
        expires = {**expires, key: until} if until is not None else expires
        return self._replace(session, (*runtime, rule), (rule, True), expires)

    def until(self, name: str, rule: Rule) -> float | None:
        """When a session's runtime rule ends (None: it is there for good, or not there)."""
        return self.session(name).expires.get(rule.key())

    def next_end(self) -> float | None:
        """The earliest end of a rule granted for a while, in any session."""
        return min((t for s in self.sessions.values() for t in s.expires.values()),
                   default=None)

    def plan_expire(self, now: float) -> Change:
        """Take back every runtime rule whose time has come. The result: (session, rule)
        for each one taken back."""
        sessions, files, ended = dict(self.sessions), [], []
        for name, session in self.sessions.items():
            due = {k for k, t in session.expires.items() if t <= now}
            if not due:
                continue
            runtime = tuple(r for r in session.runtime if r.key() not in due)
            ended += [(name, r) for r in session.runtime if r.key() in due]
            expires = {k: t for k, t in session.expires.items() if k not in due}
            sessions[name] = dataclasses.replace(
                session, runtime=runtime, expires=expires,
                policy=self._compile(session.project, runtime))
            files.append((self._runtime_path(name), _runtime_bytes(name, runtime, expires)))
        if not ended:
            return self._change(result=[], changed=False)
        return self._change(sessions=sessions, files=tuple(files), result=ended)

    def remove(self, name: str, kind: str, text: str) -> Rule:
        """Remove a runtime rule, named by kind and text as `rules` shows it."""
        return self._now(self.plan_remove(name, kind, text)).result

    def plan_remove(self, name: str, kind: str, text: str) -> Change:
        session = self.session(name)
        wanted = Rule.parse(kind, text, "session").key()
        for rule in session.runtime:
            if rule.key() == wanted:
                return self._replace(
                    session, tuple(r for r in session.runtime if r is not rule), rule,
                    {k: v for k, v in session.expires.items() if k != wanted})
        others = [r for r in session.policy.rules if r.key() == wanted]
        if others:
            r = others[0]
            raise LookupError(f"{kind} {text} comes from the {r.layer} layer ({r.source}); "
                              "only session rules can be revoked at run time")
        raise LookupError(f"session {name} has no runtime {kind} rule {text}")

    def _replace(self, session: Session, runtime: tuple[Rule, ...], result,
                 expires: dict[tuple, float]) -> Change:
        replaced = dataclasses.replace(session, runtime=runtime, expires=expires,
                                       policy=self._compile(session.project, runtime))
        return self._change(sessions={**self.sessions, session.name: replaced}, result=result,
                            files=((self._runtime_path(session.name),
                                    _runtime_bytes(session.name, runtime, expires)),))

    def _runtime_path(self, name: str) -> Path:
        return self.runtime_dir / f"{name}.json"

    def _load_runtime(self, name: str) -> tuple[tuple[Rule, ...], dict[tuple, float]]:
        """A session's runtime rules from disk, and when those granted for a while end (an
        end already past is kept: the filter takes the rule back, with an event, at once)."""
        path = self._runtime_path(name)
        try:
            document = json.loads(path.read_text("utf-8"))
        except FileNotFoundError:
            return (), {}
        except (OSError, ValueError) as exc:
            raise ConfigError(str(path), "", f"runtime rules unreadable: {exc}") from None
        rules, expires = [], {}
        items = document.get("rules") if isinstance(document, dict) else None
        if not isinstance(items, list):
            raise ConfigError(str(path), "rules", "missing or not a list")
        for index, item in enumerate(items):
            try:
                rule = Rule.parse(item["kind"], item["rule"], "session", "api")
            except (KeyError, TypeError):
                raise ConfigError(str(path), f"rules[{index}]", "needs kind and rule") from None
            except RuleError as exc:
                raise ConfigError(str(path), f"rules[{index}]", str(exc)) from None
            ends = item.get("expires")
            if ends is not None:
                if not isinstance(ends, (int, float)) or isinstance(ends, bool) or \
                        not math.isfinite(ends):
                    raise ConfigError(str(path), f"rules[{index}].expires",
                                      "must be a time in seconds since the epoch")
                expires[rule.key()] = float(ends)
            rules.append(rule)
        return tuple(rules), expires

    def effective(self, name: str | None) -> list[dict]:
        """Every rule in force, with its layer and source; a runtime rule granted for a
        while says when it ends (`expires`, seconds since the epoch)."""
        if name is None:
            return self.outside.to_json()
        session = self.session(name)
        rules = session.policy.to_json()
        if session.expires:
            ends = {(r.kind, r.text): session.expires[r.key()] for r in session.runtime
                    if r.key() in session.expires}
            for rule in rules:
                if rule.get("layer") == "session" and (rule["kind"], rule["rule"]) in ends:
                    rule["expires"] = ends[(rule["kind"], rule["rule"])]
        return rules


def _registered_bytes(registered: tuple[SessionConfig, ...]) -> bytes:
    document = {"version": 1, "sessions": [
        {"name": s.name, "subnet": str(s.subnet), "gateway": str(s.gateway),
         "files": list(s.files)} for s in registered]}
    return json.dumps(document, indent=1).encode() + b"\n"


def _only_adds(policy, rule: Rule) -> None:
    """A request allow added at run time may only widen a host's allow list. On a host with
    none (every request no deny matches passes, or it is not inspected at all) it would
    make one, and refuse every other request: refused, saying so."""
    if rule.wildcard:
        raise RuleError(f"request rule {rule.text}: a runtime allow names one host (wildcards "
                        "go in corral.toml)")
    inspection = policy.inspection(parse_host(rule.host))
    if inspection is None or not inspection.restricted:
        state = "is not inspected" if inspection is None else "has no allow list"
        raise RuleError(f"{rule.host} {state}: every request no deny matches passes already, "
                        "and an allow added now would refuse all the others; a request a deny "
                        "refuses is allowed by removing that deny where it is written")


def _runtime_bytes(name: str, runtime: tuple[Rule, ...], expires: dict[tuple, float]) -> bytes:
    document = {"version": 1, "session": name, "rules": [
        {"kind": r.kind, "rule": r.text, **({"expires": expires[r.key()]}
                                            if r.key() in expires else {})} for r in runtime]}
    return json.dumps(document, indent=1).encode() + b"\n"
