"""The control socket: runtime rules, persistence across restarts, events, the audit chain."""

from __future__ import annotations

import json
import os
import select
import socket
import stat
import threading
import time
from pathlib import Path

import pytest
from dnslib import RCODE

from appliance.filter import audit
from tests.integration.conftest import ORIGIN, FilterProcess, connect, recv_all
from tests.integration.filter.test_dns import addresses, ask


@pytest.fixture
def fresh_filter(internet, tmp_path):
    """A filter of its own: these tests change policy and restart it."""
    process = FilterProcess(tmp_path, internet.dns.address)
    yield process
    process.stop()


def connect_status(port: int, target: str) -> int:
    with connect(port) as sock:
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
        return int(recv_all(sock, 64).split(b" ")[1])


def test_socket_is_private(fresh_filter):
    mode = stat.S_IMODE(os.stat(fresh_filter.socket).st_mode)
    assert mode == 0o600


def test_socket_can_be_shared_with_the_api_group(internet, tmp_path):
    import grp

    group = grp.getgrgid(os.getgid()).gr_name if os.getgid() != 0 else "daemon"
    process = FilterProcess(tmp_path, internet.dns.address, control_extra=f'group = "{group}"')
    try:
        info = os.stat(process.socket)
        assert stat.S_IMODE(info.st_mode) == 0o660
        assert info.st_gid == grp.getgrnam(group).gr_gid
    finally:
        process.stop()


def test_rule_added_at_runtime_takes_effect_and_survives_restart(fresh_filter, internet):
    f = fresh_filter
    assert ask(f.dns_port, "other.test").header.rcode == RCODE.NXDOMAIN
    assert connect_status(f.proxy_port, "other.test:443") == 403

    answer = f.control({"op": "add", "session": "s1", "kind": "http", "rule": "Other.Test"})
    assert answer == {"ok": True, "added": True, "expires": None, "rule": {
        "kind": "http", "rule": "other.test", "layer": "session", "source": "api"}}
    assert addresses(ask(f.dns_port, "other.test")) == ["127.31.0.2"]
    assert connect_status(f.proxy_port, "other.test:443") == 200

    again = f.control({"op": "add", "session": "s1", "kind": "http", "rule": "other.test"})
    assert again["ok"] and again["added"] is False

    f.restart()
    assert connect_status(f.proxy_port, "other.test:443") == 200
    rules = f.control({"op": "policy", "session": "s1"})["rules"]
    assert {"kind": "http", "rule": "other.test", "layer": "session", "source": "api"} in rules
    assert {"kind": "http", "rule": "allowed.test", "layer": "project",
            "source": str(f.dir / "s1.toml")} in rules

    removed = f.control({"op": "remove", "session": "s1", "kind": "http", "rule": "other.test"})
    assert removed["ok"]
    assert connect_status(f.proxy_port, "other.test:443") == 403
    f.restart()
    assert connect_status(f.proxy_port, "other.test:443") == 403


def test_runtime_deny_wins_over_project_allow(fresh_filter):
    f = fresh_filter
    assert f.control({"op": "add", "session": "s1", "kind": "deny", "rule": "allowed.test"})["ok"]
    assert ask(f.dns_port, "allowed.test").header.rcode == RCODE.NXDOMAIN
    assert connect_status(f.proxy_port, "allowed.test:443") == 403


@pytest.mark.parametrize(("request_", "error"), [
    ({"op": "add", "session": "s1", "kind": "http", "rule": "bad name!"}, "not a valid host name"),
    ({"op": "add", "session": "s1", "kind": "cidr", "rule": "10.0.0.0/8"}, "cannot be added"),
    ({"op": "add", "session": "nope", "kind": "http", "rule": "x.test"}, "no session 'nope'"),
    ({"op": "add", "session": "s1", "kind": "http"}, "'rule' must be a str"),
    ({"op": "remove", "session": "s1", "kind": "http", "rule": "allowed.test"},
     "comes from the project layer"),
    ({"op": "frobnicate"}, "unknown op"),
    (["not", "an", "object"], "a request is a JSON object"),
])
def test_bad_requests_get_precise_errors(fresh_filter, request_, error):
    answer = fresh_filter.control(request_)
    assert answer["ok"] is False and error in answer["error"]


def test_garbage_on_the_socket_is_answered(fresh_filter):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(fresh_filter.socket))
        sock.sendall(b"{not json\n")
        assert b"not JSON" in sock.recv(4096)
    assert fresh_filter.control({"op": "status"})["ok"]


def test_the_apis_stream_answers_at_once_and_outlives_silences(fresh_filter):
    """The API's client of the control socket: subscribed (None) before any event, then
    keep-alives through silences longer than `idle`, and the next event still comes."""
    from appliance.control_client import ControlClient

    events = ControlClient(str(fresh_filter.socket)).stream({"op": "subscribe",
                                                             "verdict": "deny"}, idle=0.1)
    assert next(events) is None  # at once, with nothing having happened
    silences = 0
    while silences < 5:  # half a second of silence: five idle reads
        assert next(events) is None
        silences += 1
    connect_status(fresh_filter.proxy_port, "after-silence.test:443")
    deadline = time.monotonic() + 10  # keep-alives (None) come for ever: bounded by time
    while (event := next(events)) is None:
        assert time.monotonic() < deadline, "no event for the denial within 10s"
    assert event["name"] == "after-silence.test" and event["verdict"] == "deny"
    events.close()


def test_subscribe_streams_filtered_events_live(fresh_filter):
    f = fresh_filter
    received = []
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(5)
    sock.connect(str(f.socket))
    sock.sendall(json.dumps({"op": "subscribe", "verdict": "deny"}).encode() + b"\n")
    stream = sock.makefile("rb")
    assert json.loads(stream.readline())["subscribed"] is True

    def read():
        for _ in range(2):
            received.append(json.loads(stream.readline()))

    reader = threading.Thread(target=read)
    reader.start()
    ask(f.dns_port, "allowed.test")  # allowed: filtered out
    ask(f.dns_port, "denied-one.test")
    connect_status(f.proxy_port, "denied-two.test:443")
    reader.join(5)
    stream.close()
    sock.close()
    assert [(e["kind"], e["name"]) for e in received] == [
        ("dns", "denied-one.test"), ("connect", "denied-two.test")]


def test_audit_log_chain_verifies_and_detects_tampering(fresh_filter):
    f = fresh_filter
    for name in ("allowed.test", "denied.test", "other.test"):
        ask(f.dns_port, name)
    f.wait_event(lambda e: e["name"] == "other.test")
    deadline = time.monotonic() + 5
    while (verdict := f.control({"op": "audit-verify"}))["lines"] < 3:  # group commit
        assert time.monotonic() < deadline, verdict
        time.sleep(0.05)
    assert verdict["ok"] is True and verdict["intact"] is True
    assert verdict["line"] is None and verdict["lines"] >= 3
    f.stop()
    path = f.dir / "state" / "audit.jsonl"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    lines = path.read_bytes().splitlines(keepends=True)
    assert audit.verify(path).ok
    edited = lines[1].replace(b"denied.test", b"harmless.test")
    path.write_bytes(lines[0] + edited + b"".join(lines[2:]))
    broken = audit.verify(path)
    assert not broken.ok and broken.line == 3


def test_audit_chain_continues_across_restart(fresh_filter):
    f = fresh_filter
    ask(f.dns_port, "allowed.test")
    f.wait_event(lambda e: e["name"] == "allowed.test")
    f.restart()
    ask(f.dns_port, "other.test")
    f.wait_event(lambda e: e["name"] == "other.test")
    f.stop()
    verdict = audit.verify(f.dir / "state" / "audit.jsonl")
    assert verdict.ok and verdict.lines >= 2


def test_sessions_report_counters(fresh_filter):
    f = fresh_filter
    ask(f.dns_port, "allowed.test")
    ask(f.dns_port, "nope.test")
    f.wait_event(lambda e: e["name"] == "nope.test")
    sessions = {s["name"]: s for s in f.control({"op": "sessions"})["sessions"]}
    assert sessions["s1"]["allowed"] >= 1 and sessions["s1"]["denied"] >= 1
    assert sessions["s2"]["subnet"] == "127.0.1.0/24"


def test_sighup_reloads_policy_files_and_a_bad_file_keeps_the_policy(fresh_filter):
    import signal

    f = fresh_filter
    assert connect_status(f.proxy_port, "other.test:443") == 403
    policy = f.dir / "s1.toml"
    policy.write_text(policy.read_text().replace('"fronted.test"', '"fronted.test", "other.test"'))
    f.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 5
    while connect_status(f.proxy_port, "other.test:443") != 200:
        assert time.monotonic() < deadline, "reload did not take effect"
        time.sleep(0.05)
    policy.write_text("[http]\nallow = [\"not valid\"]\n")
    f.proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert connect_status(f.proxy_port, "other.test:443") == 200  # the old policy holds
    assert "reload refused, policy unchanged" in f.log.read_text()


def test_sessions_registered_at_run_time_are_judged_and_survive_restart(fresh_filter):
    f = fresh_filter
    project = f.dir / "s3.toml"
    project.write_text('[http]\nallow = ["other.test"]\n')
    source = "127.0.5.1"
    assert ask(f.dns_port, "other.test", source=source).header.rcode == RCODE.NXDOMAIN
    added = f.control({"op": "session-add", "name": "s3", "subnet": "127.0.5.0/24",
                       "files": [str(project)]})
    assert added == {"ok": True, "added": True, "session": {
        "name": "s3", "subnet": "127.0.5.0/24", "gateway": "127.0.5.1",
        "files": [str(project)]}}
    assert addresses(ask(f.dns_port, "other.test", source=source)) == ["127.31.0.2"]
    again = f.control({"op": "session-add", "name": "s3", "subnet": "127.0.5.0/24",
                       "files": [str(project)]})
    assert again["ok"] and again["added"] is False
    f.control({"op": "add", "session": "s3", "kind": "dns", "rule": "extra.test"})

    f.restart()
    sessions = {s["name"]: s for s in f.control({"op": "sessions"})["sessions"]}
    assert sessions["s3"]["registered"] is True and sessions["s1"]["registered"] is False
    assert addresses(ask(f.dns_port, "other.test", source=source)) == ["127.31.0.2"]

    assert f.control({"op": "session-remove", "name": "s3", "forget_rules": True})["ok"]
    assert ask(f.dns_port, "other.test", source=source).header.rcode == RCODE.NXDOMAIN
    assert not (f.dir / "state" / "runtime" / "s3.json").exists()
    f.restart()
    assert "s3" not in {s["name"] for s in f.control({"op": "sessions"})["sessions"]}


@pytest.mark.parametrize(("request_", "error"), [
    ({"op": "session-add", "name": "s9", "subnet": "127.0.0.0/25"}, "overlaps session s1"),
    ({"op": "session-add", "name": "s1", "subnet": "127.0.9.0/24"}, "defined twice"),
    ({"op": "session-add", "name": "Bad!", "subnet": "127.0.9.0/24"}, "must be 1-32"),
    ({"op": "session-add", "name": "s9", "subnet": "127.0.9.7/24"}, "host bits set"),
    ({"op": "session-add", "name": "s9", "subnet": "127.0.9.0/24", "gateway": "10.0.0.1"},
     "not an address in 127.0.9.0/24"),
    ({"op": "session-add", "name": "s9", "subnet": "127.0.9.0/24", "files": ["/nope.toml"]},
     "/nope.toml: cannot read"),
    ({"op": "session-remove", "name": "s1"}, "remove it there"),
    ({"op": "session-remove", "name": "ghost"}, "no session 'ghost' registered"),
])
def test_bad_session_registrations_change_nothing(fresh_filter, request_, error):
    before = fresh_filter.control({"op": "sessions"})["sessions"]
    answer = fresh_filter.control(request_)
    assert answer["ok"] is False and error in answer["error"], answer
    assert fresh_filter.control({"op": "sessions"})["sessions"] == before


# -- every request answered; nothing waits on the loop --------------------------------------


class Connection:
    """One control connection kept open across requests."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(30)
        self.sock.connect(str(path))
        self.stream = self.sock.makefile("rb")

    def send(self, request: dict) -> None:
        self.sock.sendall(json.dumps(request).encode() + b"\n")

    def answer(self) -> dict:
        line = self.stream.readline()
        assert line, "the filter closed the connection without answering"
        return json.loads(line)

    def ask(self, request: dict) -> dict:
        self.send(request)
        return self.answer()

    def close(self) -> None:
        self.stream.close()
        self.sock.close()


def test_a_change_that_cannot_be_written_is_answered_and_the_connection_goes_on(fresh_filter):
    f = fresh_filter
    runtime = f.dir / "state" / "runtime"
    if runtime.is_dir():
        runtime.rmdir()
    runtime.write_text("not a directory\n")  # every runtime rule write now fails (OSError)
    connection = Connection(f.socket)
    try:
        refused = connection.ask({"op": "add", "session": "s1", "kind": "http",
                                  "rule": "other.test"})
        assert refused["ok"] is False and refused["error"].startswith("add: ")
        assert str(runtime) in refused["error"], refused
        # nothing changed: not in memory, not on disk
        rules = connection.ask({"op": "policy", "session": "s1"})["rules"]
        assert not any(r["rule"] == "other.test" for r in rules)
        assert connect_status(f.proxy_port, "other.test:443") == 403
        assert runtime.read_text() == "not a directory\n"
        runtime.unlink()
        added = connection.ask({"op": "add", "session": "s1", "kind": "http",
                                "rule": "other.test"})
        assert added["ok"] is True and added["added"] is True
        assert connect_status(f.proxy_port, "other.test:443") == 200
    finally:
        connection.close()


def _reading(parent: int, path) -> int | None:
    """The offset at which a child of `parent` (the verifier) reads `path`, if one does."""
    for pid in os.listdir("/proc"):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            if f"\nPPid:\t{parent}\n" not in status:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") != str(path):
                    continue
                info = dict(line.split(":", 1) for line in Path(
                    f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines() if ":" in line)
                if int(info["flags"], 8) & os.O_ACCMODE == os.O_RDONLY:
                    return int(info["pos"])
        except (OSError, ValueError):
            continue
    return None


@pytest.fixture
def filter_with_a_large_audit_log(internet, tmp_path):
    """A filter whose audit log holds ~40 MB when it starts (its state from an earlier run)."""
    log = audit.AuditLog(tmp_path / "state" / "audit.jsonl")
    event = {"session": "s1", "client": "127.0.0.1", "kind": "dns", "verdict": "deny",
             "reason": "no rule allows this name " + "x" * 200, "rule": None, "layer": None}
    for n in range(130_000):
        log.append({**event, "name": f"n{n}.flood.test", "ts": 1.0 + n})
    log.close()
    process = FilterProcess(tmp_path, internet.dns.address)
    yield process
    process.stop()


def test_a_long_audit_verify_holds_up_neither_dns_nor_status(filter_with_a_large_audit_log):
    f = filter_with_a_large_audit_log
    path = f.dir / "state" / "audit.jsonl"
    assert path.stat().st_size > 40 << 20
    verifying = Connection(f.socket)
    try:
        verifying.send({"op": "audit-verify"})
        deadline = time.monotonic() + 30
        while not (_reading(f.proc.pid, path) or 0) > 0:  # the verifier is reading
            assert time.monotonic() < deadline, "the verify never started reading"
            time.sleep(0.001)
        assert addresses(ask(f.dns_port, "allowed.test")) == ["127.31.0.2"]
        status = f.control({"op": "status"})
        assert status["ok"] and status["audit"]["head"]["seq"] >= 130_000
        # both answered while the verify was still reading, and before its answer
        position = _reading(f.proc.pid, path)
        assert position is not None and position < path.stat().st_size
        readable, _, _ = select.select([verifying.sock], [], [], 0)
        assert not readable, "the verify answered before the DNS query and the status"
        verdict = verifying.answer()
        assert verdict["ok"] and verdict["intact"] and verdict["lines"] >= 130_000
        assert verifying.ask({"op": "status"})["ok"]  # and the connection goes on
    finally:
        verifying.close()


def test_concurrent_adds_all_land(fresh_filter):
    f = fresh_filter
    names = [f"c{n}.concurrent.test" for n in range(16)]
    connections = [Connection(f.socket) for _ in names]
    try:
        for connection, name in zip(connections, names, strict=True):
            connection.send({"op": "add", "session": "s1", "kind": "dns", "rule": name})
        answers = [connection.answer() for connection in connections]
    finally:
        for connection in connections:
            connection.close()
    assert all(a["ok"] and a["added"] for a in answers), answers

    def runtime_rules():
        return {r["rule"] for r in f.control({"op": "policy", "session": "s1"})["rules"]
                if r["layer"] == "session"}

    assert runtime_rules() == set(names)
    f.restart()
    assert runtime_rules() == set(names)  # every one written, none overwritten by another


# -- rules granted for a while ---------------------------------------------------------------


def test_a_rule_granted_for_a_second_is_taken_back_with_an_event_and_dns_denies_again(
        fresh_filter, internet):
    f = fresh_filter
    internet.dns.zone["granted.test"] = [("A", ORIGIN, 300)]
    answer = f.control({"op": "add", "session": "s1", "kind": "dns", "rule": "granted.test",
                        "expires_in": 1})
    assert answer["added"] and answer["expires"] > time.time()
    granted = f.wait_event(lambda e: e.get("kind") == "rule" and e.get("action") == "added")
    assert granted["session"] == "s1" and granted["rule"] == "granted.test"
    assert "until" in granted["reason"] and granted["verdict"] == "change"
    assert granted["expires"] == answer["expires"]
    assert addresses(ask(f.dns_port, "granted.test")) == [ORIGIN]
    expired = f.wait_event(lambda e: e.get("action") == "expired", timeout=10)
    assert expired["session"] == "s1" and expired["rule"] == "granted.test"
    assert expired["rule_kind"] == "dns" and expired["layer"] == "session"
    rules = f.control({"op": "policy", "session": "s1"})["rules"]
    assert "granted.test" not in [r["rule"] for r in rules]
    assert ask(f.dns_port, "granted.test").header.rcode == RCODE.NXDOMAIN
    deadline = time.monotonic() + 5  # the audit log commits in groups
    while True:
        records = f.control({"op": "audit", "limit": 1000})["records"]
        actions = [r["action"] for r in records if r["kind"] == "rule"]
        if actions == ["added", "expired"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert actions == ["added", "expired"]


def test_a_grant_survives_a_restart_and_one_that_ended_meanwhile_is_taken_back_at_start(
        fresh_filter):
    f = fresh_filter
    f.control({"op": "add", "session": "s1", "kind": "http", "rule": "long.test",
               "expires_in": 3600})
    f.control({"op": "add", "session": "s1", "kind": "http", "rule": "short.test",
               "expires_in": 0.5})
    f.stop()
    time.sleep(1)  # short.test's end passes while the filter is down
    f.start()
    rules = {r["rule"]: r for r in f.control({"op": "policy", "session": "s1"})["rules"]}
    assert rules["long.test"]["expires"] > time.time() + 3000
    f.wait_event(lambda e: e.get("action") == "expired" and e["rule"] == "short.test")
    rules = {r["rule"] for r in f.control({"op": "policy", "session": "s1"})["rules"]}
    assert "short.test" not in rules and "long.test" in rules


@pytest.mark.parametrize("seconds", [0, -5, 10**9, "soon", True])
def test_a_grant_for_no_time_or_too_long_is_refused_naming_the_field(fresh_filter, seconds):
    answer = fresh_filter.control({"op": "add", "session": "s1", "kind": "http",
                                   "rule": "x.test", "expires_in": seconds})
    assert answer["ok"] is False and "expires_in" in answer["error"]
    rules = fresh_filter.control({"op": "policy", "session": "s1"})["rules"]
    assert "x.test" not in [r["rule"] for r in rules]


# -- the audit log in segments, through the real filter --------------------------------------


@pytest.fixture
def rotating_filter(internet, tmp_path):
    process = FilterProcess(tmp_path, internet.dns.address,
                            state_extra="audit_segment_bytes = 8192\naudit_segments = 4",
                            dns_extra="denied_rate = 100000\ndenied_burst = 100000")
    yield process
    process.stop()


def test_a_flood_of_events_rotates_the_audit_log_keeps_four_segments_and_still_verifies(
        rotating_filter):
    f = rotating_filter
    for n in range(300):
        ask(f.dns_port, f"flood-{n}.test")
    # Group commit, and the events the flood causes after its own (each rotation's
    # retirement is recorded too): wait until the head has stayed put for half a second.
    deadline, head, still_since = time.monotonic() + 20, None, time.monotonic()
    while True:
        status = f.control({"op": "status"})["audit"]
        if status["head"]["seq"] != head:
            head, still_since = status["head"]["seq"], time.monotonic()
        elif head >= 300 and time.monotonic() - still_since >= 0.5:
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.05)

    state = f.dir / "state"
    files = audit.segments(state / "audit.jsonl")
    assert len(files) == 4 and files[-1].first is None  # three rotated, the active one
    assert status["segments"] == 4 and status["segments_kept"] == 4
    assert status["bytes"] == sum(s.path.stat().st_size for s in files)

    verdict = f.control({"op": "audit-verify"})
    assert verdict["intact"] is True and verdict["segments"] == 4, verdict
    assert verdict["first"] > 1 and f"from seq {verdict['first']}" in verdict["note"]

    seen, reasons, after = [], [], 0
    while True:
        page = f.control({"op": "audit", "after": after, "limit": 17})
        seen += [r["seq"] for r in page["records"]]
        reasons += [r.get("reason") or "" for r in page["records"]]
        if not page["more"]:
            break
        assert page["records"][-1]["seq"] > after, page  # a page that never moves on: no end
        after = page["records"][-1]["seq"]
    assert seen == list(range(verdict["first"], seen[-1] + 1)) and seen[-1] >= 300
    last = f.control({"op": "audit", "after": seen[-1] - 5})
    assert [r["seq"] for r in last["records"]] == seen[-5:] and not last["more"]
    # retention never removes history silently: the log says what went, where it starts
    assert any(r.startswith("retention removed audit-") and "the log now starts at seq"
               in r for r in reasons), reasons[-20:]

    f.stop()
    rotated = audit.segments(state / "audit.jsonl")[1]
    rotated.path.unlink()  # a segment missing in the middle
    broken = audit.verify(state / "audit.jsonl")
    assert not broken.ok and broken.line == 1 and "missing" in broken.error
    assert broken.segment == audit.segments(state / "audit.jsonl")[1].path.name


def test_a_session_flooding_denials_cannot_push_the_log_past_its_budget(internet,
                                                                        tmp_path_factory):
    """s1 sends 400 denied queries at once with a budget of 20 records a second (200 at
    once): the log gets at most the budget and a summary of the rest, while every event
    still reaches the event stream, and s2's record is there."""
    f = FilterProcess(tmp_path_factory.mktemp("budget"), internet.dns.address,
                      state_extra="audit_events_per_session = 20",
                      dns_extra="rate = 100000\nburst = 100000\n"
                                "denied_rate = 100000\ndenied_burst = 100000")
    try:
        for n in range(400):
            ask(f.dns_port, f"denied-{n}.test")
        ask(f.dns_port, "s2-denied.test", source="127.0.1.1")
        time.sleep(1.5)  # the summary record is written within a second
        records, after = [], 0
        while True:
            page = f.control({"op": "audit", "after": after, "limit": 1000})
            records += page["records"]
            if not page["more"]:
                break
            assert page["records"][-1]["seq"] > after, page  # a page that never moves on
            after = page["records"][-1]["seq"]
        s1 = [r for r in records if r.get("session") == "s1" and r["kind"] == "dns"]
        summary = [r for r in records if r.get("session") == "s1" and r["kind"] == "audit"]
        assert 200 <= len(s1) < 260, len(s1)  # the burst, and what the rate gave meanwhile
        assert summary and "not recorded one by one" in summary[0]["reason"]
        held = int(summary[0]["reason"].split()[0])
        assert len(s1) + sum(int(r["reason"].split()[0]) for r in summary) == 400, held
        assert any(r.get("name") == "s2-denied.test" for r in records)
        assert len(f.events(session="s1", verdict="deny")) >= 400  # monitor saw them all
        status = f.control({"op": "status"})["audit"]
        assert status["not_recorded"]["s1"] == 400 - len(s1)
    finally:
        f.stop()
