"""Micro-bench: what `AuditLog.append` (the event loop's part of recording an event) costs
per event, without and with signed heads (appliance/filter/audit/heads.py). Signing runs on
the writer's thread, so the append's cost must not move.

    PYTHONPATH=. /usr/bin/python3 bench/audit_emit.py [EVENTS] [ROUNDS]

Prints, per configuration, the best and the median of ROUNDS rounds in µs per append, and
the heads signed. Not a test: timings belong here, as ratios within one run.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from appliance.filter.audit import AuditLog
from appliance.filter.audit.heads import HeadSigner

EVENT = {"ts": 0.0, "id": 1, "session": "s1", "client": "10.88.0.2", "kind": "dns",
         "name": "example.com", "port": None, "address": None, "verdict": "deny",
         "reason": "no rule allows it", "rule": None, "layer": None,
         "hint": "corral allow-dns example.com --session s1"}


def round_(directory: Path, events: int, signer: HeadSigner | None) -> float:
    log = AuditLog(directory / "audit.jsonl", signer=signer)
    try:
        start = time.perf_counter()
        for n in range(events):
            log.append({**EVENT, "id": n})
        elapsed = time.perf_counter() - start
    finally:
        log.close()
    return elapsed / events * 1e6


def main() -> None:
    events = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    configs = {"no signer": None, "heads every 1000 / 60 s": (1000, 60.0),
               "heads every 10 / 0.01 s": (10, 0.01)}
    results = {name: [] for name in configs}
    heads = dict.fromkeys(configs, 0)
    for _ in range(rounds):
        for name, setting in configs.items():  # interleaved: drift hits each alike
            with tempfile.TemporaryDirectory() as tmp:
                signer = HeadSigner(Path(tmp), "bench", *setting) if setting else None
                results[name].append(round_(Path(tmp), events, signer))
                heads[name] += len(signer.heads()) if signer else 0
    base = statistics.median(results["no signer"])
    for name, values in results.items():
        print(f"{name:26} best {min(values):6.2f} µs  median {statistics.median(values):6.2f}"
              f" µs  ({statistics.median(values) / base:4.2f}x)  heads signed "
              f"{heads[name] // rounds}/round")


if __name__ == "__main__":
    main()
