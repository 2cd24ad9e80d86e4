"""Small helpers the test tiers share: the filter's control socket, stopping a process."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path


def control(path: Path, request: dict, timeout: float = 10) -> dict:
    """One request on corral-filter's control socket, one answer."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            data += chunk
    return json.loads(data)


def stop(process: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL if it does not go."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def journal_fields(data: bytes) -> list[tuple[str, bytes]]:
    """An entry in journald's native form, read the way journald reads one (systemd's
    "Native Journal Protocol"), written apart from the encoder (appliance/filter/journal.py)
    to hold it to the protocol: `NAME=value\\n`, or `NAME\\n` + a 64-bit little-endian
    length + the value + `\\n`; a name is A-Z, 0-9 and `_`, not starting with a digit or
    `_`, 64 characters at most. ValueError for anything else."""
    import re

    fields, at = [], 0
    while at < len(data):
        end = data.find(b"\n", at)
        if end < 0:
            raise ValueError(f"a field without its newline at byte {at}")
        line = data[at:end]
        if b"=" in line:
            name, _, value = line.partition(b"=")
            at = end + 1
        else:
            name, start = line, end + 9
            size = int.from_bytes(data[end + 1:start], "little")
            value = data[start:start + size]
            if len(data) < start or len(value) != size or data[start + size:start + size + 1] \
                    != b"\n":
                raise ValueError(f"{name!r}: a binary-safe value cut short at byte {at}")
            at = start + size + 1
        if not re.fullmatch(rb"[A-Z][A-Z0-9_]{0,63}", name):
            raise ValueError(f"{name!r} is no journald field name")
        fields.append((name.decode(), value))
    return fields


def journal_entry(sock) -> list[tuple[str, bytes]]:
    """The next entry on a datagram socket standing in for journald's: the datagram's own
    fields, or those of the sealed memfd it passes (an entry too large for a datagram)."""
    import array
    import fcntl
    import os

    data, ancillary, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(4))
    if not ancillary:
        return journal_fields(data)
    assert data == b"", "a descriptor comes in an empty datagram"
    fds = array.array("i")
    fds.frombytes(ancillary[0][2])
    fd = fds[0]
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        wanted = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        assert seals & wanted == wanted, f"journald refuses an unsealed memfd: seals {seals:#x}"
        return journal_fields(os.pread(fd, os.fstat(fd).st_size, 0))
    finally:
        os.close(fd)
