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
