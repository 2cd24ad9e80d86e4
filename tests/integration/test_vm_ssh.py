"""`corral ssh` to a VM without vagrant, against a real SSH server on 127.0.0.1 (asyncssh,
which the git gateway is built on) standing in for the VM's sshd: real ssh-keyscan keeps its
host key as `corral up` does, real ssh checks it on every call, and a machine answering at
the kept address with another key is refused. Only `vagrant ssh-config` is a stand-in (a
script answering what vagrant-libvirt answers)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import asyncssh
import pytest

from cli import vm
from cli.client import CliError
from cli.main import main
from tests.unit.cli.test_vm import _on_path, _vm_appliance_x

ROOT = Path(__file__).resolve().parents[2]


class _Sshd:
    """An SSH server on 127.0.0.1:0 in a thread of its own: one user, one client key, and
    each command answered with `ran: COMMAND`."""

    def __init__(self, client_key: asyncssh.SSHKey, port: int = 0):
        self.host_key = asyncssh.generate_private_key("ssh-ed25519")
        self.connections = 0
        """SSH connections the server has taken (each a TCP and SSH handshake)."""
        self.open: list = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        authorized = client_key.export_public_key().decode()
        sshd = self

        class Server(asyncssh.SSHServer):
            def connection_made(self, conn) -> None:
                sshd.connections += 1
                sshd.open.append(conn)

            def begin_auth(self, username: str) -> bool:
                return True

            def public_key_auth_supported(self) -> bool:
                return True

            def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
                return username == "vagrant" and key.export_public_key().decode() == authorized

        async def answer(process: asyncssh.SSHServerProcess) -> None:
            if (process.command or "").startswith("sleep "):  # a session that lasts
                await asyncio.sleep(float(process.command.split()[1]))
            process.stdout.write(f"ran: {process.command}\n")
            process.exit(0)

        async def listen():
            return await asyncssh.create_server(
                Server, "127.0.0.1", port, server_host_keys=[self.host_key],
                process_factory=answer)

        self.server = asyncio.run_coroutine_threadsafe(listen(), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]

    def close(self) -> None:
        async def closed():  # on its own loop: asyncio's server is not for other threads
            self.server.close()
            for conn in self.open:  # a master connection `corral ssh` left, among them
                conn.close()
                await conn.wait_closed()
            await self.server.wait_closed()

        asyncio.run_coroutine_threadsafe(closed(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(autouse=True)
def control_directory(monkeypatch):
    """A runtime directory of the test's own, with a path short enough for ssh's control
    sockets; every master `corral ssh` left in it stopped at the end."""
    runtime = tempfile.mkdtemp(prefix="cs-", dir="/tmp")
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
    yield os.path.join(runtime, "corral-ssh")
    for name in _sockets(os.path.join(runtime, "corral-ssh")):
        subprocess.run(["ssh", "-o", f"ControlPath={name}", "-O", "exit", "x"],
                       capture_output=True, timeout=10, check=False)
    shutil.rmtree(runtime, ignore_errors=True)


def _sockets(directory: str) -> list[str]:
    try:
        return [os.path.join(directory, name) for name in os.listdir(directory)]
    except FileNotFoundError:
        return []


@pytest.fixture
def client_key(tmp_path):
    key = asyncssh.generate_private_key("ssh-ed25519")
    path = tmp_path / "private_key"
    path.write_bytes(key.export_private_key())
    path.chmod(0o600)
    return key, path


def _vagrant_answering(tmp_path, monkeypatch, port: int, key_path) -> None:
    (tmp_path / "ssh-config").write_text(f"""Host default
  HostName 127.0.0.1
  User vagrant
  Port {port}
  UserKnownHostsFile /dev/null
  StrictHostKeyChecking no
  IdentityFile {key_path}
  IdentitiesOnly yes
""")
    runtime = os.environ["XDG_RUNTIME_DIR"]  # the control_directory fixture's, kept
    _on_path(tmp_path, monkeypatch, vagrant=f"""if [ "$1" = ssh-config ]; then
cat {tmp_path / 'ssh-config'}; exit 0; fi
echo "vagrant was asked: $*" >&2; exit 1
""")
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)


def test_corral_ssh_checks_the_host_key_corral_up_kept_and_refuses_another(
        tmp_path, monkeypatch, client_key, capfd):
    key, key_path = client_key
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no user's ssh config or known_hosts
    (tmp_path / "home").mkdir()
    first = _Sshd(key)
    try:
        _vagrant_answering(tmp_path, monkeypatch, first.port, key_path)
        _vm_appliance_x()
        vm.remember_ssh("x")
        pinned = vm.known_hosts_file("x")
        assert pinned.stat().st_mode & 0o777 == 0o600
        host_key = first.host_key.export_public_key().decode().split()
        assert pinned.read_text().splitlines() == [
            f"corral-appliance-x {host_key[0]} {host_key[1]}"]
        capfd.readouterr()
        assert main(["ssh", "--appliance", "x", "--", "-q", "echo", "a b"]) == 0
        assert capfd.readouterr().out == "ran: echo 'a b'\n"
    finally:
        first.close()
    other = _Sshd(key)  # another machine where the VM was: the same user and key let in
    try:
        _vagrant_answering(tmp_path, monkeypatch, other.port, key_path)
        vm.remember_ssh("x")  # a later `corral up` or `provision` meets it
        assert "answers with none of the host keys kept" in capfd.readouterr().err
        assert pinned.read_text().split()[1:] == host_key[:2]  # the first VM's, still
        assert main(["ssh", "--appliance", "x", "--", "-q", "echo", "secret"]) == 255
        said = capfd.readouterr()
        assert "ran:" not in said.out and str(vm.known_hosts_file("x")) in said.err, said
        assert "corral up --name x" in said.err
        assert not (tmp_path / "home" / ".ssh" / "known_hosts").exists()
    finally:
        other.close()


def test_a_vm_whose_host_key_cannot_be_had_is_reached_through_vagrant(
        tmp_path, monkeypatch, client_key, capfd):
    """Nothing listens at the address vagrant gives: no key is kept, nor the address, and
    `corral ssh` goes through vagrant as it did before corral kept either."""
    _, key_path = client_key
    closed = _Sshd(client_key[0])
    port = closed.port
    closed.close()
    _vagrant_answering(tmp_path, monkeypatch, port, key_path)
    _vm_appliance_x()
    vm.remember_ssh("x")
    assert not vm.known_hosts_file("x").exists() and not vm.ssh_config_file("x").exists()
    assert "ssh-keyscan got no host key from 127.0.0.1" in capfd.readouterr().err
    assert main(["ssh", "--appliance", "x", "--", "-q", "true"]) == 1
    assert "vagrant was asked: ssh -- -q true" in capfd.readouterr().err
    assert os.listdir(vm.known_hosts_file("x").parent)  # the appliance's own files stay


def test_later_corral_ssh_calls_are_sessions_on_one_master_connection_until_destroy(
        tmp_path, monkeypatch, client_key, capfd, control_directory):
    """Each `corral ssh` (each `corral shell` on a VM) was a new TCP and SSH handshake: one
    second under emulation. The first leaves a master connection (ControlMaster), its
    socket in a directory only the user may enter, without holding its caller's pipes (it
    would for ControlPersist); the next ones are sessions on it. A call with options that
    are not the session's alone (-v, -L, -o ...) connects on its own: they would be the
    master's. `corral destroy` ends it, and the next VM gets its own."""
    key, key_path = client_key
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    sshd = _Sshd(key)
    try:
        _vagrant_answering(tmp_path, monkeypatch, sshd.port, key_path)
        _vm_appliance_x()
        vm.remember_ssh("x")
        scanned = sshd.connections  # ssh-keyscan's, one a key type
        started = time.monotonic()
        piped = _piped_ssh("-q", "-t", "echo", "one")  # the master's maker, piped
        assert piped.returncode == 0 and piped.stdout.endswith("ran: echo one\n"), piped
        assert time.monotonic() - started < vm.SSH_PERSIST_SECONDS / 10
        capfd.readouterr()
        for word in ("two", "three"):
            assert main(["ssh", "--appliance", "x", "--", "-q", "echo", word]) == 0
            assert capfd.readouterr().out == f"ran: echo {word}\n"
        assert sshd.connections == scanned + 1
        assert os.stat(control_directory).st_mode & 0o777 == 0o700
        assert main(["ssh", "--appliance", "x", "--", "-q", "-oServerAliveInterval=9",
                     "true"]) == 0
        assert sshd.connections == scanned + 2  # its own connection
        [master] = _sockets(control_directory)
        vm.forget_ssh("x")  # what `corral destroy` does first
        assert not os.path.exists(master)
        vm.remember_ssh("x")  # the next VM (here the same server, asked again)
        assert main(["ssh", "--appliance", "x", "--", "-q", "true"]) == 0
        assert sshd.connections == 2 * scanned + 3  # ssh-keyscan's again, a master of its own
    finally:
        sshd.close()


def _piped_ssh(*words: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", "ssh", "--appliance", "x", "--",
                           *words], capture_output=True, text=True, timeout=60, env=os.environ,
                          cwd=ROOT)


def test_up_again_leaves_open_sessions_alone_and_down_ends_the_master(
        tmp_path, monkeypatch, client_key, capfd, control_directory):
    """`corral up` or `provision` on a running VM asks it again for its address: the master
    takes no new session from then on (the next call makes another), but a shell open on
    it goes on to its end. `corral down` ends the master with its sessions."""
    key, key_path = client_key
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    sshd = _Sshd(key)
    try:
        _vagrant_answering(tmp_path, monkeypatch, sshd.port, key_path)
        _vm_appliance_x()
        vm.remember_ssh("x")
        assert main(["ssh", "--appliance", "x", "--", "-q", "true"]) == 0
        masters = sshd.connections
        open_shell = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "ssh", "--appliance", "x", "--", "-q", "sleep",
             "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        time.sleep(0.7)  # it is a session on the master now
        vm.remember_ssh("x")
        assert main(["ssh", "--appliance", "x", "--", "-q", "true"]) == 0
        out, err = open_shell.communicate(timeout=30)
        assert open_shell.returncode == 0 and out == "ran: sleep 2\n", err
        assert sshd.connections > masters  # a new master (and ssh-keyscan's) for the next
        [master] = _sockets(control_directory)
        vm.stop_ssh_master("x")  # what `corral down` does first
        assert not os.path.exists(master)
    finally:
        sshd.close()


def test_no_master_connection_without_a_private_place_for_its_socket(
        tmp_path, monkeypatch, client_key, capfd, control_directory):
    """A control directory someone else could enter (or a symlink planted where it would
    be) is not used: each `corral ssh` connects on its own, as before."""
    key, key_path = client_key
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    os.mkdir(control_directory, 0o755)
    os.chmod(control_directory, 0o755)
    sshd = _Sshd(key)
    try:
        _vagrant_answering(tmp_path, monkeypatch, sshd.port, key_path)
        _vm_appliance_x()
        vm.remember_ssh("x")
        scanned = sshd.connections
        for _ in range(2):
            assert main(["ssh", "--appliance", "x", "--", "-q", "true"]) == 0
        assert sshd.connections == scanned + 2 and not _sockets(control_directory)
    finally:
        sshd.close()


def _ansible_raw(inventory, tmp_path) -> subprocess.CompletedProcess:
    """`ansible -m raw` (a command over ssh, no Python on the far side) with the
    repository's ansible.cfg, as site.yml reaches each host of an inventory."""
    control = tempfile.mkdtemp(prefix="ca-", dir="/tmp")  # short: ssh's control socket
    try:
        return subprocess.run(
            [str(Path(sys.executable).parent / "ansible"), "all", "-i", str(inventory), "-m",
             "raw", "-a", "echo provisioned"], capture_output=True, text=True, timeout=120,
            env={**os.environ, "ANSIBLE_CONFIG": str(ROOT / "playbooks" / "ansible.cfg"),
                 "ANSIBLE_SSH_CONTROL_PATH_DIR": control,
                 "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp")})
    finally:
        for name in _sockets(control):
            subprocess.run(["ssh", "-o", f"ControlPath={name}", "-O", "exit", "x"],
                           capture_output=True, timeout=10, check=False)
        shutil.rmtree(control, ignore_errors=True)


def test_provisioning_from_corral_inventory_checks_the_host_keys_kept(
        tmp_path, monkeypatch, client_key, capfd):
    """Provisioning sends the appliance's credentials: Ansible, from the inventory `corral
    inventory` writes and with the repository's ansible.cfg, reaches the VM whose host key
    `corral up` kept, and refuses another machine answering at its address with the same
    user and key let in (it was told to check none: host_key_checking = False,
    StrictHostKeyChecking=no). Real ansible and ssh; the VM's sshd a stand-in."""
    key, key_path = client_key
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    inventory = tmp_path / "inventory.ini"
    first = _Sshd(key)
    try:
        _vagrant_answering(tmp_path, monkeypatch, first.port, key_path)
        _vm_appliance_x()
        vm.remember_ssh("x")
        assert main(["inventory", "--appliance", "x", "-o", str(inventory)]) == 0
        reached = _ansible_raw(inventory, tmp_path)
        assert reached.returncode == 0 and "provisioned" in reached.stdout, reached
    finally:
        first.close()
    other = _Sshd(key, port=first.port)  # at the same address, with a key of its own
    try:
        refused = _ansible_raw(inventory, tmp_path)
        assert refused.returncode != 0 and "UNREACHABLE" in refused.stdout, refused
        assert "Host key verification failed" in refused.stdout + refused.stderr, refused
        assert other.connections == 1  # it was asked, and got nothing but the handshake
    finally:
        other.close()
    assert not (tmp_path / "home" / ".ssh" / "known_hosts").exists()


def test_no_inventory_and_no_provisioning_for_a_vm_without_kept_host_keys(
        tmp_path, monkeypatch, client_key, capfd):
    _, key_path = client_key
    sshd = _Sshd(client_key[0])
    try:
        _vagrant_answering(tmp_path, monkeypatch, sshd.port, key_path)
        _vm_appliance_x()
        with pytest.raises(CliError, match="no host keys kept") as refused:
            vm.pinned_ssh_args("x")
        assert "corral up --name x" in refused.value.hint
        assert main(["inventory", "--appliance", "x"]) != 0
        assert "no host keys kept" in capfd.readouterr().err
        assert "CORRAL_SSH_PINNED_ARGS" not in vm.vagrant_env("x")
        vm.remember_ssh("x")
        assert "HostKeyAlias=corral-appliance-x" in vm.vagrant_env("x")[
            "CORRAL_SSH_PINNED_ARGS"]
    finally:
        sshd.close()
