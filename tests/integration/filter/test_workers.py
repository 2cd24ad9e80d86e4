"""`[filter] workers = 2`: sessions sharded across two worker processes, one coordinator.
Every change made through the control socket is in force in both workers when the call
returns; a worker's events reach the coordinator's bus and its one audit chain; a killed
worker's sessions get no answer until the next one serves them, under the policy of now.
Real corral-filter, real worker processes, real sockets on 127.78.0.0/16."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from dnslib import DNSRecord

from tests.helpers import stop

from .test_gateways import EXE, GatewayFilter, free_ports

POLICY = """
[http]
allow = ["allowed.test:8080"]
[cidr]
allow = ["127.31.0.0/16"]     # the fake internet lives in loopback
"""
ZERO, ONE = "w1", "w3"
"""The config file's sessions, in order: on worker 0 and worker 1 of two (the least loaded
when each came)."""
SUBNETS = {ZERO: "127.78.1", ONE: "127.78.3", "w6": "127.78.6"}


def ask(gateway: str, port: int, client: str, name: str, timeout: float = 5) -> str:
    """The DNS filter's rcode for `name` (NOERROR, NXDOMAIN), or "timeout"."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.bind((client, 0))
        sock.sendto(DNSRecord.question(name).pack(), (gateway, port))
        try:
            reply = DNSRecord.parse(sock.recv(4096))
        except TimeoutError:
            return "timeout"
    return {0: "NOERROR", 3: "NXDOMAIN"}.get(reply.header.rcode, str(reply.header.rcode))


def fetch(gateway: str, port: int, client: str, url: str) -> int:
    """The status of GET `url` through the explicit proxy at the gateway, from `client`."""
    with socket.create_connection((gateway, port), timeout=10,
                                  source_address=(client, 0)) as sock:
        host = url.split("/")[2]
        sock.sendall(f"GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                     .encode())
        head = sock.recv(4096)
    if not head:
        raise ConnectionError("closed without an answer")
    return int(head.split()[1])


class LoopFilter(GatewayFilter):
    """GatewayFilter on the event loop asked for (the workers are started on the same)."""

    def __init__(self, directory: Path, config: Path, loop: str):
        self.loop = loop
        super().__init__(directory, config)

    def start(self) -> None:
        with open(self.dir / "filter.log", "ab") as log:
            self.process = subprocess.Popen([EXE, "--config", str(self.config),
                                             "--event-loop", self.loop], stderr=log)
        self.wait_started()


def started(internet, tmp_path, loop: str = "auto", settings: str = "") -> LoopFilter:
    """corral-filter with two workers, ZERO served by worker 0 and ONE by worker 1, the git
    gateway on each gateway as the role writes it (the coordinator serves it); `settings`:
    more of its [filter] table."""
    dns, proxy, ssh = free_ports(3)
    (tmp_path / "w.toml").write_text(POLICY)
    config = tmp_path / "filter.toml"
    upstream = "{}:{}".format(*internet.dns.address)
    sessions = "".join(f"""
[[session]]
name = "{name}"
subnet = "{SUBNETS[name]}.0/24"
files = ["{tmp_path}/w.toml"]
""" for name in (ZERO, ONE))
    config.write_text(f"""
[filter]
workers = 2
{settings}
[dns]
listen = ["gateway:{dns}"]
upstream = ["{upstream}"]
[proxy]
listen = ["gateway:{proxy}"]
[sshgate]
listen = ["gateway:{ssh}"]
[state]
dir = "{tmp_path}/state"
[control]
socket = "{tmp_path}/filter.sock"
{sessions}""")
    running = LoopFilter(tmp_path, config, loop)
    running.dns, running.proxy, running.ssh = dns, proxy, ssh
    running.files = str(tmp_path / "w.toml")
    return running


@pytest.fixture(params=["uvloop", "asyncio"])
def sharded(internet, tmp_path, request):
    running = started(internet, tmp_path, request.param)
    yield running
    stop(running.process)
    assert not [p for p in _children(running.process.pid)], "a worker outlived the filter"


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def gateway(name: str) -> str:
    return f"{SUBNETS[name]}.1"


def client(name: str) -> str:
    return f"{SUBNETS[name]}.2"


def workers(f) -> list[dict]:
    return f.control({"op": "status"})["workers"]


def test_each_session_is_served_by_its_worker_and_events_reach_one_audit_chain(sharded):
    f = sharded
    listeners = f.control({"op": "status"})["listeners"]
    assert sorted(listeners["sshgate"]) == [f"{gateway(n)}:{f.ssh}" for n in (ZERO, ONE)]
    assert sorted(listeners["proxy"]) == [f"{gateway(n)}:{f.proxy}" for n in (ZERO, ONE)]
    for name in (ZERO, ONE):
        assert banner(gateway(name), f.ssh).startswith(b"SSH-2.0-")
    seen = workers(f)
    assert [w["index"] for w in seen] == [0, 1] and all(w["up"] for w in seen)
    assert seen[0]["sessions"] == [ZERO] and seen[1]["sessions"] == [ONE]
    pids = {w["pid"] for w in seen}
    assert len(pids) == 2 and f.process.pid not in pids
    for pid in pids:  # a worker keeps no capability (it binds nothing, and no nftables)
        status = dict(line.split(":\t", 1) for line in
                      Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
        assert {k: int(status[k], 16) for k in ("CapEff", "CapPrm", "CapAmb")} == {
            "CapEff": 0, "CapPrm": 0, "CapAmb": 0}
    assert set(_children(f.process.pid)) == pids
    for name in (ZERO, ONE):
        assert ask(gateway(name), f.dns, client(name), "allowed.test") == "NOERROR"
        assert ask(gateway(name), f.dns, client(name), "denied.test") == "NXDOMAIN"
        assert fetch(gateway(name), f.proxy, client(name),
                     "http://allowed.test:8080/") == 200
        assert fetch(gateway(name), f.proxy, client(name), "http://other.test:8080/") == 403
    # each worker counted its own; the coordinator's bus has every event, ids apart
    assert {w["index"]: w["proxy"]["connections"] for w in workers(f)} == {0: 2, 1: 2}
    deadline = time.monotonic() + 5
    while True:
        events = f.control({"op": "events", "last": 100})["events"]
        denied = {(e["session"], e["name"]) for e in events if e["verdict"] == "deny"}
        if {(ZERO, "denied.test"), (ONE, "denied.test"), (ZERO, "other.test"),
                (ONE, "other.test")} <= denied or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert {(ZERO, "denied.test"), (ONE, "denied.test")} <= denied
    assert {(ZERO, "other.test"), (ONE, "other.test")} <= denied
    # one id per flow (its closing event shares it), and the workers' ids never meet
    flows = [(e["id"], bool(e.get("closed"))) for e in events]
    assert len(flows) == len(set(flows))
    by_session = {s: {e["id"] >> 40 for e in events if e["session"] == s} for s in (ZERO, ONE)}
    assert len(by_session[ZERO]) == len(by_session[ONE]) == 1, by_session  # a block each
    assert by_session[ZERO] != by_session[ONE] and 0 not in by_session[ZERO] | by_session[ONE]
    assert all(e["id"] < 2 ** 53 for e in events)  # read exactly by the dashboard's JavaScript
    verified = f.control({"op": "audit-verify"})
    assert verified["ok"], verified
    page = f.control({"op": "audit", "limit": 1000})
    audited = {(r.get("session"), r.get("name")) for r in page["records"]
               if r.get("verdict") == "deny"}
    assert {(ZERO, "denied.test"), (ONE, "denied.test")} <= audited


def test_a_rule_and_its_revoke_are_in_force_in_every_worker_when_the_call_returns(sharded):
    f = sharded
    for name in (ZERO, ONE):
        assert ask(gateway(name), f.dns, client(name), "other.test") == "NXDOMAIN"
    for name in (ZERO, ONE):
        assert f.control({"op": "add", "session": name, "kind": "http",
                          "rule": "other.test:8080"})["ok"]
    for name in (ZERO, ONE):  # no wait: the call returned after both workers took it
        assert ask(gateway(name), f.dns, client(name), "other.test") == "NOERROR"
        assert fetch(gateway(name), f.proxy, client(name), "http://other.test:8080/") == 200
    for name in (ZERO, ONE):
        assert f.control({"op": "remove", "session": name, "kind": "http",
                          "rule": "other.test:8080"})["ok"]
    for name in (ZERO, ONE):
        assert ask(gateway(name), f.dns, client(name), "other.test") == "NXDOMAIN"
        assert fetch(gateway(name), f.proxy, client(name), "http://other.test:8080/") == 403


def test_a_secret_set_or_removed_is_in_every_worker_when_the_call_returns(sharded):
    f = sharded
    assert [w["secrets"] for w in workers(f)] == [0, 0]
    assert f.control({"op": "secret-set", "name": "TOKEN", "value": "v" * 24 + "-worker-test",
                      "hosts": ["allowed.test"]})["ok"]
    assert [w["secrets"] for w in workers(f)] == [1, 1]
    assert f.control({"op": "secret-remove", "name": "TOKEN"})["ok"]
    assert [w["secrets"] for w in workers(f)] == [0, 0]


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled(pids: list[int]) -> list[int]:
    """Each process's descriptors once they stop moving (the last turn's git gateway
    connection closes a moment after its client does)."""
    deadline = time.monotonic() + 5
    counts = [descriptors(pid) for pid in pids]
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = [descriptors(pid) for pid in pids]
        if now == counts:
            break
        counts = now
    return counts


def banner(gateway: str, port: int) -> bytes:
    with socket.create_connection((gateway, port), timeout=5) as sock:
        return sock.recv(64)


def test_a_session_added_at_run_time_is_served_by_its_worker_and_closed_when_removed(
        sharded):
    f = sharded
    pids = [f.process.pid, *(w["pid"] for w in workers(f))]
    before = None
    for turn in range(7):  # nothing is left behind, in any process, by a session that went
        if turn == 4:  # (the first turns fill the resolver's pool of 4 upstream sockets)
            before = settled(pids)
        assert f.control({"op": "session-add", "name": "w6", "subnet": "127.78.6.0/24",
                          "files": [f.files]})["ok"]
        assert ask(gateway("w6"), f.dns, client("w6"), "allowed.test") == "NOERROR"
        assert workers(f)[0]["sessions"] == [ZERO, "w6"]  # a tie: the first worker
        assert banner(gateway("w6"), f.ssh).startswith(b"SSH-2.0-")  # the coordinator's
        assert f.control({"op": "session-remove", "name": "w6"})["ok"]
        for port in (f.proxy, f.ssh):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((gateway("w6"), port), timeout=5).close()
        assert workers(f)[0]["sessions"] == [ZERO]
    assert settled(pids) == before


def test_a_killed_worker_fails_its_sessions_closed_and_the_next_serves_the_policy_of_now(
        sharded):
    f = sharded
    one = workers(f)[1]
    os.kill(one["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while workers(f)[1]["up"] and time.monotonic() < deadline:
        time.sleep(0.01)
    status = f.control({"op": "status"})
    assert list(status["unserved"]) == [ONE]  # said while it is down
    # meanwhile: a rule added while nobody serves ONE; ZERO is served throughout
    assert f.control({"op": "add", "session": ONE, "kind": "http",
                      "rule": "other.test:8080"})["ok"]
    assert ask(gateway(ZERO), f.dns, client(ZERO), "allowed.test") == "NOERROR"
    while True:
        now = workers(f)[1]
        if now["up"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert now["up"] and now["restarts"] == 1 and now["pid"] != one["pid"]
    assert f.control({"op": "status"})["unserved"] == {}
    assert ask(gateway(ONE), f.dns, client(ONE), "other.test") == "NOERROR"
    assert fetch(gateway(ONE), f.proxy, client(ONE), "http://other.test:8080/") == 200


def test_while_a_worker_is_down_its_sessions_get_no_answer(sharded):
    """Stopped (SIGSTOP), not killed: its sockets are open and nobody answers on them; the
    other worker's sessions are served."""
    f = sharded
    one = workers(f)[1]
    os.kill(one["pid"], signal.SIGSTOP)
    try:
        assert ask(gateway(ONE), f.dns, client(ONE), "allowed.test", timeout=1) == "timeout"
        assert ask(gateway(ZERO), f.dns, client(ZERO), "allowed.test") == "NOERROR"
    finally:
        os.kill(one["pid"], signal.SIGCONT)
    assert ask(gateway(ONE), f.dns, client(ONE), "allowed.test") == "NOERROR"


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_worker_that_stops_answering_is_killed_and_started_again(internet, tmp_path, loop):
    """Stopped and never continued (as a worker wedged in a loop would be): the coordinator
    hears nothing from it for `worker_silence` seconds, kills it and starts the next, which
    serves its sessions again; nothing waits for a control call to find it stuck. Its
    neighbour, answering, is left alone."""
    f = started(internet, tmp_path, loop, "worker_silence = 3")
    zero, one = workers(f)
    stopped_at = time.monotonic()
    os.kill(one["pid"], signal.SIGSTOP)
    try:
        deadline = stopped_at + 3 + 30
        while time.monotonic() < deadline:
            now = workers(f)[1]
            if now["up"] and now.get("pid") not in (None, one["pid"]):
                break
            time.sleep(0.2)
        assert now["up"] and now["pid"] != one["pid"] and now["restarts"] == 1, now
        assert time.monotonic() - stopped_at > 3  # not before its silence was up
        assert workers(f)[0]["pid"] == zero["pid"] and workers(f)[0]["restarts"] == 0
        assert ask(gateway(ONE), f.dns, client(ONE), "allowed.test") == "NOERROR"
        assert fetch(gateway(ONE), f.proxy, client(ONE), "http://allowed.test:8080/") == 200
        assert "answered nothing for" in (f.dir / "filter.log").read_text()
    finally:
        if workers(f)[1].get("pid") == one["pid"]:  # not restarted: this test's to end
            os.kill(one["pid"], signal.SIGKILL)
        stop(f.process)


def _ask_mode(f) -> None:
    Path(f.files).write_text(POLICY + '\n[approval]\nmode = "ask"\nhold = 20\n')
    f.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(any(r["kind"] == "approval" for r in f.control(
                {"op": "policy", "session": name})["rules"]) for name in (ZERO, ONE)):
            return
        time.sleep(0.05)
    raise AssertionError("the reload did not turn ask mode on")


def _opened(f, session: str, target: str, waiting: int | None = None) -> dict:
    """The approval for `target`, once open (and with `waiting` requests held for it: the
    worker says it waits just after the approval opens)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for approval in f.control({"op": "approvals", "session": session})["approvals"]:
            if approval["target"] == target and waiting in (None, approval["waiting"]):
                return approval
        time.sleep(0.05)
    raise AssertionError(f"no approval for {target} in {session} ({waiting} waiting)")


def test_a_request_held_in_a_worker_goes_on_when_a_person_approves_it_in_the_filter(
        sharded):
    f = sharded
    _ask_mode(f)
    with ThreadPoolExecutor(2) as pool:
        for name in (ZERO, ONE):
            held = pool.submit(fetch, gateway(name), f.proxy, client(name),
                               "http://other.test:8080/")
            approval = _opened(f, name, "other.test:8080", waiting=1)
            assert not held.done()
            decided = f.control({"op": "approval-decide", "id": approval["id"],
                                 "grant": "once", "by": "test"})
            assert decided["ok"] and decided["released"] == 1, decided
            assert held.result(10) == 200
        # refused: the held request is denied at once, saying by whom
        held = pool.submit(fetch, gateway(ONE), f.proxy, client(ONE), "http://other.test:8080/")
        approval = _opened(f, ONE, "other.test:8080")
        started = time.monotonic()
        assert f.control({"op": "approval-decide", "id": approval["id"], "grant": "refuse",
                          "by": "test"})["ok"]
        assert held.result(10) == 403 and time.monotonic() - started < 5
    # a DNS question opens one too (answered NXDOMAIN at once), in the one book
    assert ask(gateway(ONE), f.dns, client(ONE), "fronted.test") == "NXDOMAIN"
    assert _opened(f, ONE, "fronted.test")["origin"] == "dns"
    # for the session: the grant's rule is in force in its worker when the call returns
    held = f.control({"op": "approvals", "session": ONE})["approvals"]
    (dns,) = [a for a in held if a["target"] == "fronted.test"]
    assert f.control({"op": "approval-decide", "id": dns["id"], "grant": "session",
                      "by": "test"})["ok"]
    assert ask(gateway(ONE), f.dns, client(ONE), "fronted.test") == "NOERROR"


def test_a_worker_killed_while_requests_wait_leaves_no_request_counted(sharded):
    f = sharded
    _ask_mode(f)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(fetch, gateway(ONE), f.proxy, client(ONE), "http://other.test:8080/")
        approval = _opened(f, ONE, "other.test:8080", waiting=1)
        os.kill(workers(f)[1]["pid"], signal.SIGKILL)
        with pytest.raises(OSError):  # its connection went with it
            held.result(10)
    assert _opened(f, ONE, "other.test:8080", waiting=0)["id"] == approval["id"]
    answer = f.control({"op": "approval-decide", "id": approval["id"], "grant": "once",
                        "by": "test"})
    assert not answer["ok"] and "no request is waiting" in answer["error"]
