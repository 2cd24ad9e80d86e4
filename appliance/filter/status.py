"""What `status` and `sessions` answer: read from the parts of the running filter, never
changing them. `check` looks at nftables and the open descriptors, which blocks: off the
loop, before each `describe`."""

from __future__ import annotations

import os
import time

from appliance.policystore import PolicyStore

from . import relay
from .dns.filter import DnsFilter
from .dns.resolver import Resolver
from .events import EventBus
from .firewalled import Firewall
from .journal import Journal
from .limits import DescriptorBudget
from .listeners import Listeners
from .proxy import Proxy
from .secrets import SecretStore

VERSION = "0.1.0"


class Status:
    def __init__(self, *, config, store: PolicyStore, bus: EventBus, listeners: Listeners,
                 proxy: Proxy, dns: DnsFilter, resolver: Resolver, budget: DescriptorBudget,
                 secrets: SecretStore, firewall: Firewall, inspect_error: str | None,
                 journal: Journal | None = None):
        """`config`: the filter's (the audit log's path); `inspect_error`: why there is
        no interception CA, if there is none; `journal`: the export to journald, if on."""
        self.config, self.store, self.bus, self.listeners = config, store, bus, listeners
        self.proxy, self.dns, self.resolver, self.budget = proxy, dns, resolver, budget
        self.secrets, self.firewall, self.inspect_error = secrets, firewall, inspect_error
        self.journal = journal
        self.started = time.time()
        self.event_loop = ""
        """Which loop runs the filter: "uvloop" or "asyncio" (set at start)."""
        self._firewall_seen: dict = {"loaded": False, "error": "not checked yet"}
        self._fds_seen: int | None = None

    def check(self) -> None:
        """Look at the loaded ruleset and the open descriptors for `describe`. Blocks
        (libnftables; its lock, which a change applying the ruleset holds; a directory of up
        to a million entries): run it off the loop."""
        self._firewall_seen = self.firewall.look()
        self._fds_seen = len(os.listdir("/proc/self/fd"))

    def describe(self) -> dict:
        proxy, flows = self.proxy, self.proxy.flows
        return {
            "version": VERSION,
            "event_loop": self.event_loop,
            "uptime": round(time.time() - self.started, 3),
            "listeners": self.listeners.names,
            "unserved": self.listeners.unserved,
            "sessions": len(self.store.sessions),
            "active_connections": proxy.active,
            "proxy": {**proxy.stats, "open_flows": len(flows.open),
                      "failures_not_logged": proxy.failures.dropped_total,
                      "per_session": {
                          str(name): {"connections": count,
                                      "tunnels": flows.tunnels.held.get(name, 0)}
                          for name, count in flows.connections.held.items()}},
            "descriptors": self.budget.to_json(self._fds_seen),
            "tunnels": dict(relay.STATS),
            "inspect": proxy.inspector.status() if proxy.inspector else (
                {"error": self.inspect_error} if self.inspect_error else None),
            "secrets": len(self.secrets.secrets),
            "resolver": {**self.resolver.stats, **self.resolver.udp_stats(),
                         "cache_entries": len(self.resolver.cache),
                         "cache_evicted": self.resolver.cache.evicted},
            "dns": self.dns.stats(),
            "audit": self._audit(),
            "journal": self.journal.describe() if self.journal is not None else None,
            "firewall": self._firewall_seen,  # as `check` last saw it
        }

    def _audit(self) -> dict:
        if self.bus.audit is None:
            return {"path": str(self.config.audit_path), "head": None, "error": None}
        return {**self.bus.audit.describe(), "not_recorded": {
            str(session): count for session, count in self.bus.held_total.items()}}

    def sessions(self) -> list[dict]:
        """Every session, with its counters and open connections."""
        registered = {s.name for s in self.store.registered}
        counters, held = self.bus.counters, self.proxy.flows.connections.held
        return [{"name": s.name, "subnet": str(s.subnet), "runtime_rules": len(s.runtime),
                 "registered": s.name in registered,
                 "allowed": counters[(s.name, "allow")], "denied": counters[(s.name, "deny")],
                 "last_activity": max(self.bus.last_seen.get(s.name, 0.0), self.bus.started),
                 "open_connections": held[s.name]}
                for s in self.store.sessions.values()]
