"""A change the firewall cannot follow: a real filter managing a real firewall, in a network
namespace of its own, while another process holds the table (nftables' `owner` flag: only
that process's netlink socket may change it). Every request is answered, nothing changes,
and the same connection goes on; once the table is free again, the change goes through.

How it fails depends on libnftables: 1.0.6 (Debian 12) prints an owned table's flags as
JSON that does not parse, so the filter's listing of the table fails before its transaction
(an unexpected error: "internal error: JSONDecodeError"); later versions list it and the
transaction is refused ("Operation not permitted")."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
BIN = Path(sys.executable).parent


class Connection:
    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(30)
        self.sock.connect(str(path))
        self.stream = self.sock.makefile("rb")

    def ask(self, request: dict) -> dict:
        self.sock.sendall(json.dumps(request).encode() + b"\n")
        line = self.stream.readline()
        assert line, f"no answer to {request}: the filter closed the connection"
        return json.loads(line)

    def close(self) -> None:
        self.stream.close()
        self.sock.close()


REFUSED = ("Operation not permitted", "internal error: JSONDecodeError")


def _refused(answer: dict) -> bool:
    return answer["ok"] is False and any(cause in answer["error"] for cause in REFUSED)


def _table(namespace: str) -> str:
    return subprocess.run(["ip", "netns", "exec", namespace, "nft", "list", "table", "inet",
                           "corral"], capture_output=True, text=True).stdout


def test_a_change_nftables_refuses_is_answered_and_changes_nothing(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces and nftables")
    name = f"corral-ctl-{uuid.uuid4().hex[:6]}"
    state = tmp_path / "state"
    (tmp_path / "filter.toml").write_text(f"""
[dns]
listen = ["127.0.0.1:5353"]
upstream = ["127.0.0.1:9"]
[proxy]
listen = ["127.0.0.1:3128"]
[state]
dir = "{state}"
[control]
socket = "{tmp_path}/filter.sock"
[firewall]
manage = true
""")
    filter_process = owner = connection = None
    try:
        subprocess.run(["ip", "netns", "add", name], check=True)
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
                       check=True)
        filter_process = subprocess.Popen(
            ["ip", "netns", "exec", name, str(BIN / "corral-filter"), "--config",
             str(tmp_path / "filter.toml")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(200):
            if (tmp_path / "filter.sock").exists():
                break
            assert filter_process.poll() is None, filter_process.stderr.read()
            time.sleep(0.05)
        connection = Connection(tmp_path / "filter.sock")
        assert connection.ask({"op": "session-add", "name": "s3", "subnet": "10.213.3.0/24"})[
            "added"] is True
        assert "deny_s3" in _table(name)  # the firewall followed
        registered = (state / "sessions.json").read_bytes()

        # another process takes the table: every transaction of the filter's now fails
        owner = subprocess.Popen(["ip", "netns", "exec", name, "nft", "-i"],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        owner.stdin.write(b"delete table inet corral\nadd table inet corral { flags owner; }\n")
        owner.stdin.flush()
        for _ in range(100):
            if "flags owner" in _table(name):
                break
            time.sleep(0.05)
        assert "flags owner" in _table(name)

        refused = connection.ask({"op": "session-add", "name": "s4",
                                  "subnet": "10.213.4.0/24"})
        assert _refused(refused), refused
        if "internal error" not in refused["error"]:
            assert "s4 not registered: the firewall could not follow" in refused["error"]
        gone = connection.ask({"op": "session-remove", "name": "s3"})
        assert _refused(gone), gone
        tcp = connection.ask({"op": "add", "session": "s3", "kind": "tcp",
                              "rule": "10.9.9.9:22"})  # a rule naming an address: nftables
        assert _refused(tcp), tcp
        # nothing changed, in memory or on disk
        sessions = connection.ask({"op": "sessions"})["sessions"]
        assert [s["name"] for s in sessions] == ["s3"] and sessions[0]["runtime_rules"] == 0
        assert (state / "sessions.json").read_bytes() == registered
        assert not (state / "runtime" / "s3.json").exists()
        # a change the ruleset does not depend on needs no nftables
        assert connection.ask({"op": "add", "session": "s3", "kind": "dns",
                               "rule": "fine.test"})["added"] is True
        assert connection.ask({"op": "status"})["ok"] is True

        owner.stdin.close()  # the owner goes, and its table with it
        owner.wait(10)
        added = connection.ask({"op": "session-add", "name": "s4", "subnet": "10.213.4.0/24"})
        assert added["ok"] and added["added"], added
        assert "deny_s4" in _table(name) and "deny_s3" in _table(name)
        tcp = connection.ask({"op": "add", "session": "s3", "kind": "tcp",
                              "rule": "10.9.9.9:22"})
        assert tcp["ok"] and tcp["added"], tcp
        assert "10.9.9.9" in _table(name)  # the ruleset followed the rule at once
    finally:
        if connection is not None:
            connection.close()
        if owner is not None and owner.poll() is None:
            owner.kill()
            owner.wait()
        if filter_process is not None:
            filter_process.terminate()
            filter_process.wait(10)
            filter_process.stderr.close()
        subprocess.run(["ip", "netns", "del", name], check=False)
