"""A real hardened sandbox container from the Debian-built image, checked from inside."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from appliance.sandbox import confinement, hardening, image, seccomp
from appliance.sandbox.podman import PodmanError

NAME = "corral-e2e-hardened"


@pytest.fixture(scope="module")
def container(podman, sandbox_image, tmp_path_factory):
    work = tmp_path_factory.mktemp("work")
    (work / "README").write_text("the project\n")
    os.chown(work, image_host_id(1000), image_host_id(1000))
    podman.run("rm", "--force", "--ignore", NAME)
    confined = confinement.install(tmp_path_factory.mktemp("sandbox-state"))
    spec = hardening.Sandbox(name=NAME, image=sandbox_image, network=None, gateway=None,
                             seccomp_profile=str(confined.profile), init=str(confined.init),
                             volumes=((str(work), "/work"),))
    started = time.monotonic()
    podman.run("run", *hardening.run_arguments(spec, ["sleep", "600"]))
    print(f"hardened podman run: {time.monotonic() - started:.2f}s")
    yield spec
    podman.remove_container(NAME)


def image_host_id(inside: int) -> int:
    return hardening.Sandbox.userns_base + inside


def inside(podman, *command: str, check: bool = True):
    return podman.run("exec", NAME, *command, check=check)


def test_not_root_no_capabilities_no_new_privileges(podman, container):
    assert inside(podman, "id", "-u").stdout.strip() == b"1000"
    status = inside(podman, "cat", "/proc/self/status").stdout.decode()
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["CapEff"].strip() == "0000000000000000"
    assert fields["CapPrm"].strip() == "0000000000000000"
    assert fields["CapBnd"].strip() == "0000000000000000"
    assert fields["NoNewPrivs"].strip() == "1"


def test_user_namespace_maps_the_agent_away_from_host_ids(podman, container):
    pid = podman.json("inspect", NAME)[0]["State"]["Pid"]
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    host_uids = {Path(f"/proc/{c}/status").read_text().split("Uid:")[1].split()[0]
                 for c in children}
    assert host_uids == {str(image_host_id(1000))}


def test_root_is_read_only_and_tmp_is_a_small_tmpfs(podman, container):
    for path in ("/x", "/etc/x", "/usr/local/bin/x"):
        assert inside(podman, "touch", path, check=False).returncode != 0
    assert inside(podman, "touch", "/tmp/ok").returncode == 0
    mounts = inside(podman, "cat", "/proc/mounts").stdout.decode()
    assert any(line.split()[1] == "/tmp" and line.split()[2] == "tmpfs" and "size=1048576k"
               in line for line in mounts.splitlines())


def test_init_is_pid_1_and_limits_are_set(podman, container):
    assert inside(podman, "cat", "/proc/1/comm").stdout.strip() in (b"catatonit", b"tini",
                                                                     b"podman-init")
    limits = podman.json("inspect", NAME)[0]["HostConfig"]
    assert limits["Memory"] == 4 * 1024**3 and limits["PidsLimit"] == 2048


def test_no_container_engine_socket_is_reachable(podman, container):
    for socket_path in ("/run/podman/podman.sock", "/var/run/docker.sock",
                        "/run/containerd/containerd.sock", "/var/run/podman/podman.sock"):
        assert inside(podman, "test", "-e", socket_path, check=False).returncode != 0


def test_workspace_is_mounted_and_writable(podman, container):
    assert inside(podman, "cat", "/work/README").stdout == b"the project\n"
    assert inside(podman, "touch", "/work/new-file").returncode == 0


def test_image_carries_the_toolbox_and_the_selftest(podman, container):
    for tool in ("git", "curl", "python3", "node", "npm", "rg", "jq", "ssh", "make", "gcc"):
        assert inside(podman, "sh", "-c", f"command -v {tool}").returncode == 0, tool
    assert b"Probe every bypass class" in inside(podman, "corral-selftest", "--help").stdout
    assert b"usage: corral-request" in inside(podman, "corral-request", "--help").stdout
    labels = podman.json("image", "inspect", image.IMAGE)[0]["Labels"]
    assert labels["io.corral.version"] == image.VERSION


def test_podman_errors_carry_podmans_words(podman):
    with pytest.raises(PodmanError, match=r"no such container|no container with name"):
        podman.run("exec", "corral-e2e-does-not-exist", "true")


# -- the kernel's surface (issue 14, C15): what corral's seccomp profile and init refuse ----

# Each call runs in a child of its own (a call that succeeds, as on a laxer profile, cannot
# change what the next one meets); the child's exit status is 0 or the errno. A clone that
# succeeds makes a grandchild, which leaves at once.
SYSCALLS = r"""
import ctypes, errno, json, os, platform, sys
NUMBERS = {
    "x86_64": dict(clone=56, unshare=272, setns=308, mount=165, umount2=166, pivot_root=155,
                   keyctl=250, add_key=248, request_key=249, bpf=321, perf_event_open=298,
                   userfaultfd=323, clone3=435, io_uring_setup=425, open_tree=428,
                   move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
                   mount_setattr=442, syslog=103, open_by_handle_at=304),
    "aarch64": dict(clone=220, unshare=97, setns=268, mount=40, umount2=39, pivot_root=41,
                    keyctl=219, add_key=217, request_key=218, bpf=280, perf_event_open=241,
                    userfaultfd=282, clone3=435, io_uring_setup=425, open_tree=428,
                    move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
                    mount_setattr=442, syslog=116, open_by_handle_at=265),
}[platform.machine()]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
results = {}
for label, name, *args in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        result = libc.syscall(NUMBERS[name], *[ctypes.c_long(a) for a in args])
        number = ctypes.get_errno()
        if name == "clone" and result == 0:
            os._exit(0)
        if name == "clone" and result > 0:
            os.waitpid(result, 0)
        os._exit(0 if result >= 0 else number)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    results[label] = "ok" if status == 0 else errno.errorcode.get(status, str(status))
print(json.dumps(results))
"""
SIGCHLD = 17
CLONE_FS, CLONE_FILES = 0x200, 0x400
CLONE_NEWUSER = seccomp.NAMESPACE_FLAGS["CLONE_NEWUSER"]


def test_podman_takes_corrals_profile_and_the_kernel_applies_it(podman, container):
    host_config = podman.json("inspect", NAME)[0]["HostConfig"]
    assert f"seccomp={container.seccomp_profile}" in host_config["SecurityOpt"]
    status = inside(podman, "cat", "/proc/self/status").stdout.decode()
    assert "\nSeccomp:\t2\n" in status  # a filter, in every process of the session


def syscalls(podman, *calls: tuple) -> dict[str, str]:
    """{label: "ok" or the errno's name} for each (label, syscall, *args), from inside."""
    result = inside(podman, "python3", "-c", SYSCALLS, json.dumps(calls))
    return json.loads(result.stdout)


def test_no_user_namespace_and_no_other_namespace_through_one(podman, container):
    for command in (["unshare", "-r", "id"], ["unshare", "-U", "true"],
                    ["unshare", "-m", "true"], ["unshare", "-n", "true"],
                    ["unshare", "-r", "-m", "true"], ["unshare", "-r", "-n", "true"],
                    ["unshare", "-r", "-p", "-f", "true"]):
        result = inside(podman, *command, check=False)
        assert result.returncode != 0, command
        assert b"Operation not permitted" in result.stderr, (command, result.stderr)
        assert b"uid=0" not in result.stdout


def test_clone_and_unshare_refuse_every_namespace_flag(podman, container):
    calls = []
    for flag, bit in seccomp.NAMESPACE_FLAGS.items():
        calls.append((f"unshare {flag}", "unshare", bit))
        calls.append((f"unshare NEWUSER|{flag}", "unshare", CLONE_NEWUSER | bit))
        if flag in seccomp.CLONE_NAMESPACE_FLAGS:
            calls.append((f"clone NEWUSER|{flag}", "clone", CLONE_NEWUSER | bit | SIGCHLD,
                          0, 0, 0, 0))
    calls.append(("clone NEWUSER, upper half set", "clone",
                  (1 << 40) | CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0))
    assert syscalls(podman, *calls) == {label: "EPERM" for label, *_ in calls}


def test_threads_fork_and_unshare_of_files_still_work_and_clone3_is_enosys(podman, container):
    assert syscalls(podman, ("fork", "clone", SIGCHLD, 0, 0, 0, 0),
                    ("unshare files", "unshare", CLONE_FILES),
                    ("unshare fs", "unshare", CLONE_FS),
                    ("clone3", "clone3", 0, 0)) == {
        "fork": "ok", "unshare files": "ok", "unshare fs": "ok", "clone3": "ENOSYS"}
    # glibc creates threads with clone3 and falls back to clone on ENOSYS
    threads = inside(podman, "python3", "-c", "import threading; t = threading.Thread("
                     "target=print, args=('thread ran',)); t.start(); t.join()")
    assert threads.stdout == b"thread ran\n"


def test_setns_the_mount_family_and_the_keyrings_are_refused(podman, container):
    # zero arguments: the kernel itself would answer EFAULT or EINVAL; EPERM is seccomp's,
    # before the kernel reads a single argument
    names = ["setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen",
             "fsconfig", "fsmount", "fspick", "mount_setattr", "keyctl", "add_key",
             "request_key"]
    assert syscalls(podman, *[(n, n, 0, 0, 0, 0, 0) for n in names]) == dict.fromkeys(
        names, "EPERM")
    mount = inside(podman, "mount", "-t", "tmpfs", "none", "/tmp", check=False)
    assert mount.returncode != 0


def test_bpf_perf_userfaultfd_syslog_handles_and_io_uring_are_refused(podman, container):
    names = ["bpf", "perf_event_open", "userfaultfd", "syslog", "open_by_handle_at"]
    calls = [(n, n, 0, 0, 0, 0, 0) for n in names]
    calls.append(("userfaultfd user-mode only", "userfaultfd", 1))  # UFFD_USER_MODE_ONLY
    calls.append(("io_uring_setup", "io_uring_setup", 1, 0))
    assert syscalls(podman, *calls) == {
        **{label: "EPERM" for label, *_ in calls}, "io_uring_setup": "ENOSYS"}


TRACE = r"""
import ctypes, errno, json, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_SEIZE = 0x4206  # seize, not attach: a tracee is never stopped, whatever happens
def seize(pid):
    if libc.ptrace(PTRACE_SEIZE, pid, 0, 0) == 0:
        return "ok"
    return errno.errorcode[ctypes.get_errno()]
out = {"pid 1": seize(1)}
try:
    open("/proc/1/mem", "rb").close()
    out["/proc/1/mem"] = "ok"
except OSError as exc:
    out["/proc/1/mem"] = errno.errorcode[exc.errno]
child = subprocess.Popen(["sleep", "60"])
out["own child"] = seize(child.pid)
child.kill()
for pid in map(int, sys.argv[1:]):
    out[f"host {pid}"] = ("visible" if os.path.exists(f"/proc/{pid}") else "") + seize(pid)
print(json.dumps(out))
"""


def test_pid_1_and_every_process_outside_the_session_cannot_be_traced(podman, container):
    state = podman.json("inspect", NAME)[0]["State"]
    outside = [state["ConmonPid"], state["Pid"], os.getpid(), 1 + max(
        int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())]
    traced = json.loads(inside(podman, "python3", "-c", TRACE, *map(str, outside)).stdout)
    assert traced.pop("pid 1") == "EPERM"  # the init is exec-only, so not dumpable
    assert traced.pop("/proc/1/mem") == "EACCES"
    # a host PID is no PID in the session's namespace (if the number exists in there, it is
    # one of the session's own processes, traced as such, never the host's)
    assert traced.pop("own child") == ("ok" if yama_scope() < 2 else "EPERM")
    assert traced == {f"host {pid}": "ESRCH" for pid in outside}


def yama_scope() -> int:
    path = Path("/proc/sys/kernel/yama/ptrace_scope")
    return int(path.read_text()) if path.exists() else 0


def test_proc_sys_cannot_be_written(podman, container):
    for key in ("net/ipv4/ip_forward", "kernel/hostname", "net/ipv4/ping_group_range",
                "vm/overcommit_memory"):
        result = inside(podman, "sh", "-c", f"echo 1 > /proc/sys/{key}", check=False)
        assert result.returncode != 0, key
        assert b"Read-only file system" in result.stderr, (key, result.stderr)


SOCKETS = r"""
import errno, json, socket
out = {}
for label, family, kind, proto in [
        ("icmp echo", socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP),
        ("raw", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
        ("raw tcp", socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP),
        ("raw v6", socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6),
        ("packet", socket.AF_PACKET, socket.SOCK_RAW, 0x0300),
        ("packet dgram", socket.AF_PACKET, socket.SOCK_DGRAM, 0x0300)]:
    try:
        socket.socket(family, kind, proto).close()
        out[label] = "ok"
    except OSError as exc:
        out[label] = errno.errorcode[exc.errno]
print(json.dumps(out))
"""


def test_raw_and_packet_sockets_are_refused_and_an_icmp_echo_socket_opens(podman, container):
    assert json.loads(inside(podman, "python3", "-c", SOCKETS).stdout) == {
        "icmp echo": "ok", "raw": "EPERM", "raw tcp": "EPERM", "raw v6": "EPERM",
        "packet": "EPERM", "packet dgram": "EPERM"}
    assert inside(podman, "cat", "/proc/sys/net/ipv4/ping_group_range").stdout.split() == [
        b"0", str(hardening.USERNS_SIZE - 1).encode()]


TOOLBOX = r"""
set -eu
export HOME=/tmp/toolbox-home GIT_AUTHOR_NAME=a GIT_AUTHOR_EMAIL=a@b.c
export GIT_COMMITTER_NAME=a GIT_COMMITTER_EMAIL=a@b.c
mkdir -p "$HOME" /tmp/toolbox && cd /tmp/toolbox
cat > main.c <<'C'
#include <pthread.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>
static void *work(void *arg) { return arg; }
int main(void) {
    pthread_t t; void *r;
    pthread_create(&t, 0, work, "threaded"); pthread_join(t, &r);
    pid_t pid = fork(); if (pid == 0) _exit(3);
    int status; waitpid(pid, &status, 0);
    printf("%s, child %d\n", (char *)r, WEXITSTATUS(status));
    return 0;
}
C
printf 'main: main.c\n\tgcc -pthread -o main main.c\n' > Makefile
make -s && ./main
python3 - <<'PY'
import multiprocessing, threading, concurrent.futures
def square(n):
    return n * n
if __name__ == "__main__":
    with multiprocessing.Pool(2) as pool:
        print("pool", sum(pool.map(square, range(10))))
    with concurrent.futures.ThreadPoolExecutor(4) as threads:
        print("threads", sum(threads.map(square, range(10))))
PY
python3 -m venv venv && venv/bin/python -m pip --version | cut -d' ' -f1
node -e '
const { Worker } = require("worker_threads");
const { execFileSync } = require("child_process");
new Worker("require(\"worker_threads\").parentPort.postMessage(6 * 7)", { eval: true })
  .on("message", (m) => console.log("worker", m,
                                    execFileSync("echo", ["child"]).toString().trim()));
'
npm --version >/dev/null && echo npm
git init -q origin && git -C origin commit -q --allow-empty -m first
git clone -q origin clone && cd clone && echo x > file && git add file
git commit -q -m second && git log --oneline | wc -l
mkdir -p tests && cat > tests/test_it.py <<'PY'
import unittest
class T(unittest.TestCase):
    def test_it(self):
        self.assertTrue(True)
PY
python3 -m unittest discover -s tests 2>&1 | tail -1
if python3 -c 'import pytest' 2>/dev/null; then python3 -m pytest -q tests | tail -1; fi
ssh -o BatchMode=yes -o ConnectTimeout=5 -o StrictHostKeyChecking=no -p 1 agent@127.0.0.1 \
  true 2>&1 | grep -o 'Connection refused'
"""


def test_the_agents_toolbox_works_under_the_profile(podman, container):
    result = inside(podman, "bash", "-c", TOOLBOX, check=False)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    lines = result.stdout.decode().split("\n")
    assert lines[:8] == ["threaded, child 3", "pool 285", "threads 285", "pip",
                         "worker 42 child", "npm", "2", "OK"], result.stdout
    assert lines[-2] == "Connection refused"
