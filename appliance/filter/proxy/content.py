"""A request body as the origin will read it: its declared content codings undone, and the
parts of a multipart body. Sans-IO: bytes in, bytes (or parts) out, or `Unreadable`.

The leak scanner and the method-override reader look at what the origin decodes, not at
the bytes on the wire: a form posted with `Content-Encoding: gzip` is a form to a server
that inflates request bodies (Jetty's GzipHandler, Django with a middleware, a Rack
middleware, many API gateways), and a multipart part sent `Content-Transfer-Encoding:
base64` is its decoded value to a mail-style parser. What cannot be decoded is refused by
the caller wherever reading matters (THREATS 14: a scanner that cannot decode denies).

- **Codings** (`decode`): `gzip` and `x-gzip` (up to `MAX_MEMBERS` members, as gzip(1)
  concatenates them), `deflate` (zlib-wrapped as RFC 9110 says, or raw, as some clients send it) and
  `identity`, in any stack (`gzip, deflate` is undone in reverse). `br`, `zstd`,
  `compress` and anything else: no decoder here, so `Unreadable`. Bounded: each layer's
  output at most `limit` bytes and at most `MAX_RATIO` times its input (a bomb is refused
  before it is inflated, not after).
- **Multipart** (`boundaries`, `parts`): split on every boundary a server may read in the
  Content-Type (the `boundary` parameter, also after a `,` and RFC 2231/2047-encoded as
  Commons FileUpload reads it; PHP's first `boundary` anywhere, even inside `xboundary=`;
  Rack's last `boundary=`), wherever the delimiter appears, also past the close delimiter
  (PHP reads on from the next delimiter line); CRLF or bare LF line ends, folded header
  lines unfolded, header names in any case; a part's names from `name`, RFC 7578/5987
  `name*` and RFC 2231 continuations (Go joins them; RFC 2047 words decoded, as Commons
  FileUpload decodes them), `Content-ID`
  (Rack's name for a part without a disposition), and `_method` wherever its head spells
  it as a word (PHP's quoting and Rack's regexes find names an RFC reading does not);
  values with their transfer encoding (base64, quoted-printable) undone. Lenient on
  purpose: a part a strict parser would skip is still looked at, and one more part read is
  only one more thing judged.
"""

from __future__ import annotations

import base64
import binascii
import email.errors
import email.header
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
MAX_MEMBERS = 64
"""gzip members read in one body (gzip(1) writes one per file it concatenates): each one
copies what follows it, so a MiB of 24-byte members cost a judge's thread ~0.7 s."""
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
    out, size = [], 0  # joined once: appending each member to all before it is quadratic
    while True:
        if len(out) == MAX_MEMBERS:
            raise Unreadable(f"a gzip body of more than {MAX_MEMBERS} members")
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
        out.append(_bounded(decoder, data, limit - size, "gzip"))
        size += len(out[-1])
        data = decoder.unused_data
        if not data:
            return b"".join(out)
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
    """Every name a server may give it (see the module): parsers keep the first or the
    last."""
    value: bytes
    """Its content, transfer encoding undone."""
    encoded: bool = False
    """Whether a transfer encoding was undone (its raw bytes hid the value)."""


_PARAM = re.compile(r'[;,]\s*([!#$%&\'*+.^_`|~0-9A-Za-z-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;,]*)')
_PIECE = re.compile(r"(.+)\*([0-9]{1,3})(\*?)")
MAX_BOUNDARIES = 4
"""Distinct boundaries read in one Content-Type (a client sends one; each costs a pass
over the body)."""


def params(value: str) -> list[tuple[str, str]]:
    """The `; name=value` parameters of a field value (media type, disposition; `,`
    separates them too, as Commons FileUpload reads them), names lower-cased, quoted
    strings unquoted, in order (duplicates kept). An RFC 2231 `name*` is given as `name`
    with its value decoded, its continuations `name*0`, `name*1*`... joined as `name` (after
    the others), and an RFC 2047 encoded word in a value is given decoded too (after the
    value as written)."""
    found, pieces = [], {}
    for name, raw in _PARAM.findall(value):
        raw, name = raw.strip(), name.lower()
        if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        if (piece := _PIECE.fullmatch(name)) is not None:  # RFC 2231: name*0, name*1*, ...
            if piece[3]:
                raw = unquote(raw.rpartition("'")[2] if piece[2] == "0" else raw,
                              errors="replace")
            pieces.setdefault(piece[1], {})[int(piece[2])] = raw
            continue
        if name.endswith("*"):
            name, raw = name[:-1], unquote(raw.rpartition("'")[2], errors="replace")
        found.append((name, raw))
        if "=?" in raw:
            found.append((name, _encoded_words(raw)))
    for name, parts_of in pieces.items():  # joined from 0 while they follow on (Go's way)
        joined, n = [], 0
        while n in parts_of:
            joined.append(parts_of[n])
            n += 1
        found.append((name, "".join(joined)))
    return found


def _encoded_words(text: str) -> str:
    """`text` with its RFC 2047 encoded words decoded (as written when they cannot be)."""
    try:
        return str(email.header.make_header(email.header.decode_header(text)))
    except (ValueError, LookupError, UnicodeError, email.errors.HeaderParseError):
        return text


def boundaries(content_type: str) -> list[str]:
    """Every boundary a server may read in a multipart Content-Type (see the module).
    Raises Unreadable: none, more than MAX_BOUNDARIES, or one no RFC 2046 boundary could
    be."""
    found = [v for k, v in params(content_type) if k == "boundary"]
    at = content_type.find("boundary")  # PHP: case-sensitive first, then in any case
    at = at if at >= 0 else content_type.lower().find("boundary")
    equals = content_type.find("=", at) if at >= 0 else -1
    if equals >= 0:
        rest = content_type[equals + 1:]
        if rest.startswith('"'):
            if '"' in rest[1:]:
                found.append(rest[1:].partition('"')[0])
        else:
            found.append(re.split(r"[,;]", rest, maxsplit=1)[0])
    rack = re.search(r'.*boundary="?([^";,]+)', content_type, re.IGNORECASE | re.DOTALL)
    if rack is not None:
        found.append(rack[1])
    marks = [m for m in dict.fromkeys(found) if m]
    if not marks:
        raise Unreadable("a multipart body whose Content-Type names no boundary")
    if len(marks) > MAX_BOUNDARIES:
        raise Unreadable(f"a multipart Content-Type that servers read as more than "
                         f"{MAX_BOUNDARIES} boundaries")
    if any(len(m) > 200 for m in marks):
        raise Unreadable("a multipart boundary of more than 200 characters")
    return marks


_METHOD_WORD = re.compile(rb"(?<![A-Za-z0-9_\[\]])[\[\]]*[_.\[]method(?![A-Za-z0-9_.])",
                          re.IGNORECASE)
"""`_method` spelt as PHP or Rack 2 keys it, as a name of its own (not `a[_method]`, a key
inside another), anywhere in a part's head."""


def parts(body: bytes, mark: str) -> list[Part]:
    """The parts of a multipart body with boundary `mark`. Raises Unreadable when a part's
    head cannot be read."""
    delimiter = b"--" + mark.encode("latin-1")
    chunks = body.split(delimiter, MAX_PARTS + 1)
    if len(chunks) > MAX_PARTS + 1 and not chunks[-1].startswith(b"--"):
        raise Unreadable(f"a multipart body of more than {MAX_PARTS} parts")
    found = []
    for chunk in chunks[1:]:  # the preamble before the first delimiter is no part
        if chunk.startswith(b"--"):  # a close delimiter: PHP reads on at the next one
            continue
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
                names += [raw for key, raw in params(";" + field.partition(";")[2])
                          if key == "name"]
            elif name == "content-id":  # Rack's name for a part no disposition names
                names.append(field.strip())
        if _METHOD_WORD.search(head):
            names.append("_method")
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
    """The fields of a part's head, a line that starts with a space or a tab joined to the
    one before it (PHP, Commons FileUpload and Go unfold them)."""
    fields = []
    for line in re.split(rb"\r?\n(?![ \t])", head):
        line = re.sub(rb"\r?\n[ \t]", b" ", line)
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
