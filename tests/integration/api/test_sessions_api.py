"""/v1/sessions over real mTLS, through the real API to the real sandbox service and filter.
What needs no container runs here (validation, uploads, errors, the protocol); sessions with
containers are the e2e tier's (tests/e2e/test_cli_sessions.py)."""

from __future__ import annotations

import http.client
import io
import json
import os
import socket
import tarfile
from urllib.parse import urlencode

import pytest

from appliance.agents.profile import shipped
from cli.client import CliError

from .conftest import tls_client

CLAUDE = (shipped() / "claude.toml").read_text()


def send(api, method, path, body: bytes | None = None, content_type="application/json"):
    d = api.client_dir()
    connection = http.client.HTTPSConnection(
        "127.0.0.1", api.port, timeout=30,
        context=tls_client(d / "ca.crt", d / "client.crt", d / "client.key"))
    try:
        connection.request(method, path, body=body, headers={"Content-Type": content_type}
                           if body is not None else {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def archive(*members: tuple[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_the_list_joins_the_filters_sessions(api):
    answer = api.client().request("GET", "/sessions")
    assert {s["name"] for s in answer["sessions"]} == {"s1", "s2"}
    assert "sandbox_error" not in answer  # the sandbox service answered (no sessions)
    one = api.client().request("GET", "/sessions/s1")
    assert one["name"] == "s1" and one["state"] == "running"
    with pytest.raises(CliError, match="no session 'zz'"):
        api.client().request("GET", "/sessions/zz")


@pytest.mark.parametrize(("method", "path", "body", "status", "message"), [
    ("POST", "/v1/sessions", {"name": "x", "presets": ["no-such"]}, 400, "unknown preset"),
    ("POST", "/v1/sessions", {"name": "x", "presets": ["github-pr"]}, 400,
     "preset 'github-pr' acts on the repositories you name"),  # never on any of them
    ("POST", "/v1/sessions", {"name": "x", "colour": "red"}, 400, "unknown field(s): colour"),
    ("POST", "/v1/sessions", {"presets": []}, 400, "missing field 'name'"),
    ("POST", "/v1/sessions", {"name": "Bad Name"}, 400, "must be 1-32"),
    ("POST", "/v1/sessions", {"name": "x", "uid": 0}, 400, "never root"),
    ("POST", "/v1/sessions/none/stop", None, 404, "no session 'none'"),
    ("DELETE", "/v1/sessions/none", None, 404, "no session 'none'"),
    ("DELETE", "/v1/sessions/none?home=yes", None, 400, "home must be 0 or 1"),
    ("GET", "/v1/sessions/none/diff", None, 404, "no session 'none'"),
    ("GET", "/v1/sessions/none/changes", None, 400, "missing query argument 'digest'"),
    ("GET", "/v1/sessions/none/changes?digest=" + "a" * 64, None, 404, "no session 'none'"),
    ("POST", "/v1/sessions/none/applied", {"changes": [{"path": "../x", "action": "added"}]},
     400, "not a relative path"),
    ("POST", "/v1/sessions/none/selftest", {}, 400, "missing field 'allowed'"),
    ("POST", "/v1/sessions/none/selftest", {"allowed": "a.test"}, 404, "no session 'none'"),
    ("POST", "/v1/sessions/none/selftest", {"allowed": "a.test", "skip_group": ["kernel"],
                                            "silence": 11, "connections": 600}, 404,
     "no session 'none'"),
    ("POST", "/v1/sessions/none/selftest", {"allowed": "a.test", "slow_connections": 9}, 400,
     "unknown field(s): slow_connections"),
    ("POST", "/v1/sessions", {"name": "x", "agent": CLAUDE}, 400,
     "'agent' (the profile's TOML text) and 'agent_name' go together"),
    ("POST", "/v1/sessions", {"name": "x", "agent": CLAUDE, "agent_name": "Claude Code"}, 400,
     "agent_name 'Claude Code' must be 1-32"),
    ("POST", "/v1/sessions", {"name": "x", "agent": CLAUDE + "#" * 16384,
                              "agent_name": "claude"}, 400, "the limit is 16384"),
    ("POST", "/v1/sessions", {"name": "x", "agent": CLAUDE.replace("[run]", "[runn]"),
                              "agent_name": "claude", "project_id": "p"}, 400,
     "agent claude:10: runn: unknown key"),  # parsed again by the sandbox service
    ("POST", "/v1/sessions", {"name": "x", "agent": CLAUDE, "agent_name": "claude"}, 400,
     "agent claude keeps its sign-in and settings in the project's home: send a project_id"),
])
def test_bad_session_requests_get_precise_errors(api, method, path, body, status, message):
    got, answer = send(api, method, path, json.dumps(body).encode() if body is not None else None)
    assert (got, message.lower() in answer["error"]["message"].lower()) == (status, True), answer


def refused_path(message: str) -> bool:
    """An entry outside the project refused, in the words of tarfile's data filter or, on a
    Python that lacks it (Debian 12's 3.11.2, which runs the suite), the sandbox's own."""
    return "outside the destination" in message or "'..' are refused" in message


def test_project_uploads_are_checked_before_anything_is_made(api):
    status, answer = send(api, "POST", "/v1/sessions?name=up1", b"not a tar at all",
                          "application/gzip")
    assert status == 400 and "project archive is unusable" in answer["error"]["message"]
    evil = archive(("../escape.txt", b"out"))
    status, answer = send(api, "POST", "/v1/sessions?name=up1", evil, "application/gzip")
    assert status == 400 and refused_path(answer["error"]["message"])
    status, answer = send(api, "POST", "/v1/sessions", archive(("a", b"1")), "application/gzip")
    assert status == 400 and "missing query argument 'name'" in answer["error"]["message"]
    status, answer = send(api, "POST", "/v1/sessions?name=up1&colour=red",
                          archive(("a", b"1")), "application/gzip")
    assert status == 400 and "colour" in answer["error"]["message"]
    # larger than a JSON body may be ([api] max_body, 16 KiB), within max_upload: it reaches
    # the sandbox service, which reads it (and refuses its path)
    larger = archive(("../escape.txt", os.urandom(30000)))
    assert 16 * 1024 < len(larger) < 65536
    status, answer = send(api, "POST", "/v1/sessions?name=up1", larger, "application/gzip")
    assert status == 400 and refused_path(answer["error"]["message"]), answer
    # an agent's profile rides in the query (the body is the archive): a larger one than
    # gunicorn's default request line (4094 bytes) still reaches the sandbox service, which
    # parses it (and refuses this one's unknown key, naming it)
    profile = CLAUDE + "\n".join(f"# {'x' * 70}" for _ in range(60)) + "\ncolour = 1\n"
    query = urlencode({"name": "up1", "project_id": "p", "agent_name": "claude",
                       "agent": profile})
    assert 4094 < len(query) < 8000
    status, answer = send(api, "POST", f"/v1/sessions?{query}", archive(("a", b"1")),
                          "application/gzip")
    assert status == 400 and "agent claude:" in answer["error"]["message"], answer
    assert "[policy] colour: unknown key" in answer["error"]["message"]
    status, answer = send(api, "POST", "/v1/sessions?name=up1&agent_name=claude",
                          archive(("a", b"1")), "application/gzip")
    assert status == 400 and "go together" in answer["error"]["message"]
    big = b"\0" * 70000  # [api] max_upload = 65536 in this fixture
    status, answer = send(api, "POST", "/v1/sessions?name=up1", big, "application/gzip")
    assert status == 413 and "max_upload" in answer["error"]["message"]
    assert {s["name"] for s in api.client().request("GET", "/sessions")["sessions"]} == {
        "s1", "s2"}  # nothing was made


def test_the_sandbox_service_answers_garbage_and_lives(api):
    path = str(api.sandbox.socket)
    for garbage in (b"not json\n", b"[1, 2]\n", b'{"op": "explode"}\n',
                    b'{"op": "create", "name": "g", "payload": -4}\n',
                    b'{"op": "create", "name": "g", "payload": 99999999999999}\n'):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(path)
            sock.sendall(garbage)
            answer = json.loads(sock.makefile("rb").readline())
        assert answer["ok"] is False and answer["error"]
    with socket.socket(socket.AF_UNIX) as sock:  # a payload that never fully arrives
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(b'{"op": "create", "name": "g", "payload": 100}\n' + b"x" * 10)
        sock.shutdown(socket.SHUT_WR)
        answer = json.loads(sock.makefile("rb").readline())
    assert "payload ended after 10 of 100 bytes" in answer["error"]
    assert api.client().request("GET", "/sessions")["sessions"]  # still serving


def test_no_sandbox_service_is_a_clear_503(api, corral_filter, tmp_path):
    from .conftest import ApiProcess

    alone = ApiProcess(tmp_path, corral_filter.socket)  # its sandbox socket does not exist
    try:
        listed = alone.client().request("GET", "/sessions")
        assert {s["name"] for s in listed["sessions"]} == {"s1", "s2"}
        assert "sandbox service is not answering" in listed["sandbox_error"]
        with pytest.raises(CliError, match="sandbox service is not answering") as info:
            alone.client().request("POST", "/sessions", {"name": "x"})
        assert info.value.code == 3
    finally:
        alone.stop()
