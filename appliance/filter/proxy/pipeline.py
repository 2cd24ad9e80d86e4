"""Where an HTTP request goes and what the upstream is sent: decisions without I/O.

Every path that carries HTTP — the explicit proxy, the transparent port-80 listener, and
plain HTTP inside a CONNECT tunnel — routes each request through `route()`, then sends the
upstream `outgoing()`: a head re-serialised from what was parsed and judged. Nothing the
client wrote reaches the upstream verbatim, so two parsers can never disagree about where a
request goes: the upstream sees the target this module judged, in origin-form, with a Host
header built from it.

Routing rules:
- explicit: absolute-form only (`http://host[:port]/path`, scheme in any case). The target
  decides; a Host header that names another host is refused (403), a port-notation
  difference is not (RFC 9112 §3.2.2: the absolute-form target replaces the Host header).
- transparent: origin-form with a Host header, or absolute-form; the port must be the
  one the client dialled (nftables redirected it, the upstream is dialled on it).
- in a tunnel: the request must name the CONNECT host and port (or nothing: HTTP/1.0
  without Host goes to the CONNECT host); CONNECT itself is refused.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from http import HTTPStatus

from appliance.policy import Decision, Host, HostNameError, parse_host
from appliance.policy.targets import MAX_TARGET

from ..approvals import request_hint
from ..denied import Denied
from ..http import HOP_BY_HOP, Head, HttpError, parse_absolute, parse_authority
from ..redact import Redactor
from . import overrides

OWN = frozenset({"host", "content-length", "transfer-encoding"})
"""Fields the upstream gets as the proxy writes them (from what it judged and how it reads
the body), never as the client spelt them."""
DISCARD_MAX = 1 << 20
"""The largest body of a request refused by its host's request rules that is read and
dropped so that the connection goes on; a larger one (or a chunked one, or one the client
waits for a 100 Continue to send) ends the connection instead."""
MAX_EMPTY_LINES = 8
"""Empty lines (CRLF) ignored before a request line (RFC 9112 §2.2 asks servers to ignore at
least one; more than a few is not a client being robust)."""


@dataclass(frozen=True, slots=True)
class Explicit:
    """The proxy port: absolute-form requests (CONNECT is handled before routing)."""


@dataclass(frozen=True, slots=True)
class Transparent:
    """A transparent listener: the client dialled `port` on some address."""

    port: int


@dataclass(frozen=True, slots=True)
class InTunnel:
    """Plain HTTP inside a CONNECT tunnel to host:port, or inside TLS the filter terminated
    for an inspected host (CONNECT or transparent)."""

    host: Host
    port: int
    inspected: bool = False

    @property
    def target(self) -> str:
        return _authority(self.host, self.port, None)


Mode = Explicit | Transparent | InTunnel


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes, as judged."""

    host: Host
    port: int
    path: str
    """Origin-form path and query (or `*`) for the upstream's request line."""
    conflict: str | None = None
    """Why the request may not go even where its host is allowed: it also names another host
    or port (a Host header against the target, a target against the tunnel). The caller
    judges the route first, so a denied host is reported as such, then refuses this."""
    default_port: int = 80
    """The scheme's port, which the Host header leaves out: 443 inside TLS the filter ended
    (`Host: example.org:443` is valid, and refused by CDNs that route on the exact name)."""

    @property
    def target(self) -> str:
        """host:port, as events and messages name it."""
        return _authority(self.host, self.port, None)

    @property
    def authority(self) -> str:
        """The Host header the upstream is sent: the port only when it is not the scheme's."""
        return _authority(self.host, self.port, self.default_port)


def _authority(host: Host, port: int, default: int | None) -> str:
    text = f"[{host}]" if host.address is not None and host.address.version == 6 else str(host)
    return text if port == default else f"{text}:{port}"


def host_of(text: str) -> Host:
    """The host a request names (absolute URI, Host header), parsed once per spelling: a
    keep-alive connection names the same one request after request. Raises HttpError."""
    host = _HOSTS.get(text)
    if host is not None:
        return host
    try:
        host = parse_host(text)
    except HostNameError as exc:
        raise HttpError(400, str(exc)) from None
    if len(_HOSTS) >= HOSTS_CACHED:
        _HOSTS.clear()
    _HOSTS[text] = host
    return host


_HOSTS: dict[str, Host] = {}
"""Spellings of hosts parsed (parse_host is pure and a Host immutable); only valid ones."""
HOSTS_CACHED = 1024
"""Spellings kept before the cache starts again (as the policy's decision memo does)."""


def route(head: Head, mode: Mode) -> Route:
    """The request's route under `mode`. Raises HttpError (malformed) or Denied (CONNECT
    inside a tunnel)."""
    method, target, _ = head.start
    if method == "CONNECT":
        if isinstance(mode, InTunnel):
            raise Denied(Decision(False, f"CONNECT inside a tunnel (to {mode.target}) is "
                                  "refused: one tunnel per connection"), mode.target)
        raise HttpError(405, "CONNECT on a transparent listener")
    host_header = head.get("host")
    if target.startswith("/") or (target == "*" and method == "OPTIONS"):
        if isinstance(mode, Explicit):
            raise HttpError(400, "origin-form request sent to the proxy port; set http_proxy "
                            "or use an absolute URI")
        if host_header is None:
            if isinstance(mode, InTunnel):  # HTTP/1.0 may leave it out: it goes where the
                return Route(mode.host, mode.port, target,  # tunnel goes
                             default_port=_scheme_port(mode))
            raise HttpError(400, "no Host header: cannot tell where the request goes")
        name, port = parse_authority(host_header, _default_port(mode))
        return _judged_against(mode, host_of(name), port, target, f"Host header {host_header!r}")
    parsed = parse_absolute(target)  # any other form must be absolute: http:// in any case
    host, port = host_of(parsed.host), parsed.port
    found = _judged_against(mode, host, port, parsed.path,  # never the query: see above
                            f"request target {target.partition('?')[0][:80]!r}")
    if found.conflict is None and host_header is not None:
        name, _ = parse_authority(host_header, port)
        if host_of(name) != host:  # a port notation difference is no conflict: Host is rebuilt
            return Route(found.host, found.port, found.path, f"Host header {host_header!r} "
                         f"differs from the request target {found.target}",
                         found.default_port)
    return found


def _scheme_port(mode: InTunnel) -> int:
    return 443 if mode.inspected else 80


def _default_port(mode: Mode) -> int:
    return mode.port if isinstance(mode, Transparent | InTunnel) else 80


def _judged_against(mode: Mode, host: Host, port: int, path: str, what: str) -> Route:
    """The route for host:port on this connection: a tunnel only ever goes to its CONNECT
    target, a transparent connection only to the port the client dialled."""
    if isinstance(mode, InTunnel):
        conflict = None if (host, port) == (mode.host, mode.port) else (
            f"{what} inside the tunnel differs from CONNECT host {mode.target}")
        return Route(mode.host, mode.port, path, conflict, _scheme_port(mode))
    if isinstance(mode, Transparent) and port != mode.port:
        return Route(host, mode.port, path, f"{what}: port {port} differs from the "
                     f"connection's port {mode.port}")
    return Route(host, port, path)


def outgoing(head: Head, route: Route, drop_expect: bool = False, upgrade: bool = False
             ) -> bytes:
    """The head the upstream is sent: the request line in origin-form, Host from the route,
    then the client's end-to-end fields in their order. Hop-by-hop fields and those the
    Connection header names are not forwarded; with `upgrade`, Upgrade is, and Connection
    says so. Framing fields can never be named in Connection: the parser refuses that. An
    HTTP/1.0 request asks the origin to keep the connection (the proxy's own hop): the
    next request of the session to that origin, on any client connection, needs no dial
    (forward.Pool), as HTTP/1.1's do; an origin that does not keep it says so."""
    method, _, version = head.start
    named = head.tokens("connection")
    keep = {"upgrade"} if upgrade else set()
    lines = [f"{method} {route.path} {version}", f"Host: {route.authority}"]
    for name, value in head.headers:
        low = name.lower()
        if low in OWN or (low == "expect" and drop_expect) or (
                (low in HOP_BY_HOP or low in named) and low not in keep):
            continue
        lines.append(f"{name}: {value}")
    if head.chunked:  # the framing as the proxy reads it, spelt as it writes it
        lines.append("Transfer-Encoding: chunked")
    elif head.content_length is not None:
        lines.append(f"Content-Length: {head.content_length}")
    if upgrade:
        lines.append("Connection: upgrade")
    elif version == "HTTP/1.0":
        lines.append("Connection: keep-alive")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def websocket(head: Head) -> bool:
    """Does the request ask to switch to a WebSocket (the one upgrade the proxy relays)? Any
    other (h2c above all: HTTP/2 would carry requests to any :authority past the proxy) goes
    on as a plain request without its Upgrade, and the upstream cannot switch."""
    return (head.start[0] == "GET" and head.start[2] == "HTTP/1.1"
            and "upgrade" in head.tokens("connection")
            and head.tokens("upgrade") == {"websocket"}
            and len(head.get_all("sec-websocket-key")) == 1)


WEBSOCKET_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def switch_refusal(request: Head, reply: Head) -> str | None:
    """Why a 101 the upstream sent to a WebSocket request is not a real switch (None: it
    is one). Only then does the connection stop being HTTP: a 101 that switched nothing
    (httpbin's /status/101 answers one and reads on) would turn the connection into raw
    relay, and the requests after it would reach the origin unread. A real switch names
    the protocol asked for and proves the server read this request's key (RFC 6455
    §4.2.2): `Upgrade: websocket`, `Connection: upgrade` and the right
    `Sec-WebSocket-Accept`."""
    if reply.tokens("upgrade") != {"websocket"}:
        return "the upstream answered 101 without switching to the WebSocket asked for"
    if "upgrade" not in reply.tokens("connection"):
        return "the upstream answered 101 without Connection: upgrade"
    key = (request.get("sec-websocket-key") or "").strip()
    accept = reply.get_all("sec-websocket-accept")
    if len(accept) != 1 or accept[0].strip() != websocket_accept(key):
        return ("the upstream answered 101 without the Sec-WebSocket-Accept that proves it "
                "switched")
    return None


def websocket_accept(key: str) -> str:
    """The Sec-WebSocket-Accept a server that read `key` answers with."""
    digest = hashlib.sha1((key + WEBSOCKET_GUID).encode("latin-1"),  # RFC 6455 names SHA-1
                          usedforsecurity=False).digest()
    return base64.b64encode(digest).decode()


def strip_empty_lines(data: bytes) -> tuple[bytes, int]:
    """`data` without the empty lines (CRLF) that lead it, and how many there were."""
    count = 0
    while data.startswith(b"\r\n"):
        data, count = data[2:], count + 1
    return data, count


def asked_methods(head: Head, path: str) -> list[tuple[str, str]]:
    """(where, method) for every other method the request's head asks an upstream to read
    it as: override fields, and `_method` in the query, its own or a rewrite field's
    (overrides.py: IIS routes by X-Original-URL, query and all). The query of a target
    longer than MAX_TARGET is not read: whatever judges that target refuses it (request
    rules, a secret's request patterns), and reading it would cost the loop ~20 ms."""
    found = overrides.header_methods(head)
    for how, target in [("the _method query parameter", path), *(
            (f"_method in the query of {name}", rewrite)
            for name, rewrite in overrides.header_paths(head))]:
        query = target.partition("?")[2]
        if query and len(target) <= MAX_TARGET:
            found += overrides.form_methods(query, how)
    return found


def judge_request(inspection, head: Head, where: Route, host_decision: Decision,
                  asked: list[tuple[str, str]] | None = None) -> Decision:
    """The decision for one request: its host's (already allowed), then, on a host the
    policy inspects, its request rules by method and origin-form target — for its own
    method and target and for every other its head asks to be read as (overrides.py:
    override fields, `_method` in the query, rewrite fields naming another path; `asked`:
    `asked_methods`, when the caller has it): a deny of any refuses it, and an allow must
    hold for each. What its body asks for is judged once it is read (`judge_asked`)."""
    if inspection is None:
        return host_decision
    method = head.start[0]
    decision = inspection.decide(method, where.path)
    if not decision.allowed or not inspection.judges:  # no rules: nothing to read it for
        return decision
    if asked is None:
        asked = asked_methods(head, where.path)
    return judge_asked(inspection, head, where, asked, overrides.header_paths(head)) or decision


MAX_READINGS = 32
"""Readings of one request judged besides its own (a method at a path): each is a decision on
the loop (~10 µs), and a client asks for one or two. A request asking for more is refused
unjudged: a head of 2000 override methods and 100 rewrite fields was 200,000 decisions."""


def judge_asked(inspection, head: Head, where: Route, methods: list[tuple[str, str]],
                paths: list[tuple[str, str]] = ()) -> Decision | None:
    """The refusal of the first reading of the request its rules deny (None: all pass):
    each method asked for with the request's target, and the request's own method and
    each asked one with each path a rewrite field names (each method and path once; more
    than MAX_READINGS readings refuse the request)."""
    method = head.start[0]
    methods, paths = _once(methods), _once(paths)
    count = len(methods) + len(paths) * (1 + len(methods))
    if count > MAX_READINGS:
        return Decision(False, f"{method} {where.path.partition('?')[0][:80]} asks to be "
                        f"read in {count} ways (override methods at rewrite paths); the "
                        f"filter judges at most {MAX_READINGS}")
    readings = [(how, other, where.path, "") for how, other in methods]
    for how_path, path in paths:
        readings += [(how_path, m, path, f" at {printable_ascii(path[:80])}")
                     for _, m in [("", method), *methods]]
    for how, other, path, at in readings:
        found = inspection.decide(other, path)
        if not found.allowed:
            return Decision(False, f"{method} {where.path.partition('?')[0][:80]} asks by "
                            f"{how} to be read as {printable_ascii(other[:40])}{at}: "
                            f"{found.reason}",
                            found.rule, found.hint)
    return None


def _once(found: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(where, what) pairs, each `what` once (where it was first found)."""
    seen: dict[str, tuple[str, str]] = {}
    for how, what in found:
        seen.setdefault(what, (how, what))
    return list(seen.values())


def request_fields(where: Route, head: Head) -> dict[str, str]:
    """What an event says of a request judged by its host's request rules: the method and
    the path, never the query (credentials ride in queries too)."""
    return {"method": head.start[0], "path": where.path.partition("?")[0][:200]}


def keeps_after_refusal(head: Head) -> bool:
    """May the connection go on after this request is refused (its body read and dropped)?"""
    return (not wants_close(head, head.start[2]) and head.get("expect") is None
            and not head.chunked and (head.content_length or 0) <= DISCARD_MAX)


def framing(method: str, reply: Head) -> tuple[bool, bool]:
    """How the response `reply` to a `method` request ends, as (it has no body, its end is
    known): no body (HEAD, 204, 304), chunked, or a length; else only its connection's end
    ends it. Both paths read a response by this (forward.py, express.py)."""
    no_body = method == "HEAD" or int(reply.start[1]) in (204, 304)
    return no_body, no_body or reply.chunked or reply.content_length is not None


def wants_close(head: Head, version: str) -> bool:
    """Does this message end its connection (Connection: close, or HTTP/1.0 by default)?"""
    tokens = head.tokens("connection")
    return "close" in tokens or (version == "HTTP/1.0" and "keep-alive" not in tokens)


# -- the proxy's own answers ------------------------------------------------------------------


def response(status: int, body: str, extra: dict[str, str] | None = None, keep: bool = False,
             content_type: str = "text/plain; charset=utf-8", *, redactor: Redactor) -> bytes:
    """A complete response of the proxy's own, which closes the connection unless `keep`.
    Its words pass through `redactor` (the secrets' values out: the client may be an agent
    a reason quotes a value to)."""
    payload = redactor.text(body).encode()
    lines = [f"HTTP/1.1 {status} {_phrase(status)}", f"Content-Type: {content_type}",
             f"Content-Length: {len(payload)}", f"Connection: {'keep-alive' if keep else 'close'}"]
    lines += [f"{k}: {printable_ascii(redactor.text(v))}" for k, v in (extra or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


def deny_response(denied: Denied, keep: bool = False, *, redactor: Redactor) -> bytes:
    d = denied.decision
    body = f"corral: {printable_ascii(denied.target)} denied: {printable_ascii(d.reason)}."
    if d.hint:
        body += f" To allow it: {d.hint}"
    header = "X-Corral-Deny" if denied.status == 403 else "X-Corral-Error"
    extra = {header: d.reason}
    ask = request_hint(d) if denied.status == 403 else None
    if ask is not None:  # an agent reads this: ask a person instead of working around it
        body += f"\nTo ask a person for it from inside the session: {ask}"
        extra["X-Corral-Request"] = ask
    return response(denied.status, body + "\n", extra, keep, redactor=redactor)


def error_response(status: int, message: str, *, redactor: Redactor) -> bytes:
    return response(status, f"corral: {printable_ascii(message)}\n",
                    {"X-Corral-Error": message}, redactor=redactor)


def printable_ascii(text: str) -> str:
    """Text a client sent, made safe to echo in a header or a terminal: printable ASCII,
    anything else `?` (a header holds no more; events.printable escapes instead)."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"
