"""HTTP/1.x message heads: strict, pure parsing (bytes in, typed value or HttpError out).

Strict because two parsers that disagree about where a request ends are a smuggling hole:
obsolete line folding, whitespace before a colon, conflicting Content-Length values, and a
Transfer-Encoding other than a final `chunked` are refused, not guessed at. The proxy
re-serialises the head it parsed, so the upstream only ever sees this parser's reading.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from appliance.policy import HostNameError, split_host_port

_TOKEN = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_VERSION = re.compile(rb"^HTTP/1\.[01]$")
_FIELD_VALUE_BAD = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_TARGET_BAD = re.compile(rb"[\x00-\x20\x7f-\xff]")
"""Bytes no request target may hold (RFC 9112 §3.2: visible ASCII; the rest arrives
percent-encoded, and a raw one would not survive the re-serialised request line)."""

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authorization",
    "proxy-authenticate", "te", "trailer", "upgrade", "http2-settings",
})
MAX_FIELDS = 200
"""Header fields a message may carry (more gets 431): a head of 64 KiB of tiny fields would
cost the one event loop tens of milliseconds to parse and search."""
FRAMING = frozenset({"content-length", "transfer-encoding", "host"})
"""Fields that say where a message ends or where it goes: a Connection header may not name
them (a proxy that dropped them as hop-by-hop would leave the body to be read as a second
request, to any host on that address)."""
_DIGITS = re.compile(r"[0-9]+")
_REQUEST_LINE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+ [^\x00-\x20\x7f]+ HTTP/1\.[01]")
"""What a request line looks like, checked before the rest of the head is read (fullmatch)."""
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})(?:[ \t]*;[\t\x20-\x7e]*)?")
"""A chunk-size line (fullmatch: `$` would let a trailing LF through)."""


class HttpError(ValueError):
    """A message the proxy refuses; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, unquoted: str | None = None):
        super().__init__(message)
        self.status = status
        self.unquoted = unquoted or message
        """The message without the bytes it quotes: for what an upstream sent, which may
        hold what the filter attached to the request (a secret)."""


@dataclass(frozen=True, slots=True)
class Head:
    """A parsed request or response head."""

    start: tuple[str, str, str]
    """Request: (method, target, version). Response: (version, status, reason)."""
    headers: tuple[tuple[str, str], ...]
    """Fields in order, names as sent."""
    _index: dict[str, list[str]] = field(init=False, repr=False, compare=False)
    """Lower-cased name -> the values of its fields in order, built once from `headers`
    (also by `dataclasses.replace`), so a lookup is one dict access, not a scan."""
    _tokens: dict[str, frozenset[str]] = field(init=False, repr=False, compare=False)
    """`tokens` answers, kept: a request's Connection is read five or six times on its way
    (framing, hops, keep-alive), and a head never changes."""

    def __post_init__(self) -> None:
        index: dict[str, list[str]] = {}
        for key, value in self.headers:
            index.setdefault(key.lower(), []).append(value)
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_tokens", {})

    def get(self, name: str) -> str | None:
        values = self._index.get(name.lower())
        return values[0] if values else None

    def get_all(self, name: str) -> list[str]:
        return list(self._index.get(name.lower(), ()))

    def tokens(self, name: str) -> frozenset[str]:
        """Comma-separated tokens of every `name` field, lower-cased (Connection etc.)."""
        name = name.lower()
        found = self._tokens.get(name)
        if found is None:
            found = self._tokens[name] = frozenset(
                t.strip().lower() for v in self._index.get(name, ()) for t in v.split(",")
                if t.strip())
        return found

    @property
    def chunked(self) -> bool:
        return "transfer-encoding" in self._index

    @property
    def content_length(self) -> int | None:
        values = self._index.get("content-length")
        return int(values[0]) if values else None


def _lines(data: bytes) -> list[bytes]:
    if not data.endswith(b"\r\n\r\n"):
        raise HttpError(400, "message head does not end with an empty line")
    head = data[:-4]
    crlf = head.count(b"\r\n")  # every CR and every LF in a CRLF: no line holds either
    if head.count(b"\r") != crlf or head.count(b"\n") != crlf:
        raise HttpError(400, "bare CR or LF in message head; lines must end with CRLF")
    return head.split(b"\r\n")


def _fields(lines: list[bytes]) -> tuple[tuple[str, str], ...]:
    if len(lines) > MAX_FIELDS:
        raise HttpError(431, f"{len(lines)} header fields; at most {MAX_FIELDS}")
    fields = []
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            raise HttpError(400, "obsolete line folding is not accepted")
        name, colon, value = line.partition(b":")
        text = _NAMES.get(name)
        if not colon or (text is None and not _TOKEN.match(name)):
            raise HttpError(400, f"malformed header field {line[:60]!r}",
                            "malformed header field")
        if text is None:
            text = name.decode("ascii")
            if len(name) <= NAME_CACHED:
                if len(_NAMES) >= NAMES_CACHED:
                    _NAMES.clear()
                _NAMES[name] = text
        value = value.strip(b" \t")
        if _FIELD_VALUE_BAD.search(value):
            raise HttpError(400, f"control character in header {text!r}",
                            "control character in a header field")
        fields.append((text, value.decode("latin-1")))
    return tuple(fields)


_NAMES: dict[bytes, str] = {}
"""Field names seen valid (tokens), decoded: most heads repeat the same few, checked once."""
NAMES_CACHED, NAME_CACHED = 512, 64
"""At most this many names kept (then the cache starts again), each at most this many
bytes: names an agent makes up cost what a new name costs, never more."""


def _check_framing(head: Head) -> None:
    named = head.tokens("connection") & FRAMING
    if named:
        raise HttpError(400, f"Connection header names {', '.join(sorted(named))}: a framing "
                        "field cannot be hop-by-hop (request smuggling)")
    lengths = head.get_all("content-length")
    if lengths:  # ASCII digits only: str.isdigit() takes "²", which int() then refuses
        if len(set(lengths)) != 1 or not _DIGITS.fullmatch(lengths[0]):
            raise HttpError(400, f"invalid or conflicting Content-Length {lengths!r}",
                            "invalid or conflicting Content-Length")
        if len(lengths[0]) > 18:
            raise HttpError(400, "Content-Length too large")
    # tokens as written, but for the spaces and tabs around them: str.strip() would also
    # take "\x85" and "\xa0" away, and another parser would not
    codings = [t.strip(" \t").lower() for v in head.get_all("transfer-encoding")
               for t in v.split(",")]
    if codings:
        if codings != ["chunked"]:
            raise HttpError(501, f"Transfer-Encoding {', '.join(codings)!r} is not supported;"
                            " only chunked", "a Transfer-Encoding other than chunked")
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
    if head.chunked and head.start[2] == "HTTP/1.0":  # RFC 9112 §6.1: the framing is faulty
        raise HttpError(400, "Transfer-Encoding in an HTTP/1.0 request is refused (an "
                        "HTTP/1.0 upstream would not read the chunks)")
    return head


def check_request_line(line: bytes) -> None:
    """A request line (without its CRLF) as HTTP/1.x writes it, or HttpError at once: what
    is not HTTP need not wait for the end of a head it will never send."""
    if not _REQUEST_LINE.fullmatch(line):
        raise HttpError(400, f"not an HTTP/1.x request line: {line[:60]!r}")


def parse_response(data: bytes) -> Head:
    """Parse a complete response head from an upstream server."""
    lines = _lines(data)
    version, _, rest = lines[0].partition(b" ")
    status, _, reason = rest.partition(b" ")
    # What is wrong is named, never quoted: an upstream's bytes may hold what the filter
    # attached to the request (a secret), and errors reach the agent and the audit log.
    if not _VERSION.match(version) or not re.fullmatch(rb"[0-9]{3}", status):
        raise HttpError(502, "upstream sent a malformed status line")
    try:
        head = Head((version.decode(), status.decode(), reason.decode("latin-1")),
                    _fields(lines[1:]))
        _check_framing(head)
    except HttpError as exc:
        raise HttpError(502, f"upstream response: {exc.unquoted}") from None
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
    if not _DIGITS.fullmatch(port) or len(port) > 5 or not 0 < int(port) <= 65535:
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


def serialise_response(reply: Head, close: bool = False,
                       keep: frozenset[str] = frozenset()) -> bytes:
    """The upstream's response for the client, as HTTP/1.1, with our own Connection header."""
    _, status, reason = reply.start
    return _serialise(f"HTTP/1.1 {status} {reason}", reply, HOP_BY_HOP, keep, close)


def parse_chunk_size(line: bytes) -> int:
    """The size in a chunk-size line without its CRLF: hex digits, then optional extensions
    (which the proxy drops when it re-serialises the chunk). Raises HttpError: a bare CR or
    LF, a sign, spaces or anything else a lenient parser might read differently."""
    match = _CHUNK_LINE.fullmatch(line)
    if match is None:
        raise HttpError(400, "malformed chunk size line")  # never quoted: see parse_response
    return int(match.group(1), 16)


def check_trailer_line(line: bytes) -> None:
    """A trailer field line without its CRLF (trailers are read to find the end of a chunked
    body, then dropped). Raises HttpError, which never quotes the line: an upstream's
    trailer may hold what the filter attached to the request (a secret)."""
    if b"\r" in line or b"\n" in line:
        raise HttpError(400, "bare CR or LF in a chunked body's trailer")
    try:
        _fields([line])
    except HttpError as exc:
        raise HttpError(exc.status, f"chunked trailer: {exc.unquoted}") from None
