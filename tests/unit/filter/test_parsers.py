"""The pure parsers: HTTP heads and TLS ClientHello, on good, truncated and hostile input."""

from __future__ import annotations

import pytest

from appliance.filter.http import (
    HttpError,
    parse_absolute,
    parse_authority,
    parse_chunk_size,
    parse_request,
    parse_response,
)
from appliance.filter.proxy.sni import TlsError, looks_like_tls, parse_client_hello

from .hello import client_hello, split_records

# -- HTTP ------------------------------------------------------------------------------


def test_request_head_parses():
    head = parse_request(b"GET http://a.example/x?y=1 HTTP/1.1\r\nHost: a.example\r\n"
                         b"Connection: keep-alive, X-Drop\r\nX-Drop: 1\r\nAccept: */*\r\n\r\n")
    assert head.start == ("GET", "http://a.example/x?y=1", "HTTP/1.1")
    assert head.get("HOST") == "a.example"
    assert head.tokens("connection") == {"keep-alive", "x-drop"}


@pytest.mark.parametrize(("raw", "status", "message"), [
    (b"GET / HTTP/1.1\r\nHost: a\r\n x-folded\r\n\r\n", 400, "line folding"),
    (b"GET / HTTP/1.1\r\nHost : a\r\n\r\n", 400, "malformed header"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "more than one Host"),
    (b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400, "conflicting"),
    (b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400, "invalid"),
    (b"GET / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501, "only chunked"),
    (b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", 400,
     "smuggling"),
    (b"GET / HTTP/2.0\r\n\r\n", 505, "HTTP/1.0 or 1.1"),
    (b"GET  / HTTP/1.1\r\n\r\n", 400, "request line"),
    (b"G\x00T / HTTP/1.1\r\n\r\n", 400, "method"),
    (b"GET / HTTP/1.1\nHost: a\r\n\r\n", 400, "bare CR or LF"),
    (b"GET / HTTP/1.1\r\nX: a\x01b\r\n\r\n", 400, "control character"),
    (b"GET /\x7f HTTP/1.1\r\n\r\n", 400, "target"),
    (b"GET /caf\xc3\xa9 HTTP/1.1\r\n\r\n", 400, "target"),  # raw UTF-8: percent-encode it
])
def test_hostile_request_heads_are_refused(raw, status, message):
    with pytest.raises(HttpError, match=message) as info:
        parse_request(raw)
    assert info.value.status == status


def test_response_head_and_framing():
    head = parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert head.chunked and head.start[1] == "200"
    with pytest.raises(HttpError) as info:
        parse_response(b"HTTP/1.1 2000 OK\r\n\r\n")
    assert info.value.status == 502


@pytest.mark.parametrize(("target", "expected"), [
    ("http://a.example/x", ("a.example", 80, "/x")),
    ("http://a.example:8080", ("a.example", 8080, "/")),
    ("HTTP://a.example?q=1", ("a.example", 80, "/?q=1")),
    ("http://[2001:db8::1]:81/p#frag", ("2001:db8::1", 81, "/p")),
])
def test_absolute_uris(target, expected):
    parsed = parse_absolute(target)
    assert (parsed.host, parsed.port, parsed.path) == expected


@pytest.mark.parametrize(("target", "message"), [
    ("https://a.example/", "use CONNECT"),
    ("http://user@evil.example/", "credentials"),
    ("/relative", "absolute URI"),
    ("http://a.example:99999/", "invalid port"),
])
def test_bad_absolute_uris(target, message):
    with pytest.raises(HttpError, match=message):
        parse_absolute(target)


def test_authority_needs_port_for_connect():
    assert parse_authority("a.example:443", None) == ("a.example", 443)
    with pytest.raises(HttpError, match="needs a port"):
        parse_authority("a.example", None)


@pytest.mark.parametrize(("line", "size"), [(b"0", 0), (b"1a;ext=1", 26), (b"FFFF", 65535)])
def test_chunk_sizes(line, size):
    assert parse_chunk_size(line) == size


@pytest.mark.parametrize("line", [b"", b"-1", b"0x10", b"1" * 17, b"zz"])
def test_bad_chunk_sizes(line):
    with pytest.raises(HttpError):
        parse_chunk_size(line)


# -- ClientHello -----------------------------------------------------------------------


def test_real_client_hello_gives_sni_and_alpn():
    hello = client_hello("Example.COM")
    assert looks_like_tls(hello)
    parsed = parse_client_hello(hello)
    assert parsed.sni == "example.com" and parsed.alpn == ("h2", "http/1.1")
    assert parsed.length == len(hello)


def test_client_hello_without_sni():
    assert parse_client_hello(client_hello(None)).sni is None


def test_every_truncation_asks_for_more_bytes():
    hello = client_hello("example.com")
    for cut in range(len(hello)):
        assert parse_client_hello(hello[:cut]) is None, cut


def test_hello_split_over_records_is_reassembled():
    hello = split_records(client_hello("split.example"), 50)
    assert parse_client_hello(hello).sni == "split.example"
    for cut in range(0, len(hello), 7):
        assert parse_client_hello(hello[:cut]) is None


def _with_extension(hello: bytes, ext_type: int, data: bytes) -> bytes:
    """Append an extension to a real ClientHello, fixing every enclosing length."""
    body = bytearray(hello[9:])  # after record header (5) and handshake header (4)
    pos = 2 + 32
    pos += 1 + body[pos]
    pos += 2 + int.from_bytes(body[pos : pos + 2], "big")
    pos += 1 + body[pos]
    ext_len = int.from_bytes(body[pos : pos + 2], "big")
    extra = ext_type.to_bytes(2, "big") + len(data).to_bytes(2, "big") + data
    body[pos : pos + 2] = (ext_len + len(extra)).to_bytes(2, "big")
    body += extra
    handshake = b"\x01" + len(body).to_bytes(3, "big") + bytes(body)
    return b"\x16\x03\x01" + len(handshake).to_bytes(2, "big") + handshake


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda h: b"\x17" + h[1:], "not a TLS handshake record"),
    (lambda h: h[:5] + b"\x02" + h[6:], "not ClientHello"),
    (lambda h: h[:3] + b"\x00\x00" + h[5:], "invalid TLS record length"),
    (lambda h: _with_extension(h, 0xFE0D, b"\x00"), "ECH"),
    (lambda h: _with_extension(h, 0x0000, b"\x00\x05\x00\x00\x02ab"), "appears twice"),
])
def test_hostile_client_hellos_are_refused(mutate, message):
    with pytest.raises(TlsError, match=message):
        parse_client_hello(mutate(client_hello("example.com")))


def test_sni_must_be_a_valid_name():
    hello = client_hello(None)
    ip_name = b"\x00\x0c\x00\x00\x09127.0.0.1"  # list len, type 0, len 9, "127.0.0.1"
    with pytest.raises(TlsError, match="IP address"):
        parse_client_hello(_with_extension(hello, 0x0000, ip_name))
    bad = b"\x00\x08\x00\x00\x05a b.c"
    with pytest.raises(TlsError, match="invalid server name"):
        parse_client_hello(_with_extension(hello, 0x0000, bad))


def test_oversized_hello_is_refused():
    giant = b"\x16\x03\x01\x40\x00" + b"\x01\xff\xff\xff" + b"\x00" * 16380
    with pytest.raises(TlsError, match="larger than 32 KiB"):
        parse_client_hello(giant)


@pytest.mark.parametrize("raw", [
    b"HTTP/1.1 200 OK\r\nsk-SECRET\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: sk-SECRET\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: sk-SECRET\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nsk-SECRET: \x01\r\n\r\n",
    b"sk-SECRET 200 OK\r\n\r\n",
])
def test_what_an_upstream_sent_is_named_never_quoted(raw):
    """An upstream's bytes may hold a secret the filter attached: errors go to the agent
    and the audit log."""
    with pytest.raises(HttpError) as info:
        parse_response(raw)
    assert info.value.status == 502 and "SECRET" not in str(info.value)
