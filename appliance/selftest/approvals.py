"""Ask mode (T15, T21), in a session whose policy asks a person (`--ask-hold`): what waits for
a person sends nothing anywhere before the person decides, and a flood of waiting requests
and of asking exhausts nothing.

The rest of the battery expects denials at once, which ask mode turns into waits, so these
run apart: in a session in ask mode (`corral ask --session S --hold S`), with `--only` naming
them and `--ask-hold S` (the e2e suite does). Nobody decides during the run: a held request
must end denied when the hold runs out.
"""

from __future__ import annotations

import secrets
import selectors
import time

from .registry import FAST, Outcome, probe
from .wire import first_line, from_origin, proxy_request, read_head, status, tcp

HELD_PATH = "/corral-selftest-held"
"""The path every held request asks for: an origin that ever logs it was sent a request
that no person approved (the e2e suite looks in its fake internet's log)."""
FLOOD = 48
"""Held requests for as many names: more than a session may have approvals open (32)."""
ASKS = 8
"""Agent asks at request.corral sent at once: more than the burst a session may ask (5); a
burst may be partly spent already, so no more than that is expected."""


def _quiet(socks, seconds: float) -> tuple[bool, str]:
    """Whether none of these sockets gets a byte (or is closed) for `seconds`."""
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        ready = selector.select(seconds)
    if not ready:
        return True, f"nothing for {seconds:.1f}s"
    return False, f"an answer within {seconds:.1f}s of asking (nobody decided)"


def _answered_at_once(socks, seconds: float) -> list[bytes]:
    """The heads the proxy sends on these sockets within `seconds` (the others wait)."""
    heads, deadline = [], time.monotonic() + seconds
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        while selector.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                selector.unregister(key.fileobj)
                try:
                    heads.append(read_head(key.fileobj))
                except OSError:
                    heads.append(b"")
    return heads


def _hold_budget(args) -> float:
    return (args.ask_hold or 0) + FAST


@probe("held-request-sends-nothing", 15, needs="ask_hold", budget=_hold_budget,
       records="connect event for DENIED, reason 'no decision'")
def held_request_sends_nothing(ctx):
    """A tunnel with a request already inside it, and a plain POST with its body: both wait
    for a person without a byte in answer (no 200 to the CONNECT), and end denied."""
    a = ctx.args
    tunnel = tcp(a.gateway, a.proxy_port, timeout=a.ask_hold + FAST)
    plain = tcp(a.gateway, a.proxy_port, timeout=a.ask_hold + FAST)
    with tunnel, plain:
        tunnel.sendall(f"CONNECT {a.denied}:80 HTTP/1.1\r\nHost: {a.denied}:80\r\n\r\n"
                       f"GET {HELD_PATH}/tunnel HTTP/1.1\r\nHost: {a.denied}\r\n"
                       "Connection: close\r\n\r\n".encode())
        body = b"corral-selftest: a body no person approved"
        plain.sendall(f"POST http://{a.denied}{HELD_PATH}/plain HTTP/1.1\r\nHost: {a.denied}"
                      f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                      + body)
        quiet, seen = _quiet([tunnel, plain], max(a.ask_hold - 1.0, 0.5))
        heads = [read_head(tunnel), read_head(plain)]
    denied = [status(h) == 403 and b"no decision" in h for h in heads]
    return Outcome(quiet and all(denied),
                   f"held: {seen}; then CONNECT {a.denied}:80: {first_line(heads[0])}, "
                   f"POST: {first_line(heads[1])}",
                   {"kind": "connect", "name": a.denied, "reason": "no decision"})


@probe("approval-flood-bounded", 21, needs="ask_hold", budget=2 * FAST,
       records="connect event, reason 'approvals open already'")
def approval_flood_bounded(ctx):
    """Requests for more names than a session may have approvals open: the ones past the
    bound are refused at once (no prompt, no memory), the allowed host is still served while
    the rest wait, and asking at request.corral faster than the limit is refused (429)."""
    a = ctx.args
    tag = secrets.token_hex(4)
    held = []
    try:
        for i in range(FLOOD):
            sock = tcp(a.gateway, a.proxy_port)
            held.append(sock)
            target = f"flood{i}-{tag}.{a.denied}:443"
            sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        heads = _answered_at_once(held, min(FAST / 2, a.ask_hold / 2))
        bounded = sum(status(h) == 403 and b"approvals open already" in h for h in heads)
        served = proxy_request(a, f"GET http://{a.allowed}/selftest HTTP/1.1\r\nHost: "
                               f"{a.allowed}\r\nConnection: close\r\n\r\n".encode())
        # asks for the allowed host: answered 200 ("allowed") within the rate, opening no
        # approval, so a 429 here is the rate limit and not the bound met above
        asks = [status(proxy_request(
            a, f"GET http://request.corral/?host={a.allowed}&reason=corral+selftest "
               "HTTP/1.1\r\nHost: request.corral\r\nConnection: close\r\n\r\n".encode()))
            for _ in range(ASKS)]
    finally:
        for sock in held:
            sock.close()
    ok = (bounded >= FLOOD - 32 and from_origin(served) and 429 in asks
          and set(asks) <= {200, 429})
    return Outcome(ok, f"{len(heads)} of {FLOOD} answered at once, {bounded} of them for the "
                   f"bound; {a.allowed} meanwhile: {first_line(served)}; {ASKS} asks: {asks}",
                   {"kind": "connect", "reason": "approvals open already"})
