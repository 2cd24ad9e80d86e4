"""The boot ruleset exists twice: corral_firewall's nft template (loaded by
corral-firewall.service before networking, no Python needed) and `corral-firewall apply
--base` (the local backend). Both are loaded into namespaces here and must be the same table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.unit.test_roles import render

pytestmark = pytest.mark.e2e
BIN = Path(sys.executable).parent


def _table(namespace: str) -> list[dict]:
    listed = subprocess.run(["ip", "netns", "exec", namespace, "nft", "-j", "list", "table",
                             "inet", "corral"], capture_output=True, text=True, check=True)
    items = json.loads(listed.stdout)["nftables"]
    for item in items:
        for body in item.values():
            body.pop("handle", None)
    return [i for i in items if "metainfo" not in i]


def test_template_and_python_build_the_same_boot_table(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces")
    names = [f"corral-base-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True)
        ruleset = tmp_path / "base.nft"
        ruleset.write_text(render("corral_firewall", "etc/corral/base.nft.j2"))
        subprocess.run(["ip", "netns", "exec", names[0], "nft", "-f", str(ruleset)], check=True)
        # loading it again replaces the table (the unit's restart), it does not fail
        subprocess.run(["ip", "netns", "exec", names[0], "nft", "-f", str(ruleset)], check=True)
        subprocess.run(["ip", "netns", "exec", names[1], str(BIN / "corral-firewall"), "apply",
                        "--base"], check=True, capture_output=True, timeout=60)
        assert _table(names[0]) == _table(names[1])
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], check=False)


def test_a_managing_filter_replaces_the_boot_ruleset_when_it_starts(tmp_path):
    """corral-filter.service starts after corral-firewall.service: with `[firewall] manage`
    it loads the full ruleset itself (the appliance has no other step that would)."""
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces")
    name = f"corral-base-{uuid.uuid4().hex[:6]}"
    (tmp_path / "filter.toml").write_text(f"""
[dns]
listen = ["127.0.0.1:5353"]
upstream = ["127.0.0.1:9"]
[proxy]
listen = ["127.0.0.1:3128"]
[state]
dir = "{tmp_path}/state"
[control]
socket = "{tmp_path}/filter.sock"
[firewall]
manage = true
""")
    filter_process = None
    try:
        subprocess.run(["ip", "netns", "add", name], check=True)
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
                       check=True)
        subprocess.run(["ip", "netns", "exec", name, str(BIN / "corral-firewall"), "apply",
                        "--base"], check=True, capture_output=True, timeout=60)
        assert not [i for i in _table(name) if i.get("set", {}).get("name") == "learned"]
        filter_process = subprocess.Popen(
            ["ip", "netns", "exec", name, str(BIN / "corral-filter"), "--config",
             str(tmp_path / "filter.toml")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(100):
            if (tmp_path / "filter.sock").exists():
                break
            assert filter_process.poll() is None, filter_process.stderr.read()
            time.sleep(0.1)
        sets = [i["set"]["name"] for i in _table(name) if "set" in i]
        assert "learned" in sets, sets
    finally:
        if filter_process is not None:
            filter_process.terminate()
            filter_process.wait(10)
            filter_process.stderr.close()
        subprocess.run(["ip", "netns", "del", name], check=False)
