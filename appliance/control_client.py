"""The API's only way to the services behind it: JSON lines over their unix sockets.

One client per service (the filter, the sandbox service); `what` names it in errors. A
request may carry a payload (the sandbox service's project archive): its size goes in the
request line as "payload", the bytes follow the line.
"""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Iterator
from typing import BinaryIO


class ServiceUnavailable(Exception):
    """A service's control socket does not answer."""


class ControlClient:
    def __init__(self, path: str, what: str = "the filter", timeout: float = 10.0):
        self.path, self.what, self.timeout = path, what, timeout

    def _connect(self, timeout: float | None) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout or self.timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise ServiceUnavailable(f"{self.what} is not answering on {self.path}: "
                                     f"{exc.strerror or exc}") from None
        return sock

    def request(self, message: dict, payload: BinaryIO | None = None, size: int = 0,
                timeout: float | None = None) -> dict:
        """One request, one answer. `timeout` for slow operations (creating a session)."""
        if payload is not None:
            message = {**message, "payload": size}
        with self._connect(timeout) as sock:
            try:
                sock.sendall(json.dumps(message).encode() + b"\n")
                if payload is not None:
                    with sock.makefile("wb") as out:
                        shutil.copyfileobj(payload, out, 1 << 20)
                with sock.makefile("rb") as stream:
                    line = stream.readline()
            except OSError as exc:
                raise ServiceUnavailable(f"{self.what}'s control socket failed: {exc}"
                                         ) from None
        if not line:
            raise ServiceUnavailable(f"{self.what} closed its control socket without answering")
        return json.loads(line)

    def stream(self, message: dict, idle: float = 15.0) -> Iterator[dict | None]:
        """Subscribe; yield None once the subscription is in place (the caller can answer
        its client now), then each event, and None after every `idle` seconds of silence
        (so the caller can send a keep-alive and notice a client that went away). The
        socket is read with recv, never through a file object: a read that timed out
        leaves a file object's state undefined (it then reads as the end)."""
        sock = self._connect(None)
        try:
            sock.sendall(json.dumps(message).encode() + b"\n")
            lines = _lines(sock)
            first = next(lines)  # within `timeout`, as any answer: a filter that is stuck
            if first is None:   # would hold this request (and its API worker) for ever
                raise ServiceUnavailable(f"{self.what} did not answer the subscription "
                                         f"within {self.timeout:g} s")
            sock.settimeout(idle)
            answer = json.loads(first or b"{}")
            if not answer.get("ok"):
                raise ServiceUnavailable(answer.get("error", "subscription refused"))
            yield None
            for line in lines:
                if line == b"":
                    return  # the filter closed the stream
                yield None if line is None else json.loads(line)
        finally:
            sock.close()


def _lines(sock: socket.socket, limit: int = 1 << 24) -> Iterator[bytes | None]:
    """The lines a socket sends (without their newline); None each time a read timed out;
    b"" once when it ends (a last line without a newline is dropped: cut short)."""
    buffer = b""
    while True:
        end = buffer.find(b"\n")
        if end >= 0:
            line, buffer = buffer[:end], buffer[end + 1:]
            yield line
            continue
        if len(buffer) > limit:
            raise ServiceUnavailable(f"a line longer than {limit} bytes on the event stream")
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            yield None
            continue
        if not chunk:
            yield b""
            return
        buffer += chunk
