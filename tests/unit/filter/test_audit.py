"""The audit log: chained lines, durable appends, torn-tail recovery, tamper detection."""

from __future__ import annotations

import json

from appliance.filter.audit import GENESIS, AuditLog, verify


def write(path, events):
    log = AuditLog(path)
    for event in events:
        log.append(event)
    log.close()
    return log


def test_lines_chain_and_verify(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = write(path, [{"name": f"n{i}"} for i in range(5)])
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["seq"] for r in records] == [1, 2, 3, 4, 5]
    assert records[0]["prev"] == GENESIS
    result = verify(path, expect_head=log.head)
    assert result.ok and result.lines == 5


def test_chain_continues_after_reopen(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, [{"n": 1}])
    log = write(path, [{"n": 2}])
    assert log.head["seq"] == 2 and verify(path, log.head).ok


def test_edit_remove_and_reorder_are_each_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, [{"n": i} for i in range(4)])
    original = path.read_bytes().splitlines(keepends=True)
    cases = {
        "edit": [original[0], original[1].replace(b'"n":1', b'"n":9'), *original[2:]],
        "remove": [original[0], *original[2:]],
        "reorder": [original[0], original[2], original[1], original[3]],
    }
    for name, lines in cases.items():
        path.write_bytes(b"".join(lines))
        result = verify(path)
        assert not result.ok, name
        assert result.line in (2, 3), (name, result)


def test_cut_tail_is_detected_against_the_head(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = write(path, [{"n": i} for i in range(3)])
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2]))
    assert verify(path).ok  # a chain alone cannot see a cut at the end ...
    assert not verify(path, expect_head=log.head).ok  # ... the recorded head can


def test_torn_last_line_is_cut_on_open_and_chain_goes_on(tmp_path):
    path = tmp_path / "audit.jsonl"
    write(path, [{"n": 1}, {"n": 2}])
    with open(path, "ab") as f:
        f.write(b'{"seq":3,"prev":"abc')  # a crash mid-write
    assert not verify(path).ok
    log = write(path, [{"n": 3}])
    assert log.head["seq"] == 3 and verify(path, log.head).ok


def test_verify_during_heavy_writing_never_sees_a_false_cut(tmp_path):
    import threading
    import time

    log = AuditLog(tmp_path / "audit.jsonl")
    done = threading.Event()

    def write():
        for i in range(20_000):
            log.append({"n": i})
        done.set()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    verdicts = []
    deadline = time.monotonic() + 120  # a writer that failed or stuck never sets `done`
    while not done.is_set() or len(verdicts) < 20:
        assert writer.is_alive() or done.is_set(), "the writer thread died (see its error)"
        assert time.monotonic() < deadline, "20,000 appends not done after 120s"
        verdicts.append(log.verify())
    writer.join(30)
    assert not writer.is_alive(), "the writer thread did not end"
    log.close()
    broken = [v for v in verdicts if not v.ok]
    assert not broken, broken[0]
    assert verify(tmp_path / "audit.jsonl", log.head).lines == 20_000


class _FillsUp:
    """A file whose next write stores half its bytes and then fails: a disk filling up."""

    def __init__(self, real):
        self.real, self.fail = real, True

    def write(self, data):
        if self.fail:
            self.fail = False
            self.real.write(data[: len(data) // 2])
            self.real.flush()
            raise OSError(28, "No space left on device")
        return self.real.write(data)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_failed_write_is_cut_back_and_the_chain_goes_on(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.append({"n": 1})
    log.close()
    log = AuditLog(path)
    before = log.head
    log._file = _FillsUp(log._file)
    log.append({"n": 2})
    deadline = __import__("time").monotonic() + 5
    while log.failed is None:
        assert __import__("time").monotonic() < deadline
    assert "1 records lost" in log.failed and log.head == before
    assert log.verify().ok  # the half-written record is gone
    log.append({"n": 3})
    log.close()
    result = verify(path, log.head)
    assert result.ok and result.lines == 2


def test_records_chained_onto_a_failed_write_are_lost_with_it_and_the_chain_stays_whole(
        tmp_path):
    import time

    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, window=0.2)  # the three appends below land in one batch
    log._file = _FillsUp(log._file)
    for n in range(3):
        log.append({"n": n})
    deadline = time.monotonic() + 5
    while log.failed is None:
        assert time.monotonic() < deadline
    assert "3 records lost" in log.failed and log.head == {"seq": 0, "hash": GENESIS}
    log.append({"n": 3})
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["seq"], r["n"]) for r in records] == [(1, 3)]
    assert verify(path, log.head).ok
