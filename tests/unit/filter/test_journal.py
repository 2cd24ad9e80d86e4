"""The journald entry of an event (filter/journal.py), as bytes: transcripts of the native
protocol, a property against a reader written apart from the encoder (tests/helpers.py),
and the README's list of fields held to SCHEMA."""

from __future__ import annotations

import json
import re
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from appliance.event import SCHEMA, Event
from appliance.filter.events import EventBus
from appliance.filter.journal import (
    JOURNAL_NAMES,
    NOTICE,
    OCSF_FIELD,
    WARNING,
    encode,
    entry,
    fields,
    priority,
)
from tests.helpers import journal_fields

ROOT = Path(__file__).resolve().parents[3]


def denied_lookup() -> Event:
    return Event(id=7, session="s1", client="10.213.1.2", kind="dns", name="evil.example",
                 port=None, address=None, verdict="deny", reason="no rule allows it",
                 rule=None, layer=None, qtype="A",
                 hint="corral allow-dns evil.example --session s1", ts=1764379200.123456)


def test_a_denied_lookup_is_this_datagram():
    assert entry(denied_lookup()) == (
        b'MESSAGE={"id":7,"session":"s1","client":"10.213.1.2","kind":"dns",'
        b'"name":"evil.example","port":null,"address":null,"verdict":"deny",'
        b'"reason":"no rule allows it","rule":null,"layer":null,"qtype":"A",'
        b'"hint":"corral allow-dns evil.example --session s1","ts":1764379200.123456}\n'
        b"PRIORITY=5\n"
        b"SYSLOG_IDENTIFIER=corral-events\n"
        b"CORRAL_ID=7\n"
        b"CORRAL_SESSION=s1\n"
        b"CORRAL_CLIENT=10.213.1.2\n"
        b"CORRAL_KIND=dns\n"
        b"CORRAL_NAME=evil.example\n"
        b"CORRAL_VERDICT=deny\n"
        b"CORRAL_REASON=no rule allows it\n"
        b"CORRAL_QTYPE=A\n"
        b"CORRAL_HINT=corral allow-dns evil.example --session s1\n"
        b"CORRAL_TS=1764379200.123456\n"
        b"CORRAL_OCSF_CLASS_UID=4003\n")


def test_a_value_with_a_newline_goes_in_the_binary_safe_form():
    assert encode([("MESSAGE", "{}"), ("CORRAL_REASON", "two\nlines")]) == (
        b"MESSAGE={}\n"
        b"CORRAL_REASON\n\x09\x00\x00\x00\x00\x00\x00\x00two\nlines\n")


def test_no_value_can_add_a_field_of_its_own():
    """What a session sends ends up in values (a name, a path): a newline in one, were it
    not escaped by the bus already, still cannot start a field."""
    event = Event(kind="dns", verdict="deny", reason="r\nPRIORITY=0\nCORRAL_VERDICT=allow")
    read = journal_fields(entry(event))
    assert [value for name, value in read if name == "PRIORITY"] == [b"5"]
    assert [value for name, value in read if name == "CORRAL_VERDICT"] == [b"deny"]


def test_lengths_count_bytes_not_characters():
    assert encode([("CORRAL_NAME", "é\n")]) == (
        b"CORRAL_NAME\n\x03\x00\x00\x00\x00\x00\x00\x00\xc3\xa9\n\n")


def test_values_that_are_not_text_are_written_as_json_and_null_is_no_field():
    event = Event(id=3, session=None, kind="connect", verdict="allow", reason="ok",
                  closed=True, up=10, down=0, duration=0.25, answers=["1.2.3.4"],
                  not_learned={"tcp": "why"}, expires=None)
    assert fields(event)[3:] == [
        ("CORRAL_ID", "3"), ("CORRAL_KIND", "connect"), ("CORRAL_VERDICT", "allow"),
        ("CORRAL_REASON", "ok"), ("CORRAL_CLOSED", "true"), ("CORRAL_UP", "10"),
        ("CORRAL_DOWN", "0"), ("CORRAL_DURATION", "0.25"), ("CORRAL_ANSWERS", '["1.2.3.4"]'),
        ("CORRAL_NOT_LEARNED", '{"tcp":"why"}'), (OCSF_FIELD, "4001")]


def test_the_message_is_the_json_the_control_socket_and_monitor_give():
    event = EventBus().emit(Event(session="s1", client="c", kind="http", name="a.test",
                                  verdict="allow", reason="r\u202e", method="GET", path="/"))
    message = dict(journal_fields(entry(event)))["MESSAGE"].decode()
    assert message == json.dumps(event, separators=(",", ":"))  # control.py's
    assert json.loads(message) == event and "\n" not in message


def test_priority_says_how_much_a_reader_should_care():
    def of(kind, verdict):
        return priority(Event(kind=kind, verdict=verdict, reason="r"))

    assert of("leak", "deny") == of("secret", "deny") == of("audit", "error") == WARNING
    assert of("dns", "deny") == of("approval", "pending") == of("firewall", "deny") == NOTICE
    assert {of("dns", "allow"), of("rule", "change"), of("secret", "change")} == {6}


def test_every_field_of_the_schema_has_a_journald_name_and_no_two_share_one():
    names = [*JOURNAL_NAMES.values(), OCSF_FIELD]
    assert [f.name for f in SCHEMA] == list(JOURNAL_NAMES)
    assert all(re.fullmatch(r"CORRAL_[A-Z][A-Z0-9_]{0,56}", n) for n in names), names
    assert len(set(names)) == len(names)


def test_a_name_outside_the_schema_never_becomes_a_field():
    event = Event(kind="dns", verdict="allow", reason="r")
    event["seq"] = 4  # an audit record's own, for one
    assert [name for name, _ in fields(event)] == [
        "MESSAGE", "PRIORITY", "SYSLOG_IDENTIFIER", "CORRAL_KIND", "CORRAL_VERDICT",
        "CORRAL_REASON", OCSF_FIELD]


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@given(st.lists(st.tuples(st.sampled_from(list(JOURNAL_NAMES.values())), text), max_size=8))
def test_whatever_the_values_journald_reads_back_each_field_as_written(entry_fields):
    assert journal_fields(encode(entry_fields)) == [
        (name, value.encode()) for name, value in entry_fields]


def test_the_readme_names_every_journald_field_in_schema_order():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Events in your log system"):]
    section = section[:section.index("\n## ")]
    listed = section[section.index("upper\n  case"):section.index(f"`{OCSF_FIELD}`")]
    assert re.findall(r"`(CORRAL_[A-Z_]+)`", listed) == list(JOURNAL_NAMES.values())
    assert f"`{OCSF_FIELD}`" in section and "SYSLOG_IDENTIFIER=corral-events" in section
