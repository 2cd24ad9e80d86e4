"""The VM tier's look at the host (tests/vm/host.py): who listens on the forwarded API port,
and which corral services run as an installed appliance would. Parsed from given `ss` and
/proc text here, and once against this machine's real `ss` and /proc."""

from __future__ import annotations

import os
import socket
import subprocess

from tests.vm import host

SS = """\
LISTEN 0 1    127.0.0.1:8443  0.0.0.0:* users:(("qemu-system-x86",pid=14397,fd=9))
LISTEN 0 100  127.0.0.1:18443 0.0.0.0:* users:(("python3",pid=2001,fd=5),("python3",pid=2002,fd=5))
LISTEN 0 128    0.0.0.0:2024  0.0.0.0:*
LISTEN 0 4096      [::]:8443     [::]:* users:(("corral-api",pid=3003,fd=7))
LISTEN 0 128  127.0.0.1:84430 0.0.0.0:* users:(("other",pid=4004,fd=3))
"""

VENV = "/work/repo/.venv/bin"
INSTALLED = "/opt/corral/venv/bin"


def test_the_owners_of_a_port_on_every_address_are_named():
    assert host.port_owners(SS, 8443) == {14397: "qemu-system-x86", 3003: "corral-api"}
    assert host.port_owners(SS, 18443) == {2001: "python3", 2002: "python3"}
    assert host.port_owners(SS, 9) == {}


def test_a_listener_ss_cannot_name_is_not_taken_for_nobody():
    assert host.port_owners(SS, 2024) == {0: "(unknown: ss could not name the process)"}


def test_corral_services_are_recognised_however_they_were_started():
    assert host.is_corral_service([f"{VENV}/python", f"{VENV}/corral-filter", "--config", "f"])
    assert host.is_corral_service([f"{INSTALLED}/corral-api", "--config", "/etc/corral/a"])
    assert host.is_corral_service(["python3", "-m", "appliance.local", "--state-dir", "/x"])
    assert not host.is_corral_service(["qemu-system-x86_64", "-name", "corral-vm-test"])
    assert not host.is_corral_service([f"{VENV}/python", f"{VENV}/pytest", "corral-filter"])
    assert not host.is_corral_service(["vim", "appliance/filter/config.py"])


def test_only_services_installed_as_an_appliance_are_reported():
    table = {
        10: [f"{VENV}/python", f"{VENV}/corral-filter", "--config", "/tmp/pytest-1/filter.toml"],
        11: [f"{VENV}/python", "-m", "appliance.local", "--state-dir", "/tmp/pytest-1/e2e0"],
        20: [f"{INSTALLED}/python3", f"{INSTALLED}/corral-filter", "--config",
             "/etc/corral/filter.toml"],
        21: [f"{VENV}/python", f"{VENV}/corral-api", "--config", "/etc/corral/api.toml"],
        30: ["/usr/bin/nginx", "-c", "/etc/corral/nginx.conf"],
    }
    assert set(host.appliance_services(table)) == {20, 21}


def test_processes_are_read_from_a_proc_tree(tmp_path):
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cmdline").write_bytes(b"/opt/corral/venv/bin/corral-api\0--config\0x\0")
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "cmdline").write_bytes(b"")  # a kernel thread
    (tmp_path / "self").mkdir()
    assert host.processes(tmp_path) == {7: ["/opt/corral/venv/bin/corral-api", "--config", "x"]}


def test_this_machines_ss_and_proc_name_a_real_listener():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True,
                                   check=True).stdout
        assert list(host.port_owners(listening, port)) == [os.getpid()]
    assert any("pytest" in word for word in host.processes()[os.getpid()])
