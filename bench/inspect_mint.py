"""TLS inspection's costs, in one process (no sockets): `python -m bench.inspect_mint [N]`.

  mint          a leaf for a new host: key, certificate (cryptography), TLS context (OpenSSL
                loading both): what the mint worker does, per host
  handshake     the server's CPU for a full handshake with a cached leaf (what the event loop
                pays per inspected connection), and for a resumed one (session ticket)
  upstream      the client side towards an upstream: handshake and chain verification
  loop lag      how late a 1 ms timer on the loop fires while N new hosts are minted by
                `Leaves` (off the loop), against minting the same on the loop
  memory        resident memory per cached leaf context

Each a median (and p99) over N runs; machine-dependent: compare ratios, not absolutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

from appliance import pki
from appliance.filter.proxy.inspect import Leaves
from appliance.pki.intercept import Authority, mint, server_context
from appliance.policy import Host


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_us": round(statistics.median(ordered) * 1e6, 1),
            "p99_us": round(ordered[int(len(ordered) * 0.99) - 1] * 1e6, 1)}


def timed(step, n: int) -> dict[str, float]:
    samples = []
    for i in range(n):
        start = time.perf_counter()
        step(i)
        samples.append(time.perf_counter() - start)
    return percentiles(samples)


def server_handshake(server_ctx, client_ctx, name: str, session=None):
    """A handshake between memory BIOs; (seconds the server side spent, client session)."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=name, session=session)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    spent, done = 0.0, False
    while not done:
        with contextlib.suppress(ssl.SSLWantReadError):
            client.do_handshake()
        s_in.write(c_out.read())
        start = time.perf_counter()
        try:
            server.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            pass
        spent += time.perf_counter() - start
        c_in.write(s_out.read())
    client.do_handshake()
    with contextlib.suppress(ssl.SSLWantReadError):
        client.read(1)  # takes in the session tickets (TLS 1.3 sends them after Finished)
    return spent, client.session


def client_handshake(server_ctx, client_ctx, name: str) -> float:
    """The client side's CPU (what the filter pays towards an upstream)."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=name)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    spent, done = 0.0, False
    while not done:
        start = time.perf_counter()
        try:
            client.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            pass
        spent += time.perf_counter() - start
        s_in.write(c_out.read())
        with contextlib.suppress(ssl.SSLWantReadError):
            server.do_handshake()
        c_in.write(s_out.read())
    return spent


async def loop_lag(authority: Authority, n: int, off_loop: bool) -> dict[str, float]:
    """How late a 1 ms ticker on the loop runs while `n` new hosts are minted."""
    lags: list[float] = []
    stop = False

    async def ticker():
        while not stop:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - start - 0.001)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    if off_loop:
        leaves = Leaves(authority, n, 1e9, n)
        await asyncio.gather(*(leaves.get(Host(name=f"h{i}.lag.test"), "s") for i in range(n)))
        leaves.close()
    else:
        now = datetime.datetime.now(datetime.UTC)
        for i in range(n):
            server_context(*mint(authority, Host(name=f"h{i}.lag.test"), now))
            await asyncio.sleep(0)
    stop = True
    await task
    return {**percentiles(lags), "max_us": round(max(lags) * 1e6, 1)}


def resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    with tempfile.TemporaryDirectory() as tmp:
        pki.write_intercept_ca(*pki.intercept_ca(), Path(tmp))
        ca_cert = (Path(tmp) / "intercept-ca.crt").read_text()
        authority = Authority.load(str(Path(tmp) / "intercept-ca.crt"),
                                   str(Path(tmp) / "intercept-ca.key"))
    now = datetime.datetime.now(datetime.UTC)
    results: dict[str, object] = {}
    results["mint_certificate"] = timed(lambda i: mint(authority, Host(name=f"h{i}.t"), now), n)
    pems = mint(authority, Host(name="a.test"), now)
    results["mint_context"] = timed(lambda i: server_context(*pems), n)
    results["mint_total"] = timed(
        lambda i: server_context(*mint(authority, Host(name=f"h{i}.t"), now)), n)

    leaf = server_context(*pems)
    client_ctx = ssl.create_default_context(cadata=ca_cert)
    client_ctx.set_alpn_protocols(["http/1.1"])
    results["handshake_cached_leaf_server"] = percentiles(
        [server_handshake(leaf, client_ctx, "a.test")[0] for _ in range(n)])
    _, session = server_handshake(leaf, client_ctx, "a.test")
    results["handshake_resumed_server"] = percentiles(
        [server_handshake(leaf, client_ctx, "a.test", session)[0] for _ in range(n)])
    results["upstream_handshake_client"] = percentiles(
        [client_handshake(leaf, client_ctx, "a.test") for _ in range(n)])

    lag_n = min(n, 200)
    results[f"loop_lag_minting_{lag_n}_off_loop"] = asyncio.run(loop_lag(authority, lag_n, True))
    results[f"loop_lag_minting_{lag_n}_on_loop"] = asyncio.run(loop_lag(authority, lag_n, False))

    before, kept = resident(), []
    for i in range(1000):
        kept.append(server_context(*mint(authority, Host(name=f"m{i}.t"), now)))
    results["resident_bytes_per_cached_leaf"] = (resident() - before) // 1000
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
