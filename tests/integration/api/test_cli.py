"""The `corral` command end to end: real CLI process, real API (mTLS), real filter."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.conftest import connect, recv_all

CORRAL = str(Path(sys.executable).parent / "corral")


def corral(home: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CONFIG_HOME": str(home)}
    return subprocess.run([CORRAL, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def connect_status(port: int, target: str) -> int:
    with connect(port) as sock:
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
        return int(recv_all(sock, 64).split(b" ")[1])


def read_line(process: subprocess.Popen, timeout: float = 5.0):
    """One line of a child's output, or fail after `timeout` (never block forever)."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no output within {timeout}s"
    return process.stdout.readline()


def test_credentials_are_private(home):
    directory = home / "corral" / "appliances" / "default"
    assert oct(directory.stat().st_mode & 0o777) == "0o700"
    assert oct((directory / "client.key").stat().st_mode & 0o777) == "0o600"


def test_a_rule_added_with_the_cli_changes_the_filters_decisions(home, corral_filter):
    assert connect_status(corral_filter.proxy_port, "cli-added.test:443") == 403
    added = corral(home, "allow-http", "cli-added.test", "--session", "s1")
    assert added.returncode == 0, added.stderr
    assert added.stdout == "added http cli-added.test (session s1)\n"
    assert connect_status(corral_filter.proxy_port, "cli-added.test:443") != 403

    rules = json.loads(corral(home, "rules", "--session", "s1", "--json").stdout)["rules"]
    assert {"kind": "http", "rule": "cli-added.test", "layer": "session",
            "source": "api"} in rules
    table = corral(home, "rules", "--session", "s1").stdout
    assert "RULE" in table and "cli-added.test" in table and "project" in table

    revoked = corral(home, "revoke", "cli-added.test", "--session", "s1")
    assert revoked.returncode == 0 and "revoked http cli-added.test" in revoked.stdout
    assert connect_status(corral_filter.proxy_port, "cli-added.test:443") == 403


def test_a_rule_granted_for_a_while_shows_its_end_and_goes_by_itself(home, corral_filter):
    added = corral(home, "allow-http", "for-a-while.test", "--session", "s1", "--for", "2s")
    assert added.returncode == 0, added.stderr
    assert added.stdout.startswith("added http for-a-while.test (session s1, until ")
    assert connect_status(corral_filter.proxy_port, "for-a-while.test:443") != 403
    table = corral(home, "rules", "--session", "s1").stdout
    (line,) = [x for x in table.splitlines() if "for-a-while.test" in x]
    assert "UNTIL" in table and line.rstrip().endswith(added.stdout.split("until ")[1][:8])
    corral_filter.wait_event(lambda e: e.get("action") == "expired"
                             and e.get("rule") == "for-a-while.test", timeout=10)
    assert connect_status(corral_filter.proxy_port, "for-a-while.test:443") == 403
    wrong = corral(home, "allow-http", "x.test", "--session", "s1", "--for", "soon")
    assert wrong.returncode == 2 and "90s, 10m, 1h30m or 2d" in wrong.stderr


def test_allow_dns_tcp_and_deny(home):
    for command, rule in (("allow-dns", "*.docs.test"), ("allow-tcp", "git.test:22"),
                          ("deny", "bad.docs.test")):
        result = corral(home, command, rule, "--session", "s2", "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["rule"]["rule"] == rule
    refused = corral(home, "allow-tcp", "git.test", "--session", "s2")
    assert refused.returncode == 1 and "needs a port" in refused.stderr


def test_monitor_shows_a_denial_within_a_second(home, corral_filter):
    env = {**os.environ, "XDG_CONFIG_HOME": str(home)}
    with subprocess.Popen([CORRAL, "monitor", "--session", "s1", "--denied", "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env) as monitor:
        try:
            time.sleep(1.0)  # let it subscribe
            started = time.monotonic()
            connect_status(corral_filter.proxy_port, "monitor-probe.test:443")
            event = json.loads(read_line(monitor))
            elapsed = time.monotonic() - started
            assert event["name"] == "monitor-probe.test" and event["verdict"] == "deny"
            assert event["hint"] == "corral allow-http monitor-probe.test:443"
            assert elapsed < 1.0
        finally:
            monitor.terminate()


def test_monitor_human_lines_carry_the_hint(home, corral_filter):
    env = {**os.environ, "XDG_CONFIG_HOME": str(home)}
    with subprocess.Popen([CORRAL, "monitor", "--session", "s1", "--color", "always"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                          text=True) as monitor:
        try:
            time.sleep(1.0)
            connect_status(corral_filter.proxy_port, "human-probe.test:443")
            line = read_line(monitor)
            assert "\033[31m" in line and "DENY" in line and "human-probe.test:443" in line
            assert "-> corral allow-http human-probe.test:443" in line
        finally:
            monitor.terminate()


def test_monitor_survives_an_api_restart(home, api, corral_filter):
    env = {**os.environ, "XDG_CONFIG_HOME": str(home)}
    with subprocess.Popen([CORRAL, "monitor", "--session", "s1", "--denied", "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as monitor:
        try:
            time.sleep(1.0)
            api.terminate()
            api.start()
            deadline = time.monotonic() + 15
            while True:  # until the monitor has re-subscribed, a probe may go unseen
                connect_status(corral_filter.proxy_port, "after-restart.test:443")
                ready, _, _ = select.select([monitor.stdout], [], [], 1.0)
                if ready:
                    break
                assert time.monotonic() < deadline, "monitor did not reconnect"
            event = json.loads(monitor.stdout.readline())
            assert event["name"] == "after-restart.test"
        finally:
            monitor.terminate()
        assert b"reconnecting" in monitor.stderr.read()


def test_audit_verify_and_listing(home):
    verified = corral(home, "audit", "--verify")
    assert verified.returncode == 0 and "audit log intact" in verified.stdout
    assert "records in 1 segment(s), chain verified from seq 1 to seq" in verified.stdout
    listing = corral(home, "audit", "--since", "1h", "--json", "--limit", "3")
    records = [json.loads(line) for line in listing.stdout.splitlines()]
    assert len(records) == 3 and records[0]["seq"] < records[1]["seq"]
    bad = corral(home, "audit", "--since", "last tuesday")
    assert bad.returncode == 2 and "neither a duration" in bad.stderr


def test_status(home):
    result = corral(home, "status", "--json")
    status = json.loads(result.stdout)
    assert status["filter"]["healthy"] is True
    assert status["sandbox"]["healthy"] is True and status["sandbox"]["sessions"] == 0
    human = corral(home, "status")
    assert "filter: healthy" in human.stdout and "firewall:" in human.stdout
    assert "audit: up to seq" in human.stdout and "1 segment(s)" in human.stdout
    assert status["filter"]["audit"]["segments"] == 1
    assert "sandbox: healthy, 0 sessions, image localhost/corral-sandbox:" in human.stdout


def test_errors_name_the_fix(home, tmp_path):
    missing = corral(home, "rules", "--appliance", "nope")
    assert missing.returncode == 4
    assert "no appliance 'nope'" in missing.stderr and "known appliances: default" in missing.stderr
    which = corral(home, "rules")
    assert which.returncode == 2 and "which session? there are 2: s1, s2" in which.stderr
    assert "--session" in which.stderr
    empty = corral(tmp_path, "status")
    assert empty.returncode == 4 and "corral up" in empty.stderr
    unreachable_home = tmp_path / "unreachable"
    shutil.copytree(home, unreachable_home)
    settings = unreachable_home / "corral" / "appliances" / "default" / "appliance.toml"
    settings.write_text('endpoint = "127.0.0.1:1"\n')
    down = corral(unreachable_home, "status")
    assert down.returncode == 3
    assert "cannot reach default at 127.0.0.1:1" in down.stderr and "corral up" in down.stderr


def test_ls_all_lists_every_appliance_this_host_knows(home, tmp_path):
    """Two appliances that answer (both this API, under two names) and one that does not:
    the sessions of both, each row naming its appliance, and the third named with its error."""
    several = tmp_path / "several"
    shutil.copytree(home, several)
    appliances = several / "corral" / "appliances"
    shutil.copytree(appliances / "default", appliances / "second")
    shutil.copytree(appliances / "default", appliances / "gone")
    (appliances / "gone" / "appliance.toml").write_text('endpoint = "127.0.0.1:1"\n')
    (appliances / "not-one").mkdir()  # no appliance.toml: not an appliance
    listed = corral(several, "ls", "--all", "--json")
    assert listed.returncode == 3, listed.stderr  # the unreachable one's code
    answer = json.loads(listed.stdout)
    assert sorted(answer["appliances"]) == ["default", "second"], answer
    assert answer["appliances"]["default"] == answer["appliances"]["second"]
    assert "sessions" in answer["appliances"]["default"]
    assert list(answer["unreachable"]) == ["gone"]
    assert "cannot reach gone at 127.0.0.1:1" in answer["unreachable"]["gone"]["error"]
    table = corral(several, "ls", "--all")
    assert table.stdout.splitlines()[0].split()[:2] == ["APPLIANCE", "SESSION"], table.stdout
    assert "gone: cannot reach gone" in table.stderr
    (appliances / "second" / "client.crt").write_text("not a certificate\n")
    broken = json.loads(corral(several, "ls", "--all", "--json").stdout)
    assert list(broken["appliances"]) == ["default"], broken  # the others still listed
    assert "credentials" in broken["unreachable"]["second"]["error"], broken
    shutil.rmtree(appliances / "second")
    (appliances / "gone" / "appliance.toml").unlink()
    assert corral(several, "ls", "--all").returncode == 0
    nothing = corral(tmp_path / "empty", "ls", "--all")
    assert nothing.returncode == 4 and "corral up" in nothing.stderr


def test_certs_rotate_replaces_every_certificate(home, api):
    before = home / "before"
    shutil.copytree(home / "corral", before / "corral")
    result = corral(home, "certs", "rotate")
    assert result.returncode == 0, result.stderr
    deadline = time.monotonic() + 20
    while corral(home, "status", "--json").returncode not in (0, 1):  # 1: firewall not here
        assert time.monotonic() < deadline
        time.sleep(0.2)
    stale = corral(before, "status")
    assert stale.returncode == 3 and "TLS" in stale.stderr
    from appliance import pki

    api.bundle = pki.Bundle(*(p.read_bytes() for p in (
        home / "corral/appliances/default/ca.crt", api.server_dir / "server.crt",
        api.server_dir / "server.key", home / "corral/appliances/default/client.crt",
        home / "corral/appliances/default/client.key")))


def test_audit_verify_names_the_file_and_line_of_a_break(home, corral_filter):
    """Last in this module: it breaks this filter's log for good."""
    path = corral_filter.dir / "state" / "audit.jsonl"
    with open(path, "r+b") as f:  # in place: the filter keeps appending to the same file
        lines = f.read().splitlines(keepends=True)
        assert len(lines) >= 3
        f.seek(len(lines[0]) + lines[1].index(b'"seq":'))
        f.write(b'"seq":0')  # the second record edited, its length kept
    broken = corral(home, "audit", "--verify")
    assert broken.returncode == 5, broken.stdout + broken.stderr
    assert "audit log broken at audit.jsonl line 2: seq 0 follows 1" in broken.stderr


def test_the_interception_ca_commands_say_when_inspection_is_off(home):
    # this tier's filter has no [inspect] section (the e2e tier runs one that has)
    shown = corral(home, "certs", "interception")
    assert shown.returncode == 0, shown.stderr
    assert "inspection is off" in shown.stdout and "ca_dir" in shown.stdout
    assert json.loads(corral(home, "certs", "interception", "--json").stdout) == {"ca": None}
    rotated = corral(home, "certs", "rotate", "--interception")
    assert rotated.returncode == 1 and "inspection is off" in rotated.stderr


def test_a_secret_goes_in_on_stdin_and_never_comes_out(home):
    value = "sk-cli-0123456789abcdefVALUE"
    env = {**os.environ, "XDG_CONFIG_HOME": str(home)}
    stored = subprocess.run([CORRAL, "secret", "set", "CLI_TOKEN", "--host", "api.example.com",
                             "--header", "x-api-key", "--only", "POST /v1/messages", "--json"],
                            input=value + "\n", capture_output=True, text=True, env=env,
                            timeout=30)
    assert stored.returncode == 0, stored.stderr
    assert json.loads(stored.stdout)["secret"]["header"] == "x-api-key"
    assert json.loads(stored.stdout)["secret"]["requests"] == ["POST /v1/messages"]
    listed = corral(home, "secret", "ls")
    assert "CLI_TOKEN" in listed.stdout and "header x-api-key" in listed.stdout
    assert "only with POST /v1/messages" in listed.stdout
    shown = [corral(home, "secret", "ls", "--json"), corral(home, "status", "--json"),
             corral(home, "audit", "--json")]
    assert all(value not in r.stdout + r.stderr for r in [stored, *shown])
    empty = subprocess.run([CORRAL, "secret", "set", "CLI_TOKEN", "--host", "h.example"],
                           input="", capture_output=True, text=True, env=env, timeout=30)
    assert empty.returncode == 2 and "no value for CLI_TOKEN" in empty.stderr
    reserved = subprocess.run([CORRAL, "secret", "set", "HTTPS_PROXY", "--host", "h.example"],
                              input=value, capture_output=True, text=True, env=env, timeout=30)
    assert reserved.returncode == 1 and "session's own" in reserved.stderr
    assert value not in reserved.stderr
    assert corral(home, "secret", "rm", "CLI_TOKEN").returncode == 0
    gone = corral(home, "secret", "rm", "CLI_TOKEN")
    assert gone.returncode == 1 and "no secret 'CLI_TOKEN'" in gone.stderr


def test_an_ssh_key_goes_in_on_stdin_with_its_hosts_keys_and_never_comes_out(home, tmp_path):
    import asyncssh

    key = asyncssh.generate_private_key("ssh-ed25519").export_private_key().decode()
    host = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    (tmp_path / "keys").write_text(f"# ssh-keyscan git.example\ngit.example {host}\n"
                                   f"elsewhere.example {other}\n|1|hashed= {other}\n")
    env = {**os.environ, "XDG_CONFIG_HOME": str(home)}
    stored = subprocess.run([CORRAL, "secret", "set", "GIT_DEPLOY_KEY", "--ssh", "--host",
                             "git.example", "--known-hosts", str(tmp_path / "keys"), "--json"],
                            input=key, capture_output=True, text=True, env=env, timeout=30)
    assert stored.returncode == 0, stored.stderr
    secret = json.loads(stored.stdout)["secret"]
    assert (secret["scheme"], secret["user"], secret["port"]) == ("ssh", "git", 22)
    assert secret["host_keys"] == [host]  # the other hosts' and the hashed line's: not pinned
    listed = corral(home, "secret", "ls")
    assert "ssh key, as git on port 22, 1 pinned host key" in listed.stdout
    body = key.splitlines()[1]
    assert all(body not in r.stdout + r.stderr
               for r in [stored, listed, corral(home, "secret", "ls", "--json")])
    unpinned = subprocess.run([CORRAL, "secret", "set", "GIT_DEPLOY_KEY", "--ssh", "--host",
                               "nowhere.example", "--known-hosts", str(tmp_path / "keys")],
                              input=key, capture_output=True, text=True, env=env, timeout=30)
    assert unpinned.returncode == 2 and "holds no key for nowhere.example" in unpinned.stderr
    bad = subprocess.run([CORRAL, "secret", "set", "GIT_DEPLOY_KEY", "--ssh", "--host",
                          "git.example", "--known-hosts", str(tmp_path / "keys")],
                         input="not a key\n", capture_output=True, text=True, env=env,
                         timeout=30)
    assert bad.returncode == 1 and "not a private key" in bad.stderr
    assert corral(home, "secret", "rm", "GIT_DEPLOY_KEY").returncode == 0


def test_inspection_and_request_rules_at_run_time(home):
    def run(*args):
        return corral(home, *args, "--session", "s2")

    assert run("inspect", "api.docs.test").returncode == 0
    refused = run("allow-request", "api.docs.test", "GET", "/x")
    assert refused.returncode == 1 and "has no allow list" in refused.stderr
    denied = run("deny-request", "api.docs.test", "DELETE", "/**")
    assert denied.returncode == 0 and "!api.docs.test DELETE /**" in denied.stdout
    assert run("allow-request", "api.docs.test", "GET", "/x/**").returncode == 1
    rules = json.loads(corral(home, "rules", "--session", "s2", "--json").stdout)
    shown = {(r["kind"], r["rule"]) for r in rules["rules"] if r["layer"] == "session"}
    assert {("inspect", "api.docs.test"), ("request", "!api.docs.test DELETE /**")} <= shown
    revoked = run("revoke", "request", "!api.docs.test", "DELETE", "/**")
    assert revoked.returncode == 0, revoked.stderr
    assert run("revoke", "api.docs.test").returncode == 0


def test_ask_mode_approve_and_refuse_from_the_cli(home, corral_filter):
    """A held CONNECT from session s2 in ask mode, seen in `corral approvals` and let through
    by `corral approve`; the decision is recorded with the client certificate that took it.
    Another, refused with a reason, gets the denial with it."""
    import threading

    from tests.integration.conftest import S2_CLIENT

    asked = corral(home, "ask", "--session", "s2", "--hold", "20")
    assert asked.returncode == 0 and "waits 20s for `corral approve`" in asked.stdout, asked

    def held(answers: list):
        with connect(corral_filter.proxy_port, source=S2_CLIENT, timeout=30) as sock:
            sock.sendall(b"CONNECT allowed.test:8080 HTTP/1.1\r\n\r\n")
            answers.append(recv_all(sock, 12))

    try:
        for grant, expected in ((["--once"], b"HTTP/1.1 200"), (None, b"HTTP/1.1 403")):
            answers: list[bytes] = []
            thread = threading.Thread(target=held, args=(answers,), daemon=True)
            thread.start()
            deadline = time.monotonic() + 10
            while True:
                listed = json.loads(corral(home, "approvals", "--json").stdout)["approvals"]
                if any(a["waiting"] for a in listed):
                    break
                assert time.monotonic() < deadline, listed
                time.sleep(0.1)
            (approval,) = listed
            assert approval["target"] == "allowed.test:8080" and approval["session"] == "s2"
            table = corral(home, "approvals").stdout
            assert approval["id"] in table and "http allowed.test:8080" in table
            if grant:
                decided = corral(home, "approve", approval["id"], *grant)
                assert decided.stdout.startswith(
                    "approved once: http allowed.test:8080 in session s2: 1 request let "
                    "through"), decided
            else:
                decided = corral(home, "refuse", approval["id"], "--reason", "not now")
                assert decided.stdout == ("refused http allowed.test:8080 in session s2\n"), (
                    decided)
            thread.join(10)
            assert answers and answers[0].startswith(expected), answers
        events = corral_filter.events(session="s2")
        approved, refused = [e for e in events if e.get("action") in ("approved", "refused")]
        assert approved["by"].startswith("corral-cli#") and approved["grant"] == "once"
        assert refused["reason"] == f"refused by {approved['by']}: not now"
        gone = corral(home, "approve", approval["id"], "--for", "10m")
        assert gone.returncode == 1 and "no pending approval" in gone.stderr, gone
    finally:
        off = corral(home, "ask", "--session", "s2", "--off")
        assert off.returncode == 0 and "ask mode off" in off.stdout


def test_learn_proposes_what_a_session_was_denied_and_writes_it_when_told(home, corral_filter,
                                                                          tmp_path):
    for name in ("a.learn.test", "b.learn.test", "c.learn.test", "pypi.org",
                 "files.pythonhosted.org", "pypi.org"):
        assert connect_status(corral_filter.proxy_port, f"{name}:443") == 403
    project = tmp_path / "project"
    project.mkdir()
    (project / "corral.toml").write_text('# ours\n[http]\nallow = ["allowed.test"]\n')
    unknown = corral(home, "learn", "s1", "--fold")  # s1 is from the appliance's config
    assert unknown.returncode == 2 and "--project DIR" in unknown.stderr, unknown
    exact = corral(home, "learn", "s1", "--project", str(project))
    # the port asked, as a grant names it: never the bare name, which opens 80 too
    assert '+    "a.learn.test:443", # asked 1x (connect 1)' in exact.stdout, exact.stdout
    assert "could be folded (--fold" in exact.stdout and "*.learn.test:443 (3 names)" in (
        exact.stdout)
    shown = corral(home, "learn", "s1", "--project", str(project), "--fold")
    assert shown.returncode == 2 and "not written" in shown.stderr, shown  # no terminal here
    assert '+presets = [\n+    "pypi", # 2 of its names, asked 3x' in shown.stdout, shown.stdout
    assert '+    "*.learn.test:443", # 3 names under learn.test' in shown.stdout
    assert (project / "corral.toml").read_text() == '# ours\n[http]\nallow = ["allowed.test"]\n'
    written = corral(home, "learn", "s1", "--project", str(project), "--yes", "--fold")
    assert written.returncode == 0 and "wrote " in written.stdout, written
    checked = json.loads(corral(home, "check", str(project / "corral.toml"), "--json").stdout)
    rules = {(r["kind"], r["rule"]) for r in checked["rules"]}
    assert {("http", "*.learn.test:443"), ("http", "pypi.org"), ("http", "allowed.test")} <= (
        rules)
    again = json.loads(corral(home, "learn", "s1", "--project", str(project), "--json").stdout)
    assert "a.learn.test" in again["allowed_already"]
    assert not [a for a in again["proposal"] if "learn.test" in a["rule"]]


def test_approve_always_writes_the_rule_into_the_project_and_lets_the_request_go(
        home, corral_filter, tmp_path):
    import threading

    from tests.integration.conftest import S2_CLIENT

    assert corral(home, "ask", "--session", "s2", "--hold", "30").returncode == 0
    project = tmp_path / "project"
    project.mkdir()
    answers: list[bytes] = []

    def held():
        with connect(corral_filter.proxy_port, source=S2_CLIENT, timeout=40) as sock:
            sock.sendall(b"CONNECT allowed.test:8080 HTTP/1.1\r\n\r\n")
            answers.append(recv_all(sock, 12))

    thread = threading.Thread(target=held, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not (listed := [a for a in json.loads(corral(home, "approvals", "--json").stdout)
                              ["approvals"] if a["waiting"]]):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        (approval,) = listed
        asked = corral(home, "approve", approval["id"], "--always", "--project", str(project))
        assert asked.returncode == 2 and "+    \"allowed.test:8080\"" in asked.stdout, asked
        assert not (project / "corral.toml").exists() and thread.is_alive()
        decided = corral(home, "approve", approval["id"], "--always", "--project",
                         str(project), "--yes")
        assert decided.returncode == 0, decided
        assert "in session s2 for its life" in decided.stdout
        thread.join(10)
        assert answers and answers[0].startswith(b"HTTP/1.1 200"), answers
        text = (project / "corral.toml").read_text()
        assert '"allowed.test:8080", # approved ' in text and "(session s2)" in text
        approved = [e for e in corral_filter.events(session="s2")
                    if e.get("action") == "approved"][-1]
        assert approved["grant"] == "session" and "always: the project's corral.toml has it" in (
            approved["reason"])
        assert str(tmp_path) not in approved["reason"]  # the agent learns the reason: no path
        extra = corral(home, "approve", approval["id"], "--yes")
        assert extra.returncode == 2 and "--yes: only with --always" in extra.stderr
    finally:
        corral(home, "ask", "--session", "s2", "--off")
        corral(home, "revoke", "allowed.test:8080", "--session", "s2")


class Terminal:
    """`corral ARGS` on a real pseudo-terminal: what it writes, byte for byte, as a
    terminal would be given it, and keys typed into it."""

    def __init__(self, home: Path, *args: str):
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the CLI on the terminal
            os.execve(CORRAL, [CORRAL, *args], {**os.environ, "XDG_CONFIG_HOME": str(home),
                                               "LANG": "C.UTF-8"})
        self.seen = b""

    def expect(self, marker: bytes, timeout: float = 15, count: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while self.seen.count(marker) < count:
            ready, _, _ = select.select([self.fd], [], [], max(0, deadline - time.monotonic()))
            assert ready, f"no {marker!r} (x{count}); saw {self.seen[-1500:]!r}"
            self.seen += os.read(self.fd, 65536)

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def wait(self, timeout: float = 15) -> int:
        """Its exit code, reading what it still writes (a full terminal would stop it);
        fail after `timeout` rather than wait for ever on a CLI that did not quit."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.pid = 0
                return os.waitstatus_to_exitcode(status)
            if select.select([self.fd], [], [], 0.05)[0]:
                with contextlib.suppress(OSError):  # EIO once the child has closed it
                    self.seen += os.read(self.fd, 65536)
        raise AssertionError(f"still running after {timeout}s; saw {self.seen[-1500:]!r}")

    def close(self) -> None:
        if self.pid:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


def test_monitor_ask_decides_the_oldest_approval_with_a_key(home, corral_filter):
    """`corral monitor --ask` on a real terminal: a held request's approval is shown with
    the keys, `o` lets it through, `r` refuses the next, `q` quits."""
    import threading

    from tests.integration.conftest import S2_CLIENT

    assert corral(home, "ask", "--session", "s2", "--hold", "20").returncode == 0
    terminal = Terminal(home, "monitor", "--ask", "--session", "s2", "--color", "never")

    def held(answers: list):
        with connect(corral_filter.proxy_port, source=S2_CLIENT, timeout=30) as sock:
            sock.sendall(b"CONNECT allowed.test:8080 HTTP/1.1\r\n\r\n")
            answers.append(recv_all(sock, 12))

    try:
        for key, expected in ((b"o", b"HTTP/1.1 200"), (b"r", b"HTTP/1.1 403")):
            terminal.seen = b""
            answers: list[bytes] = []
            thread = threading.Thread(target=held, args=(answers,), daemon=True)
            thread.start()
            terminal.expect(b"session s2 asks for http allowed.test:8080\r\n")
            terminal.expect(b"[o]nce [s]ession [a]lways [r]efuse [n]ext [q]uit: a key decides")
            terminal.type(b"\x1bOP\x1b[A" + key.upper())  # F1, Up, a capital: no decision
            time.sleep(0.6)
            assert thread.is_alive() and not answers, terminal.seen
            terminal.type(key)
            thread.join(10)
            assert answers and answers[0].startswith(expected), (key, answers, terminal.seen)
            if key == b"o":
                terminal.expect(b"once: http allowed.test:8080 (ap-")
                terminal.expect(b", 1 request(s) let through)")
        terminal.expect(b"refuse: http allowed.test:8080")
        terminal.type(b"q")
        assert terminal.wait() == 0
    finally:
        terminal.close()
        corral(home, "ask", "--session", "s2", "--off")


def dns_query(port: int, labels: list[bytes], source: str) -> bytes:
    """A query for a name of these labels, whatever bytes they hold, as a session sends it."""
    import secrets
    import socket
    import struct

    name = b"".join(bytes([len(label)]) + label for label in labels) + b"\0"
    wire = struct.pack("!6H", secrets.randbits(16), 0x0100, 1, 0, 0, 0) + name + b"\0\1\0\1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        sock.bind((source, 0))
        sock.sendto(wire, ("127.0.0.1", port))
        return sock.recvfrom(65535)[0]


FAKE_PROMPT = b"ap-00000000: session s2 asks for http github.com:443"
HOSTILE_LABELS = [
    [b"\r\x1b[2K\x1b[1A", FAKE_PROMPT[:60], b"test"],  # CR, erase, cursor up: redraw a line
    [b"\x1b]8;;https://evil", b"\x1b\\github\x1b]8;;\x1b\\", b"test"],  # an OSC 8 link
    [b"\x1b]52;c;cm0gLXJmIH4=\x07", b"\x1b]0;corral\x07x", b"test"],  # clipboard, title
    [b"\x9b2J\xc2\x9b2J", b"\xe2\x80\xaemoc\xe2\x81\xa6", b"test"],  # C1 CSI, bidi
    [b"git\xe2\x80\x8bhub\xe2\x80\xa8x", b"\x08\x08\x7f", b"test"],  # zero-width, LS
    [b" " * 60, b" " * 40 + FAKE_PROMPT[:20], b"test"],  # spaces to push text to a line
]
ACTS = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e"
                  "\u2060-\u206f\ufeff]")
"""What a terminal acts on or hides, but the line ends the CLI writes (CR LF on a pty)."""


def test_hostile_text_from_a_session_reaches_the_terminal_escaped_and_the_prompt_whole(
        home, corral_filter):
    """A session asks DNS for names whose labels hold escape sequences, C1 controls, CR,
    backspace, bidi and zero-width characters and runs of spaces, asks for a host with a
    reason padded to look like a prompt, and holds a request for a long name that begins
    like github.com. On a real terminal, `corral monitor --ask` writes none of what a
    terminal acts on; the only lines with the decision's mark are the CLI's, naming the
    exact target whole; `corral audit` replays the records as safely, and its --json
    stays valid ASCII."""
    import threading

    from tests.integration.conftest import S2_CLIENT

    target = "github.com.login.secure.account.verify.example.evil.test:8080"
    assert corral(home, "ask", "--session", "s2", "--hold", "30").returncode == 0
    started = time.time()
    terminal = Terminal(home, "monitor", "--ask", "--session", "s2", "--color", "never")
    answers: list[bytes] = []

    def held():
        with connect(corral_filter.proxy_port, source=S2_CLIENT, timeout=40) as sock:
            sock.sendall(f"CONNECT {target} HTTP/1.1\r\n\r\n".encode())
            answers.append(recv_all(sock, 12))

    thread = threading.Thread(target=held, daemon=True)
    try:
        time.sleep(1.0)  # subscribed
        thread.start()
        terminal.expect(b"github.com.login")
        for labels in HOSTILE_LABELS:
            dns_query(corral_filter.dns_port, labels, S2_CLIENT)
        terminal.expect(b" DENY  dns ", count=len(HOSTILE_LABELS))  # a long reason is cut
        reason = "ok" + "%20" * 150 + FAKE_PROMPT.decode().replace(" ", "+") + "%0d%1b[2K"
        with connect(corral_filter.proxy_port, source=S2_CLIENT) as sock:
            sock.sendall(f"GET http://request.corral/?host=docs.test&reason={reason} HTTP/1.1"
                         "\r\nHost: request.corral\r\nConnection: close\r\n\r\n".encode())
            assert recv_all(sock).startswith(b"HTTP/1.1 202")
        terminal.expect(b"docs.test")
        time.sleep(0.5)
        shown = terminal.seen.decode("utf-8")  # strict: no stray byte of a sequence
        assert "\x1b" not in shown and not ACTS.search(shown.replace("\r\n", "\n")), ascii(
            [line for line in shown.split("\r\n") if ACTS.search(line)])
        lines = shown.split("\r\n")
        marks = [line for line in lines if line.startswith(("\u25b6", ">>"))]
        approval = next(a for a in json.loads(corral(home, "approvals", "--json").stdout)[
            "approvals"] if a["target"] == target)
        assert marks[:2] == [
            f"\u25b6 {approval['id']}: session s2 asks for http {target}",
            f"\u25b6 [o]nce [s]ession [a]lways [r]efuse [n]ext [q]uit: a key decides "
            f"{approval['id']}"], marks
        assert all(FAKE_PROMPT.decode() not in line for line in marks)
        assert [line for line in lines if "[150 spaces]" in line or "[60 spaces]" in line]
        terminal.type(b"r")
        thread.join(10)
        assert answers and answers[0].startswith(b"HTTP/1.1 403"), answers
        terminal.expect(f"refuse: http {target} ({approval['id']})".encode())
        terminal.type(b"q")
        assert terminal.wait() == 0
    finally:
        terminal.close()
        corral(home, "ask", "--session", "s2", "--off")
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started - 1))
    replayed = subprocess.run([CORRAL, "audit", "--since", since], capture_output=True,
                              env={**os.environ, "XDG_CONFIG_HOME": str(home)}, timeout=30)
    text = replayed.stdout.decode("ascii")  # every record drawn as printable ASCII
    assert text.count(" DENY  dns ") >= len(HOSTILE_LABELS)
    assert not ACTS.search(text.replace("\n", "")), ascii(text)
    records = corral(home, "audit", "--since", since, "--json").stdout
    assert records.isascii() and not ACTS.search(records.replace("\n", ""))
    assert sum("is not a valid host name" in (json.loads(line).get("reason") or "")
               for line in records.splitlines()) >= len(HOSTILE_LABELS)
