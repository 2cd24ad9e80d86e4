"""GET /v1/manifest and `corral verify --against`: two real APIs (mTLS), each serving the
manifest its provisioning recorded, compared by the real CLI difference by difference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.manifest import AS_RENDERED, build, dumps
from cli import exitcodes
from cli.client import CliError, write_appliance
from tests.integration.api.conftest import ApiProcess

CORRAL = str(Path(sys.executable).parent / "corral")


def recorded(name: str, gateway: str, nftables: str = "1.0.6-2 amd64") -> bytes:
    return dumps(build(
        corral={"version": "0.1.0", "commit": "ab765c3"},
        packages={"nftables": nftables, "podman": "4.3.1+ds1-8 amd64"},
        wheels={"corral": {"version": "0.1.0", "sha256": "a" * 64}},
        images={"localhost/corral-sandbox:0.1.0": "sha256:" + "b" * 64},
        files={"/etc/corral/filter.toml": "c" * 64},
        units={"corral-filter": "enabled active"},
        ruleset={"rendered": "d" * 64, "loaded": AS_RENDERED},
        policy={"appliance": "e" * 64},
        appliance={"name": name, "hostname": f"corral-{name}", "host_gateway": gateway}))


@pytest.fixture(scope="module")
def two(api, corral_filter, tmp_path_factory):
    """Two appliances the CLI knows, "one" (the module's API) and "two" (another API)."""
    other = ApiProcess(tmp_path_factory.mktemp("api-two"), corral_filter.socket)
    home = tmp_path_factory.mktemp("home")
    os.environ["XDG_CONFIG_HOME"] = str(home)  # write_appliance reads it
    try:
        for name, process in (("one", api), ("two", other)):
            write_appliance(name, f"127.0.0.1:{process.port}", process.bundle,
                            server_dir=str(process.server_dir), api_pidfile=str(process.pidfile))
        yield home, api, other
    finally:
        del os.environ["XDG_CONFIG_HOME"]
        other.stop()
        for process in (api, other):
            (process.dir / "manifest.json").unlink(missing_ok=True)


def verify_against(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CORRAL, "verify", "--appliance", "one", "--against", "two", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "XDG_CONFIG_HOME": str(home)})


def test_an_appliance_without_a_manifest_answers_404_naming_the_fix(two):
    _, one, _ = two
    (one.dir / "manifest.json").unlink(missing_ok=True)
    with pytest.raises(CliError, match=r"no manifest at .*provisioning writes it"):
        one.client().request("GET", "/manifest")


def test_the_api_serves_the_recorded_manifest(two):
    _, one, _ = two
    (one.dir / "manifest.json").write_bytes(recorded("one", "192.168.121.1"))
    assert one.client().request("GET", "/manifest") == json.loads(recorded("one", "192.168.121.1"))
    (one.dir / "manifest.json").write_text('{"format": 99}')
    with pytest.raises(CliError, match="format 99"):
        one.client().request("GET", "/manifest")


def test_two_appliances_from_one_commit_compare_identical(two):
    home, one, other = two
    (one.dir / "manifest.json").write_bytes(recorded("one", "192.168.121.1"))
    (other.dir / "manifest.json").write_bytes(recorded("two", "10.0.0.1"))
    done = verify_against(home)
    assert done.returncode == exitcodes.OK, done.stderr
    assert done.stdout.splitlines()[0].startswith("one and two are identical")
    assert "  appliance host_gateway: 192.168.121.1 -> 10.0.0.1" in done.stdout.splitlines()


def test_a_changed_package_is_named_and_the_exit_says_so(two):
    home, one, other = two
    (one.dir / "manifest.json").write_bytes(recorded("one", "192.168.121.1"))
    (other.dir / "manifest.json").write_bytes(recorded("two", "10.0.0.1", "1.0.9-1 amd64"))
    done = verify_against(home)
    assert done.returncode == exitcodes.DIFFERENT, done.stderr
    assert done.stdout.splitlines()[0] == "package nftables: 1.0.6-2 amd64 -> 1.0.9-1 amd64"
    report = json.loads(verify_against(home, "--json").stdout)
    assert report["identical"] is False
    assert [d["text"] for d in report["differences"]] == [
        "package nftables: 1.0.6-2 amd64 -> 1.0.9-1 amd64"]
    assert [d["name"] for d in report["expected_to_differ"]] == ["host_gateway", "hostname",
                                                                 "name"]
