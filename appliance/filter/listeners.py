"""The filter's listening sockets: those on fixed addresses, bound once at start, and those
on each session's gateway, bound as the session comes and closed as it goes (what goes
where: gateways.py). What serves each is given as a table, key -> `serve(sock)`.

`names` is what `status` shows (key -> "host:port" list); `unserved` says which sessions
have no listeners, and why (a session registered before a restart whose port is taken now).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable

from appliance.event import Event
from appliance.policystore import PolicyStore
from appliance.sessionconfig import FilterConfig

from . import gateways
from .events import EventBus

log = logging.getLogger("corral.filter")
Serve = Callable[[socket.socket], Awaitable]
"""Serve a bound socket: the server or transport to close it with."""


class StartupBindError(gateways.BindError):
    """A listener of a session in the config file that cannot be bound: the filter does
    not start."""


def dns_sockets(host: str, port: int) -> tuple[socket.socket, socket.socket]:
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


def _name(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


IN_WORKERS = frozenset({"dns_udp", "dns_tcp", "proxy", "transparent_http", "transparent_tls"})
"""The listeners a worker serves (workers/); the git gateway stays in the coordinator, which
holds the keys its calls use."""


class _InWorker:
    """A gateway served by a worker: closing it closes it there and here."""

    def __init__(self, workers, address: str):
        self.workers, self.address = workers, address

    def close(self) -> None:
        self.workers.close(self.address)


class Listeners:
    def __init__(self, config: FilterConfig, store: PolicyStore, bus: EventBus,
                 serve: dict[str, Serve]):
        """`config`: where to listen; `store`: the sessions there are (one removed while its
        listeners were being bound gets none); `bus`: for a session left unserved."""
        self.config, self.store, self.bus, self.serve = config, store, bus, serve
        self.names: dict[str, list[str]] = {}
        self.unserved: dict[str, str] = {}
        """Session -> why its gateway has no listeners: in `status`, and the sandbox gets no
        answer."""
        self._fixed: list = []
        self._gateways: dict[str, list] = {}
        """Gateway address -> the servers and transports listening there."""
        self.workers = None
        """The worker processes (workers/coordinator.py), when `[filter] workers` > 1:
        each gateway's sockets are bound here and served by its session's worker."""

    async def _serve(self, key: str, sock: socket.socket):
        served = await self.serve[key](sock)
        self.names.setdefault(key, []).append(_name(sock))
        return served

    async def serve_fixed(self) -> None:
        """The listeners the config puts on fixed addresses (IP:PORT): bound at start."""
        for host in gateways.fixed_hosts(self.config):
            for listener in gateways.planned(self.config, host):
                if listener.key == "dns_tcp":
                    continue  # bound with its UDP twin, on the same port
                if listener.key == "dns_udp":
                    udp, tcp = dns_sockets(host, listener.port)
                    self._fixed.append(await self._serve("dns_udp", udp))
                    self._fixed.append(await self._serve("dns_tcp", tcp))
                    continue
                if listener.key not in self.serve:
                    continue  # the git gateway, where it is off
                sock = gateways.bind(host, listener.port, listener.protocol)
                self._fixed.append(await self._serve(listener.key, sock))

    def bind_gateway(self, session) -> list:
        """The session's gateway listeners, bound (none when the config has none, or when
        its gateway is served already); gateways.BindError names the port that is taken."""
        address = str(session.gateway)
        if address in self._gateways:
            return []
        return gateways.bind_all(address, gateways.planned(self.config))

    async def serve_gateway(self, session, bound: list) -> None:
        """Serve what `bind_gateway` bound, unless the session went meanwhile (a removal
        that came between its registration and this)."""
        address = str(session.gateway)
        if not bound or address in self._gateways or session not in \
                self.store.session_configs():
            for _, sock in bound:
                sock.close()
            return
        served = self._gateways[address] = []
        if self.workers is not None:  # DNS and the proxy there; the git gateway here
            theirs = [(listener, sock) for listener, sock in bound
                      if listener.key in IN_WORKERS]
            bound = [(listener, sock) for listener, sock in bound
                     if listener.key not in IN_WORKERS]
            served.append(_InWorker(self.workers, address))
            await self.workers.serve(session.name, address, theirs)
            for listener, sock in theirs:
                self.names.setdefault(listener.key, []).append(_name(sock))
        for listener, sock in bound:
            served.append(await self._serve(listener.key, sock))
        self.unserved.pop(session.name, None)
        log.info("session %s: listening on %s", session.name, ", ".join(
            f"{address}:{p}" for p in sorted({int(n.rsplit(":", 1)[1])
                                              for names in self.names.values() for n in names
                                              if n.rpartition(":")[0] == address})))

    async def open_gateway(self, session) -> None:
        """At start: a session of the config file whose gateway cannot be had stops the
        filter (the config is the operator's to fix, as a fixed listener's address); one
        registered at run time before a restart is left unserved, said in the log, an event
        and `status`, and every other session served."""
        try:
            bound = self.bind_gateway(session)
        except gateways.BindError as exc:
            if session in self.config.sessions:
                raise StartupBindError(exc.errno, f"session {session.name}: {exc}") from None
            self._unserved(session.name, str(exc))
            return
        await self.serve_gateway(session, bound)

    def _unserved(self, session: str, why: str) -> None:
        self.unserved[session] = why
        log.error("session %s is not served: %s", session, why)
        self.bus.emit(Event(session=session, client=None, kind="session", name=session,
                            port=None, address=None, verdict="error", rule=None,
                            layer=None, reason=f"session {session} is not served: {why}"))

    def close_gateways(self, kept: set[str]) -> None:
        """The listeners of every gateway but those `kept` go (their sessions are gone;
        open connections are the proxy's to judge, as on every change)."""
        for address in [a for a in self._gateways if a not in kept]:
            for served in self._gateways.pop(address, []):
                served.close()
            for key in list(self.names):
                left = [n for n in self.names[key] if n.rpartition(":")[0] != address]
                if left:
                    self.names[key] = left
                else:
                    del self.names[key]

    async def closed(self) -> None:
        """The gateways `close_gateways` closed are closed in the workers too."""
        if self.workers is not None:
            await self.workers.closed()

    def close(self) -> None:
        for served in self._fixed:
            served.close()
        self._fixed = []
        self.close_gateways(set())

    def port(self, key: str) -> int:
        """The port `key` listens on: the configured one, or the one bound (a fixed
        listener on port 0)."""
        for listener in gateways.planned(self.config):
            if listener.key == key:
                return listener.port
        return int(self.names[key][0].rsplit(":", 1)[1])
