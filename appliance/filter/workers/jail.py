"""A worker's system calls: a seccomp filter it loads as it starts, after its capabilities
are gone, so that a worker an agent's bytes took over cannot act as its coordinator does.

A worker runs as the filter's own user (a user of its own would need CAP_SETUID in the
filter, which is a wider door than the one it closes). What that user may do and a worker
needs not, the filter refuses:
- a socket of any family but IPv4 and IPv6: no connection to the control socket, nor to
  journald or any local service (a pathname AF_UNIX connect needs a new AF_UNIX socket;
  the worker's own, its link and its loop's pair, are connected already), no netlink; of
  any protocol but TCP and UDP, nor of a type whose protocol 0 is another (SCTP, L2TP:
  kernel code a worker needs not, and a module loaded where the unit's
  ProtectKernelModules is not set); a socketpair of AF_UNIX stream
  sockets only (a datagram one may sendto or connect to any path: journald's, /dev/log;
  another family's pair, TIPC's, is a socket() of a refused family), and no bind (a
  worker's sockets come bound; binding a pair's end to a path creates a file);
- a file opened for writing, created, removed, renamed, linked or changed in mode, owner,
  times, attributes or flags (chattr's ioctl needs only a read-only descriptor): the state
  directory and the audit log are the coordinator's;
- a new process or program (a clone without CLONE_THREAD, fork, exec), a namespace
  (unshare, setns), a signal to any process but itself (kill, and F_SETOWN or FIOSETOWN,
  with which the kernel would send SIGIO or any F_SETSIG signal to the owner named),
  another process's memory (ptrace, process_vm_*, pidfd_getfd; /proc/PID/mem is shut by
  confine's PR_SET_DUMPABLE), and io_uring, bpf, userfaultfd, the kernel keyring, which
  would do the same things past this filter or widen what the kernel exposes, and System V
  IPC and POSIX message queues (the host's, shared with every user: a channel past the
  link, or another's queue or segment open to all);
- a limit, priority, scheduling or memory placement set on any process but itself
  (prlimit64, setpriority, ioprio_set, sched_set*, migrate_pages, move_pages): a same-uid
  caller may, and an RLIMIT_CPU or RLIMIT_NOFILE of the coordinator's would stop it;
- clone3, with ENOSYS, which glibc reads as "use clone" (its flags sit in memory, where a
  filter cannot look), and every call newer than this table (ENOSYS too): each kernel adds
  some, and some do what a refused one does (setxattrat, file_setattr);
- the x32 ABI's numbers, and any architecture but the one this table is for.

Everything else is allowed: this is a wall around what the filter's user owns, not a
minimal list of what a worker calls (that list would break with each Python and uvloop).
Loaded with TSYNC, so every thread has it; inherited by anything a worker could start.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

# <linux/filter.h>, <linux/seccomp.h>, <linux/audit.h>
LD_ABS_W, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
ALLOW, KILL_PROCESS, ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC = 1, 1
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
NR, ARCH = 0, 4
"""Offsets in struct seccomp_data: the call's number, its architecture; then args[i] at
16 + 8 * i (the low 32 bits first, little-endian)."""

AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
IPPROTO_TCP, IPPROTO_UDP = 6, 17
WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
CLONE_THREAD = 0x00010000
SOCK_TYPE_BUT_STREAM = 0xE
"""A socket type's low bits (SOCK_TYPE_MASK 0xF) but SOCK_STREAM's, 1: any set is another type."""
SOCK_TYPE_PAST_RAW = 0xC
"""Set in every type from SOCK_RDM (4) on, in none of stream, datagram and raw (1 to 3; raw
needs CAP_NET_RAW): protocol 0 is the type's default, SCTP's for SOCK_SEQPACKET and DCCP's
for SOCK_DCCP where either module is loaded, so the type is checked as well."""
PRIO_PROCESS, IOPRIO_WHO_PROCESS = 0, 1
F_SETOWN, F_SETSIG, F_SETOWN_EX, F_SETLEASE = 8, 10, 15, 1024
FIOSETOWN, SIOCSPGRP, TIOCSTI = 0x8901, 0x8902, 0x5412
FS_IOC_SETFLAGS, FS_IOC32_SETFLAGS, FS_IOC_FSSETXATTR = 0x40086602, 0x40046602, 0x401C5820
FS_IOC_SETVERSION, FS_IOC32_SETVERSION = 0x40087602, 0x40047602
FS_IOC_ENABLE_VERITY, FS_IOC_SET_ENCRYPTION_POLICY = 0x40806685, 0x800C6613
"""<asm-generic/fcntl.h>, <asm-generic/sockios.h>, <asm-generic/ioctls.h>, <linux/fs.h>,
<linux/fsverity.h>, <linux/fscrypt.h>."""
REFUSED_FCNTLS = (F_SETOWN, F_SETSIG, F_SETOWN_EX, F_SETLEASE)
REFUSED_IOCTLS = (FIOSETOWN, SIOCSPGRP, TIOCSTI, FS_IOC_SETFLAGS, FS_IOC32_SETFLAGS,
                  FS_IOC_FSSETXATTR, FS_IOC_SETVERSION, FS_IOC32_SETVERSION,
                  FS_IOC_ENABLE_VERITY, FS_IOC_SET_ENCRYPTION_POLICY)
"""A signal's owner (another process: its SIGIO, F_SETSIG's signal; a lease breaker waits on
the worker), a terminal's input, and the ioctls that change a file through a read-only
descriptor: its flags (chattr), its generation, verity (no write ever again), encryption."""

X86_64 = {
    "seccomp": 317, "socket": 41, "open": 2, "openat": 257, "clone": 56, "kill": 62,
    "tgkill": 234, "socketpair": 53, "fcntl": 72, "ioctl": 16, "setpriority": 141,
    "ioprio_set": 251,
    # the first argument a process: 0 (the caller) or the worker's own pid only
    "own": {"prlimit64": 302, "sched_setparam": 142, "sched_setscheduler": 144,
            "sched_setaffinity": 203, "sched_setattr": 314, "migrate_pages": 256,
            "move_pages": 279},
    # refused outright (EPERM)
    "refused": {
        "creat": 85, "openat2": 437, "open_by_handle_at": 304,
        "rename": 82, "renameat": 264, "renameat2": 316, "unlink": 87, "unlinkat": 263,
        "rmdir": 84, "mkdir": 83, "mkdirat": 258, "link": 86, "linkat": 265,
        "symlink": 88, "symlinkat": 266, "mknod": 133, "mknodat": 259, "truncate": 76,
        "chmod": 90, "fchmod": 91, "fchmodat": 268, "fchmodat2": 452, "chown": 92,
        "fchown": 93, "lchown": 94, "fchownat": 260, "utime": 132, "utimes": 235,
        "futimesat": 261, "utimensat": 280, "setxattr": 188, "lsetxattr": 189,
        "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199,
        "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "unshare": 272,
        "setns": 308, "tkill": 200, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297,
        "pidfd_open": 434, "pidfd_send_signal": 424, "pidfd_getfd": 438, "ptrace": 101,
        "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "bpf": 321, "userfaultfd": 323, "perf_event_open": 298, "add_key": 248,
        "request_key": 249, "keyctl": 250, "mq_open": 240, "name_to_handle_at": 303,
        "bind": 49, "setxattrat": 463, "removexattrat": 466, "file_setattr": 469,
        "mq_unlink": 241, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71,
        "semget": 64, "semop": 65, "semctl": 66, "semtimedop": 220, "shmget": 29,
        "shmat": 30, "shmctl": 31,
    },
    "absent": {"clone3": 435},
    # allowed before any other check: what a worker calls for every request and connection
    # (each check a call passes costs a few nanoseconds, and read() came last of ~300)
    "hot": {"read": 0, "write": 1, "close": 3, "mmap": 9, "munmap": 11, "brk": 12,
            "readv": 19, "writev": 20, "madvise": 28, "connect": 42, "sendto": 44,
            "recvfrom": 45, "sendmsg": 46, "recvmsg": 47, "shutdown": 48, "getsockname": 51,
            "getpeername": 52, "setsockopt": 54, "getsockopt": 55, "futex": 202,
            "epoll_wait": 232, "epoll_ctl": 233, "splice": 275, "epoll_pwait": 281,
            "accept4": 288, "pipe2": 293, "getrandom": 318},
    "newest": 469,  # file_setattr (6.17); anything past it: ENOSYS
}
"""<asm/unistd_64.h>. The appliance is amd64 (its box, its packages); another machine's
table would be written and tested on it."""


def _ld(offset: int) -> bytes:
    return struct.pack("=HBBI", LD_ABS_W, 0, 0, offset)


def _jump(code: int, k: int, true: int, false: int) -> bytes:
    return struct.pack("=HBBI", code, true, false, k)


def _ret(value: int) -> bytes:
    return struct.pack("=HBBI", RET, 0, 0, value)


def _arg(index: int) -> int:
    return 16 + 8 * index


def _when(nr: int, block: list[bytes]) -> list[bytes]:
    """`block` (which ends in a return) for call `nr`; the next check for any other."""
    return [_jump(JEQ, nr, 0, len(block)), *block]


def _among(index: int, values: tuple[int, ...], then: bytes, otherwise: bytes) -> list[bytes]:
    """`then` when args[index] is one of `values`, `otherwise` when it is none."""
    return [_ld(_arg(index)),
            *(_jump(JEQ, value, len(values) - at, 0) for at, value in enumerate(values)),
            otherwise, then]


def program(table: dict, pid: int) -> bytes:
    """The filter, as the kernel reads it (struct sock_filter[]). `pid`: the worker's own,
    the one process it may signal."""
    denied = _ret(ERRNO | errno.EPERM)
    code = [_ld(ARCH), _jump(JEQ, AUDIT_ARCH_X86_64, 1, 0), _ret(KILL_PROCESS),
            _ld(NR), _jump(JGE, X32_SYSCALL_BIT, 0, 1), denied,
            _jump(JGE, table["newest"] + 1, 0, 1), _ret(ERRNO | errno.ENOSYS)]
    *others, last = table["hot"].values()  # each a match lands on the ALLOW after them
    code += [*(_jump(JEQ, nr, len(others) - at, 0) for at, nr in enumerate(others)),
             _jump(JEQ, last, 0, 1), _ret(ALLOW)]
    for nr in table["refused"].values():
        code += [_jump(JEQ, nr, 0, 1), denied]
    for nr in table["absent"].values():
        code += [_jump(JEQ, nr, 0, 1), _ret(ERRNO | errno.ENOSYS)]
    code += _when(table["socket"], [_ld(_arg(0)), _jump(JEQ, AF_INET, 2, 0),
                                    _jump(JEQ, AF_INET6, 1, 0),
                                    _ret(ERRNO | errno.EAFNOSUPPORT),
                                    _ld(_arg(1)), _jump(JSET, SOCK_TYPE_PAST_RAW, 0, 1),
                                    _ret(ERRNO | errno.ESOCKTNOSUPPORT),
                                    *_among(2, (0, IPPROTO_TCP, IPPROTO_UDP), _ret(ALLOW),
                                            _ret(ERRNO | errno.EPROTONOSUPPORT))])
    for call, flags in (("open", 1), ("openat", 2)):
        code += _when(table[call], [_ld(_arg(flags)), _jump(JSET, WRITING, 0, 1),
                                    _ret(ERRNO | errno.EACCES), _ret(ALLOW)])
    code += _when(table["clone"], [_ld(_arg(0)), _jump(JSET, CLONE_THREAD, 1, 0), denied,
                                   _ret(ALLOW)])
    for call in ("kill", "tgkill"):
        code += _when(table[call], [_ld(_arg(0)), _jump(JEQ, pid, 1, 0), denied, _ret(ALLOW)])
    code += _when(table["socketpair"], [_ld(_arg(0)), _jump(JEQ, AF_UNIX, 1, 0),
                                        _ret(ERRNO | errno.EAFNOSUPPORT),
                                        _ld(_arg(1)), _jump(JSET, SOCK_TYPE_BUT_STREAM, 0, 1),
                                        denied, _ret(ALLOW)])
    code += _when(table["fcntl"], _among(1, REFUSED_FCNTLS, denied, _ret(ALLOW)))
    code += _when(table["ioctl"], _among(1, REFUSED_IOCTLS, denied, _ret(ALLOW)))
    for nr in table["own"].values():
        code += _when(nr, _among(0, (0, pid), _ret(ALLOW), denied))
    for call, which in (("setpriority", PRIO_PROCESS), ("ioprio_set", IOPRIO_WHO_PROCESS)):
        code += _when(table[call], [_ld(_arg(0)), _jump(JEQ, which, 0, 3),
                                    *_among(1, (0, pid), _ret(ALLOW), denied)])
    code.append(_ret(ALLOW))
    return b"".join(code)


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def lock() -> None:
    """Load the filter into every thread of this process. Needs no_new_privs (confine sets
    it) or CAP_SYS_ADMIN; refuses to run anywhere the table does not fit."""
    if platform.machine() != "x86_64":
        raise OSError(errno.ENOSYS, f"the workers' system call filter is written for x86_64, "
                      f"not {platform.machine()}: run the filter with workers = 1")
    code = program(X86_64, os.getpid())
    prog = _Program(len(code) // 8, code)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(X86_64["seccomp"]), ctypes.c_long(SECCOMP_SET_MODE_FILTER),
                    ctypes.c_long(SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(prog)) != 0:
        raise OSError(ctypes.get_errno(), "seccomp: " + os.strerror(ctypes.get_errno()))
