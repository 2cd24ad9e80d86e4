"""Attacks on `[filter] workers`: state that must be in every worker before a control call
returns, a dead or restarting worker, and what a worker may tell its coordinator. Real
corral-filter, real worker processes, real sockets on 127.78.0.0/16 (as test_workers.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import stop
from tests.unit.filter.workers.test_jail import ATTEMPT

from .test_workers import (
    ONE,
    ZERO,
    _ask_mode,
    _children,
    _opened,
    ask,
    client,
    fetch,
    gateway,
    started,
    workers,
)


@pytest.fixture
def pair(internet, tmp_path):
    """The filter with two workers, ZERO served by worker 0 and ONE by worker 1."""
    running = started(internet, tmp_path)
    yield running
    for pid in _children(running.process.pid):  # one a test left stopped
        os.kill(pid, signal.SIGCONT)
    stop(running.process)


def _caught_starting(f, index: int) -> int:
    """Kill worker `index` and stop its successor as soon as it exists (before it has told
    the coordinator it started): the pid of the stopped successor."""
    before = {w["pid"] for w in workers(f)}
    os.kill(workers(f)[index]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        new = [p for p in _children(f.process.pid) if p not in before]
        if new:
            os.kill(new[0], signal.SIGSTOP)
            return new[0]
        time.sleep(0.001)
    raise AssertionError("no worker was started again")


def _up(f, index: int) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        seen = workers(f)[index]
        if seen["up"]:
            return seen
        time.sleep(0.02)
    raise AssertionError(f"worker {index} did not come back")


def test_a_secret_removed_while_a_worker_starts_is_removed_there_too(pair):
    """`secret-remove` answered while worker 1 was starting (its start message, with the
    secrets of then, already sent) skipped it: it came up attaching the removed secret to
    its sessions' requests, for as long as it lived."""
    f = pair
    assert f.control({"op": "secret-set", "name": "TOKEN", "value": "v" * 24 + "-worker-test",
                      "hosts": ["allowed.test"]})["ok"]
    assert [w["secrets"] for w in workers(f)] == [1, 1]
    starting = _caught_starting(f, 1)
    with ThreadPoolExecutor(1) as pool:
        removed = pool.submit(f.control, {"op": "secret-remove", "name": "TOKEN"})
        time.sleep(0.5)  # it may wait for the start to end, not skip the worker
        os.kill(starting, signal.SIGCONT)
        assert removed.result(20)["ok"]
    assert _up(f, 1)["pid"] == starting
    assert [w["secrets"] for w in workers(f)] == [0, 0]



def _sockets(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                found.add(int(target[8:-1]))
    return found


def _listening_on_gateways() -> set[int]:
    """The inodes of the sockets bound on the sessions' gateways (127.78.x.1)."""
    found = set()
    for table in ("tcp", "udp"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            address = socket.inet_ntoa(int(fields[1].split(":")[0], 16).to_bytes(4, "little"))
            if address.startswith("127.78."):
                found.add(int(fields[9]))
    return found


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_worker_holds_no_descriptor_of_the_coordinator_but_its_gateways(internet, tmp_path,
                                                                          loop):
    """A worker parses what agents send: of the coordinator's descriptors it is given its
    link and its gateways' listeners, nothing else. Under uvloop a worker was started
    holding the coordinator's netlink socket to nftables (inherited: libuv's spawn closes
    only descriptors marked close-on-exec). Its output goes to a pipe of its own, which the
    filter reads: given the filter's stderr (under systemd a socket, journald's stream), a
    worker could shut it down and the filter's log lines would go nowhere."""
    f = started(internet, tmp_path, loop)
    try:
        coordinator = _sockets(f.process.pid)
        gateways = _listening_on_gateways()
        theirs = {os.readlink(f"/proc/{f.process.pid}/fd/{fd}") for fd in (1, 2)}
        for seen in workers(f):
            shared = (coordinator & _sockets(seen["pid"])) - gateways
            assert not shared, (seen["index"], shared,
                                Path("/proc/net/netlink").read_text())
            output = [os.readlink(f"/proc/{seen['pid']}/fd/{fd}") for fd in (1, 2)]
            # (a pipe; a socketpair's end under uvloop, whose libuv makes pipes of those)
            assert output[0] == "/dev/null" and output[1].startswith(("pipe:", "socket:")), \
                output
            assert not theirs & set(output), (theirs, output)
    finally:
        stop(f.process)



def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def test_a_worker_holds_no_capability_of_the_filter(pair):
    """The filter runs with CAP_NET_ADMIN (its unit gives it as an ambient capability,
    which exec passes on): a worker, which parses what agents send, ran with it too, able
    to load any ruleset itself, whatever the link lets it say."""
    f = pair
    assert int(_status(f.process.pid)["CapEff"], 16)  # the filter has some here (root)
    for seen in workers(f):
        status = _status(seen["pid"])
        assert [status[k] for k in ("CapEff", "CapPrm", "CapAmb", "CapInh", "NoNewPrivs")] \
            == ["0" * 16] * 4 + ["1"], (seen["index"], status)
        assert ask(gateway(ZERO), f.dns, client(ZERO), "allowed.test") == "NOERROR"
        assert ask(gateway(ONE), f.dns, client(ONE), "allowed.test") == "NOERROR"


ATTACK = ATTEMPT + """
import json, os, socket, sys
uid, gid, control, state, coordinator, sibling, policy = sys.argv[1:]
os.setgroups([]); os.setgid(int(gid)); os.setuid(int(uid))
from appliance.filter.workers.confine import confine
confine(os.open("/dev/null", os.O_RDONLY))  # as a worker is, from its first byte on
def add_rule():
    s = socket.socket(socket.AF_UNIX); s.connect(control)
    s.sendall(json.dumps({"op": "add", "session": "%s", "kind": "http",
                          "rule": "evil.test:443"}).encode() + b"\\n")
    raise OSError(0, s.makefile().readline())
attempt("control socket", add_rule)
attempt("state file", lambda: open(os.path.join(state, "planted"), "w"))
attempt("control socket moved", lambda: os.rename(control, control + ".moved"))
attempt("shell", lambda: os.execv("/bin/sh", ["sh", "-c", "true"]))
attempt("fork", os.fork)
attempt("signal the coordinator", lambda: os.kill(int(coordinator), 19))
attempt("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
attempt("another worker's memory", lambda: open(f"/proc/{sibling}/environ", "rb").read())
attempt("the coordinator's memory", lambda: open(f"/proc/{coordinator}/environ", "rb").read())
attempt("the state directory", lambda: os.listdir(state))
attempt("the audit log", lambda: open(os.path.join(state, "audit.jsonl"), "rb").read())
attempt("the policy files", lambda: open(policy).read())
print(json.dumps(tried))
"""


def test_a_process_confined_as_a_worker_cannot_act_as_its_coordinator(pair):
    """What the JSON-only link is for (a worker made to misbehave must not act as the
    coordinator) holds only if a worker cannot simply do what the coordinator does. It runs
    as the filter's user, so with the uid alone it could connect to the control socket
    (0600, the filter's) and add any rule, write the state directory, or stop the filter.
    Confined as a worker is (its uid, no capability, the jail's filter, its Landlock
    ruleset), none of that; nor can it read the state directory (the audit log, the secrets'
    store) or the policy files, which its user may."""
    f = pair
    seen = workers(f)[1]
    status = _status(seen["pid"])
    assert (status["Seccomp"], status["Seccomp_filters"]) == ("2", "1"), status
    uid, gid = status["Uid"].split()[1], status["Gid"].split()[1]
    done = subprocess.run([sys.executable, "-c", ATTACK % ZERO, uid, gid,
                           str(f.dir / "filter.sock"), str(f.dir / "state"),
                           str(f.process.pid), str(workers(f)[0]["pid"]), f.files],
                          capture_output=True, text=True, timeout=30)
    tried = json.loads(done.stdout)
    assert tried == {"control socket": 97, "state file": 13, "control socket moved": 1, "shell": 1,
                     "fork": 1, "signal the coordinator": 1, "netlink": 97,
                     "another worker's memory": 13, "the coordinator's memory": 13,
                     "the state directory": 13, "the audit log": 13,
                     "the policy files": 13}, tried
    confined = [line for line in (f.dir / "filter.log").read_text().splitlines()
                if "confined" in line]  # the real workers say what the kernel gave them
    assert len(confined) >= 2 and all("Landlock ABI" in line for line in confined), confined
    assert (f.dir / "state" / "audit.jsonl").is_file()  # there, and its user's to read
    assert not (f.dir / "state" / "planted").exists()
    assert (f.dir / "filter.sock").exists()
    assert "evil.test" not in json.dumps(f.control({"op": "policy", "session": ZERO}))
    assert ask(gateway(ZERO), f.dns, client(ZERO), "allowed.test") == "NOERROR"


def test_a_stopped_coordinator_leaves_no_worker_serving(pair):
    """With the coordinator stopped (or its loop stuck) the workers served on: decisions
    recorded nowhere (their events queued in the worker's memory, lost if it goes), no
    control call answered, so no revoke can be made. Nothing is served once the workers
    stop hearing it; running again, it starts them and they serve the policy of now."""
    f = pair
    os.kill(f.process.pid, signal.SIGSTOP)
    try:
        assert ask(gateway(ZERO), f.dns, client(ZERO), "allowed.test") == "NOERROR"
        deadline = time.monotonic() + 15
        while ask(gateway(ZERO), f.dns, client(ZERO), "allowed.test", timeout=0.5) \
                != "timeout" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ask(gateway(ZERO), f.dns, client(ZERO), "allowed.test", timeout=1) == "timeout"
        assert ask(gateway(ONE), f.dns, client(ONE), "allowed.test", timeout=1) == "timeout"
        with socket.create_connection((gateway(ONE), f.proxy), timeout=1,
                                      source_address=(client(ONE), 0)) as sock:
            sock.sendall(b"GET http://allowed.test:8080/ HTTP/1.1\r\nHost: allowed.test"
                         b":8080\r\n\r\n")
            with pytest.raises(TimeoutError):  # queued in the kernel, never answered
                sock.recv(4096)
    finally:
        os.kill(f.process.pid, signal.SIGCONT)
    _up(f, 0), _up(f, 1)
    assert ask(gateway(ZERO), f.dns, client(ZERO), "allowed.test") == "NOERROR"
    assert fetch(gateway(ONE), f.proxy, client(ONE), "http://allowed.test:8080/") == 200
    # what the workers said meanwhile, on their own pipes, reached the filter's log after
    logged = (f.dir / "filter.log").read_text()
    for index in (0, 1):
        assert f"[worker {index}]: the coordinator was not heard" in logged


def test_a_request_held_when_a_rule_allows_it_goes_on_in_its_worker(pair):
    """A rule added while a request waits in ask mode settles its approval ("the policy
    allows it now") and the request goes on, as with one process. The verdict reached the
    worker before the change did (it is given while the change commits, the change is sent
    after), so the worker judged the request again by the policy before: refused."""
    f = pair
    _ask_mode(f)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(fetch, gateway(ONE), f.proxy, client(ONE),
                           "http://other.test:8080/")
        _opened(f, ONE, "other.test:8080", waiting=1)
        assert f.control({"op": "add", "session": ONE, "kind": "http",
                          "rule": "other.test:8080"})["ok"]
        assert held.result(10) == 200


def test_a_grant_that_ends_when_the_disk_refuses_ends_in_its_worker_too(pair):
    """A rule granted for a while ends in the filter even when its file cannot be written
    (expiry.py: fail closed, the change committed in memory alone). That commit did not
    go through the changes' door, so no worker was told: the rule stayed in force in its
    session's worker, and later changes (told as differences) left it there until that
    session's policy changed again, a reload or the worker's restart."""
    f = pair
    assert f.control({"op": "add", "session": ONE, "kind": "http", "rule": "other.test:8080",
                      "expires_in": 2})["ok"]
    assert fetch(gateway(ONE), f.proxy, client(ONE), "http://other.test:8080/") == 200
    runtime = f.dir / "state" / "runtime"
    runtime.rename(f.dir / "state" / "runtime.away")
    runtime.write_text("not a directory: the grant's end cannot be written")
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                r["rule"] == "other.test:8080"
                for r in f.control({"op": "policy", "session": ONE})["rules"]):
            time.sleep(0.1)
        rules = f.control({"op": "policy", "session": ONE})["rules"]
        assert not any(r["rule"] == "other.test:8080" for r in rules)  # ended in the filter
        assert fetch(gateway(ONE), f.proxy, client(ONE), "http://other.test:8080/") == 403
        assert ask(gateway(ONE), f.dns, client(ONE), "other.test") == "NXDOMAIN"
    finally:
        runtime.unlink()
        (f.dir / "state" / "runtime.away").rename(runtime)
