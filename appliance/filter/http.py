"""HTTP/1.x message heads: strict, pure parsing (bytes in, typed value or HttpError out).

Strict because two parsers that disagree about where a request ends are a smuggling hole:
obsolete line folding, whitespace before a colon, conflicting Content-Length values, and a
Transfer-Encoding other than a final `chunked` are refused, not guessed at. The proxy
re-serialises the head it parsed, so the upstream only ever sees this parser's reading.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from appliance.policy import HostNameError, split_host_port

_TOKEN = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_VERSION = re.compile(rb"^HTTP/1\.[01]$")
_FIELD_VALUE_BAD = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_TARGET_BAD = re.compile(rb"[\x00-\x20\x7f]")

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authorization",
    "proxy-authenticate", "te", "trailer", "upgrade",
})


class HttpError(ValueError):
    """A message the proxy refuses; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Head:
    """A parsed request or response head."""

    start: tuple[str, str, str]
    """Request: (method, target, version). Response: (version, status, reason)."""
    headers: tuple[tuple[str, str], ...]
    """Fields in order, names as sent."""

    def get(self, name: str) -> str | None:
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def get_all(self, name: str) -> list[str]:
        name = name.lower()
        return [v for k, v in self.headers if k.lower() == name]

    def tokens(self, name: str) -> set[str]:
        """Comma-separated tokens of every `name` field, lower-cased (Connection etc.)."""
        return {t.strip().lower() for v in self.get_all(name) for t in v.split(",") if t.strip()}

    @property
    def chunked(self) -> bool:
        return bool(self.get_all("transfer-encoding"))

    @property
    def content_length(self) -> int | None:
        values = self.get_all("content-length")
        return int(values[0]) if values else None


def _lines(data: bytes) -> list[bytes]:
    if not data.endswith(b"\r\n\r\n"):
        raise HttpError(400, "message head does not end with an empty line")
    lines = data[:-4].split(b"\r\n")
    for line in lines:
        if b"\n" in line or b"\r" in line:
            raise HttpError(400, "bare CR or LF in message head; lines must end with CRLF")
    return lines


def _fields(lines: list[bytes]) -> tuple[tuple[str, str], ...]:
    fields = []
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            raise HttpError(400, "obsolete line folding is not accepted")
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.match(name):
            raise HttpError(400, f"malformed header field {line[:60]!r}")
        value = value.strip(b" \t")
        if _FIELD_VALUE_BAD.search(value):
            raise HttpError(400, f"control character in header {name.decode()!r}")
        fields.append((name.decode("ascii"), value.decode("latin-1")))
    return tuple(fields)


def _check_framing(head: Head) -> None:
    lengths = head.get_all("content-length")
    if lengths:
        if len({v.strip() for v in lengths}) != 1 or not lengths[0].strip().isdigit():
            raise HttpError(400, f"invalid or conflicting Content-Length {lengths!r}")
        if len(lengths[0].strip()) > 18:
            raise HttpError(400, "Content-Length too large")
    codings = [t.strip().lower() for v in head.get_all("transfer-encoding") for t in v.split(",")]
    if codings:
        if codings != ["chunked"]:
            raise HttpError(501, f"Transfer-Encoding {', '.join(codings)!r} is not supported;"
                            " only chunked")
        if lengths:
            raise HttpError(400, "both Transfer-Encoding and Content-Length: refused "
                            "(request smuggling)")


def parse_request(data: bytes) -> Head:
    """Parse a complete request head (through the blank line)."""
    lines = _lines(data)
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        raise HttpError(400, f"malformed request line {lines[0][:80]!r}")
    method, target, version = parts
    if not _TOKEN.match(method):
        raise HttpError(400, f"malformed method {method[:20]!r}")
    if not _VERSION.match(version):
        raise HttpError(505, f"unsupported protocol {version[:20]!r}; HTTP/1.0 or 1.1 only")
    if not target or _TARGET_BAD.search(target):
        raise HttpError(400, "malformed request target")
    head = Head((method.decode(), target.decode("ascii", "replace"), version.decode()),
                _fields(lines[1:]))
    if len(head.get_all("host")) > 1:
        raise HttpError(400, "more than one Host header")
    _check_framing(head)
    return head


def parse_response(data: bytes) -> Head:
    """Parse a complete response head from an upstream server."""
    lines = _lines(data)
    version, _, rest = lines[0].partition(b" ")
    status, _, reason = rest.partition(b" ")
    if not _VERSION.match(version) or len(status) != 3 or not status.isdigit():
        raise HttpError(502, f"upstream sent a malformed status line {lines[0][:80]!r}")
    head = Head((version.decode(), status.decode(), reason.decode("latin-1")), _fields(lines[1:]))
    try:
        _check_framing(head)
    except HttpError as exc:
        raise HttpError(502, f"upstream response: {exc}") from None
    return head


@dataclass(frozen=True, slots=True)
class Target:
    host: str
    """As written (not yet normalised: the policy does that)."""
    port: int
    path: str
    """Origin-form path and query to send upstream."""


def parse_authority(text: str, default_port: int | None) -> tuple[str, int]:
    """`host[:port]` from a CONNECT target or a Host header."""
    if "@" in text:
        raise HttpError(400, "credentials in the authority are not accepted")
    try:
        host, port = split_host_port(text)
    except HostNameError as exc:
        raise HttpError(400, str(exc)) from None
    if port is None or port == "":
        if default_port is None:
            raise HttpError(400, f"{text!r} needs a port, as in {text}:443")
        return host, default_port
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise HttpError(400, f"invalid port in {text!r}")
    if not host:
        raise HttpError(400, f"no host in {text!r}")
    return host, int(port)


def parse_absolute(target: str) -> Target:
    """`http://host[:port]/path?query` (absolute-form, explicit proxy)."""
    scheme, sep, rest = target.partition("://")
    if not sep:
        raise HttpError(400, "a proxy request needs an absolute URI (http://host/path)")
    if scheme.lower() != "http":
        raise HttpError(400, f"scheme {scheme!r} through the proxy: use CONNECT for https")
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, path = rest[:cut], rest[cut:]
    if "#" in path:
        path = path.split("#", 1)[0]
    if not path.startswith("/"):
        path = "/" + path
    host, port = parse_authority(authority, 80)
    return Target(host, port, path)


def _serialise(start: str, head: Head, drop: frozenset[str], keep: frozenset[str],
               close: bool = False) -> bytes:
    """A start line and the fields the next hop may see: hop-by-hop fields and those the
    Connection header names are dropped, except `keep` (Upgrade), which Connection names."""
    named = head.tokens("connection")
    lines = [start]
    for name, value in head.headers:
        low = name.lower()
        if (low in drop or low in named) and low not in keep:
            continue
        lines.append(f"{name}: {value}")
    if keep:
        lines.append("Connection: " + ", ".join(sorted(keep)))
    elif close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def serialise_request(head: Head, path: str, drop: frozenset[str] = HOP_BY_HOP,
                      keep: frozenset[str] = frozenset()) -> bytes:
    """Origin-form request line plus the fields a next hop may see."""
    method, _, version = head.start
    return _serialise(f"{method} {path} {version}", head, drop, keep)


def serialise_response(reply: Head, close: bool = False,
                       keep: frozenset[str] = frozenset()) -> bytes:
    """The upstream's response for the client, as HTTP/1.1, with our own Connection header."""
    _, status, reason = reply.start
    return _serialise(f"HTTP/1.1 {status} {reason}", reply, HOP_BY_HOP, keep, close)


def parse_chunk_size(line: bytes) -> int:
    """The size in a chunk-size line (extensions ignored). Raises HttpError."""
    size = line.split(b";", 1)[0].strip()
    if not size or len(size) > 16 or not all(c in b"0123456789abcdefABCDEF" for c in size):
        raise HttpError(400, f"malformed chunk size {line[:40]!r}")
    return int(size, 16)
