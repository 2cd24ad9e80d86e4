"""The fake internet of the e2e tier, run inside its own network namespace:

  python -m tests.e2e.internet DIR

DNS (authoritative, every query logged to DIR/dns-queries.log) on 203.0.113.53:53;
HTTP :80 and HTTPS :443 (certificate from DIR's test CA) on every address; an SSH-like
banner on :22; TLS on :853 (DNS-over-TLS stand-in); UDP echo on :443 and :53 of the other
addresses. Writes DIR/ready when everything listens; runs until killed.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
import time
from pathlib import Path

from tests.fakes import FakeDns, FakeHttp, Loop, TestCA

WEB = "203.0.113.10"
RESOLVER = "203.0.113.53"
SSH_HOST = "203.0.113.22"
WEB_V6 = "3fff:ff::10"  # RFC 9637 documentation space, not a blocked range

ZONE = {
    "allowed.test": [("A", WEB, 300), ("AAAA", WEB_V6, 300)],
    "other.test": [("A", WEB, 300)],
    "denied.test": [("A", WEB, 300)],
    "private.test": [("A", "10.0.0.5", 300)],
    "ssh.test": [("A", SSH_HOST, 300)],
}


async def banner(reader, writer):
    writer.write(b"SSH-2.0-corral-e2e\r\n")
    await writer.drain()
    writer.close()


class Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport):
        self.transport = transport

    def datagram_received(self, data, addr):
        self.transport.sendto(data, addr)


async def extras(loop: Loop, context: ssl.SSLContext):
    servers = [await asyncio.start_server(banner, None, 22),
               await asyncio.start_server(banner, None, 853, ssl=context)]
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
        FakeHttp(loop, port=80, host=None)
        FakeHttp(loop, ca.server_context(names), port=443, host=None)
        loop.run(extras(loop, ca.server_context(names)))
        (path / "ready").write_text("ready\n")
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1])
