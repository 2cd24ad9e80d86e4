"""Ending forwarded TCP flows: deleting their entries from the kernel's connection tracking
table, over ctnetlink (a NETLINK_NETFILTER socket; needs CAP_NET_ADMIN, in the network
namespace of the firewall). Standard library only, like nflog.py: the message formats are in
linux/netfilter/nfnetlink_conntrack.h.

Why this cuts a flow: the forward chain accepts `ct state established,related` before it
looks at the learned set, so deleting a learned element stops only new connections. Once the
flow's conntrack entry is gone too, the next packet of the flow, in either direction, has no
entry: conntrack starts a new one (ct state new; with nf_conntrack_tcp_loose=0 it is
invalid instead) and the forward chain judges it afresh. From the sandbox it no longer
matches the learned set and meets the session's reject (a TCP reset, which the sandbox's
socket accepts: it carries the sequence number the packet acknowledged); from outside, it
is routed in to a sandbox without being established and meets the reject of everything
routed in. tests/e2e/test_tcp_revoke.py checks both ends on real flows.

One dump per sandbox address finds every entry to end, whatever the number of flows asked
for: the kernel itself keeps to that source's TCP entries (CTA_FILTER, Linux 5.8 on; an
older kernel sends the whole table and the same matching is done here), so the cost grows
with that sandbox's flows, not with the table. Each is then deleted by its own original
tuple, id and zone, as the dump gave them (an entry of the same tuple made since is not
touched). Left alone: a flow whose replies do not come from its destination (redirected to
the transparent proxy's 80/443: the proxy judges those, not the learned set), and a flow
that is over already (TIME_WAIT, CLOSE: a new SYN on its tuple is judged as a new flow).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

NETLINK_NETFILTER = 12
NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_NEW = 0
IPCTNL_MSG_CT_GET = 1
IPCTNL_MSG_CT_DELETE = 2
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_ACK, NLM_F_DUMP_INTR = 1, 2, 4, 0x10
NLM_F_DUMP = 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY, CTA_PROTOINFO, CTA_ID, CTA_ZONE, CTA_FILTER = (
    1, 2, 4, 12, 18, 25)
CTA_PROTOINFO_TCP, CTA_PROTOINFO_TCP_STATE = 1, 1
TCP_CONNTRACK_TIME_WAIT, TCP_CONNTRACK_CLOSE = 7, 8
CTA_FILTER_ORIG_FLAGS = 1
CTA_FILTER_F_IP_SRC, CTA_FILTER_F_PROTO_NUM = 1 << 0, 1 << 3
NLA_F_NESTED = 0x8000
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_IP_V4_SRC, CTA_IP_V4_DST = 1, 2
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
NLA_TYPE_MASK = 0x3FFF
IPPROTO_TCP = 6
TIMEOUT = 5.0
"""Seconds to wait for the kernel's answer to one message before giving up (OSError)."""
DUMP_ATTEMPTS = 3
"""An interrupted dump (the table changed under it) may miss entries: it is read again."""
DELETE_ROUNDS = 3
"""Dumps, each followed by its deletes, that `end` makes at most (the last finds nothing)."""

Flow = tuple[str, str, int]
"""(sandbox address, destination address, destination port): a learned element's key."""


class ConntrackError(OSError):
    """The kernel refused or broke off; the message says which request and why."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One IPv4 TCP conntrack entry, as a dump shows it."""

    source: str
    destination: str
    port: int
    """The original direction's destination port."""
    reply_source: str | None
    """Where the replies come from: the destination, unless the flow was redirected."""
    state: int | None
    """conntrack's TCP state (TCP_CONNTRACK_*), None when the dump did not say."""
    names: bytes
    """The attributes that name it in a delete: CTA_TUPLE_ORIG, CTA_ID and CTA_ZONE, as the
    dump gave them."""

    @property
    def flow(self) -> Flow:
        return (self.source, self.destination, self.port)

    @property
    def forwarded(self) -> bool:
        return self.reply_source == self.destination

    @property
    def over(self) -> bool:
        """Closed already (TIME_WAIT, CLOSE): nothing flows, a new SYN is judged anew."""
        return self.state in (TCP_CONNTRACK_TIME_WAIT, TCP_CONNTRACK_CLOSE)


def _header(kind: int, flags: int, seq: int, body: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | kind,
                       flags, seq, 0) + body


def _nfgen() -> bytes:
    """nfgenmsg: family AF_INET (the dump holds IPv4 entries only), version 0, res_id 0."""
    return struct.pack("=BBH", socket.AF_INET, 0, 0)


def _attr(kind: int, value: bytes, nested: bool = False) -> bytes:
    length = 4 + len(value)
    return struct.pack("=HH", length, kind | (NLA_F_NESTED if nested else 0)) + value + (
        b"\0" * (-length % 4))


def dump_request(seq: int, source: str | None = None) -> bytes:
    """A dump of the IPv4 table; with `source`, of the TCP entries from that address only
    (a kernel before 5.8 ignores the filter and sends everything)."""
    attrs = b""
    if source is not None:
        ip = _attr(CTA_IP_V4_SRC, ipaddress.IPv4Address(source).packed)
        proto = _attr(CTA_PROTO_NUM, bytes([IPPROTO_TCP]))
        attrs = _attr(CTA_TUPLE_ORIG, _attr(CTA_TUPLE_IP, ip, True)
                      + _attr(CTA_TUPLE_PROTO, proto, True), True)
        attrs += _attr(CTA_FILTER, _attr(CTA_FILTER_ORIG_FLAGS, struct.pack(
            "=I", CTA_FILTER_F_IP_SRC | CTA_FILTER_F_PROTO_NUM)), True)
    return _header(IPCTNL_MSG_CT_GET, NLM_F_REQUEST | NLM_F_DUMP, seq, _nfgen() + attrs)


def delete_request(entry: Entry, seq: int) -> bytes:
    return _header(IPCTNL_MSG_CT_DELETE, NLM_F_REQUEST | NLM_F_ACK, seq,
                   _nfgen() + entry.names)


def _attrs(data: bytes) -> Iterator[tuple[int, bytes, bytes]]:
    """(type, value, the whole attribute with its padding) for each attribute in `data`."""
    pos = 0
    while pos + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, pos)
        if length < 4 or pos + length > len(data):
            return
        padded = (length + 3) & ~3
        yield kind & NLA_TYPE_MASK, data[pos + 4 : pos + length], data[pos : pos + padded]
        pos += padded


def _tuple(data: bytes) -> tuple[str | None, str | None, int | None, int | None]:
    """(source, destination, protocol, destination port) of a CTA_TUPLE_* attribute."""
    source = destination = protocol = port = None
    for kind, value, _ in _attrs(data):
        if kind == CTA_TUPLE_IP:
            for ip_kind, address, _ in _attrs(value):
                if ip_kind in (CTA_IP_V4_SRC, CTA_IP_V4_DST) and len(address) == 4:
                    text = str(ipaddress.IPv4Address(address))
                    if ip_kind == CTA_IP_V4_SRC:
                        source = text
                    else:
                        destination = text
        elif kind == CTA_TUPLE_PROTO:
            for proto_kind, field, _ in _attrs(value):
                if proto_kind == CTA_PROTO_NUM and len(field) == 1:
                    protocol = field[0]
                elif proto_kind == CTA_PROTO_DST_PORT and len(field) == 2:
                    (port,) = struct.unpack(">H", field)
    return source, destination, protocol, port


def _entry(attributes: bytes) -> Entry | None:
    """The TCP/IPv4 entry a CT_NEW message of a dump describes; None for anything else."""
    original = reply = state = None
    names = b""
    for kind, value, whole in _attrs(attributes):
        if kind == CTA_TUPLE_ORIG:
            original = _tuple(value)
            names += whole
        elif kind == CTA_TUPLE_REPLY:
            reply = _tuple(value)
        elif kind == CTA_PROTOINFO:
            state = _tcp_state(value)
        elif kind in (CTA_ID, CTA_ZONE):
            names += whole
    if original is None:
        return None
    source, destination, protocol, port = original
    if protocol != IPPROTO_TCP or source is None or destination is None or port is None:
        return None
    return Entry(source, destination, port, reply[0] if reply else None, state, names)


def _tcp_state(protoinfo: bytes) -> int | None:
    for kind, value, _ in _attrs(protoinfo):
        if kind == CTA_PROTOINFO_TCP:
            for field_kind, field, _ in _attrs(value):
                if field_kind == CTA_PROTOINFO_TCP_STATE and len(field) == 1:
                    return field[0]
    return None


@dataclass(slots=True)
class Page:
    """What one datagram of a dump held."""

    entries: list[Entry]
    done: bool = False
    interrupted: bool = False
    error: int = 0
    """A negative errno from an NLMSG_ERROR, 0 for none."""


def parse(data: bytes) -> Page:
    """Every message of one netlink datagram of a conntrack dump; malformed ones skipped."""
    page = Page([])
    offset = 0
    while offset + 16 <= len(data):
        length, kind, flags, _, _ = struct.unpack_from("=IHHII", data, offset)
        if length < 16 or offset + length > len(data):
            break
        if flags & NLM_F_DUMP_INTR:
            page.interrupted = True
        if kind == NLMSG_DONE:
            page.done = True
        elif kind == NLMSG_ERROR and length >= 20:
            (page.error,) = struct.unpack_from("=i", data, offset + 16)
            page.done = page.done or page.error != 0
        elif kind == (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW:
            entry = _entry(data[offset + 20 : offset + length])
            if entry is not None:
                page.entries.append(entry)
        offset += (length + 3) & ~3
    return page


def choose(entries: Iterable[Entry], flows: set[Flow]) -> list[Entry]:
    """The entries to delete: forwarded flows, not over yet, whose (source, destination,
    port) is asked for."""
    return [e for e in entries if e.flow in flows and e.forwarded and not e.over]


class Conntrack:
    """The kernel's table, over one netlink socket per call (the calls are rare: a policy
    change that takes learned allowances away)."""

    def __init__(self, timeout: float = TIMEOUT):
        self.timeout = timeout

    def _socket(self) -> socket.socket:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            sock.bind((0, 0))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            sock.settimeout(self.timeout)
        except OSError:
            sock.close()
            raise
        return sock

    def entries(self, sock: socket.socket, source: str | None = None) -> list[Entry]:
        """The IPv4 TCP entries (from `source`); read again when the kernel says the dump
        was interrupted."""
        for attempt in range(1, DUMP_ATTEMPTS + 1):
            sock.send(dump_request(attempt, source))
            entries: list[Entry] = []
            interrupted = False
            while True:
                page = parse(sock.recv(1 << 18))
                if page.error:
                    raise ConntrackError(-page.error, "conntrack dump refused: "
                                         f"{errno.errorcode.get(-page.error, page.error)}")
                entries += page.entries
                interrupted = interrupted or page.interrupted
                if page.done:
                    break
            if not interrupted:
                return entries
        raise ConntrackError(errno.EINTR, f"conntrack dump interrupted {DUMP_ATTEMPTS} times")

    def end(self, flows: Iterable[Flow]) -> dict[Flow, int]:
        """Delete the entries of these flows; how many were ended, per flow. Raises OSError
        (ConntrackError) when the table cannot be read or an entry cannot be deleted."""
        wanted = set(flows)
        ended: dict[Flow, int] = dict.fromkeys(wanted, 0)
        if not wanted:
            return ended
        seq = 100
        with self._socket() as sock:
            # A dump that spans several pages may miss an entry when others come and go
            # meanwhile (the kernel resumes a dump where it stopped, without saying it was
            # interrupted): read again until a dump finds nothing left to end.
            for _ in range(DELETE_ROUNDS):
                found = [entry for source in sorted({flow[0] for flow in wanted})
                         for entry in choose(self.entries(sock, source), wanted)]
                if not found:
                    break
                for entry in found:
                    seq += 1
                    sock.send(delete_request(entry, seq))
                    page = parse(sock.recv(65536))
                    if page.error == -errno.ENOENT:  # it ended by itself meanwhile
                        continue
                    if page.error:
                        raise ConntrackError(
                            -page.error, f"conntrack refused to delete {entry.source} -> "
                            f"{entry.destination}:{entry.port}: "
                            f"{errno.errorcode.get(-page.error, page.error)}")
                    ended[entry.flow] += 1
        return ended
