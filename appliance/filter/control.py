"""The control socket: JSON lines over a unix socket (0600), the filter's only admin door.

Each request is one JSON object on one line; each answer is one line, `{"ok": true, ...}`
or `{"ok": false, "error": "..."}`. `subscribe` answers once and then streams events, one
per line, until the client hangs up. Requests:

  {"op": "status"}
  {"op": "sessions"}
  {"op": "policy", "session": S}                     effective rules with layers (S may be null)
  {"op": "add", "session": S, "kind": K, "rule": R}   runtime layer; K in dns|http|tcp|deny
  {"op": "remove", "session": S, "kind": K, "rule": R}
  {"op": "events", "last": N, "session": S?, "verdict": V?}
  {"op": "subscribe", "session": S?, "verdict": V?}
  {"op": "session-add", "name": N, "subnet": CIDR, "gateway": IP?, "files": [PATH]?}
  {"op": "session-remove", "name": N, "forget_rules": BOOL?}
  {"op": "audit", "after": SEQ?, "since": TS?, "limit": N?}   a page of the audit log
  {"op": "audit-verify"}
"""

from __future__ import annotations

import asyncio
import grp
import json
import logging
import os
import time
from pathlib import Path

from appliance.policy import RuleError

from . import audit

log = logging.getLogger(__name__)

MAX_REQUEST = 64 * 1024


class ControlError(Exception):
    pass


def _field(request: dict, name: str, kind=str, required=True):
    value = request.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kind) or isinstance(value, bool):
        names = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
        raise ControlError(f"{name!r} must be a {names}")
    return value


def _prepare(socket_path: Path) -> None:
    """A private directory for the socket, and no stale socket from a previous run."""
    socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    socket_path.unlink(missing_ok=True)


class ControlServer:
    def __init__(self, service):
        self.service = service  # the running Service: store, bus, audit, listeners

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
                try:
                    request = json.loads(line)
                    if not isinstance(request, dict):
                        raise ControlError("a request is a JSON object")
                    op = _field(request, "op")
                    if op == "subscribe":
                        await self._subscribe(request, writer)
                        return
                    answer = self.dispatch(op, request)
                except json.JSONDecodeError as exc:
                    answer = {"ok": False, "error": f"not JSON: {exc}"}
                except (ControlError, RuleError, KeyError, LookupError, ValueError) as exc:
                    answer = {"ok": False, "error": exc.args[0] if exc.args else str(exc)}
                await self._send(writer, answer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _send(writer, message: dict) -> None:
        writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        await writer.drain()

    def dispatch(self, op: str, request: dict) -> dict:
        service = self.service
        store = service.store
        if op == "status":
            return {"ok": True, **service.status()}
        if op == "sessions":
            counters = service.bus.counters
            registered = {s.name for s in store.registered}
            return {"ok": True, "sessions": [
                {"name": s.name, "subnet": str(s.subnet), "runtime_rules": len(s.runtime),
                 "registered": s.name in registered,
                 "allowed": counters[(s.name, "allow")], "denied": counters[(s.name, "deny")]}
                for s in store.sessions.values()]}
        if op == "session-add":
            files = _field(request, "files", list, required=False) or []
            if not all(isinstance(f, str) and f for f in files):
                raise ControlError("'files' must be a list of file paths")
            session, added = service.register_session(
                _field(request, "name"), _field(request, "subnet"),
                _field(request, "gateway", required=False), files)
            return {"ok": True, "added": added, "session": {
                "name": session.name, "subnet": str(session.subnet),
                "gateway": str(session.gateway), "files": list(session.files)}}
        if op == "session-remove":
            forget = request.get("forget_rules", False)
            if not isinstance(forget, bool):
                raise ControlError("'forget_rules' must be true or false")
            service.unregister_session(_field(request, "name"), forget)
            return {"ok": True}
        if op == "policy":
            session = _field(request, "session", required=False)
            return {"ok": True, "session": session, "rules": store.effective(session)}
        if op in ("add", "remove"):
            session = _field(request, "session")
            kind, text = _field(request, "kind"), _field(request, "rule")
            if op == "add":
                rule, added = store.add(session, kind, text)
                log.info("control: %s %s rule %s in session %s", "added" if added else "kept",
                         kind, rule.text, session)
                return {"ok": True, "rule": rule.to_json(), "added": added}
            rule = store.remove(session, kind, text)
            log.info("control: removed %s rule %s from session %s", kind, rule.text, session)
            return {"ok": True, "rule": rule.to_json()}
        if op == "events":
            last = _field(request, "last", int, required=False) or 100
            return {"ok": True, "events": service.bus.last(
                min(last, 10000), _field(request, "session", required=False),
                _field(request, "verdict", required=False))}
        if op == "audit":
            after = _field(request, "after", int, required=False) or 0
            since = _field(request, "since", (int, float), required=False)
            limit = min(_field(request, "limit", int, required=False) or 100, 1000)
            records, more = audit.page(service.config.audit_path, after, since, limit)
            return {"ok": True, "records": records, "more": more, "head": service.audit_head()}
        if op == "audit-verify":
            verdict = (service.audit.verify() if service.audit is not None
                       else audit.verify(service.config.audit_path))
            return {"ok": True, **verdict.to_json()}
        raise ControlError(f"unknown op {op!r}; expected status, sessions, session-add, "
                           "session-remove, policy, add, remove, events, subscribe, audit, "
                           "audit-verify")

    async def _subscribe(self, request: dict, writer: asyncio.StreamWriter) -> None:
        subscription = self.service.bus.subscribe(
            _field(request, "session", required=False), _field(request, "verdict", required=False))
        try:
            await self._send(writer, {"ok": True, "subscribed": True, "ts": time.time()})
            async for event in subscription:
                writer.write(json.dumps(event, separators=(",", ":")).encode() + b"\n")
                await writer.drain()
        finally:
            subscription.close()
