"""The workers' seccomp filter: its program run by a reader of the four instructions it uses
(every call it names, and ones it does not), then loaded by the kernel in a process of its
own, which tries what a taken-over worker would."""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap

import pytest

from appliance.filter.workers import jail

PID = 4242


def execute(code: bytes, nr: int, args: tuple[int, ...] = (),
            arch: int = jail.AUDIT_ARCH_X86_64) -> tuple[int, int]:
    """What the kernel's seccomp does with `code` for one call: struct seccomp_data packed
    as it lays it out, then the program, instruction by instruction. (Its verdict, and how
    many instructions it took.)"""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    program = [struct.unpack_from("=HBBI", code, at) for at in range(0, len(code), 8)]
    accumulator, pc, steps = 0, 0, 0
    while True:
        op, true, false, k = program[pc]
        steps += 1
        if op == jail.LD_ABS_W:
            accumulator = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif op == jail.RET:
            return k, steps
        else:
            taken = {jail.JEQ: accumulator == k, jail.JGE: accumulator >= k,
                     jail.JSET: bool(accumulator & k)}[op]
            pc += 1 + (true if taken else false)


def run(code: bytes, nr: int, args: tuple[int, ...] = (), arch: int = jail.AUDIT_ARCH_X86_64
        ) -> int:
    return execute(code, nr, args, arch)[0]


def steps(code: bytes, nr: int) -> int:
    return execute(code, nr)[1]


CODE = jail.program(jail.X86_64, PID)
EPERM, EACCES = jail.ERRNO | errno.EPERM, jail.ERRNO | errno.EACCES


def test_the_program_fits_the_kernel():
    assert len(CODE) % 8 == 0 and len(CODE) // 8 < 4096  # BPF_MAXINSNS


@pytest.mark.parametrize("name", sorted(jail.X86_64["refused"]))
def test_each_refused_call_is_refused(name):
    assert run(CODE, jail.X86_64["refused"][name]) == EPERM


def test_calls_it_does_not_name_are_allowed():
    for nr in (0, 1, 3, 9, 44, 45, 46, 47, 50, 232, 281, 288, 319):  # read write close mmap ..
        assert run(CODE, nr) == jail.ALLOW, nr


def test_calls_newer_than_the_table_are_absent():
    assert run(CODE, jail.X86_64["newest"] + 1) == jail.ERRNO | errno.ENOSYS
    assert run(CODE, 1000) == jail.ERRNO | errno.ENOSYS
    assert run(CODE, 462) == jail.ALLOW  # mseal: older than the newest, not refused


def test_socket_pairs_of_stream_sockets_only():
    nr = jail.X86_64["socketpair"]
    for kind in (1, 1 | os.O_NONBLOCK | os.O_CLOEXEC):  # SOCK_STREAM, with its flags
        assert run(CODE, nr, (1, kind)) == jail.ALLOW
    for kind in (2, 3, 4, 5, 10, 2 | os.O_CLOEXEC):  # dgram raw rdm seqpacket packet
        assert run(CODE, nr, (1, kind)) == EPERM, kind
    for family in (2, 10, 16, 30, 40):  # inet inet6 netlink tipc (which has pairs) vsock
        assert run(CODE, nr, (family, 1)) == jail.ERRNO | errno.EAFNOSUPPORT, family


def test_no_owner_for_signals_nor_flags_set_through_fcntl_or_ioctl():
    for cmd in (8, 10, 15, 1024):  # F_SETOWN F_SETSIG F_SETOWN_EX F_SETLEASE
        assert run(CODE, jail.X86_64["fcntl"], (3, cmd, 1)) == EPERM, cmd
    for cmd in (1, 2, 3, 4, 9, 1030):  # F_GETFD F_SETFD F_GETFL F_SETFL F_GETOWN DUPFD_CLOEXEC
        assert run(CODE, jail.X86_64["fcntl"], (3, cmd, 1)) == jail.ALLOW, cmd
    for cmd in (0x8901, 0x8902, 0x5412, 0x40086602, 0x40046602, 0x401C5820, 0x40087602,
                0x40806685, 0x800C6613):  # FIOSETOWN SIOCSPGRP TIOCSTI FS_IOC_SETFLAGS ..
        assert run(CODE, jail.X86_64["ioctl"], (3, cmd, 0)) == EPERM, hex(cmd)
    for cmd in (0x5421, 0x541B, 0x80086601):  # FIONBIO FIONREAD FS_IOC_GETFLAGS
        assert run(CODE, jail.X86_64["ioctl"], (3, cmd, 0)) == jail.ALLOW, hex(cmd)


def test_limits_priorities_and_scheduling_of_the_worker_itself_only():
    for name, nr in jail.X86_64["own"].items():
        assert run(CODE, nr, (0,)) == jail.ALLOW, name
        assert run(CODE, nr, (PID,)) == jail.ALLOW, name
        assert run(CODE, nr, (1,)) == EPERM, name
    for name, which in (("setpriority", 0), ("ioprio_set", 1)):
        nr = jail.X86_64[name]
        assert run(CODE, nr, (which, 0, 5)) == jail.ALLOW, name
        assert run(CODE, nr, (which, PID, 5)) == jail.ALLOW, name
        assert run(CODE, nr, (which, 1, 5)) == EPERM, name
        for other in (0, 1, 2, 3):  # its process group, its user: the coordinator's too
            if other != which:
                assert run(CODE, nr, (other, 0, 5)) == EPERM, (name, other)


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
    for family in (2, 10):
        for protocol in (6, 17):
            assert run(CODE, socket_nr, (family, 1, protocol)) == jail.ALLOW
        for protocol in (1, 58, 115, 132, 136, 262):  # icmp icmpv6 l2tp sctp udplite mptcp
            assert run(CODE, socket_nr, (family, 1, protocol)) == \
                jail.ERRNO | errno.EPROTONOSUPPORT, protocol


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


ATTEMPT = textwrap.dedent("""
    tried = {}
    def attempt(name, act):
        # how `act` ended: "ok", or the errno it was refused with
        try:
            act()
            tried[name] = "ok"
        except OSError as exc:
            tried[name] = exc.errno
""")
"""What the confined scripts below (and test_attack_workers' attack) try things with."""


PROBE = ATTEMPT + textwrap.dedent("""
    import asyncio, json, os, socket, sys, threading
    from appliance.filter.workers.confine import drop_capabilities
    from appliance.filter.workers import jail
    drop_capabilities()
    jail.lock()
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
    print(json.dumps(tried))
""")


THE_COORDINATOR = ATTEMPT + textwrap.dedent("""
    import ctypes, fcntl, json, os, resource, signal, socket, sys, time
    from appliance.filter.workers.confine import drop_capabilities
    from appliance.filter.workers import jail
    here = sys.argv[1]
    got = []
    for number in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGIO, signal.SIGURG):
        signal.signal(number, lambda number, frame: got.append(number))
    journal = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    journal.bind(here + "/journal")
    open(here + "/owned", "w").close()
    ready, report = os.pipe()
    done, finished = os.pipe()
    other = os.fork()
    if other == 0:  # the coordinator's stand-in: the same uid, what it was sent
        os.close(ready)
        while not os.read(done, 1):
            pass
        journal.setblocking(False)
        sent = []
        while True:
            try:
                sent.append(journal.recv(100).decode())
            except BlockingIOError:
                break
        os.write(report, json.dumps({
            "signals": got, "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            "nice": os.getpriority(os.PRIO_PROCESS, 0), "datagrams": sent}).encode())
        os._exit(0)
    os.close(report)
    drop_capabilities()
    jail.lock()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def call(*args):
        if libc.syscall(*(ctypes.c_long(a) if isinstance(a, int) else a for a in args)) < 0:
            raise OSError(ctypes.get_errno(), "")
    def owned_by_it(how):
        ours, theirs = socket.socketpair()
        how(ours)
        fcntl.fcntl(ours, fcntl.F_SETFL, os.O_ASYNC | os.O_NONBLOCK)
        theirs.send(b"x")
    attempt("F_SETOWN", lambda: owned_by_it(lambda s: fcntl.fcntl(s, 8, other)))
    attempt("FIOSETOWN", lambda: owned_by_it(
        lambda s: fcntl.ioctl(s, 0x8901, other.to_bytes(4, "little"))))
    attempt("prlimit", lambda: resource.prlimit(other, resource.RLIMIT_NOFILE, (7, 7)))
    attempt("setpriority", lambda: os.setpriority(os.PRIO_PROCESS, other, 7))
    attempt("setpriority user", lambda: os.setpriority(os.PRIO_USER, 0, 7))
    attempt("sched_setaffinity", lambda: os.sched_setaffinity(other, {0}))
    attempt("own limit", lambda: resource.prlimit(0, resource.RLIMIT_CORE, (0, 0)))
    attempt("datagram pair", lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)[0]
            .sendto(b"forged", here + "/journal"))
    attempt("bound pair", lambda: socket.socketpair()[0].bind(here + "/planted"))
    owned = here + "/owned"
    attempt("setxattrat", lambda: call(463, -100, owned.encode(), 0, b"user.planted",
                                       ctypes.byref((ctypes.c_uint64 * 2)()), 16))
    attempt("chattr", lambda: call(16, os.open(owned, os.O_RDONLY), 0x40086602,
                                   ctypes.byref(ctypes.c_long(0x80))))  # FS_NOATIME_FL
    attempt("msgget", lambda: call(68, 0, 0o1600))
    attempt("lease", lambda: fcntl.fcntl(os.open(owned, os.O_RDONLY), 1024, fcntl.F_RDLCK))
    time.sleep(0.2)
    os.write(finished, b"x")
    print(json.dumps({"done": tried, "dumpable": libc.prctl(3, 0, 0, 0, 0),  # PR_GET_
                      "other": json.loads(os.read(ready, 65536))}))
""")


def test_a_confined_process_reaches_no_process_of_its_uid_nor_a_path(tmp_path):
    """What the first version let through: the kernel's SIGIO (and F_SETSIG's signal) to the
    owner F_SETOWN names, a same-uid process's limits and priority, a datagram pair's
    sendto (journald's socket), bind's socket file, the calls newer than the table
    (setxattrat), chattr's ioctl on a read-only descriptor, and /proc/PID/mem of a sibling
    worker (dumpable)."""
    done = subprocess.run([sys.executable, "-c", THE_COORDINATOR, str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=True)
    told = json.loads(done.stdout)
    assert told["done"] == {
        "F_SETOWN": errno.EPERM, "FIOSETOWN": errno.EPERM, "prlimit": errno.EPERM,
        "setpriority": errno.EPERM, "setpriority user": errno.EPERM,
        "sched_setaffinity": errno.EPERM, "own limit": "ok", "datagram pair": errno.EPERM,
        "bound pair": errno.EPERM, "setxattrat": errno.EPERM, "chattr": errno.EPERM,
        "msgget": errno.EPERM, "lease": errno.EPERM}
    assert told["dumpable"] == 0
    assert told["other"]["signals"] == [] and told["other"]["datagrams"] == []
    assert told["other"]["nofile"] != 7 and told["other"]["nice"] != 7
    assert not (tmp_path / "planted").exists()


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


INT_80 = textwrap.dedent("""
    import ctypes, mmap
    from appliance.filter.workers.confine import drop_capabilities
    from appliance.filter.workers import jail
    drop_capabilities()
    jail.lock()
    code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    code.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))  # mov eax, 20 (getpid); int 0x80
    address = ctypes.addressof(ctypes.c_char.from_buffer(code))
    print(ctypes.CFUNCTYPE(ctypes.c_long)(address)(), flush=True)
""")


def test_an_i386_call_from_64_bit_code_kills_the_process():
    """int 0x80 from x86_64 code is the i386 ABI (AUDIT_ARCH_I386): the filter kills the
    process rather than read the number in another table (a kernel without IA32 emulation
    faults it instead)."""
    done = subprocess.run([sys.executable, "-c", INT_80], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode in (-signal.SIGSYS, -signal.SIGSEGV), (done.returncode, done.stdout)
    assert done.stdout == ""


def test_the_calls_made_for_every_request_are_allowed_first_and_nothing_else_is():
    """The hot calls are let through before the other checks: none of them may be one the
    filter refuses or looks into, or the shortcut would let it through."""
    hot = set(jail.X86_64["hot"].values())
    looked_into = {nr for key, nr in jail.X86_64.items() if isinstance(nr, int)}
    for group in ("refused", "absent", "own"):
        looked_into |= set(jail.X86_64[group].values())
    assert not hot & looked_into, hot & looked_into
    for name, nr in jail.X86_64["hot"].items():
        assert run(CODE, nr, (1, 2, 3)) == jail.ALLOW, name
    before_hot = 8  # the architecture, x32 and newest checks
    for nr in hot:  # within the shortcut's length of the start
        assert steps(CODE, nr) <= before_hot + len(hot) + 1, nr


def test_protocol_zero_names_tcp_or_udp_only_by_the_sockets_type():
    """Protocol 0 is the type's default: TCP for a stream, UDP for a datagram, but SCTP for
    a SOCK_SEQPACKET (and DCCP for SOCK_DCCP) wherever that module is loaded already."""
    nr = jail.X86_64["socket"]
    flags = os.O_NONBLOCK | os.O_CLOEXEC  # SOCK_NONBLOCK, SOCK_CLOEXEC
    for family in (2, 10):
        for kind in (1, 2, 1 | flags, 2 | flags):  # stream, dgram
            assert run(CODE, nr, (family, kind, 0)) == jail.ALLOW, (family, kind)
        for kind in (4, 5, 6, 10, 5 | flags):  # rdm seqpacket dccp packet
            for protocol in (0, 6, 17):
                assert run(CODE, nr, (family, kind, protocol)) == \
                    jail.ERRNO | errno.ESOCKTNOSUPPORT, (family, kind, protocol)
