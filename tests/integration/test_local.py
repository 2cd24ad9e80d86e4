"""The local backend's supervisor (appliance/local.py) when a service cannot start: it says
the one thing that failed, and nothing about services that never started. A real
corral-filter that cannot bind its session's gateway port (held here, as systemd-resolved
or dnsmasq would hold it); nftables left alone (the firewall's apply and remove are
recorded, not run)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from appliance import local

from .filter.test_gateways import POLICY, free_ports

COMM = Path("/proc/self/comm").read_text().strip()  # how /proc names this process: its holder


def test_a_filter_that_cannot_bind_is_the_one_thing_said(tmp_path, monkeypatch, caplog):
    (port,) = free_ports(1)
    (tmp_path / "l1.toml").write_text(POLICY)
    (tmp_path / "filter.toml").write_text(f"""
[dns]
listen = ["gateway:{port}"]
upstream = ["127.0.0.1:9"]
[state]
dir = "{tmp_path}/filter"
[control]
socket = "{tmp_path}/filter.sock"
[[session]]
name = "l1"
subnet = "127.77.5.0/24"
files = ["{tmp_path}/l1.toml"]
""")
    (tmp_path / "sandbox.toml").write_text(f"""
[sandbox]
socket = "{tmp_path}/sandbox.sock"
state_dir = "{tmp_path}/sandbox"
""")
    (tmp_path / "api.toml").write_text("")
    firewall: list[tuple[str, ...]] = []
    monkeypatch.setattr(local.Supervisor, "firewall",
                        lambda self, *args: firewall.append(args[:1]) or True)
    monkeypatch.setattr(local.signal, "signal", lambda *args: None)
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.77.5.1", port))
    held.listen()
    caplog.set_level(logging.INFO, logger="corral.local")
    try:
        supervisor = local.Supervisor(tmp_path)
        assert supervisor.run() == 1
    finally:
        held.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [
        f"start-up failed: filter exited with 1: corral-filter: session l1: cannot bind "
        f"127.77.5.1:{port} (tcp): Address already in use (held by {COMM} (pid {os.getpid()}) "
        f"on 127.77.5.1:{port}); see {tmp_path / 'logs' / 'filter.log'}"]
    assert firewall == [("apply",), ("remove",)]  # taken down as it was put up
    assert (tmp_path / "stopped").read_text() == "clean\n"
    assert supervisor.sandbox_child.process is None  # never started, never asked
