"""The appliance's kernel settings (roles/corral_base, /etc/sysctl.d/60-corral.conf): the
defence in depth under corral's seccomp profile."""

from __future__ import annotations

from tests.unit.test_roles import render


def settings() -> dict[str, str]:
    text = render("corral_base", "etc/sysctl.d/60-corral.conf.j2")
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return dict(tuple(part.strip() for part in line.split("=", 1)) for line in lines)


def test_no_user_namespaces_without_cap_sys_admin_on_the_appliance():
    assert settings()["kernel.unprivileged_userns_clone"] == "0"


def test_the_kernels_other_doors_stay_shut():
    values = settings()
    assert values["kernel.unprivileged_bpf_disabled"] == "1"
    assert values["kernel.yama.ptrace_scope"] == "2"
    assert values["kernel.dmesg_restrict"] == "1"
