"""One query at a time to SERVER:53 for each NAME; prints [p50_us, p99_us] (stdlib only)."""

from __future__ import annotations

import json
import random
import socket
import statistics
import struct
import sys
import time


def query(name: str) -> bytes:
    header = struct.pack("!HHHHHH", random.getrandbits(16), 0x0100, 1, 0, 0, 0)
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    return header + labels + b"\0" + struct.pack("!HH", 1, 1)


def main() -> None:
    server, names = sys.argv[1], sys.argv[2:]
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(2)
    sock.connect((server, 53))
    samples = []
    for name in names:
        packet = query(name)
        started = time.perf_counter()
        sock.send(packet)
        while sock.recv(4096)[:2] != packet[:2]:
            pass
        samples.append((time.perf_counter() - started) * 1e6)
    cuts = statistics.quantiles(samples, n=100)
    print(json.dumps([round(cuts[49], 1), round(cuts[98], 1)]))


if __name__ == "__main__":
    main()
