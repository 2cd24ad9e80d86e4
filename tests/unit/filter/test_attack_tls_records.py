"""An inspected client sends a quarter megabyte of one-byte TLS records in one go: the filter
must not decrypt them all in one turn of its event loop (about 10,000 records, each a trip
through OpenSSL and Python: ~10 ms). tlsstream gives TLS at most SLICE raw bytes a turn."""

from __future__ import annotations

import asyncio
import datetime
import ssl

import pytest

from appliance import pki
from appliance.filter.proxy import tlsstream
from appliance.filter.relay import Counters
from appliance.pki.intercept import Authority, mint, server_context
from appliance.policy import Host

RECORDS = 8000


class Sink:
    """The raw writer towards the client: collects what the server's TLS writes."""

    def __init__(self):
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return False


@pytest.fixture(scope="module")
def contexts(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ca")
    pki.write_intercept_ca(*pki.intercept_ca(), directory)
    authority = Authority.load(str(directory / "intercept-ca.crt"),
                               str(directory / "intercept-ca.key"))
    server = server_context(*mint(authority, Host(name="x.test"),
                                  datetime.datetime.now(datetime.UTC)))
    return server, ssl.create_default_context(cafile=str(directory / "intercept-ca.crt"))


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_a_flood_of_tiny_records_is_decrypted_a_slice_per_turn(contexts, version):
    server_ctx, client_ctx = contexts
    client_ctx.maximum_version = version

    async def main():
        into, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        client = client_ctx.wrap_bio(into, out, server_hostname="x.test")
        raw = asyncio.StreamReader(limit=1 << 20)
        sink = Sink()
        server = tlsstream.TlsServer(server_ctx, raw, sink, Counters(), 1 << 16)

        async def client_side():
            while True:
                await asyncio.sleep(0)
                if sink.data:
                    into.write(bytes(sink.data))
                    sink.data.clear()
                    try:
                        client.do_handshake()
                        done = True
                    except ssl.SSLWantReadError:
                        done = False
                    if out.pending:
                        raw.feed_data(out.read())
                    if done:
                        return

        with pytest.raises(ssl.SSLWantReadError):
            client.do_handshake()
        talking = asyncio.ensure_future(client_side())
        await server.handshake(out.read(), 5)
        try:  # the client's side spins until the server's last flight reaches it
            await asyncio.wait_for(talking, 10)
        except TimeoutError:
            raise AssertionError("the client's handshake not done 10s after the server's") \
                from None
        for _ in range(RECORDS):
            client.write(b"x")  # one record each
        fed: list[int] = []
        decrypt = server._decrypt

        def counted():
            size = len(server.reader._buffer)
            ended = decrypt()
            fed.append(len(server.reader._buffer) - size)
            return ended

        server._decrypt = counted
        raw.feed_data(out.read())  # ~200 KiB, all there for one read
        got = await asyncio.wait_for(server.reader.readexactly(RECORDS), 10)
        server.close()
        return got, fed

    got, fed = asyncio.run(main())
    assert got == b"x" * RECORDS
    # at most one slice's worth of records (~22 bytes each at the least) in any one turn
    assert max(fed) <= 500, max(fed)  # SLICE (8 KiB) // 20
