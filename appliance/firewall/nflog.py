"""Reading the firewall's NFLOG group over netlink: every reported reject becomes a Drop.

The ruleset logs rejects (rate-limited) to one NFLOG group with the prefix
"corral <session> "; this module binds that group on a NETLINK_NETFILTER socket (needs
CAP_NET_ADMIN, in the network namespace of the firewall), and parses the packet headers it
receives. Standard library only: the message formats are in linux/netfilter/nfnetlink_log.h.
`hint` says what a person can do about a Drop, as the ruleset treats its protocol: the
filter puts it in the drop's event.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Collection
from dataclasses import dataclass

NETLINK_NETFILTER = 12
NFNL_SUBSYS_ULOG = 4
NFULNL_MSG_PACKET = 0
NFULNL_MSG_CONFIG = 1
NFULA_CFG_CMD = 1
NFULA_CFG_MODE = 2
NFULA_CFG_QTHRESH = 5
NFULA_PAYLOAD = 9
NFULA_PREFIX = 10
NFULNL_CFG_CMD_BIND = 1
NFULNL_COPY_PACKET = 2
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2
COPY_RANGE = 96  # enough for IPv6 + TCP/UDP headers

PROTOCOLS = {1: "icmp", 6: "tcp", 17: "udp", 58: "icmpv6"}
LINK_LOCAL_MULTICAST = (ipaddress.ip_network("224.0.0.0/24"),
                        ipaddress.ip_network("ff02::/16"))
"""Multicast that no router forwards (RFC 5771's local network control block, RFC 4291's
link-local scope): LLMNR (224.0.0.252, ff02::1:3), mDNS (224.0.0.251, ff02::fb), IGMP and
MLD reports (224.0.0.22, ff02::16). The ruleset drops it from sandbox links quietly."""
DNS_PORTS = (53, 853)


@dataclass(frozen=True, slots=True)
class Drop:
    session: str
    protocol: str
    source: str
    destination: str
    port: int | None


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _config_message(group: int, attrs: bytes, seq: int) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(group)) + attrs
    kind = (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG
    return struct.pack("=IHHII", 16 + len(body), kind, NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


def open_group(group: int) -> socket.socket:
    """A non-blocking netlink socket bound to NFLOG `group`. Raises OSError."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.bind((0, 0))
        bind = _attr(NFULA_CFG_CMD, struct.pack("=B", NFULNL_CFG_CMD_BIND))
        mode = _attr(NFULA_CFG_MODE, struct.pack(">IBB", COPY_RANGE, NFULNL_COPY_PACKET, 0))
        # Deliver each report at once; the default batches them for up to a second.
        threshold = _attr(NFULA_CFG_QTHRESH, struct.pack(">I", 1))
        for seq, attrs in ((1, bind), (2, mode + threshold)):
            sock.send(_config_message(group, attrs, seq))
            _expect_ack(sock.recv(65536))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _expect_ack(data: bytes) -> None:
    _, kind, _, _, _ = struct.unpack_from("=IHHII", data)
    if kind == NLMSG_ERROR:
        (error,) = struct.unpack_from("=i", data, 16)
        if error != 0:
            raise OSError(-error, f"NFLOG bind refused: {socket.errno.errorcode.get(-error)}")


def parse(data: bytes) -> list[Drop]:
    """All packet messages in one netlink datagram; anything malformed is skipped."""
    drops = []
    offset = 0
    while offset + 16 <= len(data):
        length, kind, _, _, _ = struct.unpack_from("=IHHII", data, offset)
        if length < 16 or offset + length > len(data):
            break
        if kind == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET:
            drop = _packet(data[offset + 20 : offset + length])
            if drop is not None:
                drops.append(drop)
        offset += (length + 3) & ~3
    return drops


def _packet(attrs: bytes) -> Drop | None:
    prefix, payload = None, None
    pos = 0
    while pos + 4 <= len(attrs):
        length, kind = struct.unpack_from("=HH", attrs, pos)
        if length < 4:
            break
        value = attrs[pos + 4 : pos + length]
        kind &= 0x7FFF
        if kind == NFULA_PREFIX:
            prefix = value.split(b"\0", 1)[0].decode("ascii", "replace")
        elif kind == NFULA_PAYLOAD:
            payload = value
        pos += (length + 3) & ~3
    if not prefix or not prefix.startswith("corral ") or payload is None:
        return None
    session = prefix.split()[1] if len(prefix.split()) > 1 else "?"
    return _headers(session, payload)


def _headers(session: str, packet: bytes) -> Drop | None:
    if not packet:
        return None
    version = packet[0] >> 4
    if version == 4 and len(packet) >= 20:
        header = (packet[0] & 0x0F) * 4
        protocol = packet[9]
        source = str(ipaddress.IPv4Address(packet[12:16]))
        destination = str(ipaddress.IPv4Address(packet[16:20]))
    elif version == 6 and len(packet) >= 40:
        header, protocol = 40, packet[6]
        source = str(ipaddress.IPv6Address(packet[8:24]))
        destination = str(ipaddress.IPv6Address(packet[24:40]))
    else:
        return None
    port = None
    if protocol in (6, 17) and len(packet) >= header + 4:
        (port,) = struct.unpack_from(">H", packet, header + 2)
    return Drop(session, PROTOCOLS.get(protocol, str(protocol)), source, destination, port)


def link_local_multicast(drop: Drop) -> bool:
    """A drop the ruleset counts quietly (a report of one comes only from a ruleset older
    than that): no router forwards it, so nothing was denied."""
    try:
        address = ipaddress.ip_address(drop.destination)
    except ValueError:
        return False
    return any(address in network for network in LINK_LOCAL_MULTICAST
               if network.version == address.version)


def hint(drop: Drop, appliance: bool = False,
         listening: Collection[tuple[str, int]] = ()) -> str:
    """What a person can do about the drop, by what the ruleset forwards for its protocol.
    `appliance`: its destination is the appliance itself (a session's gateway), whose
    `listening` (protocol, port) the ruleset refuses only past the session's limits."""
    if ":" in drop.destination:
        return ("IPv6 is not forwarded, nor answered by the appliance: sessions reach names "
                "over IPv4, through the filter")
    if appliance and (drop.protocol, drop.port) in listening:
        return ("past the session's limits on the appliance's own listeners (DNS packets a "
                "second, new and open connections): the firewall refuses the excess before it "
                "fills the queues every session shares ([firewall] dns_packets and "
                "new_connections, the proxy's connection caps)")
    if drop.port in DNS_PORTS and drop.protocol in ("udp", "tcp"):
        return ("DNS is answered by the session's resolver (its gateway, port 53) alone: a "
                "resolver anywhere else is never reached, and a name the policy allows "
                "resolves there")
    if drop.protocol == "udp" and drop.port == 443:
        return ("QUIC (HTTP/3) is not forwarded: a client falls back to TCP 443, which the "
                "proxy judges by name")
    if drop.protocol == "udp":
        return ("UDP is not forwarded (only DNS to the session's gateway is answered): no "
                "rule opens it")
    if drop.protocol in ("icmp", "icmpv6"):
        return "ICMP is not forwarded (ping, traceroute): no rule opens it"
    if drop.protocol != "tcp":
        return f"only TCP is forwarded, by a tcp rule; protocol {drop.protocol} never is"
    if appliance:
        return ("the appliance answers a session on DNS, the proxy and the git gateway only; "
                "a port of the VM host is reached as host.corral when [host] ports lists it")
    return ("HTTP and HTTPS go through the proxy (HTTP_PROXY; ports 80 and 443 are "
            f"redirected to it); other TCP needs a tcp rule for the name: corral allow-tcp "
            f"NAME:{drop.port} (the firewall learns the name's addresses from DNS)")
