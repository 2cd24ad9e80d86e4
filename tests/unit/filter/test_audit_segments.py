"""The audit log in segments: rotation at the threshold, the chain across files, retention,
tampering at segment boundaries, crashes in the middle of a rotation, paging."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from appliance.filter.audit import GENESIS, AuditLog, page, segment_path, segments, verify

SEGMENT = 1000
"""Bytes per segment in these tests: about ten records of {"n": i}."""


def wait_for(predicate, what: str, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def write(log: AuditLog, events) -> None:
    """Append each event and wait until it is on disk: one record per batch, so each
    rotation happens exactly where the sizes say."""
    for event in events:
        log.append(event)
        seq = log._tail[0]
        wait_for(lambda seq=seq: log.head["seq"] == seq, f"seq {seq} never reached the disk")


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def seqs(active: Path) -> list[int]:
    return [json.loads(line)["seq"] for s in segments(active) for line in lines(s.path)]


@pytest.fixture
def active(tmp_path) -> Path:
    return tmp_path / "audit.jsonl"


@pytest.fixture
def full(active):
    """A closed log of 60 records in several segments, all kept; its head."""
    log = AuditLog(active, window=0, segment_bytes=SEGMENT, keep=100)
    write(log, [{"n": i} for i in range(60)])
    log.close()
    return log.head


def test_the_active_segment_rotates_before_it_would_pass_the_threshold(active, full):
    files = segments(active)
    assert len(files) >= 5 and files[-1].path == active
    for segment, following in itertools.pairwise(files):
        body = lines(segment.path)
        assert segment.path == segment_path(active, json.loads(body[0])["seq"])
        size = segment.path.stat().st_size
        assert size <= SEGMENT < size + len(lines(following.path)[0])
    assert seqs(active) == list(range(1, 61))


def test_a_batch_larger_than_a_segment_is_split_at_the_threshold(active):
    log = AuditLog(active, window=0.3, segment_bytes=SEGMENT, keep=100)
    for i in range(60):  # all within one commit window: one batch
        log.append({"n": i})
    log.close()
    files = segments(active)
    assert len(files) >= 5
    assert all(s.path.stat().st_size <= SEGMENT for s in files)
    assert seqs(active) == list(range(1, 61)) and verify(active, log.head).ok


def test_the_chain_runs_across_segments(active, full):
    result = verify(active, full)
    assert result.ok and result.lines == 60 and result.first == 1 and result.note == ""
    assert result.segments == len(segments(active)) and result.head == full
    files = segments(active)
    for segment, following in itertools.pairwise(files):
        last = lines(segment.path)[-1][:-1]
        assert json.loads(lines(following.path)[0])["prev"] == hashlib.sha256(last).hexdigest()


def test_retention_keeps_the_newest_segments_and_verify_says_where_the_log_starts(active):
    log = AuditLog(active, window=0, segment_bytes=SEGMENT, keep=3)
    write(log, [{"n": i} for i in range(60)])
    described = log.describe()
    log.close()
    files = segments(active)
    assert len(files) == 3
    assert described["segments"] == 3
    assert described["bytes"] == sum(s.path.stat().st_size for s in files)
    kept = seqs(active)
    assert kept == list(range(kept[0], 61)) and kept[0] > 1
    result = verify(active, log.head)
    assert result.ok and result.first == kept[0] and result.lines == len(kept)
    assert f"checked from seq {kept[0]}" in result.note and "cannot be" in result.note
    assert result.to_json()["note"] == result.note


def _drop_last_line(path: Path) -> None:
    path.write_bytes(b"".join(lines(path)[:-1]))


def _edit_line(path: Path, index: int) -> None:
    body = lines(path)
    body[index] = body[index].replace(b'"n":', b'"n":1')
    path.write_bytes(b"".join(body))


def _swap(a: Path, b: Path) -> None:
    a.rename(a.with_suffix(".tmp"))
    b.rename(a)
    a.with_suffix(".tmp").rename(b)


def _restart_chain(path: Path) -> None:
    body = lines(path)
    record = json.loads(body[0])
    record["prev"] = "f" * 64
    body[0] = json.dumps(record, separators=(",", ":"), sort_keys=True).encode() + b"\n"
    path.write_bytes(b"".join(body))


# (what is done to the files, (file index, line) where the break is reported, words of it);
# a line of -1 is the last line of that file after the change
TAMPERING = {
    "a middle segment removed": (lambda f: f[2].unlink(), (3, 1),
                                 "records 22 to 31 are missing"),
    "two segments swapped": (lambda f: _swap(f[1], f[2]), (1, 1), "renamed or reordered"),
    "the tail of a middle segment cut": (lambda f: _drop_last_line(f[1]), (2, 1),
                                         "record 21 is missing"),
    "the last line of a segment edited": (lambda f: _edit_line(f[1], -1), (2, 1),
                                          "the last line of audit-"),
    "the first line of a segment edited": (lambda f: _edit_line(f[2], 0), (2, 2),
                                           "prev does not match"),
    "a rotated segment emptied": (lambda f: f[1].write_bytes(b""), (1, None), "is empty"),
    "the tail of the active segment cut": (lambda f: _drop_last_line(f[-1]), (-1, -1),
                                           "ends at seq 59"),
    "the active segment removed": (lambda f: f[-1].unlink(), (-2, -1), "lines were cut"),
    "the very last record edited": (lambda f: _edit_line(f[-1], -1), (-1, -1),
                                    "seq 60 is not the one the filter wrote"),
    "the first segment's link to genesis": (lambda f: _restart_chain(f[0]), (0, 1), "genesis"),
}


@pytest.mark.parametrize("case", TAMPERING)
def test_tampering_across_segments_is_named_by_file_and_line(active, full, case):
    tamper, (index, line), words = TAMPERING[case]
    files = [s.path for s in segments(active)]
    tamper(files)
    result = verify(active, full)
    assert not result.ok, case
    assert words in result.error, result
    name = files[index].name
    assert result.segment == name, result
    expected = len(lines(files[index])) if line == -1 else line
    assert result.line == expected, result


def test_a_cut_at_the_very_end_needs_the_head(active, full):
    _drop_last_line(segments(active)[-1].path)
    assert verify(active).ok  # a chain alone cannot see it ...
    assert not verify(active, full).ok  # ... the filter's head can


# -- crashes ---------------------------------------------------------------------------------

STEPS = ["renamed", "rename durable", "created", "retained"]


@pytest.mark.parametrize("stop_after", STEPS)
def test_a_crash_between_rotation_steps_leaves_a_chain_that_recovers(active, stop_after):
    log = AuditLog(active, window=0, segment_bytes=SEGMENT, keep=3)
    write(log, [{"n": i} for i in range(25)])
    head = log.head
    steps = log._rotation(head["seq"] + 1)  # the writer is idle: nothing is queued
    assert next(step for step in steps if step == stop_after)
    log.close()  # every record was fsynced: stopping here is what a crash leaves on disk

    again = AuditLog(active, window=0, segment_bytes=SEGMENT, keep=3)
    assert again.head == head  # not one record lost
    write(again, [{"n": i} for i in range(25, 50)])
    again.close()
    kept = seqs(active)
    assert kept == list(range(kept[0], 51))  # none lost, none twice
    result = verify(active, again.head)
    assert result.ok, result
    assert [json.loads(line)["n"] for s in segments(active) for line in lines(s.path)] == (
        list(range(kept[0] - 1, 50)))


def test_a_rotation_cut_short_is_finished_before_the_next_batch(active):
    log = AuditLog(active, window=0, segment_bytes=SEGMENT, keep=100)
    write(log, [{"n": i} for i in range(5)])
    steps = log._rotation(log.head["seq"] + 1)
    next(steps)  # renamed; then the directory could not be synced, say
    steps.close()
    write(log, [{"n": 5}])  # goes to the new active segment, not the renamed one
    log.close()
    files = segments(active)
    assert [s.first for s in files] == [1, None]
    assert [json.loads(line)["seq"] for line in lines(active)] == [6]
    assert verify(active, log.head).ok


WRITER = """
import sys
from appliance.filter.audit import AuditLog
log = AuditLog(sys.argv[1], window=0.001, segment_bytes=2000, keep=4)
print(log.head["seq"], flush=True)
n = 0
while True:
    log.append({"n": n, "pad": "x" * (n % 50)})
    n += 1
"""


def test_kill_9_at_any_moment_leaves_a_chain_that_recovers(active):
    """A writer rotating every few records, killed at random moments: each time, start-up
    continues the chain and verify finds it whole."""
    import random

    rng = random.Random(1413)
    for _ in range(8):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(active)],
                                  stdout=subprocess.PIPE, cwd=Path(__file__).parents[3])
        if not select.select([writer.stdout], [], [], 30)[0]:  # opening the log hung
            writer.kill()
            raise AssertionError("the writer printed no head within 30s of starting")
        started = int(writer.stdout.readline())
        def newest() -> int:
            return max((s.first for s in segments(active) if s.first is not None), default=0)

        # a segment this writer began (its first record comes after the writer's start):
        # recovering from the last kill may finish an older rotation, which is not one
        before = max(newest(), started)
        wait_for(lambda before=before: newest() > before, "the writer never rotated", 60)
        time.sleep(rng.uniform(0, 0.2))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
        log = AuditLog(active, window=0)
        head = log.head
        log.close()
        assert head["seq"] > started, "the writer wrote nothing before it was killed"
        result = verify(active, head)
        assert result.ok, result
        kept = seqs(active)
        assert kept == list(range(kept[0], head["seq"] + 1))


# -- readers ---------------------------------------------------------------------------------


def test_every_page_across_segments_holds_exactly_the_records_after_it(active, full):
    for after in range(0, 61):
        records, more = page(active, after=after, limit=7)
        assert [r["seq"] for r in records] == list(range(after + 1, min(after + 7, 60) + 1))
        assert more == (after + 7 < 60), after


def test_since_finds_the_first_record_at_or_after_a_time(active):
    log = AuditLog(active, window=0, segment_bytes=SEGMENT, keep=100)
    write(log, [{"n": i, "ts": 1000.0 + i} for i in range(60)])
    log.close()
    for since in (0, 1000, 1000.5, 1013, 1059, 1060):
        records, _ = page(active, since=since, limit=100)
        assert [r["n"] for r in records] == [n for n in range(60) if 1000 + n >= since], since
    records, more = page(active, after=30, since=1010, limit=5)
    assert [r["seq"] for r in records] == [31, 32, 33, 34, 35] and more


def test_paging_after_retention_starts_at_the_first_record_kept(active):
    log = AuditLog(active, window=0, segment_bytes=SEGMENT, keep=3)
    write(log, [{"n": i} for i in range(60)])
    log.close()
    first = seqs(active)[0]
    collected, after = [], 0
    while True:
        records, more = page(active, after=after, limit=4)
        collected += [r["seq"] for r in records]
        if not more:
            break
        assert records[-1]["seq"] > after, records  # a page that never moves on: no end
        after = records[-1]["seq"]
    assert collected == list(range(first, 61))


def _bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_a_recent_page_reads_a_few_blocks_not_the_log(active):
    log = AuditLog(active, segment_bytes=4 << 20, keep=100)
    pad = "x" * 300
    for i in range(60_000):
        log.append({"n": i, "ts": 1_000_000.0 + i, "pad": pad})
    log.close()
    size = sum(s.path.stat().st_size for s in segments(active))
    assert size > 20 << 20 and len(segments(active)) >= 5

    before = _bytes_read()
    records, more = page(active, after=59_990, limit=100)
    recent = _bytes_read() - before
    assert [r["seq"] for r in records] == list(range(59_991, 60_001)) and not more
    before = _bytes_read()
    records, _ = page(active, since=1_000_000.0 + 59_000, limit=5)
    by_time = _bytes_read() - before
    assert [r["n"] for r in records] == [59_000, 59_001, 59_002, 59_003, 59_004]
    before = _bytes_read()
    assert verify(active).ok
    whole = _bytes_read() - before
    assert whole >= size  # what reading everything costs, measured the same way
    assert recent < 512 << 10 and by_time < 512 << 10, (recent, by_time, whole)


class _Stalls:
    """A file whose next write stores half its bytes and then waits for `go`: a writer
    stuck in the middle of a batch (a slow disk)."""

    def __init__(self, real):
        self.real, self.stuck, self.go = real, threading.Event(), threading.Event()

    def write(self, data):
        if not self.go.is_set():
            self.real.write(data[: len(data) // 2])
            self.real.flush()
            self.stuck.set()
            self.go.wait()
            return self.real.write(data[len(data) // 2:])
        return self.real.write(data)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_head_status_and_verify_do_not_wait_for_a_writer_stuck_mid_batch(active):
    log = AuditLog(active, window=0)
    write(log, [{"n": 0}])
    before = log.head
    log._file = _Stalls(log._file)
    log.append({"n": 1})
    assert log._file.stuck.wait(10)
    answers = []
    reader = threading.Thread(target=lambda: answers.extend(
        [log.head, log.describe(), log.verify()]), daemon=True)
    reader.start()
    reader.join(10)  # a reader that took the writer's lock would still be waiting
    stuck_with_answers = not reader.is_alive()
    log._file.go.set()
    reader.join(30)  # the writer is free again: a reader still waiting is deadlocked
    assert not reader.is_alive(), "head, describe or verify still waiting 30s after the write"
    log.close()
    assert stuck_with_answers
    head, described, verdict = answers
    assert head == before and described["head"] == before
    assert verdict.ok and verdict.head == before  # the half-written line is past the head
    assert verify(active, log.head).ok and log.head["seq"] == 2


def test_recovery_continues_from_the_newest_segment_when_the_active_one_is_gone(active, full):
    files = segments(active)
    active.unlink()  # as if a crash came right after a rename (and the active was lost)
    log = AuditLog(active, window=0, segment_bytes=SEGMENT, keep=100)
    last = lines(files[-2].path)[-1][:-1]
    assert log.head == {"seq": json.loads(last)["seq"],
                        "hash": hashlib.sha256(last).hexdigest()}
    write(log, [{"n": "after"}])
    log.close()
    assert json.loads(lines(active)[0])["seq"] == log.head["seq"]
    assert verify(active, log.head).ok


def test_a_fresh_log_starts_at_genesis(active):
    log = AuditLog(active, window=0)
    write(log, [{"n": 0}])
    log.close()
    assert json.loads(lines(active)[0])["prev"] == GENESIS
    assert os.stat(active).st_mode & 0o777 == 0o600


def test_rule_changes_are_recorded_whatever_the_sessions_audit_budget(tmp_path):
    """A session that spent its budget cannot keep the operator's rule changes for it out of
    the log: kind `rule` is never charged to it."""
    from appliance.event import Event
    from appliance.filter.audit.reader import page
    from appliance.filter.events import EventBus

    bus = EventBus(audit_rate=0.001, audit_burst=1)
    bus.audit = AuditLog(tmp_path / "audit.jsonl")
    for n in range(3):
        bus.emit(Event(session="s1", kind="dns", verdict="deny", name=f"d{n}.test",
                       reason="denied"))
    bus.emit(Event(session="s1", kind="rule", verdict="change", action="expired",
                   rule="x.test", reason="expired"))
    bus.audit.close()
    records, _ = page(tmp_path / "audit.jsonl", limit=100)
    assert [r["kind"] for r in records] == ["dns", "rule"]  # the 2 held dns are summarised
