"""The git gateway's keys and its secrets, without sockets: ssh secrets as the filter
stores them (secrets.py), the session's key (sshgate.session_key) and the session's ssh
client files (sandbox/sshconf.py), read back by OpenSSH's own `ssh -G`."""

from __future__ import annotations

import json
import subprocess

import asyncssh
import pytest

from appliance.filter import secrets
from appliance.filter.git import sshgate
from appliance.filter.proxy.credentials import Credentials
from appliance.policy.git import SSH_HOST_VARIABLE
from appliance.sandbox import hardening, sshconf

HELD = asyncssh.generate_private_key("ssh-ed25519")
HOST = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()


def ssh_secret(**fields) -> secrets.Secret:
    return secrets.parse({"name": "GIT_DEPLOY_KEY", "value": HELD.export_private_key().decode(),
                          "hosts": ["github.com"], "scheme": "ssh", "host_keys": [HOST],
                          **fields})


def test_an_ssh_secret_holds_a_usable_key_its_login_and_pinned_host_keys():
    secret = ssh_secret(user="git", port=2200)
    assert (secret.user, secret.port, secret.host_keys) == ("git", 2200, (HOST,))
    shown = secret.describe()
    assert "value" not in shown and shown["host_keys"] == [HOST]
    assert "PRIVATE KEY" not in json.dumps(shown)
    rsa = asyncssh.generate_private_key("ssh-rsa", key_size=2048)
    assert ssh_secret(value=rsa.export_private_key("pkcs1-pem").decode()).scheme == "ssh"


@pytest.mark.parametrize(("fields", "why"), [
    ({"value": "not a key"}, "not a private key"),
    ({"value": HELD.export_private_key("pkcs8-pem", passphrase="pw").decode()},
     "not a private key"),
    ({"host_keys": []}, "'host_keys' must list"),
    ({"host_keys": ["ssh-ed25519 AAAA!!"]}, "is not a public key"),
    ({"hosts": ["*.github.com"]}, "named hosts, not a wildcard"),
    ({"user": "git; rm"}, "'user' must be a login name"),
    ({"port": 0}, "'port' must be a TCP port"),
    ({"port": True}, "'port' must be a TCP port"),
    ({"header": "x-key"}, "for HTTP secrets"),
    ({"requests": ["GET /"]}, "for HTTP secrets"),
])
def test_an_ssh_secret_the_gateway_could_not_use_is_refused_when_set(fields, why):
    with pytest.raises(secrets.SecretError, match=why):
        ssh_secret(**fields)


def test_ssh_secrets_survive_the_file_and_never_become_placeholders(tmp_path):
    store = secrets.SecretStore.load(tmp_path)
    bearer = secrets.parse({"name": "API_TOKEN", "value": "t0ken-of-the-api",
                            "hosts": ["api.test"]})
    store.set(ssh_secret())
    store.set(bearer)
    again = secrets.SecretStore.load(tmp_path)
    assert again.secrets["GIT_DEPLOY_KEY"].host_keys == (HOST,)
    assert again.ssh("github.com").name == "GIT_DEPLOY_KEY" and again.ssh("x.test") is None
    assert set(Credentials(again.key, again.http()).environment("s1")) == {"API_TOKEN"}


def test_a_sessions_key_is_its_own_and_the_same_after_a_restart():
    key = b"k" * 32
    first = sshgate.session_key(key, "s1", "10.89.0.0/24")
    assert first.public_data == sshgate.session_key(key, "s1", "10.89.0.0/24").public_data
    for other in (sshgate.session_key(key, "s2", "10.89.0.0/24"),
                  sshgate.session_key(key, "s1", "10.89.1.0/24"),  # a later s1
                  sshgate.session_key(b"j" * 32, "s1", "10.89.0.0/24")):
        assert other.public_data != first.public_data


def test_the_gateways_host_key_is_made_once_and_kept_for_its_user_alone(tmp_path):
    key = sshgate.host_key(tmp_path)
    assert (tmp_path / sshgate.HOST_KEY).stat().st_mode & 0o777 == 0o600
    assert sshgate.host_key(tmp_path).public_data == key.public_data


def test_the_sessions_ssh_client_reaches_git_hosts_through_the_gateway_only(tmp_path):
    host_key = sshgate.host_key(tmp_path / "gate").export_public_key().decode()
    files = {"key": sshgate.session_key(b"k" * 32, "s1", "x").export_private_key().decode(),
             "host_key": host_key, "port": 2222, "hosts": ["github.com", "git.test"]}
    assert sshconf.write(tmp_path, "10.89.0.1", files)
    assert (tmp_path / sshconf.KNOWN_HOSTS).read_text() == f"{sshconf.ALIAS} {host_key.strip()}\n"
    for host in ("github.com", "git.test"):
        seen = subprocess.run(["ssh", "-G", "-F", str(tmp_path / sshconf.CONFIG), f"git@{host}"],
                              capture_output=True, text=True, check=True).stdout.splitlines()
        assert {"hostname 10.89.0.1", "port 2222", f"hostkeyalias {sshconf.ALIAS}",
                "stricthostkeychecking true", "identitiesonly yes",
                f"setenv {SSH_HOST_VARIABLE}={host}"} <= set(seen), seen
    other = subprocess.run(["ssh", "-G", "-F", str(tmp_path / sshconf.CONFIG), "x.example"],
                           capture_output=True, text=True, check=True).stdout
    assert "hostname x.example" in other  # other hosts: as they were (the firewall decides)
    assert not sshconf.write(tmp_path / "none", "10.89.0.1", {**files, "hosts": []})
    assert not sshconf.write(tmp_path / "none", "10.89.0.1", None)
    with pytest.raises(ValueError, match="not a host name"):
        sshconf.config_text("10.89.0.1", 2222, ["x\n    ProxyCommand sh"])


def test_the_config_is_mounted_as_the_systems_only_when_there_is_one():
    base = {"name": "c", "image": "i", "network": "n", "gateway": "10.89.0.1",
            "seccomp_profile": "p", "init": "i", "trust": "/t"}
    args = hardening.run_arguments(hardening.Sandbox(**base, ssh=True), [])
    assert f"/t/{sshconf.CONFIG}:{sshconf.SYSTEM_CONFIG}:ro" in args
    args = hardening.run_arguments(hardening.Sandbox(**base), [])
    assert not any(sshconf.SYSTEM_CONFIG in a for a in args)
