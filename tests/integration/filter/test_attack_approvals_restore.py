"""Attacks on approvals that outlive a restart of the filter (approvals.json: the book's
snapshot/restore, appliance/filter/approvals_file.py): a session of the same name made later
does not inherit another agent's approvals; what a person decided is not brought back by a
crash, a grant that ended while the filter was down or a full disk; a damaged file does not
keep the filter from starting; what agents write round-trips. Run in a private network
namespace; the full-disk test mounts a 2 MiB tmpfs as the filter's state directory (root, as
the tier runs in CI; it unmounts it whatever happens).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.integration.conftest import FilterProcess
from tests.integration.filter.test_approvals import (  # noqa: F401  (the fixture)
    agent_asks,
    asking,
    decide,
    open_approvals,
)
from tests.integration.filter.test_dns import ask

S3 = '\n[[session]]\nname = "s3"\nsubnet = "{subnet}"\nfiles = []\n'


def crash(f: FilterProcess) -> None:
    """What a power cut, the OOM killer or a segfault in a C extension does."""
    f.proc.kill()
    f.proc.wait()


def saved(f: FilterProcess) -> list[dict]:
    path = f.dir / "state" / "approvals.json"
    return json.loads(path.read_text())["approvals"] if path.exists() else []


def written(f: FilterProcess, timeout: float = 5, **match) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(all(a.get(k) == v for k, v in match.items()) for a in saved(f)):
                return
        except (ValueError, OSError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"never written: {match}")


# -- a session of the same name is not the same agent ------------------------------------------


def test_a_static_session_removed_then_recreated_does_not_inherit_the_old_agents_approval(
        internet, tmp_path):
    """s3 asks for other.test:8080 ("urgent: the build"); the operator removes s3 from the
    config and restarts (its approval is not restored, but the file is not rewritten either:
    restore() bumps the version and _approvals_saved takes it); later a new s3 (another
    subnet, another agent) is configured: the old agent's approval shows up as the new s3's,
    with the old agent's reason, and a grant would go to the new agent."""
    f = FilterProcess(tmp_path, internet.dns.address,
                      extra_config=S3.format(subnet="127.0.5.0/24"))
    try:
        assert f.control({"op": "add", "session": "s3", "kind": "approval",
                          "rule": "ask 20"})["added"]
        status, old = agent_asks(f, "host=other.test:8080&reason=urgent:+the+build",
                                 source="127.0.5.7")
        assert status == 202, old
        f.stop()
        config = f.config.read_text()
        f.config.write_text(config.replace(S3.format(subnet="127.0.5.0/24"), ""))
        f.start()
        assert open_approvals(f) == []  # s3 is gone: nothing restored...
        f.stop()
        stale = [a["id"] for a in saved(f)]
        # a new session named s3: another sandbox (other subnet), another agent
        f.config.write_text(config.replace("127.0.5.0/24", "127.0.6.0/24"))
        f.start()
        resurrected = open_approvals(f, id=old["id"])
        assert resurrected == [], (
            f"the removed s3's approval {old['id']} (stale ids in the file: {stale}) is open "
            f"again, for the new s3: {resurrected}")
    finally:
        f.stop()


def test_a_registered_session_removed_just_before_a_crash_does_not_hand_its_approval_to_a_new_one(
        internet, tmp_path):
    """session-remove drops s3's approvals in memory; the file catches up within a second.
    A crash in that second, then a new s3 (the manager reuses names a person picks), then a
    clean restart: the old agent's approval is restored for the new s3."""
    f = FilterProcess(tmp_path, internet.dns.address)
    try:
        assert f.control({"op": "session-add", "name": "s3", "subnet": "127.0.5.0/24"})["ok"]
        f.control({"op": "add", "session": "s3", "kind": "approval", "rule": "ask 20"})
        status, old = agent_asks(f, "host=other.test:8080&reason=old+agent",
                                 source="127.0.5.7")
        assert status == 202, old
        written(f, id=old["id"])
        assert f.control({"op": "session-remove", "name": "s3", "forget_rules": True})["ok"]
        crash(f)
        f.start()
        assert f.control({"op": "session-add", "name": "s3", "subnet": "127.0.9.0/24"})["ok"]
        f.control({"op": "add", "session": "s3", "kind": "approval", "rule": "ask 20"})
        f.restart()  # nothing changed in the book since the start: the stale file stays
        back = open_approvals(f, id=old["id"])
        assert back == [], f"the old s3's approval is the new s3's: {back}"
    finally:
        f.stop()


# -- a decision is not undone by a restart ---------------------------------------------------


def test_a_refusal_is_not_undone_by_a_crash_in_the_next_second(asking):  # noqa: F811
    f = asking
    status, answer = agent_asks(f, "host=other.test:8080&reason=x")
    assert status == 202
    written(f, id=answer["id"])
    assert decide(f, {"id": answer["id"]}, "refuse")["ok"]
    crash(f)
    f.start()
    back = open_approvals(f, id=answer["id"])
    assert back == [], f"refused, and open again after the restart: {back}"


def test_a_grant_for_a_while_that_ended_while_the_filter_was_down_is_not_asked_again(asking):  # noqa: F811
    """Granted `for` 1 s, crash in the next second (the file still has it open), down for
    2 s: the grant's rule has ended, so settle() finds the target approvable again and the
    approval a person already decided is open again, under its old id."""
    f = asking
    _status, answer = agent_asks(f, "host=other.test:8080&reason=x")
    written(f, id=answer["id"])
    assert decide(f, {"id": answer["id"]}, "for", duration=1)["ok"]
    crash(f)
    time.sleep(2)
    f.start()
    back = open_approvals(f, id=answer["id"])
    assert back == [], f"decided, and open again after the restart: {back}"


# -- a bad file costs the filter nothing -----------------------------------------------------


GOOD = {"id": "ap-0000abcd", "session": "s1", "kind": "http", "target": "other.test:8080",
        "why": "x", "origin": "agent", "note": "n", "created": 1.0, "asked": 1,
        "waiting": 0}


@pytest.mark.parametrize("text", [
    # json reads 1e999 as inf: int(inf) is an OverflowError, not a ValueError
    json.dumps({"version": 1, "approvals": [{**GOOD, "last": "LAST", "asked": "INF"}]})
    .replace('"INF"', "1e999"),
    # 100000 nested lists: RecursionError
    '{"version": 1, "approvals": ' + "[" * 100_000 + "]" * 100_000 + "}",
], ids=["asked-inf", "deep-nesting"])
def test_a_bad_approvals_file_does_not_keep_the_filter_from_starting(asking, text):  # noqa: F811
    f = asking
    f.stop()
    path = f.dir / "state" / "approvals.json"
    path.write_text(text.replace('"LAST"', str(time.time())))
    try:
        f.start()
    except RuntimeError as exc:
        pytest.fail(f"the filter does not start: {str(exc)[-600:]}")
    assert open_approvals(f) == []


def test_what_agents_write_round_trips_and_a_restart_loses_none_of_it(asking):  # noqa: F811
    """Held: reasons with quotes, backslashes, JSON and terminal escapes, non-ASCII, 2 KiB;
    IDN and odd but valid names; dns, tcp and http kinds."""
    f = asking
    asks = [
        "host=other.test:8080&reason=%22%7D%5D%2C%22version%22%3A2%7D%5C%5Cu0000",
        "host=b%C3%BCcher.example&reason=%E2%80%AE%F0%9F%92%A3%1b%5D0%3Bpwn%07",
        "host=_srv.under_score.test&kind=dns&reason=" + "A" * 2000,
        "host=UPPER.Example.:22&kind=tcp&reason=x",
        "host=xn--bcher-kva.test:65535&reason=%0d%0aSet-Cookie:+x",
    ]
    for query in asks:
        status, answer = agent_asks(f, query)
        assert status == 202, (query, answer)
    before = sorted(open_approvals(f), key=lambda a: a["id"])
    assert len(before) == len(asks)
    f.restart()
    after = sorted(open_approvals(f), key=lambda a: a["id"])
    assert after == before


# -- a failing disk ------------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it mounts a tmpfs as the filter's "
                    "state directory (run scripts/test as root)")
def test_a_full_disk_neither_stops_the_filter_nor_brings_a_refused_approval_back(
        internet, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(state)], check=True)
    f = None
    try:
        f = FilterProcess(tmp_path, internet.dns.address)
        f.control({"op": "add", "session": "s1", "kind": "approval", "rule": "ask 20"})
        _status, answer = agent_asks(f, "host=other.test:8080&reason=x")
        written(f, id=answer["id"])
        subprocess.run(["dd", "if=/dev/zero", f"of={state}/filler", "bs=64k"],
                       capture_output=True)  # ENOSPC from here on
        assert decide(f, {"id": answer["id"]}, "refuse")["ok"]
        for i in range(4):  # the filter goes on serving while it cannot write (burst 5)
            assert agent_asks(f, f"host=n{i}.flood.test&reason=x")[0] == 202
        time.sleep(2.5)
        assert f.proc.poll() is None
        errors = f.log.read_text().count("approvals: cannot write")
        assert 1 <= errors <= 4, errors  # once per change, not once per tick
        f.stop()
        (state / "filler").unlink()
        f.start()
        back = open_approvals(f, id=answer["id"])
        assert back == [], f"refused while the disk was full, open again: {back}"
    finally:
        if f is not None:
            f.stop()
        subprocess.run(["umount", "-l", str(state)], check=False)


def test_the_saved_file_is_private_and_no_temporary_is_left(asking):  # noqa: F811
    f = asking
    for i in range(40):  # DNS opens approvals without request.corral's rate limit; 32 kept
        ask(f.dns_port, f"n{i}.many.test")
    time.sleep(1.2)
    f.stop()
    state = f.dir / "state"
    assert (state / "approvals.json").stat().st_mode & 0o777 == 0o600
    assert not [p.name for p in state.iterdir() if p.name.startswith(".approvals.json.")]
    assert len(saved(f)) == 32
    f.start()
    assert len(open_approvals(f)) == 32
