"""The snapshots `corral diff` showed, kept per session (workspaces/NAME/reviews/), so that
`corral apply --digest D` gets exactly the changes shown under D and nothing read later
(appliance/workspace/snapshot.py says what a snapshot holds and how its digest is made).

One file per snapshot, `DIGEST.json` (the changes in wire format 2 with their contents, and
the notes), written atomically; the newest KEEP stay, so a session's snapshots take at most
KEEP x (MAX_CARRIED of contents + the names). A kept file is checked again when it is read:
its changes must still have the digest it is named by, else it is refused, never applied.
The directory is not mounted into the session: the agent cannot reach it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from appliance import workspace
from appliance.atomic import write_atomic
from appliance.workspace import snapshot

KEEP = 3
"""Snapshots kept per session: a person may review again before applying an earlier one."""


class DamagedSnapshot(ValueError):
    """A kept snapshot that no longer matches its digest (it is not applied)."""


class Reviews:
    def __init__(self, directory: Path, keep: int = KEEP):
        self.directory, self.keep = Path(directory), keep

    def _path(self, digest: str) -> Path:
        if not snapshot.DIGEST.fullmatch(digest):
            raise ValueError(f"{digest!r} is not a changeset digest (64 hex digits)")
        return self.directory / f"{digest}.json"

    def save(self, taken: snapshot.Snapshot) -> None:
        data = {"format": workspace.FORMAT, "digest": taken.digest,
                "changes": [workspace.to_json(c) for c in taken.changes],
                "notes": [workspace.note_json(n) for n in taken.notes]}
        write_atomic(self._path(taken.digest), json.dumps(data, separators=(",", ":")).encode(),
                     mode=0o600)
        self._prune()

    def _prune(self) -> None:
        kept = sorted(self.directory.glob("*.json"), key=lambda p: p.stat().st_mtime_ns,
                      reverse=True)
        for old in kept[self.keep:]:
            old.unlink(missing_ok=True)

    def load(self, digest: str) -> snapshot.Snapshot | None:
        """The snapshot shown under `digest`; None when none is kept under it. Raises
        DamagedSnapshot when the kept file does not hold what its name says."""
        path = self._path(digest)
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise DamagedSnapshot(f"the kept snapshot {digest} cannot be read: {exc}") from None
        try:
            changes = [workspace.from_json(c) for c in data["changes"]]
            notes = [workspace.note_from(n) for n in data["notes"]]
            snapshot.verify(changes, notes, digest)
        except (KeyError, TypeError, ValueError) as exc:
            raise DamagedSnapshot(f"the kept snapshot {digest} is damaged: {exc}") from None
        os.utime(path)  # used: the newest again, the last to be pruned
        return snapshot.Snapshot(changes, notes, digest)
