"""Issue 29's targets, read from one `scripts/bench` result: each met or missed, by how much.

  python -m bench.targets bench/results/<time>.json      the table the README shows

Every target compares numbers measured in the same run (corral against a peer, or against
the direct baseline), but for the few set in absolute terms (a p99, a decision, an apply).
A row the result lacks is reported as not measured, never as met.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Rows = dict[tuple[str, str], dict]


@dataclass(frozen=True)
class Target:
    what: str
    """The target, as the issue says it."""
    measure: Callable[[Rows], float]
    """The number compared (raises KeyError when a row it needs is missing)."""
    goal: float
    at_most: bool
    """True: met when the number is at most `goal`; False: at least."""
    unit: str = "x"


def _row(rows: Rows, metric: str, tool: str) -> dict:
    return rows[(metric, tool)]


def _ratio(metric: str, peer: str, key: str = "value") -> Callable[[Rows], float]:
    return lambda rows: _row(rows, metric, "corral")[key] / _row(rows, metric, peer)[key]


def _field(metric: str, key: str, tool: str = "corral") -> Callable[[Rows], float]:
    return lambda rows: _row(rows, metric, tool)[key]


def _prefixed(prefix: str, key: str, tool: str = "corral") -> Callable[[Rows], float]:
    """A field of the one row whose metric starts with `prefix` (its sizes are in its name)."""
    def measure(rows: Rows) -> float:
        (row,) = [r for (metric, t), r in rows.items() if metric.startswith(prefix)
                  and t == tool] or [{}]
        return row[key]
    return measure


def _workers(prefix: str, key: str) -> Callable[[Rows], float]:
    """As _prefixed, from the row of the filter with more than one worker."""
    def measure(rows: Rows) -> float:
        (row,) = [r for (metric, t), r in rows.items() if metric.startswith(prefix)
                  and t.startswith("corral, ")] or [{}]
        return row[key]
    return measure


def _added_vs_squid(rows: Rows) -> float:
    metric = "inspected HTTPS keep-alive"
    return _row(rows, metric, "corral")["added_us"] / _row(rows, metric, "squid bump")["added_us"]


TARGETS = [
    Target("CONNECT setup p50 ≤ squid's", _ratio("CONNECT setup", "squid", "p50_us"), 1.0,
           True),
    Target("CONNECT setup p99 ≤ 1 ms", _field("CONNECT setup", "p99_us"), 1000, True, " µs"),
    Target("HTTP keep-alive rate ≥ squid's", _ratio("HTTP keep-alive", "squid"), 1.0, False),
    Target("HTTP new-connection rate ≥ squid's", _ratio("HTTP new connections", "squid"), 1.0,
           False),
    Target("CONNECT plain bulk ≥ 0.90 of direct", _field("CONNECT plain bulk", "ratio_direct"),
           0.9, False),
    Target("DNS cached ≥ 1.0x dnsmasq", _ratio("DNS allowed-cached", "dnsmasq"), 1.0, False),
    Target("DNS cached p99 ≤ 2x dnsmasq's", _ratio("DNS allowed-cached", "dnsmasq", "p99_us"),
           2.0, True),
    Target("DNS uncached ≥ 0.5x dnsmasq", _ratio("DNS allowed-uncached", "dnsmasq"), 0.5,
           False),
    Target("DNS uncached p99 ≤ 2x dnsmasq's",
           _ratio("DNS allowed-uncached", "dnsmasq", "p99_us"), 2.0, True),
    Target("inspected keep-alive ≥ 5x mitmproxy",
           _ratio("inspected HTTPS keep-alive", "mitmproxy"), 5.0, False),
    Target("inspected keep-alive ≥ squid bump",
           _ratio("inspected HTTPS keep-alive", "squid bump"), 1.0, False),
    Target("inspected, 8 connections ≥ 5x mitmproxy",
           _ratio("inspected HTTPS, 8 connections", "mitmproxy"), 5.0, False),
    Target("inspected, 8 connections ≥ squid bump",
           _ratio("inspected HTTPS, 8 connections", "squid bump"), 1.0, False),
    Target("inspected: latency added on a kept connection ≤ squid bump's", _added_vs_squid,
           1.0, True),
    Target("inspected: first request (leaf cached) ≤ +2 ms",
           _field("inspected HTTPS first request", "added_ms"), 2.0, True, " ms"),
    Target("inspected bulk ≥ 0.8 of the spliced tunnel",
           _field("inspected HTTPS bulk", "ratio_tunnel"), 0.8, False),
    Target("first policy decision at 100k rules ≤ 2 µs",
           _field("policy decision, 100000 rules", "value"), 2.0, True, " µs"),
    Target("team scale: total ≤ 1.3x direct (workers = 1)",
           _prefixed("team scale:", "ratio_direct"), 1.3, True),
    Target("team scale: total ≤ 1.3x direct (workers = cores)",
           _workers("team scale:", "ratio_direct"), 1.3, True),
    Target("ruleset: one more session with 200 registered ≤ 50 ms",
           _field("ruleset: one more session, 200 registered", "value"), 50, True, " ms"),
    Target("noisy neighbour, DNS: A keeps ≥ 0.8 of its rate",
           _field("noisy neighbour: DNS, cached (A at 150/s)", "ratio_alone"), 0.8, False),
    Target("noisy neighbour, DNS: A's p99 ≤ 2x",
           _field("noisy neighbour: DNS, cached (A at 150/s)", "p99_ratio"), 2.0, True),
    Target("noisy neighbour, CONNECT: A keeps ≥ 0.8 of its rate",
           _field("noisy neighbour: CONNECT setup (A at 50/s)", "ratio_alone"), 0.8, False),
    Target("noisy neighbour, CONNECT: A's p99 ≤ 2x",
           _field("noisy neighbour: CONNECT setup (A at 50/s)", "p99_ratio"), 2.0, True),
    Target("session start (local): first command done ≤ 0.5 s",
           _field("session start: first command done", "value"), 0.5, True, " s"),
]


def judge(result: dict) -> list[dict]:
    """Each target with what was measured: {"target", "measured", "goal", "met"} (met None:
    not measured in this result)."""
    rows = {(r["metric"], r["tool"]): r for r in result["rows"]}
    out = []
    for target in TARGETS:
        try:
            measured = float(target.measure(rows))
        except (KeyError, ZeroDivisionError):
            out.append({"target": target.what, "measured": None, "goal": target.goal,
                        "unit": target.unit, "met": None})
            continue
        met = measured <= target.goal if target.at_most else measured >= target.goal
        out.append({"target": target.what, "measured": round(measured, 3), "goal": target.goal,
                    "unit": target.unit, "met": met})
    return out


def markdown(result: dict, name: str) -> str:
    python = result["meta"].get("python", {})
    lines = [f"`{name}`: {result['meta']['reps']} reps on {result['meta']['cpus']} CPUs, "
             f"Python {python.get('version', '?')} ({python.get('path', '?')}).", "",
             "| target | measured | |", "|---|---:|---|"]
    for judged in judge(result):
        if judged["met"] is None:
            lines.append(f"| {judged['target']} | not measured | — |")
            continue
        unit = judged["unit"]
        lines.append(f"| {judged['target']} | {judged['measured']:g}{unit} | "
                     f"{'met' if judged['met'] else 'missed'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m bench.targets RESULT.json", file=sys.stderr)
        return 2
    path = Path(argv[0])
    print(markdown(json.loads(path.read_text()), path.name), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
