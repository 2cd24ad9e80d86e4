"""The audit log: append-only JSONL, fsynced, each line chained to the one before it, in
segments of bounded size.

Every line carries `seq` (1, 2, ...) and `prev`, the SHA-256 of the previous line's bytes
(64 zeros for the first). Editing, removing, inserting or reordering any line breaks the
chain at the next line, which `verify()` reports by file and line. What a chain alone cannot
show is a cut at the very end: `AuditLog.head` (the last seq and hash on disk) is kept by the
running filter and reported over the control socket, so a verifier can compare against it.

Segments. Lines go to `audit.jsonl` (the active segment). When the next batch would take it
past `segment_bytes`, it is renamed `audit-<its first seq>.jsonl` and a new `audit.jsonl`
begins; the chain goes on across the boundary (the new segment's first `prev` is the hash of
the old one's last line). The oldest segments beyond `keep` are deleted: `verify()` then
reports the log intact from the first seq kept (whose `prev` it cannot check, and says so).
Rotation is rename, fsync the directory, create, fsync the directory: a crash between any
two steps leaves every record in exactly one file, and start-up (`_recover`) continues the
chain from the newest segment that holds a record.

The writer (`writer.AuditLog`) never blocks the event loop: lines are chained where events
are emitted and written by a thread in groups, one fsync each. The readers
(`reader.page`, `reader.verify`) take no lock the writer holds, so neither waits for the
other.
"""

from __future__ import annotations

from .files import GENESIS, Segment, encode, segment_path, segments
from .reader import Verification, page, session_segment, verify
from .writer import COMMIT_WINDOW, SEGMENT_BYTES, SEGMENTS_KEPT, AuditLog

__all__ = ["COMMIT_WINDOW", "GENESIS", "SEGMENTS_KEPT", "SEGMENT_BYTES", "AuditLog", "Segment",
           "Verification", "encode", "page", "segment_path", "segments", "session_segment",
           "verify"]
