"""The API's client of the services' control sockets, against a real unix socket whose
other end says only what each test has it say."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from appliance.control_client import ControlClient, ServiceUnavailable


def _serving(path: str, answer: bytes | None) -> tuple[socket.socket, threading.Thread]:
    """A listener at `path` that reads one request line and answers `answer` (None: says
    nothing, and keeps the connection open, as a stuck filter would)."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()
    server.settimeout(10)

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.settimeout(10)
            while not conn.recv(4096).endswith(b"\n"):
                pass
            if answer is not None:
                conn.sendall(answer)
            time.sleep(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server, thread


def test_a_subscription_nobody_answers_fails_within_the_timeout_and_is_not_waited_on(tmp_path):
    path = str(tmp_path / "filter.sock")
    server, thread = _serving(path, None)
    try:
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable, match="did not answer the subscription"):
            next(ControlClient(path, timeout=0.5).stream({"op": "subscribe"}, idle=0.1))
        assert time.monotonic() - started < 1.5  # the timeout's, not the idle beats' forever
    finally:
        server.close()
        thread.join(10)


def test_a_subscription_answered_yields_its_start_then_the_events(tmp_path):
    path = str(tmp_path / "filter.sock")
    server, thread = _serving(path, b'{"ok": true}\n{"kind": "dns"}\n')
    try:
        stream = ControlClient(path, timeout=5).stream({"op": "subscribe"}, idle=5)
        assert next(stream) is None and next(stream) == {"kind": "dns"}
        stream.close()
    finally:
        server.close()
        thread.join(10)
