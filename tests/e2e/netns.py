"""Network namespaces for the e2e tier: a sandbox or two, the appliance, a fake internet.

  sandbox s1 (10.213.1.2, 2001:db8:1::2) --corral-s1-- appliance --up0-- internet
  sandbox s2 (10.213.2.2)                --corral-s2--   (filter,       (203.0.113.0/24,
                                                           firewall)     2001:db8:ff::/64)
  the appliance also has virbr0 (192.168.122.1, one end of a veth pair) and, on it and
  on 127.0.0.53, stand-ins for a workstation's resolvers holding port 53 (resolvers.py)

Every name starts with PREFIX, so a run cleans up whatever an interrupted run left behind
(processes inside first, then the namespaces) before building, and again when it is done.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

PREFIX = "corral-e2e-"
APPLIANCE, INTERNET = PREFIX + "app", PREFIX + "net"


def sh(*args: str, check: bool = True, ns: str | None = None, **kw):
    command = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, **kw)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip() or result.stdout}")
    return result


def existing() -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def cleanup() -> None:
    """Kill every process in our namespaces, then delete them. Safe to call any time."""
    for name in existing():
        pids = sh("ip", "netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 5
        while pids and time.monotonic() < deadline:
            pids = sh("ip", "netns", "pids", name, check=False).stdout.split()
            time.sleep(0.05)
        sh("ip", "netns", "del", name, check=False)
        with contextlib.suppress(FileNotFoundError, OSError):
            for f in Path(f"/etc/netns/{name}").iterdir():
                f.unlink()
            Path(f"/etc/netns/{name}").rmdir()


def sandbox_name(index: int) -> str:
    return f"{PREFIX}s{index}"


def build(sessions: int = 2) -> None:
    cleanup()
    for name in (APPLIANCE, INTERNET):
        sh("ip", "netns", "add", name)
        sh("ip", "link", "set", "lo", "up", ns=name)
    sh("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=APPLIANCE)
    sh("sysctl", "-qw", "net.ipv6.conf.all.forwarding=1", ns=APPLIANCE)

    # appliance <-> internet
    sh("ip", "link", "add", "up0", "netns", APPLIANCE, "type", "veth", "peer", "name", "eth0",
       "netns", INTERNET)
    for ns, v4, v6 in ((APPLIANCE, "198.51.100.1/24", "2001:db8:ff::1/64"),
                       (INTERNET, "198.51.100.2/24", "2001:db8:ff::2/64")):
        dev = "up0" if ns == APPLIANCE else "eth0"
        sh("ip", "addr", "add", v4, "dev", dev, ns=ns)
        sh("ip", "-6", "addr", "add", v6, "dev", dev, "nodad", ns=ns)
        sh("ip", "link", "set", dev, "up", ns=ns)
    sh("ip", "route", "add", "default", "via", "198.51.100.2", ns=APPLIANCE)
    # a workstation's other bridge, where libvirt's dnsmasq holds port 53 (resolvers.py):
    # a veth pair (not every kernel here has the dummy type), both ends in the appliance
    sh("ip", "link", "add", "virbr0", "type", "veth", "peer", "name", "virbr0-nic",
       ns=APPLIANCE)
    sh("ip", "addr", "add", "192.168.122.1/24", "dev", "virbr0", ns=APPLIANCE)
    for dev in ("virbr0", "virbr0-nic"):
        sh("ip", "link", "set", dev, "up", ns=APPLIANCE)
    sh("ip", "-6", "route", "add", "default", "via", "2001:db8:ff::2", ns=APPLIANCE)
    for address in ("203.0.113.10/32", "203.0.113.11/32", "203.0.113.12/32",
                    "203.0.113.13/32", "203.0.113.22/32", "203.0.113.53/32"):
        sh("ip", "addr", "add", address, "dev", "lo", ns=INTERNET)
    sh("ip", "-6", "addr", "add", "3fff:ff::10/128", "dev", "lo", ns=INTERNET)
    sh("ip", "route", "add", "10.213.0.0/16", "via", "198.51.100.1", ns=INTERNET)
    sh("ip", "-6", "route", "add", "2001:db8::/40", "via", "2001:db8:ff::1", ns=INTERNET)

    for i in range(1, sessions + 1):
        add_sandbox(i)


def add_sandbox(i: int, bridge: str | None = None) -> None:
    """Sandbox i (10.213.i.2, 2001:db8:i::2) wired to the appliance on `bridge`, by default
    "corral-si" (the firewall's pattern)."""
    sandbox, bridge = sandbox_name(i), bridge or f"corral-s{i}"
    if sandbox not in existing():
        sh("ip", "netns", "add", sandbox)
        sh("ip", "link", "set", "lo", "up", ns=sandbox)
    sh("ip", "link", "add", bridge, "netns", APPLIANCE, "type", "veth", "peer", "name",
       "eth0", "netns", sandbox)
    sh("ip", "addr", "add", f"10.213.{i}.1/24", "dev", bridge, ns=APPLIANCE)
    sh("ip", "-6", "addr", "add", f"2001:db8:{i}::1/64", "dev", bridge, "nodad", ns=APPLIANCE)
    sh("ip", "link", "set", bridge, "up", ns=APPLIANCE)
    sh("ip", "addr", "add", f"10.213.{i}.2/24", "dev", "eth0", ns=sandbox)
    sh("ip", "-6", "addr", "add", f"2001:db8:{i}::2/64", "dev", "eth0", "nodad", ns=sandbox)
    sh("ip", "link", "set", "eth0", "up", ns=sandbox)
    sh("ip", "route", "add", "default", "via", f"10.213.{i}.1", ns=sandbox)
    sh("ip", "-6", "route", "add", "default", "via", f"2001:db8:{i}::1", ns=sandbox)
    sh("sysctl", "-qw", "net.ipv4.ping_group_range=0 2147483647", ns=sandbox)
    # `ip netns exec` shows this file as /etc/resolv.conf inside the sandbox
    Path(f"/etc/netns/{sandbox}").mkdir(parents=True, exist_ok=True)
    Path(f"/etc/netns/{sandbox}/resolv.conf").write_text(f"nameserver 10.213.{i}.1\n")


def remove_sandbox(i: int, bridge: str | None = None) -> None:
    """Undo add_sandbox: its processes, its namespace, and its end of the link."""
    name = sandbox_name(i)
    for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    sh("ip", "link", "del", bridge or f"corral-s{i}", ns=APPLIANCE, check=False)
    sh("ip", "netns", "del", name, check=False)
    with contextlib.suppress(OSError):
        Path(f"/etc/netns/{name}/resolv.conf").unlink()
        Path(f"/etc/netns/{name}").rmdir()


def spawn(ns: str, args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(["ip", "netns", "exec", ns, *args], stdout=out, stderr=out,
                                env=env, start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
