"""Tier (b): one full `corral up` with the real Vagrantfile (vagrant-libvirt, QEMU/TCG), then
the CLI against the forwarded API: a session, a rule allowed and listed, a decision seen live
in `corral monitor`, `corral status` from libvirt and the API, and `corral destroy`."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from .conftest import BIN, CACHE, free_port, timed

pytestmark = pytest.mark.vm
NAME = "vagrant-test"


@pytest.fixture(scope="module")
def libvirtd():
    """libvirt's daemons; started by hand where PID 1 is not systemd (and stopped after)."""
    if shutil.which("vagrant") is None or shutil.which("libvirtd") is None:
        pytest.skip("vagrant and libvirt are missing: scripts/setup installs them")
    started = []
    for daemon in ("virtlogd", "virtlockd", "libvirtd"):
        if subprocess.run(["pgrep", "-x", daemon], capture_output=True).returncode != 0:
            Path("/run/libvirt").mkdir(exist_ok=True)
            subprocess.run([f"/usr/sbin/{daemon}", "-d"], check=True)
            started.append(daemon)
    for _ in range(60):
        if subprocess.run(["virsh", "-c", "qemu:///system", "version"],
                          capture_output=True).returncode == 0:
            break
        time.sleep(0.5)
    yield
    for daemon in reversed(started):
        subprocess.run(["pkill", "-x", daemon], check=False)


@pytest.fixture(scope="module")
def env(tmp_path_factory, vm_image, libvirtd):
    home = tmp_path_factory.mktemp("vagrant-home")
    values = {**os.environ, "XDG_CONFIG_HOME": str(home / "config"),
              "XDG_CACHE_HOME": str(CACHE / "xdg-cache"),
              "VAGRANT_HOME": str(CACHE / "vagrant.d"),
              "PATH": f"{BIN}:{os.environ['PATH']}"}
    # the box from the image the VM tier already built (`corral box build` keeps an image
    # that is there and only packages and adds it)
    box_dir = CACHE / "xdg-cache" / "corral" / "box"
    box_dir.mkdir(parents=True, exist_ok=True)
    if not (box_dir / "debian12.qcow2").exists():
        os.link(vm_image, box_dir / "debian12.qcow2")
    return values


def corral(env, *args, timeout=120, **kwargs) -> subprocess.CompletedProcess:
    return timed(f"corral {' '.join(args)[:50]}", [str(BIN / "corral"), *args], timeout,
                 env=env, **kwargs)


@pytest.fixture(scope="module")
def appliance(env):
    built = corral(env, "box", "build", timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    port = free_port()
    try:
        up = corral(env, "up", "--name", NAME, "--api-port", str(port), timeout=2700)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-5000:]
        phases = [line for line in up.stderr.splitlines() if line.startswith("corral: [")]
        print("\n".join(phases))
        assert any("provisioning with playbooks/site.yml" in p for p in phases), phases
        assert "next:" in up.stdout
        yield env
    finally:
        down = corral(env, "destroy", "--appliance", NAME, timeout=600)
        print(down.stdout, down.stderr)


def test_cli_against_the_forwarded_api(appliance, tmp_path):
    env = appliance
    (tmp_path / "README").write_text("a small project\n")
    status = corral(env, "status", "--appliance", NAME, "--json")
    assert status.returncode == 0, status.stderr
    state = json.loads(status.stdout)
    assert state["vm"]["state"] == "running" and state["filter"]["healthy"], state
    assert state["sandbox"]["image_present"], state

    run = corral(env, "run", "--appliance", NAME, "--name", "smoke", "--detach", timeout=600,
                 cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    allow = corral(env, "allow-http", "--appliance", NAME, "--session", "smoke",
                   "api.example.org")
    assert allow.returncode == 0, allow.stderr
    rules = corral(env, "rules", "--appliance", NAME, "--session", "smoke", "--json")
    assert any(r["rule"] == "api.example.org" for r in json.loads(rules.stdout)["rules"]), (
        rules.stdout)

    monitor = subprocess.Popen([str(BIN / "corral"), "monitor", "--appliance", NAME, "--json"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True)
    # a thread reads, so the wait ends at its deadline even when monitor prints nothing
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in monitor.stdout],
                              daemon=True)
    reader.start()
    try:
        time.sleep(3)
        # a denied name looked up inside the session, through `corral shell` (ssh to the VM)
        lookup = corral(env, "shell", "--appliance", NAME, "smoke", "--", "getent", "hosts",
                        "denied.example.net", timeout=300)
        assert lookup.returncode != 0  # refused: no address
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("denied.example.net" in s for s in seen):
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
        assert any("denied.example.net" in line for line in seen), seen[-5:]
    finally:
        monitor.terminate()
        monitor.wait(10)
        reader.join(10)  # it ends at EOF; then the pipe can be closed
        monitor.stdout.close()
    assert corral(env, "rm", "--appliance", NAME, "smoke", timeout=300).returncode == 0


def test_destroy_removes_the_domain(appliance):
    env = appliance
    destroyed = corral(env, "destroy", "--appliance", NAME, timeout=600)
    assert destroyed.returncode == 0, destroyed.stderr
    status = corral(env, "status", "--appliance", NAME, "--json")
    assert status.returncode != 0
    assert json.loads(status.stdout)["vm"]["state"] == "not created"
