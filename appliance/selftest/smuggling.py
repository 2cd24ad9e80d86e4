"""Request smuggling on a shared IP (T20), in the network group: an allowed name and a denied
one may share an address, so whatever reaches the origin must be judged for the host it
names. A late ClientHello, framing fields named in `Connection`, a bare-LF chunk line, an
upper-case absolute target, and pipelined, CRLF-led, absolute-form or other-protocol bytes
inside a tunnel: each must be refused by corral (X-Corral-Deny / X-Corral-Error), never
passed on.
"""

from __future__ import annotations

import time

from .registry import FAST, Outcome, probe
from .wire import (
    Stream,
    first_line,
    from_corral,
    from_origin,
    host_seen,
    proxy_request,
    read_head,
    tcp,
    tls_denied,
    tunnel,
)


@probe("sni-after-silence", 20, records="connect event, reason 'domain fronting'",
       budget=lambda args: args.silence + FAST)
def sni_after_silence(ctx):
    """Waits past the filter's header_timeout on purpose (--silence): no timeout may open a
    tunnel uninspected, so the ClientHello that comes late is judged all the same."""
    a = ctx.args
    sock = tunnel(a, 443)
    time.sleep(a.silence)
    ok, detail = tls_denied(a, sock, a.denied)
    return Outcome(ok, f"after {a.silence:g} s of silence, TLS to {a.denied} inside a tunnel "
                   f"to {a.allowed}: {detail}", {"kind": "connect", "reason": "domain fronting"})


@probe("connection-names-framing", 20, records="http event, reason 'Connection'")
def connection_names_framing(ctx):
    """`Connection: Content-Length` would make a proxy drop the length while the body is
    still framed by it: the body, a whole request to a denied host, would reach the origin
    as a second request."""
    a = ctx.args
    smuggled = f"GET / HTTP/1.1\r\nHost: {a.denied}\r\n\r\n".encode()
    with tcp(a.gateway, a.proxy_port) as sock:
        sock.sendall(f"GET http://{a.allowed}/ HTTP/1.1\r\nHost: {a.allowed}\r\nConnection: "
                     f"keep-alive, Content-Length\r\nContent-Length: {len(smuggled)}\r\n\r\n"
                     .encode() + smuggled)
        stream = Stream(sock)
        head, _ = stream.response()
        more, _ = stream.rest(timeout=1.0)
    second = b"HTTP/1." in more
    return Outcome(from_corral(head, 400, "X-Corral-Error") and not second,
                   first_line(head) + (f"; then a second response: {first_line(more)}"
                                       if second else ""),
                   {"kind": "http", "reason": "Connection"})


@probe("chunk-line-bare-lf", 20, records="http event, reason 'chunk'")
def chunk_line_bare_lf(ctx):
    a = ctx.args
    head = proxy_request(a, f"POST http://{a.allowed}/ HTTP/1.1\r\nHost: {a.allowed}\r\n"
                         "Transfer-Encoding: chunked\r\n\r\n3\nabc\r\n0\r\n\r\n".encode())
    return Outcome(from_corral(head, 400, "X-Corral-Error"), f"a chunk-size line ending in a "
                   f"bare LF: {first_line(head)}", {"kind": "http", "reason": "chunk"})


@probe("transparent-absolute-uppercase", 20, records="http event for DENIED")
def transparent_absolute_uppercase(ctx):
    """Port 80 without the proxy: an absolute-form target in upper case names the denied host
    while Host names the allowed one; origins go by the target."""
    a = ctx.args
    with tcp(ctx.allowed_ip(), 80) as sock:
        sock.sendall(f"GET HTTP://{a.denied}/ HTTP/1.1\r\nHost: {a.allowed}\r\n\r\n".encode())
        head = read_head(sock)
    return Outcome(from_corral(head, 403, "X-Corral-Deny"), f"GET HTTP://{a.denied}/ with Host "
                   f"{a.allowed}: {first_line(head)}", {"kind": "http", "name": a.denied})


def _second_in_tunnel(ctx, second: bytes, what: str) -> Outcome:
    """Two requests in one send inside a tunnel to port 80: the first is the origin's to
    answer, the second names the denied host and must be judged and refused."""
    a = ctx.args
    with tunnel(a, 80) as sock:
        sock.sendall(f"GET / HTTP/1.1\r\nHost: {a.allowed}\r\n\r\n".encode() + second)
        stream = Stream(sock)
        first, _ = stream.response()
        denied = stream.head()
    return Outcome(from_origin(first) and from_corral(denied, 403, "X-Corral-Deny"),
                   f"first: {first_line(first)}; {what}: {first_line(denied)}",
                   {"kind": "http", "reason": "inside the tunnel"})


probe("tunnel-second-request", 20, records="http event, reason 'inside the tunnel'")(
    lambda ctx: _second_in_tunnel(
        ctx, f"GET / HTTP/1.1\r\nHost: {ctx.args.denied}\r\n\r\n".encode(),
        "a pipelined second request to the denied host"))
probe("tunnel-leading-crlf", 20, records="http event, reason 'inside the tunnel'")(
    lambda ctx: _second_in_tunnel(
        ctx, f"\r\nGET / HTTP/1.1\r\nHost: {ctx.args.denied}\r\n\r\n".encode(),
        "after an empty line, a request to the denied host"))


@probe("tunnel-absolute-form", 20, records="http event, reason 'inside the tunnel'")
def tunnel_absolute_form(ctx):
    a = ctx.args
    with tunnel(a, 80) as sock:
        sock.sendall(f"GET http://{a.denied}/ HTTP/1.1\r\nHost: {a.allowed}\r\n\r\n".encode())
        head = read_head(sock)
    return Outcome(from_corral(head, 403, "X-Corral-Deny"), f"GET http://{a.denied}/ with "
                   f"Host {a.allowed} inside a tunnel: {first_line(head)}",
                   {"kind": "http", "reason": "inside the tunnel"})


@probe("tunnel-http10-without-host", 20, legit=True)
def tunnel_http10_without_host(ctx):
    """HTTP/1.0 without Host inside a tunnel: the origin would pick its default virtual host
    (on a shared IP, maybe a denied one); corral adds Host, the CONNECT host."""
    a = ctx.args
    with tunnel(a, 80) as sock:
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
        head, body = Stream(sock).response()
    host_ok, seen = host_seen(body, a.allowed)
    return Outcome(from_origin(head) and host_ok, f"{first_line(head)} ({seen})")


@probe("tunnel-not-tls-or-http", 20, records="connect event, reason 'inside a tunnel'")
def tunnel_not_tls_or_http(ctx):
    """Inside a CONNECT tunnel only TLS and HTTP/1.x are relayed (other protocols need a tcp
    rule): anything else is answered 400 and the tunnel closed."""
    with tunnel(ctx.args, 443) as sock:
        sock.sendall(b"SSH-2.0-probe\r\n")
        stream = Stream(sock)
        head, _ = stream.response()
        _, closed = stream.rest(timeout=1.0)
    return Outcome(from_corral(head, 400, "X-Corral-Error") and closed,
                   f"SSH inside a tunnel to {ctx.args.allowed}:443: {first_line(head)}; "
                   f"{'closed' if closed else 'left open'}",
                   {"kind": "connect", "reason": "inside a tunnel"})

