"""Attacks on the git gateway (filter/git/sshgate.py, sshwire.py, http.py's judge), from
inside session s1 (and s2), with real git and ssh and with asyncssh as a crafted client.

Each test asserts the SAFE behaviour: a failing test is a finding. Tests that pass document
what holds. Loopback only; the upstream is tests/fakes.py GitSsh (git-shell), or a shell
login of this module's own (ShellSsh: what an OpenSSH server gives a user whose login shell
is sh, as many self-hosted git servers do)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shlex
import subprocess
import threading
import time
import zlib
from pathlib import Path

import asyncssh
import pytest

from appliance.filter import secrets
from appliance.filter.git import http as git
from appliance.filter.git import pack as packs
from appliance.filter.git import sshgate, sshwire
from appliance.policy.git import SSH_HOST_VARIABLE
from appliance.sandbox import sshconf
from tests import fakes

from .test_git import LATER, handmade_push
from .test_inspect import (  # noqa: F401  (fixtures)
    World,
    interception,
    origins,
)
from .test_sshgate import POLICY, Gated

ENV = SSH_HOST_VARIABLE
ZERO = "0" * 40
WILD_POLICY = POLICY
"""A policy with a glob in repos: test_sshgate's lists acme/tools-*."""
assert 'acme/tools-*' in WILD_POLICY


# -- the world -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gated(origins, interception, tmp_path_factory):  # noqa: F811
    world = Gated(origins, interception, tmp_path_factory.mktemp("attack"))
    world.origins = origins
    # a local clone (file://) to make commits and packs with, no gateway involved
    world.local = world.root.parent / "local"
    world.run("clone", "-q", f"file://{world.root}/acme/widget.git", str(world.local))
    yield world
    world.close()


@pytest.fixture(autouse=True)
def restored(gated):
    """Every test leaves the world as it found it: policy, secret, connection cap."""
    cap = gated.filter.service.proxy.flows.connections
    limit = cap.limit
    yield
    cap.limit = limit
    gated.filter.reload(POLICY)
    gated.set_secret(gated.held, [gated.server.public])


def s1_key(gated):
    return asyncssh.read_private_key(str(gated.client / sshconf.KEY))


def key_of(gated, session: str):
    async def files():
        return gated.filter.service.gate.session_files(session)["key"]
    return asyncssh.import_private_key(gated.filter.run(files()))


def gate_public(gated):
    return asyncssh.import_public_key(
        gated.filter.service.gate.host_key.export_public_key())


async def connect(gated, key=None, local: str | None = None, **options):
    options.setdefault("client_keys", [key if key is not None else s1_key(gated)])
    options.setdefault("agent_path", None)
    return await asyncio.wait_for(asyncssh.connect(
        "127.0.0.1", gated.port, username="git", known_hosts=([gate_public(gated)], [], []),
        config=None, local_addr=(local, 0) if local else None, **options), 15)


def arun(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def read_pkts(reader) -> list[bytes]:
    """pkt-line payloads up to (not including) a flush."""
    lines = []
    while True:
        head = await reader.readexactly(4)
        length = int(head, 16)
        if length == 0:
            return lines
        lines.append(await reader.readexactly(length - 4))


def advertised(lines: list[bytes]) -> dict[str, str]:
    refs = {}
    for line in lines:
        oid, _, rest = line.partition(b" ")
        refs[rest.split(b"\0")[0].strip().decode()] = oid.decode()
    return refs


async def call(conn, command: str, host: str | None = "git.test", env=None, data=b"",
               eof: bool = True):
    """One exec: (exit status, stdout, stderr)."""
    environment = dict(env or {})
    if host is not None:
        environment[ENV] = host
    process = await conn.create_process(command, env=environment, encoding=None)
    try:
        if data:
            process.stdin.write(data)
        if eof:
            process.stdin.write_eof()
    except BrokenPipeError:  # refused and closed already
        pass
    out = await asyncio.wait_for(process.stdout.read(), 20)
    err = await asyncio.wait_for(process.stderr.read(), 20)
    done = await asyncio.wait_for(process.wait(), 20)
    return done.exit_status, out, err


async def push_raw(conn, make, repo: str = "acme/widget", chunks: int = 1, extra=b""):
    """A receive-pack call whose body `make(refs)` writes from the advertised refs: (exit
    status, what came after the advertisement, stderr)."""
    process = await conn.create_process(f"git-receive-pack '{repo}.git'",
                                        env={ENV: "git.test"}, encoding=None)
    refs = advertised(await asyncio.wait_for(read_pkts(process.stdout), 20))
    body = make(refs)
    step = max(1, len(body) // chunks)
    for i in range(0, len(body), step):
        process.stdin.write(body[i : i + step])
        await process.stdin.drain()
    if extra:
        process.stdin.write(extra)
    process.stdin.write_eof()
    out = await asyncio.wait_for(process.stdout.read(), 30)
    err = await asyncio.wait_for(process.stderr.read(), 30)
    done = await asyncio.wait_for(process.wait(), 30)
    return done.exit_status, out, err


def commands(*lines: str, caps: str = "report-status side-band-64k") -> bytes:
    out = b""
    for i, line in enumerate(lines):
        out += git.pkt((line + ("\0" + caps if i == 0 and caps else "") + "\n").encode())
    return out + git.FLUSH


def pack_of(gated, revs: str) -> bytes:
    """A pack git writes in the local clone for `revs` (`NEW\n^OLD`)."""
    return subprocess.run(["git", "pack-objects", "--stdout", "--revs", "-q"],
                          cwd=gated.local, input=(revs + "\n").encode(), env=gated.env,
                          capture_output=True, check=True).stdout


def local_commit(gated, message: str, parent: str | None = None) -> str:
    """A commit in the local clone (on `parent`, or on what is checked out)."""
    if parent is not None:
        gated.run("checkout", "-q", "--detach", parent, cwd=gated.local)
    (gated.local / "notes").write_text(message + "\n")
    gated.run("add", "notes", cwd=gated.local)
    gated.run("commit", "-q", "-m", message, cwd=gated.local)
    return gated.run("rev-parse", "HEAD", cwd=gated.local).stdout.strip()


def pack_bytes(objects: list[bytes], sha=hashlib.sha1) -> bytes:
    pack = b"PACK" + (2).to_bytes(4, "big") + len(objects).to_bytes(4, "big")
    pack += b"".join(objects)
    return pack + sha(pack).digest()


def obj_header(kind: int, size: int) -> bytes:
    byte, size, out = (kind << 4) | (size & 15), size >> 4, bytearray()
    while size:
        out.append(byte | 0x80)
        byte, size = size & 0x7F, size >> 7
    out.append(byte)
    return bytes(out)


def bomb(size: int) -> bytes:
    """A blob of `size` zero bytes, deflated as hard as zlib goes (about 1:1000)."""
    deflate = zlib.compressobj(9)
    chunk = b"\0" * (1 << 20)
    data = b"".join(deflate.compress(chunk) for _ in range(size >> 20)) + deflate.flush()
    return obj_header(packs.BLOB, size) + data


def events_since(gated, seen: set) -> list[dict]:
    return [e for e in gated.filter.events() if e["id"] not in seen]


def event_ids(gated) -> set:
    return {e["id"] for e in gated.filter.events()}


class ShellSsh:
    """An SSH server that runs each exec request with `sh -c`, as OpenSSH does for a user
    whose login shell is a shell (self-hosted git servers: a `git` user, gitolite's admin, a
    developer's own account). Records every command and the environment it was sent."""

    def __init__(self, loop: fakes.Loop, root: Path, client_public: str):
        self.loop, self.root = loop, root
        self.commands: list[str] = []
        self.envs: list[dict] = []
        self.host_key = asyncssh.generate_private_key("ssh-ed25519")
        self.public = self.host_key.export_public_key().decode().strip()
        self.port = loop.run(self._start(client_public))

    async def _start(self, client_public):
        self.server = await asyncssh.listen(
            World.ADDRESS, 0, server_host_keys=[self.host_key],
            authorized_client_keys=asyncssh.import_authorized_keys(client_public),
            process_factory=self._run, encoding=None, allow_pty=False)
        return self.server.sockets[0].getsockname()[1]

    async def _run(self, process):
        self.commands.append(process.command or "")
        self.envs.append(dict(process.env or {}))
        child = await asyncio.create_subprocess_exec(
            "sh", "-c", process.command or "true", cwd=self.root,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root)},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        out, err = await child.communicate()
        process.stdout.write(out)
        process.stderr.write(err)
        process.exit(child.returncode)

    def close(self):
        async def close():
            self.server.close()
            await self.server.wait_closed()
        self.loop.run(close())


def set_secret(gated, port: int, host_keys: list[str]) -> None:
    secret = secrets.parse({"name": "GIT_DEPLOY_KEY", "value": gated.held, "hosts": ["git.test"],
                            "scheme": "ssh", "port": port, "host_keys": host_keys})

    async def store():
        gated.filter.service.secrets.set(secret)
    gated.filter.run(store())


@pytest.fixture
def shell(gated, tmp_path):
    """The held key's host is a shell login (git.test, on another port)."""
    public = asyncssh.import_private_key(gated.held).export_public_key().decode()
    server = ShellSsh(gated.origins.loop, tmp_path, public)
    set_secret(gated, server.port, [server.public])
    yield server
    server.close()


# -- reaching what is not listed: quoting in the exec command ----------------------------


def test_a_quote_in_a_wildcard_repository_name_is_sent_upstream_unquoted(gated, shell):
    """FINDING candidate. `acme/tools-*` lets `*` match any characters but '/', a quote
    too; read_exec undoes git's quoting (`'\\''` is a quote), and the gateway writes the
    upstream command as f"{service} '{repo}.git'" without quoting again. On a host where
    the held key logs in to a shell, the session runs any command there, with the
    appliance's key: reads every repository, moves any ref, no judge in the way."""
    gated.filter.reload(WILD_POLICY)
    marker = shell.root / "pwned"
    payload = f"acme/tools-x'; touch {marker.name}; echo '"
    command = "git-upload-pack " + "'" + payload.replace("'", "'\\''") + ".git'"

    async def attack():
        async with await connect(gated) as conn:
            return await call(conn, command)
    _status, _out, err = arun(attack())
    sent = shell.commands[-1] if shell.commands else None
    assert not marker.exists(), f"the host ran {sent!r}: {marker} was created"
    # safe: refused, or sent as one argument, quoted as git quotes it
    assert sent is None or shlex.split(sent)[1:] == [payload + ".git"], (sent, err)


def test_the_session_environment_never_reaches_the_host(gated, shell):
    """GIT_PROTOCOL (protocol v2), LD_PRELOAD, GIT_* sent by the session stay at the gateway."""
    async def attack():
        async with await connect(gated) as conn:
            return await call(conn, "git-upload-pack 'acme/widget.git'", env={
                "GIT_PROTOCOL": "version=2", "LD_PRELOAD": "/tmp/x.so",
                "GIT_CONFIG_PARAMETERS": "'core.sshCommand=id'"})
    arun(attack())
    assert shell.commands == ["git-upload-pack 'acme/widget.git'"]
    assert shell.envs == [{}]


@pytest.mark.parametrize("command", [
    "git-upload-pack 'acme/widget.git' 'other/secret.git'",
    "git-upload-pack 'acme/widget.git''other/secret.git'",
    "git-upload-pack \"other/secret.git\"",
    "git-upload-pack other/secret.git",
    "git-upload-pack 'acme/widget.git\n'",
    "git-upload-pack\t'other/secret.git'",
    "git upload-pack 'other/secret.git'",
    "git-upload-pack '/acme/../other/secret.git'",
    "git-upload-pack 'acme/widget/../../other/secret.git'",
    "git-upload-pack 'ACME/WIDGET.git'",
    "git-upload-pack 'acme/widget.git/'\\''/../other/secret'",
    "git-upload-pack 'acme/widget\\.git'",
    "git-upload-pack 'acme/widget%2fx.git'",
    "git-receive-pack 'other/secret.git'",
    "git-upload-archive 'other/secret'",
    "git-shell -c 'git-upload-pack other/secret.git'",
    "scp -f /etc/passwd",
    "rsync --server --sender . /",
    "git-upload-pack '-acme/widget.git'",
    "git-upload-pack '~/acme/widget.git'",
])
def test_exec_commands_that_are_not_one_listed_repository_are_refused(gated, command):
    before = list(gated.server.commands)

    async def attack():
        async with await connect(gated) as conn:
            return await call(conn, command)
    status, _out, err = arun(attack())
    assert status != 0 and b"corral:" in err, (status, err)
    assert gated.server.commands == before


# -- which host ---------------------------------------------------------------------------


@pytest.mark.parametrize(("host", "reaches"), [
    ("GIT.TEST", True), ("git.test.", True),  # the same host, written otherwise
    (World.ADDRESS, False), ("host.corral", False), ("nokey.test", False),
    ("git.test:22", False), ("", False), ("*.test", False), ("git.test ", True),
    ("other.test", False), (None, False), ("git.test\x00.evil", False),
    ("xn--git-test", False), ("git%2etest", False),
])
def test_the_host_is_what_corral_git_host_names_normalised_or_refused(gated, host, reaches):
    before = len(gated.server.commands)

    async def attack():
        async with await connect(gated) as conn:
            return await call(conn, "git-upload-pack 'acme/widget.git'", host=host,
                              data=git.FLUSH)
    status, _out, err = arun(attack())
    assert (len(gated.server.commands) > before) == reaches, err
    assert (status == 0) == reaches, err


def test_a_deny_rule_on_the_host_wins_over_its_git_table_and_key(gated):
    gated.filter.reload(POLICY + '\n[deny]\nnames = ["test"]\n')
    before = len(gated.server.commands)
    for host in ("git.test", "GIT.test."):
        async def attack(host=host):
            async with await connect(gated) as conn:
                return await call(conn, "git-upload-pack 'acme/widget.git'", host=host)
        status, _out, err = arun(attack())
        assert status != 0 and b"denied" in err, err
    assert len(gated.server.commands) == before


def test_what_the_session_writes_as_host_reaches_events_only_as_a_clean_host(gated):
    """FINDING candidate. A refusal's event carries CORRAL_GIT_HOST as the session sent it
    (`name`), unchecked and uncut: escape sequences and newlines reach `corral monitor`,
    which prints `name` as is (cli/output.py event): an agent writes on the operator's
    terminal (clears it, forges ALLOW lines). The rest of corral cleans what agents write."""
    seen = event_ids(gated)
    forged = "\x1b[2J\x1b[H12:00:00 s1 ALLOW git github.com  ok\n" + "x" * 20000

    async def attack():
        async with await connect(gated) as conn:
            await call(conn, "git-upload-pack 'acme/widget.git'", host=forged)
            await call(conn, "git-upload-pack 'acme/widget.git'", host="GIT.TEST.")
    arun(attack())
    time.sleep(0.2)
    names = [e.get("name") for e in events_since(gated, seen) if e.get("kind") == "git"]
    assert names, "no git events"
    for name in names:
        assert name is None or (name.isprintable() and len(name) <= 253), repr(name[:80])
    # and the allowed call names the host as the policy does, not as the session wrote it
    assert "git.test" in names, names


def test_a_pushed_ref_name_reaches_events_only_cleaned(gated):
    """FINDING candidate (shared with HTTPS: git/http.py's judge). A refused ref's name is
    put in the refusal's reason as sent ("git push to {ref} refused: not a valid ref name"),
    and the event's reason is printed as is by `corral monitor`: escape sequences in a ref
    name reach the operator's terminal."""
    tip = gated.refs()["refs/heads/main"]
    seen = event_ids(gated)
    ref = "refs/heads/\x1b[2J\x1b[H\x1b[32mALLOW-all"

    async def attack():
        async with await connect(gated) as conn:
            return await push_raw(conn, lambda refs: commands(f"{tip} {'1' * 40} {ref}")
                                  + pack_bytes([]))
    arun(attack())
    time.sleep(0.2)
    reasons = [e.get("reason") or "" for e in events_since(gated, seen)
               if e.get("kind") == "git"]
    assert reasons, "no git event"
    assert all(r.isprintable() for r in reasons), [r[:80] for r in reasons]


# -- authenticating ----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["none", "password", "keyboard-interactive", "s2 key",
                                 "no session", "random key"])
def test_login_without_the_sessions_own_key_from_its_own_address_is_refused(gated, how):
    async def attack():
        local = None
        options = {}
        if how == "none":
            options = {"client_keys": [], "preferred_auth": "none,publickey"}
        elif how == "password":
            options = {"client_keys": [], "password": "git", "preferred_auth": "password"}
        elif how == "keyboard-interactive":
            options = {"client_keys": [], "password": "git",
                       "preferred_auth": "keyboard-interactive"}
        elif how == "s2 key":
            options = {"client_keys": [key_of(gated, "s2")]}
        elif how == "random key":
            options = {"client_keys": [asyncssh.generate_private_key("ssh-ed25519")]}
        else:  # an address no session holds, with s1's key
            local = "127.9.9.9"
        with pytest.raises((asyncssh.PermissionDenied, asyncssh.DisconnectError, OSError)):
            conn = await connect(gated, local=local, **options)
            await call(conn, "git-upload-pack 'acme/widget.git'")
    before = len(gated.server.commands)
    arun(attack())
    assert len(gated.server.commands) == before


def test_s2_with_its_own_key_is_s2_and_pushes_only_s2s_branches(gated):
    tip = gated.refs()["refs/heads/main"]
    new = local_commit(gated, "from s2", parent=tip)
    pack = pack_of(gated, f"{new}\n^{tip}")

    async def attack():
        async with await connect(gated, key=key_of(gated, "s2"), local="127.0.1.7") as conn:
            return [await push_raw(conn, lambda refs, ref=ref: commands(
                f"{ZERO} {new} {ref}") + pack) for ref in
                ("refs/heads/corral/s1/from-s2", "refs/heads/corral/s2/mine")]
    (_s1, out1, _), (_s2, out2, _) = arun(attack())
    refs = gated.refs()
    assert "refs/heads/corral/s1/from-s2" not in refs and b"may push only" in out1
    assert refs.get("refs/heads/corral/s2/mine") == new, out2


# -- not git: forwarding, subsystems, shells, ptys ----------------------------------------


def test_port_forwarding_of_every_kind_is_refused(gated):
    control = str(gated.filter.directory / "filter.sock")

    async def attack():
        async with await connect(gated) as conn:
            with pytest.raises(asyncssh.ChannelOpenError):
                await conn.open_connection(World.ADDRESS, gated.server.port)
            with pytest.raises(asyncssh.ChannelOpenError):
                await conn.open_connection("127.0.0.1", gated.filter.proxy_port)
            with pytest.raises(asyncssh.ChannelOpenError):
                await conn.open_unix_connection(control)
            with pytest.raises(asyncssh.ChannelListenError):
                await conn.forward_remote_port("127.0.0.1", 0, "127.0.0.1", 9)
            with pytest.raises(asyncssh.ChannelListenError):
                await conn.forward_remote_path("/tmp/corral-attack.sock", "/tmp/x")
    arun(attack())


def test_shell_subsystems_pty_x11_and_agent_requests_are_refused(gated):
    before = len(gated.server.commands)

    async def attack():
        async with await connect(gated) as conn:
            with pytest.raises((asyncssh.SFTPError, asyncssh.ChannelOpenError,
                                asyncssh.ProcessError, OSError)):
                async with conn.start_sftp_client() as sftp:
                    await sftp.listdir(".")
            shell = await call(conn, None)  # a shell: no command
            sub = await conn.create_process(subsystem="git-upload-pack",
                                            env={ENV: "git.test"}, encoding=None)
            sub.stdin.write_eof()
            sub_err = await sub.stderr.read()
            await sub.wait()
            with pytest.raises(asyncssh.ChannelOpenError):
                await conn.create_process("git-upload-pack 'acme/widget.git'",
                                          term_type="xterm", env={ENV: "git.test"})
        async with await connect(gated, x11_forwarding=True, x11_display="127.0.0.1:99",
                                 x11_auth_path="/nonexistent") as conn:
            with pytest.raises(asyncssh.ChannelOpenError):
                await call(conn, "git-upload-pack 'acme/widget.git'", data=git.FLUSH)
        async with await connect(gated, agent_forwarding=True,
                                 agent_path="/nonexistent") as conn:
            try:
                agent = await call(conn, "git-upload-pack 'acme/widget.git'", data=git.FLUSH)
            except asyncssh.ChannelOpenError:
                agent = None
        x11 = None
        return shell, sub_err, x11, agent
    (status, _, err), sub_err, _x11, _agent = arun(attack())
    assert status != 0 and b"runs git only" in err, err
    assert b"runs git only" in sub_err
    assert len(gated.server.commands) <= before + 2


def test_a_second_exec_on_the_same_channel_is_refused(gated):
    before = len(gated.server.commands)

    async def attack():
        async with await connect(gated) as conn:
            process = await conn.create_process("git-upload-pack 'acme/widget.git'",
                                                env={ENV: "git.test"}, encoding=None)
            await read_pkts(process.stdout)
            again = await process.channel._make_request(
                b"exec", asyncssh.packet.String(b"git-receive-pack 'other/secret.git'"))
            process.stdin.write(git.FLUSH)
            process.stdin.write_eof()
            await process.wait()
            return again
    assert arun(attack()) is False
    assert gated.server.commands[before:] == ["git-upload-pack 'acme/widget.git'"]


# -- pushes ---------------------------------------------------------------------------------


def test_a_push_of_many_commands_is_refused_whole_when_one_is_refused(gated):
    tip = gated.refs()["refs/heads/main"]
    new = local_commit(gated, "many", parent=tip)
    pack = pack_of(gated, f"{new}\n^{tip}")
    before = gated.refs()

    async def attack():
        async with await connect(gated) as conn:
            return await push_raw(conn, lambda refs: commands(
                f"{ZERO} {new} refs/heads/corral/s1/a", f"{tip} {new} refs/heads/main",
                f"{ZERO} {new} refs/heads/corral/s1/b", caps="report-status atomic") + pack)
    _status, out, _err = arun(attack())
    assert b"ng refs/heads/main" in out, out
    assert gated.refs() == before


@pytest.mark.parametrize("form", LATER)
def test_push_options_asked_for_on_a_later_line_or_with_a_value_are_refused(gated, form):
    """git's receive-pack reads capabilities on every command line, `feature=value` too: a
    push onto the session's own branch asking for push options that way is refused whole,
    and the host's hook (it advertises push options) never runs."""
    bare = gated.root / "acme/widget.git"
    log = fakes.hear_push_options(bare)
    try:
        before, ref = gated.refs(), f"refs/heads/corral/s1/{form}"
        body = handmade_push(gated, gated.local, ref, LATER[form])

        async def attack():
            async with await connect(gated) as conn:
                return await push_raw(conn, lambda refs: body)
        _status, out, _err = arun(attack())
        assert f"ng {ref}-0 corral: push option 'merge_request.create'".encode() in out, out
        assert gated.refs() == before and log.read_text() == ""
    finally:
        fakes.forget_push_options(bare)


def test_a_create_of_an_existing_branch_cannot_force_it(gated):
    """old = zeros says "create": the judge lets any commit through; the host refuses a
    create of a ref that exists, so no history is rewritten."""
    tip = gated.refs()["refs/heads/main"]
    first = local_commit(gated, "first on own", parent=tip)
    pack = pack_of(gated, f"{first}\n^{tip}")

    async def create(new, pack):
        async with await connect(gated) as conn:
            return await push_raw(conn, lambda refs: commands(
                f"{ZERO} {new} refs/heads/corral/s1/forced") + pack)
    arun(create(first, pack))
    assert gated.refs()["refs/heads/corral/s1/forced"] == first
    other = local_commit(gated, "rewritten", parent=tip)
    _status, out, _err = arun(create(other, pack_of(gated, f"{other}\n^{tip}")))
    assert gated.refs()["refs/heads/corral/s1/forced"] == first, out


@pytest.mark.parametrize("case", [
    "trailing bytes", "bad trailer", "size lie", "object count lie", "delete own",
    "tag", "sha256 ids", "uppercase ids", "ref with dots", "ref not under refs",
    "push-cert", "shallow then main", "empty pkt", "cut short", "HEAD", "second flush main",
])
def test_crafted_pushes_are_refused_and_change_nothing(gated, case):
    tip = gated.refs()["refs/heads/main"]
    new = local_commit(gated, f"crafted {case}", parent=tip)
    pack = pack_of(gated, f"{new}\n^{tip}")
    own = "refs/heads/corral/s1/crafted"
    extra = b""

    def make(refs):
        if case == "trailing bytes":
            return commands(f"{ZERO} {new} {own}") + pack + b"0000"
        if case == "bad trailer":
            return commands(f"{ZERO} {new} {own}") + pack[:-1] + bytes([pack[-1] ^ 1])
        if case == "size lie":  # one object's header says one byte more
            objects = pack_bytes([obj_header(packs.BLOB, 6) + zlib.compress(b"hello")])
            return commands(f"{ZERO} {new} {own}") + objects
        if case == "object count lie":
            lie = pack[:8] + (int.from_bytes(pack[8:12], "big") - 1).to_bytes(4, "big")
            lie += pack[12:-20]
            return commands(f"{ZERO} {new} {own}") + lie + hashlib.sha1(lie).digest()
        if case == "delete own":
            return commands(f"{refs.get('refs/heads/corral/s1/forced', tip)} {ZERO} "
                            "refs/heads/corral/s1/forced")
        if case == "tag":
            return commands(f"{ZERO} {new} refs/tags/v9") + pack
        if case == "sha256 ids":
            return commands(f"{'0' * 64} {'1' * 64} {own}",
                            caps="report-status object-format=sha256") + pack_bytes(
                                [], hashlib.sha256)
        if case == "uppercase ids":
            return commands(f"{tip.upper()} {new.upper()} refs/heads/main") + pack
        if case == "ref with dots":
            return commands(f"{tip} {new} refs/heads/corral/s1/../../main") + pack
        if case == "ref not under refs":
            return commands(f"{tip} {new} main") + pack
        if case == "push-cert":
            return git.pkt(b"push-cert\0report-status\n") + git.pkt(b"certificate version 0.1\n")\
                + git.pkt(f"{tip} {new} refs/heads/main\n".encode()) \
                + git.pkt(b"push-cert-end\n") + git.FLUSH + pack
        if case == "shallow then main":
            return git.pkt(f"shallow {tip}\n".encode()) + commands(
                f"{tip} {new} refs/heads/main") + pack
        if case == "empty pkt":
            return git.pkt(b"") + commands(f"{tip} {new} refs/heads/main") + pack
        if case == "cut short":
            return commands(f"{ZERO} {new} {own}") + pack[:-30]
        if case == "HEAD":
            return commands(f"{tip} {new} HEAD") + pack
        # a flush, then what would be a second command section
        return commands(f"{ZERO} {new} {own}", caps="report-status") + git.pkt(
            f"{tip} {new} refs/heads/main\n".encode()) + git.FLUSH + pack
    before = gated.refs()

    async def attack():
        async with await connect(gated) as conn:
            return await push_raw(conn, make, extra=extra)
    _status, out, err = arun(attack())
    assert gated.refs() == before, (out, err)
    # refused by corral, or (sha256 to a sha1 host) by the host itself
    assert b"corral" in out + err or case == "sha256 ids", (out, err)


def test_bytes_after_a_whole_push_never_reach_the_host(gated):
    """A push judged whole (to the session's branch), then a second push written after it
    on the same channel (another command section and pack, to main)."""
    tip = gated.refs()["refs/heads/main"]
    new = local_commit(gated, "after", parent=tip)
    pack = pack_of(gated, f"{new}\n^{tip}")
    second = commands(f"{tip} {new} refs/heads/main") + pack

    async def attack():
        async with await connect(gated) as conn:
            process = await conn.create_process("git-receive-pack 'acme/widget.git'",
                                                env={ENV: "git.test"}, encoding=None)
            await read_pkts(process.stdout)
            process.stdin.write(commands(f"{ZERO} {new} refs/heads/corral/s1/after") + pack)
            await asyncio.sleep(0.1)  # judged and sent on by now
            try:
                process.stdin.write(second)
                process.stdin.write_eof()
            except BrokenPipeError:  # the gateway has ended the call: not read, not sent
                pass
            out = await process.stdout.read()
            await process.wait()
            return out
    arun(attack())
    refs = gated.refs()
    assert refs["refs/heads/corral/s1/after"] == new
    assert refs["refs/heads/main"] == tip


def test_a_refused_push_then_the_same_push_allowed_leaves_only_the_allowed_ref(gated):
    """A refused push closes the host's receive-pack before a byte of it is sent."""
    tip = gated.refs()["refs/heads/main"]
    new = local_commit(gated, "refused then", parent=tip)
    pack = pack_of(gated, f"{new}\n^{tip}")

    async def attack():
        async with await connect(gated) as conn:
            refused = await push_raw(conn, lambda refs: commands(
                f"{tip} {new} refs/heads/main") + pack)
            allowed = await push_raw(conn, lambda refs: commands(
                f"{ZERO} {new} refs/heads/corral/s1/then") + pack)
            return refused, allowed
    refused, _allowed = arun(attack())
    assert b"ng refs/heads/main" in refused[1]
    assert gated.refs()["refs/heads/main"] == tip
    assert gated.refs()["refs/heads/corral/s1/then"] == new


# -- exhaustion -----------------------------------------------------------------------------


def _open_calls(gated) -> int:
    async def count():
        return len(gated.filter.service.gate.open)
    return gated.filter.run(count())


def test_one_connection_cannot_open_more_git_calls_than_the_gateways_limit(gated):
    """Found in the attack round: each SSH channel on one login is a git call with a
    connection of its own to the host (and there a process), and the session's share of
    the filter's connections counts TCP connections only. A session has at most
    sshgate.MAX_CALLS calls open; more are refused at once."""
    channels = 16

    async def attack():
        async with await connect(gated) as conn:
            processes = []
            for _ in range(channels):
                process = await conn.create_process("git-upload-pack 'acme/widget.git'",
                                                    env={ENV: "git.test"}, encoding=None)
                processes.append(process)
            opened = 0
            for process in processes:  # each shows the host's refs: a call open upstream
                try:
                    await asyncio.wait_for(read_pkts(process.stdout), 10)
                    opened += 1
                except (asyncio.IncompleteReadError, TimeoutError):
                    pass
            at_once = _open_calls(gated)
            for process in processes:
                with contextlib.suppress(OSError, asyncssh.Error):
                    process.stdin.write(git.FLUSH)
                    process.stdin.write_eof()
            await asyncio.gather(*(p.wait() for p in processes), return_exceptions=True)
            return opened, at_once
    opened, at_once = arun(attack())
    assert at_once <= sshgate.MAX_CALLS and opened == sshgate.MAX_CALLS, (
        f"{opened} git calls to the host at once on one connection ({at_once} open)")


def test_env_requests_cannot_be_inflated_by_compression(gated):
    """Found in the attack round: asyncssh keeps every `env` request of a channel, and with
    SSH compression (zlib@openssh.com) a few KiB on the wire held 128 MiB. The gateway
    offers no compression: what a channel's env requests hold is what was sent."""
    async def attack():
        await connect(gated, compression_algs=["zlib@openssh.com"])
    # refused in the key exchange; the server's disconnect may reach the client first
    with pytest.raises((asyncssh.KeyExchangeFailed, asyncssh.ConnectionLost)):
        arun(attack())


def test_a_zlib_bomb_in_a_push_is_read_off_the_filters_loop(gated, monkeypatch):
    """Found in the attack round: PushStream inflates each object to find where it ends,
    and on the filter's loop a blob of zeros deflated ~1000:1 cost ~0.2 s of it per 64 KiB
    read (no session's DNS, proxy or git moved meanwhile). Every chunk is now read on the
    judges' threads: checked by where each feed runs, not by timing the loop."""
    tip = gated.refs()["refs/heads/main"]
    body = pack_bytes([bomb(256 << 20)])
    threads, feed = [], sshwire.PushStream.feed

    def recorded(self, data):
        threads.append(threading.current_thread().name)
        return feed(self, data)

    monkeypatch.setattr(sshwire.PushStream, "feed", recorded)

    async def attack():
        async with await connect(gated) as conn:
            return await push_raw(conn, lambda refs: commands(
                f"{tip} {'1' * 40} refs/heads/main") + body, chunks=4)
    _status, out, _err = arun(attack())
    assert b"ng refs/heads/main" in out
    assert threads and all(name.startswith("corral-git") for name in threads), threads



def test_a_sessions_pushes_held_open_leave_another_sessions_push_through(gated):
    """s1 holds pushes open (commands sent, the pack never): what they hold of the budget
    of bodies being judged is what they sent (counted as it arrives, never 64 MiB ahead),
    and s2 still pushes."""
    tip = gated.refs()["refs/heads/main"]
    new = local_commit(gated, "s2 through", parent=tip)
    pack = pack_of(gated, f"{new}\n^{tip}")
    forward = gated.filter.service.proxy.forward

    async def attack():
        async with await connect(gated) as conn:
            held = []
            for _ in range(4):
                process = await conn.create_process("git-receive-pack 'acme/widget.git'",
                                                    env={ENV: "git.test"}, encoding=None)
                await read_pkts(process.stdout)
                process.stdin.write(commands(f"{ZERO} {new} refs/heads/corral/s1/held"))
                held.append(process)
            await asyncio.sleep(0.5)
            holding = forward.held.get("s1", 0)
            async with await connect(gated, key=key_of(gated, "s2"),
                                     local="127.0.1.7") as other:
                s2 = await push_raw(other, lambda refs: commands(
                    f"{ZERO} {new} refs/heads/corral/s2/through") + pack)
            for process in held:
                process.close()
            return holding, s2
    holding, s2 = arun(attack())
    assert holding < 4096, holding
    assert gated.refs().get("refs/heads/corral/s2/through") == new, s2


def test_logins_held_open_by_one_session_leave_another_sessions_login(gated):
    """s1 fills its connection share with TCP connections that never log in; s2 logs in."""
    cap = gated.filter.service.proxy.flows.connections
    cap.limit = 4

    async def attack():
        idle = [await asyncio.open_connection("127.0.0.1", gated.port) for _ in range(6)]
        try:
            async with await connect(gated, key=key_of(gated, "s2"),
                                     local="127.0.1.7") as conn:
                return await call(conn, "git-upload-pack 'acme/widget.git'", data=git.FLUSH)
        finally:
            for _, writer in idle:
                writer.close()
    status, _out, err = arun(attack())
    assert status == 0, err


def _cut_all(gated) -> None:
    """Cut every open call (a policy without [[git]], then the policy back)."""
    gated.filter.reload('[http]\nallow = ["git.test:*"]\n')
    gated.filter.reload(POLICY)
    deadline = time.monotonic() + 5
    while _open_calls(gated) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_fetch_whose_client_vanished_does_not_stay_open_upstream(gated):
    """FINDING candidate. A fetch relays the session's stdin to the host's upload-pack;
    when the session's connection drops (abort, crash, a killed ssh), reading stdin fails
    instead of ending, the host is never sent EOF, and upload-pack waits for wants that
    never come: the call (task, upstream SSH connection, process on the host) stays open
    while the session's connection share has been given back. Repeat: without bound."""
    channels = 6
    cap = gated.filter.service.proxy.flows.connections

    async def attack():
        conn = await connect(gated)
        for _ in range(channels):
            process = await conn.create_process("git-upload-pack 'acme/widget.git'",
                                                env={ENV: "git.test"}, encoding=None)
            await read_pkts(process.stdout)
        conn.abort()
        await asyncio.sleep(0.2)
    arun(attack())
    try:
        deadline = time.monotonic() + 5
        while _open_calls(gated) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _open_calls(gated)

        async def held():
            return dict(cap.held)
        assert left == 0, (f"{left} fetches still open to the host 5 s after their client "
                           f"went (the session's connections counted: "
                           f"{gated.filter.run(held())})")
    finally:
        _cut_all(gated)


def test_a_push_whose_client_vanished_ends_and_gives_back_its_budget(gated):
    async def attack():
        conn = await connect(gated)
        process = await conn.create_process("git-receive-pack 'acme/widget.git'",
                                            env={ENV: "git.test"}, encoding=None)
        await read_pkts(process.stdout)
        process.stdin.write(commands(f"{ZERO} {'1' * 40} refs/heads/corral/s1/cut")[:-2])
        await asyncio.sleep(0.2)
        conn.abort()
    arun(attack())
    deadline = time.monotonic() + 5
    while _open_calls(gated) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _open_calls(gated) == 0

    async def held():
        return dict(gated.filter.service.proxy.forward.held)
    assert gated.filter.run(held()) == {}


# -- secrets --------------------------------------------------------------------------------


def test_the_held_key_is_in_no_listing_event_config_or_session_environment(gated):
    held = asyncssh.import_private_key(gated.held)
    private_b64 = "".join(gated.held.strip().splitlines()[1:-1])
    pieces = [private_b64[-70:-30], private_b64[len(private_b64) // 2:][:40]]
    seen = event_ids(gated)
    # refusals that name the secret: a host key it does not pin, a key the host refuses
    set_secret(gated, gated.server.port, [asyncssh.generate_private_key(
        "ssh-ed25519").export_public_key().decode()])

    async def attack():
        async with await connect(gated) as conn:
            return await call(conn, "git-upload-pack 'acme/widget.git'")
    _, _, err1 = arun(attack())

    async def listing():
        service = gated.filter.service
        return ([s.describe() for s in service.secrets.secrets.values()],
                service.proxy.credentials.environment("s1"),
                service.gate.session_files("s1"))
    described, environment, files = gated.filter.run(listing())
    text = repr((described, environment, files, events_since(gated, seen), err1))
    assert gated.held not in text and not any(piece in text for piece in pieces)
    assert "GIT_DEPLOY_KEY" not in environment
    assert held.export_public_key().decode().split()[1] not in files["key"]
    assert all("value" not in d and "nonce" not in d for d in described)


def test_the_cli_pins_only_the_named_hosts_keys(tmp_path):
    from cli.secrets import known_host_keys

    lines = ["git.test ssh-ed25519 AAAAkeyone", "evil.test ssh-ed25519 AAAAevil",
             "git.test.evil.test ssh-ed25519 AAAAsuffix", "@revoked git.test ssh-ed25519 R",
             "|1|hashed= ssh-ed25519 AAAAhashed", "[git.test]:2222 ssh-ed25519 AAAAport"]
    (tmp_path / "kh").write_text("\n".join(lines) + "\n")
    assert known_host_keys(str(tmp_path / "kh"), ["git.test"], 22) == [
        "ssh-ed25519 AAAAkeyone"]


@pytest.mark.filterwarnings("ignore::cryptography.utils.CryptographyDeprecationWarning")
@pytest.mark.parametrize("kex", ["rsa2048-sha256", "diffie-hellman-group18-sha512",
                                 "diffie-hellman-group-exchange-sha256"])
def test_costly_key_exchanges_are_not_offered(gated, kex):
    """Found in the attack round: a client picks the key exchange before any login, and
    asyncssh's defaults include rsa2048-sha256 (a new RSA key per connection) and
    finite-field DH up to 8192 bits: 16 such logins stalled the filter's loop for most of
    a second. The gateway offers elliptic curves only (sshgate.KEX)."""
    async def login():
        await connect(gated, kex_algs=[kex], client_keys=[], preferred_auth="none")
    with pytest.raises((asyncssh.KeyExchangeFailed, asyncssh.ConnectionLost)):
        arun(login())
    assert all("diffie-hellman" not in k and "rsa" not in k for k in sshgate.KEX)


