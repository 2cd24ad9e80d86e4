"""TLS inspection next to mitmproxy and squid's ssl-bump, on the bench's topology
(`scripts/bench --only inspect`).

corral ends TLS for inspect.allowed.test, an `[[inspect]]` host with no request rules (every
request allowed, each one read, judged and sent again on a TLS connection of corral's own
to nginx, verified against nginx's certificate). mitmproxy (mitmdump, regular mode, pinned in
scripts/setup to the version ../shared/bench measured) does the same from the direct
namespace, verifying the same origin against the same certificate, and so does squid with
ssl-bump (Debian's squid-openssl: `peek` at the ClientHello, then `bump`, a CA of its own,
leaves minted by its certgen helper and cached in memory). The client is curl over
HTTP/1.1 (what corral speaks to both sides), with -k: each proxy has a CA of its own, and
the client's verification is not what is measured. Rows:

  first request    a new connection: TCP, CONNECT, both TLS handshakes and one 1 KiB GET
                   (curl's time_total), p50 over --inspect-connects curls; the leaf is
                   cached after the first (minting one is the `leaf mint` row)
  keep-alive       1 KiB GETs one after another on one connection: the rate from their
                   time_total, p50/p99 and the latency added to direct's
  8 connections    eight such curls at once: requests per second of wall time
  bulk             --bulk-mib through each, MiB/s; corral's ratio to its own spliced tunnel
                   (the same request to a host it does not inspect)
  leaf mint        bench.inspect_mint's mint_total: key, certificate and TLS context, in
                   one process

Every row is a median over --reps; added latency is measured against direct's in the same
rep.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .netns import (
    APP,
    CLIENT,
    DIRECT,
    GATEWAY,
    INSPECTED_UPSTREAM,
    PEER_GATEWAY,
    UPSTREAM,
    sh,
    spawn,
    wait_port,
)
from .squid import SQUID_COMMON

HOST = "inspect.allowed.test"
"""On an address of its own (netns.INSPECTED_UPSTREAM): a name sharing it would get no tunnel."""
SPLICED = "bulk.allowed.test"
"""Not inspected: corral's tunnel, the reference for what inspection costs in bulk."""
MITM_PORT = 3158
BUMP_PORT = 3168
MITMDUMP = Path(sys.prefix) / "peers" / "mitmproxy" / "bin" / "mitmdump"
"""Where scripts/setup puts mitmproxy: a venv of its own inside .venv (its pins are not
corral's)."""
PEERS = ("mitmproxy", "squid bump")
PARALLEL = 8
FORMAT = "%{time_total} %{http_code} %{size_download}\\n"

POLICY = f"""
[[inspect]]
host = "{HOST}"
"""
"""The bench session's second policy file: one host inspected, all its requests allowed."""

FILTER = """
[inspect]
ca_dir = "{dir}/state/intercept"
upstream_ca = "{dir}/cert.pem"
"""
"""Added to the bench filter's configuration: its own CA, and nginx's certificate as the
upstream's trust anchor."""


def mitmdump(bench) -> subprocess.Popen:
    if not MITMDUMP.exists():
        raise RuntimeError(f"no {MITMDUMP}: scripts/setup installs mitmproxy there")
    d = bench.dir
    process = spawn(APP, [str(MITMDUMP), "--mode", "regular", "--listen-host", PEER_GATEWAY,
                          "--listen-port", str(MITM_PORT), "--set", f"confdir={d}/mitm",
                          "--set", f"ssl_verify_upstream_trusted_ca={d}/cert.pem",
                          "--set", "stream_large_bodies=1m", "--set", "http2=false",
                          "--set", "flow_detail=0", "--set", "termlog_verbosity=error"],
                    d / "mitmproxy.log")
    bench.processes.append(process)
    wait_port(DIRECT, PEER_GATEWAY, MITM_PORT, "mitmproxy", timeout=60)
    return process


def squid_bump(bench) -> subprocess.Popen:
    """squid (Debian's squid-openssl) ending TLS for every CONNECT with a CA of its own
    (ssl-bump), verifying nginx against its certificate: the other peer that inspects."""
    d = bench.dir
    certgen = Path("/usr/lib/squid/security_file_certgen")
    if "--with-openssl" not in sh("squid", "-v").stdout or not certgen.exists():
        raise RuntimeError("this squid has no ssl-bump: scripts/setup installs squid-openssl")
    sh("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
       "-nodes", "-subj", "/CN=squid bench CA", "-days", "2", "-keyout",
       str(d / "bump-ca.key"), "-out", str(d / "bump-ca.pem"))
    (d / "bump").mkdir()
    sh(str(certgen), "-c", "-s", str(d / "bump" / "certs"), "-M", "4MB")
    for path in (d / "bump", d / "bump" / "certs", d / "bump-ca.key", d / "bump-ca.pem"):
        shutil.chown(path, "proxy", "proxy")
    for path in (d / "bump" / "certs").rglob("*"):
        shutil.chown(path, "proxy", "proxy")
    (d / "bump.conf").write_text((SQUID_BUMP + SQUID_COMMON).format(
        dir=d, gateway=PEER_GATEWAY, port=BUMP_PORT, up=UPSTREAM, certgen=certgen,
        name="bump"))
    process = spawn(APP, ["squid", "-N", "-f", str(d / "bump.conf")], d / "bump.log")
    bench.processes.append(process)
    wait_port(DIRECT, PEER_GATEWAY, BUMP_PORT, "squid (ssl-bump)", timeout=60)
    return process


SQUID_BUMP = """
http_port {gateway}:{port} ssl-bump generate-host-certificates=on \\
    dynamic_cert_mem_cache_size=4MB tls-cert={dir}/bump-ca.pem tls-key={dir}/bump-ca.key
sslcrtd_program {certgen} -s {dir}/bump/certs -M 4MB
sslcrtd_children 2 startup=1 idle=1
acl step1 at_step SslBump1
ssl_bump peek step1
ssl_bump bump all
tls_outgoing_options cafile={dir}/cert.pem
"""
"""Followed by squid.SQUID_COMMON."""


def routes() -> dict[str, tuple[str, list[str]]]:
    """tool -> (namespace, curl's arguments to reach HOST)."""
    return {"direct": (DIRECT, ["--resolve", f"{HOST}:443:{INSPECTED_UPSTREAM}"]),
            "corral": (CLIENT, ["-x", f"http://{GATEWAY}:3128"]),
            "mitmproxy": (DIRECT, ["-x", f"http://{PEER_GATEWAY}:{MITM_PORT}"]),
            "squid bump": (DIRECT, ["-x", f"http://{PEER_GATEWAY}:{BUMP_PORT}"])}


def curl_command(ns: str, route: list[str], urls: list[str]) -> list[str]:
    command = ["ip", "netns", "exec", ns, "curl", "-sSk", "--http1.1", "--noproxy", "",
               *route, "-w", FORMAT]
    for url in urls:
        command += ["-o", "/dev/null", url]
    return command


def transfers(output: str, expected_size: int) -> list[float]:
    """Each transfer's time_total in seconds; a failed one fails the bench."""
    times = []
    for line in output.splitlines():
        total, code, size = line.split()
        if code != "200" or int(float(size)) != expected_size:
            raise RuntimeError(f"curl: status {code}, {size} bytes (wanted {expected_size})")
        times.append(float(total))
    return times


def curl(ns: str, route: list[str], urls: list[str], size: int) -> list[float]:
    result = subprocess.run(curl_command(ns, route, urls), capture_output=True, text=True,
                            timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"curl via {route}: {result.stderr.strip()}")
    return transfers(result.stdout, size)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


def measure(bench) -> None:
    mitmdump(bench)
    squid_bump(bench)
    args, tools = bench.args, routes()
    small, bulk = f"https://{HOST}/1k", f"https://{HOST}/bulk"
    bulk_size = args.bulk_mib << 20
    first: dict[str, list[float]] = {}
    keep: dict[str, list[tuple[float, float, float]]] = {}
    parallel: dict[str, list[float]] = {}
    moved: dict[str, list[float]] = {}
    for ns, route in tools.values():  # a first request each: the leaf is minted
        curl(ns, route, [small], 1024)
    for _ in range(args.reps):
        for tool, (ns, route) in tools.items():
            fresh = [curl(ns, route, [small], 1024)[0] for _ in range(args.inspect_connects)]
            first.setdefault(tool, []).append(statistics.median(fresh))
            times = curl(ns, route, [small] * (args.inspect_requests + 1), 1024)[1:]
            keep.setdefault(tool, []).append((len(times) / sum(times), statistics.median(times),
                                              percentile(times, 0.99)))
            parallel.setdefault(tool, []).append(_at_once(ns, route, small,
                                                          args.inspect_requests))
            moved.setdefault(tool, []).append(bulk_size / curl(ns, route, [bulk], bulk_size)[0])
        ns, route = tools["corral"]
        moved.setdefault("corral tunnel", []).append(
            bulk_size / curl(ns, route, [f"https://{SPLICED}/bulk"], bulk_size)[0])
    _report(bench, first, keep, parallel, moved)
    bench.rows.append(_mint())


def _at_once(ns: str, route: list[str], url: str, requests: int) -> float:
    """Requests per second of wall time, PARALLEL curls of `requests` each at once."""
    started = time.monotonic()
    running = [subprocess.Popen(curl_command(ns, route, [url] * requests),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(PARALLEL)]
    for process in running:
        out, err = process.communicate(timeout=600)
        if process.returncode != 0:
            raise RuntimeError(f"curl via {route}: {err.strip()}")
        transfers(out, 1024)
    return PARALLEL * requests / (time.monotonic() - started)


def _report(bench, first, keep, parallel, moved) -> None:
    def row(metric, tool, unit, value, **extra):
        bench.rows.append({"metric": metric, "tool": tool, "unit": unit,
                           "value": round(value, 3 if value < 10 else 1), **extra})
        print(f"  {metric:<34} {tool:<14} {bench.rows[-1]['value']:>10} {unit}", flush=True)

    def added(values, base):  # what the proxy adds, rep by rep
        return statistics.median(v - b for v, b in zip(values, base, strict=True))

    for tool, values in first.items():
        extra = {} if tool == "direct" else {
            "added_ms": round(added(values, first["direct"]) * 1e3, 3)}
        row("inspected HTTPS first request", tool, "ms p50", statistics.median(values) * 1e3,
            **extra)
    def against_peers(rates: dict[str, float]) -> dict:  # corral's rate over the peers'
        return {"ratio_best_peer": round(rates["corral"] / max(rates[t] for t in PEERS), 3),
                "ratio_mitmproxy": round(rates["corral"] / rates["mitmproxy"], 3)}

    keep_rates = {t: statistics.median(r[0] for r in v) for t, v in keep.items()}
    direct_rate = statistics.median(r[0] for r in keep["direct"])
    for tool, values in keep.items():
        rate = statistics.median(r[0] for r in values)
        extra = {"p50_us": statistics.median(r[1] for r in values) * 1e6,
                 "p99_us": statistics.median(r[2] for r in values) * 1e6,
                 "ratio_direct": round(rate / direct_rate, 3)}
        if tool != "direct":
            extra["added_us"] = round(added([r[1] for r in values],
                                            [r[1] for r in keep["direct"]]) * 1e6, 1)
        if tool == "corral":
            extra.update(against_peers(keep_rates))
        row("inspected HTTPS keep-alive", tool, "req/s", rate, **extra)
    parallel_rates = {t: statistics.median(v) for t, v in parallel.items()}
    for tool, values in parallel.items():
        rate = statistics.median(values)
        extra = against_peers(parallel_rates) if tool == "corral" else {}
        row(f"inspected HTTPS, {PARALLEL} connections", tool, "req/s", rate,
            ratio_direct=round(rate / statistics.median(parallel["direct"]), 3), **extra)
    tunnel = statistics.median(moved["corral tunnel"])
    for tool, values in moved.items():
        rate = statistics.median(values) / (1 << 20)
        extra = {"ratio_tunnel": round(statistics.median(values) / tunnel, 3)} if (
            tool == "corral") else {}
        row("inspected HTTPS bulk", tool, "MiB/s", rate, **extra)


def _mint() -> dict:
    result = subprocess.run([sys.executable, "-m", "bench.inspect_mint", "50"],
                            capture_output=True, text=True, timeout=600, check=True,
                            cwd=Path(__file__).resolve().parents[1])
    total = json.loads(result.stdout)["mint_total"]
    print(f"  leaf mint                          corral         {total['p50_us']:.0f} µs p50",
          flush=True)
    return {"metric": "leaf mint", "tool": "corral", "unit": "ms p50",
            "value": round(total["p50_us"] / 1e3, 3), "p50_us": total["p50_us"],
            "p99_us": total["p99_us"]}
