"""The VM backend: `corral up` (default), `provision`, `down`, `destroy`, `ssh`, `verify`,
and the VM half of `status`. Vagrant (vagrant-libvirt) runs the repository's Vagrantfile;
each appliance keeps its Vagrant state in its own config directory, so several can coexist.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path

from . import box, exitcodes, files, inventory, manifests, output
from .arguments import machine_command, vm_timeout
from .client import (
    Client,
    CliError,
    config_home,
    known_appliances,
    load_appliance,
    write_appliance,
)

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PHASES = [  # what vagrant prints -> what the user is told
    (re.compile(r"Creating image \(snapshot of base box volume\)|Uploading base box image"),
     "copying the box into libvirt's pool"),
    (re.compile(r"Starting domain"), "booting the VM"),
    (re.compile(r"Waiting for domain to get an IP address"), "waiting for the VM's network"),
    (re.compile(r"Waiting for machine to boot"), "waiting for SSH"),
    (re.compile(r"Running provisioner: ansible"), "provisioning with playbooks/site.yml"),
    (re.compile(r"TASK \[(corral_\w+) : "), "role {0}"),
    (re.compile(r"PLAY RECAP"), "provisioned"),
]


DRIVERS = ("kvm", "qemu")
"""The libvirt drivers vagrant-libvirt knows: hardware virtualisation, or plain emulation."""


def driver(environ: Mapping[str, str] | None = None, kvm_opens: bool | None = None,
           cpuinfo: str | None = None) -> tuple[str, str]:
    """The libvirt driver and why: the environment's choice, else kvm where it works.

    Decided from three inputs, each read from this machine unless given: the environment
    (CORRAL_LIBVIRT_DRIVER), whether /dev/kvm opens for reading and writing, and
    /proc/cpuinfo (a `hypervisor` flag: this machine is itself a VM)."""
    environ = os.environ if environ is None else environ
    chosen = environ.get("CORRAL_LIBVIRT_DRIVER")
    if chosen:
        if chosen not in DRIVERS:
            raise CliError(f"CORRAL_LIBVIRT_DRIVER={chosen!r} is not a libvirt driver",
                           "set it to kvm or qemu, or unset it to let corral choose",
                           exitcodes.USAGE)
        return chosen, "CORRAL_LIBVIRT_DRIVER"
    if not (_kvm_opens() if kvm_opens is None else kvm_opens):
        return "qemu", "no usable /dev/kvm: plain emulation (slow, but it works)"
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    if re.search(r"^flags\s*:.*\bhypervisor\b", cpuinfo, re.MULTILINE):
        return "qemu", ("this machine is itself a VM, where nested KVM is unreliable (it hangs "
                        "after the bootloader on some hosts): plain emulation; set "
                        "CORRAL_LIBVIRT_DRIVER=kvm to try KVM")
    return "kvm", "KVM"


def _kvm_opens() -> bool:
    try:
        os.close(os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC))
    except OSError:
        return False
    return True


def prerequisites() -> list[str]:
    missing = []
    if shutil.which("vagrant") is None:
        missing.append("vagrant is missing: sudo apt-get install vagrant vagrant-libvirt")
    elif not list(Path("/usr/share/vagrant-plugins/plugins.d").glob("*libvirt*")) and (
            "vagrant-libvirt" not in _quiet(["vagrant", "plugin", "list"])):
        missing.append("the vagrant-libvirt plugin is missing: sudo apt-get install "
                       "vagrant-libvirt")
    if not (BIN / "ansible-playbook").exists():
        missing.append("ansible-playbook is missing from corral's environment: run "
                       "scripts/setup")
    try:
        import libvirt

        libvirt.open("qemu:///system").close()
    except ImportError:
        missing.append("the libvirt Python bindings are missing: sudo apt-get install "
                       "python3-libvirt, then scripts/setup links them")
    except Exception as exc:  # libvirt.libvirtError: the daemon does not answer
        missing.append(f"libvirtd does not answer ({str(exc).strip()}): sudo systemctl start "
                       "libvirtd (where PID 1 is not systemd: sudo libvirtd -d; sudo virtlogd -d)")
    return missing


def _quiet(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def recorded_trust(name: str) -> list[str]:
    """The CA files `corral up --trust-ca` recorded for this appliance (appliance.toml)."""
    settings = config_home() / "appliances" / name / "appliance.toml"
    with contextlib.suppress(OSError, tomllib.TOMLDecodeError):
        found = tomllib.loads(settings.read_text()).get("trust_ca", [])
        if isinstance(found, list):
            return [str(f) for f in found]
    return []


def trusted_cas(files: list[str]) -> list[str]:
    """--trust-ca's files, absolute, each checked to hold PEM certificates (the role copies
    them into the appliance's store, where a wrong file would silently trust nothing)."""
    from cryptography import x509

    checked, stems = [], {}
    for name in dict.fromkeys(os.path.normpath(Path(f).expanduser().absolute()) for f in files):
        path = Path(name)
        if os.pathsep in str(path):
            raise CliError(f"--trust-ca {name}: a path with {os.pathsep!r} in it cannot be "
                           "handed to Vagrant (CORRAL_EXTRA_CA_FILES)", "copy it elsewhere",
                           exitcodes.USAGE)
        try:
            data = path.read_bytes()
            x509.load_pem_x509_certificates(data)
        except OSError as exc:
            raise CliError(f"--trust-ca {name}: {exc.strerror}", "name a CA certificate file "
                           "(PEM)", exitcodes.USAGE) from None
        except ValueError:
            raise CliError(f"--trust-ca {name}: no PEM certificate in it",
                           "name a CA certificate file (PEM, -----BEGIN CERTIFICATE-----)",
                           exitcodes.USAGE) from None
        if b"PRIVATE KEY" in data:  # e.g. mitmproxy-ca.pem: the role would copy it, 0644
            raise CliError(f"--trust-ca {name}: it holds a private key too",
                           "give a file with the certificate alone (e.g. mitmproxy-ca-cert.pem)",
                           exitcodes.USAGE)
        stem = re.sub(r"\.(crt|pem)$", "", path.name)  # the role's name in the store
        if stem in stems:
            raise CliError(f"--trust-ca {name} and {stems[stem]} would be one file in the "
                           f"appliance's store (corral-{stem}.crt)", "rename one of them",
                           exitcodes.USAGE)
        stems[stem] = name
        checked.append(str(path))
    return checked


def vagrant_env(name: str, api_port: int | None = None) -> dict[str, str]:
    directory = config_home() / "appliances" / name
    env = {**os.environ,
           "VAGRANT_CWD": str(ROOT),
           "VAGRANT_DOTFILE_PATH": str(directory / "vagrant"),
           "VAGRANT_DEFAULT_PROVIDER": "libvirt",
           "VAGRANT_CHECKPOINT_DISABLE": "1",
           "ANSIBLE_CONFIG": str(ROOT / "playbooks" / "ansible.cfg"),
           "ANSIBLE_FORCE_COLOR": "0",
           "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
           "CORRAL_NAME": name,
           "CORRAL_LIBVIRT_DRIVER": driver()[0],
           "CORRAL_EXTRA_CA_FILES": ":".join(recorded_trust(name))}
    if api_port is not None:
        env["CORRAL_API_PORT"] = str(api_port)
    env.pop("CORRAL_SSH_PINNED_ARGS", None)
    if known_hosts_file(name).is_file():  # provisioning checks the VM's host keys (Vagrantfile)
        with contextlib.suppress(CliError):  # (provision and up refuse before vagrant runs)
            env["CORRAL_SSH_PINNED_ARGS"] = pinned_ssh_args(name)
    return env


def _vagrant(name: str, *args: str, api_port: int | None = None, started: float,
             timeout: float = 3600) -> None:
    """Run vagrant, showing phases with the time elapsed since `started`; its whole output
    goes to a log.

    The timeout counts from vagrant's start (a box built before it is not counted) and
    holds whether or not vagrant prints anything: a reader thread takes the output while
    this one waits for the exit, and at the deadline vagrant's process group (ssh,
    ansible-playbook, qemu-img, ...) is stopped."""
    deadline = time.monotonic() + timeout
    log_path = config_home() / "appliances" / name / "vagrant.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    shown = set()
    tail: collections.deque[str] = collections.deque(maxlen=15)
    with open(log_path, "a") as log, subprocess.Popen(
            ["vagrant", *args], env=vagrant_env(name, api_port), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
            process_group=0) as process:

        def read() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                log.write(line)
                tail.append(line.rstrip())
                for pattern, text in PHASES:
                    found = pattern.search(line)
                    if found:
                        message = text.format(*found.groups())
                        if message not in shown:
                            shown.add(message)
                            output.notice(f"[{time.monotonic() - started:6.1f}s] {message}")

        reader = threading.Thread(target=read, name="vagrant-output", daemon=True)
        reader.start()
        try:
            code = process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop_group(process)
            reader.join(5)
            raise CliError(f"`vagrant {' '.join(args)}` did not finish within {timeout:.0f}s: "
                           "stopped it and every process it started (its process group):\n  "
                           + "\n  ".join(tail), f"the whole output is in {log_path}") from None
        except BaseException:  # Ctrl-C: vagrant is in its own group, so it must be told
            _stop_group(process, first=signal.SIGINT)
            raise
        reader.join(5)
    if code != 0:
        raise CliError(f"`vagrant {' '.join(args)}` failed (exit {code}):\n  "
                       + "\n  ".join(tail), f"the whole output is in {log_path}")


def _stop_group(process: subprocess.Popen, first: int = signal.SIGTERM,
                grace: float = 10) -> None:
    """Signal the child's process group, then kill what is left of it after `grace`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, first)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(grace)
    # the group outlives its leader; its id cannot be reused while a member is alive
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def up(args) -> int:
    started = time.monotonic()
    # given again, or else what an earlier `corral up` recorded (a provision keeps using it);
    # checked again either way: a recorded file may have gone
    if args.trust_ca:
        trust = trusted_cas(args.trust_ca)
    else:
        try:
            trust = trusted_cas(recorded_trust(args.name))
        except CliError as exc:
            settings = config_home() / "appliances" / args.name / "appliance.toml"
            raise CliError(f"{exc} (recorded in {settings} by an earlier `corral up "
                           "--trust-ca`)", "give --trust-ca again with the file where it is "
                           "now, or remove trust_ca from that file", exc.code) from None
    missing = prerequisites()
    if missing:
        raise CliError("cannot bring up the VM:\n  " + "\n  ".join(missing),
                       "fix the above and run `corral up` again", exitcodes.NOT_CONFIGURED)
    chosen, why = driver()
    output.notice(f"[{time.monotonic() - started:6.1f}s] libvirt driver {chosen}: {why}")
    if box.BOX_NAME not in _quiet(["vagrant", "box", "list"]) and not os.environ.get(
            "CORRAL_BOX"):
        output.notice(f"[{time.monotonic() - started:6.1f}s] no box {box.BOX_NAME}: building "
                      "it from Debian packages (`corral box build`)")
        box.cmd_build(argparse.Namespace(output=None, rebuild=False, key=None, no_add=False))
    directory = config_home() / "appliances" / args.name
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    ssh_config_file(args.name).unlink(missing_ok=True)  # kept again once vagrant is done
    # sessions' terminals and the image build run in the VM, through `corral ssh`
    through = [str(BIN / "corral"), "ssh", "--appliance", args.name, "--", "-q", "-t", "sudo"]
    write_appliance(args.name, f"127.0.0.1:{args.api_port}", backend="vm",
                    podman=[*through, "env", "CONTAINERS_CONF=/etc/corral/containers.conf",
                            "podman"],
                    sandbox=[*through, "/opt/corral/venv/bin/corral-sandbox"],
                    **({"trust_ca": trust} if trust else {}))
    booting = time.monotonic()
    _boot(args.name, args.api_port, started, args.timeout)
    if getattr(args, "no_provision", False):
        output.notice(f"[{time.monotonic() - started:6.1f}s] appliance {args.name!r} booted, "
                      "not provisioned")
        output.line(f"""
next: provision it from an inventory (it may list other appliances too):
  {args.name} ansible_host=ADDRESS ansible_user=vagrant ansible_ssh_private_key_file=KEY \\
      corral_pki_endpoint=127.0.0.1:{args.api_port}
  (`corral ssh --appliance {args.name} -- -G` ... or `vagrant ssh-config` in
  {directory / 'vagrant'} gives ADDRESS and KEY), then
  ansible-playbook -i INVENTORY playbooks/site.yml""")
        return exitcodes.OK
    pending = _pending_file(args.name)
    if pending.exists():  # made now, or its provisioning never finished
        pinned_ssh_args(args.name)  # none kept: no provisioning
        left = args.timeout - (time.monotonic() - booting)  # one timeout for both runs
        if left <= 0:
            raise CliError(f"`vagrant up` and keeping the VM's host keys took all of "
                           f"{args.timeout:g}s: not provisioned", f"`corral up --name "
                           f"{args.name}` again provisions it", exitcodes.FAILURE)
        _vagrant(args.name, "provision", api_port=args.api_port, started=started,
                 timeout=left)
        pending.unlink(missing_ok=True)
    _wait_for_api(args.name)
    output.notice(f"[{time.monotonic() - started:6.1f}s] appliance {args.name!r} is up at "
                  f"127.0.0.1:{args.api_port}")
    flag = "" if args.name == "default" else f" --appliance {args.name}"
    output.line(f"""
next:
  corral run{flag} --preset pypi                   a session for this directory
  corral selftest{flag} --preset debian --allowed deb.debian.org   the bypass battery
  corral status{flag}                              VM and services
  corral down{flag} / corral destroy{flag}         stop the VM / delete it""")
    return exitcodes.OK


def _wait_for_api(name: str, timeout: float = 300) -> None:
    client = Client(load_appliance(name), timeout=10)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.request("GET", "/status")
            return
        except CliError as exc:
            if time.monotonic() > deadline:
                raise CliError(f"the API did not answer within {timeout:.0f}s: {exc}",
                               "`corral ssh`, then `journalctl -u corral-api`") from None
        time.sleep(2)


def _vm_appliance(name: str):
    # the machine's commands work on a VM that has no credentials yet (booted, never
    # provisioned): destroying it must never depend on provisioning having worked
    appliance = load_appliance(name, need_credentials=False)
    if appliance.backend != "vm":
        raise CliError(f"appliance {name} is not a VM (backend {appliance.backend})",
                       "`corral down` stops a local one; a remote one is yours to manage",
                       exitcodes.USAGE)
    return appliance


def provision(args) -> int:
    appliance = _vm_appliance(args.appliance)
    port = appliance.host_port[1]
    remember_ssh(args.appliance)  # its address now, its host keys as first kept
    pinned_ssh_args(args.appliance)  # none kept: no provisioning
    _vagrant(args.appliance, "provision", api_port=port, started=time.monotonic(),
             timeout=args.timeout)
    _pending_file(args.appliance).unlink(missing_ok=True)
    output.line(f"appliance {args.appliance} provisioned")
    return exitcodes.OK


def halt(args) -> int:
    appliance = _vm_appliance(args.appliance)
    stop_ssh_master(args.appliance)
    ssh_config_file(args.appliance).unlink(missing_ok=True)  # its keys stay: the same VM
    _vagrant(args.appliance, "halt", api_port=appliance.host_port[1], started=time.monotonic())
    output.line(f"appliance {args.appliance} is down (`corral up` starts it again)")
    return exitcodes.OK


def destroy(args) -> int:
    appliance = _vm_appliance(args.appliance)
    stop_ssh_master(args.appliance)
    _vagrant(args.appliance, "destroy", "-f", api_port=appliance.host_port[1],
             started=time.monotonic())
    forget_ssh(args.appliance)  # once it is gone (a destroy that failed keeps its keys)
    output.line(f"appliance {args.appliance}'s VM is deleted (its credentials stay in "
                f"{appliance.directory}; `corral up --name {args.appliance}` makes a new one)")
    return exitcodes.OK


def ssh(args) -> int:
    """`corral ssh [-- [SSH OPTION]... COMMAND...]`: leading words that start with '-' go
    to ssh, the rest is the remote command, each word quoted as given (so `corral shell`
    reaches a VM's sessions with `podman = [corral, ssh, ..., podman]`)."""
    appliance = _vm_appliance(args.appliance)
    words = args.command[1:] if args.command[:1] == ["--"] else args.command
    options = []
    while words and words[0].startswith("-"):
        options.append(words.pop(0))
    remote = [shlex.join(words)] if words else []
    remembered = ssh_config_file(args.appliance)
    try:
        kept = inventory.parse_ssh_config(remembered.read_text())
        pinned = known_hosts_file(args.appliance)
        if not pinned.is_file():
            raise ValueError("no host keys kept")
        _config_quoted(str(pinned))  # a path ssh would read as another
    except (OSError, ValueError):
        output.notice(f"appliance {args.appliance}: no address or host keys kept (`corral up "
                      f"--name {args.appliance}` keeps them): through `vagrant ssh`, which "
                      "checks no host key")
        return subprocess.call(["vagrant", "ssh", *(["--", *options, *remote]
                                                    if options or remote else [])],
                               env=vagrant_env(args.appliance, appliance.host_port[1]))
    # only a session's own options ride on a master: the others (-v, -L, -A, -o ...) would
    # be the master's, outliving this call (and -v's stderr holding its caller's pipe)
    shared = multiplexed(args.appliance, kept) if set(options) <= SESSION_OPTIONS else []
    code = subprocess.call(["ssh", *vagrant_ssh_options(kept, args.appliance), *options,
                            *shared, _destination(kept), *remote])
    if code == 255:  # ssh's own failure (or the command's 255): say where the address came from
        output.notice(f"ssh to {kept['ansible_host']} (kept in {remembered}, its host keys in "
                      f"{pinned}) exited 255: if the VM was stopped, started or made again "
                      f"outside corral, `corral up --name {args.appliance}` finds it again")
    return code


def vagrant_ssh_options(kept: dict[str, str], name: str) -> list[str]:
    """The options `vagrant ssh` gives ssh (Vagrant::Util::SSH), first, so they win over the
    user's as they did; the user's ssh_config files are still read, as they were. But the
    VM's host keys are checked, against those `corral up` kept (`vagrant ssh` checks none):
    a VM answering at that address later is the one corral made, or ssh refuses it."""
    pinned = _config_quoted(str(known_hosts_file(name)))
    return ["-p", kept["ansible_port"], "-o", "LogLevel=FATAL", "-o", "Compression=yes",
            "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f'UserKnownHostsFile="{pinned}"', "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", f"HostKeyAlias={host_alias(name)}",
            "-o", "ConnectTimeout=30", "-i", kept["ansible_ssh_private_key_file"]]


def pinned_ssh_args(name: str) -> str:
    """The ssh options that check the VM's host keys against those kept for it, as one
    string that Ansible splits (ANSIBLE_SSH_ARGS, `ansible_ssh_common_args`: shlex), for
    provisioning through Vagrant and from `corral inventory`. CliError when none are kept:
    provisioning sends the appliance's credentials, and never to a machine unchecked."""
    pinned = known_hosts_file(name).absolute()  # Vagrant runs Ansible elsewhere
    if not pinned.is_file():
        raise CliError(f"appliance {name!r}: no host keys kept for its VM ({pinned}), and "
                       "provisioning checks them", f"once the VM answers, `corral provision "
                       f"--appliance {name}` keeps them, then provisions (`corral up --name "
                       f"{name} --no-provision` only keeps them)", exitcodes.NOT_CONFIGURED)
    try:
        if any(mark in str(pinned) for mark in ("{{", "{%", "{#")):  # Ansible templates it
            raise ValueError(f"{pinned} holds a template mark Ansible would read")
        quoted = _config_quoted(str(pinned))
    except ValueError as exc:
        raise CliError(f"appliance {name!r}: {exc}", "set XDG_CONFIG_HOME (or HOME) to a "
                       "path without it", exitcodes.NOT_CONFIGURED) from None
    return shlex.join([
        "-o", f'UserKnownHostsFile="{quoted}"',
        "-o", "GlobalKnownHostsFile=/dev/null", "-o", f"HostKeyAlias={host_alias(name)}",
        "-o", "StrictHostKeyChecking=yes"])


def _config_quoted(path: str) -> str:
    """`path` for ssh's config reader, inside double quotes (a path may hold spaces; `%`
    starts ssh's tokens). ValueError for `${`: ssh expands an environment variable there,
    and nothing escapes it."""
    if "${" in path:
        raise ValueError(f"{path} holds `${{`, which ssh reads as a variable")
    return path.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")


SESSION_OPTIONS = frozenset({"-q", "-t", "-tt", "-T", "-n"})
"""`corral ssh` options that are the session's alone: with only these, it rides on the VM's
master connection (`corral shell` gives -q -t)."""


SSH_PERSIST_SECONDS = 300
"""How long ssh's master connection to a VM stays after its last session ended."""


def _destination(kept: dict[str, str]) -> str:
    return f"{kept['ansible_user']}@{kept['ansible_host']}"


SHARED_TMP = Path("/tmp")  # noqa: S108 - used only when it is root's and sticky (_owned_parent)
"""Not $TMPDIR: a directory of anyone's choosing, which others may write in."""
CONTROL_DIRECTORY_MAX = 56
"""Bytes of the control directory's path, at most: 107 - 1 - 32 - 17."""


def control_directory() -> Path | None:
    """Where ssh's master connections listen: a directory only this user may enter, in a
    parent no one else may rename it in, with a short path (a unix socket's path has at
    most 107 bytes: the directory, a name of 32, and 17 more while ssh makes it):
    $XDG_RUNTIME_DIR/corral-ssh (that directory this user's, 0700, as the XDG spec has it),
    else /tmp/corral-ssh-UID (/tmp root's and sticky). None (no multiplexing) when it
    cannot be made so: whoever can reach a master's socket, or put a socket of their own
    where ssh looks for it, runs or reads commands on the way to the VM."""
    uid = os.getuid()
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and Path(runtime).is_absolute() and _owned_parent(Path(runtime), uid):
        directory = Path(runtime) / "corral-ssh"
    elif _owned_parent(SHARED_TMP, uid):
        directory = SHARED_TMP / f"corral-ssh-{uid}"
    else:
        return None
    if len(os.fsencode(directory)) > CONTROL_DIRECTORY_MAX or "${" in str(directory):
        return None
    with contextlib.suppress(OSError):  # (there already, or not to be made: looked at next)
        directory.mkdir(mode=0o700)
    try:
        found = directory.lstat()  # a symlink planted there is not a directory of ours
    except OSError:
        return None
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != uid or found.st_mode & 0o077:
        return None
    return directory


def _owned_parent(path: Path, uid: int) -> bool:
    """Whether no one but this user (and root) can rename or replace what is in `path`:
    a directory of this user's with no access for others, or root's with no write for
    others, or sticky (as /tmp is)."""
    try:
        found = path.lstat()
    except OSError:
        return False
    if not stat.S_ISDIR(found.st_mode):
        return False
    if found.st_uid == uid and uid != 0:
        return not found.st_mode & 0o077
    return found.st_uid == 0 and (not found.st_mode & 0o022 or
                                  bool(found.st_mode & stat.S_ISVTX))


def multiplexed(name: str, kept: dict[str, str]) -> list[str]:
    """ssh's options for a master connection per VM (OpenSSH's ControlMaster): the first
    `corral ssh` makes it, checking the VM's host keys as every connection does, and leaves
    it running SSH_PERSIST_SECONDS after the last session; each later one is a new session
    on it, without a TCP or SSH handshake (under emulation, most of a shell's start). Its
    socket is named for the appliance (its host keys' file: its name and CLI config) and
    where its VM answers, so no other appliance's VM, nor this one's made again elsewhere,
    is reached through it. None when there is no private place for the socket."""
    directory = control_directory()
    if directory is None:
        return []
    where = "\0".join((str(known_hosts_file(name)), kept["ansible_user"], kept["ansible_host"],
                       kept["ansible_port"]))
    socket_name = hashlib.sha256(where.encode()).hexdigest()[:32]
    return ["-o", "ControlMaster=auto",
            "-o", f'ControlPath="{_config_quoted(str(directory / socket_name))}"',
            "-o", f"ControlPersist={SSH_PERSIST_SECONDS}",
            # a master to a VM gone away notices within half a minute, not TCP's quarter hour
            "-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3"]


def stop_ssh_master(name: str, command: str = "exit") -> None:
    """End the master connection `corral ssh` left to a VM, if there is one: `exit` (it
    and its sessions end) before the VM is stopped or deleted; `stop` (it takes no new
    session, frees its socket's name, and ends with its last session) before the VM is
    asked again for its address: a VM made again is never reached through a master to the
    last one, and a shell open in this one is not cut by a `corral up`."""
    try:
        kept = inventory.parse_ssh_config(ssh_config_file(name).read_text())
    except (OSError, ValueError):
        return
    options = multiplexed(name, kept)
    if not options:
        return
    with contextlib.suppress(OSError, ValueError, subprocess.TimeoutExpired):
        subprocess.run(["ssh", *vagrant_ssh_options(kept, name), *options, "-O", command,
                        _destination(kept)], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)


def ssh_config_file(name: str) -> Path:
    return config_home() / "appliances" / name / "ssh_config"


def known_hosts_file(name: str) -> Path:
    return config_home() / "appliances" / name / "known_hosts"


def host_alias(name: str) -> str:
    """The name the VM's host keys are kept under (not its address: libvirt hands the next
    VM the same one)."""
    return f"corral-appliance-{name}"


HOST_KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384",
                  "ecdsa-sha2-nistp521", "ssh-rsa")


def forget_ssh(name: str) -> None:
    """A VM destroyed: its master connection, its address, its host keys and a
    provisioning it waited for go (the next is another machine)."""
    stop_ssh_master(name)
    ssh_config_file(name).unlink(missing_ok=True)
    known_hosts_file(name).unlink(missing_ok=True)
    _pending_file(name).unlink(missing_ok=True)


def remember_ssh(name: str) -> None:
    """`vagrant ssh-config`, kept beside the appliance's settings: `corral ssh` then runs
    ssh itself. Each `vagrant ssh` starts Ruby and asks libvirt for the VM's address, which
    every `corral shell` on a VM paid before its own command. The VM's host keys are kept
    too, the first time (ssh-keyscan, as the VM corral just made answers them: trust on
    first use, as provisioning's own connection had), and every later `corral ssh` checks
    them; a later `up` or `provision` keeps them as they were, and says so when the VM
    answers with none of them. `corral down` drops the address (a VM started again may have
    another), `corral destroy` both; without them, `corral ssh` goes through vagrant."""
    stop_ssh_master(name, "stop")
    ssh_config_file(name).unlink(missing_ok=True)
    pinned = known_hosts_file(name)
    try:
        text, kept = _asked_ssh_config(name)
        keys = _host_keys(kept, host_alias(name))
    except (ValueError, OSError, subprocess.TimeoutExpired) as exc:
        output.notice(f"`corral ssh` goes through vagrant: {exc}")
        return
    try:
        before = set(pinned.read_text().splitlines())
    except FileNotFoundError:
        files.replace(pinned, keys.encode(), mode=0o600)
    else:
        if not before & set(keys.splitlines()):  # kept as they were: ssh refuses this one
            output.notice(f"appliance {name}'s VM at {kept['ansible_host']} answers with "
                          f"none of the host keys kept in {pinned}: `corral ssh` will "
                          "refuse it. If you made the VM again yourself (not with `corral "
                          f"destroy`), remove that file and run `corral up --name {name}`")
    files.replace(ssh_config_file(name), text.encode(), mode=0o600)


def _host_keys(kept: dict[str, str], alias: str) -> str:
    """The VM's host keys as ssh-keyscan gets them, as known_hosts lines under `alias`.
    ValueError when it gets none."""
    result = subprocess.run(["ssh-keyscan", "-T", "30", "-p", kept["ansible_port"],
                             "-t", ",".join(HOST_KEY_TYPES), kept["ansible_host"]],
                            capture_output=True, text=True, timeout=120)
    lines = []
    for line in result.stdout.splitlines():
        words = line.split()
        if len(words) == 3 and words[1] in HOST_KEY_TYPES and re.fullmatch(
                r"[A-Za-z0-9+/]+={0,2}", words[2]):
            lines.append(f"{alias} {words[1]} {words[2]}\n")
    if not lines:
        said = result.stderr.strip()[-300:] or "nothing said"
        raise ValueError(f"ssh-keyscan got no host key from {kept['ansible_host']}:"
                         f"{kept['ansible_port']} ({said})")
    return "".join(lines)


def verify(args) -> int:
    """verify.yml against the VM, through the inventory `corral inventory` writes for it
    (also for a VM booted with --no-provision and provisioned from an inventory); with
    --against, the two appliances' manifests compared instead (any backend)."""
    if args.against:
        return manifests.against(args.appliance, args.against, args.json)
    if args.json:
        raise CliError("--json is for --against: verify.yml prints Ansible's own report",
                       "add --against OTHER, or leave --json out", exitcodes.USAGE)
    appliance = _vm_appliance(args.appliance)
    env = vagrant_env(args.appliance, appliance.host_port[1])
    with tempfile.TemporaryDirectory(prefix="corral-verify-") as tmp:
        hosts = Path(tmp) / "inventory.ini"
        hosts.write_text(inventory_text([args.appliance]))
        return subprocess.call([str(BIN / "ansible-playbook"), "-i", str(hosts),
                                str(ROOT / "playbooks" / "verify.yml")], env=env)


def _boot(name: str, api_port: int, started: float, timeout: float) -> None:
    """`vagrant up --no-provision`, then the VM's host keys kept. A VM Vagrant made on the
    way (no machine id before, or another after: one removed outside Vagrant) is another
    machine than any keys kept before: they go, and the VM is marked to be provisioned
    (_pending_file). The id before is written down first and kept until this is decided,
    so an `up` cut short (Ctrl-C, a closed terminal, vagrant's own failure) is decided by
    the next from the same id."""
    directory = config_home() / "appliances" / name
    pending, baseline = _pending_file(name), directory / "machine-before-up"
    if not baseline.exists():
        files.replace(baseline, (_machine_id(name) or "").encode(), mode=0o600)
    before = baseline.read_text() or None
    if before is None:  # marked first: a boot that fails leaves it to be provisioned
        files.replace(pending, b"", mode=0o600)
    _vagrant(name, "up", "--provider", "libvirt", "--no-provision", api_port=api_port,
             started=started, timeout=timeout)
    if before is None or _machine_id(name) != before:
        files.replace(pending, b"", mode=0o600)  # (marked before the keys go)
        known_hosts_file(name).unlink(missing_ok=True)
    baseline.unlink()
    remember_ssh(name)


def _pending_file(name: str) -> Path:
    """There while the appliance's VM waits for `corral up` to provision it: made now (or
    being made), or its provisioning did not finish. `corral provision` and `destroy` end
    it."""
    return config_home() / "appliances" / name / "provision-pending"


def _machine_id(name: str) -> str | None:
    """The id Vagrant recorded for this appliance's VM (libvirt's domain UUID); None when it
    has made none. A VM removed outside Vagrant leaves it, until Vagrant's next run finds the
    domain gone, forgets it and makes another (with another id)."""
    try:
        return (config_home() / "appliances" / name / "vagrant" / "machines" / "default" /
                "libvirt" / "id").read_text().strip() or None
    except OSError:
        return None


def vm_state(appliance) -> dict:
    """The VM as libvirt sees it: the domain Vagrant recorded for this appliance."""
    id_file = appliance.directory / "vagrant" / "machines" / "default" / "libvirt" / "id"
    if not id_file.exists():
        return {"state": "not created"}
    import libvirt

    states = {libvirt.VIR_DOMAIN_RUNNING: "running", libvirt.VIR_DOMAIN_SHUTOFF: "shut off",
              libvirt.VIR_DOMAIN_PAUSED: "paused", libvirt.VIR_DOMAIN_CRASHED: "crashed",
              libvirt.VIR_DOMAIN_SHUTDOWN: "shutting down"}
    try:
        connection = libvirt.open("qemu:///system")
    except libvirt.libvirtError as exc:
        return {"state": "unknown", "error": f"libvirt: {exc}"}
    try:
        domain = connection.lookupByUUIDString(id_file.read_text().strip())
        state, _ = domain.state()
        _, memory, _, cpus, _ = domain.info()
        return {"state": states.get(state, str(state)), "domain": domain.name(),
                "cpus": cpus, "memory_mib": memory // 1024}
    except libvirt.libvirtError:
        return {"state": "not created", "error": "the domain Vagrant recorded is gone"}
    finally:
        connection.close()


# -- `corral inventory` ---------------------------------------------------------------


def _settings(name: str) -> dict:
    """appliance.toml, credentials or not: a VM booted with --no-provision has none yet."""
    path = config_home() / "appliances" / name / "appliance.toml"
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CliError(f"no appliance {name!r}: {path}: {exc}",
                       "`corral up --name NAME` brings one up", exitcodes.NOT_CONFIGURED
                       ) from None


def _asked_ssh_config(name: str) -> tuple[str, dict[str, str]]:
    """`vagrant ssh-config`'s answer, and the address, port, user and key it names. Raises
    ValueError (a failure, or an answer without one of them) or subprocess.TimeoutExpired."""
    result = subprocess.run(["vagrant", "ssh-config"], env=vagrant_env(name),
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise ValueError(result.stderr.strip()[-500:] or f"exit {result.returncode}")
    return result.stdout, inventory.parse_ssh_config(result.stdout)


def ssh_config(name: str) -> dict[str, str]:
    try:
        return _asked_ssh_config(name)[1]
    except ValueError as exc:
        raise CliError(f"appliance {name!r}: cannot tell how to reach its VM: {exc}",
                       f"is it up? `corral status --appliance {name}`") from None


def inventory_text(names: list[str]) -> str:
    lines = []
    for name in names:
        known = _settings(name)
        if known.get("backend") != "vm":
            raise CliError(f"appliance {name!r} is not a VM (backend "
                           f"{known.get('backend', 'remote')}): it is in your own inventory",
                           "name only appliances `corral up` made", exitcodes.USAGE)
        lines.append(inventory.host_line(name, ssh_config(name), known["endpoint"],
                                         list(known.get("trust_ca", [])),
                                         pinned_ssh_args(name)))
    return inventory.render(lines)


def cmd_inventory(args) -> int:
    names = args.appliance or [n for n in known_appliances()
                               if _settings(n).get("backend") == "vm"]
    if not names:
        raise CliError("this host has no VM appliance", "`corral up --name NAME "
                       "[--no-provision]` boots one", exitcodes.NOT_CONFIGURED)
    text = inventory_text(names)
    if args.output:
        files.replace(Path(args.output), text.encode())
        output.notice(f"wrote {args.output}: ansible-playbook -i {args.output} "
                      "playbooks/site.yml")
    else:
        output.line(text.rstrip("\n"))
    return exitcodes.OK


def _register_inventory(sub) -> None:
    command = sub.add_parser(
        "inventory", help="an Ansible inventory for this host's VM appliances",
        description="Print an Ansible inventory naming this host's VM appliances (all, or "
        "those named): address, user and key from Vagrant, and the variables the "
        "Vagrantfile gives site.yml. One inventory provisions several: `corral up --name A "
        "--no-provision`, the same for B, then `ansible-playbook -i INVENTORY "
        "playbooks/site.yml` and `playbooks/verify.yml`.")
    command.add_argument("--appliance", action="append", metavar="NAME",
                         help="this one (repeatable; default: every VM appliance)")
    command.add_argument("-o", "--output", metavar="FILE", help="write it here (atomically)")
    command.set_defaults(run=cmd_inventory)


def register(sub) -> None:
    vm_timeout(machine_command(sub, "provision", "re-run playbooks/site.yml on the VM (safe: "
                               "idempotent)", provision))
    machine_command(sub, "destroy", "delete the appliance's VM (its credentials stay)", destroy)
    check = machine_command(sub, "verify", "run playbooks/verify.yml: the appliance as its "
                            "manifest records it (drift named), services, ruleset, API and the "
                            "bypass battery in a throwaway session", verify)
    check.add_argument("--against", metavar="OTHER",
                       help="instead, compare this appliance's manifest with OTHER's (what each "
                       "was provisioned to, as recorded) and print each difference (exit 6 if "
                       "any); any backend")
    check.add_argument("--json", action="store_true", help="with --against: machine-readable")
    _register_inventory(sub)
    shell = machine_command(sub, "ssh", "a shell on the appliance's VM", ssh)
    shell.add_argument("command", nargs=argparse.REMAINDER, help="run this instead of a shell")
