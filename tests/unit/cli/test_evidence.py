"""`corral evidence`'s archive and its offline check, on bundles made here with a key of
the test's own (the integration tier checks one the real appliance made)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from appliance.pki import signed
from cli.evidence import Refused, bundle, check

KEY = ed25519.Ed25519PrivateKey.generate()


def chain(count: int, session: str = "s1") -> list[bytes]:
    lines, prev = [], "0" * 64
    for seq in range(1, count + 1):
        line = signed.canonical({"seq": seq, "prev": prev, "session": session, "kind": "dns"})
        lines.append(line)
        prev = hashlib.sha256(line).hexdigest()
    return lines


def answer(lines: list[bytes], head_at: int | None = None, key=KEY) -> dict:
    head_at = head_at or len(lines)
    digest = hashlib.sha256(lines[head_at - 1]).hexdigest()
    head = signed.sign_head(key, head_at, digest, 1000.0, "box")
    members = {"audit.jsonl": b"".join(line + b"\n" for line in lines).decode(),
               "heads.jsonl": signed.canonical(head).decode() + "\n",
               "policy.json": '{"layers": {}}\n'}
    index = {"format": signed.EVIDENCE_FORMAT, "session": "s1", "appliance": "box",
             "created": 1000.0, "head": {"seq": head_at, "hash": digest},
             "members": {n: hashlib.sha256(t.encode()).hexdigest() for n, t in members.items()}}
    return {"index": index, "signature": signed.sign_evidence(key, index),
            "key": "", "members": members}


def test_a_bundle_is_the_same_bytes_each_time_and_verifies():
    made = answer(chain(5))
    assert bundle(made) == bundle(made)
    verdict = check(bundle(made), KEY.public_key())
    assert verdict["records"] == {"first": 1, "last": 5, "session": 5, "heads": 1,
                                  "kept_heads_matched": 0}


@pytest.mark.parametrize("member", ["audit.jsonl", "heads.jsonl", "policy.json", "index.json",
                                    "signature.json"])
def test_every_byte_of_a_member_is_covered(member):
    data = bundle(answer(chain(5)))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        info = tar.getmember(member)
    for offset in range(info.size):  # every byte of the member, one at a time
        changed = bytearray(data)
        changed[info.offset_data + offset] ^= 0x20
        with pytest.raises(Refused) as refused:
            check(bytes(changed), KEY.public_key())
        assert refused.value.member in (member, "index.json")


def test_another_key_is_refused():
    with pytest.raises(Refused, match="does not verify") as refused:
        check(bundle(answer(chain(3))), ed25519.Ed25519PrivateKey.generate().public_key())
    assert refused.value.member == "index.json"


def test_records_that_run_past_the_signed_head_are_refused():
    """Signed by the appliance's key, but the chain is not anchored at a signed head: the
    audit records carry a proof of their own, whoever assembled the bundle."""
    with pytest.raises(Refused, match="not the signed head") as refused:
        check(bundle(answer(chain(5), head_at=3)), KEY.public_key())
    assert refused.value.member == "audit.jsonl"


def test_a_member_added_or_removed_is_refused():
    data = answer(chain(3))
    data["members"]["extra.json"] = "{}\n"
    with pytest.raises(Refused, match="not in the signed index"):
        check(bundle(data), KEY.public_key())
    data = answer(chain(3))
    del data["members"]["policy.json"]
    with pytest.raises(Refused, match="missing"):
        check(bundle(data), KEY.public_key())


def test_a_head_signed_by_the_evidence_signature_is_refused():
    """An evidence signature pasted in as a head's does not verify as one."""
    made = answer(chain(2))
    head = json.loads(made["members"]["heads.jsonl"])
    head["signature"] = made["signature"]
    made["members"]["heads.jsonl"] = signed.canonical(head).decode() + "\n"
    made["index"]["members"]["heads.jsonl"] = hashlib.sha256(
        made["members"]["heads.jsonl"].encode()).hexdigest()
    made["signature"] = signed.sign_evidence(KEY, made["index"])
    with pytest.raises(Refused, match=r"heads\.jsonl: line 1: the signature"):
        check(bundle(made), KEY.public_key())


def test_a_bundle_of_a_rewritten_log_signed_with_the_real_key_is_refused_by_a_kept_head():
    """Root on the appliance holds the key: it can sign a bundle of a log rewritten whole,
    heads and all. What it cannot change is a head this host kept before the rewrite."""
    before = chain(5)
    kept_before = signed.sign_head(KEY, 3, hashlib.sha256(before[2]).hexdigest(), 900.0, "box")
    rewritten = chain(5, session="s1-rewritten")  # consistent, signed with the same key
    forged = bundle(answer(rewritten))
    assert check(forged, KEY.public_key())["ok"]  # the signature alone vouches for it
    with pytest.raises(Refused, match="rewritten before the bundle was made") as refused:
        check(forged, KEY.public_key(), [kept_before])
    assert refused.value.member == "audit.jsonl"
    honest = check(bundle(answer(before)), KEY.public_key(), [kept_before])
    assert honest["records"]["kept_heads_matched"] == 1
