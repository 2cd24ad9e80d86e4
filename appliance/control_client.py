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
        """Subscribe; yield each event, and None after `idle` seconds of silence (so the
        caller can send a keep-alive and notice a client that went away)."""
        sock = self._connect(None)
        try:
            sock.sendall(json.dumps(message).encode() + b"\n")
            sock.settimeout(idle)
            stream = sock.makefile("rb")
            first = json.loads(stream.readline() or b"{}")
            if not first.get("ok"):
                raise ServiceUnavailable(first.get("error", "subscription refused"))
            while True:
                try:
                    line = stream.readline()
                except TimeoutError:
                    yield None
                    continue
                if not line:
                    return
                yield json.loads(line)
        finally:
            sock.close()
