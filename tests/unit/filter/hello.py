"""Real TLS ClientHellos, produced by Python's own TLS stack into a memory buffer."""

from __future__ import annotations

import contextlib
import ssl


def client_hello(server_name: str | None = "example.com", alpn=("h2", "http/1.1")) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = server_name is not None
    if server_name is None:
        context.verify_mode = ssl.CERT_NONE
    if alpn:
        context.set_alpn_protocols(list(alpn))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with contextlib.suppress(ssl.SSLWantReadError):  # it waits for a server that is not there
        tls.do_handshake()
    return outgoing.read()


def split_records(hello: bytes, size: int) -> bytes:
    """Re-frame one ClientHello record as several handshake records of `size` bytes."""
    payload = hello[5:]
    out = b""
    for i in range(0, len(payload), size):
        part = payload[i : i + size]
        out += bytes([0x16, 0x03, 0x01]) + len(part).to_bytes(2, "big") + part
    return out
