"""A sandbox on a bridge whose name matches none of `[firewall] interfaces` (a podman that
names its bridges differently, a pattern mistyped) is still held: IPv4 by the session's
subnet, IPv6 because nothing is forwarded over IPv6 at all. Real nftables, real filter, in
the e2e namespaces; the sandbox is wired to the appliance on "leak99"."""

from __future__ import annotations

import contextlib
import json
import sys

import pytest

from . import netns
from .internet import SSH_HOST, WEB, WEB_V6

pytestmark = pytest.mark.e2e

INDEX, BRIDGE, SESSION = 99, "leak99", "s99"
SUBNET, GATEWAY = "10.213.99.0/24", "10.213.99.1"

PROBE = """
import socket, sys
family, host, port, kind = sys.argv[1:]
sock = socket.socket(socket.AF_INET6 if family == "6" else socket.AF_INET,
                     socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM)
sock.settimeout(3)
try:
    sock.connect((host, int(port)))
    if kind == "udp":
        sock.send(b"corral-e2e-echo")
    else:
        print("connected", end=" ")  # an HTTP server says nothing first
    print("open", sock.recv(64).decode(errors="replace").strip())
except ConnectionRefusedError:
    print("refused")
except OSError as exc:
    print(type(exc).__name__, exc.errno)
"""


def probe(world, family: str, host: str, port: int, kind: str = "tcp") -> str:
    result = world.in_sandbox(INDEX, sys.executable, "-c", PROBE, family, host, str(port),
                              kind, timeout=30)
    return result.stdout.strip() or result.stderr.strip()


@pytest.fixture
def unmatched(world):
    """Sandbox 99 on a bridge no pattern names; its session removed again afterwards."""
    netns.add_sandbox(INDEX, BRIDGE)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            world.control({"op": "session-remove", "name": SESSION, "forget_rules": True})
        netns.remove_sandbox(INDEX, BRIDGE)


def test_a_sandbox_on_an_interface_no_pattern_names_leaks_nothing(world, unmatched):
    patterns = json.loads(netns.sh("nft", "-j", "list", "chain", "inet", "corral",
                                   "filter_forward", ns=netns.APPLIANCE).stdout)
    assert BRIDGE not in json.dumps(patterns)  # the premise: no rule names this bridge

    # Before it is a session, its IPv4 is ordinary routing (the wiring works: a leak would
    # show), but no IPv6 is forwarded for anybody.
    assert probe(world, "4", SSH_HOST, 22) == "connected open SSH-2.0-corral-e2e"
    assert probe(world, "6", WEB_V6, 80) == "refused"

    policy = world.dir / f"{SESSION}.toml"
    policy.write_text('[http]\nallow = ["allowed.test"]\n')
    answer = world.control({"op": "session-add", "name": SESSION, "subnet": SUBNET,
                            "files": [str(policy)]})
    assert answer["ok"], answer
    before = world.counters()

    assert probe(world, "4", SSH_HOST, 22) == "refused"
    assert not probe(world, "4", WEB, 9999, "udp").startswith("open")
    assert probe(world, "6", WEB_V6, 80) == "refused"
    assert probe(world, "6", WEB_V6, 22) == "refused"
    assert not probe(world, "6", WEB_V6, 443, "udp").startswith("open")
    after = world.counters()
    assert after[f"deny_{SESSION}"] > before.get(f"deny_{SESSION}", 0)
    assert after["deny_ipv6"] >= before["deny_ipv6"] + 3

    # governed, not cut off: its gateway's proxy serves it by its policy
    allowed = world.in_sandbox(INDEX, "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}",
                               "--max-time", "10", "-x", f"http://{GATEWAY}:3128",
                               "http://allowed.test/")
    assert allowed.stdout == "200", allowed.stderr
    denied = world.in_sandbox(INDEX, "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}",
                              "--max-time", "10", "-x", f"http://{GATEWAY}:3128",
                              "http://other.test/")
    assert denied.stdout == "403", denied.stderr
