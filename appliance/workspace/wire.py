"""Changesets as JSON, format 2 (the appliance and the CLI ship together; format 1 carried
every file's contents twice and names as plain strings).

  change  {"path": P, "path_bytes": B64?, "action": "added|modified|removed",
           "before": ENTRY|null, "after": ENTRY|null}
  entry   {"kind": "file|link|other", "executable": BOOL, "size": N, "digest": SHA256|"",
           "note": TEXT?, "data": B64?}

A name that is not UTF-8 travels as its bytes (`path_bytes`), with `path` its escaped form
for people; every string in the JSON is then valid Unicode. A file's `data` is present on
the `after` side of what is carried, and must match `size` and `digest`; `before` carries
the digest only (the host hashes its own file). A link's `data` is its target.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re

from .model import (
    EXCLUDED,
    KINDS,
    MAX_DEPTH,
    MAX_LINK,
    MAX_NAME,
    Change,
    Entry,
    Note,
    is_utf8,
    shown,
)

FORMAT = 2
ACTIONS = ("added", "modified", "removed")
_DIGEST = re.compile(r"[0-9a-f]{64}")


def wire_path(path: str) -> dict:
    if is_utf8(path):
        return {"path": path}
    return {"path": shown(path), "path_bytes": base64.b64encode(os.fsencode(path)).decode()}


def safe_path(relative: str) -> str:
    """Why a changeset path (it may come over the network) is not a plain relative path
    inside the project; empty when it is."""
    if not relative or relative.startswith("/"):
        return "not a relative path inside the project"
    parts = relative.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\x00" in relative:
        return "not a relative path inside the project"
    if parts[0] in EXCLUDED:
        return f"inside {parts[0]}/, which is never carried"
    if len(parts) > MAX_DEPTH + 1:
        return f"deeper than {MAX_DEPTH} levels"
    if any(len(os.fsencode(p)) > MAX_NAME for p in parts):
        return f"a name longer than {MAX_NAME} bytes"
    return ""


GIT_CONTROL = ("config", "config.worktree", "commondir", "gitdir")
"""Files of a git directory that say what git runs (a config's core.fsmonitor, hooksPath,
sshCommand, pager, aliases, filter drivers) or which directory it takes as the repository."""


def git_runs(relative: str) -> str:
    """Why writing this path on the host would have git run what the agent wrote there
    (empty when it would not): anything under a `hooks` directory, or a control file
    (GIT_CONTROL), inside any git directory in the project (its own `.git`, a submodule's
    under `.git/modules/`, a nested repository's), or a `.git` that is no directory (a
    `gitdir:` pointing git at a directory the agent filled). The person's next `git status`
    (which a shell prompt runs by itself), commit or checkout would run it, outside any
    session. A ref so named (a branch `config`) is refused too: a submodule may be named
    `refs`, so no part of a git directory is taken for data by its name."""
    parts = relative.split("/")
    if parts[-1] == ".git":
        return ("a .git that is not a directory (it points git at another directory): git "
                "would run what that one says, on this host; never applied, copy it by hand "
                "if you mean it")
    if ".git" in parts[:-1]:
        inside = parts[parts.index(".git") + 1:]
        if "hooks" in inside[:-1] or inside[-1] in GIT_CONTROL:
            return ("a git hook or config: git would run what it names, on this host; never "
                    "applied, copy it by hand if you mean it")
    return ""


def _b64(text: object, where: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"{where}: must be base64 text")
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        raise ValueError(f"{where}: not base64") from None


def path_from(data: dict, where: str = "a change") -> str:
    if "path_bytes" in data:
        raw = _b64(data["path_bytes"], f"{where}: path_bytes")
        if b"\0" in raw:
            raise ValueError(f"{where}: a path cannot hold NUL")
        path = os.fsdecode(raw)
    elif isinstance(data.get("path"), str):
        path = data["path"]
    else:
        raise ValueError(f"{where} is an object with a string 'path'")
    problem = safe_path(path)
    if problem:
        raise ValueError(f"{path!r}: {problem}")
    return path


def _entry_json(entry: Entry | None, data: bool) -> dict | None:
    if entry is None:
        return None
    out: dict = {"kind": entry.kind, "executable": entry.executable, "size": entry.size,
                 "digest": entry.digest}
    if entry.note:
        out["note"] = entry.note
    if entry.data is not None and (data or entry.kind == "link"):
        out["data"] = base64.b64encode(entry.data).decode()
    return out


def _entry(value: object, where: str) -> Entry | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: an entry is an object")
    kind, executable, size = value.get("kind"), value.get("executable"), value.get("size")
    digest, note = value.get("digest", ""), value.get("note", "")
    if kind not in KINDS:
        raise ValueError(f"{where}: kind must be one of {', '.join(KINDS)}")
    if not isinstance(executable, bool):
        raise ValueError(f"{where}: executable must be true or false")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"{where}: size must be a whole number of bytes")
    if not isinstance(digest, str) or (digest and not _DIGEST.fullmatch(digest)):
        raise ValueError(f"{where}: digest must be sha256 in hex, or empty")
    if not isinstance(note, str):
        raise ValueError(f"{where}: note must be text")
    raw = _b64(value["data"], f"{where}: data") if "data" in value else None
    if kind == "link" and not note and (not raw or b"\0" in raw or len(raw) > MAX_LINK):
        raise ValueError(f"{where}: a link's data is its target: 1-{MAX_LINK} bytes, "
                         "no NUL")
    if kind == "file" and raw is not None and (
            len(raw) != size or hashlib.sha256(raw).hexdigest() != digest):
        raise ValueError(f"{where}: the data does not match its size and digest")
    if kind == "other" and not note:
        raise ValueError(f"{where}: an entry of kind other must say why (note)")
    return Entry(kind, raw, executable, size, digest, note)


def to_json(change: Change, data: bool = True) -> dict:
    """`data=False`: file contents left out (the `diff` listing)."""
    return {**wire_path(change.path), "action": change.action,
            "before": _entry_json(change.before, False),
            "after": _entry_json(change.after, data)}


def from_json(value: object) -> Change:
    """A change as `to_json` wrote it; ValueError naming the path and field otherwise."""
    if not isinstance(value, dict):
        raise ValueError("a change is an object with a string 'path'")
    path = path_from(value)
    where = shown(path)
    action = value.get("action")
    if action not in ACTIONS:
        raise ValueError(f"{where}: action must be added, modified or removed")
    before = _entry(value.get("before"), f"{where}: before")
    after = _entry(value.get("after"), f"{where}: after")
    if (before is None) != (action == "added") or (after is None) != (action == "removed"):
        raise ValueError(f"{where}: '{action}' needs "
                         + {"added": "after only", "removed": "before only",
                            "modified": "before and after"}[action])
    return Change(path, action, before, after)


def note_json(note: Note) -> dict:
    return {**wire_path(note.path), "text": note.text}


def note_from(value: object) -> Note:
    """A note as `note_json` wrote it. Its path is only ever shown, never written, so it
    is not held to `safe_path`: a note may name `.`, or a `.corral/` the agent made."""
    if not isinstance(value, dict) or not isinstance(value.get("text"), str):
        raise ValueError("a note is an object with a string 'text'")
    if "path_bytes" in value:
        return Note(os.fsdecode(_b64(value["path_bytes"], "a note: path_bytes")), value["text"])
    if not isinstance(value.get("path"), str):
        raise ValueError("a note is an object with a string 'path'")
    return Note(value["path"], value["text"])


def named(answer: dict) -> list[str]:
    """Every path a `diff` answer names, as changed or in a note, as the walk saw it (a name
    that is not UTF-8 back to its surrogates)."""
    out = []
    for item in [*(answer.get("changes") or []), *(answer.get("notes") or [])]:
        if not isinstance(item, dict):
            continue
        try:
            out.append(os.fsdecode(_b64(item["path_bytes"], "path_bytes"))
                       if "path_bytes" in item else str(item["path"]))
        except (KeyError, ValueError):
            continue
    return out


def unnamed(answer: dict, paths: list[str]) -> list[str]:
    """The paths a `diff` answer neither lists as changed nor covers with a note on them or
    on a directory above them (one too deep, too big or unreadable: what is under it is
    named by it)."""
    names = named(answer)
    exact = set(names)
    above = tuple(n + "/" for n in names)
    if "." in exact:  # the whole workspace could not be read
        return []
    return [p for p in paths if p not in exact and not p.startswith(above)]
