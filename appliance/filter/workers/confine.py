"""What a worker gives up as it starts, before it reads a byte an agent sent: every
descriptor of the coordinator's but its link, every capability, the files its user may read
but a worker needs not (landlock.py), and the system calls with which its user could do the
coordinator's work (jail.py).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable

from . import jail, landlock

PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 4, 38, 47, 4
CAPABILITY_VERSION_3 = 0x20080522
"""<linux/prctl.h>, <linux/capability.h>."""


def confine(link_fd: int, reads: Iterable[str] = (), keep_out: Iterable[str] = ()) -> str:
    """Nothing of the coordinator's but the link (its gateways' listeners come over it):
    uvloop's spawn (libuv) closes only the descriptors marked close-on-exec, and C libraries
    open some without the mark (libnftables' netlink socket). A worker parses what agents
    send; it must not hold the firewall's socket, nor the right to open another, nor read
    what its user may but it needs not (landlock.py: beneath the system's and Python's
    files and `reads` only, and never a path that holds one of `keep_out`). Returns what the
    kernel gave of that, for the log."""
    os.closerange(3, link_fd)
    os.closerange(link_fd + 1, os.sysconf("SC_OPEN_MAX"))
    drop_capabilities()
    try:
        said = f"Landlock ABI {landlock.restrict(landlock.readable(reads, keep_out))}"
    except landlock.Unsupported as exc:
        said = f"no Landlock ruleset ({exc.strerror}): it reads what the filter's user may"
    jail.lock()
    return said


def drop_capabilities() -> None:
    """The worker keeps none of the filter's capabilities (CAP_NET_ADMIN would let it load
    any ruleset; systemd gives them to the filter as ambient ones, which exec passes on),
    and can gain none again. It binds nothing (its gateways' sockets come bound) and
    teaches the firewall through the coordinator; its resolver's sockets get the buffer
    SO_RCVBUF allows rather than SO_RCVBUFFORCE's. Before any thread starts: capabilities
    are each thread's, and a thread started later copies them.

    Not dumpable either: the workers share a uid and, without capabilities, each could
    otherwise open another's /proc/PID/mem and environ for reading (another agent's
    traffic and secrets); the kernel lets only CAP_SYS_PTRACE in to a process that is not."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl: " + os.strerror(ctypes.get_errno()))
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)  # this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: none, both words
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset: " + os.strerror(ctypes.get_errno()))


def undumpable() -> None:
    """The coordinator as its workers' neighbour: not dumpable either. Where it runs with
    capabilities (the appliance's CAP_NET_ADMIN) a worker, which has none, cannot open its
    /proc/PID/mem anyway; where it runs without (a test, a developer's run), a worker of
    its uid could read the secrets and every session's state in its memory."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl: " + os.strerror(ctypes.get_errno()))
