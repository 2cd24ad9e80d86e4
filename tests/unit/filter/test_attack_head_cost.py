"""What one request head may cost the event loop (DESIGN 10: about a millisecond).

A 64 KiB head (the default `max_header_bytes`) of 13,000 one-byte fields took
`parse_request` 13 ms before fields were capped; while one session sent such heads,
another session's cached DNS answers went from p99 0.35 ms to 6.8 ms (20x), and a burst
of 16 heads completing together held the loop ~60 ms (measured by the red team with the
real filter). The number of fields is capped (http.MAX_FIELDS) as nginx, Node and Go do."""

from __future__ import annotations

import sys

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


# -- a body read on the loop ----------------------------------------------------------------


def _body_cases(size: int):
    from appliance.filter.http import parse_request as parse

    def typed(content_type: str):
        return parse(f"POST /x HTTP/1.1\r\nHost: a\r\nContent-Type: {content_type}\r\n\r\n"
                     .encode())

    form = typed("application/x-www-form-urlencoded")
    multipart = typed("multipart/form-data; boundary=z")
    return [
        (b"%5f=x&" * (size // 6), form),  # every name escaped: each one decoded
        (b"_method=x&" * (size // 10), form),
        (b"--z\r\n\r\n" * (size // 7), multipart),  # a part every 7 bytes
        (b"--z\r\n" + b"a:b\r\n" * (size // 5), multipart),
        (b'--z\r\nContent-Disposition: form-data; name="_method"\r\n\r\nx\r\n' * (size // 60),
         multipart),
        (b"{" + b'"_method":"x",' * (size // 15) + b'"a":1}', typed("application/json")),
        (b"AKIA" * (size // 4), typed("text/plain")),
        (b"eyJ" * (size // 3), typed("text/plain")),
    ]


def test_the_largest_body_read_on_the_loop_costs_it_well_under_a_millisecond():
    """Bodies up to forward.OFF_LOOP are read (reading.examine) on the event loop, the rest
    on a judge's thread. At 64 KiB a multipart body of empty parts or a form of escaped
    names cost the loop 20-25 ms; the readers cost up to ~0.4 µs a byte. Counted, not
    timed (a timed assert fails on a busy machine): the Python and C calls the reading
    makes, at most CALLS_PER_BYTE a byte (about 5 today, for a multipart body of empty
    parts), so that the largest body read on the loop stays far under a millisecond."""
    from appliance.filter.proxy.forward import OFF_LOOP
    from appliance.filter.proxy.leaks import Leaks
    from appliance.filter.proxy.reading import examine

    assert OFF_LOOP <= 4096  # beyond, a body is read on a judge's thread
    leaks = Leaks({"A": b"s3cr3tvalue123456"})
    for body, typed in _body_cases(OFF_LOOP):
        calls = _calls(examine, body, typed, leaks, True)
        assert calls <= CALLS_PER_BYTE * len(body), (body[:30], calls)


CALLS_PER_BYTE = 8


def _calls(work, *args) -> int:
    """The Python and C calls `work(*args)` makes: a cost that a busy machine does not
    change, as it changes a time."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        work(*args)
    finally:
        sys.setprofile(None)
    return calls


# -- what a head asks for, read on the loop -------------------------------------------------


def _inspected(rules: str):
    from appliance.policy import DEFAULT_RULES, Policy, dedupe, parse_host, policy_file_rules

    text = f'[http]\nallow = ["a.test"]\n[[inspect]]\nhost = "a.test"\n{rules}'
    return Policy(dedupe([*DEFAULT_RULES, *policy_file_rules(text, "p.toml", "project")])
                  ).inspection(parse_host("a.test"))


def _query(item: str, size: int) -> str:
    """A query of `size` bytes or so, of `item` ({i}: a number, so that items differ)."""
    out, i = [], 0
    while sum(map(len, out)) < size:
        out.append(item.format(i=i))
        i += 1
    return "&".join(out)


@pytest.mark.parametrize("item", ["%5f=x", "_method=x", "_method=a{i}", "_method{i}=x",
                                  "%5fmethod{i}=x", "method[{i}=x"])
@pytest.mark.parametrize("where", ["target", "rewrite"])
@pytest.mark.parametrize("rules", ["", 'deny = ["DELETE /**"]\n'])
def test_what_a_head_asks_to_be_read_as_costs_the_loop_well_under_a_millisecond(
        item, where, rules):
    """What the proxy does on the loop per request to an inspected host (forward._judged_as):
    the queries of the target and of its rewrite fields read for `_method` once
    (asked_methods), then judged (judge_request). They were read up to three times, on a
    host inspected without request rules too (nothing there to judge): a 60 KiB query of
    escaped names cost the loop ~21 ms a reading, ~24 ms in an X-Original-URL whose path is
    refused for its length anyway, an 8 KiB target ~3 ms."""

    from appliance.filter.proxy.pipeline import Transparent, asked_methods, judge_request, route
    from appliance.policy import Decision
    from appliance.policy.targets import MAX_TARGET

    size = MAX_TARGET - 100 if rules and where == "target" else 60000
    query = _query(item, size)
    if where == "target":
        text = f"GET /x?{query} HTTP/1.1\r\nHost: a.test\r\n\r\n"
    else:
        text = f"GET /x HTTP/1.1\r\nHost: a.test\r\nX-Original-URL: /y?{query}\r\n\r\n"
    asked = parse_request(text.encode())
    inspection, where_to = _inspected(rules), route(asked, Transparent(80))
    # counted, not timed (a timed assert fails on a busy machine): a query of thousands of
    # items read one by one in Python costs thousands of calls and milliseconds; read in C
    # (regular expressions, bytes methods) it costs a few dozen calls, about 180 at most today
    calls = _calls(judge_request, inspection, asked, where_to, Decision(True, "host"),
                   asked_methods(asked, where_to.path))
    assert calls <= 1000, (item, where, calls)
