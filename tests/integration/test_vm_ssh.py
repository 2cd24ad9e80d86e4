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

import asyncssh
import pytest

from cli import vm
from cli.main import main
from tests.unit.cli.test_vm import _on_path, _vm_appliance_x


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
    socket in a directory only the user may enter; the next ones are sessions on it, the
    one with pipes for its output too (a master holding them would hold its caller for
    ControlPersist). `corral destroy` ends it, and the next VM gets its own."""
    key, key_path = client_key
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    sshd = _Sshd(key)
    try:
        _vagrant_answering(tmp_path, monkeypatch, sshd.port, key_path)
        _vm_appliance_x()
        vm.remember_ssh("x")
        scanned = sshd.connections  # ssh-keyscan's, one a key type
        capfd.readouterr()
        for word in ("one", "two"):
            assert main(["ssh", "--appliance", "x", "--", "-q", "echo", word]) == 0
            assert capfd.readouterr().out == f"ran: echo {word}\n"
        started = time.monotonic()
        piped = subprocess.run([sys.executable, "-m", "cli.main", "ssh", "--appliance", "x",
                                "--", "-q", "echo", "three"], capture_output=True, text=True,
                               timeout=60, env=os.environ)
        assert piped.returncode == 0 and piped.stdout == "ran: echo three\n", piped
        assert time.monotonic() - started < vm.SSH_PERSIST_SECONDS / 10
        assert sshd.connections == scanned + 1
        assert os.stat(control_directory).st_mode & 0o777 == 0o700
        [master] = _sockets(control_directory)
        vm.forget_ssh("x")  # what `corral destroy` does first
        assert not os.path.exists(master)
        vm.remember_ssh("x")  # the next VM (here the same server, asked again)
        assert main(["ssh", "--appliance", "x", "--", "-q", "true"]) == 0
        assert sshd.connections == 2 * scanned + 2  # ssh-keyscan's again, a master of its own
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
