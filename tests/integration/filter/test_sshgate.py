"""git over SSH, confined, for real: the git client and OpenSSH's ssh, configured as a
session's are (sandbox/sshconf.py), through the filter's git gateway, to an SSH server
running git-shell. The gateway logs in to it with a key the filter holds (an ssh secret),
checking the host key it pins; fetch and clone of the listed repository work, a push
works onto the session's own branches only, and every other push is refused with its
reason printed by `git push`, the server's refs untouched."""

from __future__ import annotations

import ipaddress
import os
import select
import subprocess
from pathlib import Path

import asyncssh
import pytest

from appliance.filter import secrets
from appliance.policy.git import SSH_HOST_VARIABLE
from appliance.sandbox import sshconf
from tests import fakes
from tests.integration.conftest import ORIGIN

from .test_git import GitClient, named_options_reach_the_hook, options_are_refused_unheard
from .test_inspect import (  # noqa: F401  (fixtures)
    InProcessFilter,
    World,
    inspect_config,
    interception,
    origins,
)

POLICY = """
[http]
allow = ["git.test:*", "nokey.test"]

[[git]]
host = "git.test"
repos = ["acme/widget", "acme/tools-*"]

[[git]]
host = "nokey.test"
repos = ["acme/widget"]

[[git]]
host = "host.corral"
repos = ["acme/widget"]
"""
SSHGATE = """
[sshgate]
listen = ["127.0.0.1:0"]
"""


class Gated(GitClient):
    """A git server over SSH on the World's address, a filter whose gateway holds the key
    it knows, and session s1's ssh client files (as `secret-environment` gives them)."""

    def __init__(self, origins: World, interception: Path, root: Path):  # noqa: F811
        self.root = root / "repos"
        self.root.mkdir()
        fakes.GitHttp.seed(self.root, ["acme/widget", "other/secret"])
        held = asyncssh.generate_private_key("ssh-ed25519")
        self.server = fakes.GitSsh(origins.loop, self.root,
                                   held.export_public_key().decode(), World.ADDRESS)
        origins.dns.zone["git.test"] = [("A", World.ADDRESS, 300)]
        origins.dns.zone["nokey.test"] = [("A", World.ADDRESS, 300)]
        config = inspect_config(interception, extra=SSHGATE)
        directory = root / "filter"
        directory.mkdir()
        self.filter = InProcessFilter(directory, origins.dns.address, "asyncio", config, POLICY)
        self.held = held.export_private_key().decode()
        self.set_secret(self.held, [self.server.public])
        self.port = int(self.filter.service.listeners.names["sshgate"][0].rsplit(":", 1)[1])
        self.home = root / "home"
        self.home.mkdir()
        (self.home / ".gitconfig").write_text(
            "[user]\n\tname = agent\n\temail = agent@corral.test\n"
            "[init]\n\tdefaultBranch = main\n")
        self.client = root / "client"
        self.client.mkdir()
        self.write_client("s1")
        self.env = {"PATH": os.environ["PATH"], "HOME": str(self.home),
                    "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
                    "GIT_SSH_COMMAND": f"ssh -F {self.client / sshconf.CONFIG} -o BatchMode=yes"}
        self.work = root / "work"

    def set_secret(self, key: str, host_keys: list[str], host: str = "git.test",
                   name: str = "GIT_DEPLOY_KEY", port: int | None = None) -> None:
        secret = secrets.parse({"name": name, "value": key, "hosts": [host], "scheme": "ssh",
                                "port": port or self.server.port, "host_keys": host_keys})

        async def store():
            self.filter.service.secrets.set(secret)
        self.filter.run(store())

    def remove_secret(self, name: str) -> None:
        async def remove():
            self.filter.service.secrets.remove(name)
        self.filter.run(remove())

    def write_client(self, session: str) -> dict:
        async def files():
            return self.filter.service.gate.session_files(session)
        answer = self.filter.run(files())
        sshconf.write(self.client, "127.0.0.1", answer)
        # here the key's owner is the client's user: ssh wants it 0600 then (in a session
        # it belongs to the appliance's root, unmapped, and 0644 is what lets the agent read it)
        os.chmod(self.client / sshconf.KEY, 0o600)
        (self.client / sshconf.CONFIG).write_text(sshconf.config_text(
            "127.0.0.1", self.port, answer["hosts"], str(self.client)))
        return answer

    def ssh(self, command: str, *options: str, config: Path | None = None,
            popen: bool = False):
        """ssh to git.test as the session's config has it (or `config`), running `command`:
        completed, or with popen a process to talk to."""
        argv = ["ssh", "-F", str(config or self.client / sshconf.CONFIG), "-o",
                "BatchMode=yes", *options, "git@git.test", command]
        if popen:
            return subprocess.Popen(argv, env=self.env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def gated(origins, interception, tmp_path_factory):  # noqa: F811
    world = Gated(origins, interception, tmp_path_factory.mktemp("sshgate"))
    yield world
    world.close()


def test_the_session_is_given_a_key_and_the_hosts_its_policy_and_the_secrets_allow(gated):
    answer = gated.write_client("s1")
    assert answer["hosts"] == ["git.test"]  # nokey.test: a [[git]] table, but no ssh key
    assert answer["key"].startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    config = (gated.client / sshconf.CONFIG).read_text()
    assert f"SetEnv {SSH_HOST_VARIABLE}=git.test" in config and f"Port {gated.port}" in config
    # the same key after it is asked again; another session's is another

    def public(text: str) -> bytes:
        return asyncssh.import_private_key(text).public_data

    assert public(gated.write_client("s1")["key"]) == public(answer["key"])

    async def other():
        return gated.filter.service.gate.session_files("s2")["key"]
    assert public(gated.filter.run(other())) != public(answer["key"])


def test_a_listed_repository_is_cloned_and_the_session_pushes_its_own_branches(gated):
    gated.run("clone", "-q", "git@git.test:acme/widget.git", str(gated.work))
    assert (gated.work / "README").read_text() == "widget\n"
    first = gated.commit("one")
    done = gated.push("HEAD:refs/heads/corral/s1/work")
    assert done.returncode == 0, done.stderr
    assert gated.refs()["refs/heads/corral/s1/work"] == first
    second = gated.commit("two")
    done = gated.push("HEAD:refs/heads/corral/s1/work")
    assert done.returncode == 0, done.stderr
    assert gated.refs()["refs/heads/corral/s1/work"] == second
    gated.run("fetch", "origin", cwd=gated.work)
    assert "git-upload-pack 'acme/widget.git'" in gated.server.commands
    assert "git-receive-pack 'acme/widget.git'" in gated.server.commands
    event = gated.filter.wait_event(lambda e: e["kind"] == "git" and e["verdict"] == "allow")
    assert event["session"] == "s1" and event["name"] == "git.test"


@pytest.mark.parametrize("case", ["main", "force", "delete", "tag", "another session"])
def test_every_other_push_is_refused_with_its_reason_and_changes_nothing(gated, case):
    if not gated.work.exists():
        test_a_listed_repository_is_cloned_and_the_session_pushes_its_own_branches(gated)
    before = gated.refs()
    seen = {e["id"] for e in gated.filter.events()}
    pushes = gated.server.commands.count("git-receive-pack 'acme/widget.git'")
    if case == "main":
        gated.commit("to main")
        done, why = gated.push("HEAD:main"), "this session may push only refs/heads/corral/s1/**"
    elif case == "force":
        tip = before["refs/heads/corral/s1/work"]
        gated.run("reset", "-q", "--hard", f"{tip}~1", cwd=gated.work)
        gated.commit("rewritten")
        done = gated.push("--force", "HEAD:refs/heads/corral/s1/work")
        why = "a push may only move a ref forward"
    elif case == "delete":
        done, why = gated.push(":refs/heads/corral/s1/work"), "a push may never delete a ref"
    elif case == "tag":
        gated.run("tag", "-f", "v1", cwd=gated.work)
        done, why = gated.push("refs/tags/v1"), "this session may push only"
    else:
        done, why = gated.push("HEAD:refs/heads/corral/s2/work"), "may push only"
    assert done.returncode != 0
    assert "[remote rejected]" in done.stderr and why in done.stderr, done.stderr
    assert gated.refs() == before
    # the host saw the call (its refs were shown to git), never the push itself
    assert gated.server.commands.count("git-receive-pack 'acme/widget.git'") == pushes + 1
    event = gated.filter.wait_event(lambda e: e["id"] not in seen and e["verdict"] == "deny")
    assert event["kind"] == "git" and why in event["reason"]


@pytest.mark.parametrize(("command", "why"), [
    ("git-upload-pack 'other/secret.git'", "not listed"),
    ("git-receive-pack 'other/secret.git'", "not listed"),
    ("sh -c id", "the gateway runs git only"),
    ("git-upload-pack 'acme/widget.git'; id", "the gateway runs git only"),
    ("git-upload-pack '../acme/widget.git'", "the gateway runs git only"),
])
def test_other_commands_and_repositories_are_refused_before_the_host_is_reached(gated, command,
                                                                              why):
    before = list(gated.server.commands)
    done = gated.ssh(command)
    assert done.returncode != 0 and why in done.stderr, done.stderr
    assert gated.server.commands == before


def test_a_host_without_a_held_key_or_with_another_host_key_is_never_reached(gated, tmp_path):
    config = (gated.client / sshconf.CONFIG).read_text().replace("git.test", "nokey.test")
    (tmp_path / "config").write_text(config)
    done = subprocess.run(["ssh", "-F", str(tmp_path / "config"), "-o", "BatchMode=yes",
                           "git@nokey.test", "git-upload-pack 'acme/widget.git'"],
                          env=gated.env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "holds no ssh key for nokey.test" in done.stderr
    # the secret pins a key the server does not have: refused, the server's key unused
    before = list(gated.server.commands)
    stranger = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
    gated.set_secret(asyncssh.generate_private_key("ssh-ed25519").export_private_key().decode(),
                     [stranger])
    try:
        done = gated.run("ls-remote", "git@git.test:acme/widget.git", check=False)
        assert done.returncode != 0 and "a host key the appliance does not pin" in done.stderr
        assert gated.server.commands == before
    finally:
        gated.set_secret(gated.held, [gated.server.public])


def test_the_vm_host_is_host_corral_dialled_at_the_address_the_appliance_was_given(gated,
                                                                                  tmp_path):
    """host.corral names the VM host: the gateway dials the filter's [host] gateway for it
    (here ORIGIN, where a second server runs), never a lookup, with the key held for
    host.corral; its pushes are confined as anywhere."""
    vm_host = fakes.GitSsh(gated.server.loop, gated.root,
                           asyncssh.import_private_key(gated.held).export_public_key().decode(),
                           ORIGIN)
    gated.set_secret(gated.held, [vm_host.public], "host.corral", "VM_HOST_GIT", vm_host.port)
    gate = gated.filter.service.gate  # dials with the gateway the service gave it
    work = tmp_path / "work"
    try:
        assert gated.write_client("s1")["hosts"] == ["git.test", "host.corral"]
        assert "SetEnv CORRAL_GIT_HOST=host.corral" in (gated.client / sshconf.CONFIG).read_text()
        seen = {e["id"] for e in gated.filter.events()}
        gated.run("clone", "-q", "git@host.corral:acme/widget.git", str(work))
        (work / "notes").write_text("from the VM host's clone\n")
        gated.run("add", "notes", cwd=work)
        gated.run("commit", "-q", "-m", "vm host", cwd=work)
        tip = gated.run("rev-parse", "HEAD", cwd=work).stdout.strip()
        done = gated.run("push", "origin", "HEAD:refs/heads/corral/s1/vm-host", cwd=work,
                         check=False)
        assert done.returncode == 0, done.stderr
        assert gated.refs()["refs/heads/corral/s1/vm-host"] == tip
        before = gated.refs()
        done = gated.run("push", "origin", "HEAD:main", cwd=work, check=False)
        assert "[remote rejected]" in done.stderr and "may push only" in done.stderr
        assert gated.refs() == before
        assert "git-receive-pack 'acme/widget.git'" in vm_host.commands
        allowed = gated.filter.wait_event(lambda e: e["id"] not in seen and e["kind"] == "git"
                                          and e["verdict"] == "allow")
        assert allowed["name"] == "host.corral" and allowed["address"] == ORIGIN
        # no [host] gateway: host.corral is no address, and nothing is looked up for it
        calls = len(vm_host.commands)
        gate.gateway = None
        done = gated.run("ls-remote", "git@host.corral:acme/widget.git", check=False)
        assert done.returncode != 0 and "the filter has no [host] gateway" in done.stderr
        assert len(vm_host.commands) == calls
    finally:
        gate.gateway = ipaddress.IPv4Address(ORIGIN)
        gated.remove_secret("VM_HOST_GIT")
        gated.write_client("s1")
        vm_host.close()


SPELLINGS = ["host.corral", "HOST.CORRAL.", "host.corral ", "ho\u017ft.corral",
             "host\u3002corral", "host.corra\u217c", "host.cor\u00adral"]
"""How an agent may write host.corral in CORRAL_GIT_HOST: each is read as host.corral, once,
for the table, the deny rules, the key and the address alike (from an attack round)."""


def test_every_spelling_of_host_corral_needs_its_own_key_and_a_deny_wins(gated):
    vm_host = fakes.GitSsh(gated.server.loop, gated.root,
                           asyncssh.import_private_key(gated.held).export_public_key().decode(),
                           ORIGIN)

    def upload(name):
        return gated.ssh("git-upload-pack 'acme/widget.git'", "-o",
                         f"SetEnv={SSH_HOST_VARIABLE}={name}")
    try:
        for name in SPELLINGS:  # only git.test's key is held: nothing reaches the VM host
            done = upload(name)
            assert done.returncode != 0 and "holds no ssh key for host.corral" in done.stderr
        assert upload(ORIGIN).returncode != 0  # its address: no table, no key names it
        assert vm_host.commands == []
        gated.set_secret(gated.held, [vm_host.public], "host.corral", "VM_HOST_GIT",
                         vm_host.port)
        for name in SPELLINGS:
            before = len(vm_host.commands)
            upload(name)
            assert len(vm_host.commands) == before + 1, name
        calls = len(vm_host.commands)
        for deny in ("host.corral", "HOST.Corral.", "corral", "*.corral"):
            gated.filter.reload(POLICY + f'\n[deny]\nnames = ["{deny}"]\n')
            for name in SPELLINGS:
                done = upload(name)
                assert done.returncode != 0 and "denied" in done.stderr, (deny, name)
        assert len(vm_host.commands) == calls
    finally:
        gated.filter.reload(POLICY)
        gated.remove_secret("VM_HOST_GIT")
        vm_host.close()


def test_a_key_that_is_not_the_sessions_is_refused_at_login(gated, tmp_path):
    stranger = asyncssh.generate_private_key("ssh-ed25519")
    (tmp_path / "key").write_bytes(stranger.export_private_key())
    os.chmod(tmp_path / "key", 0o600)
    config = (gated.client / sshconf.CONFIG).read_text().replace(
        str(gated.client / sshconf.KEY), str(tmp_path / "key"))
    (tmp_path / "config").write_text(config)
    done = gated.ssh("git-upload-pack 'acme/widget.git'", config=tmp_path / "config")
    assert done.returncode == 255 and "Permission denied" in done.stderr, done.stderr


def test_a_sessions_key_from_another_sessions_address_is_refused_at_login(gated):
    """s1's key, sent from s2's subnet (127.0.1.0/24): the gateway knows a session by its
    address, and wants that session's key."""
    done = gated.ssh("git-upload-pack 'acme/widget.git'", "-b", "127.0.1.7")
    assert done.returncode == 255 and "Permission denied" in done.stderr, done.stderr


def test_a_policy_change_cuts_a_call_it_no_longer_allows(gated):
    """A fetch waiting on the host (upload-pack has shown its refs and waits for wants)
    is cut when the session's [[git]] table goes, with an event saying so."""
    seen = {e["id"] for e in gated.filter.events()}
    fetch = gated.ssh("git-upload-pack 'acme/widget.git'", popen=True)
    try:  # (a gateway that never shows the refs fails here, not a read for ever)
        assert select.select([fetch.stdout], [], [], 20)[0], "no refs from the gateway in 20s"
        assert fetch.stdout.read(4)  # the refs' first pkt-line: the call is open
        gated.filter.reload('[http]\nallow = ["git.test:*"]\n')
        _, stderr = fetch.communicate(timeout=20)
        assert b"corral: cut:" in stderr and b"no [[git]] table" in stderr, stderr
    finally:
        fetch.kill()
        gated.filter.reload(POLICY)
    event = gated.filter.wait_event(lambda e: e["id"] not in seen and e["verdict"] == "deny")
    assert event["kind"] == "git" and event["reason"].startswith("cut: ")


@pytest.mark.parametrize("command", ["ls-remote", "push"])
def test_a_repository_the_host_lacks_ends_the_call_with_the_hosts_words(gated, command):
    """A listed pattern (acme/tools-*) the host has no repository for: the host says so and
    ends; the call ends with it (a fetch whose client still has its side open, a push not
    yet sent), never waits on the client."""
    if not gated.work.exists():
        test_a_listed_repository_is_cloned_and_the_session_pushes_its_own_branches(gated)
    url = "git@git.test:acme/tools-missing.git"
    args = ["ls-remote", url] if command == "ls-remote" else ["push", url, "HEAD:x"]
    done = gated.run(*args, cwd=gated.work, check=False)
    assert done.returncode != 0 and "does not appear to be a git repository" in done.stderr, (
        done.stderr)


def test_stopping_the_gateway_cuts_its_calls_saying_so(gated):
    seen = {e["id"] for e in gated.filter.events()}
    fetch = gated.ssh("git-upload-pack 'acme/widget.git'", popen=True)
    try:
        assert select.select([fetch.stdout], [], [], 20)[0], "no refs from the gateway in 20s"
        assert fetch.stdout.read(4)
        gated.filter.run(gated.filter.service.gate.close())
        _, stderr = fetch.communicate(timeout=20)
        assert b"corral: cut: the appliance's filter is stopping" in stderr, stderr
    finally:
        fetch.kill()
    event = gated.filter.wait_event(lambda e: e["id"] not in seen and e["verdict"] == "deny")
    assert event["kind"] == "git" and "filter is stopping" in event["reason"]


@pytest.fixture
def heard(gated):
    """acme/widget advertises push options and its hook writes down those it is handed."""
    if not gated.work.exists():
        test_a_listed_repository_is_cloned_and_the_session_pushes_its_own_branches(gated)
    yield fakes.hear_push_options(gated.root / "acme/widget.git")
    fakes.forget_push_options(gated.root / "acme/widget.git")


def test_push_options_are_refused_and_never_reach_the_servers_hook(gated, heard):
    options_are_refused_unheard(gated, heard)


def test_push_options_the_table_names_reach_the_servers_hook(gated, heard):
    named_options_reach_the_hook(gated, heard, POLICY, 'repos = ["acme/widget", "acme/tools-*"]\n')
