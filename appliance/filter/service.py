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
thread, one change at a time, and swapped in on the loop (changes.py).

This module only builds the parts, wires them together and starts and stops them in
order; none of them is given the service, each gets the narrow things it uses:

  changes.py          store, blocking, firewall      one change at a time, off the loop
  firewalled.py       nftables, learned set         the ruleset loaded; what is loaded
  revocation.py       learned set, store, bus, blocking  allowances a change takes back
  expiry.py           store, changes, bus           runtime rules granted for a while
  registration.py     store, changes, budget, listeners, approvals file   sessions at run time
  listeners.py        config, store, bus, what serves each key   fixed and gateway sockets
  drops.py            store, bus, NFLOG group       firewall rejects become events
  journal.py          bus, journald's socket        every event to journald ([events] journal)
  approvals_policy.py store, holds                  open approvals under the policy now
  git/sshgate.py      store, bus, secrets, its port, the proxy's judges, cap, budget and
                      timeouts, host.corral's address, the resolver   the git gateway
  status.py           what it reports on            `status` and `sessions`
  control.py          what requests read and change   the control socket
  workers/            store, bus, learned set, secrets, frontends   with `[filter] workers`
                      > 1: processes that serve the sessions' gateways, told each change

Stores announce their changes (`on_change`): the policy store's reach the proxy, the DNS
filter, the gateway, revocation and expiry; the secret store's reach the proxy's
credentials and the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from pathlib import Path

from appliance.firewall import ruleset
from appliance.firewall.learned import Cut, LearnedSet
from appliance.firewall.nft import NftError
from appliance.policy import ConfigError
from appliance.policystore import PolicyStore
from appliance.sessionconfig import FilterConfig, load_config

from .approvals import Holds
from .approvals_file import ApprovalsFile
from .approvals_policy import OpenApprovals
from .audit import AuditLog
from .audit.heads import HeadSigner
from .blocking import Blocking
from .changes import Changes
from .control import ControlServer
from .dns.filter import DnsFilter
from .dns.resolver import Resolver
from .drops import DropReader
from .errors import ControlError
from .events import EventBus, retired
from .expiry import GrantExpiry
from .firewalled import Firewall, nftables
from .git.sshgate import Gate
from .journal import Journal
from .limits import DescriptorBudget, raise_limit
from .listeners import Listeners
from .plane import interception, loop_factory, servers, tune_gc
from .proxy import Proxy
from .proxy.credentials import Credentials
from .proxy.frontends import Frontends
from .redact import LogFilter
from .registration import Registration
from .revocation import Reach, Revocation
from .secrets import SecretStore
from .status import VERSION, Status
from .workers.coordinator import Workers

log = logging.getLogger("corral.filter")


class Service:
    """The filter's parts, built and wired (constructing binds nothing); `start` serves."""

    def __init__(self, config: FilterConfig, event_loop: str = "auto",
                 log_level: str = "info"):
        """`event_loop`, `log_level`: as the command line gave them (workers get them too)."""
        self.config = config
        self.store = PolicyStore(config)  # ConfigError before anything is bound
        self.budget = DescriptorBudget(config, raise_limit())
        try:
            self.budget.check(len(self.store.session_configs()))
        except ValueError as exc:
            raise ConfigError(config.path, "[proxy]", str(exc)) from None
        self.bus = EventBus(audit_rate=config.audit_events_per_session,
                            audit_burst=10 * config.audit_events_per_session)
        self.store.on_change(lambda: self.bus.forget(set(self.store.sessions)))
        self.resolver = Resolver(config.dns.upstream, config.dns.timeout, config.dns.ttl_min,
                                 config.dns.ttl_max, config.dns.cache_share)
        self.blocking = Blocking()
        self._approvals()
        self.frontends = Frontends(self.store, self.resolver)
        """Where the inspected hosts live: no tunnel and no learned tcp allowance for
        another name reaches one of their addresses (neighbours.py)."""
        self._firewall()
        self._traffic()
        self._jobs()
        self._workers(event_loop, log_level)
        self.audit: AuditLog | None = None
        self._control_server: asyncio.AbstractServer | None = None

    def _approvals(self) -> None:
        self.holds = Holds(self.bus.emit)
        """Approvals in ask mode: requests held for a person, names asked for (DNS)."""
        self.approvals = ApprovalsFile(Path(self.config.state_dir) / "approvals.json",
                                       self.holds.book, self.store.identity)
        """The open approvals on disk: read back here, before anything is served (their ids
        exist at once), judged again once the audit log is open (start)."""
        self.approvals.restore({name: self.store.identity(name)
                                for name in self.store.sessions})
        self.open_approvals = OpenApprovals(self.store, self.holds)
        self.store.on_change(self.open_approvals.policy_changed)

    def _firewall(self) -> None:
        nft = nftables()
        self.reach = Reach(self.store, self.frontends)
        self.learned = LearnedSet(nft, self.reach.may_reach) if nft else None
        """The learned set, with who taught each element: a policy change takes back what
        it no longer allows (revocation.py)."""
        self.firewall = Firewall(nft, self.learned)
        self.changes = Changes(self.store, self.blocking, self.firewall,
                               self.config.firewall.manage)
        self.revocation = Revocation(self.learned, self.store, self.bus, self.blocking)
        self.frontends.listeners.append(self.revocation.policy_changed)

    def _traffic(self) -> None:
        """What serves the sessions: DNS, the proxy, the git gateway, their listeners."""
        config, store, bus = self.config, self.store, self.bus
        self.dns = DnsFilter(store, self.resolver, bus, config.gateway, self.learned,
                             config.firewall.learn_ttl_min, config.dns, self.holds,
                             self.frontends)
        self.secrets = SecretStore.load(config.state_dir)
        self.inspector, self.inspect_error = interception(config.inspect)
        self.proxy = Proxy(store, self.resolver, bus, config.proxy, config.gateway,
                           self.dns.exfil, self.inspector,
                           Credentials(self.secrets.key, self.secrets.http()), self.holds,
                           self.frontends)

        def credentials_follow() -> None:  # the proxy's snapshot of the secrets, anew
            self.proxy.credentials = Credentials(self.secrets.key, self.secrets.http())
        self.secrets.on_change(credentials_follow)  # before the gate's: it judges with them

        self.listeners = Listeners(config, store, bus, servers(config, self.dns, self.proxy))
        self.gate = None
        """The git gateway (git over SSH, confined); None when it listens nowhere."""
        if config.sshgate.listen:
            self.gate = Gate(store, bus, self.secrets, config.state_dir,
                             lambda: self.listeners.port("sshgate"), judges=self.proxy.forward,
                             admission=self.proxy.flows.connections,
                             failures=self.proxy.failures, timeouts=config.proxy,
                             gateway=config.gateway, resolver=self.resolver)
            self.listeners.serve["sshgate"] = self.gate.listen

    def _jobs(self) -> None:
        """What runs beside the traffic: sessions coming and going, grants ending, firewall
        rejects reported, status, the control socket."""
        config, store, bus = self.config, self.store, self.bus
        self.registration = Registration(store, self.changes.change, self.budget,
                                         self.listeners, self.approvals)
        self.expiry = GrantExpiry(store, self.changes.change, bus, self.changes.in_memory)
        self.drops = DropReader(store, bus, config.firewall.log_group,
                                ruleset.gateway_services(config))
        self.journal = Journal(bus, config.events.journal_socket) \
            if config.events.journal else None
        self.status = Status(config=config, store=store, bus=bus, listeners=self.listeners,
                             proxy=self.proxy, dns=self.dns, resolver=self.resolver,
                             budget=self.budget, secrets=self.secrets, firewall=self.firewall,
                             inspect_error=self.inspect_error, journal=self.journal)
        self.control = ControlServer(
            store=store, bus=bus, change=self.changes.change, blocking=self.blocking,
            status=self.status, sessions=self.registration, audit_path=config.audit_path,
            inspector=self.inspector, secrets=self.secrets, gate=self.gate, holds=self.holds,
            open_approvals=self.open_approvals, approvals_file=self.approvals)
        store.on_change(self.revocation.policy_changed)
        store.on_change(self.expiry.changed)

    def _workers(self, event_loop: str, log_level: str) -> None:
        """With `[filter] workers` > 1, processes that serve the sessions' gateways
        (workers/): told every change before it returns, every secret (control.py), each
        new CA."""
        self.workers = None
        if self.config.workers < 2:
            return
        self.workers = Workers(self.config.workers, self.store, self.bus, self.learned,
                               self.secrets, self.frontends, self.holds,
                               event_loop=event_loop, log_level=log_level,
                               silence=self.config.worker_silence)
        self.listeners.workers = self.workers
        self.changes.follow = self.workers.follow
        self.control.workers = self.workers

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.status.event_loop = type(loop).__module__.split(".")[0]
        start_cuts: list[Cut] = []
        if self.config.firewall.manage:
            # the full ruleset for the sessions registered before a restart (or none),
            # replacing the boot one; if nftables refuses, the filter does not start and
            # what is loaded stays (closed)
            try:
                start_cuts = self.firewall.apply(self.store, end_strangers=True)
            except (NftError, ControlError) as exc:
                raise SystemExit(f"corral-filter: cannot load the ruleset: {exc}") from None
        if self.journal is not None:
            self.journal.start()  # subscribed before anything is served
        try:
            await self.listeners.serve_fixed()
            if self.config.sessions or self.config.firewall.manage:  # the firewall is here
                self.drops.start()
            heads = self.config.audit
            self.audit = AuditLog(self.config.audit_path,
                                  segment_bytes=self.config.audit_segment_bytes,
                                  keep=self.config.audit_segments,
                                  signer=HeadSigner(Path(self.config.state_dir),
                                                    heads.appliance or socket.gethostname(),
                                                    heads.heads_every, heads.heads_interval))
            self.bus.audit = self.audit
            if self.workers is not None:
                await self.workers.start()  # before any gateway: they serve them
            for session in self.store.session_configs():  # an unserved one is audited
                await self.listeners.open_gateway(session)
            self.holds.settle(self.open_approvals.still_open)  # restored ones, now audited
            self.approvals.start()
            self.audit.on_retire = lambda names, kept: loop.call_soon_threadsafe(
                self.bus.emit, retired(names, kept))
            self.revocation.report(start_cuts)
            self._control_server = await self.control.start(self.config.control_socket,
                                                            self.config.control_group)
            self.expiry.start()
        except BaseException:
            await self.stop()
            raise

    def reload(self) -> None:
        """SIGHUP: re-read the policy files (changes.py)."""
        self.changes.reload()

    async def stop(self) -> None:
        await self.expiry.stop()
        self.drops.stop()
        self.listeners.close()
        if self.workers is not None:
            await self.workers.stop()  # their last events, before the log closes
        self.proxy.forward.drop_kept()
        self.proxy.close_lanes()
        if self._control_server is not None:
            self._control_server.close()
            self._control_server = None
        if self.gate is not None:
            await self.gate.close()  # its calls cut, their events written before the log closes
        await self.approvals.close()  # the last save (a decision still coming: on the loop)
        if self.audit is not None:
            self.audit.close()
            self.audit = None
        if self.inspector is not None:
            self.inspector.close()
        if self.journal is not None:
            await self.journal.stop()  # the last events too, as far as journald takes them
        self.resolver.close()
        self.blocking.shutdown(wait=False)


async def run(config: FilterConfig, event_loop: str = "auto", log_level: str = "info") -> int:
    service = Service(config, event_loop, log_level)
    for handler in logging.getLogger().handlers:  # no secret's value in a log line either,
        handler.addFilter(LogFilter(lambda: service.proxy.redactor))  # from the start on
    await service.start()
    tune_gc()
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    loop.add_signal_handler(signal.SIGINT, stopping.set)
    loop.add_signal_handler(signal.SIGHUP, service.reload)
    log.info("corral-filter %s serving: %s", VERSION,
             "; ".join(f"{k} {', '.join(v)}" for k, v in service.listeners.names.items()))
    await stopping.wait()
    log.info("stopping")
    await service.stop()
    return 0


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
            return runner.run(run(config, args.event_loop, args.log_level))
    except ConfigError as exc:
        print(f"corral-filter: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"corral-filter: {exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
