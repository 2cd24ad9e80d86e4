"""The bypass battery's results, judged by the appliance: a denial counts only when recorded.

The battery (appliance/selftest/) runs inside a session and cannot see the control plane;
each of its probes says what must record the denial it met (`expect`: a filter event, a
firewall counter, or for `review` the session's diff). Here, outside, every caller of the
battery (the sandbox service's `selftest` op, so `corral selftest` and verify.yml; the e2e
suite) checks that, the same way:

  mark = mark_before(control)            the audit log's head and the firewall's counters
  ... run the battery in the session ...
  probes = confirm(probes, control, mark, session)     each expect against what was recorded

A probe that passed in the sandbox but whose denial nobody recorded is failed ("denied but not
recorded"). `judge` and `judge_review` are pure; `confirm` reads the filter's control socket.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from appliance import workspace
from appliance.control_client import ServiceUnavailable
from appliance.selftest.registry import FAILED, NOT_RUN, PASSED

SETTLE = 2.0
"""Seconds to wait for records still on their way (NFLOG reports, the audit writer)."""
PAGE = 1000

OPTIONS: dict[str, type] = {
    "allowed": str, "denied": str, "foreign_resolver": str, "v6_target": str,
    "private_name": str, "tcp_name": str, "inspected": str, "other_gateway": str,
    "denied_request": str, "git_repo": str, "git_ssh": str, "fake_upgrade": str,
    "echo_secret": str, "neighbour": str,
    "silence": int, "ask_hold": int,
    "connections": int, "only": list, "skip_group": list,
}
"""What a caller may set for the battery (the API's body, the service's `options`)."""

Control = Callable[[dict], dict]
REVIEWED = ("review", "review-snapshot")
"""Expectations the session's diff and apply answer, not the filter's records."""


class RecordsUnavailable(Exception):
    """The filter could not say what it recorded; the message says why."""


def arguments(options: dict) -> list[str]:
    """The battery's command-line flags for these options. Raises ValueError naming the bad
    option (unknown, or of the wrong type)."""
    argv = []
    for key, value in options.items():
        kind = OPTIONS.get(key)
        if kind is None:
            raise ValueError(f"unknown selftest option {key!r}; options: {', '.join(OPTIONS)}")
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"selftest option {key!r} must be a {kind.__name__}")
        flag = "--" + key.replace("_", "-")
        if kind is list:
            if not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"selftest option {key!r} must be a list of strings")
            for item in value:
                argv += [flag, item]
        else:
            argv += [flag, str(value)]
    return argv


def parse(stdout: str) -> tuple[list[dict], dict | None]:
    """The battery's --json output: its probes, and its summary (None if it did not finish)."""
    probes, summary = [], None
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if "summary" in item:
            summary = item["summary"]
        elif "id" in item:
            probes.append(item)
    return probes, summary


# -- what counts as recorded ---------------------------------------------------------------


def recorded(expect: dict, events: list[dict], counters: dict[str, int]) -> bool:
    """Whether these events (the session's, since the battery started) or the firewall's
    counter increases show the denial `expect` describes."""
    return _claim(expect, events, set(), dict(counters))


def _matches(expect: dict, event: dict) -> bool:
    kind = expect.get("kind")
    if event.get("kind") != kind or event.get("verdict") not in ("deny", "error"):
        return False
    if "name" in expect and event.get("name") != expect["name"]:
        return False
    if "reason" in expect and expect["reason"] not in (event.get("reason") or ""):
        return False
    return kind != "firewall" or (event.get("address") == expect.get("address") and (
        expect.get("port") is None or event.get("port") == expect["port"]))


def _claim(expect: dict, events: list[dict], used: set[int], growth: dict[str, int]) -> bool:
    """Find a record of this denial that no other probe has claimed, and claim it: one event
    confirms one probe, and a counter confirms as many probes as it grew."""
    if expect.get("kind") == "counter":
        counter = expect.get("counter")
        if growth.get(counter, 0) <= 0:
            return False
        growth[counter] -= 1
        return True
    for index, event in enumerate(events):
        if index not in used and _matches(expect, event):
            used.add(index)
            return True
    return False


def _specificity(expect: dict) -> int:
    """How many things a record must match: the narrowest expectations claim first, so that
    a broad one never takes the only record a narrow one could have."""
    return -sum(key in expect for key in ("name", "reason", "address", "port", "counter"))


def _failed(probe: dict, detail: str, **extra) -> dict:
    return {**probe, "state": FAILED, "ok": False, "detail": detail, **extra}


def judge(probes: list[dict], events: list[dict], counters: dict[str, int]) -> list[dict]:
    """The probes, with every passed one whose denial was not recorded failed. A `review`
    expect is the diff's to answer (`judge_review`), a `review-snapshot` one the apply's
    (`judge_snapshot`)."""
    out = list(probes)
    used: set[int] = set()
    growth = dict(counters)
    waiting = [i for i, p in enumerate(probes) if p.get("state") == PASSED and p.get("expect")
               and p["expect"].get("kind") not in REVIEWED]
    for index in sorted(waiting, key=lambda i: _specificity(probes[i]["expect"])):
        probe = probes[index]
        if not _claim(probe["expect"], events, used, growth):
            out[index] = _failed(probe, "denied but not recorded: expected "
                                 f"{json.dumps(probe['expect'])}; {probe.get('detail', '')}",
                                 unrecorded=True)
    return out


def unconfirmed(probes: list[dict], why: str) -> list[dict]:
    """When the records cannot be read, no denial is confirmed: each one that needed a record
    fails (never passes on trust)."""
    return [_failed(p, f"denial not confirmed: {why}; {p.get('detail', '')}", unrecorded=True)
            if p.get("state") == PASSED and p.get("expect")
            and p["expect"].get("kind") not in REVIEWED else p for p in probes]


def judge_review(probes: list[dict], answer: dict | None, error: str | None) -> list[dict]:
    """The review probe against the session's diff (the `diff` op's answer, or the error it
    raised): it passes only if the diff answered and names every path the probe wrote, as a
    change or in a note saying why it is not shown."""
    out = []
    for probe in probes:
        expect = probe.get("expect") or {}
        if probe.get("state") != PASSED or expect.get("kind") != "review":
            out.append(probe)
            continue
        if error is not None or answer is None:
            out.append(_failed(probe, f"the diff failed: {error}; {probe.get('detail', '')}"))
            continue
        missing = workspace.unnamed(answer, expect.get("paths") or [])
        if missing:
            shown = ", ".join(json.dumps(p) for p in missing[:5])
            out.append(_failed(probe, f"the diff does not name {len(missing)} of "
                               f"{len(expect['paths'])} files: {shown}"))
        else:
            out.append({**probe, "detail": f"{probe.get('detail', '')}; the diff answered and "
                        f"names all {len(expect.get('paths') or [])}"})
    return out


def judge_snapshot(probe: dict, shown: str, applied: bytes | None, now: bytes | None,
                   error: str | None = None) -> dict:
    """The changed-after-diff probe (T32): `shown` is the diff text a person read, `applied`
    what an apply under that diff's digest wrote (None: nothing), `now` the file as the
    agent's writer left it afterwards (None: it never changed after the diff, so nothing
    was tried). It passes only if every line applied was shown and what was written after
    the diff was neither shown nor applied."""
    if error is not None:
        return _failed(probe, f"{error}; {probe.get('detail', '')}")
    if now is None:
        return {**probe, "state": NOT_RUN, "ok": False,
                "detail": "the agent's writer did not change the file after the diff: nothing "
                f"to check; {probe.get('detail', '')}"}
    if applied is None:
        return _failed(probe, "the apply under the diff's digest wrote nothing")
    lines = applied.decode(errors="replace").splitlines()
    added = {line[1:] for line in shown.splitlines() if line.startswith("+")}
    unseen = [line for line in dict.fromkeys(lines) if line not in added]
    if unseen:
        return _failed(probe, f"applied lines the diff did not show: {unseen[:3]}")
    if applied == now:
        return _failed(probe, "the apply wrote what the agent wrote after the diff")
    late = [line for line in dict.fromkeys(now.decode(errors="replace").splitlines())
            if line not in lines]
    if any(line in added for line in late):
        return _failed(probe, "the diff shows what was written after it was taken")
    return {**probe, "detail": f"{probe.get('detail', '')}; applied {len(applied)} bytes, "
            f"all shown by the diff; the {len(now)} written since were not applied"}


def passed(probes: list[dict]) -> bool:
    return bool(probes) and all(p.get("state") == PASSED for p in probes)


def tally(probes: list[dict]) -> dict[str, int]:
    return {"passed": sum(p.get("state") == PASSED for p in probes),
            "failed": sum(p.get("state") == FAILED for p in probes),
            "not_run": sum(p.get("state") == NOT_RUN for p in probes),
            "unrecorded": sum(bool(p.get("unrecorded")) for p in probes)}


# -- reading the records -------------------------------------------------------------------


@dataclass(frozen=True)
class Mark:
    """Where the records stood when the battery started."""

    seq: int
    """The audit log's last record: the battery's events come after it."""
    ts: float
    """The time it was taken: no event of the battery is older."""
    counters: dict[str, int]
    """The firewall's named counters (packets)."""


def _ask(control: Control, request: dict) -> dict:
    try:
        answer = control(request)
    except (OSError, ServiceUnavailable) as exc:
        raise RecordsUnavailable(f"the filter's control socket failed: {exc}") from None
    if not answer.get("ok"):
        raise RecordsUnavailable(f"the filter refused {request['op']}: {answer.get('error')}")
    return answer


def _counters(status: dict) -> dict[str, int]:
    firewall = status.get("firewall") or {}
    if not firewall.get("loaded"):
        return {}  # no firewall here: a counter expect then finds nothing, and fails
    return dict(firewall.get("counters") or {})


def mark_before(control: Control) -> Mark:
    ts = time.time()
    status = _ask(control, {"op": "status"})
    head = (status.get("audit") or {}).get("head") or {}
    return Mark(int(head.get("seq") or 0), ts, _counters(status))


def observe(control: Control, mark: Mark, session: str, after: int | None = None
            ) -> tuple[list[dict], int, dict[str, int]]:
    """The session's audit records after `after` (default: the mark), the last seq read, and
    how much each firewall counter grew since the mark."""
    after = mark.seq if after is None else after
    events = []
    while True:
        page = _ask(control, {"op": "audit", "after": after, "since": mark.ts, "limit": PAGE})
        for record in page.get("records") or []:
            after = max(after, int(record.get("seq") or 0))
            if record.get("session") == session:
                events.append(record)
        if not page.get("more"):
            break
    now = _counters(_ask(control, {"op": "status"}))
    grown = {name: packets - mark.counters.get(name, 0) for name, packets in now.items()}
    return events, after, grown


def confirm(probes: list[dict], control: Control, mark: Mark, session: str,
            settle: float = SETTLE) -> list[dict]:
    """`judge` against what the filter recorded for `session` since `mark`; while a denial
    is still unrecorded, read again for up to `settle` seconds (records on their way)."""
    deadline = time.monotonic() + settle
    events: list[dict] = []
    after = mark.seq
    while True:
        try:
            new, after, counters = observe(control, mark, session, after)
        except RecordsUnavailable as exc:
            return unconfirmed(probes, str(exc))
        events += new
        judged = judge(probes, events, counters)
        if not any(p.get("unrecorded") for p in judged) or time.monotonic() >= deadline:
            return judged
        time.sleep(0.2)
