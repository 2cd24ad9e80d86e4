"""What a worker may read: a Landlock ruleset it restricts itself with as it starts, so that
a worker an agent's bytes took over reads the code and libraries it runs and the few files
a worker needs, and nothing else its user may read (the state directory: the secrets' store,
the audit log, the sessions' files; the git gateway's keys; the operator's files).

The seccomp filter (jail.py) refuses every open for writing already; the ruleset handles
writing too (no path is given any of it), so that a kernel where one of the two is missing
still has the other. Access through a descriptor the worker holds is not a path's and is
not judged: its link, its gateways' sockets, a leaf certificate's memfd (reopened through
/proc/self/fd, whose file lives on the kernel's internal tmpfs, which Landlock leaves alone).

A kernel without Landlock (older than 5.13, or without it in its `lsm=` list), or a
container whose own seccomp filter refuses the calls, gives no ruleset: the worker says so
in its log and goes on with the rest of its jail. A path that cannot be opened is left out
of the ruleset: the worker reads less, never more.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import sys
from collections.abc import Iterable

# <linux/landlock.h>; the calls' numbers are the same on every architecture (new ones are)
CREATE_RULESET, ADD_RULE, RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
READ_FILE, READ_DIR = 1 << 2, 1 << 3
HANDLED_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1}
"""The file rights each ABI knows, all handled (refused beneath every path but those given
below): executing, writing, reading, listing, removing and making any kind of file; then
linking or renaming across directories (2), truncating (3)."""
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
"""ABI 6: no abstract unix socket and no signal outside the worker's own domain."""

SYSTEM = ("/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/ssl",
          "/etc/localtime", "/etc/hosts", "/etc/nsswitch.conf", "/etc/resolv.conf",
          "/etc/gai.conf", "/etc/host.conf", "/etc/services", "/etc/protocols",
          "/dev/null", "/dev/urandom", "/dev/random", "/sys/devices/system/cpu",
          "/proc/self/fd")
"""What a worker reads of the system: Python's standard library, the shared libraries and
what loading them reads, OpenSSL's configuration and the CA bundle (an inspected upstream's
certificate is checked against it), the time zone, what libc's resolver and getaddrinfo
read, the CPUs (os.cpu_count), and its own descriptors' /proc directory (a leaf's memfd is
opened again through it; this process's, resolved when the rule is made). Not the rest of
its /proc entry: net/tcp and net/unix there list every socket of the filter's, the other
workers' sessions' flows among them."""


class Unsupported(OSError):
    """This kernel has no Landlock: the worker runs without a ruleset."""


def readable(extra: Iterable[str] = (), keep_out: Iterable[str] = ()) -> list[str]:
    """The paths a worker may read beneath: the system's, the Python it runs (its prefixes:
    a venv's packages are beneath), the filter's own package (an editable install's is
    elsewhere), the trust store OpenSSL is told of (SSL_CERT_FILE, SSL_CERT_DIR), and
    `extra` (the interception CA's files, which a rotation makes it read again). Not
    sys.path as it is: `python -m` puts the working directory first, which is / under
    systemd. "/" itself is never given, nor a path that is or holds one of `keep_out`
    (the coordinator's own: its state directory, its control socket's), however it is
    spelt (`ca_dir = "/var/lib/corral-filter/intercept/.."`) or wherever a link leads."""
    import appliance

    trust = [os.environ.get(name) for name in ("SSL_CERT_FILE", "SSL_CERT_DIR")]
    paths = [*SYSTEM, sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
             *appliance.__path__, *(p for p in trust if p), *extra]
    shut = [os.path.realpath(p) for p in keep_out]
    found = dict.fromkeys(os.path.realpath(p) for p in paths)
    return [p for p in found if p != "/" and os.path.exists(p)
            and not any(s == p or s.startswith(p + "/") for s in shut)]


def restrict(paths: Iterable[str]) -> int:
    """Restrict this thread, and every thread and process it starts from now, to reading
    beneath `paths`, and to writing nowhere. Returns the kernel's Landlock ABI. Raises
    Unsupported where the kernel has none, OSError for any other failure. Needs
    no_new_privs (confine sets it) or CAP_SYS_ADMIN; call it before any thread starts."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(ctypes.c_long(CREATE_RULESET), None, ctypes.c_size_t(0),
                       ctypes.c_uint32(CREATE_RULESET_VERSION))
    if abi < 0:
        code = ctypes.get_errno()
        if code in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):  # EPERM: a container's
            raise Unsupported(code, "Landlock: " + os.strerror(code))  # seccomp refused it
        raise OSError(code, "landlock_create_ruleset: " + os.strerror(code))
    handled = HANDLED_BY_ABI[min(abi, max(HANDLED_BY_ABI))]
    if abi >= 6:  # struct landlock_ruleset_attr: fs, net (none handled: any port), scoped
        attr = struct.pack("=QQQ", handled, 0, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
    else:
        attr = struct.pack("=Q", handled)
    ruleset = libc.syscall(ctypes.c_long(CREATE_RULESET), ctypes.create_string_buffer(attr),
                           ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        code = ctypes.get_errno()
        raise OSError(code, "landlock_create_ruleset: " + os.strerror(code))
    try:
        for path in paths:
            try:
                _beneath(libc, ruleset, path)
            except (FileNotFoundError, PermissionError):
                continue  # gone, or hidden from the filter (its unit's sandbox): not given
        if libc.syscall(ctypes.c_long(RESTRICT_SELF), ctypes.c_long(ruleset),
                        ctypes.c_uint32(0)) != 0:
            code = ctypes.get_errno()
            raise OSError(code, "landlock_restrict_self: " + os.strerror(code))
    finally:
        os.close(ruleset)
    return abi


def _beneath(libc, ruleset: int, path: str) -> None:
    """Reading beneath `path` (and listing, for a directory). Nothing is given executing:
    a shared library is mapped from a file opened for reading, which is all dlopen does."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        rights = READ_FILE | READ_DIR if stat.S_ISDIR(os.fstat(fd).st_mode) else READ_FILE
        rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd))  # packed struct
        if libc.syscall(ctypes.c_long(ADD_RULE), ctypes.c_long(ruleset),
                        ctypes.c_int(RULE_PATH_BENEATH), rule, ctypes.c_uint32(0)) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"landlock_add_rule {path}: " + os.strerror(code))
    finally:
        os.close(fd)
