"""`corral evidence`: a real bundle from the real API and filter, checked offline, and
refused, naming the member, with one byte changed in any of its members."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from tests.integration.api.test_cli import corral


@pytest.fixture(scope="module")
def bundle(home, tmp_path_factory) -> Path:
    for name in ("evidence-one.test", "evidence-two.test"):
        added = corral(home, "allow-dns", name, "--session", "s1")
        assert added.returncode == 0, added.stderr
    assert corral(home, "revoke", "dns", "evidence-two.test", "--session", "s1"
                  ).returncode == 0
    target = tmp_path_factory.mktemp("evidence") / "s1.tar"
    written = corral(home, "evidence", "s1", "-o", str(target), "--json")
    assert written.returncode == 0, written.stdout + written.stderr
    summary = json.loads(written.stdout)
    assert summary["file"] == str(target) and summary["session"] == "s1"
    return target


def members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_a_bundle_holds_the_policy_decisions_records_and_heads(bundle):
    found = members(bundle)
    assert sorted(found) == ["approvals.json", "audit.jsonl", "events.json", "heads.jsonl",
                             "index.json", "manifest.json", "policy.json", "session.json",
                             "signature.json", "workspace.json"]
    policy = json.loads(found["policy.json"])
    assert {"appliance", "project", "session"} <= set(policy["layers"])
    assert [r["rule"] for r in policy["layers"]["session"]["rules"]] == ["evidence-one.test"]
    assert all(len(layer["sha256"]) == 64 for layer in policy["layers"].values())
    decided = json.loads(found["approvals.json"])["decided"]
    assert [(r["rule"], r["action"], r["by"].split("#")[0]) for r in decided
            if r["kind"] == "rule" and r["rule"].startswith("evidence-")] == [
        ("evidence-one.test", "added", "corral-cli"),
        ("evidence-two.test", "added", "corral-cli"),
        ("evidence-two.test", "revoked", "corral-cli")]
    assert json.loads(found["manifest.json"])["sha256"] == "absent"  # none on this host
    assert json.loads(found["workspace.json"])["applied"] is None
    index = json.loads(found["index.json"])
    last = json.loads(found["audit.jsonl"].splitlines()[-1])
    assert index["head"]["seq"] == last["seq"]
    assert json.loads(found["heads.jsonl"].splitlines()[-1])["seq"] == last["seq"]
    with tarfile.open(bundle) as tar:  # deterministic: nothing of this host or this moment
        assert {(m.mtime, m.uid, m.gid, m.uname, m.mode) for m in tar.getmembers()} == {
            (0, 0, 0, "", 0o644)}


def test_a_bundle_verifies_offline_with_the_pinned_key_or_a_key_file(home, bundle,
                                                                       corral_filter, tmp_path):
    verified = corral(home, "evidence", "--verify", str(bundle))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "verified with key SHA256:" in verified.stdout
    elsewhere = tmp_path / "auditor"  # no appliance configured: only the key file
    elsewhere.mkdir()
    key = tmp_path / "appliance.pub"
    shutil.copy(corral_filter.dir / "state" / "head-key.pub", key)
    offline = corral(elsewhere, "evidence", "--verify", str(bundle), "--key", str(key),
                     "--json")
    assert offline.returncode == 0, offline.stderr
    assert json.loads(offline.stdout)["records"]["session"] >= 3
    no_key = corral(elsewhere, "evidence", "--verify", str(bundle))
    assert no_key.returncode == 2 and "pass --key FILE" in no_key.stderr


@pytest.mark.parametrize("member", ["policy.json", "audit.jsonl", "heads.jsonl",
                                    "approvals.json", "manifest.json", "index.json",
                                    "signature.json"])
def test_one_byte_changed_in_a_member_is_refused_naming_it(home, bundle, tmp_path, member):
    data = bytearray(bundle.read_bytes())
    with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar:
        info = tar.getmember(member)
    at = info.offset_data + info.size // 2
    data[at] ^= 0x01
    changed = tmp_path / "changed.tar"
    changed.write_bytes(bytes(data))
    refused = corral(home, "evidence", "--verify", str(changed), "--json")
    assert refused.returncode == 5, refused.stdout + refused.stderr
    verdict = json.loads(refused.stdout)
    # a signature changed but still well-formed fails as the signature over the index
    assert verdict["member"] == member or (member, verdict["member"]) == (
        "signature.json", "index.json")
    human = corral(home, "evidence", "--verify", str(changed))
    assert human.returncode == 5 and f"error: {verdict['member']}:" in human.stderr
