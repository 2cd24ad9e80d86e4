"""What a person reviewed, named so that exactly it is applied (THREATS 32).

The agent may write to /work between `corral diff` and `corral apply`. So `diff` takes a
snapshot: the walk's changes with every carried file's contents read once (`carry`), and the
diff text is rendered from those bytes, not from work/ again. The snapshot is named by its
digest: sha256 over `canonical()`, a serialisation of everything apply writes or checks —
each path (its bytes), action, kind, executable bit, size, content hash (of the bytes
carried), link target and note, on both sides, and the notes. Any change to any of these
changes the digest; the same changeset always gives the same one. The appliance keeps the
snapshot; `apply --digest D` gets exactly its changes, and the host recomputes the digest
of what it received before writing anything (`verify`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass

from .compare import carry
from .model import LIMITS, Change, Changeset, Entry, Limits, Note

VERSION = b"corral changeset 1\n"
"""Prefixed to what is hashed: a later serialisation can never collide with this one."""
DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Snapshot:
    """A changeset as it was shown: its changes carried (contents loaded), its notes."""

    changes: list[Change]
    notes: list[Note]
    digest: str
    """sha256 of `canonical(changes, notes)`, hex."""


def _bytes(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _side(entry: Entry | None) -> dict | None:
    if entry is None:
        return None
    side: dict = {"kind": entry.kind, "executable": entry.executable, "size": entry.size,
                  "note": entry.note}
    if entry.kind == "file":  # the bytes that would be written, when they are here
        side["sha256"] = (hashlib.sha256(entry.data).hexdigest() if entry.data is not None
                          else entry.digest)
    elif entry.kind == "link":
        side["target"] = _bytes(entry.data) if entry.data is not None else None
    return side


def canonical(changes: list[Change], notes: list[Note]) -> bytes:
    """One byte string for a changeset: names as bytes (not as shown), keys sorted, ASCII."""
    value = {
        "changes": [{"path": _bytes(os.fsencode(c.path)), "action": c.action,
                     "before": _side(c.before), "after": _side(c.after)} for c in changes],
        "notes": [{"path": _bytes(os.fsencode(n.path)), "text": n.text} for n in notes],
    }
    return VERSION + json.dumps(value, sort_keys=True, separators=(",", ":"),
                                ensure_ascii=True).encode()


def digest(changes: list[Change], notes: list[Note]) -> str:
    return hashlib.sha256(canonical(changes, notes)).hexdigest()


def take(changeset: Changeset, limits: Limits = LIMITS) -> Snapshot:
    """The changeset with its contents read (each file once), and its digest. What is read
    is what is shown and what is applied: the caller renders from these bytes."""
    changes = carry(changeset, None, limits)
    return Snapshot(changes, list(changeset.notes), digest(changes, changeset.notes))


def verify(changes: list[Change], notes: list[Note], expected: str) -> None:
    """ValueError unless these are the changes and notes whose digest is `expected`."""
    got = digest(changes, notes)
    if got != expected:
        raise ValueError(f"the changeset received has digest {got}, not {expected}")
