"""Reading a tree the agent controls, one directory descriptor at a time.

The agent may change `work/` while the service (root) reads it, so: every name is opened
relative to its directory's descriptor and never followed (O_NOFOLLOW, O_DIRECTORY for
directories), only what fstat says is a regular file is read, nothing blocks (O_NONBLOCK:
FIFOs, leases), nothing is read past a limit, and no path handed to the kernel is longer
than one name, so PATH_MAX never applies. Whatever cannot be read becomes `Unreadable` with
a reason a person can read, never an error that stops the whole walk.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from .model import human_size

FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CHUNK = 1 << 20


class Unreadable(Exception):
    """A name that could not be read as it was listed; str() says why, for a note."""


def kind_of(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        return "dir"
    for test, name in ((stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "unknown file type"


def reason(exc: OSError) -> str:
    """What an error means for a name the walk had just listed."""
    if exc.errno == errno.ENOENT:
        return "vanished while being read"
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return "changed while being read (swapped for a link or another type)"
    if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
        return "busy (a lease is held on it), not read"
    return f"unreadable: {exc.strerror or exc}"


def open_root(root: Path) -> int | None:
    """The top of a tree, or None when there is none (a session without a project);
    Unreadable when it is there but cannot be opened."""
    try:
        return os.open(root, DIR_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Unreadable(f"cannot be opened: {exc.strerror or exc}") from None


def open_dir(dir_fd: int, name: str) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise Unreadable(reason(exc)) from None


def descend(root_fd: int, parts: Iterable[str]) -> int:
    """A new descriptor for root/parts..., every step a real directory (never a link)."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            next_fd = open_dir(fd, part)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Unreadable(reason(exc)) from None


def readlink(dir_fd: int, name: str) -> bytes:
    try:
        return os.readlink(os.fsencode(name), dir_fd=dir_fd)
    except OSError as exc:
        raise Unreadable(reason(exc)) from None


def _open_file(dir_fd: int, name: str) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        raise Unreadable(reason(exc)) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise Unreadable(f"changed while being read (now a {kind_of(info.st_mode)})")
    return fd, info


def too_large(size: int, limit: int) -> str:
    return f"too large: {size} bytes ({human_size(size)}; the limit is {human_size(limit)})"


def _chunks(fd: int, limit: int):
    """The file's bytes in chunks, Unreadable once more than `limit` came (it grew)."""
    total = 0
    while True:
        try:
            chunk = os.read(fd, CHUNK)
        except OSError as exc:
            raise Unreadable(reason(exc)) from None
        if not chunk:
            return
        total += len(chunk)
        if total > limit:
            raise Unreadable(too_large(total, limit) + ", still growing while being read")
        yield chunk


def read_file(dir_fd: int, name: str, limit: int) -> tuple[bytes, os.stat_result]:
    """A regular file's contents, at most `limit` bytes; Unreadable otherwise."""
    fd, info = _open_file(dir_fd, name)
    try:
        if info.st_size > limit:
            raise Unreadable(too_large(info.st_size, limit))
        return b"".join(_chunks(fd, limit)), info
    finally:
        os.close(fd)


def hash_file(dir_fd: int, name: str, limit: int) -> tuple[str, int, os.stat_result]:
    """(sha256 hex, size, stat) of a regular file, read in chunks, never whole in memory."""
    fd, info = _open_file(dir_fd, name)
    try:
        if info.st_size > limit:
            raise Unreadable(too_large(info.st_size, limit))
        digest, size = hashlib.sha256(), 0
        for chunk in _chunks(fd, limit):
            digest.update(chunk)
            size += len(chunk)
        return digest.hexdigest(), size, info
    finally:
        os.close(fd)


def same_content(fd_a: int, fd_b: int, name: str, limit: int) -> bool:
    """Whether two regular files (the same name in two directories) hold the same bytes,
    compared chunk by chunk; anything unreadable counts as different (the change is then
    shown, with the reason, when its contents are loaded)."""
    try:
        a, _ = _open_file(fd_a, name)
    except Unreadable:
        return False
    try:
        b, _ = _open_file(fd_b, name)
    except Unreadable:
        os.close(a)
        return False
    try:
        left, right = _chunks(a, limit), _chunks(b, limit)
        x = y = memoryview(b"")
        while True:
            x = x or memoryview(next(left, b""))
            y = y or memoryview(next(right, b""))
            if not x or not y:
                return not x and not y
            n = min(len(x), len(y))  # reads may come back short: compare what both have
            if x[:n] != y[:n]:
                return False
            x, y = x[n:], y[n:]
    except Unreadable:
        return False
    finally:
        os.close(a)
        os.close(b)
