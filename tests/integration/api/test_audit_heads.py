"""Signed audit heads end to end: the real filter signs its head, the real CLI keeps the
heads over the real API (mTLS), and `corral audit --verify` catches a log rewritten whole
(every record re-hashed, the heads on the appliance re-signed with its own key, as root
could) at the first head the CLI kept."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from appliance.pki import signed
from tests.integration.api.test_cli import corral
from tests.integration.conftest import FilterProcess

HEADS = """
[audit]
heads_every = 3
heads_interval = 0.3
appliance = "test-box"
"""


@pytest.fixture(scope="module")
def corral_filter(internet, tmp_path_factory):
    process = FilterProcess(tmp_path_factory.mktemp("filter"), internet.dns.address,
                            extra_config=HEADS)
    yield process
    process.stop()


def kept(home: Path) -> list[dict]:
    path = home / "corral" / "appliances" / "default" / "audit-heads.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def records(corral_filter, count: int, tag: str) -> None:
    """`count` audit records: runtime rules added (each is recorded, whatever the rate)."""
    for n in range(count):
        corral_filter.control({"op": "add", "session": "s1", "kind": "dns",
                               "rule": f"{tag}{n}.heads.test"})


def keep_heads_until(home: Path, seq: int) -> list[dict]:
    deadline = time.monotonic() + 15
    while True:
        listed = corral(home, "audit", "--json", "--limit", "1")
        assert listed.returncode == 0, listed.stderr
        heads = kept(home)
        if heads and heads[-1]["seq"] >= seq:
            return heads
        assert time.monotonic() < deadline, f"no head signed at or past seq {seq}: {heads}"
        time.sleep(0.2)


def test_the_cli_keeps_heads_the_filter_signed_and_an_untouched_log_passes(home,
                                                                            corral_filter):
    records(corral_filter, 7, "a")
    head = corral_filter.control({"op": "status"})["audit"]["head"]
    heads = keep_heads_until(home, head["seq"])
    directory = home / "corral" / "appliances" / "default"
    pinned = signed.load_public((directory / "audit-key.pem").read_bytes())
    state_key = signed.load_public((corral_filter.dir / "state" / "head-key.pub").read_bytes())
    assert signed.fingerprint(pinned) == signed.fingerprint(state_key)
    for kept_head in heads:
        signed.check_head(pinned, kept_head)
        assert kept_head["appliance"] == "test-box"
    assert oct((corral_filter.dir / "state" / "head-key").stat().st_mode & 0o777) == "0o600"
    status = corral(home, "status")
    assert "signed heads kept on this host" in status.stdout, status.stdout + status.stderr
    verified = corral(home, "audit", "--verify", "--json")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    verdict = json.loads(verified.stdout)
    assert verdict["intact"] and verdict["heads"]["intact"]
    assert verdict["heads"]["checked"] == len(kept(home)) >= 2


def rewrite(state: Path) -> int:
    """What root can do: change the first record, re-hash every record after it, and sign
    the heads again with the filter's own key. The number of records."""
    log = state / "audit.jsonl"
    lines = log.read_bytes().splitlines()
    out, prev = [], "0" * 64
    for number, line in enumerate(lines):
        record = json.loads(line)
        if number == 0:
            record["rewritten"] = "by root"
        record["prev"] = prev
        encoded = signed.canonical(record)
        out.append(encoded)
        prev = hashlib.sha256(encoded).hexdigest()
    log.write_bytes(b"".join(line + b"\n" for line in out))
    key = serialization.load_pem_private_key((state / "head-key").read_bytes(), None)
    hashes = {json.loads(line)["seq"]: hashlib.sha256(line).hexdigest() for line in out}
    heads = [json.loads(line) for line in (state / "audit-heads.jsonl").read_bytes().splitlines()]
    (state / "audit-heads.jsonl").write_bytes(b"".join(
        signed.canonical(signed.sign_head(key, h["seq"], hashes[h["seq"]], h["time"],
                                          h["appliance"])) + b"\n" for h in heads))
    return len(out)


def test_a_log_rewritten_whole_is_caught_at_the_first_kept_head(home, corral_filter):
    first_kept = kept(home)[0]["seq"]
    corral_filter.stop()
    rewrite(corral_filter.dir / "state")
    corral_filter.start()
    chain = corral_filter.control({"op": "audit-verify"})
    assert chain["intact"] is True  # the chain alone cannot tell
    verified = corral(home, "audit", "--verify", "--json")
    assert verified.returncode == 5, verified.stdout + verified.stderr
    verdict = json.loads(verified.stdout)
    assert verdict["chain_intact"] is True and verdict["intact"] is False
    assert verdict["heads"]["seq"] == first_kept
    assert "not the one the appliance signed" in verdict["heads"]["error"]
    human = corral(home, "audit", "--verify")
    assert human.returncode == 5
    assert f"signed heads at seq {first_kept}: the log's record at seq {first_kept} is not " \
           "the one the appliance signed" in human.stderr


def test_a_log_replaced_whole_after_every_kept_head_is_not_vouched_for(home, corral_filter):
    """Root deletes the log and its heads and writes a consistent chain that starts after
    the last head this host kept, as if retention had removed the rest: no kept head is
    left in it, so nothing vouches for it (before, it passed as retention's work)."""
    last_kept = kept(home)[-1]["seq"]
    corral_filter.stop()
    state = corral_filter.dir / "state"
    template = json.loads((state / "audit.jsonl").read_bytes().splitlines()[-1])
    for old in state.glob("audit*.jsonl*"):
        old.unlink()
    out, prev = [], "f" * 64
    for seq in range(last_kept + 1, last_kept + 6):
        encoded = signed.canonical({**template, "seq": seq, "prev": prev})
        out.append(encoded)
        prev = hashlib.sha256(encoded).hexdigest()
    (state / "audit.jsonl").write_bytes(b"".join(line + b"\n" for line in out))
    corral_filter.start()
    records(corral_filter, 4, "after")  # the filter goes on, signing heads for the new log
    status = corral(home, "status")  # which `status` would keep: it refuses, and says why
    assert f"the log no longer holds the record at seq {last_kept}" in status.stderr, (
        status.stdout + status.stderr)
    assert kept(home)[-1]["seq"] == last_kept  # nothing of the new log was kept
    verified = corral(home, "audit", "--verify", "--json")
    assert verified.returncode == 5, verified.stdout + verified.stderr
    verdict = json.loads(verified.stdout)["heads"]
    assert verdict["intact"] is False and verdict["checked"] == 0, verdict
    assert "no head kept on this host is in the log any more" in verdict["error"]


def test_a_changed_key_is_an_error_naming_the_fix(home, corral_filter):
    """Last in this module: the appliance gets a new key."""
    corral_filter.stop()
    (corral_filter.dir / "state" / "head-key").unlink()
    corral_filter.start()
    verified = corral(home, "audit", "--verify")
    assert verified.returncode == 5
    assert "audit key changed" in verified.stderr and "aside to pin the new one" in \
        verified.stderr
    status = corral(home, "status")  # said, not fatal
    assert "audit key changed" in status.stderr
