"""One agent's package install, as the team row runs twenty of them at once: COUNT short HTTPS
connections, one after another, each a new TCP connection (through the proxy: a CONNECT), a
TLS handshake, one small GET and the close:

  python -m bench.team PROXY|direct HOST ADDRESS:PORT PATH COUNT

PROXY is the session's proxy (`10.233.0.1:3128`); `direct` dials ADDRESS:PORT itself.
Prints {"count", "seconds", "latencies_us": [...]}. Standard library only; the upstream's
certificate is not verified (the benchmark's own, for `*.allowed.test`).
"""

from __future__ import annotations

import json
import socket
import ssl
import sys
import time


def fetch(proxy: tuple[str, int] | None, host: str, address: tuple[str, int], path: str,
          context: ssl.SSLContext) -> None:
    if proxy is None:
        sock = socket.create_connection(address, 10)
    else:
        sock = socket.create_connection(proxy, 10)
        sock.sendall(f"CONNECT {host}:{address[1]} HTTP/1.1\r\nHost: {host}:{address[1]}"
                     "\r\n\r\n".encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError("the proxy closed before answering the CONNECT")
            answer += chunk
        if not answer.startswith(b"HTTP/1.1 200"):
            raise ConnectionError(f"CONNECT refused: {answer[:200]!r}")
    with context.wrap_socket(sock, server_hostname=host) as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                    .encode())
        body = b""
        while chunk := tls.recv(65536):
            body += chunk
    if not body.startswith(b"HTTP/1.1 200"):
        raise ConnectionError(f"GET answered {body[:100]!r}")


def main(argv: list[str]) -> int:
    proxy_text, host, address_text, path, count = argv
    proxy = None
    if proxy_text != "direct":
        name, _, port = proxy_text.rpartition(":")
        proxy = (name, int(port))
    name, _, port = address_text.rpartition(":")
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    latencies = []
    started = time.perf_counter()
    for _ in range(int(count)):
        begun = time.perf_counter()
        fetch(proxy, host, (name, int(port)), path, context)
        latencies.append((time.perf_counter() - begun) * 1e6)
    print(json.dumps({"count": len(latencies), "seconds": time.perf_counter() - started,
                      "latencies_us": latencies}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
