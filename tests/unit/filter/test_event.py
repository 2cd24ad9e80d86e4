"""The event type: what every emitter publishes is exactly what it published before Event
existed (transcripts taken from that code), the bus refuses anything else, and the names
the emitters write, the names the CLI and the dashboard read and the names docs/filter.md
lists are SCHEMA's, so that none of them can drift from it."""

from __future__ import annotations

import ast
import asyncio
import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from appliance.event import FIELDS, KINDS, NAMES, REQUIRED, SCHEMA, Event, decode
from appliance.filter import events as ev
from appliance.filter.approvals import Holds
from appliance.filter.dns.filter import DnsFilter
from appliance.filter.dns.guard import Report
from appliance.filter.drops import drop_event
from appliance.filter.listeners import Listeners
from appliance.filter.proxy import Proxy
from appliance.filter.proxy.credentials import Leak
from appliance.filter.proxy.plan import leak_decision
from appliance.filter.relay import Counters
from appliance.filter.revocation import cut_event
from appliance.firewall.learned import Cut
from appliance.firewall.ledger import Revoked
from appliance.firewall.nflog import Drop
from appliance.policy import Decision, parse_host
from appliance.policy.rules import Rule

ROOT = Path(__file__).resolve().parents[3]

TRANSCRIPT = Path(__file__).with_name("events_before.jsonl")
"""What the bus published for the inputs of `_published` below, taken from the code before
Event (each emitter built its dict by hand): keys, their order and values; `ts` and the
approval's random id fixed. A subscriber, `monitor --json` and the audit log get these."""


def _published(monkeypatch) -> list[str]:
    """Every emitter the tests can reach without sockets, fed fixed inputs: what the bus
    published, as the control socket writes it (`ts` fixed; approval ids are random)."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    bus = ev.EventBus()
    lines: list[str] = []
    emit = bus.emit

    def published(event):
        out = emit(event)
        shown = {**out, "ts": 1.5}
        if shown["kind"] == "approval":
            shown["approval"] = "a-1"
            shown["reason"] = shown["reason"].replace(out["approval"], "a-1")
        lines.append(json.dumps(shown, separators=(",", ":")))
        return out

    bus.emit = published
    rule, runtime = Rule("http", "pypi.org", layer="project"), Rule("dns", "files.test",
                                                                     layer="runtime")
    allow = Decision(True, "allowed by http rule pypi.org", rule)
    deny = Decision(False, "no rule allows evil.test", None, "corral allow-http evil.test")
    learning = Decision(True, "learning: allowed", None, "corral allow-http new.test")
    proxy = SimpleNamespace(bus=bus)
    client = SimpleNamespace(label="10.213.1.2:40000", address="10.213.1.2")

    opened = bus.decision(allow, session="s1", client="10.213.1.2:40000", kind="http",
                          name="pypi.org", port=443, address="151.101.0.223", event_id=7,
                          method="GET", path="/simple/")
    bus.decision(deny, session="s1", client="10.213.1.2", kind="dns", name="evil.test",
                 qtype="A")
    bus.decision(learning, session="s1", client="10.213.1.2:40001", kind="connect",
                 name="new.test", port=443, address="1.2.3.4", event_id=9)
    bus.decision(Decision(False, "connect failed"), session=None, client="10.0.0.9:1",
                 kind="tls", name="x.test", port=443, verdict="error", event_id=10)
    bus.decision(allow, session="s1", client="10.213.1.2", kind="dns", name="pypi.org",
                 qtype="A", answers=["151.101.0.223"], removed=["10.0.0.1 (blocked)"],
                 learned="not learned: the filter has no firewall to teach")
    bus.decision(deny, session="s1", client="10.213.1.2:40002", kind="leak", name="x.test",
                 port=443, method="POST", path="/up", secrets=["gh"], detector="aws-key")
    counters = Counters(up=10, down=20)
    counters.duration = lambda: 0.25
    Proxy.closed(proxy, opened, counters)
    leak = Leak("a header", "gh")
    Proxy.leaked(proxy, client, "s1", parse_host("evil.test"), leak,
                 leak_decision(parse_host("evil.test"), leak))
    Proxy.refused(proxy, client, "s1", SimpleNamespace(report=lambda s, n: 3, limit=64,
                                                       what="connections"))
    bus.emit(ev.rule_changed("s1", runtime, "added", 1764300000.0))
    bus.emit(ev.rule_changed("s1", runtime, "revoked"))
    bus.emit(ev.retired(["audit-000000000001.jsonl"], 42))
    key = ("10.213.1.2", "1.2.3.4", 22)
    bus.emit(cut_event(Cut(Revoked(key, "s1", ("git.test",), deny), 2), None))
    bus.emit(cut_event(Cut(Revoked(key, "", (), deny), 0, "conntrack failed"), "s2"))
    bus.emit(drop_event(Drop("s1", "udp", "10.213.1.2", "8.8.8.8", 53), {"s1"},
                        {"10.213.1.1"}, frozenset()))
    DnsFilter._report(SimpleNamespace(bus=bus, limits=SimpleNamespace(
        describe=lambda limit: f"the {limit} limit")), "s1", "10.213.1.2", Report("rate", 5))
    Listeners._unserved(SimpleNamespace(bus=bus, unserved={}), "s3", "address in use")

    async def approval():
        holds = Holds(bus.emit)
        pending = holds.ask("s1", deny, "proxy", "10.213.1.2:40000", "evil.test", 443,
                            note="need it")
        holds.decide(pending.id, "session", "tester")
    asyncio.run(approval())
    return lines


def test_every_emitter_publishes_what_it_did_before_events_were_typed(monkeypatch):
    assert _published(monkeypatch) == TRANSCRIPT.read_text().splitlines()


def test_the_audit_log_records_an_event_as_its_dict_sorted(tmp_path):
    from appliance.filter.audit import AuditLog, encode

    bus = ev.EventBus()
    bus.audit = AuditLog(tmp_path / "audit.jsonl")
    event = bus.emit(Event(session="s1", kind="dns", verdict="deny", reason="no rule",
                           name="a.test", ts=1.5))
    bus.audit.close()
    line = (tmp_path / "audit.jsonl").read_bytes().rstrip(b"\n")
    assert line == encode(1, "0" * 64, dict(event)) == (
        b'{"id":1,"kind":"dns","name":"a.test","prev":"' + b"0" * 64 +
        b'","reason":"no rule","seq":1,"session":"s1","ts":1.5,"verdict":"deny"}')


def test_the_bus_takes_an_event_and_nothing_else():
    bus = ev.EventBus()
    with pytest.raises(TypeError, match=r"an event is an Event .*not dict: build it as "
                                        r"Event\(kind="):
        bus.emit({"session": "s1", "kind": "dns", "verdict": "deny", "reason": "no"})
    with pytest.raises(TypeError, match="Event got 'bogus': no such field; the fields are "
                                        "SCHEMA's"):
        bus.decision(Decision(False, "no"), session="s1", client="c", kind="dns",
                     name="a.test", bogus=1)
    assert not bus.recent and not bus.counters  # nothing of either was published


def test_every_event_the_code_builds_uses_schema_names_and_says_kind_verdict_and_reason():
    """What `Event(name=...)` writes is checked here, once, rather than per event by emit
    (the proxy emits one per request): every keyword is a field, and an event built of
    keywords alone has the three every event has."""
    built, wrong = 0, []
    for path in sorted((ROOT / "appliance").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "Event"):
                continue
            built += 1
            names = {k.arg for k in node.keywords}
            whole = None not in names and not node.args  # no **spread, no mapping
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            wrong += [f"{where}: {n}" for n in sorted(names - NAMES - {None})]
            wrong += [f"{where}: kind {k.value.value!r}" for k in node.keywords
                      if k.arg == "kind" and isinstance(k.value, ast.Constant)
                      and k.value.value not in KINDS]
            if whole and not names >= REQUIRED:
                wrong.append(f"{where}: without {sorted(REQUIRED - names)}")
    assert built >= 15 and not wrong


def _reads(source: str, function: str, variable: str) -> set[str]:
    """The fields `function` in a Python source reads of `variable` (v["x"], v.get("x"))."""
    tree = next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.FunctionDef) and n.name == function)
    read = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and node.value.id == variable and isinstance(node.slice, ast.Constant)):
            read.add(node.slice.value)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get" and isinstance(node.func.value, ast.Name)
                and node.func.value.id == variable and node.args
                and isinstance(node.args[0], ast.Constant)):
            read.add(node.args[0].value)
    return read


def test_what_the_cli_and_the_dashboard_read_of_an_event_are_schema_fields():
    monitor = _reads((ROOT / "cli/output.py").read_text(), "event", "e")
    asking = _reads((ROOT / "cli/approvals.py").read_text(), "see", "event")
    script = (ROOT / "cli/dashboard/static/dashboard.js").read_text()
    body = script[script.index("function renderDecisions"):]
    body = body[:body.index("\n}\n")]
    dashboard = set(re.findall(r"\be\.([a-z_]+)", body))
    assert {"ts", "verdict", "hint", "closed", "up"} <= monitor  # the reader was read
    assert {"approval", "grant_kind", "note"} <= asking and {"ts", "hint"} <= dashboard
    assert not (monitor | asking | dashboard) - NAMES


def test_docs_list_every_field_as_the_schema_defines_it():
    text = (ROOT / "docs/filter.md").read_text()
    section = text[text.index("**Event fields.**"):]
    rows = [line for line in section.splitlines()[1:] if line.startswith("| `")]
    documented = [tuple(cell.strip().replace("\\|", "|")
                        for cell in re.split(r"(?<!\\)\|", row)[1:-1]) for row in rows]
    assert documented == [(f"`{f.name}`", f.type, f.kinds, f.meaning) for f in SCHEMA]
    assert [f.name for f in SCHEMA] == list(FIELDS) and len(NAMES) == len(FIELDS)


def test_a_reader_keeps_the_fields_it_knows_and_drops_the_rest():
    wire = {"ts": 1.5, "kind": "dns", "verdict": "deny", "future_field": 1, "name": "a.test"}
    event = decode(wire)
    assert type(event) is Event and dict(event) == {"ts": 1.5, "kind": "dns",
                                                    "verdict": "deny", "name": "a.test"}


def test_the_event_module_is_standard_library_only():
    """The CLI imports it (to read events by the same names): it must pull in nothing."""
    import sys

    tree = ast.parse((ROOT / "appliance/event.py").read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
               for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module}
    assert modules and modules <= set(sys.stdlib_module_names) | {"__future__"}
