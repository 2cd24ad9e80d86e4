"""The bench's topology (drawn in run.py's docstring): its network namespaces and addresses,
and how a command or a server is run in one of them. Shared by run.py and inspected.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "corral-bench-"
CLIENT, DIRECT, APP, UP, NOISY = (PREFIX + n for n in ("client", "direct", "app", "up",
                                                       "noisy"))
GATEWAY, PEER_GATEWAY, UPSTREAM = "10.232.0.1", "10.232.2.1", "10.232.1.2"
INSPECTED_UPSTREAM = "10.232.1.3"
"""The same nginx, for the inspected host (bench/inspected.py) alone: a name on an inspected
host's address gets no tunnel from corral (filter/proxy/neighbours.py), and every other row
tunnels to UPSTREAM."""
NOISY_GATEWAY = "10.232.3.1"
NETNS_ETC = Path("/etc/netns") / APP


def sh(*args: str, ns: str | None = None, check: bool = True, timeout: float = 600):
    command = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip() or result.stdout}")
    return result


def cleanup() -> None:
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.2)
        sh("ip", "netns", "del", name, check=False)
    shutil.rmtree(NETNS_ETC, ignore_errors=True)


def topology() -> None:
    cleanup()
    for ns in (CLIENT, DIRECT, APP, UP, NOISY):
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "set", "lo", "up", ns=ns)
        sh("sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65000", ns=ns)
    sh("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=APP)
    # tinyproxy resolves with the C library: `ip netns exec` gives processes in APP this
    # resolv.conf in place of the host's (squid and corral are told the resolver instead)
    NETNS_ETC.mkdir(parents=True)
    (NETNS_ETC / "resolv.conf").write_text(f"nameserver {UPSTREAM}\n")
    for client, app_if, client_ip, app_ip in ((CLIENT, "cb-sbx0", "10.232.0.2", GATEWAY),
                                              (NOISY, "cb-sbx1", "10.232.3.2", NOISY_GATEWAY),
                                              (DIRECT, "cbd0", "10.232.2.2", PEER_GATEWAY),
                                              (UP, "cb-up0", UPSTREAM, "10.232.1.1")):
        sh("ip", "link", "add", app_if, "netns", APP, "type", "veth", "peer", "name", "eth0",
           "netns", client)
        sh("ip", "addr", "add", f"{app_ip}/24", "dev", app_if, ns=APP)
        sh("ip", "link", "set", app_if, "up", ns=APP)
        sh("ip", "addr", "add", f"{client_ip}/24", "dev", "eth0", ns=client)
        sh("ip", "link", "set", "eth0", "up", ns=client)
        sh("ip", "route", "add", "default", "via", app_ip, ns=client)
    sh("ip", "addr", "add", f"{INSPECTED_UPSTREAM}/24", "dev", "eth0", ns=UP)


def spawn(ns: str, args: list[str], log: Path, nofile: int | None = None,
          stdin=None, cgroup=None) -> subprocess.Popen:
    out = open(log, "ab")  # noqa: SIM115 - the child keeps it

    def limit():  # as far as this host lets root go (a container may cap the hard limit)
        import resource

        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        except (ValueError, OSError):
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    def prepare():  # in the child, before it runs the command: its limit and cgroup
        if nofile:
            limit()
        if cgroup is not None:
            cgroup.join()

    return subprocess.Popen(["ip", "netns", "exec", ns, *args], stdout=out, stderr=out,
                            stdin=stdin, start_new_session=True,
                            preexec_fn=prepare if nofile or cgroup is not None else None)


def wait_port(ns: str, host: str, port: int, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    probe = f"import socket; socket.create_connection(('{host}', {port}), 1).close()"
    while sh(sys.executable, "-c", probe, ns=ns, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not listen on {host}:{port}")
        time.sleep(0.2)
