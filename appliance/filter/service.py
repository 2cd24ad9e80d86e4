"""`corral-filter --config FILE`: DNS filter, proxy listeners and control socket, one process.

Start-up is all or nothing: the config and every policy file are parsed first (exit 2 with
file, key and reason on any error), then every listener is bound (exit 1 naming the address
that failed): those on fixed addresses and those on the gateways of the config file's
sessions. Only then does it serve. A session added at run time gets listeners on its
gateway as it is added, or is refused naming the port that is taken (gateways.py); they
close when it is removed. SIGHUP re-reads the policy files; a bad file keeps
the policy in force. SIGTERM/SIGINT stop it after flushing the audit log.

The event loop never waits on a disk or on nftables: a change to the policy store (a rule,
a session, a reload) is worked out, written and followed by the firewall on a worker
thread, one change at a time, and swapped in on the loop (`Service.change`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from appliance.firewall import nflog, ruleset
from appliance.firewall.learned import Cut, LearnedSet
from appliance.firewall.ledger import Key
from appliance.firewall.nft import Nft, NftError
from appliance.policy import ConfigError, Decision, Host, parse_host, split_host_port

from . import gateways, relay
from .approvals import Holds, approvable, decide_kind
from .approvals_file import ApprovalsFile
from .audit import AuditLog
from .config import FilterConfig, load_config
from .control import ControlError, ControlServer
from .dns import DnsFilter, UdpServer, serve_tcp
from .events import EventBus
from .frontends import Frontends
from .limits import Budget, raise_limit
from .proxy import Proxy
from .proxy.credentials import Credentials
from .proxy.inspect import Inspector
from .redact import LogFilter
from .resolver import Resolver
from .secrets import SecretStore
from .sshgate import Gate
from .store import Change, PolicyStore

log = logging.getLogger("corral.filter")
VERSION = "0.1.0"
REVOKE_RETRY = 2.0
"""Seconds between attempts to take back learned tcp allowances while nftables refuses."""


def _dns_sockets(host: str, port: int) -> tuple[socket.socket, socket.socket]:
    """UDP and TCP on the same port. With port 0 the kernel picks the UDP port, which may
    be taken for TCP: then pick again (a few times) rather than fail."""
    for attempt in range(20):
        udp = gateways.bind(host, port, "udp")
        try:
            return udp, gateways.bind(host, udp.getsockname()[1], "tcp")
        except OSError:
            udp.close()
            if port != 0 or attempt == 19:
                raise
    raise AssertionError("unreachable")


def _learner():
    """The firewall's learned set, or None where nftables is not available to this process."""
    try:
        return Nft()
    except NftError as exc:
        log.warning("tcp rules cannot be enforced: %s", exc)
        return None


class Unaffordable(ControlError):
    """A session the descriptor budget cannot hold at its caps."""


class Unbound(ControlError):
    """A session whose gateway's listeners cannot be bound (a port that is taken)."""


class BindError(gateways.BindError):
    """A listener of a session in the config file that cannot be bound: the filter does
    not start."""


class Service:
    def __init__(self, config: FilterConfig):
        self.config = config
        self.store = PolicyStore(config)  # raises ConfigError before anything is bound
        self.budget = Budget(config, raise_limit())
        try:
            self.budget.check(len(self.store.session_configs()))
        except ValueError as exc:
            raise ConfigError(config.path, "[proxy]", str(exc)) from None
        self.started = time.time()
        self.audit: AuditLog | None = None
        self.bus = EventBus(audit_rate=config.audit_events_per_session,
                            audit_burst=10 * config.audit_events_per_session)
        self.store.on_change(lambda: self.bus.forget(set(self.store.sessions)))
        self.resolver = Resolver(config.dns.upstream, config.dns.timeout, config.dns.ttl_min,
                                 config.dns.ttl_max, config.dns.cache_share)
        self.learner = _learner()
        self.learned = LearnedSet(self.learner, self._may_reach) if self.learner else None
        """The learned set, with who taught each element: a policy change takes back what
        it no longer allows (`_revoke`)."""
        self.holds = Holds(self.bus.emit)
        """Approvals in ask mode: requests held for a person, names asked for (DNS)."""
        self.approvals = ApprovalsFile(Path(config.state_dir) / "approvals.json",
                                       self.holds.book, self._identity)
        """The open approvals on disk: read back here, before anything is served (their ids
        exist at once), judged again once the audit log is open (start)."""
        self.approvals.restore({name: self._identity(name) for name in self.store.sessions})
        self.store.on_change(self._forget_approvals)
        self.frontends = Frontends(self.store, self.resolver)
        """Where the inspected hosts live: no tunnel and no learned tcp allowance for
        another name reaches one of their addresses (neighbours.py)."""
        self.frontends.listeners.append(self._policy_changed)  # take back what it learned
        self.dns = DnsFilter(self.store, self.resolver, self.bus, config.gateway, self.learned,
                             config.firewall.learn_ttl_min, config.dns, self.holds,
                             self.frontends)
        self.secrets = SecretStore.load(config.state_dir)
        self.inspect_error: str | None = None
        """Why the filter's own CA (`ca_dir`) could not be had: it runs without inspection
        then (inspected hosts denied, everything else as ever) rather than not at all."""
        try:
            inspector = Inspector.from_config(config.inspect)
        except ConfigError as exc:
            if config.inspect.ca_dir is None:
                raise  # a CA given by hand is the operator's to fix: the filter says so
            log.error("inspect: no interception CA, inspected hosts are denied: %s", exc)
            inspector, self.inspect_error = None, str(exc)
        if inspector is not None and inspector.days_left() < 30:
            log.warning("inspect: the interception CA expires in %d days: `corral certs "
                        "rotate --interception`", inspector.days_left())
        self.proxy = Proxy(self.store, self.resolver, self.bus, config.proxy, config.gateway,
                           self.dns.exfil, inspector,
                           Credentials(self.secrets.key, self.secrets.http()), self.holds,
                           self.frontends)
        self.gate = Gate(self) if config.sshgate.listen else None
        """The git gateway (git over SSH, confined); None when it listens nowhere."""
        self.listeners: dict[str, list[str]] = {}
        self._servers: list = []
        self._transports: list = []
        self._gateways: dict[str, list] = {}
        """Gateway address -> the servers and transports listening there (gateways.py)."""
        self.unserved: dict[str, str] = {}
        """Session -> why its gateway has no listeners (a session registered before a
        restart whose port is taken now): in `status`, and the sandbox gets no answer."""
        self._nflog: socket.socket | None = None
        self.event_loop = ""
        """Which loop runs the filter: "uvloop" or "asyncio"."""
        self.blocking = ThreadPoolExecutor(4, thread_name_prefix="corral-blocking")
        """Where disk and nftables work runs, off the loop: changes (one at a time, under
        `_changing`), audit pages, firewall checks. Not the loop's default executor, which
        the DNS filter's firewall learning uses: neither waits for the other."""
        self._changing: asyncio.Lock | None = None
        self._firewall_seen: dict = {"loaded": False, "error": "not checked yet"}
        self._fds_seen: int | None = None
        self._tasks: set[asyncio.Task] = set()
        self._revoking: asyncio.Task | None = None
        self._revoke_again = False
        self._start_cuts: list[Cut] = []
        self._grants: asyncio.Task | None = None
        """Takes back runtime rules granted for a while (`_end_grants`)."""
        self._ending: asyncio.Event | None = None
        self.store.on_change(self._policy_changed)

    def audit_head(self) -> dict | None:
        return self.audit.head if self.audit else None

    def status(self) -> dict:
        return {
            "version": VERSION,
            "event_loop": self.event_loop,
            "uptime": round(time.time() - self.started, 3),
            "listeners": self.listeners,
            "unserved": self.unserved,
            "sessions": len(self.store.sessions),
            "active_connections": self.proxy.active,
            "proxy": {**self.proxy.stats, "open_flows": len(self.proxy.flows.open),
                      "failures_not_logged": self.proxy.failures.dropped_total,
                      "per_session": {
                          str(name): {"connections": count,
                                      "tunnels": self.proxy.flows.tunnels.held.get(name, 0)}
                          for name, count in self.proxy.flows.connections.held.items()}},
            "descriptors": self.budget.to_json(self._fds_seen),
            "tunnels": dict(relay.STATS),
            "inspect": self.proxy.inspector.status() if self.proxy.inspector else (
                {"error": self.inspect_error} if self.inspect_error else None),
            "secrets": len(self.secrets.secrets),
            "resolver": {**self.resolver.stats, "cache_entries": len(self.resolver.cache),
                         "cache_evicted": self.resolver.cache.evicted},
            "dns": self.dns.stats(),
            "audit": self._audit_status(),
            "firewall": self._firewall_status(),
        }

    def _audit_status(self) -> dict:
        if self.audit is None:
            return {"path": str(self.config.audit_path), "head": None, "error": None}
        return {**self.audit.describe(), "not_recorded": {
            str(session): count for session, count in self.bus.held_total.items()}}

    def _firewall_status(self) -> dict:
        return self._firewall_seen  # as `check_firewall` last saw it

    def check_firewall(self) -> None:
        """Look at the loaded ruleset and the open descriptors for `status`. Blocks
        (libnftables; its lock, which a change applying the ruleset holds; a directory of up
        to a million entries): run it off the loop."""
        self._firewall_seen = self._look_at_firewall()
        self._fds_seen = len(os.listdir("/proc/self/fd"))

    def _look_at_firewall(self) -> dict:
        if self.learner is None:
            return {"loaded": False, "error": "nftables is not available to the filter"}
        try:
            items = self.learner.list_table()
        except Exception as exc:  # status must answer whatever nftables says
            return {"loaded": False, "error": str(exc)}
        if items is None:
            return {"loaded": False, "error": "table inet corral is not loaded"}
        return {"loaded": True, "rules": sum(1 for i in items if "rule" in i),
                "counters": {i["counter"]["name"]: i["counter"]["packets"]  # battery.confirm
                             for i in items if "counter" in i}}

    async def off_loop(self, work: Callable, *args):
        """`work(*args)` on a worker thread; the loop goes on serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.blocking, work, *args)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.event_loop = type(loop).__module__.split(".")[0]
        if self.config.firewall.manage:
            # the full ruleset for the sessions registered before a restart (or none),
            # replacing the boot one; if nftables refuses, the filter does not start and
            # what is loaded stays (closed)
            try:
                self._start_cuts = self.apply_firewall(end_strangers=True)
            except (NftError, ControlError) as exc:
                raise SystemExit(f"corral-filter: cannot load the ruleset: {exc}") from None
        try:
            await self._serve_fixed()
            self._start_drop_reader()
            self.audit = AuditLog(self.config.audit_path,
                                  segment_bytes=self.config.audit_segment_bytes,
                                  keep=self.config.audit_segments)
            self.bus.audit = self.audit
            for session in self.store.session_configs():  # an unserved one is audited
                await self._open_gateway(session)
            self.holds.settle(self.still_open)  # the restored approvals, now audited
            self.approvals.start()
            loop = asyncio.get_running_loop()
            self.audit.on_retire = lambda names, kept: loop.call_soon_threadsafe(
                self._retired, names, kept)
            for cut in self._start_cuts:
                self._cut_event(cut)
            self._start_cuts = []
            control = await ControlServer(self).start(self.config.control_socket,
                                                      self.config.control_group)
            self._servers.append(control)
            self._ending = asyncio.Event()
            self.store.on_change(self._ending.set)
            self._grants = loop.create_task(self._end_grants(), name="corral-grants")
        except BaseException:
            await self.stop()
            raise

    def rule_event(self, session: str, rule, action: str, until: float | None = None) -> None:
        """A runtime rule added (for good, or `until` a time), revoked or expired: an event
        (and an audit record, never charged to the session's budget) of kind `rule`, verdict
        `change`."""
        text = f"{rule.kind} {rule.text}"
        if until is not None:
            text += " until " + time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(until))
        self.bus.emit({"session": session, "client": None, "kind": "rule",
                       "name": rule.host or None, "port": None, "address": None,
                       "verdict": "change", "action": action, "rule": rule.text,
                       "rule_kind": rule.kind, "layer": rule.layer, "expires": until,
                       "reason": f"{action}: {text} (session runtime layer)"})

    async def _end_grants(self) -> None:
        """Take back each runtime rule granted for a while when its time comes (wall-clock:
        the ends are kept on disk, and one already past at start is taken back at once).
        Woken by every change; never sleeps more than a minute (the clock may be set)."""
        while True:
            try:
                await self._end_due_grants()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not leave every later grant in force
                log.exception("grants: taking back rules whose time came failed")
                await asyncio.sleep(REVOKE_RETRY)

    async def _end_due_grants(self) -> None:
        """Take back what is due, then wait for the next end or a change."""
        self._ending.clear()
        end = self.store.next_end()
        if end is not None and end <= time.time():
            try:
                change = await self.change(lambda: self.store.plan_expire(time.time()))
            except Exception as exc:  # disk or nftables: the rule goes from memory anyway
                change = self.store.plan_expire(time.time())
                self.store.commit(change)  # fail closed: the filter no longer grants it
                log.error("grants: rules whose time came are taken back in the filter, but "
                          "not on disk or in the firewall: %s", exc)
                self.bus.emit({"session": None, "client": None, "kind": "rule", "name": None,
                               "verdict": "error", "rule": None, "layer": None,
                               "reason": "runtime rules whose time came are taken back in the "
                               "filter but could not be on disk or in the firewall (a "
                               f"restart takes them back there): {exc}"})
            for session, rule in change.result:
                log.info("grants: %s rule %s of session %s expired", rule.kind, rule.text,
                         session)
                self.rule_event(session, rule, "expired")
            return
        wait = 60.0 if end is None else min(60.0, max(0.0, end - time.time()))
        # asyncio.timeout, not wait_for: 3.11's wait_for swallows a cancel that comes as
        # the event is set (a change, then stop at once): the filter would not stop
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await self._ending.wait()

    def _retired(self, names: list[str], kept: int | None) -> None:
        """Retention removed segments: a record says which, and where the log now starts
        (so a verifier can tell retention from a cut)."""
        self.bus.emit({"session": None, "client": None, "kind": "audit", "name": None,
                       "port": None, "address": None, "verdict": "error", "rule": None,
                       "layer": None, "reason": f"retention removed {', '.join(names)}; the "
                       f"log now starts at seq {kept}"})

    def _start_drop_reader(self) -> None:
        """Firewall rejects, reported over NFLOG, become events (when the firewall is here)."""
        if not self.config.sessions and not self.config.firewall.manage:
            return
        try:
            sock = nflog.open_group(self.config.firewall.log_group)
        except OSError as exc:
            log.warning("firewall drop events unavailable (NFLOG group %d): %s",
                        self.config.firewall.log_group, exc)
            return
        self._nflog = sock

        def readable():
            while True:
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    return
                except OSError as exc:  # ENOBUFS: the kernel dropped reports; counters did not
                    log.warning("firewall drop events: %s", exc)
                    return
                for drop in nflog.parse(data):
                    self._drop_event(drop)

        asyncio.get_running_loop().add_reader(sock.fileno(), readable)

    def _drop_event(self, drop: nflog.Drop) -> None:
        if nflog.link_local_multicast(drop):
            return  # counted quietly by the ruleset: nothing was denied
        target = f"{drop.destination}:{drop.port}" if drop.port else drop.destination
        appliance = drop.destination in {str(s.gateway) for s in self.store.session_configs()}
        self.bus.emit({
            "session": drop.session if drop.session in self.store.sessions else None,
            "client": drop.source, "kind": "firewall", "name": drop.destination,
            "port": drop.port, "address": drop.destination, "verdict": "deny",
            "reason": f"rejected by the firewall: {drop.protocol} to {target}",
            "rule": None, "layer": None, "protocol": drop.protocol,
            "hint": nflog.hint(drop, appliance, ruleset.gateway_services(self.config)),
        })

    @staticmethod
    def _name(sock: socket.socket) -> str:
        host, port = sock.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _record(self, key: str, sock: socket.socket) -> None:
        self.listeners.setdefault(key, []).append(self._name(sock))

    async def _serve(self, key: str, sock: socket.socket):
        """Serve `key` on a bound socket: the server or transport to close it with."""
        if key == "dns_udp":
            served = UdpServer(self.dns).attach(asyncio.get_running_loop(), sock)
        elif key == "dns_tcp":
            served = await asyncio.start_server(lambda r, w: serve_tcp(self.dns, r, w),
                                                sock=sock, backlog=1024)
        elif key == "sshgate":
            served = await self.gate.listen(sock)
        else:
            handler = {"proxy": self.proxy.serve_explicit,
                       "transparent_http": self.proxy.serve_transparent_http,
                       "transparent_tls": self.proxy.serve_transparent_tls}[key]
            served = await asyncio.start_server(
                handler, sock=sock, limit=self.config.proxy.max_header_bytes, backlog=4096)
        self._record(key, sock)
        return served

    async def _serve_fixed(self) -> None:
        """The listeners the config puts on fixed addresses (IP:PORT): bound at start."""
        for host in gateways.fixed_hosts(self.config):
            for listener in gateways.planned(self.config, host):
                if listener.key == "dns_tcp":
                    continue  # bound with its UDP twin, on the same port
                if listener.key == "dns_udp":
                    udp, tcp = _dns_sockets(host, listener.port)
                    self._transports.append(await self._serve("dns_udp", udp))
                    self._servers.append(await self._serve("dns_tcp", tcp))
                    continue
                if listener.key == "sshgate" and self.gate is None:
                    continue
                sock = gateways.bind(host, listener.port, listener.protocol)
                self._servers.append(await self._serve(listener.key, sock))

    def _bind_gateway(self, session) -> list:
        """The session's gateway listeners, bound (none when the config has none, or when
        its gateway is served already); BindError names the port that is taken."""
        address = str(session.gateway)
        if address in self._gateways:
            return []
        return gateways.bind_all(address, gateways.planned(self.config))

    async def _serve_gateway(self, session, bound: list) -> None:
        """Serve what `_bind_gateway` bound, unless the session went meanwhile (a removal
        that came between its registration and this)."""
        address = str(session.gateway)
        if not bound or address in self._gateways or session not in \
                self.store.session_configs():
            for _, sock in bound:
                sock.close()
            return
        served = self._gateways[address] = []
        for listener, sock in bound:
            served.append(await self._serve(listener.key, sock))
        self.unserved.pop(session.name, None)
        log.info("session %s: listening on %s", session.name,
                 ", ".join(f"{address}:{p}" for p in sorted({b.port for b, _ in bound})))

    async def _open_gateway(self, session) -> None:
        """At start: a session of the config file whose gateway cannot be had stops the
        filter (the config is the operator's to fix, as a fixed listener's address); one
        registered at run time before a restart is left unserved, said in the log, an event
        and `status`, and every other session served."""
        try:
            bound = self._bind_gateway(session)
        except gateways.BindError as exc:
            if session in self.config.sessions:
                raise BindError(exc.errno, f"session {session.name}: {exc}") from None
            self._unserved(session.name, str(exc))
            return
        await self._serve_gateway(session, bound)

    def _unserved(self, session: str, why: str) -> None:
        self.unserved[session] = why
        log.error("session %s is not served: %s", session, why)
        self.bus.emit({"session": session, "client": None, "kind": "session", "name": session,
                       "port": None, "address": None, "verdict": "error", "rule": None,
                       "layer": None, "reason": f"session {session} is not served: {why}"})

    def _close_gateway(self, address: str) -> None:
        """The session on this gateway is gone: its listeners go (open connections are the
        proxy's to judge, as on every change)."""
        for served in self._gateways.pop(address, []):
            served.close()
        for key in list(self.listeners):
            kept = [n for n in self.listeners[key] if n.rpartition(":")[0] != address]
            if kept:
                self.listeners[key] = kept
            else:
                del self.listeners[key]

    def port(self, key: str) -> int:
        """The port `key` listens on: the configured one, or the one bound (a fixed
        listener on port 0)."""
        for listener in gateways.planned(self.config):
            if listener.key == key:
                return listener.port
        return int(self.listeners[key][0].rsplit(":", 1)[1])

    async def change(self, plan: Callable[[], Change],
                     first: Callable[[], None] | None = None) -> Change:
        """One change to the policy store: `plan()` works it out, it is written and (with
        `[firewall] manage`, when the ruleset depends on it) the firewall follows, all on a
        worker thread; then it is swapped in on the loop. One change at a time, so that two
        never start from the same state (the second would lose the first's rule). All or
        nothing: a file that cannot be written or a ruleset nftables refuses leaves the
        disk and the store as they were, and raises. `first` runs on the loop once the
        change's turn has come, before `plan`: it may refuse (raise) what waited meanwhile."""
        if self._changing is None:
            self._changing = asyncio.Lock()
        async with self._changing:
            if first is not None:
                first()
            change = await self.off_loop(self._prepare, plan)
            self.store.commit(change)
            return change

    def _prepare(self, plan: Callable[[], Change]) -> Change:
        change = plan()
        if change.changed:
            change.write()
            if self.config.firewall.manage and self._ruleset_changes(change):
                try:
                    self.apply_firewall(change)
                except BaseException:
                    change.undo()
                    raise
        return change

    def _ruleset_changes(self, change: Change) -> bool:
        """The ruleset holds the sessions and the tcp rules that name an address."""
        return (change.session_configs() != self.store.session_configs()
                or ruleset.static_tcp_rules(change) != ruleset.static_tcp_rules(self.store))

    async def register_session(self, name, subnet, gateway, files):
        """A session registered at run time; with `[firewall] manage`, the ruleset follows,
        and if nftables refuses it the session is not registered (fail closed). A session
        the descriptor budget cannot hold at its caps is refused (limits.Budget)."""

        bound: list = []

        def plan() -> Change:
            change = self.store.plan_register(name, subnet, gateway, files)
            if change.changed:
                try:
                    self.budget.check(len(change.session_configs()))
                except ValueError as exc:
                    raise Unaffordable(f"session {name} not registered: {exc}") from None
            if change.changed or name in self.unserved:  # added again: try its ports again
                try:  # before anything is written: a port that is taken refuses the session
                    bound.extend(self._bind_gateway(change.result[0]))
                except gateways.BindError as exc:
                    raise Unbound(f"session {name} not registered: {exc}") from None
            return change

        try:
            change = await self.change(plan)
        except BaseException as exc:
            for _, sock in bound:
                sock.close()
            if isinstance(exc, (NftError, ControlError)) and not isinstance(
                    exc, (Unaffordable, Unbound)):
                raise ControlError(f"session {name} not registered: the firewall could not "
                                   f"follow: {exc}") from None
            raise
        session, added = change.result
        await self._serve_gateway(session, bound)
        log.info("session %s %s: %s", name, "registered" if added else "unchanged",
                 session.subnet)
        return session, added

    def _identity(self, session: str) -> str:
        """What tells a session from a later one of the same name: its subnet."""
        found = self.store.sessions.get(session)
        return str(found.subnet) if found is not None else ""

    def _forget_approvals(self) -> None:
        """The policy changed: a session that is gone takes its approvals (and the requests
        held for them); every other open approval is judged again (Holds.settle)."""
        for session in {p.session for p in self.holds.book.pending.values()}:
            if session not in self.store.sessions:
                self.holds.forget(session)
        self.holds.settle(self.still_open)

    def still_open(self, pending) -> tuple[bool | None, str]:
        """An open approval under the policy in force now (see Holds.settle)."""
        policy = self.store.sessions[pending.session].policy
        name, port = split_host_port(pending.target)
        decision = decide_kind(policy, pending.kind, parse_host(name),
                               int(port) if port else None)
        if decision.allowed:
            return True, f"the policy allows it now: {decision.reason}"
        if not approvable(decision):
            return False, f"{decision.reason}: no longer something a person can approve"
        if not policy.hold and pending.waiting:
            return None, "ask mode was turned off"
        return None, ""

    async def unregister_session(self, name: str, forget_rules: bool) -> None:
        try:
            change = await self.change(lambda: self.store.plan_unregister(name, forget_rules))
        except (NftError, ControlError) as exc:
            raise ControlError(f"session {name} not unregistered: the firewall could not "
                               f"follow: {exc}") from None
        kept = {str(s.gateway) for s in change.session_configs()}
        for address in [a for a in self._gateways if a not in kept]:
            self._close_gateway(address)
        self.unserved.pop(name, None)
        # its approvals went with it: written off before a session of the same name can come
        await self.approvals.save()
        log.info("session %s unregistered%s", name, " (rules forgotten)" if forget_rules else "")

    def apply_firewall(self, state=None, end_strangers: bool = False) -> list[Cut]:
        """Load the ruleset for every session of `state` (the store, or a change about to be
        committed) in one transaction, with the learned elements of those sessions: read
        from the learned set's ledger and loaded under its lock, so that nothing learned
        meanwhile is lost. Raises on refusal. Blocks: off the loop once serving. With
        `end_strangers` (start-up): what a previous filter left in the learned set is not
        carried over, and the cuts of their connections are returned."""
        if self.learner is None or self.learned is None:
            raise ControlError("the filter manages the firewall but nftables is unavailable")
        state = state or self.store
        sessions = {s.name for s in state.session_configs()}
        counts = self.learner.counters()
        return self.learned.apply(lambda learned: ruleset.for_store(state, learned, counts),
                                  sessions, end_strangers)

    # -- learned tcp allowances that a policy change takes back ------------------------------

    def _may_reach(self, session: str, key: Key, name: str) -> Decision:
        """The learned set's judge: may `session`'s sandbox reach the element's destination
        and port as an address of `name`, under the policy in force now? Runs on worker
        threads, and reads the store as `_ruleset_changes` does: a commit swaps whole
        references, so a reader sees one state or the next, never half of one."""
        current = self.store.sessions.get(session)
        if current is None:
            return Decision(False, f"session {session} is gone")
        sandbox, destination, port = key
        if ipaddress.ip_address(sandbox) not in current.subnet:
            return Decision(False, f"{sandbox} is no longer in session {session}'s subnet")
        host = Host(name=name)
        decision = current.policy.decide_tcp(host, port)
        if decision.allowed:  # a cidr rule that let a blocked address through may be gone
            check = current.policy.decide_address(ipaddress.ip_address(destination), host)
            if not check.allowed:
                return check
            # raw TCP to an inspected host's front-end would carry its requests unread
            shared = self.frontends.judge(current.policy, host, destination, "tcp")
            if shared is not None:
                return shared
        return decision

    def _policy_changed(self) -> None:
        """After every change (on the loop): take back, off the loop, the learned elements
        the policy in force no longer allows. One pass at a time; changes that come while
        one runs ask for one more pass, not one each."""
        if self.learned is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a change made with no loop running: nothing has learned yet
            if len(self.learned.ledger):
                raise RuntimeError("learned tcp allowances are taken back on the filter's "
                                   "event loop, and none is running") from None
            return
        self._revoke_again = True
        if self._revoking is None:
            self._revoking = loop.create_task(self._revoke(), name="corral-revoke")

    async def _revoke(self) -> None:
        """Passes until one finds the policy unchanged since it began. A pass nftables
        refuses leaves the elements in the ledger and is tried again every REVOKE_RETRY
        seconds until one goes through (one event and one log line per such streak)."""
        failing = False
        try:
            while self._revoke_again:
                self._revoke_again = False
                try:
                    cuts = await self.off_loop(self.learned.revoke)
                except Exception as exc:
                    if not failing:
                        log.error("learned tcp allowances not taken back: %s", exc)
                        self.bus.emit({
                            "session": None, "client": None, "kind": "firewall", "name": None,
                            "verdict": "error", "rule": None, "layer": None,
                            "reason": "learned tcp allowances the policy no longer gives "
                                      f"could not be taken back (trying again): {exc}"})
                    failing = self._revoke_again = True
                    await asyncio.sleep(REVOKE_RETRY)
                    continue
                if failing:
                    log.info("learned tcp allowances taken back after all")
                    failing = False
                for cut in cuts:
                    self._cut_event(cut)
        finally:
            self._revoking = None

    def _cut_event(self, cut: Cut) -> None:
        revoked = cut.revoked
        sandbox, destination, port = revoked.key
        session = revoked.session or self.store.lookup(sandbox)[0]
        names = list(revoked.names)
        through = f" ({', '.join(names)})" if names else ""
        ended = cut.error or (f"{cut.connections} connection"
                              f"{'' if cut.connections == 1 else 's'} ended")
        rule = revoked.decision.rule
        event = {"session": session, "client": sandbox, "kind": "firewall",
                 "name": names[0] if names else None, "port": port, "address": destination,
                 "verdict": "deny", "rule": rule.text if rule else None,
                 "layer": rule.layer if rule else None, "protocol": "tcp",
                 "reason": f"cut: {session or sandbox} -> {destination}:{port}{through}: "
                           f"{revoked.decision.reason}; {ended}",
                 "names": names, "connections": cut.connections}
        if cut.error:
            event["error"] = cut.error
        self.bus.emit(event)

    def reload(self) -> None:
        """SIGHUP: re-read the policy files, as a change like any other (off the loop, after
        the changes before it)."""
        task = asyncio.get_running_loop().create_task(self._reload(), name="corral-reload")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reload(self) -> None:
        try:
            await self.change(self.store.plan_reload)
        except (ConfigError, NftError, ControlError, OSError) as exc:
            log.error("reload refused, policy unchanged: %s", exc)
            return
        except Exception:
            log.exception("reload refused, policy unchanged: internal error")
            return
        log.info("policy reloaded: %d sessions", len(self.store.sessions))

    async def stop(self) -> None:
        if self._grants is not None:
            self._grants.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._grants
            self._grants = None
        if self._nflog is not None:
            asyncio.get_running_loop().remove_reader(self._nflog.fileno())
            self._nflog.close()
            self._nflog = None
        for server in self._servers:
            server.close()
        for transport in self._transports:
            transport.close()
        for address in list(self._gateways):
            self._close_gateway(address)
        if self.gate is not None:
            await self.gate.close()  # its calls cut, their events written before the log closes
        await self.approvals.close()  # the last save (a decision still coming: on the loop)
        if self.audit is not None:
            self.audit.close()
            self.audit = None
        if self.proxy.inspector is not None:
            self.proxy.inspector.close()
        self.blocking.shutdown(wait=False, cancel_futures=True)


async def run(config: FilterConfig) -> int:
    service = Service(config)
    for handler in logging.getLogger().handlers:  # no secret's value in a log line either,
        handler.addFilter(LogFilter(lambda: service.proxy.redactor))  # from the start on
    await service.start()
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    loop.add_signal_handler(signal.SIGINT, stopping.set)
    loop.add_signal_handler(signal.SIGHUP, service.reload)
    log.info("corral-filter %s serving: %s", VERSION,
             "; ".join(f"{k} {', '.join(v)}" for k, v in service.listeners.items()))
    await stopping.wait()
    log.info("stopping")
    await service.stop()
    return 0


def loop_factory(choice: str):
    """uvloop when asked for or available: the same asyncio API with a loop written in C,
    which halves the time to answer a request here (bench/). Optional: asyncio's loop runs
    the same code."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("--event-loop", "", "uvloop is not installed; pip install uvloop "
                              "or use --event-loop asyncio") from None
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="corral-filter",
        description="corral's egress filter: DNS filter and HTTP(S) proxy with a control socket.")
    parser.add_argument("--config", required=True, metavar="FILE", help="the filter's TOML config")
    parser.add_argument("--check", action="store_true",
                        help="parse the config and every policy file, print a summary, exit")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--event-loop", default="auto", choices=["auto", "uvloop", "asyncio"],
                        help="auto (the default): uvloop when it is installed, else asyncio's "
                        "own loop; `status` says which one runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # asyncssh says a dozen lines at INFO for each call to the git gateway, the agent's
    # exec command among them: the gateway's own events say what happened
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    try:
        config = load_config(args.config)
        if args.check:
            store = PolicyStore(config)
            print(f"{args.config}: ok; {len(store.base)} appliance rules, "
                  f"{len(store.sessions)} sessions")
            return 0
        factory = loop_factory(args.event_loop)
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(run(config))
    except ConfigError as exc:
        print(f"corral-filter: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"corral-filter: {exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
