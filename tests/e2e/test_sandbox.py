"""A real hardened sandbox container from the Debian-built image, checked from inside."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from appliance.sandbox import hardening, image
from appliance.sandbox.podman import PodmanError

NAME = "corral-e2e-hardened"


@pytest.fixture(scope="module")
def container(podman, sandbox_image, tmp_path_factory):
    work = tmp_path_factory.mktemp("work")
    (work / "README").write_text("the project\n")
    os.chown(work, image_host_id(1000), image_host_id(1000))
    podman.run("rm", "--force", "--ignore", NAME)
    spec = hardening.Sandbox(name=NAME, image=sandbox_image, network=None, gateway=None,
                             volumes=((str(work), "/work"),))
    started = time.monotonic()
    podman.run("run", *hardening.run_arguments(spec, ["sleep", "600"]))
    print(f"hardened podman run: {time.monotonic() - started:.2f}s")
    yield spec
    podman.remove_container(NAME)


def image_host_id(inside: int) -> int:
    return hardening.Sandbox.userns_base + inside


def inside(podman, *command: str, check: bool = True):
    return podman.run("exec", NAME, *command, check=check)


def test_not_root_no_capabilities_no_new_privileges(podman, container):
    assert inside(podman, "id", "-u").stdout.strip() == b"1000"
    status = inside(podman, "cat", "/proc/self/status").stdout.decode()
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["CapEff"].strip() == "0000000000000000"
    assert fields["CapPrm"].strip() == "0000000000000000"
    assert fields["CapBnd"].strip() == "0000000000000000"
    assert fields["NoNewPrivs"].strip() == "1"


def test_user_namespace_maps_the_agent_away_from_host_ids(podman, container):
    pid = podman.json("inspect", NAME)[0]["State"]["Pid"]
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    host_uids = {Path(f"/proc/{c}/status").read_text().split("Uid:")[1].split()[0]
                 for c in children}
    assert host_uids == {str(image_host_id(1000))}


def test_root_is_read_only_and_tmp_is_a_small_tmpfs(podman, container):
    for path in ("/x", "/etc/x", "/usr/local/bin/x"):
        assert inside(podman, "touch", path, check=False).returncode != 0
    assert inside(podman, "touch", "/tmp/ok").returncode == 0
    mounts = inside(podman, "cat", "/proc/mounts").stdout.decode()
    assert any(line.split()[1] == "/tmp" and line.split()[2] == "tmpfs" and "size=1048576k"
               in line for line in mounts.splitlines())


def test_init_is_pid_1_and_limits_are_set(podman, container):
    assert inside(podman, "cat", "/proc/1/comm").stdout.strip() in (b"catatonit", b"tini",
                                                                     b"podman-init")
    limits = podman.json("inspect", NAME)[0]["HostConfig"]
    assert limits["Memory"] == 4 * 1024**3 and limits["PidsLimit"] == 2048


def test_no_container_engine_socket_is_reachable(podman, container):
    for socket_path in ("/run/podman/podman.sock", "/var/run/docker.sock",
                        "/run/containerd/containerd.sock", "/var/run/podman/podman.sock"):
        assert inside(podman, "test", "-e", socket_path, check=False).returncode != 0


def test_workspace_is_mounted_and_writable(podman, container):
    assert inside(podman, "cat", "/work/README").stdout == b"the project\n"
    assert inside(podman, "touch", "/work/new-file").returncode == 0


def test_image_carries_the_toolbox_and_the_selftest(podman, container):
    for tool in ("git", "curl", "python3", "node", "npm", "rg", "jq", "ssh", "make", "gcc"):
        assert inside(podman, "sh", "-c", f"command -v {tool}").returncode == 0, tool
    assert b"Probe every bypass class" in inside(podman, "corral-selftest", "--help").stdout
    labels = podman.json("image", "inspect", image.IMAGE)[0]["Labels"]
    assert labels["io.corral.version"] == image.VERSION


def test_podman_errors_carry_podmans_words(podman):
    with pytest.raises(PodmanError, match=r"no such container|no container with name"):
        podman.run("exec", "corral-e2e-does-not-exist", "true")
