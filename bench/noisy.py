"""The noisy-neighbour load and its victim's probes (stdlib and the filter's own bomb builder),
run inside a client namespace of the benchmark:

  paced-dns SERVER:PORT RATE SECONDS NAME...  queries at RATE/s for SECONDS, names in turn
  paced-connect PROXY TARGET RATE SECONDS  one CONNECT (sent -> 200 read) at a time, RATE/s
      both print {"sent", "answered", "rate", "p50_us", "p99_us"}: what a session that
      asks at an agent's pace gets, so its own rate limit never decides the numbers
  hold PROXY TARGET COUNT      open up to COUNT tunnels (and as many plain connections again),
                               print what was held and refused, keep them until stdin ends
  bombs SERVER:PORT SECONDS    the worst DNS packets there are, over UDP and TCP, in a loop
"""

from __future__ import annotations

import json
import random
import resource
import select
import socket
import statistics
import struct
import sys
import time

from appliance.filter.dns.wire import pointer_bomb


def query(name: str) -> bytes:
    header = struct.pack("!HHHHHH", random.getrandbits(16), 0x0100, 1, 0, 0, 0)
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    return header + labels + b"\0" + struct.pack("!HH", 1, 1)


def summary(sent: int, latencies: list[float], seconds: float) -> dict:
    cuts = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    return {"sent": sent, "answered": len(latencies), "rate": round(len(latencies) / seconds, 1),
            "p50_us": round(cuts[49], 1), "p99_us": round(cuts[98], 1)}


def paced_dns(server: tuple[str, int], rate: float, seconds: float, names: list[str]) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect(server)
    pending: dict[bytes, float] = {}
    latencies: list[float] = []
    start = time.perf_counter()
    sent = 0
    while True:
        now = time.perf_counter()
        due = start + sent / rate
        if due - start >= seconds:
            break
        if now >= due:
            packet = query(names[sent % len(names)])
            pending[packet[:2]] = now
            sock.send(packet)
            sent += 1
            continue
        ready, _, _ = select.select([sock], [], [], due - now)
        if ready:
            reply = sock.recv(4096)
            at = pending.pop(reply[:2], None)
            if at is not None:
                latencies.append((time.perf_counter() - at) * 1e6)
    deadline = time.perf_counter() + 1.0  # the last ones may still come: a second, no more
    while pending and time.perf_counter() < deadline:
        ready, _, _ = select.select([sock], [], [], deadline - time.perf_counter())
        if ready:
            reply = sock.recv(4096)
            at = pending.pop(reply[:2], None)
            if at is not None:
                latencies.append((time.perf_counter() - at) * 1e6)
    return summary(sent, latencies, seconds)


def _tunnel(proxy: tuple[str, int], target: str) -> socket.socket:
    sock = socket.create_connection(proxy, timeout=5)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("closed")
        head += chunk
    if not head.startswith(b"HTTP/1.1 200"):
        sock.close()
        raise ConnectionError(head.split(b"\r\n", 1)[0].decode(errors="replace"))
    return sock


def paced_connect(proxy: tuple[str, int], target: str, rate: float, seconds: float) -> dict:
    latencies: list[float] = []
    start = time.perf_counter()
    sent = 0
    while (due := start + sent / rate) - start < seconds:
        time.sleep(max(0.0, due - time.perf_counter()))
        sent += 1
        began = time.perf_counter()
        try:
            _tunnel(proxy, target).close()
        except OSError:
            continue
        latencies.append((time.perf_counter() - began) * 1e6)
    return summary(sent, latencies, seconds)


def hold(proxy: tuple[str, int], target: str, count: int) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held, refused = [], 0
    for _ in range(count):  # tunnels until the cap says no ...
        try:
            held.append(_tunnel(proxy, target))
        except OSError:
            refused += 1
    for _ in range(count):  # ... then plain connections, each with half a request head
        try:
            sock = socket.create_connection(proxy, timeout=5)
            sock.sendall(b"GET http://x/ HTTP/1.1\r\nHo")
            held.append(sock)
        except OSError:
            refused += 1
    print(json.dumps({"held": len(held), "refused": refused}), flush=True)
    sys.stdin.read()
    for sock in held:
        sock.close()


def bombs(server: tuple[str, int], seconds: float) -> None:
    udp = pointer_bomb(size=1200)
    tcp = pointer_bomb(size=12_000)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect(server)
    sock.setblocking(False)
    deadline = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < deadline:
        for _ in range(50):
            try:
                sock.send(udp)
                sent += 1
            except OSError:
                pass
        try:
            with socket.create_connection(server, timeout=1) as stream:
                stream.sendall(struct.pack("!H", len(tcp)) + tcp)
                sent += 1
        except OSError:
            pass
        while True:  # drop what came back
            try:
                sock.recv(4096)
            except OSError:
                break
    print(json.dumps({"bombs": sent}), flush=True)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "paced-dns":
        result = paced_dns(_address(rest[0]), float(rest[1]), float(rest[2]), rest[3:])
    elif mode == "paced-connect":
        result = paced_connect(_address(rest[0]), rest[1], float(rest[2]), float(rest[3]))
    elif mode == "hold":
        hold(_address(rest[0]), rest[1], int(rest[2]))
        return
    elif mode == "bombs":
        bombs(_address(rest[0]), float(rest[1]))
        return
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
