"""corral's seccomp profile, derived from podman's default: every refused syscall and
namespace flag refused whatever the container's capabilities and architecture, the forms an
agent needs (threads, fork, unshare of files) kept, nothing else changed, nothing the
default refuses allowed. Checked on a default in podman's format with every spelling corral
must handle, and on this host's real default (containers-common) where it is installed."""

from __future__ import annotations

import copy
import errno
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.sandbox import seccomp
from appliance.sandbox.confinement import DEFAULT_PROFILE

from .seccomp_eval import decide

ALLOW = ("SCMP_ACT_ALLOW", None)
EPERM = ("SCMP_ACT_ERRNO", errno.EPERM)
ENOSYS = ("SCMP_ACT_ERRNO", errno.ENOSYS)
NO_CAPS = frozenset()
EVERY_CAP = frozenset({
    "CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_SYSLOG", "CAP_BPF",
    "CAP_PERFMON", "CAP_NET_ADMIN", "CAP_SYS_CHROOT", "CAP_AUDIT_WRITE", "CAP_SYS_MODULE",
    "CAP_SYS_NICE", "CAP_SYS_RAWIO", "CAP_SYS_TIME", "CAP_NET_RAW"})
ARCHES = ("amd64", "arm64", "s390x")
SIGCHLD = 17
# pthread_create's clone flags (glibc): VM, FS, FILES, SIGHAND, THREAD, SYSVSEM, SETTLS,
# PARENT_SETTID, CHILD_CLEARTID
THREAD_FLAGS = 0x003D0F00
CLONE_FS, CLONE_FILES, CLONE_SYSVSEM = 0x200, 0x400, 0x40000
CLONE_NEWUSER = seccomp.NAMESPACE_FLAGS["CLONE_NEWUSER"]
EVERY_NS = 0
for _bit in seccomp.NAMESPACE_FLAGS.values():
    EVERY_NS |= _bit


def podman_like_default() -> dict:
    """A default-deny profile in containers-common's format, with every shape corral meets
    there: one big unconditional allow (Debian 12 allows clone, unshare, setns, mount and
    keyctl in it), capability-gated pairs (bpf, setns: allowed with CAP_SYS_ADMIN, EPERM
    without), an explicit refusal list, argument tests, Docker's singular `name` with its
    masked clone rule, and architecture-only rules."""
    return {
        "defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 38,
        "archMap": [{"architecture": "SCMP_ARCH_X86_64",
                     "subArchitectures": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]}],
        "syscalls": [
            {"names": ["userfaultfd", "vmsplice", "kexec_load"], "action": "SCMP_ACT_ERRNO",
             "args": [], "comment": "", "includes": {}, "excludes": {}, "errnoRet": 1},
            {"names": ["read", "write", "execve", "exit_group", "clone", "clone3", "unshare",
                       "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount",
                       "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "keyctl",
                       "ptrace", "ioctl", "syslog", "fork", "vfork", "wait4"],
             "action": "SCMP_ACT_ALLOW", "args": [], "comment": "", "includes": {},
             "excludes": {}},
            {"names": ["personality"], "action": "SCMP_ACT_ALLOW",
             "args": [{"index": 0, "value": 8, "valueTwo": 0, "op": "SCMP_CMP_EQ"}],
             "comment": "", "includes": {}, "excludes": {}},
            {"names": ["arch_prctl"], "action": "SCMP_ACT_ALLOW", "args": [], "comment": "",
             "includes": {"arches": ["amd64", "x32"]}, "excludes": {}},
            {"names": ["bpf", "perf_event_open", "setns"], "action": "SCMP_ACT_ALLOW",
             "args": [], "comment": "", "includes": {"caps": ["CAP_SYS_ADMIN"]},
             "excludes": {}},
            {"names": ["bpf", "perf_event_open", "setns"], "action": "SCMP_ACT_ERRNO",
             "args": [], "comment": "", "includes": {},
             "excludes": {"caps": ["CAP_SYS_ADMIN"]}, "errnoRet": 1},
            {"names": ["open_by_handle_at"], "action": "SCMP_ACT_ALLOW", "args": [],
             "comment": "", "includes": {"caps": ["CAP_DAC_READ_SEARCH"]}, "excludes": {}},
            {"name": "clone", "action": "SCMP_ACT_ALLOW",
             "args": [{"index": 0, "value": 0x7E020000, "valueTwo": 0,
                       "op": "SCMP_CMP_MASKED_EQ"}],
             "excludes": {"caps": ["CAP_SYS_ADMIN"], "arches": ["s390", "s390x"]}},
            {"names": ["io_uring_setup", "io_uring_enter"], "action": "SCMP_ACT_ALLOW",
             "args": [], "comment": "a newer default might allow io_uring"},
        ],
    }


def host_default() -> dict:
    if not DEFAULT_PROFILE.is_file():
        pytest.skip(f"{DEFAULT_PROFILE} is not here (containers-common, podman's dependency)")
    return json.loads(DEFAULT_PROFILE.read_text())


@pytest.fixture(params=["podman-like", "host"])
def default(request) -> dict:
    return podman_like_default() if request.param == "podman-like" else host_default()


@pytest.fixture
def hardened(default) -> dict:
    return seccomp.harden(default)


def test_namespace_flags_are_the_kernels():
    header = Path("/usr/include/linux/sched.h")
    if not header.is_file():
        pytest.skip("linux/sched.h is not here (linux-libc-dev, which build-essential brings)")
    defined = {name: int(value, 16) for name, value in re.findall(
        r"#define\s+(CLONE_NEW\w+)\s+(0x[0-9a-fA-F]+)", header.read_text())}
    assert defined == seccomp.NAMESPACE_FLAGS


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("caps", [NO_CAPS, EVERY_CAP], ids=["no-caps", "every-cap"])
def test_every_refused_syscall_is_refused_with_its_errno(hardened, caps, arch):
    for name, number in seccomp.REFUSED.items():
        assert decide(hardened, name, caps=caps, arch=arch) == ("SCMP_ACT_ERRNO", number), name


def test_the_refusals_are_the_documented_ones():
    eperm = {n for n, e in seccomp.REFUSED.items() if e == errno.EPERM}
    enosys = {n for n, e in seccomp.REFUSED.items() if e == errno.ENOSYS}
    assert {"setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen",
            "fsconfig", "fsmount", "fspick", "mount_setattr", "keyctl", "add_key",
            "request_key", "bpf", "perf_event_open", "userfaultfd"} <= eperm
    assert enosys == {"clone3", "io_uring_setup", "io_uring_enter", "io_uring_register"}
    assert set(seccomp.JUDGED) == {"clone", "unshare"}


@pytest.mark.parametrize("caps", [NO_CAPS, EVERY_CAP], ids=["no-caps", "every-cap"])
@pytest.mark.parametrize("flag", sorted(seccomp.CLONE_NAMESPACE_FLAGS))
def test_clone_with_any_namespace_flag_is_refused(hardened, flag, caps):
    bit = seccomp.NAMESPACE_FLAGS[flag]
    for arch in ("amd64", "arm64"):
        for flags in (bit | SIGCHLD, bit | CLONE_NEWUSER | SIGCHLD, bit | THREAD_FLAGS,
                      bit | (1 << 40)):  # upper half of the register set too
            assert decide(hardened, "clone", (flags,), caps, arch) == EPERM, (arch, flags)
    # s390 passes the stack first and the flags second
    assert decide(hardened, "clone", (0, bit | SIGCHLD), caps, "s390x") == EPERM
    assert decide(hardened, "clone", (bit | SIGCHLD, 0), caps, "s390x") == ALLOW


@pytest.mark.parametrize("caps", [NO_CAPS, EVERY_CAP], ids=["no-caps", "every-cap"])
@pytest.mark.parametrize("flag", sorted(seccomp.NAMESPACE_FLAGS))
def test_unshare_with_any_namespace_flag_is_refused(hardened, flag, caps):
    bit = seccomp.NAMESPACE_FLAGS[flag]
    for arch in ARCHES:
        for flags in (bit, bit | CLONE_FILES, bit | CLONE_NEWUSER, bit | (1 << 33)):
            assert decide(hardened, "unshare", (flags,), caps, arch) == EPERM, (arch, flags)


@pytest.mark.parametrize("arch", ARCHES)
def test_threads_fork_and_unshare_of_files_are_kept(hardened, arch):
    index = 1 if arch == "s390x" else 0
    for flags in (SIGCHLD, THREAD_FLAGS, 0):
        args = tuple(flags if i == index else 0 for i in range(6))
        assert decide(hardened, "clone", args, NO_CAPS, arch) == ALLOW, (arch, hex(flags))
    for flags in (CLONE_FS, CLONE_FILES, CLONE_SYSVSEM, CLONE_FS | CLONE_FILES, 0):
        assert decide(hardened, "unshare", (flags,), NO_CAPS, arch) == ALLOW, hex(flags)


@settings(max_examples=500, deadline=None)
@given(flags=st.integers(min_value=0, max_value=(1 << 64) - 1),
       caps=st.sampled_from([NO_CAPS, EVERY_CAP]), arch=st.sampled_from(ARCHES))
def test_clone_and_unshare_are_allowed_exactly_without_namespace_flags(flags, caps, arch):
    hardened = seccomp.harden(podman_like_default())
    clone_args = (0, flags) if arch == "s390x" else (flags,)
    clone_mask = EVERY_NS & ~seccomp.NAMESPACE_FLAGS["CLONE_NEWTIME"]
    assert decide(hardened, "clone", clone_args, caps, arch) == (
        ALLOW if flags & clone_mask == 0 else EPERM)
    assert decide(hardened, "unshare", (flags,), caps, arch) == (
        ALLOW if flags & EVERY_NS == 0 else EPERM)


def _sample_args(data) -> tuple[int, ...]:
    return tuple(data.draw(st.sampled_from([0, 1, 8, 9, 16, SIGCHLD, THREAD_FLAGS,
                                            CLONE_NEWUSER, EVERY_NS, (1 << 64) - 1]))
                 for _ in range(3))


def _every_name(*profiles: dict) -> list[str]:
    return sorted({n for p in profiles for r in p["syscalls"]
                   for n in r.get("names") or [r["name"]]} | seccomp.CONFINED)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_hardened_profile_never_allows_what_the_default_refuses(data):
    for default in (podman_like_default(), *(
            [json.loads(DEFAULT_PROFILE.read_text())] if DEFAULT_PROFILE.is_file() else [])):
        hardened = seccomp.harden(default)
        name = data.draw(st.sampled_from(_every_name(default)))
        args, caps = _sample_args(data), data.draw(st.sampled_from([NO_CAPS, EVERY_CAP]))
        arch = data.draw(st.sampled_from(ARCHES))
        after = decide(hardened, name, args, caps, arch)
        before = decide(default, name, args, caps, arch)
        if after == ALLOW:
            assert before in (ALLOW, None), (name, args, caps, arch)
        if name not in seccomp.CONFINED:  # everything corral does not confine is untouched
            assert after == before, (name, args, caps, arch)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_corral_rules_never_disagree_with_each_other(data):
    hardened = seccomp.harden(podman_like_default())
    name = data.draw(st.sampled_from(sorted(seccomp.CONFINED)))
    args = (data.draw(st.integers(0, (1 << 64) - 1)), data.draw(st.integers(0, (1 << 64) - 1)))
    for caps in (NO_CAPS, EVERY_CAP):
        for arch in ARCHES:
            assert decide(hardened, name, args, caps, arch) is not None, (name, args, arch)


def test_no_rule_of_the_default_for_a_confined_syscall_survives(default, hardened):
    corral = seccomp.corral_rules()
    for rule in hardened["syscalls"]:
        if rule not in corral:
            assert not set(rule["names"]) & seccomp.CONFINED, rule
            assert rule["names"], rule
    assert hardened["syscalls"][-len(corral):] == corral


def test_the_rest_of_the_default_is_kept_as_it_was(default, hardened):
    assert {k: v for k, v in hardened.items() if k != "syscalls"} == {
        k: v for k, v in default.items() if k != "syscalls"}
    assert decide(hardened, "ptrace") == decide(default, "ptrace")  # ptrace: podman's call
    assert decide(hardened, "read") == ALLOW


def test_the_default_is_not_modified():
    default = podman_like_default()
    before = copy.deepcopy(default)
    seccomp.harden(default)
    assert default == before


def test_the_profile_is_json_in_podmans_format(hardened):
    again = json.loads(json.dumps(hardened))
    assert again == hardened
    for rule in hardened["syscalls"]:
        assert set(rule) <= {"names", "action", "args", "comment", "includes", "excludes",
                             "errnoRet", "errno"}, rule
        assert all(isinstance(n, str) for n in rule["names"]) and rule["names"]
        for test in rule.get("args") or []:
            assert test["op"].startswith("SCMP_CMP_") and 0 <= test["value"] < 1 << 64


@pytest.mark.parametrize(("broken", "message"), [
    ([], "not a seccomp profile"),
    ({"defaultAction": "SCMP_ACT_ERRNO"}, "not a seccomp profile"),
    ({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}, "default-deny profiles only"),
    ({"defaultAction": "SCMP_ACT_LOG", "syscalls": []}, "default-deny profiles only"),
    ({"defaultAction": "SCMP_ACT_ERRNO", "syscalls": ["read"]}, r"syscalls\[0\] is not a rule"),
    ({"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"action": "SCMP_ACT_ALLOW"}]},
     r"syscalls\[0\] has no list of names"),
    ({"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [
        {"names": ["read"], "action": "SCMP_ACT_ALLOW"},
        {"names": [1], "action": "SCMP_ACT_ALLOW"}]}, r"syscalls\[1\] has no list of names"),
])
def test_a_profile_corral_cannot_harden_is_refused_by_name(broken, message):
    with pytest.raises(seccomp.ProfileError, match=message) as caught:
        seccomp.harden(broken, where="/etc/x/seccomp.json")
    assert "/etc/x/seccomp.json" in str(caught.value)
