"""`podman run` arguments of a sandbox: corral's seccomp profile and init always, and an ICMP
echo range the kernel accepts inside the sandbox's user namespace."""

from __future__ import annotations

import pytest

from appliance.sandbox import hardening


def spec(**overrides) -> hardening.Sandbox:
    values = {"name": "corral-s1", "image": "localhost/corral-sandbox:1", "network": "n1",
              "gateway": "10.213.1.1", "seccomp_profile": "/var/lib/x/seccomp.json",
              "init": "/var/lib/x/init", **overrides}
    return hardening.Sandbox(**values)


def options(arguments: list[str], flag: str) -> list[str]:
    """Every value given to `flag`, whether spelled `--flag value` or `--flag=value`."""
    found = [arguments[i + 1] for i, a in enumerate(arguments) if a == flag]
    return found + [a.split("=", 1)[1] for a in arguments if a.startswith(flag + "=")]


def test_a_sandbox_runs_under_corrals_profile_and_init():
    arguments = hardening.run_arguments(spec(), ["sleep", "infinity"])
    image = arguments.index("localhost/corral-sandbox:1")
    flags, command = arguments[:image], arguments[image + 1:]
    assert "seccomp=/var/lib/x/seccomp.json" in options(flags, "--security-opt")
    assert "no-new-privileges" in options(flags, "--security-opt")
    assert "--init" in flags and options(flags, "--init-path") == ["/var/lib/x/init"]
    assert options(flags, "--cap-drop") == ["ALL"]
    assert command == ["sleep", "infinity"]


def test_no_sandbox_without_a_profile_and_an_init():
    with pytest.raises(TypeError, match="seccomp_profile"):
        hardening.Sandbox(name="x", image="i", network=None, gateway=None, init="/i")
    with pytest.raises(TypeError, match="init"):
        hardening.Sandbox(name="x", image="i", network=None, gateway=None,
                          seccomp_profile="/p")


@pytest.mark.parametrize("network", ["n1", None])
def test_icmp_echo_sockets_are_open_to_every_mapped_group_and_no_other(network):
    arguments = hardening.run_arguments(spec(network=network), ["true"])
    (sysctl,) = options(arguments, "--sysctl")
    key, value = sysctl.split("=", 1)
    assert key == "net.ipv4.ping_group_range"
    low, high = map(int, value.split())
    (gidmap,) = options(arguments, "--gidmap")
    inside, _, count = map(int, gidmap.split(":"))
    # runc writes the range inside the user namespace: an unmapped ID there is EINVAL and
    # the container does not start
    assert (low, high) == (inside, inside + count - 1)
    assert low <= spec().gid <= high
