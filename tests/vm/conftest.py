"""The VM tier: a real Debian 13 VM under QEMU (TCG: nested KVM hangs on these machines),
from the box `corral box build` makes of Debian packages, brought up by `corral up` (the real
Vagrantfile, vagrant-libvirt) and provisioned by the real playbooks. Every step has a
timeout; every VM started is destroyed.

The image and the sandbox image archive are kept in CORRAL_VM_CACHE (default
/var/tmp/corral-vm) between runs on one machine; CI machines start without them.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import pool

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
    image = CACHE / box.IMAGE
    # an image made by another recipe is made again (the wheel it holds is brought current
    # by provisioning; what the recipe bakes, such as no SSH host keys, is not)
    recipe = hashlib.sha256(Path(box.__file__).read_bytes()).hexdigest()
    stamp = CACHE / f"{box.IMAGE}.recipe"
    if image.exists() and (not stamp.exists() or stamp.read_text() != recipe):
        print(f"vm: {image} was made by another cli/box.py: made again")
        image.unlink()
    if not image.exists():
        keys = [Path(p) for p in sorted(glob.glob(box.INSECURE_KEYS))[-1:]]
        started = time.monotonic()
        archive = box.sandbox_archive(CACHE, progress=print)
        box.build_image(CACHE, [key.with_suffix(".pub"), *keys], progress=print,
                        sandbox_images=archive)
        archive.unlink()
        stamp.write_text(recipe)
        print(f"vm: image built in {time.monotonic() - started:.0f}s")
    # what the box holds, recorded beside it: every package with its version and
    # architecture (the appliance's own among them), and the sandbox images' ids
    record = json.loads((CACHE / f"{box.RELEASE}.json").read_text())
    assert {"nftables", "podman", "python3", "linux-image-cloud-amd64"} <= set(
        record["packages"]), sorted(record["packages"])[:20]
    assert sorted(record["images"]) == sorted(box.SANDBOX_IMAGES), record["images"]
    return image


RECAP = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)",
                   re.MULTILINE)


def recap(output: str) -> dict[str, int]:
    """The PLAY RECAP line's counters (one host)."""
    found = RECAP.findall(output)
    assert found, "no PLAY RECAP in:\n" + output[-3000:]
    _, ok, changed, unreachable, failed = found[-1]
    return {"ok": int(ok), "changed": int(changed), "unreachable": int(unreachable),
            "failed": int(failed)}


def recaps(output: str) -> dict[str, dict[str, int]]:
    """The PLAY RECAP's counters, per host."""
    found = RECAP.findall(output)
    assert found, "no PLAY RECAP in:\n" + output[-3000:]
    return {host: {"ok": int(ok), "changed": int(changed), "unreachable": int(unreachable),
                   "failed": int(failed)} for host, ok, changed, unreachable, failed in found}


def playbook(name: str, inventory: Path, config_home: Path, log_dir: Path, timeout: float,
             limit: str | None = None, **extra):
    """ansible-playbook as on any Debian 13 host: an inventory, the repository's config."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "playbooks" / "ansible.cfg"),
           "XDG_CONFIG_HOME": str(config_home), "ANSIBLE_FORCE_COLOR": "0",
           # each task, time-stamped
           "ANSIBLE_LOG_PATH": str(log_dir / f"{name}{'.' + limit if limit else ''}.timed.log"),
           "ANSIBLE_TASK_TIMEOUT": TASK_TIMEOUT,
           "PATH": f"{BIN}:{os.environ['PATH']}"}
    argv = [str(BIN / "ansible-playbook"), "-i", str(inventory), str(ROOT / "playbooks" / name)]
    if limit:
        argv += ["--limit", limit]
    for key, value in extra.items():  # JSON: a value may be a template, spaces and all
        argv += ["-e", json.dumps({key: value})]
    log = log_dir / f"{name}{'.' + limit if limit else ''}.log"  # tail it to watch a run
    print(f"vm: {name}: output in {log}")
    with open(log, "w") as out:
        result = timed(name, argv, timeout, env=env, cwd=ROOT, stdout=out)
    result.stdout = log.read_text()
    return result


STATE_ON_FAILURE = (
    "free -m; echo; sudo dmesg | grep -iE 'oom|killed process|out of memory' | tail -20; echo; "
    "ps -eo rss,pid,user,args --sort=-rss | head -25 | cut -c1-160; echo; "
    "systemctl --failed --no-legend; systemctl --no-legend list-units 'corral*'; echo; "
    "sudo journalctl -p warning -n 40 --no-pager -o short-monotonic | cut -c1-240")
"""What a failed VM test reports of the VM as it was: the CI log is all there is of a run on
another machine, and the VM is destroyed at the module's end."""


UP_TIMEOUT = 1500
"""Seconds `corral up --timeout` gives vagrant (booting and provisioning: 5 to 7 minutes
here): then corral stops vagrant's process group and says where it was."""
TASK_TIMEOUT = "600"
"""ANSIBLE_TASK_TIMEOUT for the tier's playbooks: the slowest task here takes 40 s. A task
that waits on a VM that stopped answering fails in this time instead of taking the run."""
STALLED_STATE = STATE_ON_FAILURE + (
    "; echo; uptime; systemctl list-jobs --no-legend --no-pager; echo; "
    "systemctl status corral-filter corral-sandbox corral-api --no-pager -n 30 | cut -c1-200")
STALLED = re.compile(r"did not finish within|UNREACHABLE!|expected time frame|"
                     r"Timed out while waiting for the machine to boot")
"""How a `corral up` that stalled ends (corral's own timeout, an ssh keepalive, Ansible's
task timeout, Vagrant's boot timeout): the failures tried once more."""
RETRIED: list[Path] = []
"""Each `corral up` that failed and was tried again, as what it left (CACHE/failures): the
run's summary names them, so a failure a second try got past is still seen."""


def up_with_one_more_try(appliance, name: str, argv: list[str],
                         ansible_log: Path) -> subprocess.CompletedProcess:
    """`corral up`, and once more from a new VM if it stalled. CI once saw provisioning stop
    for 45 minutes at one `systemctl start` (the VM did not answer; never seen here): a
    wedged guest under QEMU/TCG must not take the whole run. What the first try left is
    printed, kept under CACHE/failures and named in the summary; a second failure fails."""
    up = appliance.corral(*argv, timeout=UP_TIMEOUT + 120)
    vagrant_log = Path(appliance.env["XDG_CONFIG_HOME"], "corral", "appliances", name,
                       "vagrant.log")
    said = up.stderr + (vagrant_log.read_text() if vagrant_log.exists() else "")
    if up.returncode == 0 or not STALLED.search(said):
        return up  # a playbook's own failure fails at once, as it would a second time
    RETRIED.append(record_failed_up(appliance, name, up, ansible_log))
    appliance.corral("destroy", "--appliance", name, timeout=600)
    pool.remove_domain(f"corral-{name}-default")  # what vagrant's state no longer knew
    return appliance.corral(*argv, timeout=UP_TIMEOUT + 120)


def record_failed_up(appliance, name: str, up: subprocess.CompletedProcess,
                     ansible_log: Path) -> Path:
    """What a failed `corral up` left: its message, the playbook's last tasks, whether the
    guest's CPUs still ran (two samples of libvirt's counters) and the guest as ssh finds it."""
    lines = ansible_log.read_text().splitlines()[-40:] if ansible_log.exists() else []
    parts = [f"`corral up` exited {up.returncode}:", up.stderr[-4000:],
             f"the last tasks ({ansible_log}):", "\n".join(lines)]
    parts += host_side(appliance, name)
    try:
        state = appliance.ssh(STALLED_STATE, timeout=180)
        parts += ["the guest:", state.stdout[-12000:] + state.stderr[-2000:]]
    except subprocess.TimeoutExpired:
        parts += ["the guest:", "did not answer `corral ssh` within 180 s"]
    path = CACHE / "failures" / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-up.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n")
    print("\n".join(parts))
    return path


def host_side(appliance, name: str) -> list[str]:
    """The VM as this host sees it, for a VM that stopped answering (CI once saw one go
    silent, "exit 255" in 3 s, between two steps of a test): whether its CPUs still ran
    and why libvirt says it is in its state (two samples of its counters; a full disk
    pauses it), whether its address takes a TCP connection, QEMU's own last words, and
    this host's disk, memory and OOM kills."""
    parts = []
    for sample in (1, 2):
        stats = subprocess.run(["virsh", "-c", "qemu:///system", "domstats", "--state",
                                "--cpu-total", "--balloon", f"corral-{name}-default"],
                               capture_output=True, text=True, timeout=60)
        parts += [f"libvirt's counters, sample {sample}:", stats.stdout + stats.stderr]
        time.sleep(5)
    try:
        from cli import inventory

        kept = inventory.parse_ssh_config(
            (appliance.config_home / "corral" / "appliances" / name / "ssh_config").read_text())
        where = (kept["ansible_host"], int(kept["ansible_port"]))
        with socket.create_connection(where, timeout=10) as sock:
            banner = sock.recv(64)
        parts += [f"a TCP connection to {where}: {banner!r}"]
    except Exception as error:  # what it was is the finding
        parts += [f"a TCP connection to the VM's ssh: {error!r}"]
    qemu_log = Path(f"/var/log/libvirt/qemu/corral-{name}-default.log")
    if qemu_log.exists():
        parts += [f"{qemu_log}, its end:", "\n".join(qemu_log.read_text(
            errors="replace").splitlines()[-8:])]
    for argv in (["df", "-h", "/", str(CACHE), "/var/lib/libvirt/images"], ["free", "-m"],
                 ["sh", "-c", "dmesg | grep -iE 'oom|killed process|out of memory' | tail"]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        parts += [f"this host: {' '.join(argv)}", done.stdout + done.stderr]
    return parts


def pytest_terminal_summary(terminalreporter) -> None:
    for path in RETRIED:
        terminalreporter.section("vm: a `corral up` failed and was tried again", yellow=True)
        terminalreporter.line(f"what it left: {path}")
        for line in path.read_text().splitlines()[:80]:
            terminalreporter.line(line[:200])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    appliance = getattr(item, "funcargs", {}).get("appliance")
    if report.when != "call" or not report.failed or appliance is None:
        return
    try:
        state = appliance.ssh(STATE_ON_FAILURE, timeout=120)
        report.sections.append(("the appliance when the test failed",
                                state.stdout[-8000:] + state.stderr[-2000:]))
        if state.returncode != 0:  # the VM itself: paused, crashed, off the network?
            report.sections.append(("the VM as its host sees it",
                                    "\n".join(host_side(appliance, appliance.directory.name))))
    except Exception as error:  # a report of the failure must not hide the failure
        report.sections.append(("the appliance when the test failed", f"unreadable: {error!r}"))
