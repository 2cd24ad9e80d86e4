"""The battery's probes against the real filter on loopback, and the appliance's check of
them (appliance/sandbox/battery.py) against what that filter really recorded: a denial
counts only in the session that met it, and only after the battery started.

Only probes that mean something on loopback run here (no firewall, no transparent redirect);
the whole battery runs from real sandboxes in tests/e2e."""

from __future__ import annotations

import subprocess
import sys

import pytest

from appliance.sandbox import battery

ON_LOOPBACK = ["dns-allowed", "http-via-proxy", "https-via-proxy", "dns-exfiltration",
               "dns-over-https-denied-host", "metadata-via-proxy", "proxy-to-loopback",
               "connect-inside-tunnel", "host-header-mismatch", "domain-fronting",
               "malformed-dns", "giant-header", "placeholder-in-a-name",
               "placeholder-to-an-allowed-host", "hostile-name-recorded-escaped"]


@pytest.fixture(scope="module")
def run(corral_filter):
    """The battery from 127.0.0.1 (session s1): (the mark before it, its probes)."""
    mark = battery.mark_before(corral_filter.control)
    result = subprocess.run(
        [sys.executable, "-m", "appliance.selftest", "--json", "--gateway", "127.0.0.1",
         "--dns-port", str(corral_filter.dns_port), "--proxy-port", str(corral_filter.proxy_port),
         "--allowed", "allowed.test", "--denied", "denied.test",
         *[arg for probe in ON_LOOPBACK for arg in ("--only", probe)]],
        capture_output=True, text=True, timeout=120)
    probes, summary = battery.parse(result.stdout)
    assert summary is not None, result.stderr
    return mark, probes, result.returncode


def test_every_probe_passes_and_every_denial_is_found_in_the_sessions_records(
        corral_filter, run):
    mark, probes, returncode = run
    assert returncode == 0 and {p["id"] for p in probes} == set(ON_LOOPBACK)
    judged = battery.confirm(probes, corral_filter.control, mark, "s1")
    assert battery.passed(judged), [p for p in judged if p["state"] != "passed"]
    assert sum(1 for p in judged if p["expect"]) == 12


def test_a_denial_recorded_for_another_session_does_not_count(corral_filter, run):
    mark, probes, _ = run
    judged = battery.confirm(probes, corral_filter.control, mark, "s2", settle=0)
    unrecorded = {p["id"] for p in judged if p.get("unrecorded")}
    assert unrecorded == {p["id"] for p in probes if p["expect"]}
    assert all(p["detail"].startswith("denied but not recorded: expected {")
               for p in judged if p.get("unrecorded"))
    assert not battery.passed(judged)


def test_a_denial_recorded_before_the_battery_started_does_not_count(corral_filter, run):
    _, probes, _ = run
    later = battery.mark_before(corral_filter.control)
    judged = battery.confirm(probes, corral_filter.control, later, "s1", settle=0)
    assert {p["id"] for p in judged if p.get("unrecorded")} == {
        p["id"] for p in probes if p["expect"]}
