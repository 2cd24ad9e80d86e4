"""A small fake internet for tests, on 127.0.0.1:0: an authoritative DNS server that logs
every query it receives, an HTTP origin, and a TLS origin with its own CA.

These stand in for the internet (which tests may not reach), never for corral's own code.
All servers run on one asyncio loop in a background thread, so test bodies stay plain
synchronous socket code.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import errno
import hashlib
import ipaddress
import json
import os
import ssl
import struct
import subprocess
import threading
import weakref
from pathlib import Path

from dnslib import QTYPE, RCODE, RR, DNSRecord

SNI_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The server name each TLS connection of a fake origin asked for."""


class Loop:
    """An asyncio loop on a daemon thread; `run(coro)` runs a coroutine on it and waits."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fakes", daemon=True)
        self.thread.start()

    def run(self, coro, timeout=10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class FakeDns:
    """Authoritative for whatever `zone` says: {name: [(qtype, rdata-text, ttl), ...]}.

    Special behaviours per name: `servfail` (answer SERVFAIL), `refuse_aaaa` (REFUSED for
    AAAA only), `silent` (never answer),
    `truncate` (set TC over UDP so the client must retry over TCP), `slow` (answer late).
    """

    def __init__(self, loop: Loop, host: str = "127.0.0.1", port: int = 0, log=None):
        self.host, self.port, self.log = host, port, log
        self.zone: dict[str, list[tuple[str, str, int]]] = {}
        self.servfail: set[str] = set()
        self.silent: set[str] = set()
        self.truncate: set[str] = set()
        self.slow: dict[str, float] = {}
        """Names answered only after this many seconds (over UDP)."""
        self.refuse_aaaa: set[str] = set()
        """Names whose AAAA queries are REFUSED (as dnsmasq without an upstream answers a
        name it holds only an IPv4 address for)."""
        self.queries: list[tuple[str, str, str]] = []  # (transport, name, qtype)
        self.loop = loop
        self.address = loop.run(self._start())

    async def _start(self):
        loop = asyncio.get_running_loop()
        fake = self

        class Udp(asyncio.DatagramProtocol):
            def connection_made(self, transport):
                self.transport = transport

            def datagram_received(self, data, addr):
                reply = fake.answer(data, "udp")
                if reply is not None:
                    name = str(DNSRecord.parse(data).q.qname).rstrip(".").lower()
                    asyncio.get_running_loop().call_later(
                        fake.slow.get(name, 0), self.transport.sendto, reply, addr)

        async def tcp(reader, writer):
            try:
                (n,) = struct.unpack("!H", await reader.readexactly(2))
                reply = self.answer(await reader.readexactly(n), "tcp")
                if reply is not None:
                    writer.write(struct.pack("!H", len(reply)) + reply)
                    await writer.drain()
            except asyncio.IncompleteReadError:
                pass
            writer.close()

        # UDP and TCP on one port: a port free for UDP may be held for TCP (a connection
        # of an earlier test still using it as its own end), so a random one is tried again
        for attempt in range(1 if self.port else 20):
            self.udp, _ = await loop.create_datagram_endpoint(
                Udp, local_addr=(self.host, self.port))
            port = self.udp.get_extra_info("sockname")[1]
            try:
                self.tcp = await asyncio.start_server(tcp, self.host, port)
            except OSError as exc:
                self.udp.close()
                if exc.errno != errno.EADDRINUSE or self.port or attempt == 19:
                    raise
                continue
            return (self.host, port)

    def answer(self, data: bytes, transport: str) -> bytes | None:
        request = DNSRecord.parse(data)
        name = str(request.q.qname).rstrip(".").lower()
        qtype = QTYPE.get(request.q.qtype)
        self.queries.append((transport, name, qtype))
        if self.log is not None:
            self.log.write(f"{transport} {name} {qtype}\n")
            self.log.flush()
        if name in self.silent:
            return None
        reply = request.reply()
        if name in self.servfail:
            reply.header.rcode = RCODE.SERVFAIL
            return reply.pack()
        if name in self.refuse_aaaa and qtype == "AAAA":
            reply.header.rcode = RCODE.REFUSED
            return reply.pack()
        if transport == "udp" and name in self.truncate:
            reply.header.tc = 1
            return reply.pack()
        records = self.zone.get(name)
        if records is None:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply.pack()
        for rtype, value, ttl in records:
            if rtype == qtype or rtype == "CNAME":
                reply.add_answer(*RR.fromZone(f"{name}. {ttl} IN {rtype} {value}"))
                if rtype == "CNAME":
                    for t2, v2, ttl2 in self.zone.get(value.rstrip("."), []):
                        if t2 == qtype:
                            reply.add_answer(*RR.fromZone(f"{value} {ttl2} IN {t2} {v2}"))
        return reply.pack()

    def names_asked(self) -> set[str]:
        return {name for _, name, _ in self.queries}

    def close(self):
        self.udp.close()
        self.tcp.close()


def websocket_accept(key: str) -> str:
    """The Sec-WebSocket-Accept a server answers `key` with (RFC 6455 §4.2.2)."""
    digest = hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()
    return base64.b64encode(digest).decode()


class FakeHttp:
    """An HTTP/1.1 origin. Every response body is JSON describing the request it got.

    /chunked answers with a chunked body; /close with a close-delimited one; /upgrade
    switches to a WebSocket and then echoes bytes back; /status/101 answers 101 as httpbin
    does, switching nothing (/status/101/wrong-accept with WebSocket fields and a wrong
    Sec-WebSocket-Accept) and reads the next request as HTTP; anything else answers with a
    length.
    """

    def __init__(self, loop: Loop, ssl_context: ssl.SSLContext | None = None, port: int = 0,
                 host: str = "127.0.0.1", log: Path | None = None):
        self.requests: list[dict] = []
        self.accepted = 0
        """Connections accepted: how a test tells a kept connection from a new one."""
        self.resumed: list[bool] = []
        """Per TLS connection that sent a request: whether its TLS session was resumed."""
        self._log = None if log is None else os.open(log, os.O_WRONLY | os.O_APPEND
                                                      | os.O_CREAT, 0o644)
        """Where each request's method, Host and path are appended, one line each (when the
        origin runs in a process of its own, as the e2e tier's fake internet)."""
        self.loop = loop
        self.ssl_context = ssl_context
        self.port = loop.run(self._start(host, port))

    async def _start(self, host, port):
        self.server = await asyncio.start_server(self._handle, host, port, ssl=self.ssl_context,
                                                 reuse_address=True)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader, writer):
        self.accepted += 1
        counted = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ")
                headers = {}
                for line in lines[1:]:
                    if line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                if self._log is not None:  # on the head: a leak cut short is logged too
                    os.write(self._log, f"{method} {headers.get('host', '-')} {path}\n"
                             .encode("latin-1"))
                body = b""
                if "content-length" in headers:
                    body = await reader.readexactly(int(headers["content-length"]))
                elif headers.get("transfer-encoding") == "chunked":
                    while True:
                        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                        if size == 0:
                            await reader.readuntil(b"\r\n")
                            break
                        body += await reader.readexactly(size)
                        await reader.readexactly(2)
                if not counted and (session := writer.get_extra_info("ssl_object")):
                    self.resumed.append(session.session_reused)
                    counted = True
                info = {"method": method, "path": path, "headers": headers,
                        "body": body.decode("latin-1"),
                        "tls_sni": SNI_SEEN.get(tls) if (tls := writer.get_extra_info(
                            "ssl_object")) else None}
                self.requests.append(info)
                payload = json.dumps(info).encode()
                if path == "/upgrade":  # a real WebSocket switch, then an echo of the bytes
                    accept = websocket_accept(headers.get("sec-websocket-key", ""))
                    writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                                 b"Connection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n"
                                 % accept.encode())
                    while data := await reader.read(65536):
                        writer.write(data)
                    break
                if path.startswith("/status/101"):  # httpbin's: a 101 that switches nothing,
                    writer.write(b"HTTP/1.1 101 Switching Protocols\r\n"  # then more HTTP
                                 + (b"Upgrade: websocket\r\nConnection: Upgrade\r\n"
                                    b"Sec-WebSocket-Accept: d3JvbmcgYWNjZXB0IGtleQ==\r\n"
                                    if path.endswith("/wrong-accept") else b"") + b"\r\n")
                    await writer.drain()
                    continue
                if path == "/chunked":
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    for i in range(0, len(payload), 7):
                        part = payload[i : i + 7]
                        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                    writer.write(b"0\r\n\r\n")
                elif path == "/close":
                    writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + payload)
                    await writer.drain()
                    break
                elif path.startswith("/big/"):
                    n = int(path.split("/")[2])
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n)
                    writer.write(b"x" * n)
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, ValueError):
            pass
        finally:
            writer.close()

    def close(self):
        self.server.close()
        if self._log is not None:
            os.close(self._log)
            self._log = None


class TestCA:
    """A throwaway CA and server certificates for names, minted with cryptography."""

    def __init__(self, directory: Path):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self._x509, self._hashes, self._ser, self._ec = x509, hashes, serialization, ec
        self._oid = NameOID
        self.dir = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "corral test CA")])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            # as a public CA's: OpenSSL's strict verification (Python 3.13's default, the
            # sandbox image's pip and urllib) wants key usage and key identifiers
            .add_extension(x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()),
                           critical=False)
            .sign(self.key, hashes.SHA256())
        )
        self.ca_path = directory / "ca.pem"
        self.ca_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def server_context(self, names: list[str]) -> ssl.SSLContext:
        x509, ser = self._x509, self._ser
        key = self._ec.generate_private_key(self._ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans = [x509.DNSName(n) for n in names]
        sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(self._oid.COMMON_NAME, names[0])]))
            .issuer_name(self.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self.key.public_key()), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(self.key, self._hashes.SHA256())
        )
        cert_path, key_path = self.dir / f"{names[0]}.pem", self.dir / f"{names[0]}.key"
        cert_path.write_bytes(cert.public_bytes(ser.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8,
                                               ser.NoEncryption()))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert_path, key_path)
        context.sni_callback = lambda ssl_object, name, _: SNI_SEEN.__setitem__(ssl_object, name)
        return context

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_path))
        return context


class GitHttp:
    """A git server over smart HTTP: `git http-backend` (git's own CGI program) behind a
    small HTTP/1.1 front, serving the bare repositories under `root` (pushes enabled, as an
    authenticated server would). Every request line goes to `requests`."""

    def __init__(self, loop: Loop, root: Path, ssl_context: ssl.SSLContext | None = None,
                 host: str = "127.0.0.1", port: int = 0):
        self.root, self.loop, self.ssl_context = root, loop, ssl_context
        self.requests: list[str] = []
        self.port = loop.run(self._start(host, port))

    async def _start(self, host, port):
        self.server = await asyncio.start_server(self._handle, host, port, ssl=self.ssl_context,
                                                 reuse_address=True)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ")
                headers = {}
                for line in lines[1:]:
                    if line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                body = b""
                if "content-length" in headers:
                    body = await reader.readexactly(int(headers["content-length"]))
                elif headers.get("transfer-encoding") == "chunked":
                    while True:
                        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                        if size == 0:
                            await reader.readuntil(b"\r\n")
                            break
                        body += await reader.readexactly(size)
                        await reader.readexactly(2)
                self.requests.append(f"{method} {target}")
                path, _, query = target.partition("?")
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                       "GIT_PROJECT_ROOT": str(self.root), "GIT_HTTP_EXPORT_ALL": "1",
                       "REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query,
                       "CONTENT_TYPE": headers.get("content-type", ""),
                       "CONTENT_LENGTH": str(len(body)), "REMOTE_USER": "corral-test",
                       "REMOTE_ADDR": "127.0.0.1", "GIT_CONFIG_NOSYSTEM": "1",
                       "HOME": str(self.root)}
                if "content-encoding" in headers:
                    env["HTTP_CONTENT_ENCODING"] = headers["content-encoding"]
                if "git-protocol" in headers:
                    env["GIT_PROTOCOL"] = headers["git-protocol"]
                # a thread, not asyncio's subprocess transports: nothing is left for a closed
                # loop to finish (an unclosed transport warns when collected, in a later test)
                out = (await asyncio.to_thread(
                    subprocess.run, ["git", "http-backend"], env=env, input=body,
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=60)).stdout
                cgi_head, _, payload = out.partition(b"\r\n\r\n")
                if not _:
                    cgi_head, _, payload = out.partition(b"\n\n")
                status, fields = "200 OK", []
                for line in cgi_head.decode("latin-1").splitlines():
                    name, _, value = line.partition(":")
                    if name.lower() == "status":
                        status = value.strip()
                    elif name:
                        fields.append(f"{name}: {value.strip()}")
                response = [f"HTTP/1.1 {status}", *fields, f"Content-Length: {len(payload)}"]
                writer.write(("\r\n".join(response) + "\r\n\r\n").encode("latin-1") + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, ValueError):
            pass
        finally:
            writer.close()

    def close(self):
        async def close():  # on the loop's own thread: asyncio servers are not thread-safe
            self.server.close()
            await self.server.wait_closed()

        self.loop.run(close())

    @staticmethod
    def seed(root: Path, repos: list[str]) -> str:
        """Bare repositories `root/REPO.git`, each with branch main at one commit (the same
        in each); returns that commit's id."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root),
               "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "seed",
               "GIT_AUTHOR_EMAIL": "seed@corral.test", "GIT_COMMITTER_NAME": "seed",
               "GIT_COMMITTER_EMAIL": "seed@corral.test"}
        work = root / ".seed"

        def git(*args, cwd=None):
            return subprocess.run(["git", *args], cwd=cwd, env=env, check=True,
                                  capture_output=True, text=True).stdout.strip()

        git("init", "-q", "-b", "main", str(work))
        (work / "README").write_text("widget\n")
        git("add", "README", cwd=work)
        git("commit", "-q", "-m", "first", cwd=work)
        for repo in repos:
            bare = root / f"{repo}.git"
            bare.parent.mkdir(parents=True, exist_ok=True)
            git("init", "-q", "--bare", "-b", "main", str(bare))
            git("push", "-q", str(bare), "main", cwd=work)
        return git("rev-parse", "HEAD", cwd=work)

    @staticmethod
    def refs(bare: Path) -> dict[str, str]:
        listed = subprocess.run(["git", "-C", str(bare), "for-each-ref",
                                 "--format=%(refname) %(objectname)"], capture_output=True,
                                text=True, check=True, env={
                                    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                    "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(bare),
                                    "GIT_CONFIG_COUNT": "1",
                                    "GIT_CONFIG_KEY_0": "safe.directory",
                                    "GIT_CONFIG_VALUE_0": "*"}).stdout
        return dict(line.split(" ") for line in listed.splitlines())


PUSH_OPTIONS_LOG = "push-options.log"


ADVERTISE_PUSH_OPTIONS = "[receive]\n\tadvertisePushOptions = true\n"


def hear_push_options(bare: Path) -> Path:
    """Make the bare repository advertise push options (`receive.advertisePushOptions`),
    as GitLab's do, and give it a pre-receive hook that writes what a forge acts on: a
    line `push COUNT` per push that reached the hook, then one `option VALUE` per push option
    it was handed (GIT_PUSH_OPTION_i). Returns the log's path (empty); `forget_push_options`
    undoes it."""
    log = bare / PUSH_OPTIONS_LOG
    config = bare / "config"
    if ADVERTISE_PUSH_OPTIONS not in config.read_text():
        with config.open("a") as f:
            f.write(ADVERTISE_PUSH_OPTIONS)
    hook = bare / "hooks" / "pre-receive"
    hook.parent.mkdir(exist_ok=True)
    hook.write_text(f"#!/bin/sh\ncat > /dev/null\necho \"push ${{GIT_PUSH_OPTION_COUNT:-none}}\" "
                    f">> '{log}'\nenv | sed -n 's/^GIT_PUSH_OPTION_[0-9][0-9]*=/option /p' "
                    f">> '{log}'\n")
    hook.chmod(0o755)
    log.write_text("")
    return log


def forget_push_options(bare: Path) -> None:
    config = bare / "config"
    config.write_text(config.read_text().replace(ADVERTISE_PUSH_OPTIONS, ""))
    (bare / "hooks" / "pre-receive").unlink(missing_ok=True)
    (bare / PUSH_OPTIONS_LOG).unlink(missing_ok=True)


def options_heard(log: Path) -> list[str]:
    """The push options the hook of `hear_push_options` was handed, all pushes together
    (sorted: the hook reads them from its environment, in no order)."""
    return sorted(line[len("option "):] for line in log.read_text().splitlines()
                  if line.startswith("option "))


class GitSsh:
    """A git server over SSH, as forges run one: an SSH server (asyncssh) that lets in one
    client key and runs each exec request through `git-shell -c COMMAND` (git's commands
    only) in `root`, where GitHttp.seed put the bare repositories. Every command goes to
    `commands`; `host_key` is its own, made here (`public` for a known_hosts line)."""

    def __init__(self, loop: Loop, root: Path, client_public: str, host: str = "127.0.0.1",
                 port: int = 0):
        import asyncssh

        self.loop, self.root = loop, root
        self.commands: list[str] = []
        self.host_key = asyncssh.generate_private_key("ssh-ed25519")
        self.public = self.host_key.export_public_key().decode().strip()
        self.port = loop.run(self._start(asyncssh, client_public, host, port))

    async def _start(self, asyncssh, client_public, host, port):
        self.server = await asyncssh.listen(
            host, port, server_host_keys=[self.host_key],
            authorized_client_keys=asyncssh.import_authorized_keys(client_public),
            process_factory=self._run, encoding=None, allow_pty=False, reuse_address=True)
        return self.server.sockets[0].getsockname()[1]

    async def _run(self, process):
        self.commands.append(process.command or "")
        child = await asyncio.create_subprocess_exec(
            "git-shell", "-c", process.command or "", cwd=self.root,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root),
                 "GIT_CONFIG_NOSYSTEM": "1"},
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)

        async def pump(source, sink, eof):
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
            eof()

        tasks = [asyncio.ensure_future(pump(process.stdin, child.stdin, child.stdin.close)),
                 asyncio.ensure_future(pump(child.stdout, process.stdout, lambda: None)),
                 asyncio.ensure_future(pump(child.stderr, process.stderr, lambda: None))]
        try:
            await asyncio.gather(*tasks[1:])
            process.exit(await child.wait())
        finally:
            for task in tasks:
                task.cancel()
            if child.returncode is None:
                child.kill()

    def close(self):
        async def close():
            self.server.close()
            await self.server.wait_closed()

        self.loop.run(close())
