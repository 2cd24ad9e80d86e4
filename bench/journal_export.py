"""What exporting to journald costs the filter per event (`[events] journal`), against the
bus's own cost in the same run: `PYTHONPATH=. python3 bench/journal_export.py` from the
repository's root (the standard library only: the appliance's own Python will do).

  emit           EventBus.emit alone, no subscriber: the baseline
  entry          the pure encoder (filter/journal.py): event -> datagram
  emit+export    emit with the exporter subscribed, each entry sent on a real AF_UNIX
                 datagram socket that another process reads (as journald would), timed
                 until every entry is sent: what the filter's loop spends per event
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import sys
import tempfile
import time
from pathlib import Path

from appliance.event import Event
from appliance.filter.events import EventBus
from appliance.filter.journal import Journal, entry

N = 50_000


def denial(n: int) -> Event:
    """A denied lookup as the DNS filter emits it (about a dozen fields)."""
    return Event(id=n, session="s1", client="10.213.1.2", kind="dns", name=f"n{n}.example",
                 port=None, address=None, verdict="deny", reason="no rule allows it",
                 rule=None, layer=None, qtype="A",
                 hint=f"corral allow-dns n{n}.example --session s1")


def drain(path: str, ready) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)  # as journald sets it
    ready.set()
    while sock.recv(1 << 16) != b"end":
        pass


def per_event(seconds: float) -> float:
    return seconds / N * 1e6


def emit_alone() -> float:
    bus, events = EventBus(), [denial(n) for n in range(N)]
    start = time.perf_counter()
    for event in events:
        bus.emit(event)
    return per_event(time.perf_counter() - start)


def encode_alone() -> float:
    events = [EventBus().emit(denial(n)) for n in range(N)]
    start = time.perf_counter()
    for event in events:
        entry(event)
    return per_event(time.perf_counter() - start)


async def emit_and_export(path: str) -> tuple[float, int]:
    bus = EventBus()
    exporter = Journal(bus, path, queue=N)
    exporter.start()
    events = [denial(n) for n in range(N)]
    start = time.perf_counter()
    for n, event in enumerate(events):
        bus.emit(event)
        if n % 64 == 63:
            await asyncio.sleep(0)  # the exporter takes its turn, as between requests
    while exporter.sent + exporter.lost < N:  # noqa: ASYNC110 (the loop's time is measured)
        await asyncio.sleep(0)
    elapsed = time.perf_counter() - start
    await exporter.stop()
    return per_event(elapsed), exporter.lost


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = str(Path(directory) / "journal.sock")
        ready = multiprocessing.Event()
        reader = multiprocessing.Process(target=drain, args=(path, ready))
        reader.start()
        ready.wait()
        rows = {"emit": [], "entry": [], "emit+export": []}
        lost = 0
        for _ in range(5):
            rows["emit"].append(emit_alone())
            rows["entry"].append(encode_alone())
            cost, missed = asyncio.run(emit_and_export(path))
            rows["emit+export"].append(cost)
            lost += missed
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(b"end", path)
        reader.join()
    base = min(rows["emit"])
    print(f"python {sys.version.split()[0]}, {N} events a run, best of 5 runs")
    for name, values in rows.items():
        print(f"  {name:12} {min(values):6.2f} µs/event   x{min(values) / base:.1f} emit")
    print(f"  export adds  {min(rows['emit+export']) - base:6.2f} µs/event; lost {lost}")


if __name__ == "__main__":
    main()
