"""TLS ClientHello parsing: the server name, without terminating TLS.

`parse_client_hello(buf)` takes the bytes a client sent so far and returns NEED_MORE, a
ClientHello, or raises TlsError. It reassembles a handshake message split over several
records (post-quantum key shares make ClientHellos big), and bounds how much it will buffer.
ECH and ESNI are refused: they hide the real server name behind a public one, which is
domain fronting by design.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.policy import HostNameError, normalise_name, parse_address

MAX_HELLO = 32 * 1024
EXT_SERVER_NAME = 0x0000
EXT_ALPN = 0x0010
EXT_ECH = 0xFE0D
EXT_ESNI = 0xFFCE

NEED_MORE = None


class TlsError(ValueError):
    """Not a usable ClientHello; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class ClientHello:
    sni: str | None
    """Normalised server name, or None when the client sent none."""
    alpn: tuple[str, ...]
    length: int
    """Bytes of the records that carried the ClientHello."""


def looks_like_tls(first: bytes) -> bool:
    """A TLS handshake record starts 0x16 0x03."""
    return len(first) >= 2 and first[0] == 0x16 and first[1] == 0x03


def _reassemble(buf: bytes) -> tuple[bytes, int] | None:
    """Concatenate handshake record payloads until one whole handshake message is there."""
    payload = bytearray()
    offset = 0
    while True:
        if len(buf) < offset + 5:
            return NEED_MORE
        ctype, major = buf[offset], buf[offset + 1]
        length = int.from_bytes(buf[offset + 3 : offset + 5], "big")
        if ctype != 0x16 or major != 3:
            raise TlsError("not a TLS handshake record" if offset == 0
                           else "ClientHello interrupted by a non-handshake record")
        if length == 0 or length > 16384 + 256:
            raise TlsError(f"invalid TLS record length {length}")
        if len(buf) < offset + 5 + length:
            if offset + 5 + length > MAX_HELLO:
                raise TlsError("ClientHello larger than 32 KiB")
            return NEED_MORE
        payload += buf[offset + 5 : offset + 5 + length]
        offset += 5 + length
        if len(payload) >= 4:
            if payload[0] != 0x01:
                raise TlsError(f"first handshake message is type {payload[0]}, not ClientHello")
            need = 4 + int.from_bytes(payload[1:4], "big")
            if need > MAX_HELLO:
                raise TlsError("ClientHello larger than 32 KiB")
            if len(payload) >= need:
                return bytes(payload[4:need]), offset
        if offset >= MAX_HELLO:
            raise TlsError("ClientHello larger than 32 KiB")


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.data):
            raise TlsError(f"ClientHello truncated in {what}")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def int(self, n: int, what: str) -> int:
        return int.from_bytes(self.take(n, what), "big")

    def vector(self, size_bytes: int, what: str) -> bytes:
        return self.take(self.int(size_bytes, what), what)


def parse_client_hello(buf: bytes) -> ClientHello | None:
    found = _reassemble(buf)
    if found is NEED_MORE:
        return NEED_MORE
    body, length = found
    r = _Reader(body)
    r.take(2, "version")
    r.take(32, "random")
    if len(r.vector(1, "session id")) > 32:
        raise TlsError("session id longer than 32 bytes")
    suites = r.vector(2, "cipher suites")
    if not suites or len(suites) % 2:
        raise TlsError("malformed cipher suite list")
    r.vector(1, "compression methods")
    sni: str | None = None
    alpn: tuple[str, ...] = ()
    if r.pos == len(body):
        return ClientHello(None, (), length)  # no extensions at all (SSL 3 style)
    extensions = _Reader(r.vector(2, "extensions"))
    if r.pos != len(body):
        raise TlsError("trailing bytes after extensions")
    seen: set[int] = set()
    while extensions.pos < len(extensions.data):
        ext_type = extensions.int(2, "extension type")
        data = extensions.vector(2, "extension data")
        if ext_type in seen:
            raise TlsError(f"extension {ext_type} appears twice")
        seen.add(ext_type)
        if ext_type in (EXT_ECH, EXT_ESNI):
            raise TlsError("encrypted ClientHello (ECH/ESNI) hides the server name")
        if ext_type == EXT_SERVER_NAME:
            sni = _server_name(data)
        elif ext_type == EXT_ALPN:
            alpn = _alpn(data)
    return ClientHello(sni, alpn, length)


def _server_name(data: bytes) -> str | None:
    r = _Reader(data)
    names = _Reader(r.vector(2, "server name list"))
    if r.pos != len(data):
        raise TlsError("trailing bytes in server_name extension")
    host = None
    while names.pos < len(names.data):
        name_type = names.int(1, "server name type")
        value = names.vector(2, "server name")
        if name_type != 0:
            continue
        if host is not None:
            raise TlsError("more than one host_name in server_name")
        try:
            text = value.decode("ascii")
        except UnicodeDecodeError:
            raise TlsError("server name is not ASCII") from None
        if parse_address(text) is not None:
            raise TlsError("server name is an IP address (forbidden by RFC 6066)")
        try:
            host = normalise_name(text)
        except HostNameError as exc:
            raise TlsError(f"invalid server name: {exc}") from None
    return host


def _alpn(data: bytes) -> tuple[str, ...]:
    r = _Reader(data)
    protocols = _Reader(r.vector(2, "ALPN list"))
    out = []
    while protocols.pos < len(protocols.data):
        out.append(protocols.vector(1, "ALPN protocol").decode("ascii", "replace"))
    return tuple(out)
