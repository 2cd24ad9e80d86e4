"""The VM tier: a real Debian 12 VM under QEMU (TCG: nested KVM hangs on these machines),
built from Debian packages by `corral box build`'s image builder and provisioned by the real
playbooks over SSH. Every step has a timeout; every VM started is stopped.

The image and the sandbox image archive are kept in CORRAL_VM_CACHE (default
/var/tmp/corral-vm) between runs on one machine; CI machines start without them.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CACHE = Path(os.environ.get("CORRAL_VM_CACHE", "/var/tmp/corral-vm"))


def _need_root_and_tools():
    if os.geteuid() != 0:
        pytest.skip("the VM tier needs root (loop devices for the image): run scripts/test "
                    "as root")
    for tool in ("qemu-system-x86_64", "qemu-img", "mmdebstrap", "extlinux", "podman"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is missing: scripts/setup installs the VM tier's packages")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def timed(label: str, argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run one step with its own timeout, print how long it took, keep its output."""
    started = time.monotonic()
    if "stdout" not in kwargs:
        kwargs["stdout"] = subprocess.PIPE
    result = subprocess.run(argv, stderr=subprocess.PIPE, text=True, timeout=timeout, **kwargs)
    print(f"vm: {label}: {time.monotonic() - started:.0f}s (exit {result.returncode})")
    return result


@pytest.fixture(scope="session")
def vm_image() -> Path:
    """The qcow2 `corral box build` makes (the appliance's packages and the sandbox images
    baked in), with this run's SSH key and Vagrant's."""
    _need_root_and_tools()
    from cli import box

    CACHE.mkdir(parents=True, exist_ok=True)
    key = CACHE / "id_test"
    if not key.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key), "-C",
                        "corral-vm-test"], check=True)
    image = CACHE / "debian12.qcow2"
    if not image.exists():
        keys = [Path(p) for p in sorted(glob.glob(box.INSECURE_KEYS))[-1:]]
        started = time.monotonic()
        archive = box.sandbox_archive(CACHE, progress=print)
        box.build_image(CACHE, [key.with_suffix(".pub"), *keys], progress=print,
                        sandbox_images=archive)
        archive.unlink()
        print(f"vm: image built in {time.monotonic() - started:.0f}s")
    return image


@dataclass
class Vm:
    ssh_port: int
    api_port: int
    key: Path
    directory: Path
    process: subprocess.Popen

    def ssh(self, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return timed(f"ssh {command[:40]}", [
            "ssh", "-q", "-i", str(self.key), "-p", str(self.ssh_port),
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "ConnectTimeout=5", "vagrant@127.0.0.1", command], timeout)

    def inventory(self) -> Path:
        path = self.directory / "inventory.ini"
        path.write_text(
            f"corral-vm ansible_host=127.0.0.1 ansible_port={self.ssh_port} "
            f"ansible_user=vagrant ansible_ssh_private_key_file={self.key}\n")
        return path


@pytest.fixture(scope="module")
def vm(vm_image, tmp_path_factory):
    """A fresh VM from an overlay on the image; SSH and the API forwarded to 127.0.0.1."""
    directory = tmp_path_factory.mktemp("vm")
    disk = directory / "disk.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(vm_image), "-F",
                    "qcow2", str(disk)], check=True)
    ssh_port, api_port = free_port(), free_port()
    process = subprocess.Popen([
        "qemu-system-x86_64", "-name", "corral-vm-test", "-accel", "tcg,thread=multi",
        "-cpu", "max", "-smp", "2", "-m", "2048", "-nodefaults", "-display", "none",
        "-drive", f"file={disk},if=virtio,format=qcow2,cache=unsafe",
        "-netdev", f"user,id=n0,hostfwd=tcp:127.0.0.1:{ssh_port}-:22,"
                   f"hostfwd=tcp:127.0.0.1:{api_port}-:8443",
        "-device", "virtio-net-pci,netdev=n0",
        "-serial", f"file:{directory / 'console.log'}"], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    machine = Vm(ssh_port, api_port, CACHE / "id_test", directory, process)
    try:
        started = time.monotonic()
        while machine.ssh("true", timeout=30).returncode != 0:
            assert process.poll() is None, "qemu exited: " + _tail(directory / "console.log")
            assert time.monotonic() - started < 600, "no SSH after 600s: " + _tail(
                directory / "console.log")
            time.sleep(2)
        print(f"vm: SSH answers after {time.monotonic() - started:.0f}s")
        yield machine
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-20:])
    return "(no console log)"


RECAP = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)",
                   re.MULTILINE)


def recap(output: str) -> dict[str, int]:
    """The PLAY RECAP line's counters (one host)."""
    found = RECAP.findall(output)
    assert found, "no PLAY RECAP in:\n" + output[-3000:]
    _, ok, changed, unreachable, failed = found[-1]
    return {"ok": int(ok), "changed": int(changed), "unreachable": int(unreachable),
            "failed": int(failed)}


def playbook(name: str, vm: Vm, config_home: Path, timeout: float, **extra):
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "playbooks" / "ansible.cfg"),
           "XDG_CONFIG_HOME": str(config_home), "ANSIBLE_FORCE_COLOR": "0",
           "PATH": f"{BIN}:{os.environ['PATH']}"}
    argv = [str(BIN / "ansible-playbook"), "-i", str(vm.inventory()),
            str(ROOT / "playbooks" / name)]
    for key, value in extra.items():
        argv += ["-e", f"{key}={value}" if isinstance(value, str) else json.dumps({key: value})]
    log = vm.directory / f"{name}.log"  # tail it to watch a run
    print(f"vm: {name}: output in {log}")
    with open(log, "w") as out:
        result = timed(name, argv, timeout, env=env, cwd=ROOT, stdout=out)
    result.stdout = log.read_text()
    return result
