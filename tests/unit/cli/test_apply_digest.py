"""`corral apply` writes only a changeset a person was shown: with `--digest`, the one the
appliance kept under it, checked again here before anything is written; without it, a diff
shown now and confirmed. The appliance's answers are canned (its side is tested in
tests/unit/sandbox/test_reviews.py and the e2e tier); the host's checks are under test."""

from __future__ import annotations

import hashlib
import io
from argparse import Namespace

import pytest

from appliance import workspace
from cli import exitcodes, sessions
from cli.client import CliError


def _entry(data: bytes) -> workspace.Entry:
    return workspace.Entry("file", data, False, len(data), hashlib.sha256(data).hexdigest())


SHOWN = [workspace.Change("app.py", "added", None, _entry(b"shown\n"))]
DIGEST = workspace.snapshot.digest(SHOWN, [])


class Appliance:
    """Canned answers, by path; records what was asked."""

    def __init__(self, changes=SHOWN, diff_digest=DIGEST):
        self.changes, self.diff_digest, self.asked = changes, diff_digest, []

    def request(self, method, path, body=None, **query):
        self.asked.append((path, query))
        if path.endswith("/diff"):
            return {"diff": "+++ b/app.py\n+shown", "digest": self.diff_digest, "changes": [],
                    "notes": []}
        return {"format": workspace.FORMAT, "digest": query.get("digest"), "notes": [],
                "changes": [workspace.to_json(c) for c in self.changes]}


def _args(**fields):
    return Namespace(**{"name": "s1", "digest": None, "yes": False, "json": False, **fields})


def test_the_host_refuses_a_changeset_that_is_not_the_one_reviewed():
    sneaked = [workspace.Change("app.py", "added", None, _entry(b"written later\n"))]
    with pytest.raises(CliError, match=f"has digest .*, not {DIGEST}") as refused:
        sessions._changes(Appliance(changes=sneaked), "s1", DIGEST)
    assert "nothing applied" in str(refused.value)
    changes, notes = sessions._changes(Appliance(), "s1", DIGEST)
    assert changes == SHOWN and notes == []


def test_a_digest_given_is_asked_for_as_is_and_a_malformed_one_is_refused():
    appliance = Appliance()
    assert sessions._reviewed(appliance, _args(digest=f"sha256:{DIGEST.upper()}")) == DIGEST
    assert appliance.asked == []  # no new diff: the one reviewed is applied
    with pytest.raises(CliError, match="64 hex digits") as refused:
        sessions._reviewed(appliance, _args(digest="abc"))
    assert refused.value.code == exitcodes.USAGE


def test_without_a_digest_a_diff_is_shown_and_applied_only_when_confirmed(monkeypatch,
                                                                            capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)
    monkeypatch.setattr(sessions, "drop_typeahead", lambda: None)
    assert sessions._reviewed(Appliance(), _args()) == DIGEST
    out = capsys.readouterr()
    assert "+shown" in out.out and f"digest {DIGEST}" in out.out and "[y/N]" in out.err
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)
    with pytest.raises(CliError, match="nothing applied") as declined:
        sessions._reviewed(Appliance(), _args())
    assert DIGEST in declined.value.hint


def test_without_a_digest_or_a_terminal_nothing_is_applied(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))  # a pipe: no one to ask
    with pytest.raises(CliError, match="no terminal to ask on") as refused:
        sessions._reviewed(Appliance(), _args())
    assert refused.value.code == exitcodes.USAGE and f"--digest {DIGEST}" in refused.value.hint
    assert sessions._reviewed(Appliance(), _args(yes=True)) == DIGEST
    with pytest.raises(CliError, match="with --json, apply needs --digest"):
        sessions._reviewed(Appliance(), _args(json=True))


def test_a_diff_without_a_digest_is_an_appliance_this_corral_cannot_trust():
    with pytest.raises(CliError, match="without the digest"):
        sessions._reviewed(Appliance(diff_digest=None), _args(yes=True))
