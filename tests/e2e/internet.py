"""The fake internet of the e2e tier, run inside its own network namespace:

  python -m tests.e2e.internet DIR

DNS (authoritative, every query logged to DIR/dns-queries.log) on 203.0.113.53:53;
HTTP :80 and HTTPS :443 (certificate from DIR's test CA) on every address, every request
logged to DIR/http-requests.log; an SSH-like
banner on :22; TLS on :853 (DNS-over-TLS stand-in); UDP echo on :443 and :53 of the other
addresses; a git server (`git http-backend`, smart HTTP over TLS) for git.test on
WEB:GIT_PORT, its bare repositories under DIR/git (advertising push options, as GitLab's
do; a pre-receive hook writes those it is handed to REPO.git/push-options.log, see
fakes.hear_push_options), and the same repositories over SSH
(git-shell) on WEB:GIT_SSH_PORT for the key in DIR/git-ssh-held-key (made here: the key
the appliance is to hold; its host key is DIR/git-ssh-host.pub); a long-lived TCP service on
STREAM_HOST:STREAM_PORT (`stream`: every connection and how it ended goes to
DIR/stream.log); the agents' APIs (api.anthropic.com, api.openai.com: the :443 origin, on an
address of their own); a package index for pip (PEP 503) at https://pypi.test:PYPI_PORT/simple/
serving the wheels a test puts in DIR/pypi/, every request logged to DIR/pypi-requests.log
(a download is a `GET pypi.test:PORT /files/NAME` line). Writes DIR/ready when everything
listens; runs until killed.
"""

from __future__ import annotations

import asyncio
import hashlib
import html
import http.server
import re
import ssl
import sys
import threading
import time
from pathlib import Path

import asyncssh

from tests.fakes import FakeDns, FakeHttp, GitHttp, GitSsh, Loop, TestCA, hear_push_options

WEB = "203.0.113.10"
INSPECTED = "203.0.113.11"
"""inspected.test's address, with one more name: neighbour.test, the same front-end's other
site (THREATS 29: a name on an inspected host's address gets no tunnel; the names on WEB
are spliced)."""
RESOLVER = "203.0.113.53"
SSH_HOST = "203.0.113.22"
STREAM_HOST, STREAM_PORT = SSH_HOST, 7007
GIT_PORT = 8443
GIT_SSH_PORT = 2022
GIT_REPOS = ["acme/widget", "other/secret"]
WEB_V6 = "3fff:ff::10"  # RFC 9637 documentation space, not a blocked range
API = "203.0.113.12"
"""The agents' API hosts: answered by the :443 origin, which echoes each request."""
PYPI, PYPI_PORT = "203.0.113.13", 8444
"""pypi.test: the package index (a port of its own: the origin holds :443 on every address)."""

ZONE = {
    "allowed.test": [("A", WEB, 300), ("AAAA", WEB_V6, 300)],
    "other.test": [("A", WEB, 300)],
    "inspected.test": [("A", INSPECTED, 300)],
    "neighbour.test": [("A", INSPECTED, 300)],
    "echo.test": [("A", INSPECTED, 300)],  # a secret's host: inspected, beside inspected.test
    "denied.test": [("A", WEB, 300)],
    "private.test": [("A", "10.0.0.5", 300)],
    "ssh.test": [("A", SSH_HOST, 300)],
    "stream.test": [("A", STREAM_HOST, 300)],
    "git.test": [("A", WEB, 300)],
    "api.anthropic.com": [("A", API, 300)],
    "api.openai.com": [("A", API, 300)],
    "pypi.test": [("A", PYPI, 300)],
}


async def banner(reader, writer):
    writer.write(b"SSH-2.0-corral-e2e\r\n")
    await writer.drain()
    writer.close()


def stream(log: Path):
    """The long-lived TCP service. The first line picks the mode: `echo` sends back every
    byte it gets; `tick` sends "tick\n" every 0.2 s, unasked, until the connection fails (so
    that a cut is seen from this side too). Each connection's end goes to `log`:
    "end PEER MODE eof|reset|error"."""

    def record(line: str) -> None:
        with open(log, "a") as out:
            out.write(line + "\n")

    async def serve(reader, writer):
        host, port = writer.get_extra_info("peername")[:2]
        peer = f"{host}:{port}"
        mode, how = "?", "eof"
        try:
            mode = (await reader.readline()).strip().decode("ascii", "replace") or "?"
            record(f"open {peer} {mode}")
            if mode == "tick":
                while True:
                    writer.write(b"tick\n")
                    await writer.drain()
                    await asyncio.sleep(0.2)
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionResetError:
            how = "reset"
        except OSError as exc:
            how = f"error {exc.errno}"
        finally:
            record(f"end {peer} {mode} {how}")
            writer.close()

    return serve


class Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport):
        self.transport = transport

    def datagram_received(self, data, addr):
        self.transport.sendto(data, addr)


async def extras(loop: Loop, context: ssl.SSLContext, directory: Path):
    servers = [await asyncio.start_server(banner, None, 22),
               await asyncio.start_server(banner, None, 853, ssl=context),
               await asyncio.start_server(stream(directory / "stream.log"), STREAM_HOST,
                                          STREAM_PORT)]
    aio = asyncio.get_running_loop()
    for host, port in ((WEB, 443), (WEB, 9999), (SSH_HOST, 53)):
        await aio.create_datagram_endpoint(Echo, local_addr=(host, port))
    return servers


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def package_index(directory: Path, context: ssl.SSLContext) -> http.server.HTTPServer:
    """pip's simple index over the wheels in DIR/pypi/ (read at each request, so a test adds
    its own): /simple/PROJECT/ lists them with their sha256, /files/NAME sends one."""
    files, log = directory / "pypi", directory / "pypi-requests.log"
    files.mkdir(exist_ok=True)

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            with open(log, "a") as out:
                out.write(f"GET {self.headers.get('Host', '-')} {self.path}\n")
            parts = self.path.split("?")[0].strip("/").split("/")
            body, kind = None, "text/html"
            if len(parts) == 2 and parts[0] == "simple":
                wheels = sorted(p for p in files.glob("*.whl")
                                if _normalised(p.name.split("-")[0]) == _normalised(parts[1]))
                if wheels:
                    links = "".join(
                        f'<a href="../../files/{html.escape(p.name)}#sha256='
                        f'{hashlib.sha256(p.read_bytes()).hexdigest()}">{html.escape(p.name)}'
                        "</a><br>\n" for p in wheels)
                    body = f"<!DOCTYPE html><html><body>\n{links}</body></html>\n".encode()
            elif len(parts) == 2 and parts[0] == "files" and (files / parts[1]).is_file():
                body, kind = (files / parts[1]).read_bytes(), "application/octet-stream"
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # the request log above is the one kept
            pass

    server = http.server.ThreadingHTTPServer((PYPI, PYPI_PORT), Index)
    server.daemon_threads = True
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="pypi", daemon=True).start()
    return server


def main(directory: str) -> None:
    path = Path(directory)
    loop = Loop()
    ca = TestCA(path)
    names = [*ZONE, "dns.denied.test"]  # the agents' API hosts and pypi.test among them
    with open(path / "dns-queries.log", "a") as log:
        dns = FakeDns(loop, RESOLVER, 53, log)
        dns.zone.update(ZONE)
        FakeHttp(loop, port=80, host=None, log=path / "http-requests.log")
        FakeHttp(loop, ca.server_context(names), port=443, host=None,
                 log=path / "http-requests.log")
        (path / "git").mkdir(exist_ok=True)
        GitHttp.seed(path / "git", GIT_REPOS)
        for repo in GIT_REPOS:
            hear_push_options(path / "git" / f"{repo}.git")
        GitHttp(loop, path / "git", ca.server_context(["git.test"]), host=WEB, port=GIT_PORT)
        held = asyncssh.generate_private_key("ssh-ed25519")
        (path / "git-ssh-held-key").write_bytes(held.export_private_key())
        ssh = GitSsh(loop, path / "git", held.export_public_key().decode(), WEB, GIT_SSH_PORT)
        (path / "git-ssh-host.pub").write_text(f"git.test {ssh.public}\n")
        loop.run(extras(loop, ca.server_context(names), path))
        package_index(path, ca.server_context(["pypi.test"]))
        (path / "ready").write_text("ready\n")
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1])
