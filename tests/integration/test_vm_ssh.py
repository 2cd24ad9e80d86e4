"""`corral ssh` to a VM without vagrant, against a real SSH server on 127.0.0.1 (asyncssh,
which the git gateway is built on) standing in for the VM's sshd: real ssh-keyscan keeps its
host key as `corral up` does, real ssh checks it on every call, and a machine answering at
the kept address with another key is refused. Only `vagrant ssh-config` is a stand-in (a
script answering what vagrant-libvirt answers)."""

from __future__ import annotations

import asyncio
import os
import threading

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
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        authorized = client_key.export_public_key().decode()

        class Server(asyncssh.SSHServer):
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
            await self.server.wait_closed()

        asyncio.run_coroutine_threadsafe(closed(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


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
    _on_path(tmp_path, monkeypatch, vagrant=f"""if [ "$1" = ssh-config ]; then
cat {tmp_path / 'ssh-config'}; exit 0; fi
echo "vagrant was asked: $*" >&2; exit 1
""")


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
