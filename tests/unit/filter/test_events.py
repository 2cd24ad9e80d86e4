"""The event bus as a person's terminal meets it: whatever text a producer put in an event
(a name, a reason quoting a request, a list of answers), subscribers, the recent ring and
the audit log get it with nothing a terminal acts on; plain values stay as they were."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.event import Event
from appliance.filter import events
from appliance.filter.audit.reader import page
from appliance.filter.audit.writer import AuditLog
from appliance.filter.events import EventBus, printable


def all_text(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in (*all_text(k), *all_text(v))]
    if isinstance(value, list | tuple):
        return [t for v in value for t in all_text(v)]
    return []


def test_what_an_event_quotes_is_recorded_escaped_everywhere_it_goes(tmp_path):
    bus = EventBus()
    bus.audit = AuditLog(tmp_path / "audit.jsonl")
    live = bus.subscribe()
    event = bus.emit(Event(session="s1", kind="http", verdict="error",
                           name="a\x1b]52;c;eA==\x07.test",
                           reason="400: malformed header field 'X-\r\x1b[2K\u202eok'",
                           answers=["1.2.3.4", "\x9b2J"], not_learned={"k\x07": "v\u2028"}))
    bus.audit.close()
    (recorded,), _ = page(tmp_path / "audit.jsonl", limit=10)
    assert live.queue[0] is event and bus.recent[-1] is event
    assert event["name"] == "a\\x1b]52;c;eA==\\x07.test"
    assert event["reason"] == "400: malformed header field 'X-\\r\\x1b[2K\\u202eok'"
    assert event["answers"] == ["1.2.3.4", "\\x9b2J"]
    assert event["not_learned"] == {"k\\x07": "v\\u2028"}
    assert {k: recorded[k] for k in event} == json.loads(json.dumps(event))


@given(st.recursive(st.text() | st.integers() | st.none(),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=12))
@settings(max_examples=300)
def test_whatever_an_event_carries_it_leaves_the_bus_printable(value):
    bus = EventBus()
    event = bus.emit(Event(session="s1", kind="dns", verdict="deny", name="x.test",
                           reason="", not_learned=value))
    assert all(text.isprintable() for text in all_text(event))


@given(st.text())
def test_printable_text_is_left_alone_and_the_rest_escaped_once(text):
    shown = printable(text)
    assert shown.isprintable()
    if text.isprintable():
        assert shown == text


def test_an_event_is_encoded_once_for_every_subscriber_that_streams_it():
    bus = EventBus()
    first = bus.emit(Event(kind="dns", verdict="deny", reason="no rule", session="s1",
                           name="evil.test"))
    line = bus.line(first)
    assert json.loads(line) == first and line.endswith(b"\n")
    assert bus.line(first) is line  # the second subscriber writes the same bytes
    for _ in range(events.LINES):
        bus.line(bus.emit(Event(kind="dns", verdict="deny", reason="no rule", session="s1")))
    assert len(bus._lines) == events.LINES
    again = bus.line(first)  # pushed out by the newer ones: encoded again, the same line
    assert again == line and again is not line
