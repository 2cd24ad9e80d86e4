"""What one request head may cost the event loop (DESIGN 10: about a millisecond).

A 64 KiB head (the default `max_header_bytes`) of 13,000 one-byte fields took
`parse_request` 13 ms before fields were capped; while one session sent such heads,
another session's cached DNS answers went from p99 0.35 ms to 6.8 ms (20x), and a burst
of 16 heads completing together held the loop ~60 ms (measured by the red team with the
real filter). The number of fields is capped (http.MAX_FIELDS) as nginx, Node and Go do."""

from __future__ import annotations

import pytest

from appliance.filter.http import MAX_FIELDS, HttpError, parse_request


def test_a_head_of_thousands_of_fields_is_refused_before_it_is_parsed():
    head = b"GET / HTTP/1.1\r\nHost: a.test\r\n" + b"a:b\r\n" * 13000 + b"\r\n"
    with pytest.raises(HttpError) as refused:
        parse_request(head)
    assert refused.value.status == 431


def test_a_head_at_the_cap_is_accepted():
    head = (b"GET / HTTP/1.1\r\nHost: a.test\r\n" + b"a:b\r\n" * (MAX_FIELDS - 1) + b"\r\n")
    assert len(parse_request(head).headers) == MAX_FIELDS
