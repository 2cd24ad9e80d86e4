"""The manifest's pure half: built from facts, compared into differences named one by one."""

from __future__ import annotations

import ast
import copy
import sys
from pathlib import Path

import pytest

from appliance.manifest import (
    AS_RENDERED,
    Difference,
    ManifestError,
    box_manifest,
    build,
    compare,
    dpkg_query,
    dumps,
    loads,
    mask,
    parse_dpkg,
    parse_lock,
)

A, B = "a" * 64, "b" * 64


def manifest(**changes) -> dict:
    """One appliance's manifest; `changes` replace whole sections."""
    sections = {
        "corral": {"version": "0.1.0", "commit": "ab765c3"},
        "packages": {"nftables": "1.0.6-2 amd64", "podman": "4.3.1+ds1-8 amd64"},
        "wheels": {"corral": {"version": "0.1.0", "sha256": A},
                   "flask": {"version": "3.0.3", "sha256": B}},
        "images": {"localhost/corral-sandbox:0.1.0": "sha256:" + A},
        "files": {"/etc/corral/filter.toml": A, "/etc/corral/policy.toml": B},
        "units": {"corral-filter": "enabled active", "corral-api": "enabled active"},
        "ruleset": {"rendered": A, "loaded": AS_RENDERED},
        "policy": {"appliance": B},
        "appliance": {"name": "one", "hostname": "corral-one", "host_gateway": "192.168.121.1"},
    }
    for section, value in changes.items():
        sections[section] = value
    return build(**sections)


def changed(section: str, name: str, value) -> dict:
    result = manifest()
    result[section] = copy.deepcopy(result[section])
    if value is None:
        del result[section][name]
    else:
        result[section][name] = value
    return result


@pytest.mark.parametrize(("section", "name", "value", "line"), [
    ("packages", "nftables", "1.0.9-1 amd64", "package nftables: 1.0.6-2 amd64 -> 1.0.9-1 amd64"),
    ("packages", "curl", "7.88.1-10 amd64", "package curl: added (7.88.1-10 amd64)"),
    ("packages", "podman", None, "package podman: removed (was 4.3.1+ds1-8 amd64)"),
    ("files", "/etc/corral/filter.toml", B,
     "file /etc/corral/filter.toml: sha256 aaaaaaaaaaaa… -> sha256 bbbbbbbbbbbb…"),
    ("files", "/etc/corral/extra.toml", A, "file /etc/corral/extra.toml: added (sha256 aaaa"),
    ("units", "corral-filter", "enabled inactive",
     "unit corral-filter: enabled active -> enabled inactive"),
    ("wheels", "corral", {"version": "0.1.0", "sha256": B},
     "wheel corral: 0.1.0 sha256 aaaaaaaaaaaa… -> 0.1.0 sha256 bbbbbbbbbbbb…"),
    ("ruleset", "loaded", "differs from rendered", "ruleset: loaded differs from rendered"),
    ("ruleset", "rendered", B, "ruleset rendered: sha256 aaaaaaaaaaaa… -> sha256 bbbb"),
    ("policy", "appliance", A, "policy appliance: sha256 bbbbbbbbbbbb… -> sha256 aaaa"),
    ("images", "localhost/corral-sandbox:0.1.0", "sha256:" + B,
     "image localhost/corral-sandbox:0.1.0: sha256:" + A + " -> sha256:" + B),
    ("corral", "commit", "61b7878", "corral commit: ab765c3 -> 61b7878"),
    ("appliance", "host_gateway", "10.0.0.1",
     "appliance host_gateway: 192.168.121.1 -> 10.0.0.1"),
])
def test_each_drift_is_one_difference_named(section, name, value, line):
    comparison = compare(manifest(), changed(section, name, value))
    assert [str(d) for d in comparison.differences if not str(d).startswith(line)] == []
    assert len(comparison.differences) == 1
    assert (comparison.differences[0].section, comparison.differences[0].name) == (section, name)


def test_an_edited_file_and_a_changed_package_are_each_reported_by_name():
    running = changed("files", "/etc/corral/filter.toml", B)
    running["packages"] = {**running["packages"], "nftables": "1.0.9-1 amd64"}
    lines = [str(d) for d in compare(manifest(), running).differences]
    assert lines == ["package nftables: 1.0.6-2 amd64 -> 1.0.9-1 amd64",
                     "file /etc/corral/filter.toml: sha256 aaaaaaaaaaaa… -> sha256 bbbbbbbbbbbb…"]


def test_the_same_manifest_has_no_difference():
    assert compare(manifest(), manifest()).differences == ()


def test_two_appliances_differing_only_in_their_own_values_compare_identical():
    other = manifest(appliance={"name": "two", "hostname": "corral-two",
                                "host_gateway": "10.0.0.1"})
    across = compare(manifest(), other, across=True)
    assert across.differences == ()
    assert [d.name for d in across.expected] == ["host_gateway", "hostname", "name"]
    assert across.to_json()["identical"] is True
    # on one appliance, its own values changing is drift like any other
    assert len(compare(manifest(), other).differences) == 3


def test_across_appliances_a_real_difference_still_counts():
    other = changed("packages", "nftables", "1.0.9-1 amd64")
    other["appliance"] = {"name": "two"}
    across = compare(manifest(), other, across=True)
    assert [str(d) for d in across.differences] == [
        "package nftables: 1.0.6-2 amd64 -> 1.0.9-1 amd64"]


def test_the_same_facts_give_the_same_bytes():
    first = dumps(manifest())
    shuffled = {k: dict(reversed(list(v.items()))) if isinstance(v, dict) else v
                for k, v in manifest().items()}
    assert dumps(build(**{k: v for k, v in shuffled.items() if k != "format"})) == first
    assert loads(first) == manifest()


@pytest.mark.parametrize(("data", "message"), [
    (b"{", "not JSON"),
    (b"[]", "not a JSON object"),
    (b'{"format": 99}', "format 99"),
    (b'{"format": 1, "files": []}', "files is not an object"),
])
def test_a_manifest_that_cannot_be_compared_is_refused_by_what_is_wrong(data, message):
    with pytest.raises(ManifestError, match=message):
        loads(data, "/etc/corral/manifest.json")


def test_dpkg_lines_become_package_versions():
    text = "nftables 1.0.6-2 amd64\nlibc6 2.36-9+deb12u4 amd64\nremoved-pkg  \n"
    assert parse_dpkg(text) == {"nftables": "1.0.6-2 amd64", "libc6": "2.36-9+deb12u4 amd64"}


def test_a_hashed_lock_file_gives_each_pin_and_its_hashes():
    text = ("# generated\nFlask==3.0.3 \\\n    --hash=sha256:bb \\\n    --hash=sha256:aa\n"
            "    # via corral\nzope.interface==6.4 ; python_version >= '3.11' "
            "--hash=sha256:cc\n")
    assert parse_lock(text) == {
        "flask": {"version": "3.0.3", "hashes": ["sha256:aa", "sha256:bb"]},
        "zope-interface": {"version": "6.4", "hashes": ["sha256:cc"]}}


def test_masking_makes_one_configuration_hash_alike_on_two_appliances():
    one = b'[host]\ngateway = "192.168.121.1"   # the VM host\n'
    two = b'[host]\ngateway = "10.0.0.1"   # the VM host\n'
    assert mask(one, {"host_gateway": "192.168.121.1"}) == mask(two, {"host_gateway": "10.0.0.1"})
    assert mask(one, {"host_gateway": ""}) == one


def test_a_difference_serialises_with_its_line():
    difference = Difference("units", "corral-api", "enabled active", None)
    assert difference.to_json()["text"] == "unit corral-api: removed (was enabled active)"


def test_the_shared_manifest_module_is_standard_library_only():
    """The CLI compares manifests with it: it must pull in nothing of the appliance's."""
    tree = ast.parse(Path("appliance/manifest/__init__.py").read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
               for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
    assert modules - {"__future__"} <= sys.stdlib_module_names


def test_a_box_package_set_against_an_appliance_names_what_provisioning_changed():
    box = box_manifest("nftables 1.0.6-2 amd64\npodman 4.3.1+ds1-8 amd64\nvim 2:9.0 amd64\n")
    assert dpkg_query("/tmp/box/var/lib/dpkg")[:2] == ["dpkg-query",
                                                        "--admindir=/tmp/box/var/lib/dpkg"]
    lines = [str(d) for d in compare(box, manifest(), sections=("packages",)).differences]
    assert lines == ["package vim: removed (was 2:9.0 amd64)"]
