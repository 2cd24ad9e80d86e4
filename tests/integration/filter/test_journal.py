"""Every event to journald (`[events] journal`, filter/journal.py): the real filter sends
to an AF_UNIX datagram socket the test binds, standing in for journald's own (no systemd
runs on this tier; the VM tier reads the real journal with journalctl). The socket is read
with a reader of the native protocol written apart from the encoder (tests/helpers.py).

Then the edge on its own, on a loop here with real sockets: what journald cannot take (a
missing or refusing socket, a full one) is counted, never waited for; an entry too large
for a datagram goes as a sealed memfd."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from pathlib import Path

import pytest

from appliance.event import Event
from appliance.filter import journal as journal_module
from appliance.filter.events import EventBus
from appliance.filter.journal import DATAGRAM_MAX, Journal
from tests.helpers import journal_entry
from tests.integration.conftest import FilterProcess
from tests.integration.filter.test_dns import ask


@contextlib.contextmanager
def journald(path: Path):
    """A datagram socket bound at `path`, where journald's would be."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    try:
        yield sock
    finally:
        sock.close()


def started(tmp_path: Path, internet, socket_path: Path, event_loop: str = "auto"):
    return FilterProcess(tmp_path, internet.dns.address, event_loop=event_loop,
                         extra_config=f'[events]\njournal = true\n'
                                      f'journal_socket = "{socket_path}"\n')


def entries_until(sock, predicate) -> dict[str, bytes]:
    """Entries read off `sock` until one whose fields satisfy `predicate`: its fields."""
    while True:
        entry = dict(journal_entry(sock))
        if predicate(entry):
            return entry


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_a_denied_lookup_reaches_the_journal_as_its_event(tmp_path, internet, event_loop):
    path = tmp_path / "journal.sock"
    with journald(path) as sock:
        process = started(tmp_path, internet, path, event_loop)
        try:
            ask(process.dns_port, "not-allowed.journal.test")
            entry = entries_until(sock, lambda e: e.get("CORRAL_NAME")
                                  == b"not-allowed.journal.test")
            event = process.wait_event(lambda e: e["name"] == "not-allowed.journal.test")
            status = process.control({"op": "status"})["journal"]
        finally:
            process.stop()
    assert json.loads(entry["MESSAGE"]) == event  # the very event `monitor` shows
    assert entry["MESSAGE"] == json.dumps(event, separators=(",", ":")).encode()
    assert (entry["SYSLOG_IDENTIFIER"], entry["PRIORITY"]) == (b"corral-events", b"5")
    assert (entry["CORRAL_KIND"], entry["CORRAL_VERDICT"], entry["CORRAL_SESSION"],
            entry["CORRAL_QTYPE"], entry["CORRAL_OCSF_CLASS_UID"]) == (
        b"dns", b"deny", b"s1", b"A", b"4003")
    assert entry["CORRAL_ID"] == str(event["id"]).encode()
    assert status["socket"] == str(path) and status["sent"] >= 1
    assert (status["lost"], status["error"]) == (0, None)


@pytest.mark.parametrize("absent", ["missing", "refusing"])
def test_without_journald_the_filter_serves_and_counts_what_it_lost(tmp_path, internet,
                                                                      absent):
    path = tmp_path / "journal.sock"
    if absent == "refusing":  # bound once, nobody there now: ECONNREFUSED
        with journald(path):
            pass
    process = started(tmp_path, internet, path)
    try:
        for n in range(5):
            assert ask(process.dns_port, f"lost-{n}.journal.test").header.rcode == 3
        process.wait_event(lambda e: e["name"] == "lost-4.journal.test")
        status = process.control({"op": "status"})["journal"]
        assert status["sent"] == 0 and status["lost"] >= 5
        assert str(path) in status["error"]
        assert ("No such file" if absent == "missing" else "refused") in status["error"]
        # journald back: entries flow again (the socket is tried again within a second)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with journald(path) as sock:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                ask(process.dns_port, "back.journal.test")
                sock.settimeout(0.2)
                with contextlib.suppress(TimeoutError):
                    entry = entries_until(sock, lambda e: e.get("CORRAL_NAME")
                                          == b"back.journal.test")
                    break
            else:
                raise AssertionError("no entry once the journal socket was back")
            assert entry["CORRAL_VERDICT"] == b"deny"
            status = process.control({"op": "status"})["journal"]
            assert status["sent"] >= 1 and status["error"] is None
    finally:
        process.stop()
    assert "journal export" in process.log.read_text()  # said so, in its log


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_a_full_journal_never_holds_the_filter_back(tmp_path, internet, event_loop):
    """journald not reading (its queue full: EAGAIN): every query is answered all the same,
    the entries wait in the exporter's queue, and go once journald reads again."""
    path = tmp_path / "journal.sock"
    with journald(path) as sock:
        process = started(tmp_path, internet, path, event_loop)
        try:
            queue = int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
            for n in range(queue + 40):  # beyond what the socket's queue holds
                assert ask(process.dns_port, f"full-{n}.journal.test").header.rcode == 3
            status = process.control({"op": "status"})["journal"]
            assert status["waiting"] and status["queued"] > 0 and status["lost"] == 0
            last = f"full-{queue + 39}.journal.test".encode()
            entries_until(sock, lambda e: e.get("CORRAL_NAME") == last)  # all come through
            status = process.control({"op": "status"})["journal"]
        finally:
            process.stop()
    assert status["sent"] >= queue + 40 and status["lost"] == 0


# -- the edge on its own -------------------------------------------------------------------


def denial(n: int, reason: str = "no rule allows it") -> Event:
    return Event(session="s1", client="10.213.1.2", kind="dns", name=f"n{n}.test",
                 verdict="deny", reason=reason)


async def settle(exporter: Journal, count: int) -> None:
    """Until `count` entries are sent or lost (5 s at most)."""
    for _ in range(500):
        if exporter.sent + exporter.lost >= count:
            return
        await asyncio.sleep(0.01)


def test_an_entry_too_large_for_a_datagram_goes_as_a_sealed_memfd(tmp_path):
    path = tmp_path / "journal.sock"
    large = "x" * (DATAGRAM_MAX + 1)

    async def main(sock):
        bus = EventBus()
        exporter = Journal(bus, str(path))
        exporter.start()
        bus.emit(denial(1, large))
        bus.emit(denial(2))
        await settle(exporter, 2)
        await exporter.stop()
        return exporter

    with journald(path) as sock:
        exporter = asyncio.run(main(sock))
        first, second = dict(journal_entry(sock)), dict(journal_entry(sock))
    assert first["CORRAL_REASON"] == large.encode() and json.loads(first["MESSAGE"])["id"] == 1
    assert second["CORRAL_NAME"] == b"n2.test"
    assert (exporter.sent, exporter.lost) == (2, 0)


def test_one_the_kernel_refuses_as_too_large_goes_as_a_memfd_too(tmp_path):
    """EMSGSIZE below DATAGRAM_MAX (a small socket buffer): a memfd, not a loss."""
    path = tmp_path / "journal.sock"

    async def main():
        bus = EventBus()
        exporter = Journal(bus, str(path))
        exporter._connect()
        exporter._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        exporter.start()
        bus.emit(denial(1, "y" * 20000))
        await settle(exporter, 1)
        await exporter.stop()
        return exporter

    with journald(path) as sock:
        exporter = asyncio.run(main())
        data, ancillary, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(4))
    assert data == b"" and ancillary  # the descriptor, not the bytes
    os.close(int.from_bytes(ancillary[0][2][:4], "little"))
    assert (exporter.sent, exporter.lost) == (1, 0)


def test_a_journal_full_for_good_costs_the_oldest_entries_counted(tmp_path, monkeypatch):
    """The exporter's queue is bounded as every subscriber's: past it the oldest events go,
    counted as lost; the bus never waits."""
    monkeypatch.setattr(journal_module, "WAIT_WRITABLE", 0.05)
    path = tmp_path / "journal.sock"

    async def main():
        bus = EventBus()
        exporter = Journal(bus, str(path), queue=20)
        exporter.start()
        for n in range(300):
            bus.emit(denial(n))
            if n % 10 == 0:
                await asyncio.sleep(0)  # the exporter runs in between, as on the filter
        await asyncio.sleep(0.2)
        seen = exporter.describe()
        await exporter.stop()
        return exporter, seen

    with journald(path):  # never read
        exporter, seen = asyncio.run(main())
    assert seen["waiting"] and seen["queued"] == 20 and seen["lost"] > 0
    assert exporter.sent + exporter.lost == 300  # each one either sent or counted


def test_a_restarted_journald_gets_the_next_entry_on_its_new_socket(tmp_path):
    """journald restarted: the connected socket's peer is gone (ECONNREFUSED); the entry
    goes to the new socket at the same path, nothing lost."""
    path = tmp_path / "journal.sock"

    async def main(first_socket):
        bus = EventBus()
        exporter = Journal(bus, str(path))
        exporter.start()
        bus.emit(denial(1))
        await settle(exporter, 1)
        first_socket.close()
        path.unlink()
        with journald(path) as second:
            bus.emit(denial(2))
            await settle(exporter, 2)
            await exporter.stop()
            return exporter, dict(journal_entry(second))

    with journald(path) as first:
        exporter, entry = asyncio.run(main(first))
    assert entry["CORRAL_NAME"] == b"n2.test"
    assert (exporter.sent, exporter.lost) == (2, 0)
