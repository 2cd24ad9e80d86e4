"""The digest that names a reviewed changeset (appliance/workspace/snapshot.py): the same
changeset always gives the same digest, any change to what apply writes or checks gives
another, and the diff a person reads is rendered from the snapshot's bytes, not from what
the agent writes afterwards."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.workspace import (
    Change,
    Entry,
    Note,
    changes,
    copy_in,
    diff_answer,
    from_json,
    take,
    to_json,
    verify,
)
from appliance.workspace.snapshot import canonical, digest


def _file(data: bytes, executable: bool = False) -> Entry:
    import hashlib

    return Entry("file", data, executable, len(data), hashlib.sha256(data).hexdigest())


BASE = [
    Change("a.txt", "modified", _file(b"old\n"), _file(b"new\n")),
    Change("bin/run", "added", None, _file(b"#!/bin/sh\n", True)),
    Change("gone.txt", "removed", _file(b"bye\n"), None),
    Change("link", "added", None, Entry("link", b"a.txt")),
    Change("pipe", "added", None, Entry("other", note="not a regular file: fifo")),
]
NOTES = [Note("deep", "deeper than 128 levels: not read, not shown or carried")]


def _replace(index: int, **fields) -> list[Change]:
    out = list(BASE)
    out[index] = dataclasses.replace(out[index], **fields)
    return out


MUTATIONS = {
    "one content byte": (_replace(0, after=_file(b"new!\n")), NOTES),
    "the executable bit": (_replace(1, after=_file(b"#!/bin/sh\n", False)), NOTES),
    "a link's target": (_replace(3, after=Entry("link", b"bin/run")), NOTES),
    "a path": (_replace(0, path="b.txt"), NOTES),
    "a name's bytes (not how it is shown)": (_replace(0, path=os.fsdecode(b"a\xff.txt")),
                                            NOTES),
    "a deletion dropped": (BASE[:2] + BASE[3:], NOTES),
    "a change added": ([*BASE, Change("z", "added", None, _file(b""))], NOTES),
    "the side it started from": (_replace(0, before=_file(b"older\n")), NOTES),
    "a file for a link": (_replace(3, after=_file(b"a.txt")), NOTES),
    "a note's text": (_replace(4, after=Entry("other", note="not a regular file: socket")),
                      NOTES),
    "a note added": (BASE, [*NOTES, Note("x", "empty directory: not carried")]),
    "a note dropped": (BASE, []),
    "the order": (BASE[::-1], NOTES),
}


def test_the_same_changeset_gives_the_same_digest():
    copy = [dataclasses.replace(c) for c in BASE]
    assert digest(BASE, NOTES) == digest(copy, list(NOTES))
    back = [from_json(json.loads(json.dumps(to_json(c)))) for c in BASE]  # over the wire
    assert digest(back, NOTES) == digest(BASE, NOTES)


@pytest.mark.parametrize("what", sorted(MUTATIONS))
def test_any_change_to_the_changeset_changes_its_digest(what):
    changed, notes = MUTATIONS[what]
    assert digest(changed, notes) != digest(BASE, NOTES)
    with pytest.raises(ValueError, match="has digest"):
        verify(changed, notes, digest(BASE, NOTES))


def test_a_files_digest_is_of_the_bytes_carried_not_of_what_the_entry_claims():
    """An entry whose bytes differ from its recorded digest is named by its bytes: what
    would be written is what is hashed."""
    lying = dataclasses.replace(BASE[0], after=dataclasses.replace(_file(b"new\n"),
                                                                   data=b"evil\n"))
    assert digest([lying, *BASE[1:]], NOTES) != digest(BASE, NOTES)


names = st.text(st.sampled_from("ab/\udcff\n"), min_size=1, max_size=6)
contents = st.binary(max_size=8)


@given(st.lists(st.tuples(names, contents, st.booleans()), min_size=1, max_size=5,
                unique_by=lambda t: t[0]),
       st.integers(0, 4), st.sampled_from(["content", "mode", "path", "drop"]))
def test_one_field_changed_anywhere_gives_another_digest(files, pick, field):
    listed = [Change(p, "added", None, _file(d, x)) for p, d, x in files]
    index = pick % len(listed)
    change = listed[index]
    if field == "content":
        mutated = dataclasses.replace(change, after=_file(change.after.data + b"\0",
                                                          change.after.executable))
    elif field == "mode":
        mutated = dataclasses.replace(change, after=_file(change.after.data,
                                                          not change.after.executable))
    elif field == "path":
        mutated = dataclasses.replace(change, path=change.path + "x")
    else:
        mutated = None
    other = [c for c in listed if c is not change] if mutated is None else [
        mutated if c is change else c for c in listed]
    assert digest(other, []) != digest(listed, [])
    assert canonical(listed, []) == canonical(list(listed), [])


@pytest.fixture
def session(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "app.py").write_text("print('v1')\n")
    work, base = tmp_path / "work", tmp_path / "base"
    copy_in(project, work, base)
    return work, base


def test_the_diff_shows_the_snapshots_bytes_not_what_the_agent_wrote_since(session):
    work, base = session
    (work / "app.py").write_text("print('reviewed')\n")
    taken = take(changes(base, work))
    (work / "app.py").write_text("print('written after the diff')\n")
    answer = diff_answer(taken, base)
    assert "+print('reviewed')" in answer["diff"] and "after the diff" not in answer["diff"]
    assert answer["digest"] == taken.digest
    (change,) = taken.changes
    assert change.after.data == b"print('reviewed')\n"
    again = take(changes(base, work))
    assert again.digest != taken.digest  # the new write is a new changeset
    assert take(changes(base, work)).digest == again.digest  # and a stable one
