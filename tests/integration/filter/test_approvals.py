"""Ask mode against the real filter: a request the policy does not name is held while an
approval is open, and goes on, or is denied, as the control socket decides.

The held requests are CONNECTs to other.test:8080 (s1 does not name it; the fake internet's
plain HTTP origin answers there, so no root is needed): once a tunnel is granted, a request
goes through it to the origin.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from dnslib import RCODE

from appliance.sandbox import battery
from appliance.selftest.approvals import HELD_PATH
from tests.integration.conftest import FilterProcess, connect, recv_all
from tests.integration.filter.test_dns import ask


@pytest.fixture
def asking(internet, tmp_path):
    """A filter of its own, with session s1 in ask mode (a runtime approval rule)."""
    process = FilterProcess(tmp_path, internet.dns.address)
    assert process.control({"op": "add", "session": "s1", "kind": "approval",
                            "rule": "ask 20"})["added"]
    yield process
    process.stop()
    while Held.opened:
        Held.opened.pop().sock.close()


class Held:
    """A CONNECT sent in a thread; its answer (status line and all) when it comes."""

    opened: list[Held] = []
    """Closed when the test's filter stops."""

    def __init__(self, port: int, target: str = "other.test:8080"):
        self.sock = connect(port, timeout=30)
        Held.opened.append(self)
        self.sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        self.head = b""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        while b"\r\n\r\n" not in self.head:
            chunk = self.sock.recv(4096)
            if not chunk:
                return
            self.head += chunk

    def answered(self, timeout: float) -> bytes:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "no answer in time"
        return self.head

    def status(self, timeout: float = 10) -> int:
        return int(self.answered(timeout).split(b" ")[1])


def open_approvals(f: FilterProcess, **match) -> list[dict]:
    return [a for a in f.control({"op": "approvals"})["approvals"]
            if all(a.get(k) == v for k, v in match.items())]


def wait_approval(f: FilterProcess, timeout: float = 10, **match) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = open_approvals(f, **match)
        if found:
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"no approval {match}: {f.control({'op': 'approvals'})}")


def decide(f: FilterProcess, approval: dict, grant: str, **extra) -> dict:
    return f.control({"op": "approval-decide", "id": approval["id"], "grant": grant,
                      "by": "tester", **extra})


def test_a_held_tunnel_goes_on_when_approved_once_and_no_rule_is_added(asking, internet):
    f = asking
    seen = len(internet.http8080.requests)
    held = Held(f.proxy_port)
    approval = wait_approval(f, target="other.test:8080", waiting=1)
    assert approval["session"] == "s1" and approval["kind"] == "http"
    assert approval["origin"] == "proxy" and "not in the http policy" in approval["why"]
    time.sleep(0.3)  # held: no answer to the client, nothing dialled upstream
    assert held.head == b"" and len(internet.http8080.requests) == seen
    answer = decide(f, approval, "once")
    assert answer["ok"] and answer["grant"] == "once", answer
    assert held.status() == 200
    held.sock.sendall(b"GET /through HTTP/1.1\r\nHost: other.test:8080\r\nConnection: close"
                      b"\r\n\r\n")
    assert recv_all(held.sock).startswith(b"HTTP/1.1 200")
    held.sock.close()
    assert not [r for r in f.control({"op": "policy", "session": "s1"})["rules"]
                if r["rule"].startswith("other.test")]
    events = f.events()
    pending = [e for e in events if e["kind"] == "approval" and e["verdict"] == "pending"]
    assert pending and pending[-1]["approval"] == approval["id"]
    approved = [e for e in events if e.get("action") == "approved"][-1]
    assert approved["by"] == "tester" and approved["grant"] == "once"
    allowed = [e for e in events if e["kind"] == "connect" and e["verdict"] == "allow"][-1]
    assert "approved by tester: once" in allowed["reason"], allowed
    # once is once: the next tunnel waits again, for a new approval
    again = Held(f.proxy_port)
    second = wait_approval(f, target="other.test:8080")
    assert second["id"] != approval["id"]
    decide(f, second, "refuse")
    assert again.status() == 403


def test_a_refused_request_gets_the_denial_with_the_reason(asking):
    f = asking
    held = Held(f.proxy_port)
    approval = wait_approval(f, target="other.test:8080", waiting=1)
    decide(f, approval, "refuse", note="not\x1b[31m today")
    head = held.answered(10).decode()
    assert head.startswith("HTTP/1.1 403"), head
    assert "refused by tester: not?[31m today" in head
    assert not open_approvals(f)
    assert f.control({"op": "approval-decide", "id": approval["id"], "grant": "once"}) == {
        "ok": False, "error": f"no pending approval {approval['id']!r} (decided already, or "
        "expired: `corral approvals` lists the open ones)"}


def test_no_decision_in_time_is_a_denial_and_the_approval_stays_open(asking):
    f = asking
    f.control({"op": "add", "session": "s1", "kind": "approval", "rule": "ask 1"})
    started = time.monotonic()
    held = Held(f.proxy_port)
    head = held.answered(10).decode()
    assert head.startswith("HTTP/1.1 403") and "no decision within 1s" in head, head
    assert time.monotonic() - started >= 0.9
    approval = wait_approval(f, target="other.test:8080")
    assert approval["waiting"] == 0
    # once needs a request waiting; a grant for a while lets the next attempt straight in
    refused = decide(f, approval, "once")
    assert not refused["ok"] and "no request is waiting" in refused["error"]
    granted = decide(f, approval, "for", duration=120)
    assert granted["ok"], granted
    rules = {r["rule"]: r for r in f.control({"op": "policy", "session": "s1"})["rules"]}
    assert rules["other.test:8080"]["layer"] == "session"
    assert 100 < rules["other.test:8080"]["expires"] - time.time() <= 120
    assert Held(f.proxy_port).status(5) == 200


def test_requests_for_one_target_share_one_approval_and_a_session_grant_adds_the_rule(asking):
    f = asking
    first, second = Held(f.proxy_port), Held(f.proxy_port)
    approval = wait_approval(f, target="other.test:8080", waiting=2)
    assert approval["asked"] == 2 and len(open_approvals(f)) == 1
    decide(f, approval, "session")
    assert first.status() == 200 and second.status() == 200
    rules = {r["rule"]: r for r in f.control({"op": "policy", "session": "s1"})["rules"]}
    assert rules["other.test:8080"].get("expires") is None
    added = [e for e in f.events() if e["kind"] == "rule" and e.get("action") == "added"]
    assert added[-1]["rule"] == "other.test:8080"


def test_deny_rules_and_other_sessions_are_never_held(asking):
    f = asking
    started = time.monotonic()
    with connect(f.proxy_port) as sock:  # s1's [deny] names no.wild.test
        sock.sendall(b"CONNECT no.wild.test:443 HTTP/1.1\r\n\r\n")
        assert recv_all(sock, 12).startswith(b"HTTP/1.1 403")
    from tests.integration.conftest import S2_CLIENT

    with connect(f.proxy_port, source=S2_CLIENT) as sock:  # s2 is not in ask mode
        sock.sendall(b"CONNECT other2.test:8080 HTTP/1.1\r\n\r\n")
        assert recv_all(sock, 12).startswith(b"HTTP/1.1 403")
    assert time.monotonic() - started < 5
    assert not open_approvals(f)


def test_a_denied_name_in_dns_is_answered_at_once_and_opens_an_approval(asking):
    f = asking
    assert ask(f.dns_port, "other.test").header.rcode == RCODE.NXDOMAIN
    approval = wait_approval(f, target="other.test")
    assert approval["origin"] == "dns" and approval["kind"] == "http"
    decide(f, approval, "for", duration=60)
    deadline = time.monotonic() + 5
    while ask(f.dns_port, "other.test").header.rcode != RCODE.NOERROR:
        assert time.monotonic() < deadline, "the grant did not answer the name"
        time.sleep(0.05)


def test_a_session_has_a_bounded_number_of_open_approvals(asking):
    f = asking
    for i in range(40):
        assert ask(f.dns_port, f"n{i}.flood.test").header.rcode == RCODE.NXDOMAIN
    assert len(open_approvals(f, session="s1")) == 32
    started = time.monotonic()
    with connect(f.proxy_port) as sock:  # past the bound: denied at once, not held
        sock.sendall(b"CONNECT other.test:8080 HTTP/1.1\r\n\r\n")
        head = recv_all(sock, 4096)
    assert head.startswith(b"HTTP/1.1 403") and b"32 approvals open" in head
    assert time.monotonic() - started < 5


def test_bad_decisions_are_refused_with_the_reason(asking):
    f = asking
    Held(f.proxy_port)
    approval = wait_approval(f, target="other.test:8080")
    for request, error in [
        ({"grant": "always"}, "'grant' must be one of once, for, session or refuse"),
        ({"grant": "for"}, "'duration' (seconds) goes with grant 'for'"),
        ({"grant": "session", "duration": 5}, "'duration' (seconds) goes with grant 'for'"),
        ({"grant": "for", "duration": -1}, "'duration' must be more than 0"),
        ({"grant": "for", "duration": 10**9}, "'duration' must be more than 0"),
    ]:
        answer = f.control({"op": "approval-decide", "id": approval["id"], **request})
        assert not answer["ok"] and error in answer["error"], (request, answer)
    assert open_approvals(f, id=approval["id"])
    assert json.dumps(f.control({"op": "approvals", "session": "s2"})) == (
        '{"ok": true, "approvals": []}')


def test_a_held_request_ends_when_its_session_is_removed(asking):
    f = asking
    added = f.control({"op": "session-add", "name": "s3", "subnet": "127.0.3.0/24",
                       "files": [str(f.dir / "s1.toml")]})
    assert added["ok"], added
    f.control({"op": "add", "session": "s3", "kind": "approval", "rule": "ask 30"})
    sock = connect(f.proxy_port, source="127.0.3.1", timeout=10)
    with sock:
        sock.sendall(b"CONNECT other.test:8080 HTTP/1.1\r\n\r\n")
        wait_approval(f, session="s3", waiting=1)
        assert f.control({"op": "session-remove", "name": "s3"})["ok"]
        head = recv_all(sock)  # its policy is gone: refused at once, not after 30 s
    assert head.startswith(b"HTTP/1.1 403") and b"session s3 ended" in head, head
    assert not open_approvals(f, session="s3")


@pytest.mark.parametrize("body", [b"bytes", b"x" * 400_000], ids=["small", "unread"])
def test_a_held_request_whose_client_left_is_not_counted_nor_sent_on_a_grant(asking,
                                                                              internet, body):
    """Also when the body is larger than the proxy reads ahead: its end is behind bytes
    nobody reads, so the socket itself is asked."""
    f = asking
    seen = len(internet.http8080.requests)
    sock = connect(f.proxy_port, timeout=10)
    sock.sendall(b"POST http://other.test:8080/left HTTP/1.1\r\nHost: other.test:8080\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    approval = wait_approval(f, target="other.test:8080", waiting=1)
    sock.close()  # the client goes while its request is held (its body unread)
    wait_approval(f, target="other.test:8080", waiting=0)
    refused = decide(f, approval, "once")  # a person is told nothing waits any more
    assert not refused["ok"] and "no request is waiting for it" in refused["error"], refused
    assert len(internet.http8080.requests) == seen  # nothing was sent for it
    left = [e for e in f.events() if e["kind"] == "http" and e["name"] == "other.test"][-1]
    assert left["verdict"] == "deny" and "the client left" in left["reason"], left


def test_a_once_grant_right_after_the_client_left_finds_nobody_and_dials_nothing(asking,
                                                                                 internet):
    """The grant comes before the filter's half-second look at the client: the grant asks
    the client itself, so the person is told that it found nobody, and nothing is sent."""
    f = asking
    seen = len(internet.http8080.requests)
    sock = connect(f.proxy_port, timeout=10)
    sock.sendall(b"POST http://other.test:8080/left-just-now HTTP/1.1\r\nHost: other.test:8080"
                 b"\r\nContent-Length: 4\r\n\r\nbody")
    approval = wait_approval(f, target="other.test:8080", waiting=1)
    sock.close()
    answer = decide(f, approval, "once")  # within the half second: no look has seen it yet
    assert not answer["ok"], answer
    assert "left" in answer["error"] and "nothing was let through" in answer["error"], answer
    time.sleep(0.7)
    assert len(internet.http8080.requests) == seen  # nothing was dialled for it
    assert open_approvals(f, id=approval["id"])  # still open: a person may grant it otherwise


def test_a_grant_says_how_many_requests_it_let_through(asking):
    f = asking
    held = [Held(f.proxy_port) for _ in range(2)]
    approval = wait_approval(f, target="other.test:8080", waiting=2)
    answer = decide(f, approval, "once")
    assert answer["ok"] and answer["released"] == 2, answer
    assert [h.status() for h in held] == [200, 200]


def agent_asks(f: FilterProcess, query: str, source: str | None = None) -> tuple[int, dict]:
    """GET http://request.corral/?QUERY through the proxy, as curl in a session would."""
    from tests.integration.conftest import S1_CLIENT

    with connect(f.proxy_port, source=source or S1_CLIENT, timeout=30) as sock:
        sock.sendall(f"GET http://request.corral/?{query} HTTP/1.1\r\nHost: request.corral"
                     "\r\n\r\n".encode())
        answer = recv_all(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Content-Type: application/json" in head, answer
    return int(head.split(b" ")[1]), json.loads(body)


def test_an_agent_asks_with_a_reason_and_learns_the_decision(asking):
    f = asking
    status, answer = agent_asks(f, "host=other.test:8080&reason=the+docs+%1b[31m")
    assert status == 202 and answer["status"] == "pending", answer
    (approval,) = open_approvals(f, id=answer["id"])
    assert approval["origin"] == "agent" and approval["note"] == "the docs ?[31m"
    assert approval["target"] == "other.test:8080"
    pending = next(e for e in f.events() if e.get("approval") == answer["id"])
    assert "the agent says: the docs ?[31m" in pending["reason"]
    # asking again with wait= joins the same approval and learns the decision
    waiter = threading.Thread(target=lambda: results.append(agent_asks(
        f, "host=other.test:8080&reason=still+needed&wait=20")), daemon=True)
    results: list = []
    waiter.start()
    wait_approval(f, id=answer["id"], asked=2)  # an agent asking is not a request waiting
    decide(f, approval, "for", duration=60)
    waiter.join(10)
    (status, decided), = results
    assert status == 200 and decided["status"] == "approved" and decided["grant"] == "for"
    assert agent_asks(f, "host=other.test:8080&reason=again")[1]["status"] == "allowed"
    assert open_approvals(f) == []


def test_open_approvals_outlive_a_restart_of_the_filter(asking):
    """An agent told "pending" and a person holding an id find the approval again after the
    filter restarts (SIGTERM, as systemd stops it): same id, reason and count; a grant then
    works as before. One the policy no longer leaves to a person is not brought back."""
    f = asking
    status, kept = agent_asks(f, "host=other.test:8080&reason=the+build")
    assert status == 202
    status, gone = agent_asks(f, "host=later.test&reason=x")
    assert status == 202
    agent_asks(f, "host=other.test:8080&reason=again")
    before = {a["id"]: a for a in open_approvals(f)}
    f.stop()
    saved_file = f.dir / "state" / "approvals.json"
    saved = json.loads(saved_file.read_text())
    assert {a["id"] for a in saved["approvals"]} == {kept["id"], gone["id"]}
    assert saved_file.stat().st_mode & 0o777 == 0o600
    policy = f.dir / "s1.toml"  # meanwhile a deny rule comes to cover one of them
    policy.write_text(policy.read_text().replace('names = ["no.wild.test"]',
                                                 'names = ["no.wild.test", "later.test"]'))
    f.start()
    (restored,) = open_approvals(f)
    assert restored == before[kept["id"]] and restored["asked"] == 2, (restored, before)
    assert restored["note"] == "the build"
    decide(f, restored, "session")
    assert agent_asks(f, "host=other.test:8080&reason=x")[1]["status"] == "allowed"
    f.restart()
    assert open_approvals(f) == []  # decided: not brought back


def test_what_no_person_can_grant_is_answered_at_once(asking):
    f = asking
    status, answer = agent_asks(f, "host=no.wild.test&reason=please")  # s1 denies it
    assert status == 403 and "not something a person can approve" in answer["reason"]
    status, answer = agent_asks(f, "host=request.corral&reason=loop")
    assert status == 403
    status, answer = agent_asks(f, "host=a.test&reason=x&grant=session")
    assert status == 400 and "unknown field 'grant'" in answer["error"]
    from tests.integration.conftest import OUTSIDE_CLIENT

    status, answer = agent_asks(f, "host=a.test&reason=x", source=OUTSIDE_CLIENT)
    assert status == 403 and "outside every session" in answer["error"]
    assert open_approvals(f) == []


def test_an_ask_posted_with_a_body_gets_its_answer_not_a_reset(asking):
    """request.corral never reads a body: a POST with one larger than the sockets hold still
    gets its answer (the filter reads and drops the rest before it closes)."""
    from tests.integration.conftest import S1_CLIENT

    body = b"x" * (8 << 20)
    with connect(asking.proxy_port, source=S1_CLIENT, timeout=30) as sock:
        sock.sendall(b"POST http://request.corral/?host=a.test&reason=x HTTP/1.1\r\n"
                     b"Host: request.corral\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        answer = recv_all(sock)
    assert answer.startswith(b"HTTP/1.1 20"), answer[:200]


def test_asking_is_rate_limited_per_session(asking):
    f = asking
    statuses = [agent_asks(f, f"host=n{i}.test&reason=x")[0] for i in range(8)]
    assert statuses[:5] == [202] * 5 and 429 in statuses[5:], statuses
    from tests.integration.conftest import S2_CLIENT

    assert agent_asks(f, "host=n0.test&reason=x", source=S2_CLIENT)[0] == 202  # its own


def test_a_denial_tells_the_agent_how_to_ask(asking):
    f = asking
    f.control({"op": "add", "session": "s1", "kind": "approval", "rule": "deny"})
    with connect(f.proxy_port) as sock:
        sock.sendall(b"GET http://other.test:8080/x HTTP/1.1\r\nHost: other.test:8080\r\n\r\n")
        head = recv_all(sock).decode()
    assert head.startswith("HTTP/1.1 403")
    hint = ("curl -sS 'http://request.corral/?host=other.test:8080&reason=WHY+YOU+NEED+IT"
            "&wait=60'")
    assert f"X-Corral-Request: {hint}" in head and f"from inside the session: {hint}" in head


def test_the_policy_changing_settles_what_waits(asking):
    """A rule added by hand while a request waits lets it go on at once; a deny rule added
    refuses it; ask mode turned off ends the wait (the approval stays for a person)."""
    f = asking
    held = Held(f.proxy_port)
    approval = wait_approval(f, target="other.test:8080", waiting=1)
    started = time.monotonic()
    f.control({"op": "add", "session": "s1", "kind": "http", "rule": "other.test:8080"})
    assert held.status(10) == 200 and time.monotonic() - started < 5
    assert not open_approvals(f, id=approval["id"])
    settled = [e for e in f.events() if e.get("action") == "settled"]
    assert settled[-1]["approval"] == approval["id"]

    f.control({"op": "remove", "session": "s1", "kind": "http", "rule": "other.test:8080"})
    held = Held(f.proxy_port)
    wait_approval(f, target="other.test:8080", waiting=1)
    f.control({"op": "add", "session": "s1", "kind": "deny", "rule": "other.test"})
    head = held.answered(10).decode()
    assert head.startswith("HTTP/1.1 403") and "denied by deny rule other.test" in head, head
    assert "X-Corral-Request" not in head  # nothing to ask for any more
    assert not open_approvals(f, target="other.test:8080")

    f.control({"op": "remove", "session": "s1", "kind": "deny", "rule": "other.test"})
    held = Held(f.proxy_port)
    approval = wait_approval(f, target="other.test:8080", waiting=1)
    f.control({"op": "add", "session": "s1", "kind": "approval", "rule": "deny"})
    head = held.answered(10).decode()
    assert head.startswith("HTTP/1.1 403") and "ask mode was turned off" in head, head
    assert open_approvals(f, id=approval["id"])


def test_an_ip_literal_is_refused_at_once_never_held(asking):
    f = asking
    started = time.monotonic()
    for target in ("169.254.169.254:80", "10.0.0.1:8080", "[2001:db8::1]:443"):
        with connect(f.proxy_port) as sock:
            sock.sendall(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
            assert recv_all(sock, 12).startswith(b"HTTP/1.1 403"), target
    assert time.monotonic() - started < 5 and not open_approvals(f)
    status, answer = agent_asks(f, "host=169.254.169.254:80&kind=tcp&reason=metadata")
    assert status == 403 and "not something a person can approve" in answer["reason"]


def test_once_on_a_plain_http_connection_is_that_request_alone(asking, internet):
    f = asking
    with connect(f.proxy_port, timeout=30) as sock:
        request = (b"GET http://other.test:8080/one HTTP/1.1\r\nHost: other.test:8080\r\n"
                   b"\r\n")
        sock.sendall(request)
        approval = wait_approval(f, target="other.test:8080", waiting=1)
        decide(f, approval, "once")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        sock.sendall(request.replace(b"/one", b"/two"))  # the same connection: asked again
        again = wait_approval(f, target="other.test:8080", waiting=1)
        assert again["id"] != approval["id"]
        decide(f, again, "refuse")
        assert recv_all(sock).startswith(b"HTTP/1.1 403")


def test_a_request_naming_two_hosts_is_refused_at_once_without_advice_to_ask(asking):
    f = asking
    started = time.monotonic()
    with connect(f.proxy_port) as sock:
        sock.sendall(b"GET http://other.test:8080/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        head = recv_all(sock).decode()
    assert head.startswith("HTTP/1.1 403") and time.monotonic() - started < 5, head
    assert "X-Corral-Request" not in head and not open_approvals(f)


def test_the_batterys_ask_mode_probes_pass_and_their_denials_are_recorded(asking, internet):
    """What waits for a person sends nothing (no origin sees the held requests' path) and
    ends denied; a flood is bounded while the allowed host is still served."""
    f = asking
    f.control({"op": "add", "session": "s1", "kind": "approval", "rule": "ask 2"})
    mark = battery.mark_before(f.control)
    result = subprocess.run(
        [sys.executable, "-m", "appliance.selftest", "--json", "--gateway", "127.0.0.1",
         "--dns-port", str(f.dns_port), "--proxy-port", str(f.proxy_port),
         "--allowed", "allowed.test", "--denied", "denied.test", "--ask-hold", "2",
         "--only", "held-request-sends-nothing", "--only", "approval-flood-bounded"],
        capture_output=True, text=True, timeout=120)
    probes, summary = battery.parse(result.stdout)
    assert summary is not None and result.returncode == 0, result.stdout + result.stderr
    judged = battery.confirm(probes, f.control, mark, "s1")
    assert battery.passed(judged) and len(judged) == 2, judged
    origins = [o for o in (internet.http80, internet.http8080) if o is not None]
    assert not [r for o in origins for r in o.requests if HELD_PATH in r["path"]]
    # the flood's held requests left with their clients: none is still counted as waiting
    deadline = time.monotonic() + 5
    while any(a["waiting"] for a in open_approvals(f)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [a for a in open_approvals(f) if a["waiting"]]


def test_corral_request_asks_waits_and_says_the_decision(asking):
    """The image's corral-request, through the proxy as HTTP_PROXY names it (NO_PROXY is not
    heeded: request.corral is only there), against the real filter."""
    f = asking

    def run(*args: str, wait: bool = False) -> subprocess.Popen:
        env = {"PATH": "/usr/bin:/bin", "HTTP_PROXY": f"http://127.0.0.1:{f.proxy_port}",
               "NO_PROXY": "*"}
        return subprocess.Popen([sys.executable, "appliance/sandbox/corral_request.py", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)

    waiting = run("docs.test", "--reason", "the API reference", "--wait", "20")
    approval = wait_approval(f, target="docs.test:443")
    assert approval["note"] == "the API reference" and approval["origin"] == "agent"
    assert waiting.poll() is None
    decide(f, approval, "for", duration=60)
    out, err = waiting.communicate(timeout=20)
    assert waiting.returncode == 0 and out == "approved (for): http docs.test:443\n", (out, err)

    pending = run("ssh.test:22", "--kind", "tcp", "--reason", "push")
    out, _ = pending.communicate(timeout=20)
    (opened,) = open_approvals(f, target="ssh.test:22")
    assert pending.returncode == 3 and out.startswith(f"pending: approval {opened['id']} for "
                                                      "tcp ssh.test:22"), out
    refused = run("10.0.0.1", "--reason", "the LAN", "--json")
    out, _ = refused.communicate(timeout=20)
    assert refused.returncode == 1 and json.loads(out)["status"] == "refused", out
    bad = run("docs.test:http", "--reason", "x")
    _, err = bad.communicate(timeout=20)
    assert bad.returncode == 2 and "is not a number" in err, err
    alone = subprocess.run([sys.executable, "appliance/sandbox/corral_request.py", "x.test",
                            "--reason", "r"], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin"}, timeout=20)
    assert alone.returncode == 2 and "no HTTP_PROXY" in alone.stderr


def test_learning_open_lets_through_and_records_what_a_person_could_approve(asking,
                                                                            internet):
    """`corral run --learn=open`: a name the policy does not name resolves and is reached,
    each allowance an event marked learned with the command that allows it; a deny rule and
    an IP literal stay denied, and nothing is held."""
    f = asking
    f.control({"op": "add", "session": "s1", "kind": "approval", "rule": "open"})
    f.control({"op": "add", "session": "s1", "kind": "deny", "rule": "fronted.test"})
    answer = ask(f.dns_port, "other.test")
    assert answer.header.rcode == RCODE.NOERROR and answer.rr, answer
    seen = len(internet.http8080.requests)
    with connect(f.proxy_port, timeout=10) as sock:
        sock.sendall(b"GET http://other.test:8080/learned HTTP/1.1\r\nHost: other.test:8080"
                     b"\r\nConnection: close\r\n\r\n")
        assert recv_all(sock).startswith(b"HTTP/1.1 200")
    assert len(internet.http8080.requests) == seen + 1
    for target in (b"fronted.test:8080", b"127.31.0.2:8080"):
        with connect(f.proxy_port, timeout=10) as sock:
            sock.sendall(b"CONNECT %s HTTP/1.1\r\n\r\n" % target)
            assert recv_all(sock).startswith(b"HTTP/1.1 403"), target
    assert not open_approvals(f)
    learned = [e for e in f.events() if e.get("learning") == "open"]
    assert {(e["kind"], e["hint"]) for e in learned} >= {
        ("dns", "corral allow-dns other.test"), ("http", "corral allow-http other.test:8080")}
    assert all(e["verdict"] == "allow" for e in learned)
