"""The appliance's check of the battery (appliance/sandbox/battery.py): a denial counts only
when it was recorded, the review probe only when the diff names its files. Table-driven on
the pure parts; the reading of the real filter's records is tests/integration's."""

from __future__ import annotations

import json

import pytest

from appliance.sandbox import battery
from appliance.sandbox.battery import FAILED, NOT_RUN, PASSED


def probe(id="p", state=PASSED, expect=None, detail="refused"):
    return {"id": id, "threat": 1, "legit": False, "group": "network", "state": state,
            "ok": state == PASSED, "ms": 1.0, "detail": detail, "expect": expect}


def event(kind, verdict="deny", **fields):
    return {"kind": kind, "verdict": verdict, "name": None, "reason": None, "address": None,
            "port": None, **fields}


DNS = event("dns", name="x.exfil.denied.test", reason="not allowed")
FIREWALL = event("firewall", name="9.9.9.9", address="9.9.9.9", port=53,
                 reason="rejected by the firewall: udp to 9.9.9.9:53")
ICMP = event("firewall", name="203.0.113.10", address="203.0.113.10", port=None)
MALFORMED = event("http", verdict="error", reason="400: Connection names Content-Length")
ALLOWED = event("dns", verdict="allow", name="allowed.test")


@pytest.mark.parametrize(("expect", "events", "counters", "found"), [
    ({"kind": "dns", "name": "x.exfil.denied.test", "never_upstream": True}, [DNS], {}, True),
    ({"kind": "dns", "name": "y.exfil.denied.test"}, [DNS], {}, False),
    ({"kind": "dns", "name": "allowed.test"}, [ALLOWED], {}, False),  # an allow records no denial
    ({"kind": "http", "reason": "Connection"}, [MALFORMED], {}, True),  # errors count
    ({"kind": "http", "reason": "chunk"}, [MALFORMED], {}, False),
    ({"kind": "connect", "reason": "Connection"}, [MALFORMED], {}, False),  # kind must match
    ({"kind": "firewall", "address": "9.9.9.9", "port": 53}, [FIREWALL], {}, True),
    ({"kind": "firewall", "address": "9.9.9.9", "port": 853}, [FIREWALL], {}, False),
    ({"kind": "firewall", "address": "203.0.113.10", "port": None}, [ICMP], {}, True),
    ({"kind": "counter", "counter": "deny_ipv6"}, [], {"deny_ipv6": 2}, True),
    ({"kind": "counter", "counter": "deny_ipv6"}, [], {"deny_ipv6": 0}, False),
    ({"kind": "counter", "counter": "deny_ipv6"}, [], {}, False),
])
def test_what_counts_as_recorded(expect, events, counters, found):
    assert battery.recorded(expect, events, counters) is found


def test_a_passed_probe_whose_denial_was_not_recorded_fails():
    probes = [probe("seen", expect={"kind": "dns", "name": "x.exfil.denied.test"}),
              probe("unseen", expect={"kind": "http", "reason": "chunk"}),
              probe("legit"),
              probe("failed", FAILED, {"kind": "http", "reason": "chunk"}, "went through"),
              probe("not-run", NOT_RUN, None, "no ICMP socket"),
              probe("review", expect={"kind": "review", "paths": ["a"]})]
    judged = {p["id"]: p for p in battery.judge(probes, [DNS], {})}
    assert judged["seen"] == probes[0]
    unseen = judged["unseen"]
    assert (unseen["state"], unseen["ok"], unseen["unrecorded"]) == (FAILED, False, True)
    assert unseen["detail"] == ('denied but not recorded: expected {"kind": "http", "reason": '
                                '"chunk"}; refused')
    for same in ("legit", "failed", "not-run", "review"):  # nothing to confirm, or not here
        assert judged[same] == next(p for p in probes if p["id"] == same)
    assert probes[1]["state"] == PASSED  # the input is left as it was


def test_unreadable_records_confirm_no_denial():
    probes = [probe("a", expect={"kind": "dns"}), probe("legit")]
    a, legit = battery.unconfirmed(probes, "the filter refused audit: boom")
    assert a["state"] == FAILED and a["detail"].startswith("denial not confirmed: the filter "
                                                           "refused audit: boom")
    assert legit == probes[1]


REVIEW = probe("review-hostile-files", expect={
    "kind": "review", "root": "r", "paths": ["r/late.txt", "r/name-\udcff.txt", "r/fifo"]})


def test_the_review_probe_passes_only_when_the_diff_answered_and_names_every_file():
    named = {"changes": [{"path": "r/late.txt"}, {"path": "r/name-\udcff.txt"}],
             "notes": [{"path": "r/fifo", "note": "a FIFO: not carried"}]}
    (ok,) = battery.judge_review([REVIEW], named, None)
    assert ok["state"] == PASSED and ok["detail"].endswith("the diff answered and names all 3")
    (missing,) = battery.judge_review([REVIEW], {"changes": named["changes"]}, None)
    assert missing["state"] == FAILED
    assert missing["detail"] == 'the diff does not name 1 of 3 files: "r/fifo"'
    (broken,) = battery.judge_review([REVIEW], None, "UnicodeDecodeError: 'utf-8' codec ...")
    assert broken["state"] == FAILED and broken["detail"].startswith(
        "the diff failed: UnicodeDecodeError")


def test_the_review_check_leaves_other_probes_alone():
    others = [probe("a", expect={"kind": "dns"}), {**REVIEW, "state": NOT_RUN}]
    assert battery.judge_review(others, None, "boom") == others


SNAPSHOT = probe("review-changed-after-diff", expect={
    "kind": "review-snapshot", "root": "s", "path": "s/changing.txt"}, detail="writer")
SHOWN = "--- /dev/null\n+++ b/s/changing.txt\n@@ -0,0 +1,2 @@\n+version 7\n+version 7"


@pytest.mark.parametrize(("applied", "now", "error", "state", "detail"), [
    (b"version 7\nversion 7\n", b"version 9\n", None, PASSED, "all shown by the diff"),
    (b"version 9\n", b"version 9\n", None, FAILED, "did not show: ['version 9']"),
    (b"version 7\n", b"version 7\n", None, FAILED, "wrote what the agent wrote after"),
    (None, b"version 9\n", None, FAILED, "wrote nothing"),
    (b"version 7\n", None, None, NOT_RUN, "did not change the file after the diff"),
    (b"", b"version 9\n", None, PASSED, "applied 0 bytes"),  # caught truncated: shown so
    (None, None, "SessionError: no reviewed changeset", FAILED, "no reviewed changeset"),
])
def test_the_changed_after_diff_probe_passes_only_when_what_was_applied_was_shown(
        applied, now, error, state, detail):
    judged = battery.judge_snapshot(SNAPSHOT, SHOWN, applied, now, error)
    assert judged["state"] == state and detail in judged["detail"], judged


def test_the_changed_after_diff_probe_fails_when_the_diff_shows_later_writes():
    late = SHOWN + "\n+version 9"
    judged = battery.judge_snapshot(SNAPSHOT, late, b"version 7\n", b"version 9\n")
    assert judged["state"] == FAILED and "written after" in judged["detail"]


def test_a_review_snapshot_expect_is_not_looked_for_in_the_records():
    (judged,) = battery.judge([SNAPSHOT], [], {})
    assert judged["state"] == PASSED and not judged.get("unrecorded")


def test_passed_and_tally():
    probes = [probe("a"), probe("b", FAILED), {**probe("c", FAILED), "unrecorded": True},
              probe("d", NOT_RUN)]
    assert battery.tally(probes) == {"passed": 1, "failed": 2, "not_run": 1, "unrecorded": 1}
    assert not battery.passed(probes)
    assert battery.passed([probe("a")])
    assert not battery.passed([])  # nothing ran: nothing was shown


def test_options_become_the_batterys_flags_and_bad_ones_are_named():
    assert battery.arguments({"allowed": "a.test", "silence": 6, "only": ["x", "y"],
                              "skip_group": ["kernel"]}) == [
        "--allowed", "a.test", "--silence", "6", "--only", "x", "--only", "y",
        "--skip-group", "kernel"]
    with pytest.raises(ValueError, match="unknown selftest option 'slow_connections'"):
        battery.arguments({"slow_connections": 500})
    with pytest.raises(ValueError, match="'silence' must be a int"):
        battery.arguments({"silence": True})
    with pytest.raises(ValueError, match="'only' must be a list of strings"):
        battery.arguments({"only": ["x", 3]})


def test_the_batterys_output_is_probes_then_a_summary():
    lines = [json.dumps(probe("a")), "podman: some warning", "{not json",
             json.dumps({"summary": {"passed": 1}})]
    probes, summary = battery.parse("\n".join(lines))
    assert [p["id"] for p in probes] == ["a"] and summary == {"passed": 1}
    assert battery.parse(json.dumps(probe("a")))[1] is None  # it did not finish


class Filter:
    """The filter's control socket as battery.confirm reads it, answering from lists."""

    def __init__(self, records, counters, fail=None):
        self.records, self.counters, self.fail, self.asked = records, counters, fail, []

    def __call__(self, request):
        self.asked.append(request)
        if self.fail:
            return {"ok": False, "error": self.fail}
        if request["op"] == "status":
            return {"ok": True, "audit": {"head": {"seq": len(self.records)}},
                    "firewall": {"loaded": True, "counters": dict(self.counters)}}
        after, limit = request["after"], request["limit"]
        rest = [r for r in self.records if r["seq"] > after]
        return {"ok": True, "records": rest[:limit], "more": len(rest) > limit}


def test_confirm_reads_only_the_sessions_records_after_the_mark_page_by_page():
    old = [{"seq": 1, "ts": 0, "session": "s1", **DNS}]
    control = Filter(old, {"deny_ipv6": 5})
    mark = battery.mark_before(control)
    assert (mark.seq, mark.counters) == (1, {"deny_ipv6": 5})
    control.records += [{"seq": 1 + i, "ts": mark.ts + 1, "session": "s2", **DNS}
                        for i in range(1, 1500)]
    control.records.append({"seq": 1501, "ts": mark.ts + 1, "session": "s1", **FIREWALL})
    control.counters["deny_ipv6"] = 6
    probes = [probe("exfil", expect={"kind": "dns", "name": "x.exfil.denied.test"}),
              probe("udp", expect={"kind": "firewall", "address": "9.9.9.9", "port": 53}),
              probe("v6", expect={"kind": "counter", "counter": "deny_ipv6"})]
    exfil, udp, v6 = battery.confirm(probes, control, mark, "s1", settle=0)
    assert exfil["unrecorded"] and udp["state"] == v6["state"] == PASSED  # s2's, and old
    audits = [r for r in control.asked if r["op"] == "audit"]
    assert [r["after"] for r in audits] == [1, 1001]
    assert all(r["since"] == mark.ts for r in audits)


def test_confirm_fails_every_denial_when_the_records_cannot_be_read():
    probes = [probe("exfil", expect={"kind": "dns"})]
    mark = battery.Mark(0, 0.0, {})
    (exfil,) = battery.confirm(probes, Filter([], {}, fail="audit log unreadable"), mark, "s1")
    assert exfil["state"] == FAILED and "audit log unreadable" in exfil["detail"]


def test_one_record_confirms_one_probe_only():
    """Two probes that expect the same kind of record, one record: one of them was not
    recorded. And a counter confirms as many probes as it grew."""
    def passed(name, expect):
        return {"id": name, "state": "passed", "ok": True, "detail": "", "expect": expect}

    fronting = {"kind": "connect", "reason": "domain fronting"}
    probes = [passed("a", fronting), passed("b", fronting),
              passed("c", {"kind": "counter", "counter": "deny_ipv6"}),
              passed("d", {"kind": "counter", "counter": "deny_ipv6"})]
    events = [{"kind": "connect", "verdict": "deny", "reason": "TLS SNI x differs from CONNECT "
               "host y (domain fronting)"}]
    judged = battery.judge(probes, events, {"deny_ipv6": 1})
    assert [p["state"] for p in judged] == ["passed", "failed", "passed", "failed"]
    judged = battery.judge(probes, events * 2, {"deny_ipv6": 2})
    assert [p["state"] for p in judged] == ["passed"] * 4


def test_a_narrow_expectation_is_matched_before_a_broad_one_takes_its_record():
    narrow = {"kind": "http", "name": "denied.test", "reason": "not in the http policy"}
    broad = {"kind": "http"}
    probes = [{"id": "broad", "state": "passed", "expect": broad},
              {"id": "narrow", "state": "passed", "expect": narrow}]
    events = [{"kind": "http", "verdict": "deny", "name": "denied.test",
               "reason": "denied.test is not in the http policy"},
              {"kind": "http", "verdict": "error", "name": None, "reason": "400: bad"}]
    assert [p["state"] for p in battery.judge(probes, events, {})] == ["passed", "passed"]
