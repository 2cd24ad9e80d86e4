"""Firewall rejects, reported over NFLOG (firewall/nflog.py), become events.

`DropReader` is the socket edge: it reads the group on the loop and emits what `drop_event`
makes of each report, a pure function of the drop and the sessions there are now.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Collection

from appliance.event import Event
from appliance.firewall import nflog
from appliance.policystore import PolicyStore

from .events import EventBus

log = logging.getLogger("corral.filter")


def drop_event(drop: nflog.Drop, sessions: Collection[str], gateways: Collection[str],
               services: frozenset[tuple[str, int]]) -> Event | None:
    """The event of a reject: None for link-local multicast (counted quietly by the
    ruleset: nothing was denied). `sessions`: their names now; `gateways`: their gateway
    addresses; `services`: what a session reaches on its gateway (ruleset.gateway_services),
    refused there only past its limits."""
    if nflog.link_local_multicast(drop):
        return None
    target = f"{drop.destination}:{drop.port}" if drop.port else drop.destination
    return Event(
        session=drop.session if drop.session in sessions else None,
        client=drop.source, kind="firewall", name=drop.destination,
        port=drop.port, address=drop.destination, verdict="deny",
        reason=f"rejected by the firewall: {drop.protocol} to {target}",
        rule=None, layer=None, protocol=drop.protocol,
        hint=nflog.hint(drop, drop.destination in gateways, services),
    )


class DropReader:
    def __init__(self, store: PolicyStore, bus: EventBus, group: int,
                 services: frozenset[tuple[str, int]]):
        self.store, self.bus, self.group, self.services = store, bus, group, services
        self._sock: socket.socket | None = None

    def event(self, drop: nflog.Drop) -> dict | None:
        """Emit the drop's event (if it is one), as the sessions are now; returns it as
        emitted."""
        event = drop_event(drop, self.store.sessions,
                           {str(s.gateway) for s in self.store.session_configs()},
                           self.services)
        return self.bus.emit(event) if event is not None else None

    def start(self) -> None:
        """Read the group on the running loop; without it (no CAP_NET_ADMIN, no module),
        a warning and no drop events: the firewall rejects all the same."""
        try:
            sock = nflog.open_group(self.group)
        except OSError as exc:
            log.warning("firewall drop events unavailable (NFLOG group %d): %s",
                        self.group, exc)
            return
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        sock = self._sock
        while sock is not None:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                return
            except OSError as exc:  # ENOBUFS: the kernel dropped reports; counters did not
                log.warning("firewall drop events: %s", exc)
                return
            for drop in nflog.parse(data):
                self.event(drop)

    def stop(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
