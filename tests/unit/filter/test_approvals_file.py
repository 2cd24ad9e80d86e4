"""approvals.json on a real disk (tmp_path), with the real writer thread: what has closed
never stays in the file, whatever the timing (a decision racing the stop, one after it) or
the failure (a write that fails, and its removal too; an error that is no OSError); what a
restore read back and settled is written at once; a FIFO or a link in its place costs the
approvals, never the filter."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import pytest

from appliance.filter import approvals_file
from appliance.filter.approvals import Approvals
from appliance.filter.approvals_file import ApprovalsFile, Unwritten

SUBNET = {"s1": "10.1.0.0/24"}
identity = SUBNET.get


def on_disk(path: Path) -> list[str] | None:
    if not path.exists():
        return None
    return [a["id"] for a in json.loads(path.read_text())["approvals"]]


def started(path: Path) -> tuple[Approvals, ApprovalsFile]:
    """A book and its file, saving (inside a running loop)."""
    book = Approvals()
    file = ApprovalsFile(path, book, identity)
    file.start()
    return book, file


def opened(book: Approvals, name: str = "a.test"):
    pending, _ = book.ask("s1", "http", f"{name}:443", "not named", "agent")
    return pending


def test_a_decision_after_the_stop_is_written_on_the_loop(tmp_path):
    async def main():
        book, file = started(tmp_path / "a.json")
        first, second = opened(book), opened(book, "b.test")
        await file.save()
        await file.close()
        book.take(first.id, None)  # on a control connection still open since before the stop
        await file.save(strict=True)
        return second.id

    kept = asyncio.run(main())
    assert on_disk(tmp_path / "a.json") == [kept]  # the refused one gone


def test_a_decision_racing_the_last_write_is_not_overwritten_by_it(tmp_path, monkeypatch):
    slow = approvals_file.write_atomic

    def slower(*args, **kwargs):
        time.sleep(0.2)
        slow(*args, **kwargs)

    async def main():
        book, file = started(tmp_path / "a.json")
        first = opened(book)
        await file.save()
        monkeypatch.setattr(approvals_file, "write_atomic", slower)
        book.touched += 1  # something for the last save to write
        closing = asyncio.create_task(file.close())
        await asyncio.sleep(0.05)  # its write is on the writer thread now
        book.take(first.id, None)
        await file.save(strict=True)
        await closing
        return first.id

    refused = asyncio.run(main())
    assert refused not in on_disk(tmp_path / "a.json")


def test_a_write_that_fails_removes_the_file_and_one_that_cannot_says_so(tmp_path,
                                                                         monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    async def main():
        book, file = started(tmp_path / "a.json")
        first, second = opened(book), opened(book, "b.test")
        await file.save()
        monkeypatch.setattr(approvals_file, "write_atomic", read_only)
        book.take(first.id, None)
        await file.save(strict=True)  # the removal worked: nothing stale is left
        assert on_disk(tmp_path / "a.json") is None
        (tmp_path / "a.json").write_text("stale")
        monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: read_only())
        book.take(second.id, None)
        with pytest.raises(Unwritten, match="could not be removed either"):
            await file.save(strict=True)  # a decision waiting on it hears so
        await file.save()  # the periodic save logs it, and goes on
        monkeypatch.undo()
        await file.close()

    asyncio.run(main())


def test_an_error_that_is_no_oserror_leaves_no_stale_file(tmp_path, monkeypatch):
    def broken(snapshot):
        raise MemoryError

    async def main():
        book, file = started(tmp_path / "a.json")
        first = opened(book)
        await file.save()
        monkeypatch.setattr(Approvals, "encode", staticmethod(broken))
        book.take(first.id, None)
        await file.save()
        monkeypatch.undo()
        await file.close()

    asyncio.run(main())
    assert on_disk(tmp_path / "a.json") in (None, [])


def test_what_a_restore_read_back_and_settled_is_written_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(approvals_file, "SAVE_EVERY", 60.0)  # only "at once" can be seen
    book = Approvals()
    first = opened(book)
    (tmp_path / "a.json").write_bytes(Approvals.encode(book.snapshot(identity)))

    async def main():
        again = Approvals()
        file = ApprovalsFile(tmp_path / "a.json", again, identity)
        assert [p.id for p in file.restore(SUBNET)] == [first.id]
        again.drop(again.pending[first.id])  # settled: the policy allows it now
        file.start()
        for _ in range(200):  # up to 10 s: far less than SAVE_EVERY, now a minute
            if on_disk(tmp_path / "a.json") == []:
                break
            await asyncio.sleep(0.05)
        written = on_disk(tmp_path / "a.json")
        await file.close()
        return written

    assert asyncio.run(main()) == []


@pytest.mark.parametrize("kind", ["fifo", "link", "directory"])
def test_something_else_in_its_place_costs_the_approvals_not_the_filter(tmp_path, kind):
    path = tmp_path / "a.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        os.symlink("/dev/zero", path)
    else:
        path.mkdir()
    file = ApprovalsFile(path, Approvals(), identity)
    done = []
    reader = threading.Thread(target=lambda: done.append(file.restore(SUBNET)), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock it before failing
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert done == [[]]
