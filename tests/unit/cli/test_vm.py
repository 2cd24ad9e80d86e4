"""The VM backend's pure parts: which libvirt driver, how `corral ssh` splits its words, and
what `corral up` refuses before it starts anything."""

from __future__ import annotations

import subprocess

import pytest

from cli import vm
from cli.main import main


def test_the_environment_chooses_the_driver(monkeypatch):
    monkeypatch.setenv("CORRAL_LIBVIRT_DRIVER", "qemu")
    assert vm.driver() == ("qemu", "CORRAL_LIBVIRT_DRIVER")


def test_without_a_choice_a_machine_that_is_a_vm_gets_emulation(monkeypatch):
    """These machines are VMs whose nested KVM hangs: the default must not be kvm here."""
    monkeypatch.delenv("CORRAL_LIBVIRT_DRIVER", raising=False)
    with open("/proc/cpuinfo") as cpuinfo:
        inside_a_vm = " hypervisor" in cpuinfo.read()
    chosen, why = vm.driver()
    if inside_a_vm:
        assert chosen == "qemu" and ("itself a VM" in why or "/dev/kvm" in why)
    else:
        assert chosen in ("kvm", "qemu")


def test_ssh_passes_options_to_ssh_and_quotes_the_remote_command(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(vm, "_vm_appliance", lambda name: type(
        "A", (), {"host_port": ("127.0.0.1", 8443)})())
    monkeypatch.setattr(subprocess, "call", lambda argv, env: calls.append(argv) or 0)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    main(["ssh", "--appliance", "x", "--", "-q", "-t", "sudo", "podman", "exec", "-it", "c",
          "sh", "-c", "echo 'a b'; ls"])
    main(["ssh", "--appliance", "x"])
    assert calls == [
        ["vagrant", "ssh", "--", "-q", "-t",
         "sudo podman exec -it c sh -c 'echo '\"'\"'a b'\"'\"'; ls'"],
        ["vagrant", "ssh"],
    ]


def test_vm_commands_refuse_other_backends(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    directory = tmp_path / "corral" / "appliances" / "local1"
    directory.mkdir(parents=True)
    (directory / "appliance.toml").write_text('endpoint = "127.0.0.1:7443"\nbackend = "local"\n')
    for name in ("ca.crt", "client.crt", "client.key"):
        (directory / name).write_text("x")
    for command in ("provision", "destroy", "verify"):
        assert main([command, "--appliance", "local1"]) == 2
        assert "is not a VM (backend local)" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["provision", "destroy", "ssh", "verify", "down"])
def test_vm_commands_name_a_missing_appliance(monkeypatch, tmp_path, capsys, command):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert main([command, "--appliance", "nope"]) == 4
    assert "no appliance 'nope'" in capsys.readouterr().err
