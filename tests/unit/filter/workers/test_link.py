"""The link's frames as transcripts (bytes in, bodies out), then a real socketpair: calls and
replies, descriptors passed with a message, a worker's pickle refused by the coordinator,
and a peer that goes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import socket

import pytest

from appliance.filter.workers import link
from appliance.filter.workers.inbox import _teaching
from appliance.filter.workers.link import JSON, PICKLE, Frames, Link, LinkError


def test_frames_split_and_joined_anywhere_give_the_same_bodies():
    data = link.encode({"op": "a", "n": 1}, JSON) + link.encode({"op": "b", "x": "y" * 300},
                                                                JSON)
    for cut in range(len(data) + 1):
        frames = Frames(JSON)
        bodies = frames.feed(data[:cut]) + frames.feed(data[cut:])
        assert [json.loads(b)["op"] for b in bodies] == ["a", "b"]


def test_the_coordinator_reads_no_pickle_and_no_giant_frame():
    with pytest.raises(LinkError, match="kind"):
        Frames(JSON).feed(link.encode({"op": "x"}, PICKLE))
    with pytest.raises(LinkError, match="more than"):  # refused before its body came
        Frames(JSON).feed(link.HEADER.pack(link.MAX_JSON + 1, JSON))
    with pytest.raises(LinkError, match="`op`"):
        link.decode(b"[1, 2]", JSON)
    assert Frames(PICKLE).feed(link.encode({"op": "x"}, PICKLE)) == [
        pickle.dumps({"op": "x"}, protocol=pickle.HIGHEST_PROTOCOL)]


def test_a_teaching_from_a_worker_is_checked_field_by_field():
    good = {"session": "s", "name": "n.test", "sandbox": "10.0.0.2",
            "destination": "192.0.2.1", "port": 443, "timeout": 60}
    assert _teaching(good).port == 443
    for bad in ({**good, "port": "443"}, {**good, "port": 0}, {**good, "timeout": -1},
                {**good, "destination": "1.2.3"}, {**good, "extra": 1},
                {k: v for k, v in good.items() if k != "name"}, [good]):
        with pytest.raises(LinkError):
            _teaching(bad)


def test_calls_replies_and_descriptors_over_a_real_socketpair(tmp_path):
    async def main():
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        got: list = []

        def worker_handles(message, fds):
            if message["op"] == "read":
                with os.fdopen(fds[0], "rb") as passed:
                    return {"data": passed.read().decode()}
            if message["op"] == "fail":
                raise ValueError("as asked")
            got.append(message)
            return None

        coordinator = Link(a, sends=PICKLE, handle=lambda m, f: None)
        worker = Link(b, sends=JSON, handle=worker_handles)
        path = tmp_path / "passed"
        path.write_text("through the link")
        fd = os.open(path, os.O_RDONLY)
        try:  # the caller's to close: the link sends a copy
            reply = await coordinator.call({"op": "read", "fds": 1}, fds=[fd], seconds=5)
        finally:
            os.close(fd)
        assert reply["data"] == "through the link"
        with pytest.raises(LinkError, match="ValueError: as asked"):
            await coordinator.call({"op": "fail"}, seconds=5)
        coordinator.send({"op": "note", "big": "x" * 500_000})  # more than one recv
        fd = os.open(path, os.O_RDONLY)
        reply = await coordinator.call({"op": "read", "fds": 1}, fds=[fd], seconds=5)
        os.close(fd)
        assert reply["data"] == "through the link"
        assert got and got[0]["big"] == "x" * 500_000
        # a worker that speaks pickle is cut off
        worker.sends = PICKLE
        worker.send({"op": "event"})
        assert isinstance(await asyncio.wait_for(coordinator.closed, 5), LinkError)
        assert await asyncio.wait_for(worker.closed, 5) is None  # it saw the end
        with pytest.raises(ConnectionError):
            await coordinator.call({"op": "read"})
    asyncio.run(main())


def test_a_call_ends_when_the_peer_goes():
    async def main():
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        coordinator = Link(a, sends=PICKLE, handle=lambda m, f: None)
        pending = asyncio.ensure_future(coordinator.call({"op": "slow"}, seconds=5))
        await asyncio.sleep(0.01)
        b.close()
        with pytest.raises(ConnectionError):
            await pending
    asyncio.run(main())


def test_a_frame_larger_than_the_socket_buffer_keeps_its_descriptors(tmp_path):
    """Sent in many partial writes: the descriptors ride on the first, and the message that
    names them gets them, after a queue of plain messages that came before."""
    async def main():
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        got: list = []

        def worker_handles(message, fds):
            got.append((message["op"], len(message.get("big", "")),
                        [os.read(fd, 64) for fd in fds]))
            for fd in fds:
                os.close(fd)
            return {} if "id" in message else None

        coordinator = Link(a, sends=PICKLE, handle=lambda m, f: None)
        worker = Link(b, sends=JSON, handle=worker_handles)
        for n in range(3):
            coordinator.send({"op": f"plain{n}", "big": "y" * 100_000})
        readers = []
        for n in range(2):
            r, w = os.pipe()
            os.write(w, f"pipe {n}".encode())
            os.close(w)
            readers.append(r)
        await coordinator.call({"op": "serve", "big": "x" * (8 << 20), "fds": 2},
                               fds=readers, seconds=30)
        for fd in readers:
            os.close(fd)
        assert got == [("plain0", 100_000, []), ("plain1", 100_000, []),
                       ("plain2", 100_000, []), ("serve", 8 << 20, [b"pipe 0", b"pipe 1"])]
        coordinator.close()
        worker.close()
    asyncio.run(main())


def test_a_beat_is_answered_by_a_running_loop_and_moves_heard_and_nothing_else_does():
    """`heard` is when the other end last answered a beat: its loop read it and ran (the
    coordinator takes a worker that answers none for `worker_silence` for stuck). A stuck
    worker could still send frames blindly, even replies to the ids a call would use next:
    none of that moves it."""
    async def main():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        mute_ours, mute_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        seen: list[dict] = []
        coordinator = Link(ours, sends=PICKLE, handle=lambda message, fds: None)
        worker = Link(theirs, sends=JSON, handle=lambda message, fds: seen.append(message))
        to_mute = Link(mute_ours, sends=PICKLE, handle=lambda message, fds: None)
        try:
            coordinator.heard = to_mute.heard = 0.0
            to_mute.beat()  # its other end reads nothing: it sends what a stuck one could
            for number in range(1, 50):
                mute_theirs.sendall(link.encode({"op": "reply", "id": number}, JSON))
            mute_theirs.sendall(link.encode({"op": "event", "event": {}}, JSON))
            coordinator.beat()
            for _ in range(1000):  # 5 s at most
                if coordinator.heard:
                    break
                await asyncio.sleep(0.005)
            assert coordinator.heard > 0.0
            assert [m["op"] for m in seen] == ["beat"] and seen[0]["id"] >= 1 << 62
            await asyncio.sleep(0.1)
            assert to_mute.heard == 0.0 and mute_theirs.recv(1 << 16)  # sent, unanswered
        finally:
            for one in (coordinator, worker, to_mute):
                one.close()
            mute_theirs.close()
    asyncio.run(main())


def test_a_worker_that_asks_and_reads_nothing_is_not_read_while_its_answers_wait(
        monkeypatch):
    """Each message with an id gets an answer: one that sends them and never reads grew the
    coordinator's queue without end (85 MiB a second, measured), while it counted as heard.
    Past HIGH_WATER waiting, the coordinator stops reading it; once it reads, on again."""
    monkeypatch.setattr(link, "HIGH_WATER", 256 << 10)

    async def main():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        asked = []
        coordinator = Link(ours, sends=PICKLE,
                           handle=lambda message, fds: asked.append(message["id"]) or {})
        theirs.setblocking(False)
        frame = link.encode({"op": "x", "id": 1}, JSON)
        sent = 0
        try:
            for _ in range(200):  # it sends for as long as the kernel takes its frames
                try:
                    while True:
                        sent += theirs.send(frame * 64)
                except BlockingIOError:
                    pass
                await asyncio.sleep(0.01)
            assert coordinator._paused and len(asked) < sent // len(frame)
            assert coordinator._queued <= link.HIGH_WATER + (1 << 18)  # a read's answers
            waiting = coordinator._queued
            for _ in range(100_000):  # it reads at last
                if coordinator._queued <= link.HIGH_WATER // 2:
                    break
                with contextlib.suppress(BlockingIOError):
                    theirs.recv(1 << 20)
                await asyncio.sleep(0)
            assert not coordinator._paused and waiting > link.HIGH_WATER
        finally:
            coordinator.close()
            theirs.close()
    asyncio.run(main())


def test_a_late_answer_counts_while_the_silence_allowed_is_not_over():
    """A beat goes each second and `worker_silence` may be minutes: the ids of every beat
    in that silence are kept (BEATS_KEPT only when the silence is shorter), so a worker
    whose answer comes 100 beats late, under a silence of 120 s, is heard, not killed
    early."""
    async def main():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        coordinator = Link(ours, sends=PICKLE, handle=lambda message, fds: None)
        try:
            coordinator.heard = 0.0
            for _ in range(100):
                coordinator.beat(keep=Link.beats_for(120.0, 1.0))
            frames, beats = Frames(PICKLE), []
            theirs.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while data := theirs.recv(1 << 16):
                    beats += [pickle.loads(body) for body in frames.feed(data)]
            assert len(beats) == 100
            theirs.sendall(link.encode({"op": "reply", "id": beats[0]["id"]}, JSON))
            for _ in range(1000):
                if coordinator.heard:
                    break
                await asyncio.sleep(0.005)
            assert coordinator.heard > 0.0
        finally:
            coordinator.close()
            theirs.close()
    asyncio.run(main())
    assert Link.beats_for(10.0, 1.0) == link.BEATS_KEPT
    assert Link.beats_for(120.0, 1.0) == 122
