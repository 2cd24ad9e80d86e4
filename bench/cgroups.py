"""CPU cgroups for the noisy neighbour, laid out as an appliance has them: the filter in a
cgroup of its own with its unit's CPUWeight (corral-filter.service), each session's processes
in one of their own with podman's default weight (a sandbox is a container: its own scope).

Without them the benchmark runs every process in one cgroup, where the kernel shares the
cores between processes: the filter's event loop, which serves every session, is then one
equal among session B's load generators, and it measured waiting for a core longer than it
ran (3.6 s on the run queue against 3.0 s running, while B flooded; 0.3-0.6 s alone).

cgroup v2 (`cpu.weight`) where the cpu controller is there, else v1 (`cpu.shares`, the same
ratio); neither: the processes stay where they are and `layout()` says so in the results.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/cpu")
SANDBOX_WEIGHT = 100
"""A podman container's CPU weight when none is given (systemd's and the kernel's default)."""


def _root() -> tuple[Path, str] | None:
    with contextlib.suppress(OSError):
        if "cpu" in (V2 / "cgroup.controllers").read_text().split():
            return V2, "v2"
    if (V1 / "cpu.shares").exists():
        return V1, "v1"
    return None


def layout(groups: list[CpuGroup]) -> str:
    """What the noisy neighbour's processes ran in, for its rows."""
    root = _root()
    if root is None or not groups or any(g.path is None for g in groups):
        return "one cgroup for all (no cpu controller here to make one each)"
    return (f"a cgroup each (cgroup {root[1]}): filter weight {FILTER_WEIGHT}, sessions "
            f"{SANDBOX_WEIGHT}")


SLICE = (Path(__file__).resolve().parents[1] / "roles/corral_filter/templates/etc/systemd/system"
         / "corral.slice.j2")
FILTER_WEIGHT = int(re.search(r"^CPUWeight=(\d+)$", SLICE.read_text(), re.M).group(1))
"""The filter's CPU weight, as its slice sets it (roles/corral_filter: corral.slice)."""


class CpuGroup:
    """A cgroup named `name` under the cpu controller's root with `weight` (1-10000, as
    systemd's CPUWeight); `join` is a preexec_fn for a child that should run in it."""

    def __init__(self, name: str, weight: int):
        root = _root()
        self.path: Path | None = None
        if root is None:
            return
        base, version = root
        self.base, path = base, base / name
        try:
            path.mkdir(exist_ok=True)
            if version == "v2":
                with contextlib.suppress(OSError):  # the cpu controller for the children
                    (base / "cgroup.subtree_control").write_text("+cpu")
                (path / "cpu.weight").write_text(str(weight))
            else:
                (path / "cpu.shares").write_text(str(weight * 1024 // 100))
        except OSError:  # a read-only cgroup tree (a container): where they are, then
            with contextlib.suppress(OSError):
                path.rmdir()
            return
        self.path = path

    def join(self) -> None:
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        """Whatever still runs in it goes back to the root; then the group goes."""
        if self.path is None or not self.path.exists():
            return
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (self.base / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.path.rmdir()
