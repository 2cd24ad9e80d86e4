"""The workers' seccomp filter: its program run by a reader of the four instructions it uses
(every call it names, and ones it does not), then loaded by the kernel in a process of its
own, which tries what a taken-over worker would."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest

from appliance.filter.workers import jail

PID = 4242


def run(code: bytes, nr: int, args: tuple[int, ...] = (), arch: int = jail.AUDIT_ARCH_X86_64
        ) -> int:
    """What the kernel's seccomp does with `code` for one call: struct seccomp_data packed
    as it lays it out, then the program, instruction by instruction."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    program = [struct.unpack_from("=HBBI", code, at) for at in range(0, len(code), 8)]
    accumulator, pc = 0, 0
    while True:
        op, true, false, k = program[pc]
        if op == jail.LD_ABS_W:
            accumulator = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif op == jail.RET:
            return k
        else:
            taken = {jail.JEQ: accumulator == k, jail.JGE: accumulator >= k,
                     jail.JSET: bool(accumulator & k)}[op]
            pc += 1 + (true if taken else false)


CODE = jail.program(jail.X86_64, PID)
EPERM, EACCES = jail.ERRNO | errno.EPERM, jail.ERRNO | errno.EACCES


def test_the_program_fits_the_kernel():
    assert len(CODE) % 8 == 0 and len(CODE) // 8 < 4096  # BPF_MAXINSNS


@pytest.mark.parametrize("name", sorted(jail.X86_64["refused"]))
def test_each_refused_call_is_refused(name):
    assert run(CODE, jail.X86_64["refused"][name]) == EPERM


def test_calls_it_does_not_name_are_allowed():
    for nr in (0, 1, 3, 9, 44, 45, 46, 47, 49, 232, 281, 288, 319):  # read write close mmap ..
        assert run(CODE, nr) == jail.ALLOW, nr


def test_clone3_is_absent_so_threads_start_with_clone():
    assert run(CODE, 435) == jail.ERRNO | errno.ENOSYS
    assert run(CODE, 56, (0x3D0F00,)) == jail.ALLOW  # glibc's pthread_create flags
    assert run(CODE, 56, (17,)) == EPERM  # fork: SIGCHLD alone


def test_sockets_of_ipv4_and_ipv6_only():
    socket_nr = jail.X86_64["socket"]
    assert run(CODE, socket_nr, (2, 1)) == jail.ALLOW
    assert run(CODE, socket_nr, (10, 2)) == jail.ALLOW
    for family in (1, 16, 17, 38, 40):  # unix, netlink, packet, alg, vsock
        assert run(CODE, socket_nr, (family, 1)) == jail.ERRNO | errno.EAFNOSUPPORT


def test_files_are_opened_for_reading_only():
    for nr, at in ((jail.X86_64["open"], 1), (jail.X86_64["openat"], 2)):
        def opened(flags, nr=nr, at=at):
            args = [0, 0, 0]
            args[at] = flags
            return run(CODE, nr, tuple(args))

        assert opened(os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_DIRECTORY) == \
            jail.ALLOW
        for flags in (os.O_WRONLY, os.O_RDWR, os.O_CREAT, os.O_TRUNC, os.O_APPEND,
                      os.O_TMPFILE | os.O_RDWR):
            assert opened(flags) == EACCES, flags


def test_signals_go_to_the_worker_itself_only():
    for name in ("kill", "tgkill"):
        assert run(CODE, jail.X86_64[name], (PID, 10)) == jail.ALLOW
        assert run(CODE, jail.X86_64[name], (1, 10)) == EPERM
        assert run(CODE, jail.X86_64[name], (0, 10)) == EPERM  # its process group
        assert run(CODE, jail.X86_64[name], ((1 << 32) - 1, 9)) == EPERM  # -1: everyone


def test_other_abis_and_architectures_are_not_let_through():
    assert run(CODE, jail.X32_SYSCALL_BIT | 41, (1, 1)) == EPERM  # x32's socket
    assert run(CODE, 0, arch=0x40000003) == jail.KILL_PROCESS  # i386
    assert run(CODE, 5, arch=0x40000003) == jail.KILL_PROCESS  # i386's open


PROBE = textwrap.dedent("""
    import asyncio, json, os, socket, sys, threading
    from appliance.filter.workers.confine import drop_capabilities
    from appliance.filter.workers import jail
    drop_capabilities()
    jail.lock()
    done = {}
    def attempt(name, act):
        try:
            act()
            done[name] = "ok"
        except OSError as exc:
            done[name] = exc.errno
    def thread():
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
    attempt("unix socket", lambda: socket.socket(socket.AF_UNIX))
    attempt("netlink socket", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0))
    attempt("tcp socket", lambda: socket.socket().close())
    attempt("udp6 socket", lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close())
    attempt("socket pair", lambda: [s.close() for s in socket.socketpair()])
    attempt("write", lambda: open(sys.argv[1], "w"))
    attempt("append", lambda: open(sys.argv[1], "a"))
    attempt("read", lambda: open("/proc/self/status").read())
    attempt("mkdir", lambda: os.mkdir(sys.argv[1] + ".d"))
    attempt("signal parent", lambda: os.kill(os.getppid(), 0))
    attempt("signal self", lambda: os.kill(os.getpid(), 0))
    attempt("fork", os.fork)
    attempt("exec", lambda: os.execv("/bin/true", ["true"]))
    attempt("memfd", lambda: os.close(os.memfd_create("leaf")))
    attempt("thread", thread)
    attempt("asyncio loop", lambda: asyncio.new_event_loop().close())
    attempt("uvloop loop", lambda: __import__("uvloop").new_event_loop().close())
    print(json.dumps(done))
""")


def test_the_kernel_loads_it_and_a_confined_process_does_only_what_a_worker_needs(tmp_path):
    target = tmp_path / "planted"
    done = subprocess.run([sys.executable, "-c", PROBE, str(target)], capture_output=True,
                          text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == {
        "unix socket": errno.EAFNOSUPPORT, "netlink socket": errno.EAFNOSUPPORT,
        "tcp socket": "ok", "udp6 socket": "ok", "socket pair": "ok", "write": errno.EACCES,
        "append": errno.EACCES, "read": "ok", "mkdir": errno.EPERM,
        "signal parent": errno.EPERM, "signal self": "ok", "fork": errno.EPERM,
        "exec": errno.EPERM, "memfd": "ok", "thread": "ok", "asyncio loop": "ok",
        "uvloop loop": "ok"}
    assert not target.exists() and not (tmp_path / "planted.d").exists()
