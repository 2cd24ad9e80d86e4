"""What runs on the host while the VM tier runs: who listens on a port (`ss -ltnpH`), and
which corral services were started as an appliance (installed under /opt/corral, or with
the roles' configs under /etc/corral), read from /proc.

The VM is the appliance: a provisioning that ran on the host by mistake (a play with a
local connection) would leave services here, and a host process could answer on the port
the CLI uses in place of the VM. Parsing is pure, so tests/unit checks it on given text;
the e2e tier's services (same pytest session, started from .venv with configs in temporary
directories) are neither.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Iterable
from pathlib import Path

SERVICES = {"corral-filter", "corral-api", "corral-sandbox", "corral-firewall"}
APPLIANCE_PATHS = ("/opt/corral/", "/etc/corral/")
"""Where the roles install the services and their configs (corral_base_prefix, templates)."""

_USERS = re.compile(r'\("([^"]*)",pid=(\d+),fd=\d+\)')


def port_owners(ss_listening: str, port: int) -> dict[int, str]:
    """pid -> process name of every socket listening on `port` (any address), from the
    output of `ss -ltnpH` (or -lunpH). A listener whose process ss could not name (not
    root) is pid 0, so that it is never mistaken for nobody."""
    owners: dict[int, str] = {}
    for line in ss_listening.splitlines():
        fields = line.split()
        if len(fields) < 5 or fields[0] not in ("LISTEN", "UNCONN"):
            continue
        local = fields[3]
        if local.rpartition(":")[2] != str(port):
            continue
        users = _USERS.findall(line)
        if not users:
            owners[0] = "(unknown: ss could not name the process)"
        for name, pid in users:
            owners[int(pid)] = name
    return owners


def processes(proc: Path = Path("/proc")) -> dict[int, list[str]]:
    """pid -> argv of every process that can be read (kernel threads have none)."""
    found = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            raw = (entry / "cmdline").read_bytes()
            if raw:
                found[int(entry.name)] = raw.rstrip(b"\0").decode(errors="replace").split("\0")
    return found


def is_corral_service(argv: list[str]) -> bool:
    """A corral service, whichever way it was started: its console script (run directly or
    by an interpreter), or `python -m appliance...`."""
    if any(Path(word).name in SERVICES for word in argv[:2]):
        return True
    return any(a == "-m" and b.startswith("appliance") for a, b in itertools.pairwise(argv))


def appliance_services(table: dict[int, list[str]]) -> dict[int, list[str]]:
    """The corral services among `table` that run as an installed appliance does."""
    return {pid: argv for pid, argv in table.items() if is_corral_service(argv)
            and any(word.startswith(APPLIANCE_PATHS) for word in argv)}


def describe(table: dict[int, list[str]], pids: Iterable[int]) -> str:
    return "; ".join(f"{pid}: {' '.join(table.get(pid, ['?']))}" for pid in pids)
