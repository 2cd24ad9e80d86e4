"""`corral monitor --ask`'s keys: what a new prompt drops, and the `q` it never drops."""

from __future__ import annotations

import os
import pty
import time
import tty

import pytest

from cli.approvals import _quits, _typed_before


@pytest.mark.parametrize(("typed", "quits"), [
    (b"q", True),
    (b"oq", True),  # a key for the last prompt, then quit: the quit stands
    (b"\x1b[Aq", True),  # an arrow, then q
    (b"o", False),
    (b"", False),
    (b"\x1bOq", False),  # the keypad's 1 in application mode
    (b"\x1bq", False),  # Alt-q
    (b"\x1b[1;5q", False),  # a CSI sequence that ends in q
    (b"Q", False),  # a capital decides nothing, and quits nothing
])
def test_a_q_of_its_own_quits_and_one_inside_an_escape_sequence_does_not(typed, quits):
    assert _quits(typed) is quits


def test_what_was_typed_is_read_without_waiting_and_the_terminal_is_left_empty():
    parent, child = pty.openpty()
    try:
        tty.setcbreak(child)
        assert _typed_before(child) == b""  # nothing typed: no wait
        os.write(parent, b"o\x1bOPq")
        deadline = time.monotonic() + 5
        typed = b""
        while len(typed) < 5 and time.monotonic() < deadline:
            typed += _typed_before(child)
        assert typed == b"o\x1bOPq"
        assert _typed_before(child) == b""
    finally:
        os.close(parent)
        os.close(child)
