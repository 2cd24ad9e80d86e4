"""Kept upstream connections (proxy/pool.py) never outlive the policy they were dialled under,
never pass to another session, and never carry a request judged before a change: the probes
of an attack on the pool, kept as tests. The origin says which of its connections carried
each answer, and keeps state per connection as NTLM and Negotiate do."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from tests.integration.conftest import FilterProcess, connect, recv_all

ORIGIN = "127.31.0.5"
BLOCKED = "127.31.7.2"
"""Outside the appliance layer's cidr allow once the test narrows it."""


class Stateful:
    """An HTTP origin on `host`:80 whose JSON answers name the connection that carried them
    and who logged in on it (`X-Login`)."""

    def __init__(self, loop, host: str):
        self.accepted = 0
        self.paths: list[str] = []
        self.server = loop.run(asyncio.start_server(self._handle, host, 80,
                                                    reuse_address=True))

    async def _handle(self, reader, writer):
        self.accepted += 1
        conn, login = self.accepted, None
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                path = head[0].split(" ")[1]
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (line.partition(":") for line in head[1:] if line)}
                await reader.readexactly(int(headers.get("content-length", 0)))
                self.paths.append(path)
                login = headers.get("x-login", login)
                payload = json.dumps({"conn": conn, "login": login, "path": path}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(payload), payload))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def response(sock) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")), 0)
    while len(rest) < length and (chunk := sock.recv(65536)):
        rest += chunk
    return head + b"\r\n\r\n" + rest


def status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def get(port: int, host: str, path: str, source: str = "127.0.0.1") -> bytes:
    with connect(port, source) as sock:
        sock.sendall(f"GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n"
                     "Connection: close\r\n\r\n".encode())
        return recv_all(sock)


def held(port: int, host: str, path: str, source: str = "127.0.0.1", extra: str = ""):
    """A client connection that made one request and stays open (its upstream kept)."""
    sock = connect(port, source)
    sock.sendall(f"GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode())
    raw = response(sock)
    assert status(raw) == 200, raw
    return sock, json.loads(raw.split(b"\r\n\r\n", 1)[1])


@pytest.fixture(scope="module")
def kept(internet, tmp_path_factory):
    process = FilterProcess(tmp_path_factory.mktemp("kept"), internet.dns.address)
    origins = {ORIGIN: Stateful(internet.loop, ORIGIN), BLOCKED: Stateful(internet.loop,
                                                                          BLOCKED)}
    for name, address in (("auth.test", ORIGIN), ("race.test", ORIGIN),
                          ("seven.test", BLOCKED)):
        internet.dns.zone[name] = [("A", address, 300)]
    yield process, origins
    for origin in origins.values():
        origin.server.close()
    process.stop()


def test_an_upstream_of_a_session_gone_never_serves_the_next_one_on_its_subnet(kept, tmp_path):
    corral, _ = kept
    policy = tmp_path / "auth.toml"
    policy.write_text('[http]\nallow = ["auth.test"]\n')
    assert corral.control({"op": "session-add", "name": "old", "subnet": "127.0.9.0/24",
                           "files": [str(policy)]})["ok"]
    sock, answer = held(corral.proxy_port, "auth.test", "/login", "127.0.9.1",
                        "X-Login: old\r\n")
    assert corral.control({"op": "session-remove", "name": "old", "forget_rules": True})["ok"]
    assert corral.control({"op": "session-add", "name": "new", "subnet": "127.0.9.0/24",
                           "files": [str(policy)]})["ok"]
    try:
        sock.close()  # the old sandbox's connection ends after the new session came
        time.sleep(0.3)
        raw = get(corral.proxy_port, "auth.test", "/whoami", "127.0.9.2")
        mine = json.loads(raw.split(b"\r\n\r\n", 1)[1])
        assert mine["conn"] != answer["conn"] and mine["login"] is None, mine
    finally:
        corral.control({"op": "session-remove", "name": "new", "forget_rules": True})


@pytest.mark.parametrize("pooled", [False, True], ids=["same-connection", "pooled"])
def test_a_request_judged_before_a_revoke_is_not_sent_after_it(kept, pooled):
    """Its body read to be judged (an inspected host), the request waits; the rule goes;
    the upstream it would use (its own connection's, or one another connection put back
    after the change) is never used for it: it is judged at a new dial, and refused."""
    corral, origins = kept
    for kind in ("http", "inspect"):
        assert corral.control({"op": "add", "session": "s1", "kind": kind,
                               "rule": "race.test"})["ok"]
    path = f"/exfil-{'pooled' if pooled else 'same'}"
    idle, _ = held(corral.proxy_port, "race.test", "/warm")
    slow = idle if not pooled else connect(corral.proxy_port)
    slow.sendall(f"POST http://race.test{path} HTTP/1.1\r\nHost: race.test\r\n"
                 "Content-Length: 20\r\nConnection: close\r\n\r\nfirst".encode())
    time.sleep(0.3)  # judged: allowed; its body is being read
    try:
        assert corral.control({"op": "remove", "session": "s1", "kind": "http",
                               "rule": "race.test"})["ok"]
        assert status(get(corral.proxy_port, "race.test", "/after")) == 403
        if pooled:
            idle.close()  # its upstream would go back after the change
            time.sleep(0.3)
        slow.sendall(b" and the rest!!")
        raw = response(slow)
        assert path not in origins[ORIGIN].paths and status(raw) == 403, raw[:200]
    finally:
        slow.close()
        idle.close()
        corral.control({"op": "remove", "session": "s1", "kind": "inspect",
                        "rule": "race.test"})


def test_an_address_a_reload_blocks_is_not_reached_over_a_kept_upstream(kept):
    corral, origins = kept
    wide = '[cidr]\nallow = ["127.31.0.0/16"]\n'
    narrow = '[cidr]\nallow = ["127.31.0.0/24"]\n'
    assert corral.control({"op": "add", "session": "s1", "kind": "http",
                           "rule": "seven.test"})["ok"]
    idle, _ = held(corral.proxy_port, "seven.test", "/warm")
    (corral.dir / "appliance.toml").write_text(narrow)
    try:
        os.kill(corral.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 5
        while (fresh := get(corral.proxy_port, "seven.test", "/fresh")) and status(fresh) == 200:
            assert time.monotonic() < deadline, "the reload never took"
            time.sleep(0.2)
        idle.close()  # its upstream was dialled under the wide cidr rule
        time.sleep(0.3)
        raw = get(corral.proxy_port, "seven.test", "/after-reload")
        assert status(raw) == 403 and "/after-reload" not in origins[BLOCKED].paths, raw[:200]
    finally:
        (corral.dir / "appliance.toml").write_text(wide)
        os.kill(corral.proc.pid, signal.SIGHUP)
