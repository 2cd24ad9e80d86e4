"""The kernel group: system calls a sandbox must be refused (T22), meaningful only inside a
real session's container (on a host, as root, they would work).

Each attempt runs in a child process of its own (whatever it manages to change dies with
it), calls the kernel directly (ctypes, libc's syscall()), and reports (return, errno).
Refused means an errno of REFUSED; success is the attack working; any other errno means
the probe cannot tell, which fails it (it is looked at, never assumed fine).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import selectors
import signal
import socket
import struct
import tempfile

from .registry import FAST, NotRun, Outcome, probe

REFUSED = {errno.EPERM, errno.EACCES, errno.ENOSYS, errno.EROFS}
SYSCALLS = {
    "x86_64": {"clone": 56, "ptrace": 101, "mount": 165, "umount2": 166, "add_key": 248,
               "keyctl": 250, "unshare": 272, "perf_event_open": 298, "bpf": 321,
               "userfaultfd": 323, "clone3": 435},
    "aarch64": {"umount2": 39, "mount": 40, "unshare": 97, "ptrace": 117, "add_key": 217,
                "keyctl": 219, "clone": 220, "perf_event_open": 241, "bpf": 280,
                "userfaultfd": 282, "clone3": 435},
}
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
HOST_PID_NAMESPACE = "pid:[4026531836]"  # the initial namespace's fixed inode (PROC_PID_INIT_INO)
KERNEL_RECORDS = "nothing on the network: the kernel refuses it"


def kernel_probe(id, what):
    return probe(id, 22, group="kernel", records=f"{KERNEL_RECORDS} ({what})")


@functools.cache
def _kernel():
    """(ctypes, libc, syscall numbers); NotRun where they cannot be had."""
    try:
        import ctypes
    except ImportError as exc:
        raise NotRun(f"no ctypes in this Python: {exc}") from None
    machine = os.uname().machine
    if machine not in SYSCALLS:
        raise NotRun(f"system call numbers are not known for {machine}")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
    except (OSError, AttributeError) as exc:
        raise NotRun(f"no libc to call the kernel with: {exc}") from None
    return ctypes, libc, SYSCALLS[machine]


def _sys(name, *args) -> tuple[int, int]:
    """syscall(name, args...) in this process: (return value, errno)."""
    ctypes, libc, numbers = _kernel()
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(numbers[name]), *args)
    return rc, ctypes.get_errno()


def _attempt(fn) -> tuple[int, int]:
    """fn() -> (return value, errno), run in a child process. NotRun if it could not try."""
    _kernel()  # fail here, not in the child, when ctypes or libc is missing
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running anything of the parent's
        try:
            os.close(read_end)
            rc, err = fn()
            report = {"rc": rc, "errno": err}
        except NotRun as exc:
            report = {"not_run": str(exc)}
        except BaseException as exc:
            report = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            os.write(write_end, json.dumps(report).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready = selectors.DefaultSelector()
        ready.register(read_end, selectors.EVENT_READ)
        data = os.read(read_end, 4096) if ready.select(FAST) else b""
        ready.close()
    finally:
        os.close(read_end)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    report = json.loads(data) if data else {"error": "the attempt gave no answer in time"}
    if "not_run" in report:
        raise NotRun(report["not_run"])
    if "error" in report:
        raise RuntimeError(report["error"])
    return report["rc"], report["errno"]


def judge_attempts(attempts: list[tuple[str, int, int]]) -> Outcome:
    """(what, return value, errno) of each attempt: passed when every one was refused."""
    parts, ok, unclear = [], True, False
    for what, rc, err in attempts:
        if rc >= 0:
            parts.append(f"{what}: DONE (returned {rc})")
            ok = False
        elif err in REFUSED:
            parts.append(f"{what}: {errno.errorcode.get(err, err)}")
        else:
            parts.append(f"{what}: {errno.errorcode.get(err, err)} (neither refused nor done)")
            ok, unclear = False, True
    detail = "; ".join(parts)
    if unclear:
        detail += "; the probe cannot tell whether the kernel would allow it"
    return Outcome(ok, detail)


def _clone_child(flags):
    """The raw clone(2): the child leaves at once; the parent reaps it."""
    ctypes = _kernel()[0]
    rc, err = _sys("clone", ctypes.c_ulong(flags | signal.SIGCHLD), None, None, None, None)
    if rc == 0:
        os._exit(0)
    if rc > 0:
        os.waitpid(rc, 0)
    return rc, err


def _clone3_child(flags):
    ctypes = _kernel()[0]
    args = ctypes.create_string_buffer(struct.pack("=8Q", flags, 0, 0, 0, signal.SIGCHLD, 0,
                                                   0, 0), 64)  # struct clone_args, version 0
    rc, err = _sys("clone3", args, ctypes.c_size_t(64))
    if rc == 0:
        os._exit(0)
    if rc > 0:
        os.waitpid(rc, 0)
    return rc, err


def _closing(rc_err):
    """A syscall that returns a descriptor: close it if the attack worked."""
    rc, err = rc_err
    if rc >= 0:
        os.close(rc)
    return rc, err


@kernel_probe("userns-unshare", "unshare(CLONE_NEWUSER), as `unshare -r` does")
def userns_unshare(ctx):
    ctypes = _kernel()[0]
    return judge_attempts([
        (f"unshare({name})", *_attempt(lambda f=flags: _sys("unshare", ctypes.c_int(f))))
        for name, flags in (("CLONE_NEWUSER", CLONE_NEWUSER),
                            ("CLONE_NEWUSER|CLONE_NEWNS", CLONE_NEWUSER | CLONE_NEWNS),
                            ("CLONE_NEWUSER|CLONE_NEWNET", CLONE_NEWUSER | CLONE_NEWNET))])


@kernel_probe("userns-clone", "clone and clone3 with CLONE_NEWUSER")
def userns_clone(ctx):
    return judge_attempts([
        ("clone(CLONE_NEWUSER)", *_attempt(lambda: _clone_child(CLONE_NEWUSER))),
        ("clone3(CLONE_NEWUSER)", *_attempt(lambda: _clone3_child(CLONE_NEWUSER)))])


@kernel_probe("mount", "mount a tmpfs")
def mount(ctx):
    ctypes = _kernel()[0]
    try:
        target = tempfile.mkdtemp(prefix="corral-selftest-mount-")
    except OSError as exc:
        raise NotRun(f"no directory to mount on: {exc}") from None

    def attempt():
        rc, err = _sys("mount", b"none", target.encode(), b"tmpfs", ctypes.c_ulong(0), None)
        if rc == 0:
            _sys("umount2", target.encode(), ctypes.c_int(2))  # MNT_DETACH
        return rc, err

    try:
        return judge_attempts([(f"mount tmpfs on {target}", *_attempt(attempt))])
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(target)


@kernel_probe("keyctl", "the kernel keyring: keyctl and add_key")
def keyctl(ctx):
    ctypes = _kernel()[0]
    return judge_attempts([
        ("keyctl(KEYCTL_JOIN_SESSION_KEYRING)",
         *_attempt(lambda: _sys("keyctl", ctypes.c_int(1), None))),
        ("add_key(user, process keyring)",
         *_attempt(lambda: _sys("add_key", b"user", b"corral-selftest", b"x", ctypes.c_size_t(1),
                                ctypes.c_int(-2))))])


@kernel_probe("bpf", "bpf(BPF_MAP_CREATE)")
def bpf(ctx):
    ctypes = _kernel()[0]
    attr = ctypes.create_string_buffer(struct.pack("=5I", 2, 4, 4, 1, 0), 72)  # an array map

    return judge_attempts([("bpf(BPF_MAP_CREATE)", *_attempt(
        lambda: _closing(_sys("bpf", ctypes.c_int(0), attr, ctypes.c_uint(72)))))])


@kernel_probe("perf-event-open", "perf_event_open on this process, user space only")
def perf_event_open(ctx):
    ctypes = _kernel()[0]
    raw = bytearray(112)  # struct perf_event_attr, PERF_ATTR_SIZE_VER5
    struct.pack_into("=IIQ", raw, 0, 1, 112, 0)  # PERF_TYPE_SOFTWARE, size, CPU_CLOCK
    struct.pack_into("=Q", raw, 40, 1 | 32 | 64)  # disabled, exclude_kernel, exclude_hv
    attr = ctypes.create_string_buffer(bytes(raw), 112)
    return judge_attempts([("perf_event_open(self, user space)", *_attempt(
        lambda: _closing(_sys("perf_event_open", attr, ctypes.c_int(0), ctypes.c_int(-1),
                              ctypes.c_int(-1), ctypes.c_ulong(8)))))])


@kernel_probe("userfaultfd", "userfaultfd, with and without UFFD_USER_MODE_ONLY")
def userfaultfd(ctx):
    ctypes = _kernel()[0]
    flags = os.O_CLOEXEC | os.O_NONBLOCK
    return judge_attempts([
        (what, *_attempt(lambda f=f: _closing(_sys("userfaultfd", ctypes.c_int(f)))))
        for what, f in (("userfaultfd()", flags),
                        ("userfaultfd(UFFD_USER_MODE_ONLY)", flags | 1))])


def _outside_processes() -> list[str]:
    """Evidence that this sandbox sees processes outside its session."""
    found = []
    with contextlib.suppress(OSError):
        if os.readlink("/proc/self/ns/pid") == HOST_PID_NAMESPACE:
            found.append("this sandbox is in the host's PID namespace")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            if f.readline().split() == ["Name:", "kthreadd"]:
                found.append(f"kthreadd (pid {pid}), a host kernel thread, is visible")
    return found


def _ptrace_child(request):
    ctypes = _kernel()[0]
    rc, err = _sys("ptrace", ctypes.c_long(request), ctypes.c_long(1), None, None)
    if rc == 0 and request == 16:  # attached and stopped it: let it go again
        with contextlib.suppress(OSError):
            os.waitpid(1, 0x40000000)  # __WALL
            _sys("ptrace", ctypes.c_long(17), ctypes.c_long(1), None, None)  # PTRACE_DETACH
            os.kill(1, signal.SIGCONT)
    return rc, err


@kernel_probe("ptrace-outside", "PTRACE_SEIZE and PTRACE_ATTACH to pid 1; /proc shows no "
              "process outside the session")
def ptrace_outside(ctx):
    # SEIZE first: it does not stop the target if it works; ATTACH too, in case a profile
    # filters the request number
    outcome = judge_attempts([(f"ptrace({name}, 1)", *_attempt(lambda r=request:
                                                                _ptrace_child(r)))
                              for name, request in (("PTRACE_SEIZE", 0x4206),
                                                    ("PTRACE_ATTACH", 16))])
    outside = _outside_processes()
    return Outcome(outcome.ok and not outside, "; ".join([outcome.detail, *outside]))


@kernel_probe("proc-sys-write", "opening /proc/sys and /proc/sysrq-trigger for writing")
def proc_sys_write(ctx):
    attempts = []
    for path in ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/hostname",
                 "/proc/sys/net/ipv4/ip_forward", "/proc/sysrq-trigger"):
        try:
            os.close(os.open(path, os.O_WRONLY))  # opened, not written: that is proof enough
            attempts.append((f"open {path} for writing", 0, 0))
        except FileNotFoundError:
            continue
        except OSError as exc:
            attempts.append((f"open {path} for writing", -1, exc.errno))
    if not attempts:
        raise NotRun("none of the /proc/sys files probed exists here")
    return judge_attempts(attempts)


def _socket_attempt(what, family, kind, protocol):
    try:
        socket.socket(family, kind, protocol).close()
        return what, 0, 0
    except OSError as exc:
        # a kernel without the family cannot be used either
        return what, -1, errno.EPERM if exc.errno == errno.EAFNOSUPPORT else exc.errno


@kernel_probe("raw-socket", "SOCK_RAW, IPv4 and IPv6")
def raw_socket(ctx):
    return judge_attempts([
        _socket_attempt("socket(AF_INET, SOCK_RAW)", socket.AF_INET, socket.SOCK_RAW,
                        socket.IPPROTO_ICMP),
        _socket_attempt("socket(AF_INET6, SOCK_RAW)", socket.AF_INET6, socket.SOCK_RAW,
                        socket.IPPROTO_ICMPV6)])


@kernel_probe("packet-socket", "AF_PACKET, raw and datagram")
def packet_socket(ctx):
    family = getattr(socket, "AF_PACKET", 17)
    return judge_attempts([
        _socket_attempt(f"socket(AF_PACKET, {name})", family, kind, socket.htons(0x0003))
        for name, kind in (("SOCK_RAW", socket.SOCK_RAW), ("SOCK_DGRAM", socket.SOCK_DGRAM))])

