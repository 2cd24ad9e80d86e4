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
DIR/stream.log). Writes DIR/ready when everything listens; runs
until killed.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
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


def main(directory: str) -> None:
    path = Path(directory)
    loop = Loop()
    ca = TestCA(path)
    names = [*ZONE, "dns.denied.test"]
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
        (path / "ready").write_text("ready\n")
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1])
