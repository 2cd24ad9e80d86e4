"""`corral monitor --ask`'s keys: what a new prompt drops, and the `q` it never drops."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import sys
import textwrap
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
    (b"\x1bO5q", False),  # the keypad's 1 with Ctrl
    (b"\x1b\x1b[1;5q", False),  # with Alt too
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


MONITOR = textwrap.dedent("""
    import sys, threading, time, types
    from cli.approvals import monitor_ask
    decided = open(sys.argv[1], "a", buffering=1)

    class Client:  # the API as the monitor sees it: two approvals open, no event coming
        def stream(self, path, **only):
            threading.Event().wait()
            yield from ()

        def request(self, method, path, body=None, **only):
            if method == "GET":
                return {"approvals": [
                    {"id": f"ap-{n}", "session": "s1", "kind": "http",
                     "target": f"host{n}.test:443"} for n in ("a", "b")]}
            decided.write(f"{path} {body['grant']}\\n")
            time.sleep(0.2)  # the API's time: the next key comes while the answer is awaited
            return {"released": 1}

    args = types.SimpleNamespace(session=None, denied=False, project=None)
    sys.exit(monitor_ask(Client(), args, False))
""")


def _monitor(tmp_path):
    """`monitor --ask` on a real pseudo-terminal against a stand-in API (the keys are the
    thing under test): its pid, the terminal, and the file its decisions go to."""
    decided = tmp_path / "decided"
    decided.touch()
    pid, fd = pty.fork()
    if pid == 0:
        os.execve(sys.executable, [sys.executable, "-c", MONITOR, str(decided)],
                  {**os.environ, "LANG": "C.UTF-8"})
    return pid, fd, decided


def _until(fd: int, marker: bytes, seen: bytearray, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while marker not in seen:
        ready, _, _ = select.select([fd], [], [], max(0, deadline - time.monotonic()))
        assert ready, f"no {marker!r}; saw {bytes(seen)!r}"
        seen += os.read(fd, 65536)


def _ended(pid: int, fd: int, seen: bytearray, timeout: float = 10) -> int | None:
    """Its exit code, or None (then killed) if it is still running after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if select.select([fd], [], [], 0.05)[0]:
            with contextlib.suppress(OSError):
                seen += os.read(fd, 65536)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_a_q_typed_with_a_decision_quits_once_the_decision_is_made(tmp_path):
    """`o` then `q` in one go: the first approval is let through once and the monitor
    quits. Keys typed before a new prompt are dropped (flushed, before), and the `q` went
    with them: the next approval's prompt came up and the monitor waited for ever."""
    pid, fd, decided = _monitor(tmp_path)
    seen = bytearray()
    try:
        _until(fd, b"a key decides ap-a", seen)
        os.write(fd, b"oq")
        assert _ended(pid, fd, seen) == 0, bytes(seen)
    finally:
        os.close(fd)
    assert decided.read_text() == "/approvals/ap-a once\n"


def test_a_decision_key_typed_before_the_next_prompt_decides_nothing(tmp_path):
    """`o` then `s` in one go: `s` was typed before ap-b's prompt, so it is not for ap-b."""
    pid, fd, decided = _monitor(tmp_path)
    seen = bytearray()
    try:
        _until(fd, b"a key decides ap-a", seen)
        os.write(fd, b"os")
        _until(fd, b"a key decides ap-b", seen)
        time.sleep(0.5)  # a key it took for ap-b would be decided by now
        assert decided.read_text() == "/approvals/ap-a once\n"
        os.write(fd, b"q")
        assert _ended(pid, fd, seen) == 0, bytes(seen)
    finally:
        os.close(fd)
    assert decided.read_text() == "/approvals/ap-a once\n"
