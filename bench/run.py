"""corral's benchmark: corral-filter behind its real nftables ruleset, next to squid,
tinyproxy, dnsmasq and (TLS inspection, bench/inspected.py) mitmproxy and a direct baseline,
in one run, on one topology of network namespaces.

  corral-bench-client 10.232.0.2 ─cb-sbx0─ 10.232.0.1  corral-bench-app  10.232.1.1 ─ 10.232.1.2
   (a corral sandbox: its traffic      (corral-filter + ruleset;              corral-bench-up
    meets the ruleset and the filter)   squid, dnsmasq)                       (nginx :80/:443,
  corral-bench-direct 10.232.2.2 ─cbd0─ 10.232.2.1                             dnsmasq for
   (direct baseline and the peers: not a sandbox interface, so not under corral's ruleset)
                                                                               allowed.test)

The session start row (`start`, bench/start.py) runs apart from this topology: the local
backend (`corral up --backend local`) in a namespace of its own, sessions started by the CLI.

Every number is the median of --reps runs (the start row's: of --starts starts); ratios are
medians of per-run ratios to the direct run made just before. Results:
bench/results/<time>.{json,md}. Never a timed test: tests/bench only checks that a tiny run
completes and reports every row.

  scripts/bench [--reps 3] [--bulk-mib 100] [--dns-seconds 4]     (root; a few minutes)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import timeit
from pathlib import Path

from . import cgroups, inspected, start, targets
from .cgroups import CpuGroup
from .netns import (
    APP,
    CLIENT,
    DIRECT,
    GATEWAY,
    INSPECTED_UPSTREAM,
    NOISY,
    NOISY_GATEWAY,
    PEER_GATEWAY,
    PREFIX,
    UP,
    UPSTREAM,
    cleanup,
    sh,
    spawn,
    topology,
    wait_port,
)
from .squid import SQUID_COMMON

FILTER_NOFILE = 1 << 20
"""The filter's open-files limit, as its unit sets it (LimitNOFILE)."""
BIN = Path(sys.executable).parent
RESULTS = Path(__file__).resolve().parent / "results"
TOOLS = ("nginx", "squid", "tinyproxy", "dnsmasq", "dnsperf", "curl", "openssl", "nft", "wrk", "ab")
WRK_SCRIPT = Path(__file__).resolve().parent / "absolute.lua"
START_TOOLS = ("podman", "runc", "nsenter")
"""The session start row's (`start`: bench/start.py), beyond what `corral up --backend local`
checks itself."""
PARTS = ["bulk", "http", "setup", "memory", "dns", "policy", "ruleset", "team", "noisy",
         "inspect", "start"]


class Bench:
    def __init__(self, directory: Path, args):
        self.dir, self.args = directory, args
        self.profiles = 0
        self.processes: list[subprocess.Popen] = []
        self.rows: list[dict] = []
        self.groups: dict[str, CpuGroup] = {}
        """The noisy neighbour's CPU cgroups while it runs (bench/cgroups.py)."""

    # -- the servers -----------------------------------------------------------------------

    def serve(self) -> None:
        d, mib = self.dir, self.args.bulk_mib
        d.chmod(0o755)  # nginx's and squid's workers run as www-data and proxy
        (d / "www").mkdir()
        with open(d / "www" / "bulk", "wb") as f:
            f.write(os.urandom(1 << 20) * mib)  # incompressible, really on disk
        (d / "www" / "1k").write_bytes(os.urandom(1024))
        sh("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
           "-nodes", "-subj", "/CN=bulk.allowed.test", "-addext",
           "subjectAltName=DNS:*.allowed.test", "-days", "2", "-keyout", str(d / "key.pem"),
           "-out", str(d / "cert.pem"))
        (d / "nginx.conf").write_text(NGINX.format(dir=d, up=UPSTREAM,
                                                   inspected=INSPECTED_UPSTREAM))
        self.processes.append(spawn(UP, ["nginx", "-c", str(d / "nginx.conf")], d / "nginx.log"))
        self.processes.append(spawn(UP, [
            "dnsmasq", "--no-daemon", "--no-resolv", "--no-hosts", "--bind-interfaces",
            f"--listen-address={UPSTREAM}", "--address=/allowed.test/" + UPSTREAM,
            "--address=/inspect.allowed.test/" + INSPECTED_UPSTREAM,  # the longest one wins
            "--cache-size=0", f"--pid-file={d}/dnsmasq-up.pid", "--user=root"],
            d / "dnsmasq-up.log"))
        # peers, reached from the direct namespace
        self.processes.append(spawn(APP, [
            "dnsmasq", "--no-daemon", "--no-resolv", "--no-hosts", "--bind-interfaces",
            f"--listen-address={PEER_GATEWAY}", f"--server={UPSTREAM}", "--cache-size=10000",
            f"--pid-file={d}/dnsmasq-peer.pid", "--user=root"], d / "dnsmasq-peer.log"))
        (d / "squid").mkdir()
        shutil.chown(d / "squid", "proxy", "proxy")
        (d / "squid.conf").write_text(SQUID.format(dir=d, gateway=PEER_GATEWAY, up=UPSTREAM,
                                                  name="squid"))
        self.processes.append(spawn(APP, ["squid", "-N", "-f", str(d / "squid.conf")],
                                    d / "squid.log"))
        (d / "tinyproxy.conf").write_text(TINYPROXY.format(gateway=PEER_GATEWAY))
        self.processes.append(spawn(APP, ["tinyproxy", "-d", "-c", str(d / "tinyproxy.conf")],
                                    d / "tinyproxy.log"))
        # corral: the filter behind its real ruleset
        (d / "policy.toml").write_text(POLICY)
        # inspection (an interception CA, one inspected host) only when it is measured:
        # the other rows keep the filter they always measured
        inspecting = "inspect" in (self.args.only or PARTS)
        (d / "inspect.toml").write_text(inspected.POLICY if inspecting else "")
        (d / "filter.toml").write_text(FILTER.format(dir=d, gateway=GATEWAY, up=UPSTREAM) +
                                       (inspected.FILTER.format(dir=d) if inspecting else ""))
        sh(str(BIN / "corral-firewall"), "apply", "--config", str(d / "filter.toml"), ns=APP)
        self._start_filter(wait=False)
        wait_port(DIRECT, UPSTREAM, 443, "nginx")
        wait_port(DIRECT, PEER_GATEWAY, 3138, "squid", timeout=60)
        wait_port(DIRECT, PEER_GATEWAY, 3148, "tinyproxy")
        wait_port(CLIENT, GATEWAY, 3128, "corral-filter")

    def stop(self) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        sh("nft", "delete", "table", "inet", "corral", ns=APP, check=False)
        cleanup()

    # -- measurements ----------------------------------------------------------------------

    def curl(self, ns: str, *args: str) -> float:
        """MiB/s of one download."""
        out = sh("curl", "-sS", "-k", "-o", "/dev/null", "--noproxy", "", "-w",
                 "%{speed_download} %{size_download}", *args, ns=ns).stdout.split()
        size = int(float(out[1]))
        if size != self.args.bulk_mib << 20:
            raise RuntimeError(f"curl {' '.join(args)} got {size} bytes")
        return float(out[0]) / (1 << 20)

    def bulk(self) -> None:
        host = "bulk.allowed.test"
        resolve = ["--resolve", f"{host}:443:{UPSTREAM}", "--resolve", f"{host}:80:{UPSTREAM}"]
        cases = {
            "CONNECT+TLS bulk": (
                (DIRECT, [*resolve, f"https://{host}/bulk"]),
                {"corral": (CLIENT, ["-x", f"http://{GATEWAY}:3128", f"https://{host}/bulk"]),
                 "squid": (DIRECT, ["-x", f"http://{PEER_GATEWAY}:3138",
                                    f"https://{host}/bulk"]),
                 "tinyproxy": (DIRECT, ["-x", f"http://{PEER_GATEWAY}:3148",
                                        f"https://{host}/bulk"])}),
            "CONNECT plain bulk": (
                (DIRECT, [*resolve, f"http://{host}/bulk"]),
                {"corral": (CLIENT, ["-p", "-x", f"http://{GATEWAY}:3128",
                                     f"http://{host}/bulk"]),
                 "squid": (DIRECT, ["-p", "-x", f"http://{PEER_GATEWAY}:3138",
                                    f"http://{host}/bulk"]),
                 "tinyproxy": (DIRECT, ["-p", "-x", f"http://{PEER_GATEWAY}:3148",
                                        f"http://{host}/bulk"])}),
            "transparent 443 bulk": (
                (DIRECT, [*resolve, f"https://{host}/bulk"]),
                {"corral": (CLIENT, [*resolve, f"https://{host}/bulk"])}),
        }
        for metric, (direct, tools) in cases.items():
            runs: dict[str, list[float]] = {"direct": []}
            ratios: dict[str, list[float]] = {}
            for _ in range(self.args.reps):
                base = self.curl(direct[0], *direct[1])
                runs["direct"].append(base)
                for tool, (ns, args) in tools.items():
                    value = self.curl(ns, *args)
                    runs.setdefault(tool, []).append(value)
                    ratios.setdefault(tool, []).append(value / base)
            self.report(metric, "MiB/s", runs, ratios, higher_is_better=True)

    def dnsperf(self, server: str, ns: str, names: list[str]) -> tuple[float, float, float]:
        """(qps with 100 outstanding, p50 µs, p99 µs with 1 outstanding)."""
        queries = self.dir / "queries.txt"
        queries.write_text("".join(f"{n} A\n" for n in names))
        out = sh("dnsperf", "-s", server, "-d", str(queries), "-l",
                 str(self.args.dns_seconds), "-q", "100", "-c", "4", ns=ns).stdout
        qps = float(re.search(r"Queries per second:\s+([\d.]+)", out).group(1))
        # from the end: names the qps run did not reach, so "uncached" stays uncached
        latencies = self.latency(server, ns, names[-self.args.latency_queries:])
        return qps, latencies[0], latencies[1]

    def latency(self, server: str, ns: str, names: list[str]) -> tuple[float, float]:
        out = sh(sys.executable, "-m", "bench.dns_latency", server, *names, ns=ns).stdout
        return tuple(json.loads(out))

    def dns(self) -> None:
        cached = [f"n{i % 10}.allowed.test" for i in range(1000)]
        unique = [f"u{random.getrandbits(48):x}.allowed.test" for _ in range(300_000)]
        denied = [f"d{i % 10}.denied.test" for i in range(1000)]
        for metric, names, tools in (
                ("DNS allowed-cached", cached, {"corral": (GATEWAY, CLIENT),
                                                "dnsmasq": (PEER_GATEWAY, DIRECT)}),
                ("DNS allowed-uncached", unique, {"corral": (GATEWAY, CLIENT),
                                                  "dnsmasq": (PEER_GATEWAY, DIRECT)}),
                ("DNS denied", denied, {"corral": (GATEWAY, CLIENT)})):
            runs: dict[str, list] = {}
            ratios: dict[str, list[float]] = {}
            for _ in range(self.args.reps):
                base = self.dnsperf(UPSTREAM, DIRECT, cached)  # the authoritative server
                runs.setdefault("direct", []).append(base)
                for tool, (server, ns) in tools.items():
                    result = self.dnsperf(server, ns, names)
                    runs.setdefault(tool, []).append(result)
                    ratios.setdefault(tool, []).append(result[0] / base[0])
            qps = {t: [r[0] for r in v] for t, v in runs.items()}
            self.report(metric, "qps", qps, ratios, higher_is_better=True, extra={
                t: {"p50_us": statistics.median(r[1] for r in v),
                    "p99_us": statistics.median(r[2] for r in v)} for t, v in runs.items()})

    def _cpu(self) -> float:
        return _process_cpu(self.filter.pid)

    def _rss_mib(self) -> float:
        return _process_rss_mib(self.filter.pid)

    def http(self) -> None:
        """Keep-alive req/s with p50/p99 (wrk), new connections per second (ab), and the
        filter's CPU per request, for small responses through each proxy."""
        seconds = str(self.args.http_seconds)
        target = "http://small.allowed.test/1k"
        proxies = {"corral": (CLIENT, f"http://{GATEWAY}:3128"),
                   "squid": (DIRECT, f"http://{PEER_GATEWAY}:3138"),
                   "tinyproxy": (DIRECT, f"http://{PEER_GATEWAY}:3148")}
        keep: dict[str, list] = {}
        ratios: dict[str, list[float]] = {}
        fresh: dict[str, list] = {}
        fresh_ratios: dict[str, list[float]] = {}
        cpu: list[float] = []
        for _ in range(self.args.reps):
            base = self._wrk(DIRECT, f"http://{UPSTREAM}/1k", None, seconds)
            keep.setdefault("direct", []).append(base)
            base_new = self._ab(DIRECT, f"http://{UPSTREAM}/1k", None)
            fresh.setdefault("direct", []).append(base_new)
            for tool, (ns, proxy) in proxies.items():
                before = self._cpu() if tool == "corral" else 0
                result = self._wrk(ns, proxy, target, seconds)
                if tool == "corral":
                    cpu.append((self._cpu() - before) / result[3] * 1e6)
                keep.setdefault(tool, []).append(result)
                ratios.setdefault(tool, []).append(result[0] / base[0])
                rate = self._ab(ns, target, proxy)
                fresh.setdefault(tool, []).append(rate)
                fresh_ratios.setdefault(tool, []).append(rate / base_new)
        self.report("HTTP keep-alive", "req/s", {t: [r[0] for r in v] for t, v in keep.items()},
                    ratios, higher_is_better=True, extra={
                        t: {"p50_us": statistics.median(r[1] for r in v),
                            "p99_us": statistics.median(r[2] for r in v)}
                        for t, v in keep.items()})
        self.report("HTTP new connections", "req/s", fresh, fresh_ratios, higher_is_better=True)
        self.rows.append({"metric": "CPU per keep-alive request", "tool": "corral",
                          "unit": "µs", "value": round(statistics.median(cpu), 1)})

    def _wrk(self, ns: str, url: str, target: str | None, seconds: str):
        """(req/s, p50 µs, p99 µs, requests) from wrk with 16 connections."""
        command = ["wrk", "-t", "2", "-c", "16", "-d", seconds, "--latency", url]
        if target is not None:
            command[1:1] = ["-s", str(WRK_SCRIPT)]
        env = f"CORRAL_BENCH_TARGET={target}" if target else "CORRAL_BENCH_TARGET="
        out = sh("env", env, *command, ns=ns).stdout
        rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
        total = int(re.search(r"(\d+) requests in", out).group(1))

        def percentile(p):
            value, unit = re.search(rf"\s{p}%\s+([\d.]+)(us|ms|s)", out).groups()
            return float(value) * {"us": 1, "ms": 1e3, "s": 1e6}[unit]

        return rate, percentile(50), percentile(99), total

    def _ab(self, ns: str, url: str, proxy: str | None) -> float:
        """New-connection requests per second (ab: one connection per request)."""
        command = ["ab", "-q", "-n", str(self.args.new_connections), "-c", "16"]
        if proxy is not None:
            command += ["-X", proxy.removeprefix("http://")]
        out = sh(*command, url, ns=ns).stdout
        failed = int(re.search(r"Failed requests:\s+(\d+)", out).group(1))
        if failed:
            raise RuntimeError(f"ab {url} via {proxy}: {failed} failed requests")
        return float(re.search(r"Requests per second:\s+([\d.]+)", out).group(1))

    def setup(self) -> None:
        """CONNECT setup latency (CONNECT sent -> 200 read), p50/p99 over sequential
        tunnels; direct is the TCP connect alone."""
        n = str(self.args.connects)
        runs = {"direct": [], "corral": [], "squid": [], "tinyproxy": []}
        for _ in range(self.args.reps):
            for tool, ns, address in (("direct", DIRECT, f"{UPSTREAM}:443"),
                                      ("corral", CLIENT, f"{GATEWAY}:3128"),
                                      ("squid", DIRECT, f"{PEER_GATEWAY}:3138"),
                                      ("tinyproxy", DIRECT, f"{PEER_GATEWAY}:3148")):
                mode = "tcp" if tool == "direct" else "connect"
                out = sh(sys.executable, "-m", "bench.connect_latency", mode, address,
                         "small.allowed.test:443", n, ns=ns).stdout
                runs[tool].append(json.loads(out))
        for tool, values in runs.items():
            self.rows.append({"metric": "CONNECT setup", "tool": tool, "unit": "µs p50",
                              "value": round(statistics.median(v[0] for v in values), 1),
                              "p50_us": statistics.median(v[0] for v in values),
                              "p99_us": statistics.median(v[1] for v in values)})
            print(f"  CONNECT setup            {tool:<8} p50 {self.rows[-1]['p50_us']:.0f} "
                  f"p99 {self.rows[-1]['p99_us']:.0f} µs", flush=True)

    def memory(self) -> None:
        """The filter's RSS while N CONNECT tunnels are open at once (idle, after the 200)."""
        before = self._rss_mib()
        holder = subprocess.Popen(
            ["ip", "netns", "exec", CLIENT, sys.executable, "-m", "bench.connect_latency",
             "hold", f"{GATEWAY}:3128", "small.allowed.test:443", str(self.args.tunnels)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = holder.stdout.readline()
            if line.strip() != f"held {self.args.tunnels}":
                raise RuntimeError(f"could not hold {self.args.tunnels} tunnels: {line!r} "
                                   f"{holder.stderr.read()[-500:]}")
            time.sleep(0.5)
            during = self._rss_mib()
        finally:
            holder.stdin.close()  # the holder closes its tunnels and exits
            holder.wait(60)
        self.rows.append({"metric": f"RSS with {self.args.tunnels} open tunnels",
                          "tool": "corral", "unit": "MiB", "value": round(during, 1),
                          "idle_rss_mib": round(before, 1)})
        print(f"  RSS, {self.args.tunnels} tunnels     corral   {during:.1f} MiB "
              f"(idle {before:.1f})", flush=True)

    def policy(self) -> None:
        """Decision time at 10, 10k and 100k rules: the first decision for a host (a walk
        of its labels; every host new, more than a Policy remembers), the same decision
        again (remembered), a first denial; and the time to compile the rules."""
        from appliance.policy import Policy, Rule, parse_host

        def per_call(fn, items, number) -> float:
            loops = number // len(items) + 1
            return min(timeit.repeat(lambda: [fn(i) for i in items], number=loops,
                                     repeat=3)) / (loops * len(items)) * 1e6

        fresh = [parse_host(f"c{j}.h0.example0.com") for j in range(20_000)]  # *.h0... allows
        denied = [parse_host(f"d{j}.not-there.example.org") for j in range(20_000)]
        for count in (10, 10_000, 100_000):
            rules = [Rule.parse("http", f"{'*.' if i % 3 == 0 else ''}h{i}.example{i % 97}.com")
                     for i in range(count)]
            started = time.perf_counter()
            policy = Policy(rules)
            compile_s = time.perf_counter() - started
            hosts = [parse_host(f"h{i}.example{i % 97}.com") for i in range(1, min(count, 500))]
            first_us = per_call(lambda h, p=policy: p.decide_http(h, 443), fresh, 20_000)
            again_us = per_call(lambda h, p=policy: p.decide_http(h, 443), hosts, 20_000)
            deny_us = per_call(lambda h, p=policy: p.decide_http(h, 443), denied, 20_000)
            self.rows.append({"metric": f"policy decision, {count} rules", "tool": "corral",
                              "unit": "µs", "value": round(first_us, 2),
                              "remembered_us": round(again_us, 2), "deny_us": round(deny_us, 2),
                              "compile_s": round(compile_s, 3)})

    def ruleset(self) -> None:
        """One more session with --sessions registered: the store's plan and write, the
        ruleset built for the change and loaded (bench/ruleset.py), in a namespace of its own
        so that the filter's ruleset stays as it is."""
        ns = PREFIX + "rules"
        sh("ip", "netns", "add", ns)
        try:
            state = self.dir / "ruleset-state"
            state.mkdir()
            out = json.loads(sh(sys.executable, "-m", "bench.ruleset", str(self.args.sessions),
                                str(max(self.args.reps, 3)), str(state), ns=ns).stdout)
        finally:
            sh("ip", "netns", "del", ns, check=False)
        median = {k: round(statistics.median(out[k]), 1) for k in ("add_ms", "plan_ms",
                                                                    "load_ms")}
        row = {"metric": f"ruleset: one more session, {out['sessions']} registered",
               "tool": "corral", "unit": "ms", "value": median["add_ms"],
               "plan_ms": median["plan_ms"], "load_ms": median["load_ms"],
               "full_ms": round(out["full_ms"], 1)}
        self.rows.append(row)
        print(f"  {row['metric']:<24} {row['value']} ms (plan {row['plan_ms']}, ruleset "
              f"{row['load_ms']}; all {out['sessions']} at once: {row['full_ms']} ms)",
              flush=True)

    def team(self) -> None:
        """A team's load: --team-sessions sessions, each its own namespace, subnet and policy
        file, registered at run time (`session-add`), each opening --team-connections short
        HTTPS connections through its proxy one after another, the sessions all at once
        (bench/team.py, a package install's pattern); against the same clients dialling the
        origin directly. Runs a filter with
        the appliance's defaults (listeners on each session's gateway), as noisy does."""
        d, count, each = self.dir, self.args.team_sessions, self.args.team_connections
        names = [f"{PREFIX}team{i}" for i in range(count)]
        try:
            self._team(d, names, count, each)
        finally:  # its namespaces (and their links) go, whatever failed
            for ns in names:
                sh("ip", "netns", "del", ns, check=False)

    def _team(self, d: Path, names: list[str], count: int, each: int) -> None:
        for i, ns in enumerate(names):
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "set", "lo", "up", ns=ns)
            sh("ip", "link", "add", f"cb-sbx{10 + i}", "netns", APP, "type", "veth", "peer",
               "name", "eth0", "netns", ns)
            sh("ip", "addr", "add", f"10.233.{i}.1/24", "dev", f"cb-sbx{10 + i}", ns=APP)
            sh("ip", "link", "set", f"cb-sbx{10 + i}", "up", ns=APP)
            sh("ip", "addr", "add", f"10.233.{i}.2/24", "dev", "eth0", ns=ns)
            sh("ip", "link", "set", "eth0", "up", ns=ns)
            sh("ip", "route", "add", "default", "via", f"10.233.{i}.1", ns=ns)
            (d / f"team{i}.toml").write_text(TEAM_POLICY.format(i=i))  # a policy each
        self._stop_filter()
        try:
            runs: dict[str, list[dict]] = {"direct": []}
            for _ in range(self.args.reps):
                runs["direct"].append(self._team_run(
                    [DIRECT] * count, ["direct"] * count, each, None))
            registered: dict[str, float] = {}
            for workers in dict.fromkeys((1, self.args.team_workers)):
                tool = "corral" if workers == 1 else f"corral, {workers} workers"
                runs[tool], registered[tool] = self._team_filter(d, names, count, each,
                                                                 workers)
        finally:
            self._start_filter()
        direct_s = statistics.median(r["seconds"] for r in runs["direct"])
        for tool, results in runs.items():
            seconds = statistics.median(r["seconds"] for r in results)
            row = {"metric": f"team scale: {count} sessions x {each} HTTPS connections",
                   "tool": tool, "unit": "s", "value": round(seconds, 3),
                   "ratio_direct": round(seconds / direct_s, 3),
                   "p50_us": statistics.median(r["p50_us"] for r in results),
                   "p99_us": statistics.median(r["p99_us"] for r in results)}
            if tool != "direct":
                row.update(workers=results[0]["workers"],
                           register_ms=round(registered[tool], 1),
                           cpu_per_core=round(statistics.median(r["cpu_per_core"]
                                                                for r in results), 3),
                           rss_mib=round(max(r["rss_mib"] for r in results), 1))
            self.rows.append(row)
            print(f"  {row['metric']:<48} {tool:<18} {row['value']:>8} s "
                  f"({row['ratio_direct']:.2f} of direct; p99 {row['p99_us']:.0f} µs)",
                  flush=True)

    def _team_filter(self, d: Path, names: list[str], count: int, each: int,
                     workers: int) -> tuple[list[dict], float]:
        """A filter with `[filter] workers`, the sessions registered, --reps runs; the runs
        and how long registering took (ms). Its state starts empty each time."""
        from appliance.control_client import ControlClient

        shutil.rmtree(d / "team-state", ignore_errors=True)
        (d / "team.toml").write_text(TEAM_FILTER.format(dir=d, up=UPSTREAM, workers=workers))
        team = spawn(APP, [str(BIN / "corral-filter"), "--config", str(d / "team.toml")],
                     d / f"team-filter-{workers}.log", FILTER_NOFILE)
        try:
            deadline = time.monotonic() + 30
            while not (d / "team.sock").exists():
                if time.monotonic() > deadline or team.poll() is not None:
                    raise RuntimeError("the team filter did not start: " + (
                        d / f"team-filter-{workers}.log").read_text()[-1000:])
                time.sleep(0.1)
            control = ControlClient(str(d / "team.sock"))
            started = time.perf_counter()
            for i in range(count):
                answer = control.request({"op": "session-add", "name": f"team{i}",
                                          "subnet": f"10.233.{i}.0/24",
                                          "files": [str(d / f"team{i}.toml")]})
                if not answer.get("ok"):
                    raise RuntimeError(f"session-add team{i}: {answer}")
            register_ms = (time.perf_counter() - started) * 1000
            for i, ns in enumerate(names):
                wait_port(ns, f"10.233.{i}.1", 3128, "the team's proxy")
            runs = [{**self._team_run(names, [f"10.233.{i}.1:3128" for i in range(count)],
                                      each, team.pid), "workers": workers}
                    for _ in range(self.args.reps)]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(team.pid, signal.SIGTERM)
            team.wait(10)
            (d / "team.sock").unlink(missing_ok=True)
        return runs, register_ms

    def _team_run(self, namespaces: list[str], proxies: list[str], each: int,
                  pid: int | None) -> dict:
        """Every client at once; the wall time until the last is done, the pooled latencies,
        and the filter's CPU per core and RSS over the run (with `pid`)."""
        cpu = sum(map(_process_cpu, _tree(pid))) if pid else 0.0
        started = time.perf_counter()
        clients = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m",
                                     "bench.team", proxy, "small.allowed.test",
                                     f"{UPSTREAM}:443", "/1k", str(each)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for ns, proxy in zip(namespaces, proxies, strict=True)]
        outputs = [c.communicate(timeout=600) for c in clients]
        seconds = time.perf_counter() - started
        failed = [err[-500:] for c, (_, err) in zip(clients, outputs, strict=True)
                  if c.returncode != 0]
        if failed:
            raise RuntimeError(f"{len(failed)} team clients failed: {failed[0]}")
        latencies = sorted(x for out, _ in outputs for x in json.loads(out)["latencies_us"])
        result = {"seconds": seconds, "p50_us": round(statistics.median(latencies)),
                  "p99_us": round(latencies[max(0, int(len(latencies) * 0.99) - 1)])}
        if pid:  # the filter and its workers
            tree = _tree(pid)
            result["cpu_per_core"] = (sum(map(_process_cpu, tree)) - cpu) / seconds \
                / os.cpu_count()
            result["rss_mib"] = sum(map(_process_rss_mib, tree))
        return result

    def noisy(self) -> None:
        """Session A asks at an agent's pace (cached names, CONNECTs) while session B floods
        random denied names, holds connections and tunnels up to its caps and sends the
        worst DNS packets there are: A's answered rate and p99 against its own, unloaded,
        measured in the same rep. Runs a filter with the appliance's defaults in place of
        the benchmark's, and puts the benchmark's back afterwards. The processes sit in CPU
        cgroups as on an appliance (bench/cgroups.py): the filter in its slice's, A and B in
        one each, as podman runs a sandbox; --noisy-flat keeps them all in one, as before."""
        d, seconds = self.dir, self.args.noisy_seconds
        flat = self.args.noisy_flat
        groups = {} if flat else {"filter": CpuGroup(PREFIX + "filter", cgroups.FILTER_WEIGHT),
                                  "a": CpuGroup(PREFIX + "a", cgroups.SANDBOX_WEIGHT),
                                  "b": CpuGroup(PREFIX + "b", cgroups.SANDBOX_WEIGHT)}
        self.groups = groups
        layout = ("one cgroup for all (--noisy-flat)" if flat
                  else cgroups.layout(list(groups.values())))
        self._stop_filter()
        (d / "noisy.toml").write_text(NOISY_FILTER.format(dir=d, up=UPSTREAM))
        try:
            noisy_filter = spawn(APP, [str(BIN / "corral-filter"), "--config",
                                       str(d / "noisy.toml")], d / "noisy-filter.log",
                                 FILTER_NOFILE, cgroup=groups.get("filter"))
        except BaseException:
            for group in groups.values():
                group.remove()
            raise
        try:
            wait_port(CLIENT, GATEWAY, 3128, "corral-filter (defaults)")
            cached = [f"n{i}.allowed.test" for i in range(10)]
            victim = {
                "DNS, cached (A at 150/s)": ["paced-dns", f"{GATEWAY}:5300", "150",
                                             str(seconds), *cached],
                "CONNECT setup (A at 50/s)": ["paced-connect", f"{GATEWAY}:3128",
                                              "bulk.allowed.test:443", "50", str(seconds)]}
            results: dict[str, dict[str, list[dict]]] = {m: {"alone": [], "noisy": []}
                                                         for m in victim}
            pid = noisy_filter.pid

            def probe(argv: list[str]) -> dict:  # A's numbers, and how long the filter's
                waited = _run_queue_wait(pid)    # loop waited for a core meanwhile
                began = time.monotonic()
                result = self._noisy_run(CLIENT, argv)
                result["wait_ms_s"] = ((_run_queue_wait(pid) - waited) * 1e3
                                       / (time.monotonic() - began))
                return result

            for _ in range(self.args.reps):
                for metric, argv in victim.items():  # warm the caches, then alone
                    self._noisy_run(CLIENT, argv)
                    results[metric]["alone"].append(probe(argv))
                load = self._neighbour(seconds * len(victim) + 3)
                try:
                    for metric, argv in victim.items():
                        results[metric]["noisy"].append(probe(argv))
                finally:
                    for process in load:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(process.pid, signal.SIGKILL)
                        process.wait()
            for metric, runs in results.items():
                alone = {k: statistics.median(r[k] for r in runs["alone"])
                         for k in ("rate", "p50_us", "p99_us", "wait_ms_s")}
                noisy = {k: statistics.median(r[k] for r in runs["noisy"])
                         for k in ("rate", "p50_us", "p99_us", "wait_ms_s")}
                row = {"metric": f"noisy neighbour: {metric}", "tool": "corral",
                       "unit": "answered/s", "value": noisy["rate"],
                       "n": len(runs["noisy"]),
                       "ratio_alone": round(noisy["rate"] / alone["rate"], 3),
                       "p50_us": noisy["p50_us"], "p99_us": noisy["p99_us"],
                       "alone_p50_us": alone["p50_us"], "alone_p99_us": alone["p99_us"],
                       "p99_ratio": round(noisy["p99_us"] / alone["p99_us"], 2),
                       "cgroups": layout,
                       "filter_wait_ms_s": round(noisy["wait_ms_s"], 1),
                       "alone_filter_wait_ms_s": round(alone["wait_ms_s"], 1)}
                self.rows.append(row)
                print(f"  {row['metric']:<48} {row['value']:>8} /s ({row['ratio_alone']:.2f} "
                      f"of alone; p99 {row['p99_ratio']:.2f}x)", flush=True)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(noisy_filter.pid, signal.SIGTERM)
            noisy_filter.wait(10)
            for group in groups.values():
                group.remove()
            self.groups = {}
            self._start_filter()

    def _noisy_run(self, ns: str, argv: list[str]) -> dict:
        """Session A's probe, in A's cgroup."""
        group = self.groups.get("a")
        command = ["ip", "netns", "exec", ns, sys.executable, "-m", "bench.noisy", *argv]
        out = subprocess.run(command, capture_output=True, text=True, timeout=120,
                             preexec_fn=group.join if group is not None else None)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: {out.stderr.strip() or out.stdout}")
        return json.loads(out.stdout)

    def _neighbour(self, seconds: int) -> list[subprocess.Popen]:
        """Session B at its worst, for `seconds`: a flood of random denied names, tunnels and
        connections held up to (and beyond) its caps, and pointer-bomb DNS packets."""
        d = self.dir
        names = d / "flood.txt"
        names.write_text("".join(f"x{random.getrandbits(48):x}.denied.test A\n"
                                 for _ in range(100_000)))
        flood = spawn(NOISY, ["dnsperf", "-s", NOISY_GATEWAY, "-p", "5300", "-d", str(names),
                              "-l", str(seconds), "-q", "500", "-c", "4"], d / "flood.log",
                      cgroup=self.groups.get("b"))
        holder = spawn(NOISY, [sys.executable, "-m", "bench.noisy", "hold",
                               f"{NOISY_GATEWAY}:3128", "bulk.allowed.test:443", "400"],
                       d / "hold.log", stdin=subprocess.PIPE, cgroup=self.groups.get("b"))
        bombs = spawn(NOISY, [sys.executable, "-m", "bench.noisy", "bombs",
                              f"{NOISY_GATEWAY}:5300", str(seconds)], d / "bombs.log",
                      cgroup=self.groups.get("b"))
        deadline = time.monotonic() + 30
        while b"held" not in (d / "hold.log").read_bytes():  # B sits at its caps now
            if time.monotonic() > deadline or holder.poll() is not None:
                raise RuntimeError("the neighbour could not take its connections: "
                                   + (d / "hold.log").read_text()[-500:])
            time.sleep(0.1)
        return [flood, holder, bombs]

    def inspect(self) -> None:
        """TLS inspection next to mitmproxy's (bench/inspected.py)."""
        inspected.measure(self)

    def start(self) -> None:
        """Session start on the local backend (bench/start.py): `corral run --detach`, the
        first `corral shell -- true`, and where the start's time went, over --starts."""
        directory = self.dir / "start"
        directory.mkdir()
        for row in start.rows(start.measure(directory, self.args.starts)):
            self.rows.append(row)
            print(f"  {row['metric']:<40} p50 {row['p50_s']:.3f} s, p95 {row['p95_s']:.3f} s",
                  flush=True)
        took = self.rows[-3]
        print("  " + ", ".join(f"{k[:-3]} {took[k]} ms" for k in (
            *(f"{step}_ms" for step in start.STEPS), "firewall_apply_ms", "registration_ms",
            "outside_ms", "cli_ms")), flush=True)

    def _stop_filter(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.filter.pid, signal.SIGTERM)
        self.filter.wait(10)
        self.processes.remove(self.filter)

    def _start_filter(self, wait: bool = True) -> None:
        """The measured filter, on filter.toml; under cProfile with --profile (its stats
        written when it stops: one file per start, numbered)."""
        d = self.dir
        command = [str(BIN / "corral-filter")]
        if self.args.profile is not None:
            self.profiles += 1
            out = self.args.profile.with_name(
                f"{self.args.profile.stem}-{self.profiles}{self.args.profile.suffix}")
            command = [sys.executable, "-m", "cProfile", "-o", str(out.resolve()), "-m",
                       "appliance.filter.service"]
            print(f"bench: the filter runs under cProfile, its stats to {out}", flush=True)
        self.filter = spawn(APP, [*command, "--config", str(d / "filter.toml")],
                            d / "filter.log", FILTER_NOFILE)
        self.processes.append(self.filter)
        if wait:
            wait_port(CLIENT, GATEWAY, 3128, "corral-filter")

    def report(self, metric, unit, runs, ratios, higher_is_better, extra=None) -> None:
        peers = {t: statistics.median(r) for t, r in ratios.items() if t != "corral"}
        best = max(peers.values(), default=None) if higher_is_better else min(
            peers.values(), default=None)
        for tool, values in runs.items():
            row = {"metric": metric, "tool": tool, "unit": unit,
                   "value": round(statistics.median(values), 1), "n": len(values),
                   "min": round(min(values), 1), "max": round(max(values), 1),
                   "ratio_direct": round(statistics.median(ratios[tool]), 3) if tool in ratios
                   else 1.0}
            if tool == "corral" and best:
                row["ratio_best_peer"] = round(row["ratio_direct"] / best, 3)
            row.update((extra or {}).get(tool, {}))
            self.rows.append(row)
            print(f"  {metric:<24} {tool:<8} {row['value']:>10} {unit} "
                  f"({row['ratio_direct']:.2f} of direct)", flush=True)


def _process_cpu(pid: int) -> float:
    """Seconds of CPU a process has used (the filter: `ip netns exec` execs it, same pid)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    """`pid` and its children (the filter's worker processes)."""
    found = [pid]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def _run_queue_wait(pid: int) -> float:
    """Seconds a process's main thread (an event loop's) has waited on the run queue for a
    core, runnable but not running (schedstat)."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[1]) / 1e9


def _process_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def interpreter() -> dict:
    """The Python the filter ran on (the venv's base: the filter is started from BIN), as the
    results record it: a number from a build without PGO says little about the appliance."""
    flags = sysconfig.get_config_var("CONFIG_ARGS") or ""
    return {"path": os.path.realpath(sys._base_executable), "version": sys.version.split()[0],
            "implementation": sys.implementation.name, "compiler": platform.python_compiler(),
            "build": " ".join(platform.python_build()), "config_args": flags,
            "cflags": sysconfig.get_config_var("PY_CFLAGS") or "",
            "debian": os.path.realpath(sys._base_executable).startswith("/usr/bin/")}


def markdown(rows: list[dict], meta: dict) -> str:
    python = meta["python"]
    lines = [f"# corral bench, {meta['started']}", "",
             f"{meta['reps']} reps, {meta['bulk_mib']} MiB bulk, {meta['dns_seconds']} s DNS "
             f"runs; {meta['starts']} session starts; {meta['cpus']} CPUs; wall "
             f"{meta['wall_s']:.0f} s.", "",
             f"Python: {python['path']} {python['version']} ({python['build']}, "
             f"{python['compiler']}; its configure flags are in the JSON).",
             "",
             "| metric | tool | value | ratio to direct | ratio to best peer | p50 / p99 µs |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        latency = f"{r['p50_us']:.0f} / {r['p99_us']:.0f}" if "p50_us" in r else ""
        if "cpu_per_core" in r:
            latency += (f"; filter with workers = {r['workers']}: {r['cpu_per_core']} of each "
                        f"core, RSS {r['rss_mib']} MiB (its processes together); the "
                        f"sessions registered in "
                        f"{r['register_ms']} ms")
        if "load_ms" in r:
            latency = (f"plan {r['plan_ms']} ms, ruleset {r['load_ms']} ms; all at once "
                       f"{r['full_ms']} ms")
        if "p95_s" in r:
            latency = f"p50 {r['p50_s']} / p95 {r['p95_s']} s over {r['n']}"
        if "container_ms" in r:
            latency += (f"; network {r['network_ms']} ms, files {r['files_ms']} ms, filter "
                        f"{r['filter_ms']} ms (registration {r['registration_ms']}, firewall "
                        f"apply {r['firewall_apply_ms']} alone), podman run "
                        f"{r['container_ms']} ms; CLI, API and the rest {r['outside_ms']} ms "
                        f"(the CLI's own start, `corral shell --help`: "
                        f"{r['cli_ms']} ms)")
        if "compile_s" in r:
            latency = (f"again {r['remembered_us']} µs; deny {r['deny_us']} µs; "
                       f"compile {r['compile_s']} s")
        notes = [latency] if latency else []  # the inspection rows' (bench/inspected.py)
        if "added_us" in r:
            notes.append(f"+{r['added_us']} µs to direct")
        if "added_ms" in r:
            notes.append(f"+{r['added_ms']} ms to direct")
        if "ratio_mitmproxy" in r:
            notes.append(f"{r['ratio_mitmproxy']}x mitmproxy's rate")
        if "ratio_tunnel" in r:
            notes.append(f"{r['ratio_tunnel']} of its spliced tunnel")
        latency = "; ".join(notes)
        if "alone_p99_us" in r:
            latency += (f" (alone {r['alone_p50_us']:.0f} / {r['alone_p99_us']:.0f}: "
                        f"p99 {r['p99_ratio']}x)")
        if "cgroups" in r:
            latency += (f"; the filter's loop waited for a core {r['filter_wait_ms_s']} ms a "
                        f"second (alone {r['alone_filter_wait_ms_s']}); {r['cgroups']}")
        ratio = r.get("ratio_direct", r.get("ratio_alone", ""))
        if "ratio_alone" in r:
            ratio = f"{ratio} of alone"
        lines.append(f"| {r['metric']} | {r['tool']} | {r['value']} {r['unit']} | "
                     f"{ratio} | {r.get('ratio_best_peer', '')} | {latency} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bulk-mib", type=int, default=100)
    parser.add_argument("--dns-seconds", type=int, default=4)
    parser.add_argument("--latency-queries", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--http-seconds", type=int, default=4)
    parser.add_argument("--new-connections", type=int, default=5000)
    parser.add_argument("--connects", type=int, default=1000)
    parser.add_argument("--tunnels", type=int, default=1000)
    parser.add_argument("--noisy-seconds", type=int, default=4)
    parser.add_argument("--noisy-flat", action="store_true",
                        help="the noisy neighbour's processes all in one cgroup (not as an "
                             "appliance runs them: to compare)")
    parser.add_argument("--inspect-requests", type=int, default=500,
                        help="inspected keep-alive requests per connection")
    parser.add_argument("--inspect-connects", type=int, default=20,
                        help="new inspected connections for the first-request latency")
    parser.add_argument("--team-sessions", type=int, default=20,
                        help="sessions (namespaces) of the team row")
    parser.add_argument("--team-connections", type=int, default=200,
                        help="HTTPS connections each team session opens")
    parser.add_argument("--team-workers", type=int, default=os.cpu_count() or 2,
                        help="the team row's second filter: [filter] workers (the cores)")
    parser.add_argument("--sessions", type=int, default=200,
                        help="sessions registered for the ruleset row")
    parser.add_argument("--starts", type=int, default=10,
                        help="session starts timed for the start row (after one left out)")
    parser.add_argument("--only", choices=PARTS, action="append")
    parser.add_argument("--profile", type=Path, metavar="PSTATS",
                        help="run the measured filter under cProfile and write its stats "
                             "(PSTATS-1, -2, ... one per start; `python -m pstats` reads "
                             "them): where the time goes, not how fast it is (the profiler "
                             "slows it about 2x)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench: needs root (network namespaces, nftables)", file=sys.stderr)
        return 2
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if "start" in (args.only or PARTS):
        missing += [t for t in START_TOOLS if shutil.which(t) is None]
    if "inspect" in (args.only or PARTS) and not inspected.MITMDUMP.exists():
        missing.append(str(inspected.MITMDUMP))
    if missing:
        print(f"bench: missing {', '.join(missing)}: scripts/bench installs them",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with tempfile.TemporaryDirectory(prefix="corral-bench-") as tmp:
        bench = Bench(Path(tmp), args)
        try:
            topology()
            bench.serve()
            for part in args.only or PARTS:
                print(f"bench: {part}", flush=True)
                getattr(bench, part)()
        except Exception:
            for log in sorted(Path(tmp).glob("*.log")):
                print(f"--- {log.name}\n{log.read_text()[-2000:]}", file=sys.stderr)
            raise
        finally:
            bench.stop()
    meta = {"started": stamp, "reps": args.reps, "bulk_mib": args.bulk_mib,
            "dns_seconds": args.dns_seconds, "starts": args.starts, "cpus": os.cpu_count(),
            "wall_s": time.monotonic() - started, "python": interpreter()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stamp}.json").write_text(json.dumps({"meta": meta, "rows": bench.rows},
                                                       indent=1))
    result = {"meta": meta, "rows": bench.rows}
    report = (markdown(bench.rows, meta) + "\n## Targets (issue 29)\n\n"
              + targets.markdown(result, f"{stamp}.json"))
    (args.out / f"{stamp}.md").write_text(report)
    print(report)
    return 0


POLICY = """
[dns]
allow = ["*.allowed.test"]
[http]
allow = ["*.allowed.test"]
[cidr]
allow = ["10.232.1.0/24"]   # the bench's upstream lives in a private range
"""

FILTER = """
[dns]
listen = ["{gateway}:53"]
upstream = ["{up}:53"]
# the throughput rows measure the filter, not its per-session limits: one session here
# sends more queries, names and tunnels than an agent would (the noisy part keeps them)
rate = 1000000
burst = 1000000
denied_rate = 1000000
denied_burst = 1000000
exfil_names = 1000000000
[proxy]
max_connections_per_session = 1200   # the RSS row holds 1000 tunnels; within 20000
max_tunnels_per_session = 1100       # descriptors (this host's hard limit) with headroom
listen = ["{gateway}:3128"]
transparent_http = ["gateway:3129"]   # where the firewall redirects: the session's gateway
transparent_tls = ["gateway:3130"]
[state]
dir = "{dir}/state"
[control]
socket = "{dir}/filter.sock"
[firewall]
manage = true
interfaces = ["cb-sbx*"]
dns_packets = 100000000       # the kernel's per-session rates, lifted as the filter's are
new_connections = 100000000
[[session]]
name = "bench"
subnet = "10.232.0.0/24"
files = ["{dir}/policy.toml", "{dir}/inspect.toml"]
"""

NOISY_FILTER = """
# the appliance's defaults, as the role writes them: listeners on each session's gateway,
# per-session limits as shipped (DNS on 5300, as the bench's clients ask it)
[dns]
listen = ["gateway:5300"]
upstream = ["{up}:53"]
[proxy]
listen = ["gateway:3128"]
transparent_http = ["gateway:3129"]
transparent_tls = ["gateway:3130"]
[state]
dir = "{dir}/noisy-state"
[control]
socket = "{dir}/noisy.sock"
[firewall]
manage = true
interfaces = ["cb-sbx*"]
[[session]]
name = "a"
subnet = "10.232.0.0/24"
files = ["{dir}/policy.toml"]
[[session]]
name = "b"
subnet = "10.232.3.0/24"
files = ["{dir}/policy.toml"]
"""

TEAM_POLICY = """
[dns]
allow = ["*.allowed.test", "team{i}.test"]
[http]
allow = ["*.allowed.test", "team{i}.test"]
[cidr]
allow = ["10.232.1.0/24"]
"""

TEAM_FILTER = """
# the appliance's defaults, as the role writes them: listeners on each session's gateway,
# per-session limits as shipped; the sessions come at run time (session-add)
[filter]
workers = {workers}
[dns]
listen = ["gateway:5300"]
upstream = ["{up}:53"]
[proxy]
listen = ["gateway:3128"]
transparent_http = ["gateway:3129"]
transparent_tls = ["gateway:3130"]
# the caps lowered so that 20 sessions fit this host's descriptors (a hard limit of 20000,
# where the unit sets 1048576): one client connection at a time per session needs 2
max_connections_per_session = 100
max_tunnels_per_session = 50
[state]
dir = "{dir}/team-state"
[control]
socket = "{dir}/team.sock"
[firewall]
manage = true
interfaces = ["cb-sbx*"]
"""

NGINX = """
daemon off;
master_process on;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 10000000;
    default_type application/octet-stream;
    server {{
        listen {up}:80 backlog=4096;
        listen {up}:443 ssl backlog=4096;
        listen {inspected}:80 backlog=4096;
        listen {inspected}:443 ssl backlog=4096;
        ssl_certificate {dir}/cert.pem;
        ssl_certificate_key {dir}/key.pem;
        root {dir}/www;
    }}
}}
"""

SQUID = """
http_port {gateway}:3138
acl tunnel_ports port 443 80
acl CONNECT method CONNECT
http_access deny CONNECT !tunnel_ports
""" + SQUID_COMMON

TINYPROXY = """
Port 3148
Listen {gateway}
Timeout 600
MaxClients 1024
Allow 10.232.2.0/24
ConnectPort 443
ConnectPort 80
DisableViaHeader Yes
LogLevel Critical
"""

if __name__ == "__main__":
    sys.exit(main())
