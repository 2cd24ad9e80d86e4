"""The ruleset row: what one more session costs the firewall when many are registered, run
as root inside a network namespace of its own (nothing is routed; only nftables is loaded):

  python -m bench.ruleset SESSIONS REPS STATE_DIR [FILTER_TOML]

SESSIONS are registered through the policy store as `corral run` registers them and loaded
as one ruleset; then, REPS times, one more session is registered the way the filter's
`session-add` does it (plan, write, the ruleset for the change, load) and timed, and
unregistered again (untimed), each through the filter's own `Firewall.apply`. Prints
{"sessions", "add_ms": [...] and its parts "plan_ms" (the store's plan and write) and
"load_ms" (the ruleset built and loaded), "full_ms" (the first load of them all)} as JSON.
FILTER_TOML: the filter's config to build the ruleset from (its [state] dir STATE_DIR), in
place of CONFIG (the start row's: the local backend's own, bench/start.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from appliance.filter.firewalled import Firewall
from appliance.firewall.learned import LearnedSet
from appliance.firewall.nft import Nft
from appliance.policystore import PolicyStore
from appliance.sessionconfig import parse_config

CONFIG = """
[dns]
listen = ["10.231.0.1:53"]
upstream = ["192.0.2.53:53"]
[proxy]
listen = ["10.231.0.1:3128"]
transparent_http = ["gateway:3129"]
transparent_tls = ["gateway:3130"]
[state]
dir = "{state}"
"""


def subnet(i: int) -> str:
    return f"10.{240 + i // 250}.{i % 250}.0/24"


def measure(sessions: int, reps: int, state: Path, config: str | None = None) -> dict:
    store = PolicyStore(parse_config(config or CONFIG.format(state=state), "filter.toml"))
    for i in range(sessions):
        store.register(f"s{i}", subnet(i))
    nft = Nft()
    firewall = Firewall(nft, LearnedSet(nft, lambda *_: None))  # as the filter drives it
    started = time.perf_counter()
    firewall.apply(store)
    full_ms = (time.perf_counter() - started) * 1000
    add, plan, load = [], [], []
    for _ in range(reps):
        started = time.perf_counter()
        change = store.plan_register(f"s{sessions}", subnet(sessions))
        change.write()
        planned = time.perf_counter()
        firewall.apply(change)  # what `session-add` does (changes.py)
        done = time.perf_counter()
        store.commit(change)
        add.append((done - started) * 1000)
        plan.append((planned - started) * 1000)
        load.append((done - planned) * 1000)
        change = store.plan_unregister(f"s{sessions}")
        change.write()
        firewall.apply(change)
        store.commit(change)
    return {"sessions": sessions, "add_ms": add, "plan_ms": plan, "load_ms": load,
            "full_ms": full_ms}


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]),
                             Path(sys.argv[4]).read_text() if len(sys.argv) > 4 else None)))
