"""The git gateway: git over SSH, confined as it is over HTTPS. The socket edge; what git
sends is read by sshwire.py and judged by http.py, without sockets.

A session's ssh client is configured (sandbox/sshconf.py) to reach a `[[git]]` host
through the gateway, on its gateway address, with a key of its own and the host's name
in CORRAL_GIT_HOST:

    agent's git ──ssh, session key──▶ gateway ──ssh, held key──▶ github.com:22
                                      │ the session: its source address (and its key)
                                      │ the repository: its [[git]] table (which, with
                                      │   a key held for the host, is the allowance:
                                      │   no http or tcp rule needed; a deny rule wins)
                                      │ a push: read whole, judged, then sent or refused

The session never holds the key the host knows: the appliance does (`corral secret set
NAME --ssh`), and reaches the host only if it shows one of the keys pinned with it. Fetches
are relayed as they are; a push (git-receive-pack) is read to its end and judged as over
HTTPS (the session's refs only, forward only, no deletes, no tags moved), on the judges'
threads, then sent on whole or answered in git's own report, so that `git push` prints
why. Nothing else runs here: no shell, no port forwarding, no subsystems, no other command.
A policy or secret change that no longer allows a call in progress cuts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import asyncssh
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from appliance.atomic import write_atomic
from appliance.policy import ConfigError, Decision, HostNameError, Policy, parse_host
from appliance.policy.git import SSH_HOST_VARIABLE
from appliance.policystore import PolicyStore
from appliance.sessionconfig import ProxyConfig

from .. import dial
from ..denied import Denied
from ..dns.resolver import Resolver
from ..events import EventBus
from ..http import HttpError
from ..ratelimit import LogBudget
from ..secrets import SecretStore
from . import http as git
from . import sshwire

log = logging.getLogger(__name__)

HOST_KEY = "sshgate_host_key"
READ = 1 << 16
LOGIN_SECONDS = 20.0
PUSH_SECONDS = 600.0
"""How long the client may take to send a whole push (each read also waits at most the
proxy's idle_timeout)."""
MAX_CALLS = 8
"""git calls one session may have open through the gateway at once: each is a connection
to the host (a client may open many channels on one connection)."""
KEEPALIVE = 30
KEX = ["curve25519-sha256", "curve25519-sha256@libssh.org", "curve448-sha512",
       "ecdh-sha2-nistp256"]
"""Key exchanges the gateway offers: elliptic curves only, each a fraction of a millisecond
of the loop. RSA key exchange makes a key per connection and 8192-bit DH costs tens of
milliseconds: a session logging in over and over would stall every other's traffic."""


def session_key(key: bytes, session: str, identity: str) -> asyncssh.SSHKey:
    """The key a session reaches the gateway with: made from the filter's own key (the
    secrets file's), the session's name and its subnet, so it is the same after a restart
    and stored nowhere. A later session of the same name on the same subnet gets the same
    key (it is that session's, and the old one's container is gone)."""
    seed = hmac.new(key, b"corral-sshgate\0" + session.encode() + b"\0" + identity.encode(),
                    hashlib.sha256).digest()
    pem = Ed25519PrivateKey.from_private_bytes(seed).private_bytes(
        Encoding.PEM, PrivateFormat.OpenSSH, NoEncryption())
    return asyncssh.import_private_key(pem)


def host_key(state_dir: str | Path) -> asyncssh.SSHKey:
    """The gateway's own host key, made (Ed25519, 0600) on its first start. Raises
    ConfigError naming the file when it cannot be read as a key."""
    path = Path(state_dir) / HOST_KEY
    try:
        return asyncssh.read_private_key(str(path))
    except FileNotFoundError:
        pass
    except (OSError, asyncssh.KeyImportError, ValueError) as exc:
        raise ConfigError(str(path), "", f"the git gateway's host key cannot be read ({exc}): "
                          "remove the file for a new one (sessions started after get it)"
                          ) from None
    key = asyncssh.generate_private_key("ssh-ed25519")
    write_atomic(path, key.export_private_key(), mode=0o600)
    return key


@dataclass(eq=False)
class _Open:
    """A git call in progress: judged again when the policy or the secrets change."""

    session: str
    address: str
    label: str
    host: str
    call: sshwire.SshCall
    task: asyncio.Task
    secret: object = None
    upstream: str | None = None
    cut: str | None = None


@dataclass
class _Held:
    """An ssh secret's key and pinned host keys, parsed once (an RSA key takes a third of a
    second to check)."""

    client_key: asyncssh.SSHKey
    host_keys: list = field(default_factory=list)


class Judges(Protocol):
    """The proxy's judges (proxy/forward.py), whose threads and held-bytes budget a push
    over SSH shares with those over HTTPS."""

    def hold(self, session: str | None, n: int, holding: list) -> None: ...
    def release(self, holding: list) -> None: ...
    async def judged(self, session: str | None, work, *args): ...


class Admission(Protocol):
    """The proxy's cap on a session's connections (proxy/flows.py), which the gateway's
    count against too."""

    def admit(self, session: str | None) -> bool: ...
    def release(self, session: str | None) -> None: ...


class Gate:
    """The gateway of one filter: the policy, the secrets, the events, and the parts of the
    proxy it dials and judges pushes with, are the filter's (service.py gives them)."""

    def __init__(self, store: PolicyStore, bus: EventBus, secrets: SecretStore,
                 state_dir: str | Path, port: Callable[[], int], *, judges: Judges,
                 admission: Admission, failures: LogBudget, timeouts: ProxyConfig,
                 gateway, resolver: Resolver):
        """`port()`: the port the gateway listens on (for a session's ssh client);
        `gateway` and `resolver`: what host.corral and every other name dial (dial.py);
        `failures`: the proxy's budget of logged failures, which the gateway's share."""
        self.store, self.bus, self.secrets = store, bus, secrets
        self.judges, self.admission, self.failures = judges, admission, failures
        self.timeouts, self.gateway, self.resolver = timeouts, gateway, resolver
        self.port = port
        self.host_key = host_key(state_dir)
        self.open: set[_Open] = set()
        self.calls: dict[str, int] = {}
        self.connections: set[asyncssh.SSHServerConnection] = set()
        self._session_keys: dict[tuple[str, str], asyncssh.SSHKey] = {}
        self._held: dict[object, _Held] = {}
        self.store.on_change(self.rejudge)
        self.secrets.on_change(self.rejudge)  # an ssh key replaced or removed: its calls end

    def key_for(self, session: str) -> asyncssh.SSHKey:
        identity = (session, self.store.identity(session))
        found = self._session_keys.get(identity)
        if found is None:
            if len(self._session_keys) > 4096:
                self._session_keys.clear()
            found = self._session_keys[identity] = session_key(self.secrets.key, *identity)
        return found

    def session_files(self, session: str) -> dict:
        """What a session's ssh client needs (sandbox/sshconf.py): its key, the gateway's
        host key, the port, and the hosts it reaches through the gateway: those its policy
        has a [[git]] table for and the appliance holds an ssh key for."""
        policy = self.store.sessions[session].policy
        hosts = sorted({h for s in self.secrets.secrets.values() if s.scheme == "ssh"
                        for h in s.hosts if policy.git(parse_host(h)) is not None})
        port = self.port()
        return {"key": self.key_for(session).export_private_key().decode(),
                "host_key": self.host_key.export_public_key().decode().strip(),
                "port": port, "hosts": hosts}

    async def listen(self, sock) -> asyncssh.SSHAcceptor:
        return await asyncssh.listen(
            sock=sock, server_factory=lambda: _Server(self), server_host_keys=[self.host_key],
            process_factory=self.serve, encoding=None, allow_pty=False,
            agent_forwarding=False, x11_forwarding=False, allow_scp=False,
            login_timeout=LOGIN_SECONDS, keepalive_interval=KEEPALIVE, keepalive_count_max=4,
            kex_algs=KEX, compression_algs=["none"])

    async def close(self) -> None:
        """The filter is stopping: every call is cut, with an event and its client told
        why, then every connection closed; all before the audit log closes."""
        tasks = []
        for opened in list(self.open):
            why = "the appliance's filter is stopping"
            self.event(Decision(False, f"cut: {why}"), opened.session, opened.label,
                       opened.host)
            self._cut(opened, why)
            tasks.append(opened.task)
        if tasks:
            await asyncio.wait(tasks, timeout=5)  # their last words are sent
            # and the clients leave once told (ssh ends with its channel): closing first
            # would reset connections over what their clients have not read yet
            leaving = [asyncio.ensure_future(c.wait_closed()) for c in self.connections]
            if leaving:
                _, late = await asyncio.wait(leaving, timeout=2)
                for waiting in late:
                    waiting.cancel()
        for connection in list(self.connections):
            connection.close()

    # -- deciding ------------------------------------------------------------------------

    def decide(self, session: str, policy: Policy, host_name: str, call: sshwire.SshCall):
        """(decision, spec, secret) for this call now; Denied when it may not be made."""
        try:
            host = parse_host(host_name)
        except HostNameError as exc:
            raise Denied(Decision(False, f"{SSH_HOST_VARIABLE}={host_name[:100]!r}: "
                                   f"{exc}")) from None
        denied = policy.denied_by(host)
        if denied is not None:  # a deny rule wins over every allow, a [[git]] table's too
            raise Denied(Decision(False, f"{host} is denied to session {session} "
                                   f"({denied.text})", denied))
        access = policy.git(host)
        if access is None:
            raise Denied(Decision(False, f"{host} has no [[git]] table in session {session}'s "
                                   "policy", hint=f'add [[git]] host = "{host}" with its '
                                   "repos to corral.toml"))
        spec = access.repository(call.repo)
        if spec is None:
            raise Denied(Decision(False, f"git repository {call.repo[:100]!r} on {host} is "
                                   f"not listed (listed: {access.listed()})",
                                   hint=f'add "{call.repo[:100]}" to repos of the [[git]] '
                                   f"table for {host} in corral.toml"))
        secret = self.secrets.ssh(host.name)
        if secret is None:
            raise Denied(Decision(False, f"the appliance holds no ssh key for {host}", hint=(
                f"corral secret set NAME --ssh --host {host} --known-hosts FILE < KEY")))
        return (Decision(True, f"git {call.service} of {call.repo} on {host} through the "
                         f"gateway (ssh key {secret.name})"), spec, secret)

    def rejudge(self) -> None:
        """The policy or the secrets changed: a call they no longer allow is cut, with an
        event (its session, repository and host, the key it uses, the address it reached)."""
        for opened in list(self.open):
            session, policy = self.store.lookup(opened.address)
            try:
                if session != opened.session:
                    raise Denied(Decision(False, f"session {opened.session} has ended"))
                _, _, secret = self.decide(session, policy, opened.host, opened.call)
                if secret is not opened.secret:
                    raise Denied(Decision(False, f"ssh key {secret.name} for {opened.host} "
                                           "was replaced or removed"))
                if opened.upstream is not None:
                    check = dial.decide(policy, ipaddress.ip_address(opened.upstream),
                                        parse_host(opened.host), secret.port)
                    if not check.allowed:
                        raise Denied(check)
            except Denied as refused:
                self.event(Decision(False, f"cut: {refused.decision.reason} (the policy "
                                    "changed while it was open)"), opened.session,
                           opened.label, opened.host)
                self._cut(opened, refused.decision.reason)

    def _cut(self, opened: _Open, why: str) -> None:
        self.open.discard(opened)  # cut once: a later change does not cut it again
        opened.cut = why
        opened.task.cancel()

    def event(self, decision: Decision, session, label: str, host: str | None, **extra):
        return self.bus.decision(decision, session=session, client=label, kind="git",
                                 name=host[:253] if host else None, port=None, **extra)

    # -- serving -------------------------------------------------------------------------

    async def serve(self, process: asyncssh.SSHServerProcess) -> None:
        peer = process.get_extra_info("peername") or ("?", 0)
        label = f"{peer[0]}:{peer[1]}"
        status = 128
        try:
            status = await self._serve(process, peer[0], label)
        except Denied as refused:
            decision = refused.decision
            session, _ = self.store.lookup(peer[0])
            self.event(decision, session, label, _shown(_env(process).get(SSH_HOST_VARIABLE)))
            hint = f" ({decision.hint})" if decision.hint else ""
            _say(process, f"corral: {decision.reason}{hint}")
        except asyncio.CancelledError:  # the filter is stopping, past Gate.close
            _say(process, "corral: the appliance's filter is stopping")
            with contextlib.suppress(Exception):
                process.exit(status)
            raise
        except (asyncssh.Error, OSError, TimeoutError) as exc:
            _say(process, f"corral: the gateway lost the host: {str(exc) or 'timed out'}")
        except Exception:  # one broken call must never take the gateway down
            self.failures.log(log, self.store.lookup(peer[0])[0], time.monotonic(),
                                    "sshgate: %s failed", label)
            _say(process, "corral: the gateway failed; see the filter's log")
        with contextlib.suppress(Exception):
            process.exit(status)

    async def _serve(self, process, address: str, label: str) -> int:
        session, policy = self.store.lookup(address)
        if session is None:
            raise Denied(Decision(False, "git over ssh from an address no session holds"))
        try:
            call = sshwire.read_exec(process.command or "")
        except git.GitProtocolError as exc:
            raise Denied(Decision(False, f"the gateway runs git only: {exc}")) from None
        host = _env(process).get(SSH_HOST_VARIABLE)
        if not host:
            raise Denied(Decision(False, f"no {SSH_HOST_VARIABLE}: say which host this is "
                                   "for (the session's ssh config does; use "
                                   "git@HOST:OWNER/REPO)"))
        decision, _, secret = self.decide(session, policy, host, call)
        host = str(parse_host(host))  # as decide read it: events and rejudge name it so
        if self.calls.get(session, 0) >= MAX_CALLS:
            raise Denied(Decision(False, f"session {session} has {MAX_CALLS} git calls open "
                                   "through the gateway: the limit"))
        opened = _Open(session, address, label, host, call, asyncio.current_task(), secret)
        self.open.add(opened)
        self.calls[session] = self.calls.get(session, 0) + 1
        try:
            held = await self._parsed(secret)
            upstream, connection = await self._connect(policy, parse_host(host), secret, held,
                                                       session)
            if opened.cut is not None:  # cut while it dialled (wait_for can keep it)
                connection.close()
                _say(process, f"corral: cut: {opened.cut}")
                return 128
            opened.upstream = upstream
            event = self.event(decision, session, label, host, address=upstream)
            async with connection:
                remote = await connection.create_process(
                    f"{call.service} '{call.repo}.git'", encoding=None)  # a name: no quotes
                if call.service == git.RECEIVE:
                    return await self._push(process, remote, opened, event)
                return await _relay(process, remote)
        except asyncio.CancelledError:
            if opened.cut is None:
                raise  # the filter is stopping
            asyncio.current_task().uncancel()
            _say(process, f"corral: cut: {opened.cut}")
            return 128  # its event is rejudge's
        finally:
            self.open.discard(opened)
            left = self.calls[session] - 1
            if left:
                self.calls[session] = left
            else:
                del self.calls[session]

    async def _parsed(self, secret) -> _Held:
        found = self._held.get(secret)  # the secret itself: a replacement is another
        if found is None:
            found = await asyncio.get_running_loop().run_in_executor(None, _parse, secret)
            if len(self._held) > 256:
                self._held.clear()
            self._held[secret] = found
        return found

    async def _connect(self, policy: Policy, host, secret, held: _Held, session: str):
        """An SSH connection to the first of `host`'s addresses the policy lets the filter
        dial, the host checked against the secret's pinned keys only."""
        timeout = self.timeouts.connect_timeout

        async def connect(address):
            try:
                return await asyncio.wait_for(asyncssh.connect(
                    str(address), secret.port, username=secret.user,
                    client_keys=[held.client_key], known_hosts=(held.host_keys, [], []),
                    config=None, agent_path=None, agent_forwarding=False, gss_host=None,
                    preferred_auth="publickey", x509_trusted_certs=None,
                    keepalive_interval=KEEPALIVE, keepalive_count_max=4,
                    login_timeout=timeout), timeout * 2)
            except asyncssh.HostKeyNotVerifiable:
                raise dial.Unanswered(f"{host} ({address}) showed a host key the appliance "
                                      f"does not pin for it (secret {secret.name}): "
                                      "refused") from None
            except (asyncssh.Error, OSError, TimeoutError) as exc:
                raise dial.Unanswered(f"ssh to {address}:{secret.port} failed: "
                                      f"{str(exc) or 'timed out'}") from None

        try:
            try:
                addresses = await dial.candidates(host, self.gateway, self.resolver, session)
            except dial.Undialable:
                raise
            except Exception as exc:  # any resolver failure is a refusal, with its event
                raise Denied(Decision(False, f"cannot resolve {host}: {exc}")) from None
            return await dial.first_answering(
                addresses, lambda a: dial.decide(policy, a, host, secret.port), connect, host)
        except dial.Undialable as exc:
            raise Denied(exc.decision) from None

    async def _push(self, process, remote, opened: _Open, event: dict) -> int:
        """git-receive-pack: the host's refs go to the client as they come; the client's
        push is read whole (sshwire.PushStream, on the judges' threads: reading a pack is
        inflating it) and judged under the policy in force then, before a byte of it goes
        on."""
        session, host, forward = opened.session, opened.host, self.judges
        copies = [asyncio.ensure_future(_copy(remote.stdout, process.stdout)),
                  asyncio.ensure_future(_copy(remote.stderr, process.stderr))]
        holding: list = []
        stream = sshwire.PushStream()
        spec = None
        try:
            try:
                deadline = time.monotonic() + PUSH_SECONDS
                idle = self.timeouts.idle_timeout
                while True:
                    data = await _read(process, copies[0], min(idle, deadline - time.monotonic()))
                    _still(opened)
                    if data is None:  # the host ended first: it said why (relayed)
                        return 128
                    if not data:
                        stream.feed_eof()
                        break
                    forward.hold(session, len(data), holding)  # as it comes, never ahead
                    whole = await forward.judged(session, stream.feed, data)
                    _still(opened)
                    if whole:
                        break
                session_now, policy = self.store.lookup(opened.address)
                if session_now != session:
                    raise Denied(Decision(False, f"session {session} has ended"))
                _, spec, secret = self.decide(session, policy, host, opened.call)
                if secret is not opened.secret:
                    raise Denied(Decision(False, f"ssh key {secret.name} for {host} was "
                                           "replaced"))
            except (git.GitProtocolError, HttpError, TimeoutError, Denied) as exc:
                read = stream.push  # the commands, when they were read: refused in their form
                verdict = git.Verdict((), read.capabilities if read else frozenset(),
                                      read.commands if read else (),
                                      str(exc) or "the push stopped coming")
            else:
                verdict = await forward.judged(session, git.judge_push, stream.body, (), spec,
                                               session)
                _still(opened)
            if not verdict.allowed:
                for task in copies:
                    task.cancel()
                decision = Decision(False, verdict.reason[:500],
                                    hint=git.hint(verdict, spec, session, host))
                self.event(decision, session, opened.label, host, address=event.get("address"))
                process.stdout.write(git.report(verdict))
                return 0  # git prints each ref's refusal and fails the push itself
            remote.stdin.write(stream.body)
            remote.stdin.write_eof()
            await asyncio.gather(*copies, return_exceptions=True)
            done = await remote.wait()
            return done.exit_status if done.exit_status is not None else 128
        finally:
            forward.release(holding)
            for task in copies:
                task.cancel()


class _Server(asyncssh.SSHServer):
    """One connection from a session: its key, checked against its address's session."""

    def __init__(self, gate: Gate):
        self.gate = gate
        self.session: str | None = None
        self.connection: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        peer = conn.get_extra_info("peername") or ("?", 0)
        self.session, _ = self.gate.store.lookup(peer[0])
        connections = self.gate.admission
        # no session's address: nothing here for it, not even a key exchange; and each
        # session within its share of the filter's connections, as for the proxy
        if self.session is None or not connections.admit(self.session):
            asyncio.get_running_loop().call_soon(conn.abort)  # once asyncssh has set it up
            return
        self.connection = conn
        self.gate.connections.add(conn)

    def connection_lost(self, exc) -> None:
        if self.connection is not None:
            self.gate.connections.discard(self.connection)
            self.connection = None
            self.gate.admission.release(self.session)

    def begin_auth(self, username: str) -> bool:
        return True

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        if self.session is None or self.session not in self.gate.store.sessions:
            return False
        expected = self.gate.key_for(self.session)
        return hmac.compare_digest(key.public_data, expected.public_data)


def _still(opened: _Open) -> None:
    """A cut that landed with the data (wait_for can return it, and keep the cancel) is
    a cut all the same."""
    if opened.cut is not None:
        raise asyncio.CancelledError


async def _read(process, host_done: asyncio.Future, seconds: float) -> bytes | None:
    """The client's next bytes (b"" at its end); None if the host ended first. Raises
    TimeoutError past `seconds`."""
    if seconds <= 0:
        raise TimeoutError(f"the push took more than {PUSH_SECONDS:g} s to arrive")
    read = asyncio.ensure_future(process.stdin.read(READ))
    try:
        done, _ = await asyncio.wait({read, host_done}, timeout=seconds,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not read.done():  # a timeout, the host's end, or a cut: no read left behind
            read.cancel()
    if read in done:
        return read.result()
    if host_done in done:
        return None
    raise TimeoutError("the push stopped coming")


def _parse(secret) -> _Held:
    return _Held(asyncssh.import_private_key(secret.value),
                 [asyncssh.import_public_key(k) for k in secret.host_keys])


def _env(process) -> dict[str, str]:
    found = {}
    for key, value in (process.env or {}).items():
        key = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
        value = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        found[key] = value
    return found


def _shown(host: str | None) -> str | None:
    """A host as a session named it, for an event: the name if it is one, else quoted."""
    if not host:
        return None
    try:
        return str(parse_host(host))
    except HostNameError:
        return repr(host[:100])


def _say(process, line: str) -> None:
    """A line for git to print (on stderr); the client may be gone already."""
    with contextlib.suppress(Exception):
        process.stderr.write(line.encode()[:2000] + b"\n")


async def _copy(reader, writer, eof: bool = False) -> None:
    while True:
        data = await reader.read(READ)
        if not data:
            break
        writer.write(data)
        await writer.drain()
    if eof:
        writer.write_eof()


async def _relay(process, remote) -> int:
    """A fetch (upload-pack, upload-archive): both ways as it comes, until the host ends.
    A side that fails (the client gone, the host's connection lost: the keepalives find a
    dead one) ends the call, and leaving closes the host's connection."""
    copies = [asyncio.ensure_future(_copy(process.stdin, remote.stdin, eof=True)),
              asyncio.ensure_future(_copy(remote.stdout, process.stdout)),
              asyncio.ensure_future(_copy(remote.stderr, process.stderr))]
    try:
        pending = set(copies)
        while copies[1] in pending or copies[2] in pending:  # until the host has said all
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if any(not t.cancelled() and t.exception() is not None for t in done):
                return 128
        done = await remote.wait()
        return done.exit_status if done.exit_status is not None else 128
    finally:
        for task in copies:
            task.cancel()
