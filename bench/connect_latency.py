"""CONNECT probes for the benchmark (stdlib only), run inside a client namespace.

  tcp ADDRESS TARGET N       N sequential TCP connects to ADDRESS: [p50_us, p99_us]
  connect PROXY TARGET N     N sequential CONNECTs (sent -> 200 read): [p50_us, p99_us]
  hold PROXY TARGET N        open N tunnels at once, print "held N", keep them until stdin ends
"""

from __future__ import annotations

import json
import resource
import socket
import statistics
import sys
import time


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def _tunnel(proxy: tuple[str, int], target: str) -> socket.socket:
    sock = socket.create_connection(proxy, timeout=10)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError(f"proxy closed: {head!r}")
        head += chunk
    if not head.startswith(b"HTTP/1.1 200") and not head.startswith(b"HTTP/1.0 200"):
        raise ConnectionError(f"refused: {head.splitlines()[0]!r}")
    return sock


def main() -> None:
    mode, address, target, count = sys.argv[1], _address(sys.argv[2]), sys.argv[3], int(
        sys.argv[4])
    if mode == "hold":
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, count + 64)), hard))
        tunnels = [_tunnel(address, target) for _ in range(count)]
        print(f"held {len(tunnels)}", flush=True)
        sys.stdin.read()
        for sock in tunnels:
            sock.close()
        return
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        if mode == "tcp":
            socket.create_connection(address, timeout=10).close()
            samples.append((time.perf_counter() - started) * 1e6)
            continue
        sock = _tunnel(address, target)
        samples.append((time.perf_counter() - started) * 1e6)
        sock.close()
    cuts = statistics.quantiles(samples, n=100)
    print(json.dumps([round(cuts[49], 1), round(cuts[98], 1)]))


if __name__ == "__main__":
    main()
