"""Starving the neighbours (T21), in the network group: the worst DNS packet a parser can be
handed, a DNS flood against the session's rate limit, and connections that never finish
their head against the proxy's per-session cap. The filter must refuse each at once and
keep serving the session. These run last (the package imports them after the others), and
each leaves the filter as it found it: the cap's connections closed, the DNS rate limit
recovered.
"""

from __future__ import annotations

import contextlib
import errno
import resource
import secrets
import selectors
import socket
import struct
import time
from collections import Counter

from .registry import FAST, NotRun, Outcome, probe
from .wire import dns_query, first_line, from_origin, proxy_request, refused, resolve, tcp


def pointer_chain_query(size: int, qid: int) -> bytes:
    """A query built to make a DNS parser work: one answer record's data holds a chain of
    names, each a label and a compression pointer to the one before it (decoding the last
    walks the whole chain and copies a growing list at every step), and every further answer
    record's name points at the chain's end. About `size` bytes. A query has no answers at
    all, so the filter can refuse it (FORMERR) before it parses a single name."""
    question = b"\x01a\x00" + struct.pack("!HH", 1, 1)
    chain_at = 12 + len(question) + 11  # after the header, the question, the carrier's head
    # cost ~ references x links^2, for links x 4 + references x 13 bytes: most at links = size/6;
    # at most 900, below Python's recursion limit
    links = min(900, max(8, size // 6))
    chain = bytearray(b"\x01a\x00")
    previous = chain_at
    for _ in range(links):
        here = chain_at + len(chain)
        chain += b"\x01a" + struct.pack("!H", 0xC000 | previous)
        previous = here
    carrier = b"\x00" + struct.pack("!HHIH", 10, 1, 0, len(chain)) + bytes(chain)  # NULL RR
    reference = struct.pack("!H", 0xC000 | previous) + struct.pack("!HHIH", 10, 1, 0, 1) + b"x"
    references = max(1, (size - 12 - len(question) - len(carrier)) // len(reference))
    header = struct.pack("!HHHHHH", qid, 0x0100, 1, 1 + references, 0, 0)
    return header + question + carrier + reference * references



FLOOD_SECONDS = 20.0
"""The longest dns-flood-rate-limited floods. The limit a flood of random denied names meets
first is `[dns] denied_rate` (at the defaults a burst of 200, 20 a second): a filter that
answers 40 queries a second refuses one after 10 s; one that answers 2,000, after 0.1 s."""
BURST, BURST_GAP = 100, 0.05
"""Flood queries sent at once, and the pause between bursts (read answers meanwhile): 2,000 a
second, `[firewall] dns_packets`; faster would only be dropped by the kernel."""
ENOUGH_REFUSED = 20
"""REFUSED answers after which the flood has shown the limit."""


def _raise_nofile(want: int) -> int:
    """As many descriptors as this process may have, up to `want`; the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)))  # root may
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, want), hard), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]



@probe("dns-worst-packet", 21, records="dns event, reason 'malformed'")
def dns_worst_packet(ctx):
    a = ctx.args
    qid = secrets.randbelow(65536)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(FAST)
        sock.connect((a.gateway, a.dns_port))
        sock.send(pointer_chain_query(1200, qid))
        udp = sock.recv(4096)
    with tcp(a.gateway, a.dns_port) as sock:
        query = pointer_chain_query(12_000, qid ^ 1)
        sock.sendall(struct.pack("!H", len(query)) + query)
        length = struct.unpack("!H", _recv_exactly(sock, 2))[0]
        over_tcp = _recv_exactly(sock, length)
    rcode, addresses = resolve(a, a.allowed)
    udp_ok = udp[:2] == struct.pack("!H", qid) and udp[3] & 0x0F == 1
    tcp_ok = over_tcp[:2] == struct.pack("!H", qid ^ 1) and over_tcp[3] & 0x0F == 1
    return Outcome(udp_ok and tcp_ok and rcode == 0 and bool(addresses),
                   f"1,200 bytes over UDP: rcode {udp[3] & 0x0F}; 12,000 over TCP: rcode "
                   f"{over_tcp[3] & 0x0F} (FORMERR = 1); then {a.allowed}: rcode {rcode}",
                   {"kind": "dns", "reason": "malformed"})


def _recv_exactly(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


@probe("dns-flood-rate-limited", 21, records="dns event, reason 'denied names'",
       budget=lambda args: FLOOD_SECONDS + 1 + args.recover + FAST)
def dns_flood_rate_limited(ctx):
    """Random names under the denied zone in bursts of BURST every BURST_GAP seconds (the
    exfiltration pattern, at the kernel's per-session packet rate): past the session's limit
    on denied names, REFUSED; never NOERROR; and the session's ordinary queries are
    answered again a few seconds later.

    The filter spends a token only on a query it reads, so a bucket empties only while the
    filter answers faster than its rate. The general `[dns] rate` (200 a second) is above
    what a VM under emulation answers (170 to 600 a second, measured), so the flood could
    not show it there; the denied-names limit (20 a second) it meets within seconds.
    The flood keeps the filter's queue full until the first REFUSED answers, `--flood`
    queries, or FLOOD_SECONDS; what the kernel or a full queue drops is no answer, no
    token, and no harm to the result."""
    a = ctx.args
    ids, rcodes = set(), Counter()
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.connect((a.gateway, a.dns_port))

        def drain(until):
            while True:
                remaining = until - time.monotonic()
                if remaining > 0:
                    sock.settimeout(remaining)
                else:
                    sock.setblocking(False)
                try:
                    reply = sock.recv(4096)
                except (BlockingIOError, TimeoutError):
                    return
                except OSError:  # an ICMP error reported on the socket: not an answer
                    continue
                if len(reply) >= 4 and struct.unpack("!H", reply[:2])[0] in ids:
                    rcodes[reply[3] & 0x0F] += 1

        deadline = time.monotonic() + FLOOD_SECONDS
        while sent < a.flood and rcodes[5] < ENOUGH_REFUSED and time.monotonic() < deadline:
            sock.setblocking(True)
            for _ in range(min(BURST, a.flood - sent)):
                qid = sent & 0xFFFF
                ids.add(qid)
                with contextlib.suppress(BlockingIOError, ConnectionRefusedError):
                    sock.send(dns_query(f"{secrets.token_hex(8)}.flood.{a.denied}", qid=qid))
                sent += 1
            drain(time.monotonic() + BURST_GAP)
        drain(time.monotonic() + 1.0)
    recovered, waited = None, 0.0
    started = time.monotonic()
    while recovered is None and waited <= a.recover:
        rcode, addresses = resolve(a, a.allowed)
        waited = time.monotonic() - started
        if rcode == 0 and addresses:
            recovered = waited
        else:
            time.sleep(0.25)
    names = {0: "NOERROR", 3: "NXDOMAIN", 5: "REFUSED", 2: "SERVFAIL"}
    seen = ", ".join(f"{names.get(k, k)} {v}" for k, v in sorted(rcodes.items()))
    return Outcome(rcodes[5] > 0 and rcodes[0] == 0 and recovered is not None,
                   f"{sent} sent, {sum(rcodes.values())} answered ({seen or 'none'}); "
                   + (f"{a.allowed} answered again after {recovered:.1f} s" if recovered
                      is not None else f"{a.allowed} still not answered after {waited:.1f} s"),
                   {"kind": "dns", "reason": "denied names"})


@probe("proxy-connection-cap", 21, records="http event, reason 'connections open'",
       budget=60.0)
def proxy_connection_cap(ctx):
    """Slowloris: connections that never finish their request head. The filter caps them per
    session; the one over the cap is refused at once (reset or closed, no answer), and once
    they are gone the proxy serves the session again."""
    a = ctx.args
    limit = _raise_nofile(a.connections + 64)
    held: list[socket.socket] = []
    refusal = None
    with selectors.DefaultSelector() as selector:
        try:
            for index in range(a.connections):
                try:
                    sock = tcp(a.gateway, a.proxy_port)
                except OSError as exc:
                    if exc.errno in (errno.EMFILE, errno.ENFILE):
                        # the filter may not have accepted them all yet: give it time
                        refusal = _first_refusal(selector, FAST, held)
                        if refusal:
                            break
                        raise NotRun(f"this sandbox may open only {limit} descriptors and held "
                                     f"{len(held)} connections without meeting the cap") from None
                    if not refused(exc):
                        raise
                    refusal = f"connection {index + 1} refused at connect ({exc})"
                    break
                held.append(sock)
                selector.register(sock, selectors.EVENT_READ)
                with contextlib.suppress(OSError):
                    sock.sendall(b"GET http://x/ HTTP/1.1\r\nHo")
                refusal = _first_refusal(selector, 0, held)
                if refusal:
                    break
            else:
                refusal = _first_refusal(selector, FAST, held)
        finally:
            for sock in held:
                sock.close()
    head = b""
    for _ in range(25):  # the filter, then conntrack, see the closes as they come in
        try:
            head = proxy_request(a, f"GET http://{a.allowed}/ HTTP/1.1\r\n"
                                 f"Host: {a.allowed}\r\nConnection: close\r\n\r\n".encode())
        except OSError as exc:
            if not refused(exc):
                raise
            head = f"refused: {exc}".encode()
        if from_origin(head):
            break
        time.sleep(0.2)
    # refused at connect: the kernel's count of the session's connections (twice its caps:
    # it gets there first when the filter has not accepted them all yet), a firewall event;
    # reset once accepted: the filter's cap, an event of its own
    expect = ({"kind": "firewall", "address": a.gateway, "port": a.proxy_port}
              if refusal and "at connect" in refusal
              else {"kind": "http", "reason": "connections open"})
    return Outcome(bool(refusal) and from_origin(head),
                   f"{refusal or f'{len(held)} slow connections held open, none refused'}; "
                   f"after closing them: {first_line(head)}", expect)


def _first_refusal(selector, timeout, held) -> str | None:
    """A held connection the proxy closed or reset without answering, if any is readable."""
    for key, _ in selector.select(timeout):
        sock = key.fileobj
        try:
            sock.setblocking(False)
            data = sock.recv(4096)
        except BlockingIOError:
            continue
        except ConnectionResetError:
            return f"connection {held.index(sock) + 1} reset at once, no answer"
        if data:
            raise RuntimeError(f"the proxy answered a held connection instead of refusing "
                                 f"it: {first_line(data)}")
        return f"connection {held.index(sock) + 1} closed at once, no answer"
    return None

