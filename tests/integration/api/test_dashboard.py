"""`corral dashboard`'s server against the real API and filter: only the token's holder is
served, only on its loopback name, and what it relays (approvals, rules, the event stream)
is the appliance's own answer. The page itself is driven in a real browser in the e2e tier
(tests/e2e/test_dashboard.py)."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from cli.client import Client, load_appliance
from cli.dashboard.server import Dashboard
from tests.integration.conftest import S2_CLIENT, connect, recv_all


@pytest.fixture(scope="module")
def board(home):
    dashboard = Dashboard(Client(load_appliance("default"))).start()
    yield dashboard
    dashboard.stop()


def call(board, method: str, path: str, body=None, token: str | None = "",
         host: str | None = None) -> tuple[int, dict, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", board.port, timeout=30)
    headers = {"Host": host or f"127.0.0.1:{board.port}"}
    if token is not None:
        headers["X-Corral-Token"] = token or board.token
    if body is not None:
        headers["Content-Type"] = "application/json"
    try:
        connection.request(method, path, body=json.dumps(body) if body is not None else None,
                           headers=headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_only_the_tokens_holder_on_the_loopback_name_is_served(board):
    status, headers, page = call(board, "GET", f"/?token={board.token}", token=None)
    assert status == 200 and b"<title>corral</title>" in page
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert headers["Referrer-Policy"] == "no-referrer"
    assert call(board, "GET", "/", token=None)[0] == 403
    assert call(board, "GET", "/?token=wrong", token=None)[0] == 403
    assert call(board, "GET", "/api/sessions", token="wrong")[0] == 403
    assert call(board, "GET", "/api/sessions", token=None)[0] == 403
    # a name rebound to 127.0.0.1 by another site's DNS is not this server
    assert call(board, "GET", "/api/sessions", host=f"evil.example:{board.port}")[0] == 403
    # a token in the query is for the page and the event stream (GET), never for a change
    status, _, _ = call(board, "POST", f"/api/approvals/x?token={board.token}",
                        {"grant": "refuse"}, token=None)
    assert status == 403
    assert call(board, "GET", "/static/dashboard.js", token=None)[0] == 200
    assert call(board, "GET", "/static/../__init__.py", token=None)[0] == 404
    status, _, body = call(board, "GET", "/api/sessions")
    assert status == 200 and {"s1", "s2"} <= {s["name"] for s in json.loads(body)["sessions"]}


def test_an_approval_is_decided_from_the_dashboard(board, corral_filter):
    assert corral_filter.control({"op": "add", "session": "s2", "kind": "approval",
                                  "rule": "ask 20"})["added"]
    answers: list[bytes] = []

    def held():
        with connect(corral_filter.proxy_port, source=S2_CLIENT, timeout=30) as sock:
            sock.sendall(b"CONNECT allowed.test:8080 HTTP/1.1\r\n\r\n")
            answers.append(recv_all(sock, 12))

    thread = threading.Thread(target=held, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while True:
            listed = json.loads(call(board, "GET", "/api/approvals")[2])["approvals"]
            if any(a["waiting"] for a in listed):
                break
            assert time.monotonic() < deadline, listed
            time.sleep(0.1)
        (approval,) = listed
        status, _, body = call(board, "POST", f"/api/approvals/{approval['id']}",
                               {"grant": "maybe"})
        assert status == 400 and b"grant: one of once, for, session, refuse" in body
        status, _, body = call(board, "POST", f"/api/approvals/{approval['id']}",
                               {"grant": "for", "duration": "10m"})
        assert status == 400 and b"duration" in body
        status, _, body = call(board, "POST", f"/api/approvals/{approval['id']}",
                               {"grant": "once"})
        assert status == 200 and json.loads(body)["approval"]["id"] == approval["id"]
        thread.join(10)
        assert answers and answers[0].startswith(b"HTTP/1.1 200"), answers
        status, _, body = call(board, "POST", f"/api/approvals/{approval['id']}",
                               {"grant": "refuse"})
        assert status == 502 and b"no pending approval" in body  # the appliance's answer
    finally:
        corral_filter.control({"op": "add", "session": "s2", "kind": "approval",
                               "rule": "deny"})


def test_rules_are_listed_and_a_runtime_one_revoked(board, corral_filter):
    corral_filter.control({"op": "add", "session": "s1", "kind": "http",
                           "rule": "dashboard.test"})
    rules = json.loads(call(board, "GET", "/api/rules?session=s1")[2])["rules"]
    assert {"kind": "http", "rule": "dashboard.test", "layer": "session"}.items() <= next(
        r for r in rules if r["rule"] == "dashboard.test").items()
    assert call(board, "DELETE", "/api/rules", {"session": "s1"})[0] == 400
    status, _, _ = call(board, "DELETE", "/api/rules", {"session": "s1", "kind": "http",
                                                        "rule": "dashboard.test"})
    assert status == 200
    rules = json.loads(call(board, "GET", "/api/rules?session=s1")[2])["rules"]
    assert "dashboard.test" not in {r["rule"] for r in rules}


def test_the_event_stream_is_relayed_recent_first_then_live(board, corral_filter):
    connection = http.client.HTTPConnection("127.0.0.1", board.port, timeout=30)
    connection.request("GET", f"/api/events?token={board.token}")
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith(
        "text/event-stream")
    deadline = time.monotonic() + 30  # at the end (b"") a readline answers at once, for ever
    while (line := response.readline()).strip() != b": live":
        assert line and time.monotonic() < deadline, f"no ': live' mark; last line {line!r}"
    with connect(corral_filter.proxy_port) as sock:  # s1: a denial, live
        sock.sendall(b"CONNECT stream-live.test:443 HTTP/1.1\r\n\r\n")
        recv_all(sock)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        line = response.readline()
        if line.startswith(b"data: ") and b"stream-live.test" in line:
            event = json.loads(line[6:])
            assert event["verdict"] == "deny" and event["session"] == "s1"
            break
    else:
        raise AssertionError("the live denial was not relayed")
    connection.close()


def test_another_sites_page_and_an_oversized_body_are_refused(board, corral_filter):
    assert call(board, "GET", "/api/sessions", host=None)[1][
        "Cross-Origin-Resource-Policy"] == "same-origin"
    connection = http.client.HTTPConnection("127.0.0.1", board.port, timeout=30)
    connection.request("GET", "/static/dashboard.js", headers={"Sec-Fetch-Site": "cross-site"})
    assert connection.getresponse().status == 403  # another site's <script src=...>
    connection.close()
    status, _, _ = call(board, "POST", "/api/approvals/x", {"grant": "refuse",
                                                             "note": "n" * 20000})
    assert status == 413  # a decision is a few dozen bytes
