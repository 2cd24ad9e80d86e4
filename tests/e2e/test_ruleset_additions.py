"""A session that comes is loaded alone (`ruleset.additions`), into real nftables in a network
namespace of the test's own: what the kernel then holds is exactly what loading the whole
ruleset for the new state gives, and where the small transaction is refused the filter's
`Firewall` loads the whole ruleset instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

SCRIPT = r"""
import json, subprocess, sys
from pathlib import Path
from appliance.filter.firewalled import Firewall
from appliance.firewall import ruleset
from appliance.firewall.learned import LearnedSet
from appliance.firewall.nft import Nft
from appliance.manifest.ruleset import normalise
from appliance.policystore import PolicyStore
from appliance.sessionconfig import parse_config

state = Path(sys.argv[1])
(state / "tcp.toml").write_text('[tcp]\nallow = ["203.0.113.7:22", "db.example.net:5432"]\n')
config = parse_config(f'''
[dns]
listen = ["10.231.0.1:53"]
upstream = ["192.0.2.53:53"]
[proxy]
listen = ["10.231.0.1:3128"]
transparent_http = ["gateway:3129"]
transparent_tls = ["gateway:3130"]
[state]
dir = "{state}/state"
[[session]]
name = "fixed"
subnet = "10.241.0.0/24"
''', "filter.toml")
store = PolicyStore(config)
for i in range(4):
    store.register(f"s{i}", f"10.242.{i}.0/24")
nft = Nft()
firewall = Firewall(nft, LearnedSet(nft, lambda *_: None))
firewall.apply(store)
out = {}

def listing():
    return normalise(nft.list_table())

# one more session, with a tcp rule naming an address: its chains and elements alone
change = store.plan_register("late", "10.242.9.0/24", None, [str(state / "tcp.toml")])
change.write()
added = ruleset.additions(store, change)
out["added_commands"] = len(added)
out["whole_commands"] = len(ruleset.for_store(change))
firewall.apply(change)
store.commit(change)
alone = listing()
nft.apply(ruleset.for_store(store, [], nft.counters()))
out["same_as_whole"] = alone == listing()
out["late_chains"] = sorted(i["chain"]["name"] for i in alone if "chain" in i
                            and i["chain"]["name"].endswith("_late"))
out["static_tcp"] = any("203.0.113.7" in json.dumps(i) for i in alone
                        if "rule" in i and i["rule"]["chain"] == "session_forward_late")

# loaded, never committed (its caller went away): the same session again is loaded whole,
# not added a second time
change = store.plan_register("ghost", "10.242.11.0/24")
change.write()
firewall.apply(change)
change.undo()
change = store.plan_register("ghost", "10.242.11.0/24")
change.write()
firewall.apply(change)
store.commit(change)
twice = listing()
nft.apply(ruleset.for_store(store, [], nft.counters()))
out["again_same_as_whole"] = twice == listing()

# the small transaction refused (the table gone behind the filter's back): the whole loads
subprocess.run(["nft", "delete", "table", "inet", "corral"], check=True)
change = store.plan_register("later", "10.242.10.0/24")
change.write()
firewall.apply(change)
store.commit(change)
again = listing()
nft.apply(ruleset.for_store(store, [], nft.counters()))
out["fallback_same_as_whole"] = again == listing()
out["fallback_has_later"] = any(i.get("chain", {}).get("name") == "session_input_later"
                                for i in again)
print(json.dumps(out))
"""


@pytest.fixture
def namespace():
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces")
    name = f"corral-rules-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_a_session_loaded_alone_is_what_the_whole_ruleset_holds(namespace, tmp_path):
    result = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", SCRIPT,
                             str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["same_as_whole"], out
    assert out["late_chains"] == ["deny_late", "session_forward_late", "session_input_late",
                                  "session_nat_late"]
    assert out["again_same_as_whole"], out
    assert out["static_tcp"]
    assert out["added_commands"] < out["whole_commands"] / 4  # a few of them, not all again
    assert out["fallback_same_as_whole"] and out["fallback_has_later"], out
