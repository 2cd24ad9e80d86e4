"""The secrets' values out of everything the filter says (redact.py), without sockets: any
value, in any form it travels in, at any position of any text and cut anywhere, is gone;
and the parsers' own reasons, quoting malformed input with a value planted at every
position, say nothing of it once they pass a door."""

from __future__ import annotations

import base64
import json
import logging
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.event import Event
from appliance.filter.events import EventBus
from appliance.filter.http import HttpError, check_trailer_line, parse_request, parse_response
from appliance.filter.proxy.credentials import Credentials
from appliance.filter.proxy.pipeline import error_response
from appliance.filter.redact import MIN_VALUE, NONE, LogFilter, Redactor
from appliance.filter.secrets import Secret

VALUES = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=MIN_VALUE,
                 max_size=48)
TEXT = st.text(max_size=60)


def gone(value: str, said: str) -> bool:
    """No run of the value's first MIN_VALUE characters or more is left in `said`."""
    return value[:MIN_VALUE] not in said


@given(VALUES, TEXT, TEXT, st.integers(0, 200), st.sampled_from(["raw", "repr", "quoted"]))
def test_a_value_anywhere_in_any_form_cut_anywhere_is_replaced(value, before, after, cut,
                                                               form):
    shown = {"raw": value, "repr": repr(value)[1:-1], "quoted": quote(value, safe="")}[form]
    text = (before + shown + after)[:len(before) + MIN_VALUE + cut]
    said = Redactor({"API_TOKEN": value.encode()}).text(text)
    assert gone(shown, said)
    if len(before) + len(shown) <= len(text):  # the whole value was there: named
        assert "[secret API_TOKEN]" in said


def test_text_without_a_value_is_left_alone_and_no_secrets_cost_nothing():
    redactor = Redactor({"A": b"sk-live-0123456789"})
    assert redactor.text("sk-live, not it") == "sk-live, not it"
    assert NONE.text("anything sk-live-0123456789") == "anything sk-live-0123456789"
    assert not NONE and redactor


def _credentials() -> Credentials:
    return Credentials(b"k" * 32, {
        "GH_TOKEN": Secret("GH_TOKEN", "ghp_0123456789abcdefghijklmnop", ("gh.test",),
                           "bearer", nonce="n"),
        "DEPLOY": Secret("DEPLOY", "hunter2-hunter2", ("d.test",), "basic", user="bot",
                         nonce="m")})


def test_basic_auth_encodings_are_secrets_of_their_own():
    basic = base64.b64encode(b"bot:hunter2-hunter2").decode()
    said = _credentials().redactor.text(f"Authorization: Basic {basic}")
    assert basic[:MIN_VALUE] not in said and "[secret DEPLOY (basic auth)]" in said


MALFORMED = [  # (how the input is read, a template with {v} where the value is planted)
    (parse_request, "GET / HTTP/1.1\r\nHost: a\r\nX-Echo {v}\r\n\r\n"),
    (parse_request, "GET / HTTP/1.1\r\nHost: a\r\n{v} : x\r\n\r\n"),
    (parse_request, "GET /{v} HTTP/1.1 extra\r\n\r\n"),
    (parse_request, "{v} / HTTP/1.1\r\n\r\n"),
    (parse_request, "GET / HTTP/9.{v}\r\n\r\n"),
    (parse_response, "HTTP/1.1 200 OK\r\nBearer {v}\r\n\r\n"),
    (parse_response, "HTTP/1.1 {v}\r\n\r\n"),
    (lambda data: check_trailer_line(data.rstrip(b"\r\n")), "Bearer {v}"),
    (lambda data: check_trailer_line(data.rstrip(b"\r\n")), "{v}: x\x01"),
]


@pytest.mark.parametrize(("read", "template"), MALFORMED)
def test_a_value_planted_anywhere_in_malformed_input_leaves_no_door(read, template):
    credentials = _credentials()
    value = "ghp_0123456789abcdefghijklmnop"
    bus = EventBus()
    bus.redactor = credentials.redactor
    for at in range(len(template) + 1):  # the value at every position, the template's own too
        for text in (template.replace("{v}", value), template[:at] + value + template[at:]):
            try:
                read(text.replace("{v}", "").encode("latin-1"))
            except HttpError as exc:
                answer = error_response(exc.status, str(exc),
                                        redactor=credentials.redactor).decode("latin-1")
                event = bus.emit(Event(reason=f"{exc.status}: {exc}"[:200], kind="http",
                                       verdict="error"))
                assert gone(value, answer) and gone(value, event["reason"]), (text, answer)


def test_log_records_and_their_tracebacks_are_redacted(caplog):
    credentials = _credentials()
    logger = logging.getLogger("corral.test-redact")
    handler = logging.Handler()
    seen = []
    handler.emit = lambda record: seen.append(logging.Formatter().format(record))
    handler.addFilter(LogFilter(lambda: credentials.redactor))
    logger.addHandler(handler)
    try:
        try:
            raise ValueError("upstream said Bearer ghp_0123456789abcdefghijklmnop")
        except ValueError:
            logger.exception("failed for %s", "hunter2-hunter2")
    finally:
        logger.removeHandler(handler)
    assert seen and "ghp_0123" not in seen[0] and "hunter2-" not in seen[0]
    assert "[secret GH_TOKEN]" in seen[0] and "[secret DEPLOY]" in seen[0]


def _quoted_in_bytes_repr(value: str) -> str:
    return repr(f'X-Echo: "{value}'.encode())  # both quotes in it: repr escapes "'"


@pytest.mark.parametrize(("value", "shown"), [
    ("abcdefgh'ijklmnop", _quoted_in_bytes_repr),  # `malformed header field b'...\'...'`
    ('abcdefgh"ijklmnop', lambda v: json.dumps({"q": v})),  # JSON-encoded answers
    ("abcdefgh\\ijklmnop", lambda v: json.dumps({"q": v})),
    ("sk-live-0123456789abcdef", str.upper),  # a method override's value, upper-cased
    ("SK-Live-0123456789ABCDEF", str.lower),  # a host name, lower-cased
    ("Mixed-Case_value99", lambda v: f"GET /{v.swapcase()}"),
])
def test_a_value_as_the_filter_rewrites_it_leaves_no_run_of_itself(value, shown):
    """Escaped as a bytes repr with both quotes in it (`\\'`), as JSON (`\\"`, `\\\\`), or
    in another letter case (override values are upper-cased, host names lower-cased): the
    text after the first character the form changes was left whole."""
    said = Redactor({"API_TOKEN": value.encode()}).text(f"quoted: {shown(value)} .")
    left = [value[at:at + MIN_VALUE] for at in range(len(value) - MIN_VALUE + 1)
            if value[at:at + MIN_VALUE].lower() in said.lower()]
    assert left == [], said


def test_a_log_call_whose_arguments_do_not_fit_is_logged_redacted_and_the_caller_goes_on():
    """A record whose message cannot be formatted (a bug in the call) used to raise at the
    caller, on the connection being served, from inside the redaction: it is logged as
    its format and arguments, redacted, and the caller goes on."""
    credentials = _credentials()
    logger = logging.getLogger("corral.test-redact-args")
    handler = logging.Handler()
    seen = []
    handler.emit = lambda record: seen.append(logging.Formatter().format(record))
    handler.addFilter(LogFilter(lambda: credentials.redactor))
    logger.addHandler(handler)
    try:
        logger.error("two places %s %s for one value", "hunter2-hunter2")
    finally:
        logger.removeHandler(handler)
    assert len(seen) == 1 and "two places" in seen[0], seen
    assert "hunter2-" not in seen[0] and "[secret DEPLOY]" in seen[0]
