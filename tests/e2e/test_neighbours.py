"""One sandbox at its worst, the other unaffected (invariant 10), through the real filter and
the real ruleset: s2 floods the DNS socket every session shares and opens connections far
past its caps; s1's queries and tunnels all go through meanwhile, and the kernel counted
what it turned away."""

from __future__ import annotations

import subprocess
import sys
import time

from . import netns

DNS_FLOOD = r"""
import os, socket, struct, sys, time
end = time.monotonic() + float(sys.argv[1])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect(("10.213.2.1", 53))
s.setblocking(False)
sent = 0
while time.monotonic() < end:
    name = os.urandom(8).hex().encode()
    query = (struct.pack("!6H", sent & 0xFFFF, 0x0100, 1, 0, 0, 0) + bytes([len(name)]) + name
             + b"\x06denied\x04test\x00" + struct.pack("!HH", 1, 1))
    try:
        s.send(query)
        sent += 1
    except OSError:
        pass
print(sent)
"""

CONNECTION_FLOOD = r"""
import resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (5000, 5000))
end = time.monotonic() + float(sys.argv[1])
held, refused = [], 0
while time.monotonic() < end and len(held) < 3000:
    try:
        sock = socket.create_connection(("10.213.2.1", 3128), timeout=2)
        sock.sendall(b"GET http://x/ HTTP/1.1\r\nHo")
        held.append(sock)
    except OSError:
        refused += 1
time.sleep(max(0.0, end - time.monotonic()))
print(len(held), refused)
"""

RESOLVE = r"""
import socket, struct, sys, time
answered = 0
for n in range(int(sys.argv[1])):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(2)
        s.connect(("10.213.1.1", 53))
        s.send(struct.pack("!6H", n, 0x0100, 1, 0, 0, 0) + b"\x07allowed\x04test\x00"
               + struct.pack("!HH", 1, 1))
        try:
            answered += s.recv(512)[:2] == struct.pack("!H", n)
        except OSError:
            pass
    time.sleep(0.01)
print(answered)
"""


def flood(world, script: str, seconds: float) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", netns.sandbox_name(2), sys.executable,
                             "-c", script, str(seconds)], stdout=subprocess.PIPE, text=True)


def test_a_dns_flood_from_one_session_costs_another_nothing(world):
    before = world.counters().get("deny_s2", 0)
    flooding = flood(world, DNS_FLOOD, 6)
    try:
        time.sleep(0.5)
        result = world.in_sandbox(1, sys.executable, "-c", RESOLVE, "300")
    finally:
        sent = int(flooding.communicate(timeout=30)[0])
    assert sent > 20_000  # a real flood: far past what the kernel lets through
    assert result.stdout.strip() == "300", result.stdout + result.stderr
    assert world.counters()["deny_s2"] - before > sent // 2  # turned away in the kernel


def test_a_connection_flood_from_one_session_costs_another_nothing(world):
    ca = str(world.dir / "ca.pem")
    flooding = flood(world, CONNECTION_FLOOD, 8)
    try:
        time.sleep(1)
        codes = []
        for _ in range(20):
            result = world.in_sandbox(1, "curl", "-sS", "--max-time", "5", "--cacert", ca, "-x",
                                      "http://10.213.1.1:3128", "-o", "/dev/null", "-w",
                                      "%{http_code}", "https://allowed.test/")
            codes.append(result.stdout)
    finally:
        held, refused = map(int, flooding.communicate(timeout=60)[0].split())
    status = world.control({"op": "status"})
    assert codes == ["200"] * 20
    assert refused > 0, (held, refused)  # the kernel reset the flood's excess at once
    assert status["proxy"]["per_session"].get("s2", {"connections": 0})["connections"] <= 256
