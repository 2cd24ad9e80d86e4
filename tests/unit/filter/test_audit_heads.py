"""Signed heads: the key made once, the head signed on the writer's thread when due, each
signature behind its own domain prefix."""

from __future__ import annotations

import json
import os
import time

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from appliance.filter.audit import AuditLog
from appliance.filter.audit.files import line_hash
from appliance.filter.audit.heads import HeadSigner
from appliance.pki import signed


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_key_is_made_once_private_with_its_public_half_beside_it(tmp_path):
    first = signed.load_or_create_key(tmp_path)
    assert oct((tmp_path / "head-key").stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "head-key.pub").stat().st_mode & 0o777) == "0o644"
    mtime = (tmp_path / "head-key").stat().st_mtime_ns
    again = signed.load_or_create_key(tmp_path)
    assert signed.public_pem(again.public_key()) == signed.public_pem(first.public_key())
    assert (tmp_path / "head-key").stat().st_mtime_ns == mtime  # never replaced
    public = signed.load_public((tmp_path / "head-key.pub").read_bytes())
    head = signed.sign_head(first, 3, "a" * 64, time.time(), "box")
    signed.check_head(public, head)


def test_a_head_signature_breaks_with_any_field_changed(tmp_path):
    key = signed.load_or_create_key(tmp_path)
    head = signed.sign_head(key, 7, "b" * 64, 1000.0, "box")
    for field, value in (("seq", 8), ("hash", "c" * 64), ("time", 1001.0),
                         ("appliance", "other")):
        with pytest.raises(signed.SignatureError, match="does not verify"):
            signed.check_head(key.public_key(), {**head, field: value})
    with pytest.raises(signed.SignatureError, match="does not verify"):
        signed.check_head(ed25519.Ed25519PrivateKey.generate().public_key(), head)


def test_an_evidence_signature_never_verifies_as_a_head_nor_the_other_way(tmp_path):
    """The domain prefixes: a signature over an index (whatever the index says) is no
    head's, and a head's signature is no index's."""
    key = signed.load_or_create_key(tmp_path)
    index = {"format": signed.EVIDENCE_FORMAT, "session": "s1", "appliance": "box",
             "hash": "d" * 64, "seq": 5, "time": 1000.0, "members": {"a.json": "e" * 64}}
    signature = signed.sign_evidence(key, index)
    signed.check_evidence(key.public_key(), index, signature)
    as_head = {k: index[k] for k in signed.HEAD_FIELDS} | {"signature": signature}
    with pytest.raises(signed.SignatureError):
        signed.check_head(key.public_key(), as_head)
    head = signed.sign_head(key, 5, "d" * 64, 1000.0, "box")
    with pytest.raises(signed.SignatureError):
        signed.check_evidence(key.public_key(), index, head["signature"])
    assert signed.evidence_message(index)[:8] != signed.head_message(head)[:8]


@pytest.mark.parametrize("index", [
    {"format": "corral-audit-head-v1", "session": "s", "members": {"a": "0" * 64}},
    {"format": signed.EVIDENCE_FORMAT, "members": {"a": "0" * 64}},
    {"format": signed.EVIDENCE_FORMAT, "session": "s", "members": {}},
    {"format": signed.EVIDENCE_FORMAT, "session": "s", "members": {"../x": "0" * 64}},
    {"format": signed.EVIDENCE_FORMAT, "session": "s", "members": {"a": "not a digest"}},
    ["not", "a", "dict"],
])
def test_the_key_signs_no_index_of_another_shape(tmp_path, index):
    key = signed.load_or_create_key(tmp_path)
    with pytest.raises(signed.SignatureError):
        signed.sign_evidence(key, index)


def test_the_writer_signs_the_head_every_n_records_on_its_own_thread(tmp_path):
    signer = HeadSigner(tmp_path, "box", every=5, interval=3600)
    log = AuditLog(tmp_path / "audit.jsonl", window=0, signer=signer)
    try:
        for n in range(12):
            log.append({"n": n})
            if n in (3, 5, 11):  # batches of 4, 2 and 6 records
                wait_for(lambda n=n: log.head["seq"] == n + 1)
        wait_for(lambda: len(signer.heads()) == 2)
        assert log.describe()["signed"]["seq"] == 12  # status says it, from memory
    finally:
        log.close()
    heads = signer.heads()
    lines = (tmp_path / "audit.jsonl").read_bytes().splitlines()
    public = signed.load_public((tmp_path / "head-key.pub").read_bytes())
    for head in heads:
        signed.check_head(public, head)
        assert head["hash"] == line_hash(lines[head["seq"] - 1])
    # the first head at once (none was signed), then not at 6 (2 since), at 12 (8 since)
    assert [h["seq"] for h in heads] == [4, 12]


def test_an_idle_moved_head_is_signed_after_the_interval_and_an_unmoved_one_never(tmp_path):
    signer = HeadSigner(tmp_path, "box", every=1000, interval=0.2)
    log = AuditLog(tmp_path / "audit.jsonl", window=0, signer=signer)
    try:
        log.append({"n": 1})
        wait_for(lambda: signer.heads() and signer.heads()[-1]["seq"] == 1)
        time.sleep(0.6)  # three intervals, nothing new: nothing signed
        assert len(signer.heads()) == 1
        log.append({"n": 2})
        wait_for(lambda: signer.heads()[-1]["seq"] == 2)
    finally:
        log.close()


def test_a_restarted_signer_goes_on_after_the_heads_on_disk(tmp_path):
    signer = HeadSigner(tmp_path, "box", every=1, interval=3600)
    log = AuditLog(tmp_path / "audit.jsonl", window=0, signer=signer)
    log.append({"n": 1})
    wait_for(lambda: signer.heads())
    log.close()
    again = HeadSigner(tmp_path, "box", every=1, interval=3600)
    assert again.sign(1, signer.heads()[0]["hash"], force=True) is None  # already signed
    assert again.latest() == signer.heads()[0]
    with open(tmp_path / "audit-heads.jsonl", "ab") as f:
        f.write(b'{"torn')  # a crash mid-write: skipped
    assert HeadSigner(tmp_path, "box").heads() == signer.heads()
    assert json.loads((tmp_path / "audit-heads.jsonl").read_bytes().splitlines()[0])["seq"] == 1
    assert os.stat(tmp_path / "audit-heads.jsonl").st_mode & 0o777 == 0o600


def test_a_sessions_segment_runs_from_its_first_record_to_the_head_across_segments(tmp_path):
    """Every record between, other sessions' too (a chain cannot skip one), and none past
    the signed head."""
    from appliance.filter.audit import session_segment

    log = AuditLog(tmp_path / "audit.jsonl", window=0, segment_bytes=4096)
    try:
        for n in range(120):
            log.append({"session": "s10" if n < 30 else ("s1" if n % 3 == 0 else "s2"),
                        "n": n})
        wait_for(lambda: log.head["seq"] == 120)
    finally:
        log.close()
    assert len(list(tmp_path.glob("audit-*.jsonl"))) >= 2  # it crosses a rotation
    lines = session_segment(tmp_path / "audit.jsonl", "s1", 100)
    records = [json.loads(line) for line in lines]
    assert [r["seq"] for r in records] == list(range(31, 101))  # "s10" is not "s1"
    assert records[0]["session"] == "s1"
    assert session_segment(tmp_path / "audit.jsonl", "s1", 20) == []
    assert session_segment(tmp_path / "audit.jsonl", "nobody", 120) == []


def test_a_clean_stop_signs_the_head_it_ends_at(tmp_path):
    signer = HeadSigner(tmp_path, "box", every=1000, interval=3600)
    log = AuditLog(tmp_path / "audit.jsonl", window=0, signer=signer)
    log.append({"n": 1})
    wait_for(lambda: signer.heads())  # the first head at once: none was signed before
    log.append({"n": 2})
    log.append({"n": 3})
    wait_for(lambda: log.head["seq"] == 3)
    assert [h["seq"] for h in signer.heads()] == [1]  # not due
    log.close()
    assert [h["seq"] for h in signer.heads()] == [1, 3]


def test_a_head_torn_by_a_crash_neither_stops_the_filter_nor_glues_the_next(tmp_path):
    """A crash (or a full disk) mid-write leaves a last line without its newline: the
    signer starts anyway, from the last whole head, and cuts the torn line before the next."""
    signer = HeadSigner(tmp_path, "corral", every=1)
    first = signer.sign(1, "a" * 64)
    with open(tmp_path / "audit-heads.jsonl", "ab") as f:
        f.write(b'{"appliance":"corral","hash":"bbbb')  # the crash
    again = HeadSigner(tmp_path, "corral", every=1)
    assert again.latest() == first
    second = again.sign(2, "b" * 64)
    assert again.heads() == [first, second]
    lines = (tmp_path / "audit-heads.jsonl").read_bytes().splitlines()
    assert [json.loads(line) for line in lines] == [first, second]


def test_a_line_that_is_no_head_is_skipped_when_read(tmp_path):
    signer = HeadSigner(tmp_path, "corral", every=1)
    first = signer.sign(1, "a" * 64)
    with open(tmp_path / "audit-heads.jsonl", "ab") as f:
        f.write(b"not json\n[1, 2]\n")
    second = HeadSigner(tmp_path, "corral", every=1).sign(2, "b" * 64)
    assert HeadSigner(tmp_path, "corral").heads() == [first, second]
