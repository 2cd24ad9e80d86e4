"""Head's lookups by lower-cased name read exactly what a scan of its fields in order reads;
the parser's lines and fields are read, and refused, exactly as one line at a time."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.filter import http
from appliance.filter.http import Head, HttpError, parse_request

NAMES = ["Host", "Connection", "Content-Length", "Transfer-Encoding", "X-A", "Upgrade", "TE"]


def _cased(name: str) -> st.SearchStrategy[str]:
    return st.lists(st.booleans(), min_size=len(name), max_size=len(name)).map(
        lambda upper: "".join(c.upper() if u else c.lower()
                              for c, u in zip(name, upper, strict=True)))


fields = st.lists(st.tuples(
    st.sampled_from(NAMES).flatmap(_cased),
    st.one_of(st.from_regex(r"[0-9]{1,3}", fullmatch=True),
              st.text(alphabet="abc, \t\xa0Kk", max_size=12))), max_size=12)


def _scan_all(head: Head, name: str) -> list[str]:
    return [v for k, v in head.headers if k.lower() == name.lower()]


def _outcome(call):
    try:
        return call()
    except ValueError as exc:
        return type(exc)


def _reads_like_a_scan(head: Head) -> None:
    for name in [*NAMES, "host", "CONTENT-LENGTH", "absent"]:
        values = _scan_all(head, name)
        assert head.get_all(name) == values
        assert head.get(name) == (values[0] if values else None)
        assert head.tokens(name) == {t.strip().lower() for v in values for t in v.split(",")
                                     if t.strip()}
    assert head.chunked == bool(_scan_all(head, "transfer-encoding"))
    lengths = _scan_all(head, "content-length")
    assert _outcome(lambda: head.content_length) == _outcome(
        lambda: int(lengths[0]) if lengths else None)


@settings(max_examples=300)
@given(fields)
def test_lookups_by_name_equal_a_scan_in_order(headers):
    _reads_like_a_scan(Head(("GET", "/", "HTTP/1.1"), tuple(headers)))


@settings(max_examples=100)
@given(fields, fields)
def test_a_replaced_head_is_indexed_from_its_new_fields(before, after):
    head = replace(Head(("GET", "/", "HTTP/1.1"), tuple(before)), headers=tuple(after))
    _reads_like_a_scan(head)


def test_the_index_is_not_part_of_equality_hash_or_repr():
    head = parse_request(b"GET / HTTP/1.1\r\nHost: a\r\nX-A: 1\r\nx-a: 2\r\n\r\n")
    same = Head(head.start, head.headers)
    assert head == same and hash(head) == hash(same)
    assert repr(head) == ("Head(start=('GET', '/', 'HTTP/1.1'), headers=(('Host', 'a'), "
                          "('X-A', '1'), ('x-a', '2')))")
    assert head.get_all("x-A") == ["1", "2"]
    head.get_all("x-a").append("3")  # a caller's list is its own
    assert head.get_all("x-a") == ["1", "2"]


# -- the head's lines and fields read as a line-by-line reading reads them ---------------------

_TOKEN = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_FIELD_VALUE_BAD = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def _lines_one_by_one(data: bytes) -> list[bytes]:
    if not data.endswith(b"\r\n\r\n"):
        raise HttpError(400, "message head does not end with an empty line")
    lines = data[:-4].split(b"\r\n")
    for line in lines:
        if b"\n" in line or b"\r" in line:
            raise HttpError(400, "bare CR or LF in message head; lines must end with CRLF")
    return lines


def _fields_one_by_one(lines: list[bytes]) -> tuple[tuple[str, str], ...]:
    fields = []
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            raise HttpError(400, "obsolete line folding is not accepted")
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.match(name):
            raise HttpError(400, f"malformed header field {line[:60]!r}",
                            "malformed header field")
        value = value.strip(b" \t")
        if _FIELD_VALUE_BAD.search(value):
            raise HttpError(400, f"control character in header {name.decode()!r}",
                            "control character in a header field")
        fields.append((name.decode("ascii"), value.decode("latin-1")))
    return tuple(fields)


def _reading(call):
    try:
        return call()
    except HttpError as exc:
        return ("refused", exc.status, str(exc), exc.unquoted)


head_bytes = st.lists(st.sampled_from(
    [b"\r\n", b"\r", b"\n", b":", b" ", b"\t", b"Host", b"X-A", b"x-a", b"a b", b"\x00",
     b"\x7f", b"\xe9", b"v"]), max_size=16).map(b"".join)


@settings(max_examples=500)
@given(head_bytes, st.booleans())
def test_lines_are_split_and_refused_as_one_by_one(body, ended):
    data = body + (b"\r\n\r\n" if ended else b"")
    assert _reading(lambda: http._lines(data)) == _reading(lambda: _lines_one_by_one(data))


@settings(max_examples=500)
@given(st.lists(head_bytes, max_size=6))
def test_fields_are_read_and_refused_as_one_by_one(lines):
    lines = [line.replace(b"\r", b"").replace(b"\n", b"") for line in lines]
    for _ in range(2):  # the second time, the names are known
        assert _reading(lambda: http._fields(lines)) == _reading(
            lambda: _fields_one_by_one(lines))


def test_known_names_never_stand_for_a_line_without_a_colon():
    http._fields([b"Host: a"])
    with pytest.raises(HttpError, match="malformed header field"):
        http._fields([b"Host"])
