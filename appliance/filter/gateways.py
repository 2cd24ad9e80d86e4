"""Where the filter listens: on each session's gateway, and nowhere wider.

A sandbox reaches the filter at its own gateway address only (the firewall accepts nothing
else from it, and redirects its TCP 80/443 to the transparent ports on the address of the
interface the packet came in on, which is that gateway). So a listener written
`gateway:PORT` is bound on every session's gateway: when the session comes (from the
config file at start, or `session-add` at run time) and closed when it goes. A wildcard
(0.0.0.0:53) would also take the port from the host's own resolvers (systemd-resolved's
stub on 127.0.0.53:53, NetworkManager's or libvirt's dnsmasq on their bridges): the config
refuses it. A listener written `IP:PORT` is bound once, at start (tests, an operator).

One gateway's listeners are bound all or none: a port that is taken refuses that session,
naming the address, port and protocol, and what holds it when /proc can tell.

`planned` is pure; `bind_all` and `holder` touch sockets and /proc.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from appliance.sessionconfig import GATEWAY, FilterConfig

IP_FREEBIND = getattr(socket, "IP_FREEBIND", 15)


@dataclass(frozen=True)
class Listener:
    key: str
    """What serves it, as `status` names it: dns_udp, dns_tcp, proxy, transparent_http,
    transparent_tls, sshgate."""
    port: int
    protocol: str = "tcp"
    """"udp" or "tcp"."""


def planned(config: FilterConfig, host: str = GATEWAY) -> tuple[Listener, ...]:
    """The listeners the config puts on `host`: GATEWAY (each session's gateway) or a fixed
    address. DNS is two, UDP and TCP on one port."""
    found: list[Listener] = []
    for h, port in config.dns.listen:
        if h == host:
            found += [Listener("dns_udp", port, "udp"), Listener("dns_tcp", port)]
    for key, addresses in (("proxy", config.proxy.listen),
                           ("transparent_http", config.proxy.transparent_http),
                           ("transparent_tls", config.proxy.transparent_tls),
                           ("sshgate", config.sshgate.listen)):
        found += [Listener(key, port) for h, port in addresses if h == host]
    return tuple(found)


def fixed_hosts(config: FilterConfig) -> list[str]:
    """The fixed addresses the config names for listeners, in the order written."""
    hosts = [h for h, _ in (*config.dns.listen, *config.proxy.listen,
                            *config.proxy.transparent_http, *config.proxy.transparent_tls,
                            *config.sshgate.listen)]
    return [h for h in dict.fromkeys(hosts) if h != GATEWAY]


class BindError(OSError):
    """A listener that cannot be bound; the message names address, port, protocol and,
    when /proc tells, what holds the port."""

    def __str__(self) -> str:
        return self.strerror  # the message alone, without "[Errno 98]"


def bind(host: str, port: int, protocol: str) -> socket.socket:
    """A bound socket (a listening one is made by the server that serves it).

    IP_FREEBIND: a session's gateway may not be on any interface yet when the session is
    added. podman (netavark) creates the bridge and gives it the gateway address only when
    the session's first container starts, and the sandbox service adds the session to the
    filter before that (sandbox/sessions.py `create`: network, then `session-add`, then
    `podman run`), so that the firewall is in place before the container has a network.
    With IP_FREEBIND the bind succeeds now and the socket receives once the address exists;
    a port conflict is still found at bind time."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    kind = socket.SOCK_DGRAM if protocol == "udp" else socket.SOCK_STREAM
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
        held = holder(host, port, protocol) if exc.errno == 98 else None  # EADDRINUSE
        message = f"cannot bind {host}:{port} ({protocol}): {exc.strerror}"
        raise BindError(exc.errno, message + (f" (held by {held})" if held else "")) from None
    sock.setblocking(False)
    return sock


def bind_all(host: str, listeners: tuple[Listener, ...]) -> list[tuple[Listener, socket.socket]]:
    """Every listener of `host` bound, or none (BindError for the first that fails)."""
    bound: list[tuple[Listener, socket.socket]] = []
    try:
        for listener in listeners:
            bound.append((listener, bind(host, listener.port, listener.protocol)))
    except BaseException:
        for _, sock in bound:
            sock.close()
        raise
    return bound


def holder(host: str, port: int, protocol: str) -> str | None:
    """Who holds `port` on `host` (or on the wildcard, which takes it everywhere), as
    "dnsmasq (pid 812) on 0.0.0.0:53"; None when /proc does not say (another user's
    process without root, a socket of another namespace)."""
    inodes: dict[str, str] = {}
    wanted = ipaddress.ip_address(host)
    for suffix in ("", "6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/net/{protocol}{suffix}").read_text().splitlines()[1:]:
                fields = line.split()
                address, _, hexport = fields[1].partition(":")
                if int(hexport, 16) != port:
                    continue
                local = _proc_address(address)
                if local == wanted or local.is_unspecified:
                    inodes[fields[9]] = f"{local}:{port}" if local.version == 4 \
                        else f"[{local}]:{port}"
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        name = Path(f"/proc/{pid}/comm").read_text().strip()
                        return f"{name} (pid {pid}) on {inodes[link[8:-1]]}"
    return f"a socket on {next(iter(inodes.values()))}"


def _proc_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/{tcp,udp}[6] writes it: 32-bit words of hex, each in the
    host's byte order."""
    words = bytes.fromhex(text)
    if sys.byteorder == "little":
        words = b"".join(words[i:i + 4][::-1] for i in range(0, len(words), 4))
    raw = words
    return ipaddress.ip_address(raw)
