"""Erasing the record (THREATS 18, DESIGN 5 and 8): the audit log keeps `audit_segments`
segments of `audit_segment_bytes` and deletes the oldest; nothing limits how many events a
session made the filter write. A sandbox that did something it wants forgotten flooded
cheap denied requests until the segments holding it were deleted: 6 client threads from
one session wrote 4.2 MB/s of audit with the defaults (8 x 64 MiB turned over in about 2
minutes). Each session's records now have a budget ([state] audit_events_per_session,
200 a second, ten seconds' worth at once; then one summary record a second). This test
scales retention (2 x 64 KiB, about 300 records) and the budget (20 a second) down
together: the flood leaves the allowed request in the log."""

from __future__ import annotations

import socket

from tests.integration.conftest import S1_CLIENT, FilterProcess, connect, recv_all


def test_one_session_can_flush_its_own_history_out_of_the_audit_log(internet, tmp_path):
    corral = FilterProcess(tmp_path, internet.dns.address,
                           state_extra="audit_segment_bytes = 65536\naudit_segments = 2\n"
                                       "audit_events_per_session = 20")
    try:
        # the act the agent wants forgotten: a request to an allowed host
        sock = connect(corral.proxy_port)
        sock.sendall(b"GET http://allowed.test:8080/secret-upload HTTP/1.1\r\n"
                     b"Host: allowed.test:8080\r\nConnection: close\r\n\r\n")
        assert recv_all(sock).startswith(b"HTTP/1.1 200")
        sock.close()
        first = corral.wait_event(lambda e: e.get("name") == "allowed.test"
                                  and e.get("verdict") == "allow")
        # then a flood of cheap denials from the same session
        for _ in range(600):
            s = socket.socket()
            s.settimeout(10)  # a denial the filter never answers: a TimeoutError, not a hang
            s.bind((S1_CLIENT, 0))
            s.connect(("127.0.0.1", corral.proxy_port))
            s.sendall(b"GET http://" + b"x" * 60 + b".denied.test/ HTTP/1.1\r\n\r\n")
            s.recv(100)
            s.close()
        corral.control({"op": "audit-verify"})
        kept = corral.control({"op": "audit", "after": 0, "limit": 5})["records"]
        ids = [r.get("event", r).get("id") for r in kept]
        assert first["id"] in ids or any(
            r.get("event", r).get("name") == "allowed.test" for r in kept), (
            f"the allowed request (event {first['id']}) is no longer in the audit log: "
            f"the oldest record kept is {kept[:1]}")
    finally:
        corral.stop()
