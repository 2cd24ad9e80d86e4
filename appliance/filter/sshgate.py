"""The git gateway: git over SSH, confined as it is over HTTPS. The socket edge; what git
sends is read by gitssh.py and judged by proxy/git.py, without sockets.

A session's ssh client is configured (sandbox/sshconf.py) to reach a `[[git]]` host
through the gateway, on its gateway address, with a key of its own and the host's name
in `CORRAL_GIT_HOST`:

    agent's git ──ssh, session key──▶ gateway ──ssh, held key──▶ github.com:22
                                      │ the session: its source address (and its key)
                                      │ the repository: its [[git]] table (which, with
                                      │   a key held for the host, is the allowance:
                                      │   no http or tcp rule needed; a deny rule wins)
                                      │ a push: read whole, judged, then sent or refused

The session never holds the key the host knows: the appliance does (`corral secret set
NAME --ssh`), and reaches the host only with that host's pinned keys. Fetches are relayed
as they are; a push (git-receive-pack) is read to its end, judged as over HTTPS (the
session's refs only, forward only, no deletes, no tags moved), and either sent on whole or
answered in git's own report, so that `git push` prints why. Nothing else runs here: no
shell, no port forwarding, no subsystems, no other command.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

import asyncssh
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from appliance.atomic import write_atomic
from appliance.policy import Decision, HostNameError, Policy, parse_host

from . import gitssh
from .http import HttpError
from .proxy import git
from .proxy.forward import _judge, _judges

log = logging.getLogger(__name__)

ENV_HOST = "CORRAL_GIT_HOST"
"""What the session's ssh client sends (SetEnv) to name the host it means."""
HOST_KEY = "sshgate_host_key"
READ = 1 << 16
LOGIN_SECONDS = 20.0


class Refused(Exception):
    """A git call the gateway will not make; the message is what git prints."""

    def __init__(self, decision: Decision):
        super().__init__(decision.reason)
        self.decision = decision


def session_key(key: bytes, session: str, identity: str) -> asyncssh.SSHKey:
    """The key a session reaches the gateway with: made from the filter's own key (the
    secrets file's), the session's name and its subnet, so it is the same after a restart,
    different for a later session of the same name, and stored nowhere."""
    seed = hmac.new(key, b"corral-sshgate\0" + session.encode() + b"\0" + identity.encode(),
                    hashlib.sha256).digest()
    pem = Ed25519PrivateKey.from_private_bytes(seed).private_bytes(
        Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption())
    return asyncssh.import_private_key(pem)


def host_key(state_dir: str | Path) -> asyncssh.SSHKey:
    """The gateway's own host key, made (Ed25519, 0600) on its first start."""
    path = Path(state_dir) / HOST_KEY
    try:
        return asyncssh.read_private_key(str(path))
    except FileNotFoundError:
        pass
    key = asyncssh.generate_private_key("ssh-ed25519")
    write_atomic(path, key.export_private_key(), mode=0o600)
    return key


@dataclass(eq=False)
class _Open:
    """A git call in progress: judged again when the policy changes."""

    session: str
    address: str
    label: str
    host: str
    call: gitssh.SshCall
    task: asyncio.Task
    cut: str | None = None


class Gate:
    """The gateway of one filter: the policy, resolver, secrets and events are the
    filter's (service.py gives them)."""

    def __init__(self, service):
        self.service = service
        self.store, self.bus, self.proxy = service.store, service.bus, service.proxy
        self.host_key = host_key(service.config.state_dir)
        self.open: set[_Open] = set()
        self.store.on_change(self.rejudge)

    @property
    def secrets(self):
        return self.service.secrets

    def key_for(self, session: str) -> asyncssh.SSHKey:
        return session_key(self.secrets.key, session, self.service._identity(session))

    def session_files(self, session: str, port: int) -> dict:
        """What a session's ssh client needs (sandbox/sshconf.py): its key, the gateway's
        host key, the port, and the hosts it reaches through the gateway: those its policy
        has a [[git]] table for and the appliance holds an ssh key for."""
        policy = self.store.sessions[session].policy
        hosts = sorted({h for s in self.secrets.secrets.values() if s.scheme == "ssh"
                        for h in s.hosts if policy.git(parse_host(h)) is not None})
        return {"key": self.key_for(session).export_private_key().decode(),
                "host_key": self.host_key.export_public_key().decode().strip(),
                "port": port, "hosts": hosts}

    async def listen(self, sock) -> asyncssh.SSHAcceptor:
        return await asyncssh.listen(
            sock=sock, server_factory=lambda: _Server(self), server_host_keys=[self.host_key],
            process_factory=self.serve, encoding=None, allow_pty=False,
            agent_forwarding=False, x11_forwarding=False, allow_scp=False,
            login_timeout=LOGIN_SECONDS, keepalive_interval=30, keepalive_count_max=4)

    # -- deciding ------------------------------------------------------------------------

    def decide(self, session: str, policy: Policy, host_name: str, call: gitssh.SshCall):
        """(decision, spec, secret) for this call now; Refused when it may not be made."""
        try:
            host = parse_host(host_name)
        except HostNameError as exc:
            raise Refused(Decision(False, f"{ENV_HOST}={host_name[:100]!r}: {exc}")) from None
        denied = policy.denied_by(host)
        if denied is not None:  # a deny rule wins over every allow, a [[git]] table's too
            raise Refused(Decision(False, f"{host} is denied to session {session} "
                                   f"({denied.text})", denied))
        access = policy.git(host)
        if access is None:
            raise Refused(Decision(False, f"{host} has no [[git]] table in session {session}'s "
                                   "policy", hint=f'add [[git]] host = "{host}" with its '
                                   "repos to corral.toml"))
        spec = access.repository(call.repo)
        if spec is None:
            raise Refused(Decision(False, f"git repository {call.repo[:100]!r} on {host} is "
                                   f"not listed (listed: {access.listed()})",
                                   hint=f'add "{call.repo[:100]}" to repos of the [[git]] '
                                   f"table for {host} in corral.toml"))
        secret = self.secrets.ssh(host.name)
        if secret is None:
            raise Refused(Decision(False, f"the appliance holds no ssh key for {host}", hint=(
                f"corral secret set NAME --ssh --host {host} --known-hosts FILE < KEY")))
        return (Decision(True, f"git {call.service} of {call.repo} on {host} through the "
                         f"gateway (ssh key {secret.name})"), spec, secret)

    def rejudge(self) -> None:
        """The policy changed: a call it no longer allows is cut, with an event."""
        for opened in list(self.open):
            session, policy = self.store.lookup(opened.address)
            try:
                if session != opened.session:
                    raise Refused(Decision(False, f"session {opened.session} has ended"))
                self.decide(session, policy, opened.host, opened.call)
            except Refused as refused:
                opened.cut = refused.decision.reason
                self.event(Decision(False, f"cut: {refused.decision.reason} (the policy "
                                    "changed while it was open)"), opened.session,
                           opened.label, opened.host)
                opened.task.cancel()

    def event(self, decision: Decision, session, label: str, host: str | None, **extra):
        return self.bus.decision(decision, session=session, client=label, kind="git",
                                 name=host, port=None, **extra)

    # -- serving -------------------------------------------------------------------------

    async def serve(self, process: asyncssh.SSHServerProcess) -> None:
        peer = process.get_extra_info("peername") or ("?", 0)
        label = f"{peer[0]}:{peer[1]}"
        status = 128
        try:
            status = await self._serve(process, peer[0], label)
        except Refused as refused:
            decision = refused.decision
            session, _ = self.store.lookup(peer[0])
            self.event(decision, session, label, _env(process).get(ENV_HOST))
            hint = f" ({decision.hint})" if decision.hint else ""
            process.stderr.write(f"corral: {decision.reason}{hint}\n".encode())
        except asyncio.CancelledError:  # the filter is stopping
            with contextlib.suppress(Exception):
                process.stderr.write(b"corral: the appliance's filter is stopping\n")
                process.exit(status)
            raise
        except (asyncssh.Error, OSError, TimeoutError) as exc:
            process.stderr.write(f"corral: the gateway lost the host: {exc}\n".encode()[:500])
        except Exception:  # one broken call must never take the gateway down
            log.exception("sshgate: %s failed", label)
            process.stderr.write(b"corral: the gateway failed; see the filter's log\n")
        with contextlib.suppress(Exception):
            process.exit(status)

    async def _serve(self, process, address: str, label: str) -> int:
        session, policy = self.store.lookup(address)
        if session is None:
            raise Refused(Decision(False, "git over ssh from an address no session holds"))
        try:
            call = gitssh.read_exec(process.command or "")
        except git.GitProtocolError as exc:
            raise Refused(Decision(False, f"the gateway runs git only: {exc}")) from None
        host = _env(process).get(ENV_HOST)
        if not host:
            raise Refused(Decision(False, f"no {ENV_HOST}: say which host this is for (the "
                                   "session's ssh config does; use git@HOST:OWNER/REPO)"))
        decision, spec, secret = self.decide(session, policy, host, call)
        opened = _Open(session, address, label, host, call, asyncio.current_task())
        self.open.add(opened)
        try:
            address_up, connection = await self._connect(policy, parse_host(host), secret,
                                                         session)
            event = self.event(decision, session, label, host, address=address_up)
            async with connection:
                upstream = await connection.create_process(
                    f"{call.service} '{call.repo}.git'", encoding=None)
                if call.service == git.RECEIVE:
                    return await self._push(process, upstream, spec, session, label, host,
                                            event)
                return await _relay(process, upstream)
        except asyncio.CancelledError:
            if opened.cut is None:
                raise  # the filter is stopping
            asyncio.current_task().uncancel()
            process.stderr.write(f"corral: cut: {opened.cut}\n".encode()[:1000])
            return 128  # its event is rejudge's
        finally:
            self.open.discard(opened)

    async def _connect(self, policy: Policy, host, secret, session: str):
        """An SSH connection to the first of `host`'s addresses the policy lets the filter
        dial, the host checked against the secret's pinned keys only."""
        config = self.proxy.config
        try:
            addresses = await self.proxy.resolver.addresses(host.name, session)
        except Exception as exc:
            raise Refused(Decision(False, f"cannot resolve {host}: {exc}")) from None
        refusal, failure = None, None
        for address in addresses:
            check = policy.decide_address(address, host, secret.port)
            if not check.allowed:
                refusal = refusal or check
                continue
            try:
                connection = await asyncio.wait_for(asyncssh.connect(
                    str(address), secret.port, username=secret.user,
                    client_keys=[asyncssh.import_private_key(secret.value)],
                    known_hosts=([asyncssh.import_public_key(k) for k in secret.host_keys],
                                 [], []),
                    config=None, agent_path=None, agent_forwarding=False, gss_host=None,
                    preferred_auth="publickey", x509_trusted_certs=None,
                    login_timeout=config.connect_timeout), config.connect_timeout * 2)
            except asyncssh.HostKeyNotVerifiable:
                failure = (f"{host} ({address}) showed a host key the appliance does not "
                           f"pin for it (secret {secret.name}): refused")
                continue
            except (asyncssh.Error, OSError, TimeoutError) as exc:
                failure = f"ssh to {address}:{secret.port} failed: {exc or 'timed out'}"
                continue
            return str(address), connection
        if failure is not None:
            raise Refused(Decision(False, failure))
        raise Refused(refusal or Decision(False, f"{host} has no address"))

    async def _push(self, process, upstream, spec, session: str, label: str, host: str,
                    event: dict) -> int:
        """git-receive-pack: the host's refs go to the client as they come; the client's
        push is read whole (gitssh.PushStream) and judged before a byte of it goes on."""
        down = asyncio.ensure_future(_copy(upstream.stdout, process.stdout))
        errors = asyncio.ensure_future(_copy(upstream.stderr, process.stderr))
        forward = self.proxy.forward
        holding: list = []
        stream = gitssh.PushStream()
        try:
            try:
                forward._hold(session, git.MAX_PUSH, holding)
                idle = self.proxy.config.idle_timeout
                while True:
                    data = await asyncio.wait_for(process.stdin.read(READ), idle)
                    if not data:
                        stream.feed_eof()
                        break
                    if stream.feed(data):
                        break
            except (git.GitProtocolError, HttpError, TimeoutError) as exc:
                read = stream.push  # the commands, when they were read: refused in their form
                verdict = git.Verdict((), read.capabilities if read else frozenset(),
                                      read.commands if read else (),
                                      str(exc) or "the push stopped coming")
            else:
                async with forward._judge_slot(session):
                    verdict = await asyncio.get_running_loop().run_in_executor(
                        _judges(), _judge, stream.body, (), spec, session)
            if not verdict.allowed:
                for task in (down, errors):
                    task.cancel()
                decision = Decision(False, verdict.reason[:500], hint=(
                    f"push to a branch under {spec.pushes[0].replace('{session}', session)}, "
                    f"or name the ref in push of the [[git]] table for {host}"))
                self.event(decision, session, label, host, address=event.get("address"))
                process.stdout.write(git.report(verdict))
                return 0  # git prints each ref's refusal and fails the push itself
            upstream.stdin.write(stream.body)
            upstream.stdin.write_eof()
            await asyncio.gather(down, errors)
            done = await upstream.wait()
            return done.exit_status if done.exit_status is not None else 128
        finally:
            forward._release(holding)
            for task in (down, errors):
                task.cancel()


class _Server(asyncssh.SSHServer):
    """One connection from a session: its key, checked against its address's session."""

    def __init__(self, gate: Gate):
        self.gate = gate
        self.session: str | None = None
        self.admitted = False

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        peer = conn.get_extra_info("peername") or ("?", 0)
        self.session, _ = self.gate.store.lookup(peer[0])
        connections = self.gate.proxy.flows.connections
        if not connections.admit(self.session):  # the session's share, as for the proxy
            asyncio.get_running_loop().call_soon(conn.abort)  # once asyncssh has set it up
            return
        self.admitted = True

    def connection_lost(self, exc) -> None:
        if self.admitted:
            self.admitted = False
            self.gate.proxy.flows.connections.release(self.session)

    def begin_auth(self, username: str) -> bool:
        return True

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        if self.session is None or self.session not in self.gate.store.sessions:
            return False
        expected = self.gate.key_for(self.session)
        return hmac.compare_digest(key.public_data, expected.public_data)


def _env(process) -> dict[str, str]:
    found = {}
    for key, value in (process.env or {}).items():
        key = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
        value = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        found[key] = value
    return found


async def _copy(reader, writer, eof: bool = False) -> None:
    while True:
        data = await reader.read(READ)
        if not data:
            break
        writer.write(data)
        await writer.drain()
    if eof:
        writer.write_eof()


async def _relay(process, upstream) -> int:
    """A fetch (upload-pack, upload-archive): both ways as it comes, until the host ends."""
    tasks = [asyncio.ensure_future(_copy(process.stdin, upstream.stdin, eof=True)),
             asyncio.ensure_future(_copy(upstream.stdout, process.stdout)),
             asyncio.ensure_future(_copy(upstream.stderr, process.stderr))]
    try:
        await asyncio.gather(*tasks[1:])
        done = await upstream.wait()
        return done.exit_status if done.exit_status is not None else 128
    finally:
        for task in tasks:
            task.cancel()
