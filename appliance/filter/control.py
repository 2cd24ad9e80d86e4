"""The control socket: JSON lines over a unix socket (0600), the filter's only admin door.

Each request is one JSON object on one line; each answer is one line, `{"ok": true, ...}`
or `{"ok": false, "error": "..."}`, whatever goes wrong (an unexpected failure is answered
"internal error: ..." and logged with its traceback), and the connection stays open for
the next request. `subscribe` answers once and then streams events, one per line, until
the client hangs up. Requests:

  {"op": "status"}
  {"op": "sessions"}
  {"op": "policy", "session": S}                     effective rules with layers (S may be null)
  {"op": "add", "session": S, "kind": K, "rule": R, "expires_in": SECONDS?}
                                                      runtime layer; K: one of store.RUNTIME_KINDS;
                                                      with expires_in, taken back then (an event)
  {"op": "remove", "session": S, "kind": K, "rule": R}
  {"op": "events", "last": N, "session": S?, "verdict": V?}
  {"op": "subscribe", "session": S?, "verdict": V?}
  {"op": "session-add", "name": N, "subnet": CIDR, "gateway": IP?, "files": [PATH]?}
  {"op": "session-remove", "name": N, "forget_rules": BOOL?, "reason": TEXT?}
                                                      a reason: it stopped by itself (an event)
  {"op": "audit", "after": SEQ?, "since": TS?, "limit": N?}   a page of the audit log
  {"op": "audit-verify"}
  {"op": "audit-heads", "after": SEQ?, "limit": N?}  signed heads after a seq (audit/heads.py)
  {"op": "audit-key"}                                the audit key's public half (PEM)
  {"op": "audit-sign"}                               sign the head now (if it moved); the
                                                      latest signed head
  {"op": "audit-segment", "session": S}              the raw lines from the session's first
                               record to the latest signed head (sign first: `audit-sign`)
  {"op": "evidence-sign", "index": {...}}            sign an evidence index (pki/signed.py:
                               checked, behind the evidence prefix: never a head)
  {"op": "inspect-ca"}                                the interception CA's certificate, or null
  {"op": "inspect-rotate"}                            a new interception CA, in use at once
  {"op": "secret-set", "name": N, "value": V, "hosts": [H], "scheme": S?, "header": F?,
   "user": U?, "requests": ["METHOD /path", ...]?, "host_keys": [K]?, "port": P?}
                               store a secret (answers never hold values; host_keys and
                               port: an ssh key's, scheme "ssh")
  {"op": "secret-list"}       {"op": "secret-remove", "name": N}
  {"op": "secret-environment", "session": S}         the session's placeholders, by variable,
                               and with the git gateway its ssh client's files ("ssh")
  {"op": "approvals", "session": S?}                 open approvals (ask mode)
  {"op": "approval-decide", "id": ID, "grant": G, "duration": SECONDS?, "by": WHO?,
   "note": TEXT?}    G: once | for (with duration) | session | refuse; a grant's rule is in
                     force before the held requests go on; "released" in the answer: how
                     many held requests went on (a `once` that finds every client gone is
                     refused)

The loop that runs this also answers every sandbox's DNS and proxy traffic, so nothing here
waits on a disk or on nftables on it: audit pages and the firewall check run on the
service's worker threads, an audit verify in a process of its own, and changes go through
`Changes.change` (worked out and written off the loop, one at a time, swapped in on it).
"""

from __future__ import annotations

import asyncio
import grp
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.event import Event
from appliance.firewall.nft import NftError
from appliance.pki import signed
from appliance.policy import ConfigError, RuleError
from appliance.policystore import MAX_GRANT
from appliance.sessionconfig import SessionError

from . import approvals, audit, secrets
from .approvals_file import ApprovalsFile, Unwritten
from .errors import ControlError
from .events import rule_changed
from .proxy.credentials import Credentials

if TYPE_CHECKING:  # the parts it is given
    from appliance.policystore import PolicyStore

    from .approvals_policy import OpenApprovals
    from .blocking import Blocking
    from .events import EventBus
    from .git.sshgate import Gate
    from .proxy.inspect import Inspector
    from .registration import Registration
    from .secrets import SecretStore
    from .status import Status

log = logging.getLogger(__name__)

MAX_REQUEST = 64 * 1024
AUDIT_READERS = 2
"""Audit pages and verifies running at once; the service's other blocking threads stay free for
changes and status."""


class NotJson(ControlError):
    """The request line does not parse (as opposed to JSON a handler met on its way)."""


def _field(request: dict, name: str, kind=str, required=True):
    value = request.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kind) or isinstance(value, bool):
        names = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
        raise ControlError(f"{name!r} must be a {names}")
    return value


def _count(request: dict, name: str, default: int, low: int, high: int) -> int:
    """A whole-number field: `default` when absent, at least `low`, at most `high`."""
    value = _field(request, name, int, required=False)
    if value is None:
        return default
    if value < low:
        raise ControlError(f"{name!r} must be at least {low}, got {value}")
    return min(value, high)


def _by(request: dict) -> str:
    """Who asked (the API passes its client's certificate name), for the audit record."""
    return approvals.clean(_field(request, "by", required=False) or "the control socket")


async def verify_apart(path: Path, head: dict | None) -> dict:
    """`audit.verify` in a process of its own (`python -m appliance.filter.audit`): a
    thread of this one would share the interpreter's lock with the event loop for as long as
    it hashes, seconds for a full log."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-m", "appliance.filter.audit", "verify", str(path),
        *([json.dumps(head)] if head is not None else []),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"the verifier exited {child.returncode}: "
                           f"{err.decode(errors='replace').strip()[-500:]}")
    return json.loads(out)


def _prepare(socket_path: Path) -> None:
    """A private directory for the socket, and no stale socket from a previous run."""
    socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    socket_path.unlink(missing_ok=True)


BAD_REQUEST = (ControlError, RuleError, ConfigError, SessionError, LookupError,
               secrets.SecretError, approvals.ApprovalError)
"""What a request can be refused with: its message says what is wrong with it."""


def answer_for(op: str, exc: Exception) -> dict:
    """The answer to a request that failed with `exc`: a precise error for bad requests, the
    cause for a disk or nftables failure, "internal error" (logged) for anything else."""
    if isinstance(exc, BAD_REQUEST):
        return {"ok": False, "error": exc.args[0] if exc.args else str(exc)}
    if isinstance(exc, NftError):
        return {"ok": False, "error": f"{op}: nftables refused: {exc}"}
    if isinstance(exc, OSError):
        return {"ok": False, "error": f"{op}: {exc}"}
    log.error("control: %s failed", op, exc_info=exc)
    return {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"}


Handler = Callable[["ControlServer", dict], Awaitable[dict]]
HANDLERS: dict[str, Handler] = {}
"""op -> the coroutine that answers it."""


def handles(op: str):
    def register(handler: Handler) -> Handler:
        HANDLERS[op] = handler
        return handler
    return register


class ControlServer:
    def __init__(self, *, store: PolicyStore, bus: EventBus, change: Callable[..., Awaitable],
                 blocking: Blocking, status: Status, sessions: Registration,
                 audit_path: Path | str, inspector: Inspector | None, secrets: SecretStore,
                 gate: Gate | None, holds: approvals.Holds, open_approvals: OpenApprovals,
                 approvals_file: ApprovalsFile):
        """The parts of the running filter that requests read and change. `change`: how a
        change reaches the store (changes.Changes.change); `blocking`: where disk work runs;
        `sessions`: session-add and session-remove; `inspector`: the interception CA (None
        when inspection is off); `gate`: the git gateway (None when it listens nowhere)."""
        self.store, self.bus, self.change, self.blocking = store, bus, change, blocking
        self.status, self.sessions, self.audit_path = status, sessions, Path(audit_path)
        self.inspector, self.secrets, self.gate = inspector, secrets, gate
        self.holds, self.open_approvals, self.approvals_file = holds, open_approvals, \
            approvals_file
        self.workers = None
        """The worker processes, when there are (`[filter] workers`): in `status`, and told
        of a new CA before the rotation returns."""
        self._audit_readers = asyncio.Semaphore(AUDIT_READERS)
        self._writing = asyncio.Lock()
        """One change of the CA or the secrets file at a time."""

    async def start(self, path: str, group: str | None = None) -> asyncio.AbstractServer:
        """Listen on `path`: 0600, or 0660 owned by `group` (the admin API's user)."""
        _prepare(Path(path))
        old = os.umask(0o177)  # the socket is born 0600: no window where others can connect
        try:
            server = await asyncio.start_unix_server(self.handle, path, limit=MAX_REQUEST)
        finally:
            os.umask(old)
        if group is not None:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
            os.chmod(path, 0o660)
        return server

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    line = await reader.readline()
                except (asyncio.LimitOverrunError, ValueError):
                    await self._send(writer, {"ok": False, "error": "request line too long"})
                    return
                if not line:
                    return
                op, subscription = "request", None
                try:
                    try:
                        request = json.loads(line)
                    except ValueError as exc:  # not UTF-8, or not JSON
                        raise NotJson(f"not JSON: {exc}") from None
                    if not isinstance(request, dict):
                        raise ControlError("a request is a JSON object")
                    op = _field(request, "op")
                    if op == "subscribe":
                        subscription = self.bus.subscribe(
                            _field(request, "session", required=False),
                            _field(request, "verdict", required=False))
                    else:
                        answer = await self.dispatch(op, request)
                except Exception as exc:  # every request is answered, whatever went wrong
                    answer = answer_for(op, exc)
                if subscription is not None:
                    await self._stream(subscription, writer)
                    return
                await self._send(writer, answer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _send(self, writer, message: dict) -> None:
        """An answer, its words redacted: approvals and status quote what sessions sent."""
        self.bus.redactor.fields(message)
        writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        await writer.drain()

    async def dispatch(self, op: str, request: dict) -> dict:
        handler = HANDLERS.get(op)
        if handler is None:
            raise ControlError(f"unknown op {op!r}; expected "
                               f"{', '.join([*HANDLERS, 'subscribe'])}")
        return await handler(self, request)

    async def _read_audit(self, work: Callable, *args):
        """An audit read (it may cover hundreds of MB) on a worker, a bounded number at once."""
        async with self._audit_readers:
            return await self.blocking.run(work, *args)

    @handles("status")
    async def _status(self, request: dict) -> dict:
        await self.blocking.run(self.status.check)
        described = self.status.describe()
        if self.workers is not None:
            described["workers"] = await self.workers.describe()
            described["active_connections"] += sum(w.get("active_connections", 0)
                                                   for w in described["workers"])
            described["unserved"] = {**self.workers.unserved(), **described["unserved"]}
        return {"ok": True, **described}

    @handles("sessions")
    async def _sessions(self, request: dict) -> dict:
        sessions = self.status.sessions()
        if self.workers is not None:  # their connections are held there
            held = await self.workers.held()
            for session in sessions:
                session["open_connections"] += held.get(session["name"], 0)
        return {"ok": True, "sessions": sessions}

    @handles("session-add")
    async def _session_add(self, request: dict) -> dict:
        files = _field(request, "files", list, required=False) or []
        if not all(isinstance(f, str) and f for f in files):
            raise ControlError("'files' must be a list of file paths")
        session, added = await self.sessions.register(
            _field(request, "name"), _field(request, "subnet"),
            _field(request, "gateway", required=False), files)
        return {"ok": True, "added": added, "session": {
            "name": session.name, "subnet": str(session.subnet),
            "gateway": str(session.gateway), "files": list(session.files)}}

    @handles("session-remove")
    async def _session_remove(self, request: dict) -> dict:
        forget = request.get("forget_rules", False)
        if not isinstance(forget, bool):
            raise ControlError("'forget_rules' must be true or false")
        name = _field(request, "name")
        reason = _field(request, "reason", required=False)
        await self.sessions.unregister(name, forget)
        if reason:  # stopped by itself (its limits, a crash): an event and an audit record
            self.bus.emit(Event(
                session=name, client=None, kind="session", name=name,
                port=None, address=None, verdict="change", action="stopped",
                rule=None, layer=None, reason=f"session {name} stopped: {reason}"))
        self.bus.last_seen.pop(name, None)
        return {"ok": True}

    @handles("policy")
    async def _policy(self, request: dict) -> dict:
        session = _field(request, "session", required=False)
        return {"ok": True, "session": session, "rules": self.store.effective(session)}

    @handles("add")
    async def _add(self, request: dict) -> dict:
        session, kind, text = (_field(request, "session"), _field(request, "kind"),
                               _field(request, "rule"))
        seconds = _field(request, "expires_in", (int, float), required=False)
        until = None
        if seconds is not None:
            if not 0 < seconds <= MAX_GRANT:
                raise ControlError(f"'expires_in' must be more than 0 and at most "
                                   f"{MAX_GRANT:.0f} seconds, got {seconds}")
            until = time.time() + seconds
        store = self.store
        change = await self.change(lambda: store.plan_add(session, kind, text, until))
        rule, added = change.result
        ends = store.until(session, rule)
        log.info("control: %s %s rule %s in session %s%s", "added" if added else "kept", kind,
                 rule.text, session, f" until {ends:.0f}" if ends else "")
        if added:
            self.bus.emit(rule_changed(session, rule, "added", ends, _by(request)))
        return {"ok": True, "rule": rule.to_json(), "added": added, "expires": ends}

    @handles("remove")
    async def _remove(self, request: dict) -> dict:
        session, kind, text = (_field(request, "session"), _field(request, "kind"),
                               _field(request, "rule"))
        store = self.store
        rule = (await self.change(lambda: store.plan_remove(session, kind, text))).result
        log.info("control: removed %s rule %s from session %s", kind, rule.text, session)
        self.bus.emit(rule_changed(session, rule, "revoked", by=_by(request)))
        return {"ok": True, "rule": rule.to_json()}

    @handles("events")
    async def _events(self, request: dict) -> dict:
        return {"ok": True, "events": self.bus.last(
            _count(request, "last", 100, 0, 10000), _field(request, "session", required=False),
            _field(request, "verdict", required=False))}

    @handles("audit")
    async def _audit(self, request: dict) -> dict:
        after = _count(request, "after", 0, 0, 2**63)
        since = _field(request, "since", (int, float), required=False)
        limit = _count(request, "limit", 100, 1, 1000)
        head = self._audit_head()  # every record up to it is on disk
        records, more = await self._read_audit(
            audit.page, self.audit_path, after, since, limit)
        return {"ok": True, "records": records, "more": more, "head": head}

    @handles("audit-verify")
    async def _audit_verify(self, request: dict) -> dict:
        head = self._audit_head()  # every record up to it is on disk
        async with self._audit_readers:
            verdict = await verify_apart(self.audit_path, head)
        return {"ok": True, **verdict}

    def _signer(self):
        audit_log = self.bus.audit
        if audit_log is None or audit_log.signer is None:
            raise ControlError("the audit log is not open yet: no key to sign with")
        return audit_log, audit_log.signer

    @handles("audit-heads")
    async def _audit_heads(self, request: dict) -> dict:
        _, signer = self._signer()
        after = _count(request, "after", 0, 0, 2**63)
        limit = _count(request, "limit", 1000, 1, 1000)
        heads = await self._read_audit(signer.heads, after, limit)
        return {"ok": True, "heads": heads, "more": len(heads) == limit}

    @handles("audit-key")
    async def _audit_key(self, request: dict) -> dict:
        _, signer = self._signer()
        return {"ok": True, "key": signer.public_pem, "appliance": signer.appliance}

    @handles("audit-sign")
    async def _audit_sign(self, request: dict) -> dict:
        audit_log, signer = self._signer()
        await self.blocking.run(audit_log.sign_head, True)
        return {"ok": True, "head": await self.blocking.run(signer.latest)}

    @handles("audit-segment")
    async def _audit_segment(self, request: dict) -> dict:
        _, signer = self._signer()
        session = _field(request, "session")
        head = await self.blocking.run(signer.latest)
        try:
            lines = await self._read_audit(audit.session_segment, self.audit_path, session,
                                           head["seq"] if head else 0)
        except ValueError as exc:
            raise ControlError(str(exc)) from None
        return {"ok": True, "lines": lines, "head": head}

    @handles("evidence-sign")
    async def _evidence_sign(self, request: dict) -> dict:
        _, signer = self._signer()
        index = _field(request, "index", dict)
        try:
            signature = signed.sign_evidence(signer.key, index)
        except signed.SignatureError as exc:
            raise ControlError(str(exc)) from None
        return {"ok": True, "signature": signature, "key": signer.public_pem}

    @handles("inspect-ca")
    async def _inspect_ca(self, request: dict) -> dict:
        inspector = self.inspector
        return {"ok": True, "ca": inspector.describe() if inspector else None}

    @handles("inspect-rotate")
    async def _inspect_rotate(self, request: dict) -> dict:
        inspector = self.inspector
        if inspector is None:
            raise ControlError("inspection is off (no [inspect] ca_dir in the filter's "
                               "config): there is no CA to rotate")
        async with self._writing:  # each new CA removes the ones before it
            old = inspector.describe()["sha256"]
            inspector.use(await self.blocking.run(inspector.renewed))
            if self.workers is not None:
                await self.workers.authority_changed()
        ca = inspector.describe()
        log.info("control: interception CA rotated: %s -> %s", old, ca["sha256"])
        self.bus.emit(Event(
            session=None, client=None, kind="certs", name=None, port=None,
            address=None, verdict="change", rule=None, layer=None,
            reason=f"new interception CA {ca['sha256']} (was {old}), valid until "
                   f"{ca['not_after']}"))
        return {"ok": True, "ca": ca, "previous": old}

    @handles("secret-set")
    async def _secret_set(self, request: dict) -> dict:
        secret = secrets.parse(request)
        async with self._writing:
            new = await self._commit_secrets(self.secrets.plan_set(secret))
        self._secrets_changed(f"secret {secret.name} {'set' if new else 'replaced'}: bound to "
                              f"{', '.join(secret.hosts)} ({secret.scheme})")
        return {"ok": True, "secret": secret.describe(), "added": new}

    @handles("secret-list")
    async def _secret_list(self, request: dict) -> dict:
        return {"ok": True, "secrets": [s.describe() for _, s in
                                        sorted(self.secrets.secrets.items())]}

    @handles("secret-remove")
    async def _secret_remove(self, request: dict) -> dict:
        name = _field(request, "name")
        async with self._writing:
            secret = await self._commit_secrets(self.secrets.plan_remove(name))
        self._secrets_changed(f"secret {name} removed: it goes to "
                              f"{', '.join(secret.hosts)} no more")
        return {"ok": True, "secret": secret.describe()}

    @handles("secret-environment")
    async def _secret_environment(self, request: dict) -> dict:
        session = _field(request, "session")
        if session not in self.store.sessions:
            raise LookupError(f"no session {session!r}")
        # the placeholders the proxy swaps, worked out from the same secrets
        answer = {"ok": True, "environment": Credentials(
            self.secrets.key, self.secrets.http()).environment(session)}
        gate = self.gate
        if gate is not None:  # git over SSH: the session's key, the hosts it reaches so
            answer["ssh"] = gate.session_files(session)
        return answer

    @handles("approvals")
    async def _approvals(self, request: dict) -> dict:
        holds = self.holds
        holds.expire()
        return {"ok": True, "approvals": holds.book.listing(
            _field(request, "session", required=False))}

    @handles("approval-decide")
    async def _approval_decide(self, request: dict) -> dict:
        approval_id, grant = _field(request, "id"), _field(request, "grant")
        by = approvals.clean(_field(request, "by", required=False) or "the control socket")
        note = _field(request, "note", required=False) or ""
        seconds = _field(request, "duration", (int, float), required=False)
        if grant not in (*approvals.GRANTS, "refuse"):
            raise ControlError(f"'grant' must be one of {', '.join(approvals.GRANTS)} or "
                               f"refuse, got {grant!r}")
        if (grant == "for") != (seconds is not None):
            raise ControlError("'duration' (seconds) goes with grant 'for', and only with it")
        if seconds is not None and not 0 < seconds <= MAX_GRANT:
            raise ControlError(f"'duration' must be more than 0 and at most {MAX_GRANT:.0f} "
                               f"seconds, got {seconds}")
        holds, store = self.holds, self.store
        # claimed while its rule is written: no other decision, expiry or settling meanwhile
        pending = holds.claim(approval_id, None if grant == "refuse" else grant)
        detail, ends = "", None
        try:
            if grant in ("for", "session"):
                until = time.time() + seconds if seconds is not None else None

                def still() -> None:  # its turn has come: what it waited behind may matter
                    if holds.book.pending.get(approval_id) is not pending:
                        raise approvals.ApprovalError(f"{approval_id} ended meanwhile (its "
                                                      "session went): nothing was granted")
                    open_now, why = self.open_approvals.still_open(pending)
                    if open_now is False:
                        raise approvals.ApprovalError(f"{approval_id}: {why}; nothing was "
                                                      "granted")

                change = await self.change(
                    lambda: store.plan_add(pending.session, pending.kind, pending.target,
                                           until), first=still)
                rule, added = change.result
                ends = store.until(pending.session, rule)
                if added:
                    self.bus.emit(rule_changed(pending.session, rule, "added", ends, by))
                detail = f", {pending.kind} {rule.text}" + (
                    f" until {time.strftime('%H:%M:%S', time.localtime(ends))}" if ends else "")
            # the rule is in force (or none is needed): the held requests may learn of it;
            # a `once` asks their clients again, now (gone: ApprovalError, nothing granted)
            released = holds.decide(approval_id, None if grant == "refuse" else grant, by,
                                    note, detail, claimed=True)
        except BaseException:
            holds.book.release(pending)
            raise
        try:  # answered once a crash cannot bring it back
            await self.approvals_file.save(strict=True)
        except Unwritten as exc:
            raise ControlError(f"{approval_id} was decided ({grant}), but {exc}") from None
        log.info("control: approval %s %s by %s (%s %s in session %s)", approval_id, grant,
                 by, pending.kind, pending.target, pending.session)
        return {"ok": True, "approval": pending.to_json(), "grant": grant, "expires": ends,
                "released": released}

    async def _commit_secrets(self, change: secrets.SecretChange):
        """Written off the loop, committed on it: the secret store's listeners (the proxy's
        credentials, the git gateway's calls) follow there."""
        await self.blocking.run(change.write)
        self.secrets.commit(change)
        if self.workers is not None:  # theirs too, before the call returns
            await self.workers.secrets_changed()
        return change.result

    def _secrets_changed(self, reason: str) -> None:
        log.info("control: %s", reason)
        self.bus.emit(Event(
            session=None, client=None, kind="secret", name=None, port=None,
            address=None, verdict="change", rule=None, layer=None,
            reason=reason))

    def _audit_head(self) -> dict | None:
        """Where the audit log stands: every record up to it is on disk."""
        return self.bus.audit.head if self.bus.audit is not None else None

    async def _stream(self, subscription, writer: asyncio.StreamWriter) -> None:
        try:
            await self._send(writer, {"ok": True, "subscribed": True, "ts": time.time()})
            async for event in subscription:
                writer.write(self.bus.line(event))
                await writer.drain()
        finally:
            subscription.close()
