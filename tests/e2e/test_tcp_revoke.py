"""Outliving a revoke (THREATS.md class 26) on the tcp path: real sandboxes, the real filter
and nftables, the kernel's conntrack, the fake internet's long-lived TCP service.

A sandbox resolves a name a tcp rule allows (which teaches the firewall an element), opens
two connections to the service (one it talks on, one the service talks on unasked) and
holds them. Then the policy stops allowing it: the rule is removed, or the session goes, or
the filter restarts and can no longer say who taught what. Both connections must die, in
both directions, with the ruleset's own rejects (a reset, at once, not a silent hang), a new
connection must be refused, and the cut must be recorded, counting both connections (the
event of that step: never an earlier one's). Until the entries are deleted, a flow goes on
without its element (the forward chain accepts established flows first). The waits below
are hang detectors: generous bounds, never speed assertions.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from . import netns
from .internet import STREAM_HOST, STREAM_PORT

RULE = f"stream.test:{STREAM_PORT}"
HANG = 10.0
"""Seconds after which something that should have happened is called a hang."""

CLIENT = r"""
import json, socket, sys, time

def say(**fields):
    print(json.dumps(fields), flush=True)

def attempt(work):  # what `work` read, or how it failed: an exception's name, or EOF
    try:
        data = work()
    except OSError as exc:
        return type(exc).__name__
    return data.decode() if data else "EOF"

def failed(outcome):
    return outcome == "EOF" or outcome.endswith("Error")

# getaddrinfo asks the filter (the sandbox's resolv.conf): the answer teaches the firewall
address = socket.getaddrinfo(sys.argv[1], None, socket.AF_INET)[0][4][0]
port = int(sys.argv[2])
echo = socket.create_connection((address, port), timeout=2)
echo.sendall(b"echo\nhello")
hello = echo.recv(5)
tick = socket.create_connection((address, port), timeout=2)
tick.sendall(b"tick\n")
say(address=address, echo=hello.decode(), tick=tick.recv(5).decode(),
    tick_port=tick.getsockname()[1])
for line in sys.stdin:
    command = line.strip()
    if command == "echo":  # one round trip on the connection the sandbox talks on
        say(echo=attempt(lambda: (echo.sendall(b"ping"), echo.recv(4))[1]))
    elif command == "ticks":  # does the service still reach the sandbox? (1 s of silence)
        tick.settimeout(1.0)
        deadline, outcome = time.monotonic() + 3, "ticking"
        while time.monotonic() < deadline:
            got = attempt(lambda: tick.recv(4096))
            if failed(got):
                outcome = got
                break
        say(ticks=outcome)
    elif command == "connect":  # a new connection to the same address and port
        say(connect=attempt(lambda: socket.create_connection((address, port),
                                                             timeout=5).recv(0) or b"open"))
"""


class Client:
    """The client above, in sandbox `index`'s namespace, holding its connections open."""

    def __init__(self, index: int, name: str = "stream.test"):
        self.process = subprocess.Popen(
            ["ip", "netns", "exec", netns.sandbox_name(index), sys.executable, "-c", CLIENT,
             name, str(STREAM_PORT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        self.opened = self.read()

    def read(self) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], 15)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.process.kill()
            raise AssertionError(f"the client said nothing:\n{self.process.stderr.read()}")
        return json.loads(line)

    def ask(self, command: str) -> str:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read()[command]

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            stream.close()


def _until(check, what: str):
    deadline = time.monotonic() + HANG
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} (after {HANG:.0f}s)")
        time.sleep(0.1)


def _dies(client: Client, since: float, what: str) -> str:
    """Round trips on the echo connection until one fails: what ended it. Prints how long
    after `since` (information, not an assertion)."""
    def failed():
        outcome = client.ask("echo")
        return outcome if outcome != "ping" else None

    outcome = _until(failed, "the established connection outlived the revoke")
    print(f"{what}: the established connection died {time.monotonic() - since:.3f}s later")
    return outcome


def _reset_at_the_service(world, sandbox: str, port: int) -> None:
    """The service's side of the tick connection ended with a reset from the firewall."""
    log = world.dir / "stream.log"
    line = f"end {sandbox}:{port} tick reset"
    _until(lambda: log.exists() and line in log.read_text(),
           f"the service's side was not cut: no {line!r} in stream.log")


def _seq(world) -> int:
    """The audit log's last record: a cut event of the step that follows comes after it."""
    return max((e.get("seq", 0) for e in world.events()), default=0)


def _cut_event(world, session: str, why: str, after: int) -> dict:
    """The cut event recorded after `after` (never an earlier step's): it must count both
    connections, the one the sandbox talks on and the one the service talks on."""
    def found():
        return next((e for e in world.events() if e.get("seq", 0) > after
                     and e.get("kind") == "firewall"
                     and e.get("reason", "").startswith("cut:") and e.get("session") == session
                     and e.get("address") == STREAM_HOST and e.get("port") == STREAM_PORT
                     and why in e["reason"]), None)

    event = _until(found, f"no cut event for {session} ({why})")
    assert event["verdict"] == "deny"
    assert event["connections"] == 2 and event["reason"].endswith("2 connections ended"), event
    return event


def _learned(sandbox: str) -> list:
    listing = json.loads(netns.sh("nft", "-j", "list", "set", "inet", "corral", "learned",
                                  ns=netns.APPLIANCE).stdout)
    return [e["elem"]["val"]["concat"] for item in listing["nftables"] if "set" in item
            for e in item["set"].get("elem", []) if e["elem"]["val"]["concat"][0] == sandbox]


@contextlib.contextmanager
def _tcp_loose(value: str):
    """nf_conntrack_tcp_loose in the appliance's namespace, put back afterwards."""
    key = "net.netfilter.nf_conntrack_tcp_loose"
    before = netns.sh("sysctl", "-n", key, ns=netns.APPLIANCE).stdout.strip()
    netns.sh("sysctl", "-qw", f"{key}={value}", ns=netns.APPLIANCE)
    try:
        yield
    finally:
        netns.sh("sysctl", "-qw", f"{key}={before}", ns=netns.APPLIANCE)


@pytest.mark.parametrize("loose", ["1", "0"], ids=["tcp_loose", "tcp_strict"])
def test_removing_a_tcp_rule_ends_its_established_connections(world, loose):
    """With nf_conntrack_tcp_loose on (the kernel's default), a cut flow's next packet is a
    new one; off, it is invalid. Either way the sandbox's next packet is answered with a
    reset and nothing more from the service reaches the sandbox."""
    sandbox = "10.213.1.2"
    added = world.control({"op": "add", "session": "s1", "kind": "tcp", "rule": RULE})
    assert added["ok"], added
    client = None
    try:
        with _tcp_loose(loose):
            client = Client(1)
            assert client.opened["echo"] == "hello" and client.opened["tick"] == "tick\n"
            assert [sandbox, STREAM_HOST, STREAM_PORT] in _learned(sandbox)

            started, mark = time.monotonic(), _seq(world)
            removed = world.control({"op": "remove", "session": "s1", "kind": "tcp",
                                     "rule": RULE})
            assert removed["ok"], removed
            event = _cut_event(world, "s1", "stream.test is not in the tcp policy", mark)
            assert event["client"] == sandbox and event["name"] == "stream.test"
            assert _dies(client, started, f"rule removed (tcp_loose={loose})") == (
                "ConnectionResetError")  # the firewall's reset, not a hang
            assert client.ask("ticks") == "TimeoutError"  # the service reaches it no more
            if loose == "1":  # the service's next tick met a reset too
                _reset_at_the_service(world, sandbox, client.opened["tick_port"])
            assert client.ask("connect") == "ConnectionRefusedError"  # refused at once
            assert [sandbox, STREAM_HOST, STREAM_PORT] not in _learned(sandbox)
    finally:
        if client is not None:
            client.close()
        world.control({"op": "remove", "session": "s1", "kind": "tcp", "rule": RULE})


def test_an_established_flow_outlives_its_element_until_its_conntrack_entry_goes(world):
    """The forward chain accepts established flows before it looks at the learned set, so
    an element that leaves the set (its time ran out, or a cut took it out and has not yet
    deleted the flow's entries) stops only new connections: its flows go on, both ways,
    until conntrack forgets them. The accept used to compare the state with established
    and related OR-ed together, which no packet is: such a flow's next packet met the
    session's reset, one side only (the cut then saw it closed and counted one)."""
    sandbox = "10.213.1.2"
    added = world.control({"op": "add", "session": "s1", "kind": "tcp", "rule": RULE})
    assert added["ok"], added
    client = None
    try:
        client = Client(1)
        element = f"{{ {sandbox} . {STREAM_HOST} . {STREAM_PORT} }}"
        netns.sh("nft", "delete", "element", "inet", "corral", "learned", element,
                 ns=netns.APPLIANCE)  # as its timeout would
        assert [sandbox, STREAM_HOST, STREAM_PORT] not in _learned(sandbox)
        assert client.ask("echo") == "ping"  # the sandbox's side goes on
        assert client.ask("ticks") == "ticking"  # and the service's
        assert client.ask("connect") == "ConnectionRefusedError"  # a new one does not
    finally:
        if client is not None:
            client.close()
        world.control({"op": "remove", "session": "s1", "kind": "tcp", "rule": RULE})


def test_a_session_that_goes_takes_its_established_connections_with_it(world):
    """The session's subnet leaves the ruleset, so its sandbox's packets are dropped at the
    spoofing check; what the service sends it is refused once its flows are cut."""
    index, sandbox = 4, "10.213.4.2"
    netns.add_sandbox(index)
    policy = world.dir / "s4.toml"
    policy.write_text(f'[tcp]\nallow = ["{RULE}"]\n')
    added = world.control({"op": "session-add", "name": "s4", "subnet": "10.213.4.0/24",
                           "files": [str(policy)]})
    assert added["ok"], added
    client = None
    registered = True
    try:
        client = Client(index)
        assert client.opened["echo"] == "hello"
        assert client.ask("ticks") == "ticking"
        mark = _seq(world)
        gone = world.control({"op": "session-remove", "name": "s4"})
        assert gone["ok"], gone
        registered = False
        event = _cut_event(world, "s4", "session s4 is gone", mark)
        assert event["client"] == sandbox
        _reset_at_the_service(world, sandbox, client.opened["tick_port"])
        assert client.ask("ticks") == "TimeoutError"
        assert client.ask("echo") == "TimeoutError"  # dropped: the subnet is no session's
    finally:
        if client is not None:
            client.close()
        if registered:
            world.control({"op": "session-remove", "name": "s4"})
        netns.remove_sandbox(index)


def _filter_pid(world) -> int:
    log = (world.dir / "logs" / "supervisor.log").read_text()
    return int(re.findall(r"started filter \(pid (\d+)\)", log)[-1])


def test_a_restarted_filter_ends_the_connections_it_cannot_vouch_for(world):
    """The learned set outlives the filter; the ledger of who taught it does not. A filter
    that starts drops what it finds there and ends its flows (as the proxy's die with the
    process): an allowance nobody can take back must not stay."""
    sandbox = "10.213.1.2"
    added = world.control({"op": "add", "session": "s1", "kind": "tcp", "rule": RULE})
    assert added["ok"], added
    client = None
    try:
        client = Client(1)
        assert client.opened["echo"] == "hello"
        old = _filter_pid(world)
        started, mark = time.monotonic(), _seq(world)
        os.kill(old, signal.SIGKILL)  # started by this test's world: its own child
        _until(lambda: _filter_pid(world) != old and world._filter_up(),
               "the supervisor did not bring the filter back")
        event = _cut_event(world, "s1", "the filter restarted", mark)
        assert event["name"] is None
        assert _dies(client, started, "filter killed and restarted") == "ConnectionResetError"
        _reset_at_the_service(world, sandbox, client.opened["tick_port"])
        assert client.ask("connect") == "ConnectionRefusedError"  # until it asks again
        again = Client(1)  # a new answer teaches the restarted filter
        again.close()
    finally:
        if client is not None:
            client.close()
        world.control({"op": "remove", "session": "s1", "kind": "tcp", "rule": RULE})
