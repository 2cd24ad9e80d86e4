"""`corral-filter --config FILE`: DNS filter, proxy listeners and control socket, one process.

Start-up is all or nothing: the config and every policy file are parsed first (exit 2 with
file, key and reason on any error), then every listener is bound (exit 1 naming the address
that failed). Only then does it serve. SIGHUP re-reads the policy files; a bad file keeps
the policy in force. SIGTERM/SIGINT stop it after flushing the audit log.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
import time

from appliance.firewall import nflog, ruleset
from appliance.firewall.nft import Nft, NftError
from appliance.policy import ConfigError

from . import relay
from .audit import AuditLog
from .config import FilterConfig, load_config
from .control import ControlError, ControlServer
from .dns import DnsFilter, UdpServer, serve_tcp
from .events import EventBus
from .proxy import Proxy
from .resolver import Resolver
from .store import PolicyStore

log = logging.getLogger("corral.filter")
IP_FREEBIND = getattr(socket, "IP_FREEBIND", 15)
VERSION = "0.1.0"


def _socket(host: str, port: int, kind: int) -> socket.socket:
    """A bound socket; IP_FREEBIND lets it bind a bridge address that does not exist yet."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, kind)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET:
            sock.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
        else:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        protocol = "udp" if kind == socket.SOCK_DGRAM else "tcp"
        message = f"cannot bind {host}:{port} ({protocol}): {exc.strerror}"
        raise OSError(exc.errno, message) from None
    sock.setblocking(False)
    return sock


def _dns_sockets(host: str, port: int) -> tuple[socket.socket, socket.socket]:
    """UDP and TCP on the same port. With port 0 the kernel picks the UDP port, which may
    be taken for TCP: then pick again (a few times) rather than fail."""
    for attempt in range(20):
        udp = _socket(host, port, socket.SOCK_DGRAM)
        try:
            return udp, _socket(host, udp.getsockname()[1], socket.SOCK_STREAM)
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


class Service:
    def __init__(self, config: FilterConfig):
        self.config = config
        self.store = PolicyStore(config)  # raises ConfigError before anything is bound
        self.started = time.time()
        self.audit: AuditLog | None = None
        self.bus = EventBus()
        self.resolver = Resolver(config.dns.upstream, config.dns.timeout, config.dns.ttl_min,
                                 config.dns.ttl_max)
        self.learner = _learner()
        self.dns = DnsFilter(self.store, self.resolver, self.bus, config.gateway, self.learner,
                             config.firewall.learn_ttl_min)
        self.proxy = Proxy(self.store, self.resolver, self.bus, config.proxy, config.gateway)
        self.listeners: dict[str, list[str]] = {}
        self._servers: list = []
        self._transports: list = []
        self._nflog: socket.socket | None = None
        self.event_loop = ""
        """Which loop runs the filter: "uvloop" or "asyncio"."""

    def audit_head(self) -> dict | None:
        return self.audit.head if self.audit else None

    def status(self) -> dict:
        return {
            "version": VERSION,
            "event_loop": self.event_loop,
            "uptime": round(time.time() - self.started, 3),
            "listeners": self.listeners,
            "sessions": len(self.store.sessions),
            "active_connections": self.proxy.active,
            "proxy": self.proxy.stats,
            "tunnels": dict(relay.STATS),
            "resolver": self.resolver.stats,
            "dns": {"wire_cache_hits": self.dns.wire.hits,
                    "wire_cache_entries": len(self.dns.wire.entries)},
            "audit": {"path": str(self.config.audit_path), "head": self.audit_head(),
                      "error": self.audit.failed if self.audit else None},
            "firewall": self._firewall_status(),
        }

    def _firewall_status(self) -> dict:
        if self.learner is None:
            return {"loaded": False, "error": "nftables is not available to the filter"}
        try:
            items = self.learner.list_table()
        except Exception as exc:  # status must answer whatever nftables says
            return {"loaded": False, "error": str(exc)}
        if items is None:
            return {"loaded": False, "error": "table inet corral is not loaded"}
        return {"loaded": True, "rules": sum(1 for i in items if "rule" in i)}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.event_loop = type(loop).__module__.split(".")[0]
        limit = self.config.proxy.max_header_bytes
        if self.config.firewall.manage:
            # the full ruleset for the sessions registered before a restart (or none),
            # replacing the boot one; if nftables refuses, the filter does not start and
            # what is loaded stays (closed)
            try:
                self.apply_firewall()
            except (NftError, ControlError) as exc:
                raise SystemExit(f"corral-filter: cannot load the ruleset: {exc}") from None
        try:
            for host, port in self.config.dns.listen:
                udp, tcp = _dns_sockets(host, port)
                self._transports.append(UdpServer(self.dns).attach(loop, udp))
                self._record("dns_udp", udp)
                server = await asyncio.start_server(
                    lambda r, w: serve_tcp(self.dns, r, w), sock=tcp, backlog=1024)
                self._servers.append(server)
                self._record("dns_tcp", tcp)
            for key, handler in (("proxy", self.proxy.serve_explicit),
                                 ("transparent_http", self.proxy.serve_transparent_http),
                                 ("transparent_tls", self.proxy.serve_transparent_tls)):
                addresses = {"proxy": self.config.proxy.listen,
                             "transparent_http": self.config.proxy.transparent_http,
                             "transparent_tls": self.config.proxy.transparent_tls}[key]
                for host, port in addresses:
                    sock = _socket(host, port, socket.SOCK_STREAM)
                    server = await asyncio.start_server(handler, sock=sock, limit=limit,
                                                        backlog=4096)
                    self._servers.append(server)
                    self._record(key, sock)
            self._start_drop_reader()
            self.audit = AuditLog(self.config.audit_path)
            self.bus.audit = self.audit
            control = await ControlServer(self).start(self.config.control_socket,
                                                      self.config.control_group)
            self._servers.append(control)
        except BaseException:
            await self.stop()
            raise

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
        target = f"{drop.destination}:{drop.port}" if drop.port else drop.destination
        self.bus.emit({
            "session": drop.session if drop.session in self.store.sessions else None,
            "client": drop.source, "kind": "firewall", "name": drop.destination,
            "port": drop.port, "address": drop.destination, "verdict": "deny",
            "reason": f"rejected by the firewall: {drop.protocol} to {target}",
            "rule": None, "layer": None, "protocol": drop.protocol,
            "hint": "use the proxy (HTTP_PROXY), or add a tcp rule for the name",
        })

    def _record(self, key: str, sock: socket.socket) -> None:
        host, port = sock.getsockname()[:2]
        self.listeners.setdefault(key, []).append(
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    def register_session(self, name, subnet, gateway, files):
        """A session registered at run time; with `[firewall] manage`, the ruleset follows,
        and if nftables refuses it the session is taken back out (fail closed)."""
        session, added = self.store.register(name, subnet, gateway, files)
        if added and self.config.firewall.manage:
            try:
                self.apply_firewall()
            except (NftError, ControlError) as exc:
                self.store.unregister(name)
                raise ControlError(f"session {name} not registered: the firewall could not "
                                   f"follow: {exc}") from None
        log.info("session %s %s: %s", name, "registered" if added else "unchanged",
                 session.subnet)
        return session, added

    def unregister_session(self, name: str, forget_rules: bool) -> None:
        self.store.unregister(name, forget_rules)
        if self.config.firewall.manage:
            self.apply_firewall()
        log.info("session %s unregistered%s", name, " (rules forgotten)" if forget_rules else "")

    def apply_firewall(self) -> None:
        """Load the ruleset for every session now known (one transaction). Raises on refusal."""
        if self.learner is None:
            raise ControlError("the filter manages the firewall but nftables is unavailable")
        self.learner.apply(ruleset.for_store(self.store, self.learner.learned_elements(),
                                             self.learner.counters()))

    def reload(self) -> None:
        try:
            self.store.reload()
        except ConfigError as exc:
            log.error("reload refused, policy unchanged: %s", exc)
            return
        log.info("policy reloaded: %d sessions", len(self.store.sessions))

    async def stop(self) -> None:
        if self._nflog is not None:
            asyncio.get_running_loop().remove_reader(self._nflog.fileno())
            self._nflog.close()
            self._nflog = None
        for server in self._servers:
            server.close()
        for transport in self._transports:
            transport.close()
        if self.audit is not None:
            self.audit.close()
            self.audit = None


async def run(config: FilterConfig) -> int:
    service = Service(config)
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
