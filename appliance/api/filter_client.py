"""The API's only way to the filter: JSON lines over its control socket."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator


class FilterUnavailable(Exception):
    """The filter's control socket does not answer."""


class FilterClient:
    def __init__(self, path: str, timeout: float = 10.0):
        self.path, self.timeout = path, timeout

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise FilterUnavailable(f"the filter is not answering on {self.path}: "
                                    f"{exc.strerror or exc}") from None
        return sock

    def request(self, message: dict) -> dict:
        with self._connect() as sock:
            try:
                sock.sendall(json.dumps(message).encode() + b"\n")
                with sock.makefile("rb") as stream:
                    line = stream.readline()
            except OSError as exc:
                raise FilterUnavailable(f"the filter's control socket failed: {exc}") from None
        if not line:
            raise FilterUnavailable("the filter closed its control socket without answering")
        return json.loads(line)

    def stream(self, message: dict, idle: float = 15.0) -> Iterator[dict | None]:
        """Subscribe; yield each event, and None after `idle` seconds of silence (so the
        caller can send a keep-alive and notice a client that went away)."""
        sock = self._connect()
        try:
            sock.sendall(json.dumps(message).encode() + b"\n")
            sock.settimeout(idle)
            stream = sock.makefile("rb")
            first = json.loads(stream.readline() or b"{}")
            if not first.get("ok"):
                raise FilterUnavailable(first.get("error", "subscription refused"))
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
