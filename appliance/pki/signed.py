"""What the appliance signs with its audit key, and how anyone checks it offline.

One Ed25519 key (`head-key`, 0600, the filter's alone, in its state directory; the public
half beside it as `head-key.pub`, 0644) signs two kinds of message, each behind a domain
prefix of its own, so that a signature over one kind never verifies as the other:

  HEAD      b"corral-audit-head-v1\\0" + canonical JSON of {appliance, hash, seq, time}
            the audit chain's head: the filter signs it by itself, never on request
  EVIDENCE  b"corral-evidence-v1\\0"   + canonical JSON of an evidence bundle's index
            (`corral evidence`): the filter signs an index it is handed only after checking
            its shape (format, session, members by sha256), and always behind this prefix

The two prefixes differ at their 8th byte, and the filter builds every message itself (the
prefix included): whatever index the admin API hands it, the bytes signed start with the
evidence prefix, so no request can make the key sign something that parses as a head.

Canonical JSON: keys sorted, no spaces, ASCII only (json.dumps' escapes), as the audit
records themselves are written. Pure functions; the CLI imports this module.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from appliance.atomic import write_atomic

HEAD_DOMAIN = b"corral-audit-head-v1\0"
EVIDENCE_DOMAIN = b"corral-evidence-v1\0"
EVIDENCE_FORMAT = "corral-evidence-v1"
HEAD_FIELDS = ("appliance", "hash", "seq", "time")
KEY_FILE = "head-key"
PUBLIC_FILE = "head-key.pub"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MEMBER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class SignatureError(ValueError):
    """A signature, a key or a signed document that does not check out: the message says
    which and why."""


def canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def line_hash(line: bytes) -> str:
    """An audit line's hash, as the next line's `prev` carries it."""
    return hashlib.sha256(line).hexdigest()


# -- heads files (the filter's, and the copies a host keeps) ------------------------------


def cut_torn_tail(fd: int) -> None:
    """A write cut off (a crash, a full disk) leaves a last line without its newline: cut
    it, or the next line appended would be glued to it and neither would read again."""
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        os.ftruncate(fd, os.pread(fd, size, 0).rfind(b"\n") + 1)


def read_heads(path: Path):
    """The signed heads in a heads file, oldest first: a line that is not one (torn, or
    edited into something else) is skipped; each head's signature is the reader's to
    check."""
    try:
        with open(path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    return
                try:
                    head = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(head, dict) and isinstance(head.get("seq"), int):
                    yield head
    except FileNotFoundError:
        return


# -- keys ---------------------------------------------------------------------------------


def load_or_create_key(directory: Path) -> ed25519.Ed25519PrivateKey:
    """The audit key in `directory`, made on first use (0600, created exclusively: a second
    filter start never replaces it), and its public half written beside it (0644)."""
    path = Path(directory) / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = serialization.load_pem_private_key(path.read_bytes(), None)
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise SignatureError(f"{path} is not an Ed25519 key; move it aside and restart "
                                 "the filter to make a new one") from None
    else:
        key = ed25519.Ed25519PrivateKey.generate()
        with os.fdopen(fd, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
            f.flush()
            os.fsync(f.fileno())
    public = Path(directory) / PUBLIC_FILE
    pem = public_pem(key.public_key())
    if not public.exists() or public.read_bytes() != pem:
        write_atomic(public, pem, 0o644)
    return key


def public_pem(key: ed25519.Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM,
                            serialization.PublicFormat.SubjectPublicKeyInfo)


def load_public(pem: bytes | str, where: str = "the key") -> ed25519.Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(pem.encode() if isinstance(pem, str) else pem)
    except ValueError as exc:
        raise SignatureError(f"{where} is not a PEM public key: {exc}") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise SignatureError(f"{where} is not an Ed25519 public key")
    return key


def fingerprint(key: ed25519.Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "SHA256:" + base64.b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")


# -- heads --------------------------------------------------------------------------------


def head_message(head: dict) -> bytes:
    return HEAD_DOMAIN + canonical({k: head[k] for k in HEAD_FIELDS})


def sign_head(key: ed25519.Ed25519PrivateKey, seq: int, digest: str, at: float,
              appliance: str) -> dict:
    head = {"appliance": appliance, "hash": digest, "seq": seq, "time": round(at, 3)}
    return {**head, "signature": base64.b64encode(key.sign(head_message(head))).decode()}


def check_head(key: ed25519.Ed25519PublicKey, signed: dict) -> None:
    """Raise SignatureError unless `signed` is a well-formed head its signature covers."""
    if not isinstance(signed, dict) or set(signed) != {*HEAD_FIELDS, "signature"}:
        raise SignatureError(f"not a signed head: {str(signed)[:200]}")
    if not (isinstance(signed["seq"], int) and isinstance(signed["hash"], str)
            and _SHA256.fullmatch(signed["hash"]) and isinstance(signed["appliance"], str)
            and isinstance(signed["time"], int | float)):
        raise SignatureError(f"a signed head with malformed fields: {str(signed)[:200]}")
    _check(key, head_message(signed), signed["signature"], f"the head at seq {signed['seq']}")


# -- evidence -----------------------------------------------------------------------------


def check_index(index) -> None:
    """The only shape of index the filter signs (and a verifier accepts)."""
    if not isinstance(index, dict) or index.get("format") != EVIDENCE_FORMAT:
        raise SignatureError(f"an evidence index has \"format\": \"{EVIDENCE_FORMAT}\"")
    if not isinstance(index.get("session"), str) or not index["session"]:
        raise SignatureError("an evidence index names its session")
    members = index.get("members")
    if not isinstance(members, dict) or not members or not all(
            isinstance(n, str) and _MEMBER.fullmatch(n) and isinstance(d, str)
            and _SHA256.fullmatch(d) for n, d in members.items()):
        raise SignatureError("an evidence index's members map plain file names to sha256 "
                             "hex digests")


def evidence_message(index: dict) -> bytes:
    check_index(index)
    return EVIDENCE_DOMAIN + canonical(index)


def sign_evidence(key: ed25519.Ed25519PrivateKey, index: dict) -> str:
    return base64.b64encode(key.sign(evidence_message(index))).decode()


def check_evidence(key: ed25519.Ed25519PublicKey, index: dict, signature: str) -> None:
    _check(key, evidence_message(index), signature, "the evidence index")


def _check(key: ed25519.Ed25519PublicKey, message: bytes, signature, what: str) -> None:
    try:
        raw = base64.b64decode(signature, validate=True)
        key.verify(raw, message)
    except (InvalidSignature, ValueError, TypeError):
        raise SignatureError(f"the signature over {what} does not verify with the appliance's "
                             f"key {fingerprint(key)}") from None
