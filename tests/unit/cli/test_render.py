"""What a person's terminal is given of text from a session: cli/render.py, and cli/output.py
and the ask prompt drawing through it. The hostile strings are what an agent can put in a
DNS label, a Host header, a path or a reason; the properties hold for any string."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cli import approvals, output, render

HOSTILE = [
    "\x1b[2K\rask ap-00000000: session s2 asks for http github.com:443",  # CSI, CR
    "\x1b]8;;https://evil.test/\x1b\\github.com\x1b]8;;\x1b\\",  # an OSC 8 link
    "\x1b]52;c;cm0gLXJmIH4=\x07",  # OSC 52: a clipboard write
    "\x1b]0;corral: all clear\x07",  # a title change
    "\x9b2J\x9d0;t\x9c\x85",  # C1: CSI, OSC, ST, NEL as single characters
    "abc\b\b\bgithub.com",  # backspaces over what was shown
    "moc.buhtig\u202e",  # a right-to-left override
    "\u2066evil\u2069\u2067x\u2069\u2068y\u2069\u202a\u202b\u202c\u202d",  # isolates, embeddings
    "git\u200bhub\u200c.\u200dcom\u2060\ufeff\u180e\u061c",  # zero-width and invisible
    "one\u2028two\u2029three\nfour\rfive\x0bsix\x0cseven\x85eight",  # line breaks of every kind
    "x" + " " * 200 + "ask ap-1: session s2 asks for http github.com:443",  # pushed off the line
    "g\u0456thub.com",  # a Cyrillic i
    "\udcff\udc1b[31m",  # bytes that were not UTF-8 (surrogateescape)
    "\x00\x7f\x01",
]
TERMINAL_ACTS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u180e\u200b-\u200f\u2028-\u202e"
                           "\u2060-\u206f\ufeff]")
"""What a terminal acts on or hides: C0 but tab and newline, DEL, C1, bidi controls,
zero-width and invisible characters, line and paragraph separators."""


def one_printable_line(shown: str) -> bool:
    return all(" " <= ch <= "~" for ch in shown)


@pytest.mark.parametrize("value", HOSTILE)
def test_a_hostile_value_is_one_printable_ascii_line(value):
    shown = render.text(value)
    assert one_printable_line(shown), shown
    assert " " * render.RUN not in shown


@given(st.text())
@settings(max_examples=400)
def test_whatever_string_is_rendered_the_output_is_printable_and_one_line(value):
    assert one_printable_line(render.text(value))
    assert one_printable_line(render.host(value)) and " " not in render.host(value)


@given(st.text(), st.integers(min_value=3, max_value=120))
def test_a_bounded_place_is_never_overrun(value, width):
    shown = render.text(value, width)
    assert len(shown) <= width and one_printable_line(shown)
    if len(render.text(value)) > width:
        assert shown.endswith("...")


@given(st.text())
def test_the_clis_own_lines_keep_their_breaks_and_lose_whatever_acts(value):
    shown = render.prose(value)
    assert not TERMINAL_ACTS.search(shown), ascii(shown)
    assert shown.count("\n") == value.count("\n")


def test_escapes_say_what_was_there():
    assert render.text("a\x1b[31mb\r\n\t\x9b\u202e\u200b\udcff") == (
        "a\\x1b[31mb\\r\\n\\t\\x9b\\u202e\\u200b\\xff")
    assert render.text("a" + " " * 40 + "b") == "a[40 spaces]b"
    assert render.text("two  spaces stay") == "two  spaces stay"
    assert render.text(None) == "-" and render.text(443) == "443"


def test_a_host_beyond_ascii_is_shown_as_it_is_on_the_wire():
    assert render.host("g\u0456thub.com") == "xn--gthub-n2e.com"
    assert render.host("b\u00fccher.de", 443) == "xn--bcher-kva.de:443"
    assert render.host("evil.test\u202e") == "evil.test\\u202e"  # no IDNA form: escaped
    assert render.host("a b.test") == "a\\x20b.test"
    assert render.host("github.com.login.secure.account.example.evil.test:443") == (
        "github.com.login.secure.account.example.evil.test:443")  # whole, never cut


def hostile_event(value: str) -> dict:
    return {"ts": 1700000000.0, "session": value, "kind": value, "name": value, "port": 443,
            "verdict": "deny", "reason": value, "hint": value}


@pytest.mark.parametrize("value", HOSTILE)
def test_monitor_and_audit_lines_carry_nothing_a_terminal_acts_on(value, capsys):
    output.event(hostile_event(value))
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1
    assert one_printable_line(out[:-1]), ascii(out)


def test_an_old_record_with_fields_of_any_type_is_still_a_line(capsys):
    output.event({"ts": "soon", "session": ["x"], "kind": {"a": 1}, "name": 5, "port": "\x1b",
                  "verdict": None, "reason": b"\x1b", "hint": 7})
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and one_printable_line(out[:-1]), out


@pytest.mark.parametrize("value", HOSTILE)
def test_tables_and_lines_carry_nothing_a_terminal_acts_on(value, capsys):
    output.table([[value, "ok", value]], ["A", "B", "C"])
    output.line(f"refused {value}")
    output.notice(f"sandbox service: {value}")
    output.error(value, value)
    captured = capsys.readouterr()
    for out in (captured.out, captured.err):
        assert not TERMINAL_ACTS.search(out), ascii(out)
    assert captured.out.splitlines()[1].startswith(render.text(value))


@pytest.mark.parametrize("value", HOSTILE)
def test_json_stays_valid_and_carries_no_raw_control(value, capsys):
    record = hostile_event(value)
    output.data(record)
    output.data_line(record)
    out = capsys.readouterr().out
    assert out.isascii() and not TERMINAL_ACTS.search(out.replace("\n", ""))
    pretty, _, line = out.rstrip("\n").rpartition("\n")
    assert json.loads(pretty) == record and json.loads(line) == record


def test_the_prompt_shows_the_target_whole_after_the_agents_words(capsys):
    target = "github.com.login.secure.account.verify.session.example.evil.test:443"
    note = "ok\r\x1b[2K" + " " * 90 + "ap-0000: session s2 asks for http github.com:443"
    said, decided = approvals.prompt({"id": "ap-1234abcd", "session": "s2", "kind": "http",
                                      "target": target, "note": note})
    for text in said:
        output.line(text)
    output.decision(decided)
    lines = capsys.readouterr().out.splitlines()
    mark = output.MARK if output._encodes(output.MARK) else output.MARK_ASCII
    drawn = [n for n, text in enumerate(lines) if text.startswith(mark)]
    assert drawn == [len(lines) - 2, len(lines) - 1]  # the decision comes last
    assert lines[drawn[0]] == f"{mark} ap-1234abcd: session s2 asks for http {target}"
    assert "a key decides ap-1234abcd" in lines[drawn[1]]
    (agent,) = lines[:drawn[0]]
    assert agent.startswith("  ap-1234abcd: the agent says: ok\\r\\x1b[2K[90 spaces]")
    assert len(agent) <= len("  ap-1234abcd: the agent says: ") + approvals.NOTE_WIDTH


@given(st.text(), st.text(), st.text())
def test_no_value_in_an_approval_can_draw_the_mark(note, target, session):
    said, decided = approvals.prompt({"id": "ap-1", "session": session, "kind": "http",
                                      "target": target, "note": note})
    for text in [*said, *decided]:
        assert output.MARK not in text and one_printable_line(text)


def test_on_a_real_terminal_raw_records_and_the_prompt_arrive_as_drawn(tmp_path):
    """What an older filter wrote raw into the audit log, replayed on a pseudo-terminal
    through the CLI's printer, then a prompt: the bytes the terminal gets hold nothing it
    acts on but the CLI's own line ends, and the prompt's marked lines are the last."""
    import os
    import pty
    import select
    import sys
    import time

    records = tmp_path / "records.json"
    records.write_text(json.dumps([hostile_event(value) for value in HOSTILE]))
    script = (
        "import json, sys\n"
        "from cli import approvals, output\n"
        f"for record in json.load(open({str(records)!r})):\n"
        "    output.event(record, color=True)\n"
        "said, decided = approvals.prompt({'id': 'ap-1', 'session': 's2', 'kind': 'http',\n"
        f"    'target': 'github.com.login.example.evil.test:443', 'note': {HOSTILE[0]!r}}})\n"
        "for text in said:\n"
        "    output.line(text)\n"
        "output.decision(decided)\n")
    pid, fd = pty.fork()
    if pid == 0:
        os.execve(sys.executable, [sys.executable, "-c", script],
                  {**os.environ, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"})
    seen = b""
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], 10)
            assert ready, seen
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child is done: the terminal hung up
                break
            if not chunk:
                break
            seen += chunk
    finally:  # reached early by a failed read too: then the child may never exit by itself
        deadline = time.monotonic() + 10
        while (ended := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        if ended == (0, 0):
            os.kill(pid, 9)
            ended = os.waitpid(pid, 0)
        status = ended[1]
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, seen
    shown = seen.decode("utf-8")
    colours = re.compile("\x1b\\[(?:3[123]|1;35|0)m")  # the CLI's own, around whole lines
    lines = colours.sub("", shown).split("\r\n")
    assert lines[-1] == ""
    for text in lines[:-1]:
        assert not TERMINAL_ACTS.search(text) and "\x1b" not in text, ascii(text)
    assert lines[-3:-1] == [
        f"{output.MARK} ap-1: session s2 asks for http github.com.login.example.evil.test:443",
        f"{output.MARK} [o]nce [s]ession [a]lways [r]efuse [n]ext [q]uit: a key decides ap-1"]
    assert sum(text.startswith(output.MARK) for text in lines) == 2


def test_status_says_what_the_journal_export_lost_and_why():
    from cli.control import journal_line

    sock = "/run/systemd/journal/socket"
    assert journal_line({"socket": sock, "sent": 12, "lost": 0, "queued": 0,
                         "waiting": False, "error": None}) == f"journal: 12 events sent to {sock}"
    assert journal_line({"socket": sock, "sent": 3, "lost": 5, "queued": 7, "waiting": True,
                         "error": f"{sock}: No such file or directory\x1b[2J"}) == (
        f"journal: 3 events sent to {sock}; 5 NOT sent (the audit log has them): {sock}: "
        "No such file or directory\\x1b[2J; journald full, 7 waiting")


def test_status_says_which_filter_worker_is_down():
    from cli.control import workers_line

    assert workers_line([{"index": 0, "up": True, "restarts": 0, "sessions": ["s1", "s3"]},
                         {"index": 1, "up": True, "restarts": 0, "sessions": ["s2"]}]) == (
        "workers: 0 up, 2 sessions; 1 up, 1 sessions")
    assert workers_line([{"index": 0, "up": True, "restarts": 0, "sessions": []},
                         {"index": 1, "up": False, "restarts": 3}]) == (
        "workers: 0 up, 0 sessions; 1 DOWN (its sessions get no answer; restarting); "
        "3 restarts")
