"""The VM backend's pure parts: which libvirt driver, how `corral ssh` splits its words, and
what `corral up` refuses before it starts anything."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from cli import exitcodes, vm
from cli.client import CliError, config_home, write_appliance
from cli.main import main

VM_CPUINFO = "processor\t: 0\nflags\t\t: fpu vme sse2 vmx hypervisor lahf_lm\n"
METAL_CPUINFO = "processor\t: 0\nflags\t\t: fpu vme sse2 vmx lahf_lm\n"
"""A CPU whose model name says 'hypervisor' is not a VM: only the flags line counts."""
METAL_NAMED = "model name\t: hypervisor-ready CPU\n" + METAL_CPUINFO


@pytest.mark.parametrize(("environ", "kvm_opens", "cpuinfo", "chosen", "why"), [
    ({"CORRAL_LIBVIRT_DRIVER": "qemu"}, True, METAL_CPUINFO, "qemu", "CORRAL_LIBVIRT_DRIVER"),
    ({"CORRAL_LIBVIRT_DRIVER": "kvm"}, False, VM_CPUINFO, "kvm", "CORRAL_LIBVIRT_DRIVER"),
    ({}, False, METAL_CPUINFO, "qemu", "no usable /dev/kvm"),
    ({"CORRAL_LIBVIRT_DRIVER": ""}, False, METAL_CPUINFO, "qemu", "no usable /dev/kvm"),
    ({}, True, VM_CPUINFO, "qemu", "this machine is itself a VM"),
    ({}, True, METAL_CPUINFO, "kvm", "KVM"),
    ({}, True, METAL_NAMED, "kvm", "KVM"),
    ({}, True, "", "kvm", "KVM"),
], ids=["env-qemu", "env-kvm-wins", "no-kvm", "empty-env", "inside-a-vm", "metal",
        "metal-named-hypervisor", "no-cpuinfo"])
def test_the_driver_is_decided_from_environment_kvm_and_cpu_flags(environ, kvm_opens, cpuinfo,
                                                                   chosen, why):
    got, reason = vm.driver(environ, kvm_opens=kvm_opens, cpuinfo=cpuinfo)
    assert got == chosen and reason.startswith(why), reason


def test_an_unknown_driver_in_the_environment_is_refused():
    with pytest.raises(CliError, match="'xen' is not a libvirt driver") as raised:
        vm.driver({"CORRAL_LIBVIRT_DRIVER": "xen"}, kvm_opens=True, cpuinfo="")
    assert "kvm or qemu" in raised.value.hint


def test_this_machines_inputs_are_read_when_none_are_given(monkeypatch):
    """Without arguments, driver() reads /dev/kvm and /proc/cpuinfo: the same answer as
    when it is handed what they hold."""
    monkeypatch.delenv("CORRAL_LIBVIRT_DRIVER", raising=False)
    cpuinfo = Path("/proc/cpuinfo").read_text()
    assert vm.driver() == vm.driver({}, kvm_opens=vm._kvm_opens(), cpuinfo=cpuinfo)


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


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent, or no process at all, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _on_path(tmp_path, monkeypatch, **programs: str) -> None:
    """Shell scripts (name -> body) first on PATH, standing in for vagrant and ssh; the CLI's
    config in tmp_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in programs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    # longer than a control socket's directory may be: `corral ssh` makes no master (the
    # tests that want one set a short one)
    runtime = tmp_path / "run" / ("r" * 60)
    runtime.mkdir(parents=True, mode=0o700, exist_ok=True)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("CORRAL_LIBVIRT_DRIVER", "qemu")


def _vm_appliance_x() -> None:
    """Appliance x, a VM, as `corral up` records it (no credentials)."""
    (config_home() / "appliances" / "x").mkdir(parents=True)
    write_appliance("x", "127.0.0.1:9", backend="vm", podman=["podman"], sandbox=["s"])


def test_vagrant_that_goes_silent_is_stopped_at_the_deadline_with_its_process_group(
        monkeypatch, tmp_path):
    """The timeout fires although vagrant prints nothing more: a real process stands in for
    vagrant, prints one line, starts a child (as vagrant starts ssh) and sleeps."""
    pids = tmp_path / "pids"
    _on_path(tmp_path, monkeypatch, vagrant=f"""echo "==> default: Starting domain."
sleep 600 &
echo "$$ $!" > {pids}
wait
""")
    with pytest.raises(CliError) as raised:
        vm._vagrant("x", "up", started=time.monotonic(), timeout=2)
    message = str(raised.value)
    assert "did not finish within 2s" in message and "process group" in message
    assert "Starting domain" in message  # the tail of what it printed
    vagrant_pid, child_pid = (int(p) for p in pids.read_text().split())
    deadline = time.monotonic() + 10  # SIGKILL is sent; dying takes a moment on a busy host
    while (_alive(vagrant_pid) or _alive(child_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(vagrant_pid) and not _alive(child_pid)
    log = tmp_path / "config" / "corral" / "appliances" / "x" / "vagrant.log"
    assert "Starting domain" in log.read_text()


def test_provision_stops_a_silent_vagrant_at_its_timeout(monkeypatch, tmp_path, capsys):
    """`--timeout` reaches vagrant's deadline: a provisioning stuck on an unresponsive VM
    ends with the tail of its output in the time given, not after the default hour."""
    _on_path(tmp_path, monkeypatch,
             vagrant="echo 'TASK [corral_sandbox : Run it]'\nexec sleep 600\n")
    _vm_appliance_x()
    monkeypatch.setattr(vm, "remember_ssh", lambda name: vm.known_hosts_file(name).write_text(
        f"{vm.host_alias(name)} ssh-ed25519 AAAA\n"))  # the VM's keys, kept
    started = time.monotonic()
    code = main(["provision", "--appliance", "x", "--timeout", "2"])
    assert code != 0 and time.monotonic() - started < 60
    err = capsys.readouterr().err
    assert "`vagrant provision` did not finish within 2s" in err, err
    assert "TASK [corral_sandbox : Run it]" in err, err


def test_vagrant_that_fails_reports_its_exit_and_output(monkeypatch, tmp_path):
    _on_path(tmp_path, monkeypatch, vagrant="echo 'boom: no such box'\nexit 3\n")
    with pytest.raises(CliError, match=r"failed \(exit 3\):\n  boom: no such box"):
        vm._vagrant("x", "up", started=time.monotonic())


def test_trust_ca_is_checked_before_anything_starts(monkeypatch, tmp_path, capsys):
    """A file that is missing or holds no certificate is refused with its name: the role
    would copy it into the appliance's store, where it would silently trust nothing."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setattr(vm, "prerequisites", lambda: pytest.fail("started"))
    (tmp_path / "notes.txt").write_text("not a certificate\n")
    assert main(["up", "--trust-ca", str(tmp_path / "missing.pem")]) == 2
    assert "--trust-ca" in (err := capsys.readouterr().err) and "missing.pem" in err
    assert main(["up", "--trust-ca", str(tmp_path / "notes.txt")]) == 2
    assert "notes.txt: no PEM certificate in it" in capsys.readouterr().err
    from appliance import pki

    bundle = pki.issue()
    (tmp_path / "with-key.pem").write_bytes(bundle.client_key + bundle.ca_cert)
    assert main(["up", "--trust-ca", str(tmp_path / "with-key.pem")]) == 2
    assert "it holds a private key too" in capsys.readouterr().err
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "proxy.crt").write_bytes(bundle.ca_cert)
    (tmp_path / "proxy.pem").write_bytes(bundle.ca_cert)
    assert main(["up", "--trust-ca", str(tmp_path / "a" / "proxy.crt"), "--trust-ca",
                 str(tmp_path / "proxy.pem")]) == 2
    assert "would be one file in the appliance's store" in capsys.readouterr().err
    assert main(["up", "--backend", "local", "--trust-ca", str(tmp_path / "proxy.pem")]) == 2
    assert "--trust-ca is for a VM" in capsys.readouterr().err


def test_trusted_cas_are_recorded_and_handed_to_vagrant(monkeypatch, tmp_path):
    """`corral up --trust-ca` records the files; every later vagrant run (provision too) gets
    them in CORRAL_EXTRA_CA_FILES, which the Vagrantfile hands to corral_base."""
    from appliance import pki

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("CORRAL_LIBVIRT_DRIVER", "qemu")
    bundle = pki.issue()
    ca = tmp_path / "proxy-ca.pem"
    ca.write_bytes(bundle.ca_cert)
    assert vm.trusted_cas([str(ca)]) == [str(ca)]
    vagrant_runs = []
    _up_without_a_vm(monkeypatch, vagrant_runs)
    assert main(["up", "--name", "lab", "--trust-ca", str(ca)]) == 0
    assert main(["up", "--name", "lab"]) == 0  # not given again: the record stands
    assert [extra for _, extra, _ in vagrant_runs] == [str(ca)] * 3  # up, provision, up
    assert vm.vagrant_env("other")["CORRAL_EXTRA_CA_FILES"] == ""
    vagrantfile = (vm.ROOT / "Vagrantfile").read_text()
    assert 'corral_base_extra_ca_files: ENV.fetch("CORRAL_EXTRA_CA_FILES"' in vagrantfile


def test_a_recorded_ca_that_went_is_named_with_where_it_was_recorded(monkeypatch, tmp_path,
                                                                     capsys):
    from appliance import pki

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("CORRAL_LIBVIRT_DRIVER", "qemu")
    _up_without_a_vm(monkeypatch, [])
    ca = tmp_path / "proxy.crt"
    ca.write_bytes(pki.issue().ca_cert)
    assert vm.trusted_cas([str(ca), str(tmp_path / "." / "proxy.crt")]) == [str(ca)]
    assert main(["up", "--name", "lab", "--trust-ca", str(ca)]) == 0
    ca.unlink()
    assert main(["up", "--name", "lab"]) == 2
    err = capsys.readouterr().err
    assert "proxy.crt" in err and "recorded in" in err and "appliance.toml" in err


def _up_without_a_vm(monkeypatch, runs: list, keys: bool = True, machine_id: str = "a-uuid",
                     booting: float = 0.0, failing: tuple[str, ...] = ()) -> None:
    """`corral up` with vagrant, the VM and its host keys stood in for: each vagrant run is
    recorded as (its words, CORRAL_EXTRA_CA_FILES, CORRAL_SSH_PINNED_ARGS), an `up` (taking
    `booting` seconds) records the machine as vagrant does (`machine_id`), and the VM's keys
    are kept where none are (unless `keys` is False); a run of a verb in `failing` fails
    (an `up` after making the machine)."""
    def vagrant(name, *args, **kw):
        env = vm.vagrant_env(name)
        runs.append((args, env["CORRAL_EXTRA_CA_FILES"], env.get("CORRAL_SSH_PINNED_ARGS")))
        if args[0] == "provision" and "provision" in failing:
            raise CliError("`vagrant provision` failed (exit 1)")
        if args[0] == "up":
            time.sleep(booting)
            machine = config_home() / "appliances" / name / "vagrant" / "machines" / "default"
            (machine / "libvirt").mkdir(parents=True, exist_ok=True)
            (machine / "libvirt" / "id").write_text(machine_id)
            if "up" in failing:
                raise CliError("`vagrant up` failed (exit 1): timed out waiting for SSH")

    def remember(name):
        if keys and not vm.known_hosts_file(name).exists():
            vm.known_hosts_file(name).write_text(f"{vm.host_alias(name)} ssh-ed25519 "
                                                 f"{machine_id}\n")

    monkeypatch.setattr(vm, "prerequisites", lambda: [])
    monkeypatch.setattr(vm, "_quiet", lambda argv: vm.box.BOX_NAME)
    monkeypatch.setattr(vm, "_wait_for_api", lambda name: None)
    monkeypatch.setattr(vm, "_vagrant", vagrant)
    monkeypatch.setattr(vm, "remember_ssh", remember)


def test_a_new_vm_is_provisioned_only_once_its_host_keys_are_kept(monkeypatch, tmp_path,
                                                                  capsys):
    """Provisioning sends the appliance's credentials: a new VM is booted without it, its
    host keys kept, then provisioned by Vagrant's Ansible with the options that check them
    (the Vagrantfile turns host key checking on with them). A VM Vagrant made already is
    only booted (Vagrant provisions a VM when it makes it). No keys: no provisioning."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("CORRAL_LIBVIRT_DRIVER", "qemu")
    runs: list = []
    _up_without_a_vm(monkeypatch, runs)
    assert main(["up", "--name", "lab"]) == 0
    assert [words for words, _, _ in runs] == [
        ("up", "--provider", "libvirt", "--no-provision"), ("provision",)]
    pinned = runs[1][2]
    assert shlex.split(pinned) == [
        "-o", f'UserKnownHostsFile="{vm.known_hosts_file("lab")}"',
        "-o", "GlobalKnownHostsFile=/dev/null", "-o", "HostKeyAlias=corral-appliance-lab",
        "-o", "StrictHostKeyChecking=yes"]
    assert main(["up", "--name", "lab"]) == 0  # the same machine: booted, not provisioned
    assert [words for words, _, _ in runs[2:]] == [("up", "--provider", "libvirt",
                                                     "--no-provision")]
    # the VM removed outside corral: Vagrant makes another (another id); the keys kept
    # were the last one's, so they go, and the new one's are kept before provisioning
    runs.clear()
    _up_without_a_vm(monkeypatch, runs, machine_id="another-uuid")
    assert main(["up", "--name", "lab"]) == 0
    assert [words for words, _, _ in runs] == [
        ("up", "--provider", "libvirt", "--no-provision"), ("provision",)]
    assert vm.known_hosts_file("lab").read_text().split()[-1] == "another-uuid"
    vagrantfile = (vm.ROOT / "Vagrantfile").read_text()
    assert 'ENV.fetch("CORRAL_SSH_PINNED_ARGS", "")' in vagrantfile
    assert "ansible.host_key_checking = true" in vagrantfile
    runs.clear()
    _up_without_a_vm(monkeypatch, runs, keys=False)
    assert main(["up", "--name", "new"]) == exitcodes.NOT_CONFIGURED
    assert [words for words, _, _ in runs] == [("up", "--provider", "libvirt",
                                                 "--no-provision")]
    err = capsys.readouterr().err
    assert "no host keys kept" in err and "corral provision --appliance new" in err
    assert main(["provision", "--appliance", "new"]) == exitcodes.NOT_CONFIGURED
    assert len(runs) == 1
    # one --timeout for the boot and the provisioning: none left, none started
    runs.clear()
    _up_without_a_vm(monkeypatch, runs, booting=1.2)
    assert main(["up", "--name", "slow", "--timeout", "1"]) == exitcodes.FAILURE
    assert [words for words, _, _ in runs] == [("up", "--provider", "libvirt",
                                                 "--no-provision")]
    assert "took all of 1s: not provisioned" in capsys.readouterr().err


def test_a_vm_whose_boot_or_provisioning_failed_is_provisioned_by_the_next_up(monkeypatch,
                                                                              tmp_path):
    """Vagrant provisions a VM on the `up` that makes it; corral boots it first (its keys
    kept), so a boot that fails, or a provisioning, would leave a VM the next `up` only
    booted: it is marked until its provisioning is done, and the next `up` provisions it.
    `corral provision` and `destroy` end the mark."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("CORRAL_LIBVIRT_DRIVER", "qemu")
    for failing in ("up", "provision"):
        runs: list = []
        _up_without_a_vm(monkeypatch, runs, failing=(failing,))
        assert main(["up", "--name", failing]) == exitcodes.FAILURE
        _up_without_a_vm(monkeypatch, runs)
        assert main(["up", "--name", failing]) == 0
        assert [words for words, _, _ in runs][-2:] == [
            ("up", "--provider", "libvirt", "--no-provision"), ("provision",)], failing
        assert not vm._pending_file(failing).exists()
        assert main(["up", "--name", failing]) == 0  # provisioned: booted only
        assert runs[-1][0] == ("up", "--provider", "libvirt", "--no-provision")
    _up_without_a_vm(monkeypatch, runs := [], failing=("provision",))
    assert main(["up", "--name", "third"]) == exitcodes.FAILURE
    assert vm._pending_file("third").exists()
    _up_without_a_vm(monkeypatch, runs)
    assert main(["provision", "--appliance", "third"]) == 0
    assert not vm._pending_file("third").exists()
    _up_without_a_vm(monkeypatch, runs, failing=("provision",))
    assert main(["up", "--name", "fourth"]) == exitcodes.FAILURE
    monkeypatch.setattr(vm, "stop_ssh_master", lambda name, command="exit": None)
    assert main(["destroy", "--appliance", "fourth"]) == 0
    assert not vm._pending_file("fourth").exists()


def test_an_up_cut_short_after_vagrant_made_another_vm_is_decided_by_the_next(monkeypatch,
                                                                              tmp_path):
    """The VM removed outside Vagrant (its id left), and the `up` that makes the next one
    cut short after Vagrant recorded it: the next `up` still sees another machine (the id
    before was written down), drops the last VM's keys and provisions the new one. A
    destroy that fails keeps the VM's keys; `--no-provision` then a plain `up` provisions
    (as Vagrant's own `up` would have)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("CORRAL_LIBVIRT_DRIVER", "qemu")
    _up_without_a_vm(monkeypatch, runs := [])
    assert main(["up", "--name", "lab"]) == 0
    _up_without_a_vm(monkeypatch, runs, machine_id="second-uuid", failing=("up",))
    assert main(["up", "--name", "lab"]) == exitcodes.FAILURE
    _up_without_a_vm(monkeypatch, runs, machine_id="second-uuid")
    runs.clear()
    assert main(["up", "--name", "lab"]) == 0
    assert [words for words, _, _ in runs] == [
        ("up", "--provider", "libvirt", "--no-provision"), ("provision",)]
    assert vm.known_hosts_file("lab").read_text().split()[-1] == "second-uuid"

    def failed_destroy(name, *args, **kw):
        raise CliError("`vagrant destroy -f` failed (exit 1)")

    monkeypatch.setattr(vm, "_vagrant", failed_destroy)
    assert main(["destroy", "--appliance", "lab"]) == exitcodes.FAILURE
    assert vm.known_hosts_file("lab").exists()

    _up_without_a_vm(monkeypatch, runs := [])
    assert main(["up", "--name", "later", "--api-port", "8450", "--no-provision"]) == 0
    assert main(["up", "--name", "later"]) == 0
    assert [words for words, _, _ in runs] == [
        ("up", "--provider", "libvirt", "--no-provision"),
        ("up", "--provider", "libvirt", "--no-provision"), ("provision",)]


def test_no_pinned_options_for_a_path_ansible_or_ssh_would_read_as_another(monkeypatch,
                                                                             tmp_path):
    for mark in ("{{ x }}", "{%", "{#", "${HOME}"):
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / mark))
        vm.known_hosts_file("x").parent.mkdir(parents=True)
        vm.known_hosts_file("x").write_text("corral-appliance-x ssh-ed25519 AAAA\n")
        with pytest.raises(CliError, match=r"would read|reads as a variable") as refused:
            vm.pinned_ssh_args("x")
        assert "XDG_CONFIG_HOME" in refused.value.hint
        assert "CORRAL_SSH_PINNED_ARGS" not in vm.vagrant_env("x")
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/config")  # Vagrant runs Ansible elsewhere
    monkeypatch.chdir(tmp_path)
    vm.known_hosts_file("x").parent.mkdir(parents=True)
    vm.known_hosts_file("x").write_text("corral-appliance-x ssh-ed25519 AAAA\n")
    assert f'UserKnownHostsFile="{tmp_path}/relative/config/' in vm.pinned_ssh_args("x")


def test_a_vm_booted_without_provisioning_can_be_destroyed(monkeypatch, tmp_path, capsys):
    """`corral up --no-provision` runs `vagrant up --no-provision`, waits for no API and
    writes no credentials; the machine's commands (destroy above all) work without them."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("CORRAL_LIBVIRT_DRIVER", "qemu")
    runs = []
    monkeypatch.setattr(vm, "prerequisites", lambda: [])
    monkeypatch.setattr(vm, "_quiet", lambda argv: vm.box.BOX_NAME)
    monkeypatch.setattr(vm, "_wait_for_api", lambda name: pytest.fail("waited for an API"))
    monkeypatch.setattr(vm, "_vagrant", lambda name, *args, **kw: runs.append((name, args)))
    assert main(["up", "--name", "two", "--api-port", "8444", "--no-provision"]) == 0
    assert runs == [("two", ("up", "--provider", "libvirt", "--no-provision"))]
    assert "ansible-playbook -i INVENTORY playbooks/site.yml" in capsys.readouterr().out
    directory = tmp_path / "corral" / "appliances" / "two"
    assert not (directory / "client.key").exists()
    assert main(["destroy", "--appliance", "two"]) == 0
    assert runs[-1] == ("two", ("destroy", "-f"))
    assert main(["status", "--appliance", "two"]) == 4  # the API's commands do need them


SSH_CONFIG = """Host default
  HostName 192.168.121.7
  User vagrant
  Port 22
  UserKnownHostsFile /dev/null
  StrictHostKeyChecking no
  PasswordAuthentication no
  IdentityFile /keys/private_key
  IdentitiesOnly yes
  LogLevel FATAL
"""


HOST_KEY = "AAAAC3NzaC1lZDI1NTE5AAAAIHostKeyOfTheVmStandInXXXXXXXXXXXXXXXXXXXX"


def _fake_ssh_tools(tmp_path, monkeypatch, config: str = SSH_CONFIG) -> Path:
    """`vagrant` answering ssh-config with `config` (and recording any other call), `ssh`
    recording its words, one call a line, in the file returned, and `ssh-keyscan` answering
    a host key (and a comment, and a line that is none) for whatever it is asked. (A real
    VM's ssh: tests/integration/test_vm_ssh.py.)"""
    calls = tmp_path / "calls"
    (tmp_path / "ssh-config").write_text(config)
    _on_path(tmp_path, monkeypatch,
             vagrant=f"""if [ "$1" = ssh-config ]; then cat {tmp_path / 'ssh-config'}; exit 0; fi
echo "vagrant $*" >> {calls}
""", ssh=f'echo "ssh $*" >> {calls}\n', **{"ssh-keyscan": f"""echo "ssh-keyscan $*" >> {calls}
for last; do :; done
echo "# $last:22 SSH-2.0-OpenSSH_9.2p1 Debian"
echo "$last ssh-ed25519 {HOST_KEY}"
echo "$last ssh-ed25519 not;base64"
"""})
    _vm_appliance_x()
    return calls


def test_ssh_runs_ssh_itself_with_the_config_vagrant_gave_once(monkeypatch, tmp_path):
    """Each `vagrant ssh` starts Ruby: a VM's every `corral shell` paid it. Once `corral up`
    kept vagrant's ssh-config, `corral ssh` runs ssh with it, the same words as before."""
    calls = _fake_ssh_tools(tmp_path, monkeypatch)
    runtime = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))  # short: a socket's path
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    try:
        _ssh_runs_ssh_itself(calls, runtime / "corral-ssh")
    finally:
        shutil.rmtree(runtime)


def _ssh_runs_ssh_itself(calls: Path, control: Path) -> None:
    vm.remember_ssh("x")
    kept, pinned = vm.ssh_config_file("x"), vm.known_hosts_file("x")
    assert kept.read_text() == SSH_CONFIG and kept.stat().st_mode & 0o777 == 0o600
    assert pinned.read_text() == f"corral-appliance-x ssh-ed25519 {HOST_KEY}\n"
    assert pinned.stat().st_mode & 0o777 == 0o600
    assert main(["ssh", "--appliance", "x", "--", "-q", "-t", "sudo", "echo", "a b"]) == 0
    assert calls.read_text() == (
        "ssh-keyscan -T 30 -p 22 -t ssh-ed25519,ecdsa-sha2-nistp256,ecdsa-sha2-nistp384,"
        "ecdsa-sha2-nistp521,ssh-rsa 192.168.121.7\n"
        "ssh -p 22 -o LogLevel=FATAL -o Compression=yes -o IdentitiesOnly=yes "
        f'-o StrictHostKeyChecking=yes -o UserKnownHostsFile="{pinned}" '
        "-o GlobalKnownHostsFile=/dev/null -o HostKeyAlias=corral-appliance-x "
        "-o ConnectTimeout=30 "
        "-i /keys/private_key -q -t "
        # a master connection per VM, named for the appliance and where its VM answers
        f'-o ControlMaster=auto -o ControlPath="{control}/{_socket_name()}" '
        "-o ControlPersist=300 -o ServerAliveInterval=10 -o ServerAliveCountMax=3 "
        "vagrant@192.168.121.7 sudo echo 'a b'\n")
    assert control.stat().st_mode & 0o777 == 0o700


def _socket_name() -> str:
    where = (str(vm.known_hosts_file("x")).encode(), b"vagrant", b"192.168.121.7", b"22")
    return hashlib.sha256(b"\0".join(where)).hexdigest()[:32]


def test_the_control_directory_is_private_or_not_used(monkeypatch, tmp_path):
    """Whoever reaches a master's socket runs commands on the VM: its directory is this
    user's alone. One that someone else may enter, a symlink put in its place, or a path
    too long for a socket's, and `corral ssh` makes no master."""
    runtime = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    kept = {"ansible_user": "u", "ansible_host": "h", "ansible_port": "22"}
    try:
        assert vm.control_directory() == runtime / "corral-ssh"
        assert "ControlMaster=auto" in vm.multiplexed("x", kept)
        (runtime / "corral-ssh").chmod(0o750)
        assert vm.control_directory() is None and vm.multiplexed("x", kept) == []
        (runtime / "corral-ssh").rmdir()
        (runtime / "elsewhere").mkdir(mode=0o700)
        (runtime / "corral-ssh").symlink_to(runtime / "elsewhere")
        assert vm.control_directory() is None
        (runtime / "corral-ssh").unlink()
        (runtime / "corral-ssh").mkdir(mode=0o700)
        os.chown(runtime / "corral-ssh", 65534, -1)  # someone else's (the test runs as root)
        assert vm.control_directory() is None
        long = tmp_path / ("d" * 60)
        long.mkdir(mode=0o700)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(long))
        assert vm.control_directory() is None and not (long / "corral-ssh").exists()
        dollar = runtime / "d${HOME}"  # ssh would expand it: another directory than this
        dollar.mkdir(mode=0o700)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(dollar))
        assert vm.control_directory() is None and not (dollar / "corral-ssh").exists()
    finally:
        shutil.rmtree(runtime)


def test_the_control_directorys_parent_lets_no_one_else_replace_it(tmp_path):
    """Checking the directory is not enough where another user may rename it away and put
    their own (with a socket that reads the commands) between the check and ssh: its
    parent is this user's with no access for others, or root's and not writable by
    others or sticky (as /tmp). Not $TMPDIR: anyone's choice."""
    me = os.getuid()
    parent = tmp_path / "parent"
    parent.mkdir(mode=0o700)
    os.chmod(parent, 0o700)
    cases = [(0, 0o700, True), (0, 0o755, True), (0, 0o777, False), (0, 0o1777, True),
             (65534, 0o700, False), (65534, 0o1777, False)]
    for owner, mode, trusted in cases:
        os.chown(parent, owner, -1)
        os.chmod(parent, mode)
        assert vm._owned_parent(parent, me) is trusted, (owner, oct(mode))
    assert vm._owned_parent(tmp_path / "missing", me) is False
    (tmp_path / "link").symlink_to(parent)
    assert vm._owned_parent(tmp_path / "link", me) is False


def test_ssh_that_cannot_connect_says_where_its_address_came_from(monkeypatch, tmp_path,
                                                                  capsys):
    """A VM stopped or started outside corral leaves the kept address stale: ssh's own
    words are hidden (LogLevel=FATAL, -q), so corral names the file and the fix."""
    calls = _fake_ssh_tools(tmp_path, monkeypatch)
    _on_path(tmp_path, monkeypatch, ssh=f'echo "ssh $*" >> {calls}\nexit 255\n')
    vm.remember_ssh("x")
    assert main(["ssh", "--appliance", "x", "--", "-q", "true"]) == 255
    err = capsys.readouterr().err
    assert str(vm.ssh_config_file("x")) in err and "corral up --name x" in err, err


@pytest.mark.parametrize("given", ["0", "-5", "nan", "inf", "soon"])
def test_a_timeout_must_be_seconds_above_zero(given, capsys):
    with pytest.raises(SystemExit):
        main(["provision", "--appliance", "x", "--timeout", given])
    assert "is not a number of seconds above 0" in capsys.readouterr().err


def test_ssh_goes_through_vagrant_without_a_kept_config(monkeypatch, tmp_path, capsys):
    """An ssh-config vagrant gave without an address is not kept (nor one that failed), and
    `corral down` and `destroy` drop the kept one: a VM started again may have another."""
    calls = _fake_ssh_tools(tmp_path, monkeypatch, config="Host default\n  User vagrant\n")
    vm.remember_ssh("x")
    assert not vm.ssh_config_file("x").exists()
    assert "goes through vagrant" in capsys.readouterr().err
    assert main(["ssh", "--appliance", "x", "--", "-q", "true"]) == 0
    assert calls.read_text() == "vagrant ssh -- -q true\n"
    assert "which checks no host key" in capsys.readouterr().err  # said, every time
    for command, keys_stay in (("down", True), ("destroy", False)):  # the same VM, or none
        vm.ssh_config_file("x").write_text(SSH_CONFIG)
        vm.known_hosts_file("x").write_text(f"corral-appliance-x ssh-ed25519 {HOST_KEY}\n")
        assert main([command, "--appliance", "x"]) == 0
        assert not vm.ssh_config_file("x").exists(), command
        assert vm.known_hosts_file("x").exists() is keys_stay, command


def test_keys_kept_stay_as_they_were_and_a_vm_with_others_is_named(monkeypatch, tmp_path,
                                                                   capsys):
    """A later `up` or `provision` keeps the first keys (trusting what answers then would
    trust on every use, not the first); a VM answering with none of them is named, and
    `corral ssh` is left to refuse it, never sent through vagrant, which checks none."""
    _fake_ssh_tools(tmp_path, monkeypatch)
    pinned = vm.known_hosts_file("x")
    pinned.write_text("corral-appliance-x ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOther\n")
    vm.remember_ssh("x")
    assert pinned.read_text() == "corral-appliance-x ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOther\n"
    err = capsys.readouterr().err
    assert "answers with none of the host keys kept in" in err and str(pinned) in err, err
    assert vm.ssh_config_file("x").exists()  # so `corral ssh` checks, and refuses
    pinned.write_text(f"corral-appliance-x ssh-ed25519 {HOST_KEY}\n")
    vm.remember_ssh("x")
    assert "none of the host keys" not in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../x", "a/b", "_x", "", "a b", "${HOME}", "a" * 64])
def test_an_appliance_name_is_a_plain_word(name, capsys):
    """It names a directory under the CLI's config, a libvirt domain and a known_hosts
    alias: `../x` wrote outside the config, `${HOME}` is expanded by ssh in a path."""
    with pytest.raises(SystemExit):
        main(["up", "--name", name])
    assert "is not an appliance name" in capsys.readouterr().err


VAGRANTFILE_READER = """
# The Vagrantfile's settings as JSON: a stand-in for Vagrant's config objects that keeps
# whatever is set on it (a block's object under "NAME:FIRST ARGUMENT").
require "json"
class Kept
  def initialize; @kept = {}; end
  def method_missing(name, *args, &block)
    key = name.to_s
    return @kept[key.chomp("=")] = args[0] if key.end_with?("=")
    return block.call(@kept["#{key}:#{args[0]}"] = Kept.new) if block
    @kept[key] ||= Kept.new
  end
  def respond_to_missing?(*) = true
  def to_h = @kept.transform_values { |v| v.is_a?(Kept) ? v.to_h : v }
end
module Vagrant
  def self.configure(_version) = yield($config = Kept.new)
end
load ARGV[0]
puts JSON.generate($config.to_h)
"""


def _vagrantfile_settings(tmp_path, env: dict[str, str]) -> dict:
    reader = tmp_path / "read.rb"
    reader.write_text(VAGRANTFILE_READER)
    read = subprocess.run(["ruby", str(reader), str(vm.ROOT / "Vagrantfile")],
                          capture_output=True, text=True, timeout=60, check=True,
                          env={k: v for k, v in {**os.environ, **env}.items() if v is not None})
    return json.loads(read.stdout)["vm"]["provision:ansible"]


def test_the_vagrantfile_turns_host_key_checking_on_with_the_options_corral_gives(
        monkeypatch, tmp_path):
    """Vagrant's Ansible provisioner checks no host key unless `host_key_checking` is set;
    then it adds no UserKnownHostsFile=/dev/null and passes ANSIBLE_HOST_KEY_CHECKING=true,
    and its raw_ssh_args end ANSIBLE_SSH_ARGS (joined with spaces; Ansible splits them as a
    shell would). The real Vagrantfile, read by Ruby; what it gives ssh, read by `ssh -G`."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "a config's %h home"))
    vm.known_hosts_file("x").parent.mkdir(parents=True)
    vm.known_hosts_file("x").write_text("corral-appliance-x ssh-ed25519 AAAA\n")
    pinned = vm.pinned_ssh_args("x")
    checking = _vagrantfile_settings(tmp_path, {"CORRAL_SSH_PINNED_ARGS": pinned})
    assert checking["host_key_checking"] is True and checking["raw_ssh_args"][-1] == pinned
    ssh_args = shlex.split(" ".join(checking["raw_ssh_args"]))  # as Vagrant, then Ansible
    seen = subprocess.run(["ssh", "-G", *ssh_args, "vagrant@192.0.2.1"], capture_output=True,
                          text=True, timeout=30, check=True).stdout.splitlines()
    assert f"userknownhostsfile {vm.known_hosts_file('x')}" in seen
    assert {"stricthostkeychecking true", "globalknownhostsfile /dev/null",
            "hostkeyalias corral-appliance-x"} <= set(seen)
    plain = _vagrantfile_settings(tmp_path, {"CORRAL_SSH_PINNED_ARGS": None})
    assert "host_key_checking" not in plain  # a plain `vagrant up`: as Vagrant does
    assert plain["raw_ssh_args"] == checking["raw_ssh_args"][:-1]
