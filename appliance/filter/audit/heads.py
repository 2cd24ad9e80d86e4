"""Signed heads: the chain's head (seq, hash), signed with the appliance's audit key every
`every` records or `interval` seconds (only when the head moved), kept in `audit-heads.jsonl`
beside the log.

Why: the chain shows an edit to one record, but root can rewrite the whole log consistently
(every record re-hashed) and the chain verifies again. A head signed before that, and kept
off the appliance (the CLI keeps every one it sees), pins the record at its seq: after a
rewrite, that record no longer has that hash.

Why a file of their own and not audit records: a head recorded in the chain moves the head,
so there would always be a newer head to sign (a record per interval on an idle appliance,
forever), and a head cannot sign the record that carries it. The file is read by `since`
(the heads signed after a seq): a line of ~200 bytes per head, one a minute on a quiet
appliance and one per `every` records on a busy one.

Signing runs on the audit writer's thread, after a batch is on disk (an Ed25519 signature
is ~50 µs), or on a control-socket worker when asked for (`audit-sign`, before an evidence
bundle): `AuditLog.append`, the event loop's part, does no more than before.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from appliance.pki.signed import (
    cut_torn_tail,
    load_or_create_key,
    public_pem,
    read_heads,
    sign_head,
)

from .files import fsync_dir

HEADS_EVERY = 1000
"""Default: a head is signed after this many records ([audit] heads_every) ..."""
HEADS_INTERVAL = 60.0
"""... or this many seconds after the last signed one, if the head moved ([audit]
heads_interval)."""


@dataclass
class Signed:
    seq: int
    at: float


class HeadSigner:
    """Signs the head when it is due and appends it to the heads file. Thread-safe."""

    def __init__(self, state_dir: Path, appliance: str, every: int = HEADS_EVERY,
                 interval: float = HEADS_INTERVAL):
        self.path = Path(state_dir) / "audit-heads.jsonl"
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        self.key = load_or_create_key(Path(state_dir))
        self.public_pem = public_pem(self.key.public_key()).decode()
        self.appliance, self.every, self.interval = appliance, every, interval
        self._lock = threading.Lock()
        last = self.latest()
        self._last = Signed(last["seq"], last["time"]) if last else Signed(0, 0.0)
        self.failed: str | None = None

    def due(self, seq: int, now: float) -> bool:
        last = self._last
        return seq > last.seq and (seq - last.seq >= self.every or now - last.at >= self.interval)

    def wait(self, seq: int, now: float) -> float:
        """Seconds until the interval makes the head at `seq` due (the writer sleeps no
        longer); a whole interval when nothing moved (a new record wakes the writer)."""
        if seq <= self._last.seq:
            return self.interval
        return max(0.0, self._last.at + self.interval - now)

    def sign(self, seq: int, digest: str, force: bool = False) -> dict | None:
        """Sign (seq, digest), a head on disk, if it is due (or `force` and it moved); the
        signed head, or None."""
        with self._lock:
            now = time.time()
            if seq <= self._last.seq or not (force or self.due(seq, now)):
                return None
            signed = sign_head(self.key, seq, digest, now, self.appliance)
            line = json.dumps(signed, sort_keys=True, separators=(",", ":")).encode() + b"\n"
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    new = os.fstat(fd).st_size == 0
                    cut_torn_tail(fd)
                    os.write(fd, line)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                if new:
                    fsync_dir(self.path.parent)
            except OSError as exc:
                self.failed = f"signing the audit head failed: {exc}"
                return None
            self._last, self.failed = Signed(seq, now), None
            return signed

    def describe(self) -> dict:
        """The last head signed, from memory (`status`)."""
        last = self._last
        return {"seq": last.seq, "time": last.at, "every": self.every,
                "interval": self.interval, "error": self.failed}

    def heads(self, after: int = 0, limit: int = 1000) -> list[dict]:
        """Signed heads with seq > `after`, oldest first."""
        out = []
        for head in read_heads(self.path):
            if head["seq"] > after:
                out.append(head)
                if len(out) == limit:
                    break
        return out

    def latest(self) -> dict | None:
        last = None
        for last in read_heads(self.path):  # noqa: B007 - the last one is wanted
            pass
        return last
