"""The workspace: the agent proposes, a human disposes. Standard library only: the appliance
computes changes, the host CLI applies them (the two sides may be different machines).

At start the project is copied twice, without `.corral/`: `work/` (mounted at /work, the
agent's) and `base/` (never mounted: what the agent started from). `changes()` compares the
two (appliance side, `compare`); `review()`/`render()` show them to a person (`show`);
`carry()` loads what the host needs and `to_json`/`from_json` move it (`wire`); `take()`
snapshots what a diff shows and names it by a digest, so that what is applied is exactly
what was reviewed (`snapshot`); `apply()` writes a changeset into the host project, but
only where the host still holds what the change started from (`write`); `fold()` writes the
applied changes into `base/`, so the next apply carries only what is new.

The agent controls `work/` completely, so nothing read from it is trusted and nothing it
leaves there may break review: whatever bytes, names, sizes, file types, depths or counts it
leaves, `diff` shows them (or says what it does not show, and why) and `apply` writes them or
refuses them by name. Symlinks are compared and applied as links (never followed), a link
pointing out of the project is refused, and no write goes through a symlink.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .compare import carry, changes, selected
from .model import (
    EXCLUDED,
    LIMITS,
    MAX_CARRIED,
    MAX_DEPTH,
    MAX_FILE,
    Change,
    Changeset,
    Entry,
    Limits,
    Note,
    is_utf8,
    shown,
    terminal_safe,
)
from .show import render, review
from .snapshot import DIGEST, Snapshot, take, verify
from .wire import (
    FORMAT,
    from_json,
    named,
    note_from,
    note_json,
    path_from,
    to_json,
    unnamed,
    wire_path,
)
from .write import Applied, Conflict, Refusal, apply, fold, remove_tree

__all__ = [
    "DIGEST",
    "EXCLUDED",
    "FORMAT",
    "LIMITS",
    "MAX_CARRIED",
    "MAX_DEPTH",
    "MAX_FILE",
    "Applied",
    "Change",
    "Changeset",
    "Conflict",
    "Entry",
    "Limits",
    "Note",
    "Refusal",
    "Snapshot",
    "apply",
    "carry",
    "changes",
    "changes_answer",
    "copy_in",
    "diff_answer",
    "fold",
    "from_json",
    "is_utf8",
    "named",
    "note_from",
    "note_json",
    "path_from",
    "remove_tree",
    "render",
    "review",
    "selected",
    "shown",
    "take",
    "terminal_safe",
    "to_json",
    "unnamed",
    "verify",
    "wire_path",
]


def diff_answer(taken: Snapshot, base: Path | None = None) -> dict:
    """The sandbox service's `diff` answer: the digest naming the snapshot, the text a person
    reads (rendered from the snapshot's bytes; `base` for the sides before), the changes
    listed without contents, the notes (see `named`/`unnamed` to check what it names)."""
    text, shown_changes = review(Changeset(taken.changes, taken.notes, base=base))
    return {"digest": taken.digest, "diff": text,
            "notes": [note_json(n) for n in taken.notes], "changes": [
                {**wire_path(s.change.path), "action": s.change.action, "binary": s.binary,
                 **({"note": s.change.note} if s.change.note else {})}
                for s in shown_changes]}


def changes_answer(taken: Snapshot) -> dict:
    """The sandbox service's `changes` answer: a snapshot whole, with its contents (the host
    picks the paths it applies, and checks the digest of all of it first)."""
    return {"format": FORMAT, "digest": taken.digest,
            "notes": [note_json(n) for n in taken.notes],
            "changes": [to_json(c) for c in taken.changes]}


def copy_in(project: Path, work: Path, base: Path) -> None:
    """The project into `work/` and `base/`, without `.corral/`; symlinks stay symlinks."""
    def ignore(directory, names):
        return [n for n in names if n in EXCLUDED] if Path(directory) == project else []

    for target in (base, work):
        shutil.copytree(project, target, symlinks=True, ignore=ignore)
