"""A request body as the origin will read it: its declared content codings undone, and the
parts of a multipart body. Sans-IO: bytes in, bytes (or parts) out, or `Unreadable`.

The leak scanner and the method-override reader look at what the origin decodes, not at
the bytes on the wire: a form posted with `Content-Encoding: gzip` is a form to a server
that inflates request bodies (Jetty's GzipHandler, Django with a middleware, a Rack
middleware, many API gateways), and a multipart part sent `Content-Transfer-Encoding:
base64` is its decoded value to a mail-style parser. What cannot be decoded is refused by
the caller wherever reading matters (THREATS 14: a scanner that cannot decode denies).

- **Codings** (`decode`): `gzip` and `x-gzip` (several members, as gzip(1) concatenates
  them), `deflate` (zlib-wrapped as RFC 9110 says, or raw, as some clients send it) and
  `identity`, in any stack (`gzip, deflate` is undone in reverse). `br`, `zstd`,
  `compress` and anything else: no decoder here, so `Unreadable`. Bounded: each layer's
  output at most `limit` bytes and at most `MAX_RATIO` times its input (a bomb is refused
  before it is inflated, not after).
- **Multipart** (`parts`): split on the boundary wherever the delimiter appears, CRLF or
  bare LF line ends, header names in any case, `name` and RFC 7578/5987 `name*`, values
  with their transfer encoding (base64, quoted-printable) undone. Lenient on purpose: a
  part a strict parser would skip is still looked at, and one more part read is only one
  more thing judged.
"""

from __future__ import annotations

import base64
import binascii
import quopri
import re
import zlib
from dataclasses import dataclass
from urllib.parse import unquote

from ..http import Head

MAX_PARTS = 1000
"""The most parts a multipart body may have to be read (Werkzeug's own default cap): more is
`Unreadable`, refused where reading matters."""
MAX_RATIO = 1000
"""The most a layer of coding may expand (zlib's own ceiling is 1032:1; a stack of layers
multiplies, which is how bombs are built)."""
IDENTITY = "identity"
_GZIP_MAGIC = b"\x1f\x8b"


class Unreadable(ValueError):
    """A body the filter cannot read as the origin would; the message says why (it never
    quotes the body)."""


def codings(head: Head) -> list[str]:
    """The content codings a message declares, in the order they were applied (every
    Content-Encoding field, comma-separated, lower-cased; `identity` left out)."""
    found = [t.strip(" \t").lower() for v in head.get_all("content-encoding")
             for t in v.split(",")]
    return [c for c in found if c and c != IDENTITY]


def decode(body: bytes, applied: list[str], limit: int) -> bytes:
    """`body` with `applied` codings undone (the last applied first). Raises Unreadable."""
    for coding in reversed(applied):
        if coding in ("gzip", "x-gzip"):
            body = _gunzip(body, limit)
        elif coding == "deflate":
            body = _inflate(body, limit)
        else:
            raise Unreadable(f"Content-Encoding {coding[:20]!r}, which the filter cannot "
                             "decode (it reads gzip and deflate)")
    return body


def _bounded(decoder, data: bytes, limit: int, coding: str) -> bytes:
    cap = min(limit, max(len(data), 1) * MAX_RATIO)
    try:
        out = decoder.decompress(data, cap + 1)
    except zlib.error:
        raise Unreadable(f"a body that is not valid {coding}") from None
    if len(out) > cap or decoder.unconsumed_tail:
        raise Unreadable(f"a {coding} body that expands past " + (
            f"{limit} bytes" if cap == limit else f"{MAX_RATIO} times its size"))
    if not decoder.eof:
        raise Unreadable(f"a {coding} body that ends before its stream does")
    return out


def _gunzip(data: bytes, limit: int) -> bytes:
    out = b""
    while True:
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
        out += _bounded(decoder, data, limit - len(out), "gzip")
        data = decoder.unused_data
        if not data:
            return out
        if not data.startswith(_GZIP_MAGIC):  # servers differ on trailing bytes: refuse
            raise Unreadable("bytes after the gzip stream that are not another gzip member")


def _inflate(data: bytes, limit: int) -> bytes:
    for wbits in (zlib.MAX_WBITS, -zlib.MAX_WBITS):  # zlib-wrapped, else raw deflate
        decoder = zlib.decompressobj(wbits)
        try:
            out = _bounded(decoder, data, limit, "deflate")
        except Unreadable:
            if wbits > 0:
                continue
            raise
        if decoder.unused_data:
            raise Unreadable("bytes after the deflate stream")
        return out
    raise AssertionError("unreachable")


# -- multipart ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Part:
    names: tuple[str, ...]
    """Every `name` (and decoded `name*`) its Content-Disposition gives: parsers keep the
    first or the last."""
    value: bytes
    """Its content, transfer encoding undone."""
    encoded: bool = False
    """Whether a transfer encoding was undone (its raw bytes hid the value)."""


_PARAM = re.compile(r';\s*([!#$%&\'*+.^_`|~0-9A-Za-z-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


def params(value: str) -> list[tuple[str, str]]:
    """The `; name=value` parameters of a field value (media type, disposition), names
    lower-cased, quoted strings unquoted, in order (duplicates kept)."""
    found = []
    for name, raw in _PARAM.findall(value):
        raw = raw.strip()
        if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        found.append((name.lower(), raw))
    return found


def boundary(content_type: str) -> str:
    """The boundary a multipart Content-Type names. Raises Unreadable: none, several, or
    one no RFC 2046 boundary could be."""
    found = {v for k, v in params(content_type) if k == "boundary"}
    if len(found) != 1:
        raise Unreadable("a multipart body whose Content-Type names " + (
            "no boundary" if not found else "more than one boundary"))
    value = found.pop()
    if not 0 < len(value) <= 200:
        raise Unreadable("a multipart boundary of no or more than 200 characters")
    return value


def parts(body: bytes, mark: str) -> list[Part]:
    """The parts of a multipart body with boundary `mark`. Raises Unreadable when a part's
    head cannot be read."""
    delimiter = b"--" + mark.encode("latin-1")
    chunks = body.split(delimiter, MAX_PARTS + 1)
    if len(chunks) > MAX_PARTS + 1 and not chunks[-1].startswith(b"--"):
        raise Unreadable(f"a multipart body of more than {MAX_PARTS} parts")
    found = []
    for chunk in chunks[1:]:  # the preamble before the first delimiter is no part
        if chunk.startswith(b"--"):  # the close delimiter: the epilogue follows
            break
        chunk = chunk[2:] if chunk.startswith(b"\r\n") else chunk.removeprefix(b"\n")
        head, value = _split_head(chunk)
        if value.endswith(b"\r\n"):
            value = value[:-2]
        elif value.endswith(b"\n"):
            value = value[:-1]
        fields = _part_fields(head)
        names = []
        for name, field in fields:
            if name == "content-disposition":
                for key, raw in params(";" + field.partition(";")[2]):
                    if key == "name":
                        names.append(raw)
                    elif key == "name*":
                        names.append(unquote(raw.rpartition("'")[2], errors="replace"))
        transfer = next((v.strip().lower() for k, v in fields
                         if k == "content-transfer-encoding"), "")
        encoded = transfer in ("base64", "quoted-printable")
        found.append(Part(tuple(names), _transfer_decoded(value, transfer), encoded))
    return found


def _split_head(chunk: bytes) -> tuple[bytes, bytes]:
    ends = [i for i in (chunk.find(b"\r\n\r\n"), chunk.find(b"\n\n")) if i >= 0]
    if chunk.startswith((b"\r\n", b"\n")):  # a part with no fields
        return b"", chunk[2 if chunk.startswith(b"\r\n") else 1:]
    if not ends:
        raise Unreadable("a multipart part whose head does not end")
    at = min(ends)
    gap = 4 if chunk[at:at + 4] == b"\r\n\r\n" else 2
    return chunk[:at], chunk[at + gap:]


def _part_fields(head: bytes) -> list[tuple[str, str]]:
    fields = []
    for line in re.split(rb"\r?\n", head):
        if not line.strip():
            continue
        name, colon, value = line.partition(b":")
        if not colon:
            raise Unreadable("a multipart part with a header line that is no field")
        fields.append((name.strip().decode("latin-1").lower(), value.decode("latin-1")))
    return fields


def _transfer_decoded(value: bytes, transfer: str) -> bytes:
    try:
        if transfer == "base64":
            return base64.b64decode(b"".join(value.split()) + b"==")
        if transfer == "quoted-printable":
            return quopri.decodestring(value)
    except (binascii.Error, ValueError):
        raise Unreadable(f"a multipart part that is not valid {transfer}") from None
    return value
