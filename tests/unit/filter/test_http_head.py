"""Head's lookups by lower-cased name read exactly what a scan of its fields in order reads."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.filter.http import Head, parse_request

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
