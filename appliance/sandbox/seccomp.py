"""The sandbox's seccomp profile: podman's default, with the kernel's riskiest doors shut.

podman's default profile (containers-common's /usr/share/containers/seccomp.json) lets a
process without a single capability create namespaces (`unshare -r id` says uid=0), mount,
use the kernel keyrings and more. A user namespace of its own hands the agent every
capability over it, and with them the kernel code that only root could reach before:
netfilter, overlayfs, mount, most of the container escapes of recent years. An agent that
writes code needs none of that.

`harden(default)` is pure: every syscall named in CONFINED is taken out of every rule of the
default (whatever action, capabilities or arguments it carried) and gets corral's rule
instead; everything else stays as the distribution ships it. So the hardened profile never
allows what the default refuses (a test checks it), follows the distribution's updates (new
syscalls and architectures come with containers-common, Debian 12 and 13 alike), and does
not depend on the container's capabilities: no `--cap-add` reopens what corral shut.

What a refused call gets, so that probes can tell "refused by corral" from "could not run":
  EPERM   clone/unshare with a namespace flag, setns, the mount family, the keyrings, bpf,
          perf_event_open, userfaultfd, open_by_handle_at, syslog
  ENOSYS  clone3 (its flags sit behind a pointer seccomp cannot read: glibc, like Docker's
          profile expects, falls back to clone on ENOSYS) and io_uring (liburing and libuv
          fall back to ordinary syscalls on ENOSYS)
"""

from __future__ import annotations

import copy
import errno

# The namespace flags, as clone(2), unshare(2) and setns(2) spell them.
NAMESPACE_FLAGS = {
    "CLONE_NEWTIME": 0x00000080,
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
# clone(2) keeps the child's exit signal in its low byte (CSIGNAL), where CLONE_NEWTIME's
# bit would be: the kernel takes that flag from clone3 and unshare only.
CLONE_NAMESPACE_FLAGS = {k: v for k, v in NAMESPACE_FLAGS.items() if k != "CLONE_NEWTIME"}

# Where clone(2) takes its flags: the first argument, but the second on s390 (the stack
# comes first there). unshare(2) takes them first everywhere.
_CLONE_FLAGS_SECOND = ["s390", "s390x"]

REFUSED: dict[str, int] = {
    # entering another namespace (a pidfd or /proc/PID/ns/* file)
    "setns": errno.EPERM,
    # the mount family: old API, detached trees, the new mount API
    **dict.fromkeys([
        "mount", "umount", "umount2", "pivot_root", "open_tree", "open_tree_attr",
        "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    ], errno.EPERM),
    # kernel keyrings: shared kernel state, a steady source of CVEs, no use to an agent
    **dict.fromkeys(["keyctl", "add_key", "request_key"], errno.EPERM),
    # eBPF, perf events and userfaultfd: kernel attack surface and the classic exploit aids
    # (userfaultfd pauses the kernel mid-copy; perf and bpf read and run kernel code)
    **dict.fromkeys(["bpf", "perf_event_open", "userfaultfd"], errno.EPERM),
    # files opened by handle, around every path check ("shocker"); the kernel's log, which
    # names kernel addresses and the host's devices
    **dict.fromkeys(["open_by_handle_at", "syslog"], errno.EPERM),
    # flags behind a pointer: ENOSYS so that glibc falls back to clone(2), which is judged
    "clone3": errno.ENOSYS,
    # io_uring runs I/O in kernel threads around seccomp and carries much kernel surface;
    # ENOSYS is "not here", and its users fall back to ordinary syscalls
    **dict.fromkeys(["io_uring_setup", "io_uring_enter", "io_uring_register"], errno.ENOSYS),
}
"""Syscalls refused outright, and the errno the caller gets."""

JUDGED = ("clone", "unshare")
"""Syscalls allowed without a namespace flag and refused (EPERM) with any."""

CONFINED = frozenset(REFUSED) | frozenset(JUDGED)
"""Every syscall whose rules corral writes; the default's rules for them are dropped."""

DENY_ACTIONS = {"SCMP_ACT_ERRNO", "SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS",
                "SCMP_ACT_KILL_THREAD", "SCMP_ACT_TRAP"}


class ProfileError(ValueError):
    """The default profile cannot be hardened; the message names the file and why."""


def _masked(index: int, mask: int, value: int) -> dict:
    """An argument test: (argument & mask) == value. Seccomp sees the whole 64-bit register,
    so a mask also covers whatever a caller puts in the upper half."""
    return {"index": index, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}


def _judged(name: str, flags: dict[str, int], index: int, arches: dict) -> list[dict]:
    """Allowed when no namespace flag is set; EPERM for each flag that is (one rule per flag:
    seccomp has no "masked not-equal", and the rules never overlap with the allow)."""
    every = 0
    for bit in flags.values():
        every |= bit
    rules = [{"names": [name], "action": "SCMP_ACT_ALLOW", "args": [_masked(index, every, 0)],
              "comment": f"corral: {name} without namespace flags (threads, fork, "
                         "unshare of files or fs)", **arches}]
    for flag, bit in flags.items():
        rules.append({"names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM,
                      "args": [_masked(index, bit, bit)],
                      "comment": f"corral: no {flag} (no namespaces inside a sandbox)",
                      **arches})
    return rules


def corral_rules() -> list[dict]:
    """The rules corral adds, in containers-common's format (which podman turns into runc's)."""
    first = {"includes": {}, "excludes": {"arches": _CLONE_FLAGS_SECOND}}
    second = {"includes": {"arches": _CLONE_FLAGS_SECOND}, "excludes": {}}
    anywhere = {"includes": {}, "excludes": {}}
    rules = [*_judged("clone", CLONE_NAMESPACE_FLAGS, 0, first),
             *_judged("clone", CLONE_NAMESPACE_FLAGS, 1, second),
             *_judged("unshare", NAMESPACE_FLAGS, 0, anywhere)]
    by_errno: dict[int, list[str]] = {}
    for name, number in REFUSED.items():
        by_errno.setdefault(number, []).append(name)
    for number, names in sorted(by_errno.items()):
        rules.append({"names": sorted(names), "action": "SCMP_ACT_ERRNO", "errnoRet": number,
                      "args": [], "comment": f"corral: refused ({errno.errorcode[number]})",
                      **anywhere})
    return rules


def _names(rule: object, where: str, position: int) -> list[str]:
    if not isinstance(rule, dict) or not isinstance(rule.get("action"), str):
        raise ProfileError(f"{where}: syscalls[{position}] is not a rule with an action")
    names = rule.get("names")
    if names is None and isinstance(rule.get("name"), str):  # the older, singular spelling
        names = [rule["name"]]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ProfileError(f"{where}: syscalls[{position}] has no list of names")
    return names


def harden(default: object, where: str = "the default profile") -> dict:
    """podman's default profile in, the sandbox's out (a new dict; the input is untouched).
    Raises ProfileError when `default` is not a default-deny profile in podman's format."""
    if not isinstance(default, dict) or not isinstance(default.get("syscalls"), list):
        raise ProfileError(f"{where}: not a seccomp profile (an object with 'syscalls')")
    if default.get("defaultAction") not in DENY_ACTIONS:
        raise ProfileError(f"{where}: defaultAction is {default.get('defaultAction')!r}; "
                           "corral hardens default-deny profiles only (an allow-list)")
    profile = copy.deepcopy(default)
    kept = []
    for position, rule in enumerate(default["syscalls"]):
        names = [n for n in _names(rule, where, position) if n not in CONFINED]
        if names:
            rest = {k: copy.deepcopy(v) for k, v in rule.items() if k not in ("name", "names")}
            kept.append({"names": names, **rest})
    profile["syscalls"] = kept + corral_rules()
    return profile
