"""ctnetlink messages, built and read without a socket: what a dump of the kernel's table
looks like (linux/netfilter/nfnetlink_conntrack.h), which entries a cut ends, and the
delete that names exactly the entry the dump showed. The kernel itself is in
tests/e2e/test_tcp_revoke.py."""

from __future__ import annotations

import ipaddress
import socket
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.firewall import conntrack
from appliance.firewall.conntrack import Entry, choose, delete_request, dump_request, parse

NESTED = 0x8000


def attr(kind: int, value: bytes, nested: bool = False) -> bytes:
    length = 4 + len(value)
    return struct.pack("=HH", length, kind | (NESTED if nested else 0)) + value + (
        b"\0" * (-length % 4))


def tuple_attr(kind: int, src: str, dst: str, proto: int, sport: int, dport: int) -> bytes:
    ip = attr(conntrack.CTA_IP_V4_SRC, ipaddress.IPv4Address(src).packed) + attr(
        conntrack.CTA_IP_V4_DST, ipaddress.IPv4Address(dst).packed)
    l4 = (attr(conntrack.CTA_PROTO_NUM, bytes([proto]))
          + attr(conntrack.CTA_PROTO_SRC_PORT, struct.pack(">H", sport))
          + attr(conntrack.CTA_PROTO_DST_PORT, struct.pack(">H", dport)))
    return attr(kind, attr(conntrack.CTA_TUPLE_IP, ip, True)
                + attr(conntrack.CTA_TUPLE_PROTO, l4, True), True)


def ct_message(src, dst, dport, sport=40000, proto=6, reply_src=None, ct_id=7,
               flags=conntrack.NLM_F_MULTI, state=3) -> bytes:
    """One entry as a dump shows it (state 3: ESTABLISHED)."""
    protoinfo = attr(conntrack.CTA_PROTOINFO, attr(conntrack.CTA_PROTOINFO_TCP, attr(
        conntrack.CTA_PROTOINFO_TCP_STATE, bytes([state])), True), True)
    body = (struct.pack("=BBH", socket.AF_INET, 0, 0)
            + tuple_attr(conntrack.CTA_TUPLE_ORIG, src, dst, proto, sport, dport)
            + tuple_attr(conntrack.CTA_TUPLE_REPLY, reply_src or dst, src, proto, dport, sport)
            + protoinfo + attr(3, struct.pack(">I", 0x18e))  # CTA_STATUS
            + attr(conntrack.CTA_ID, struct.pack(">I", ct_id)))
    kind = (conntrack.NFNL_SUBSYS_CTNETLINK << 8) | conntrack.IPCTNL_MSG_CT_NEW
    return struct.pack("=IHHII", 16 + len(body), kind, flags, 1, 0) + body


def done(flags: int = conntrack.NLM_F_MULTI) -> bytes:
    return struct.pack("=IHHIIi", 20, conntrack.NLMSG_DONE, flags, 1, 0, 0)


def error(code: int) -> bytes:
    return struct.pack("=IHHIIi", 36, conntrack.NLMSG_ERROR, 0, 1, 0, code) + b"\0" * 16


S1, SSH = "10.213.1.2", "203.0.113.22"


def test_a_dump_page_yields_its_tcp_entries_and_says_when_the_dump_is_done():
    page = parse(ct_message(S1, SSH, 22) + ct_message(S1, SSH, 53, proto=17) + done())
    assert page.done and not page.interrupted and page.error == 0
    (entry,) = page.entries  # the UDP one is no learned element's
    assert entry.flow == (S1, SSH, 22) and entry.forwarded


def test_a_redirected_flow_is_not_the_learned_sets_to_cut():
    """TCP 443 redirected to the transparent proxy: its replies come from the appliance.
    The proxy judges those; a cut of the learned element (sandbox, address, 443) must not
    end them."""
    forwarded = parse(ct_message(S1, SSH, 443, sport=1)).entries[0]
    redirected = parse(ct_message(S1, SSH, 443, sport=2, reply_src="10.213.1.1")).entries[0]
    other = parse(ct_message(S1, SSH, 22, sport=3)).entries[0]
    assert choose([forwarded, redirected, other], {(S1, SSH, 443)}) == [forwarded]


def test_a_flow_that_is_over_already_is_left_to_conntrack():
    """TIME_WAIT and CLOSE: nothing flows there, and a new SYN on the tuple is judged as a
    new connection; ending them would only inflate the count of connections cut."""
    live = parse(ct_message(S1, SSH, 22, sport=1)).entries[0]
    waiting = parse(ct_message(S1, SSH, 22, sport=2,
                               state=conntrack.TCP_CONNTRACK_TIME_WAIT)).entries[0]
    closed = parse(ct_message(S1, SSH, 22, sport=3, state=conntrack.TCP_CONNTRACK_CLOSE)
                   ).entries[0]
    assert live.state == 3 and choose([live, waiting, closed], {(S1, SSH, 22)}) == [live]


def test_the_delete_names_the_entry_by_the_tuple_id_and_zone_the_dump_gave():
    entry = parse(ct_message(S1, SSH, 22, ct_id=0xABCDEF01)).entries[0]
    message = delete_request(entry, seq=9)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", message)
    assert length == len(message) and seq == 9
    assert kind == (conntrack.NFNL_SUBSYS_CTNETLINK << 8) | conntrack.IPCTNL_MSG_CT_DELETE
    assert flags == conntrack.NLM_F_REQUEST | conntrack.NLM_F_ACK
    assert message[16:20] == struct.pack("=BBH", socket.AF_INET, 0, 0)
    kinds = [k for k, _, _ in conntrack._attrs(message[20:])]
    assert kinds == [conntrack.CTA_TUPLE_ORIG, conntrack.CTA_ID]  # not the reply, not status
    assert struct.pack(">I", 0xABCDEF01) in message
    assert conntrack._tuple(next(v for k, v, _ in conntrack._attrs(message[20:])
                                 if k == conntrack.CTA_TUPLE_ORIG)) == (S1, SSH, 6, 22)


def test_a_dump_request_asks_for_ipv4_entries_only():
    message = dump_request(3)
    _, kind, flags, seq, _ = struct.unpack_from("=IHHII", message)
    assert kind == (conntrack.NFNL_SUBSYS_CTNETLINK << 8) | conntrack.IPCTNL_MSG_CT_GET
    assert flags & conntrack.NLM_F_DUMP == conntrack.NLM_F_DUMP and seq == 3
    assert message[16] == socket.AF_INET and len(message) == 20


def test_a_dump_for_one_sandbox_asks_the_kernel_for_its_tcp_entries_only():
    """CTA_FILTER: the source address and the protocol of the original tuple are compared,
    nothing else (destination and port are matched here, for every flow asked at once)."""
    attrs = dict((k, v) for k, v, _ in conntrack._attrs(dump_request(1, S1)[20:]))
    assert conntrack._tuple(attrs[conntrack.CTA_TUPLE_ORIG]) == (S1, None, 6, None)
    (flags,) = [struct.unpack("=I", v)[0] for k, v, _ in conntrack._attrs(
        attrs[conntrack.CTA_FILTER]) if k == conntrack.CTA_FILTER_ORIG_FLAGS]
    assert flags == conntrack.CTA_FILTER_F_IP_SRC | conntrack.CTA_FILTER_F_PROTO_NUM


def test_an_interrupted_dump_and_a_refusal_are_reported():
    assert parse(ct_message(S1, SSH, 22) + done(conntrack.NLM_F_MULTI
                                                | conntrack.NLM_F_DUMP_INTR)).interrupted
    refused = parse(error(-1))
    assert refused.error == -1 and refused.done
    assert parse(error(0)).error == 0  # an acknowledgement


class Kernel:
    """The netlink socket as ctnetlink answers it, for Conntrack's own logic: a dump page by
    page (interrupted once if asked), then an acknowledgement or an error per delete."""

    def __init__(self, pages: list[bytes], deletes: list[int], interrupt_first: bool = False,
                 later: list[list[bytes]] = ()):
        """`later`: the pages of each whole dump after the first, in turn; after those,
        none (what the dumps showed was deleted)."""
        self.pages, self.deletes = pages, list(deletes)
        self.later = list(later)
        self.interrupt = interrupt_first
        self.sent: list[bytes] = []
        self.queue: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)
        kind = struct.unpack_from("=H", data, 4)[0] & 0xFF
        if kind == conntrack.IPCTNL_MSG_CT_GET:
            flags = conntrack.NLM_F_MULTI | (conntrack.NLM_F_DUMP_INTR if self.interrupt else 0)
            pages = self.pages
            if not self.interrupt:  # a whole dump: the next one shows what is left
                self.pages = self.later.pop(0) if self.later else [b""]
            self.interrupt = False
            self.queue = [*pages[:-1], pages[-1] + done(flags)]
        else:
            self.queue = [error(self.deletes.pop(0))]

    def recv(self, size: int) -> bytes:
        return self.queue.pop(0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_ending_flows_reads_the_table_once_per_sandbox_and_deletes_only_what_was_asked(
        monkeypatch):
    """A kernel that ignores the filter (before 5.8) sends everything: the same matching."""
    pages = [ct_message(S1, SSH, 22, sport=1) + ct_message(S1, SSH, 22, sport=2),
             ct_message(S1, SSH, 5432, sport=3) + ct_message("10.213.2.2", SSH, 22, sport=4)]
    kernel = Kernel(pages, deletes=[0, -2])  # the second ended by itself meanwhile: ENOENT
    monkeypatch.setattr(conntrack.Conntrack, "_socket", lambda self: kernel)
    ended = conntrack.Conntrack().end([(S1, SSH, 22), (S1, "192.0.2.9", 22)])
    assert ended == {(S1, SSH, 22): 1, (S1, "192.0.2.9", 22): 0}
    kinds = [struct.unpack_from("=H", m, 4)[0] & 0xFF for m in kernel.sent]
    assert kinds == [conntrack.IPCTNL_MSG_CT_GET, conntrack.IPCTNL_MSG_CT_DELETE,
                     conntrack.IPCTNL_MSG_CT_DELETE, conntrack.IPCTNL_MSG_CT_GET]
    assert kernel.sent[0] == dump_request(1, S1)  # and a last one finds nothing left


def test_an_entry_a_dump_missed_is_found_by_the_next_one(monkeypatch):
    """A dump of several pages can skip an entry when others come and go meanwhile, and the
    kernel does not say so (seen in the e2e tier after a busy run): dump until none is left."""
    kernel = Kernel([ct_message(S1, SSH, 22, sport=1)], deletes=[0, 0],
                    later=[[ct_message(S1, SSH, 22, sport=2)]])
    monkeypatch.setattr(conntrack.Conntrack, "_socket", lambda self: kernel)
    assert conntrack.Conntrack().end([(S1, SSH, 22)]) == {(S1, SSH, 22): 2}


def test_the_dumps_are_bounded_whatever_the_kernel_keeps_showing(monkeypatch):
    kernel = Kernel([ct_message(S1, SSH, 22)], deletes=[0] * conntrack.DELETE_ROUNDS,
                    later=[[ct_message(S1, SSH, 22)]] * 5)  # an entry that never goes
    monkeypatch.setattr(conntrack.Conntrack, "_socket", lambda self: kernel)
    assert conntrack.Conntrack().end([(S1, SSH, 22)]) == {(S1, SSH, 22): 3}
    assert sum(1 for m in kernel.sent if struct.unpack_from("=H", m, 4)[0] & 0xFF
               == conntrack.IPCTNL_MSG_CT_GET) == conntrack.DELETE_ROUNDS


def test_an_interrupted_dump_is_read_again(monkeypatch):
    kernel = Kernel([ct_message(S1, SSH, 22)], deletes=[0], interrupt_first=True)
    monkeypatch.setattr(conntrack.Conntrack, "_socket", lambda self: kernel)
    assert conntrack.Conntrack().end([(S1, SSH, 22)]) == {(S1, SSH, 22): 1}
    assert sum(1 for m in kernel.sent if struct.unpack_from("=H", m, 4)[0] & 0xFF
               == conntrack.IPCTNL_MSG_CT_GET) == 3  # again, then the last finds nothing


def test_a_delete_the_kernel_refuses_is_an_error_naming_the_flow(monkeypatch):
    kernel = Kernel([ct_message(S1, SSH, 22)], deletes=[-1])
    monkeypatch.setattr(conntrack.Conntrack, "_socket", lambda self: kernel)
    with pytest.raises(OSError, match=r"10.213.1.2 -> 203.0.113.22:22: EPERM"):
        conntrack.Conntrack().end([(S1, SSH, 22)])


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 3))
def test_any_bytes_parse_without_raising(noise, cut):
    whole = ct_message(S1, SSH, 22) + noise
    for data in (noise, whole, whole[: len(whole) // (cut + 1)]):
        page = parse(data)
        assert all(isinstance(e, Entry) for e in page.entries)
