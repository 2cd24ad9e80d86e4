"""The bypass battery's own machinery, without a sandbox: the registry, the three states and
the exit status, selection, the packets and files it builds, and how kernel refusals are read.
The probes themselves run against the real filter in tests/integration and tests/e2e."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import socket
import stat
import time

import pytest
from dnslib import DNSRecord

from appliance.policy import Policy, Rule, parse_host
from appliance.selftest import cli, inspection, kernel, review, wire
from appliance.selftest.kernel import judge_attempts
from appliance.selftest.registry import (
    FAILED,
    GROUPS,
    NOT_RUN,
    PASSED,
    REGISTRY,
    NotRun,
    Outcome,
    Registry,
    run_probe,
)
from appliance.selftest.review import hostile_tree
from appliance.selftest.starvation import pointer_chain_query
from appliance.selftest.wire import Context, Stream

BASE = ["--allowed", "allowed.test", "--gateway", "192.0.2.1"]


def args(*extra):
    return cli.parse_args([*BASE, *extra], REGISTRY)


# -- the registry ------------------------------------------------------------------------


def test_every_probe_has_a_group_a_class_and_says_what_records_its_denial():
    assert len(REGISTRY.probes) > 50
    for p in REGISTRY:
        assert p.group in GROUPS, p.id
        assert p.records, p.id
        if p.legit:
            assert p.budget is None, p.id  # a legitimate flow is not held to the FAST rule
        else:
            assert p.threat > 0 and p.budget is not None, p.id
        if p.group == "kernel":
            assert p.threat == 22 and p.records.startswith("nothing on the network"), p.id


def test_the_battery_covers_every_class_a_sandbox_can_try():
    attacks = {p.threat for p in REGISTRY if not p.legit}
    assert {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 18, 20, 21, 22, 23, 27, 28, 29,
            30, 31, 32, 33} <= attacks
    groups = {p.group: set() for p in REGISTRY}
    for p in REGISTRY:
        groups[p.group].add(p.id)
    assert {"userns-unshare", "userns-clone", "mount", "keyctl", "bpf", "perf-event-open",
            "userfaultfd", "ptrace-outside", "proc-sys-write", "raw-socket",
            "packet-socket"} == groups["kernel"]
    assert groups["review"] == {"review-hostile-files", "review-changed-after-diff"}
    assert "slow-connections" not in REGISTRY.probes  # the cap replaced it


def test_the_push_options_probes_push_what_the_filter_refuses_for_its_options_alone():
    """The probes' push (inspected-push-options-refused, ssh-push-options-refused): two
    branches of the session's own, push options asked for on the second command line as
    `push-options=1`, a merge request into main. The filter's own judge refuses it for the
    options; the same push without them it would let through."""
    from appliance.filter.git import http as git
    from appliance.policy.git import GitSpec

    ref, body = inspection.push_with_options("s1")
    assert ref.startswith("refs/heads/corral/s1/selftest-")
    verdict = git.judge(body, GitSpec.parse("corral-selftest/probe"), "s1")
    assert not verdict.allowed and verdict.options == ("merge_request.create",
                                                       "merge_request.target=main")
    assert f"ng {ref} corral: push option 'merge_request.create'".encode() in git.report(verdict)
    plain = inspection.receive_pack([f"{'0' * 40} {'1' * 40} {ref}\0report-status\n"])
    assert git.judge(plain, GitSpec.parse("corral-selftest/probe"), "s1").allowed


def test_the_session_is_the_hostname_unless_named():
    assert args().session == socket.gethostname()
    assert args("--session", "s1").session == "s1"


def test_a_probe_id_is_registered_once_and_groups_are_known():
    registry = Registry()
    registry.probe("x", 1)(lambda ctx: Outcome(True, ""))
    with pytest.raises(ValueError, match="registered twice"):
        registry.probe("x", 1)(lambda ctx: Outcome(True, ""))
    with pytest.raises(ValueError, match="group 'disk'"):
        registry.probe("y", 1, group="disk")


# -- states, selection, the exit status ----------------------------------------------------


class Clock:
    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_a_probe_ends_passed_failed_or_not_run():
    registry = Registry()

    @registry.probe("ok", 1)
    def ok(ctx):
        return Outcome(True, "refused", {"kind": "dns"})

    @registry.probe("no", 1)
    def no(ctx):
        return Outcome(False, "went through")

    @registry.probe("cannot", 1)
    def cannot(ctx):
        raise NotRun("no ICMP socket")

    @registry.probe("broken", 1)
    def broken(ctx):
        raise KeyError("boom")

    ctx = Context(args())
    got = {p.id: run_probe(p, ctx) for p in registry}
    assert {k: r.state for k, r in got.items()} == {
        "ok": PASSED, "no": FAILED, "cannot": NOT_RUN, "broken": FAILED}
    assert got["cannot"].detail == "no ICMP socket" and got["cannot"].expect is None
    assert got["broken"].detail == "KeyError: 'boom'"
    assert got["ok"].to_json() == {"id": "ok", "threat": 1, "legit": False, "group": "network",
                                   "state": "passed", "ok": True, "ms": got["ok"].ms,
                                   "detail": "refused", "expect": {"kind": "dns"}}
    assert got["cannot"].to_json()["ok"] is False  # not run is never reported as passed


def test_an_attack_refused_too_slowly_is_a_hang_and_fails_but_a_slow_legit_flow_passes():
    registry = Registry()
    registry.probe("slow-denial", 1)(lambda ctx: Outcome(True, "403"))
    registry.probe("waits", 20, budget=lambda a: a.silence + 3)(lambda ctx: Outcome(True, ""))
    registry.probe("slow-legit", 0, legit=True)(lambda ctx: Outcome(True, "200"))
    slow, waits, legit = registry
    ctx = Context(args("--silence", "6"))
    result = run_probe(slow, ctx, clock=Clock(0.0, 3.5))
    assert result.state == FAILED and result.detail.startswith("too slow (3500.0 ms")
    assert run_probe(waits, ctx, clock=Clock(0.0, 8.9)).state == PASSED
    assert run_probe(waits, ctx, clock=Clock(0.0, 9.1)).state == FAILED
    assert run_probe(legit, ctx, clock=Clock(0.0, 30.0)).state == PASSED


def run_main(registry, *argv):
    out = io.StringIO()
    code = cli.main([*BASE, *argv], registry=registry, out=out)
    return code, out.getvalue()


def small_registry(cannot_run=False):
    registry = Registry()
    registry.probe("net", 1)(lambda ctx: Outcome(True, "refused"))
    registry.probe("needs-private", 7, needs="private_name")(lambda ctx: Outcome(True, "403"))

    @registry.probe("kern", 22, group="kernel")
    def kern(ctx):
        if cannot_run:
            raise NotRun("no libc")
        return Outcome(True, "EPERM")

    return registry


def test_exit_status_is_zero_only_when_every_selected_probe_passed():
    assert run_main(small_registry())[0] == 0
    code, out = run_main(small_registry(cannot_run=True), "--json")
    assert code == 1  # not run fails the run
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(p["id"], p["state"]) for p in lines[:-1]] == [("net", "passed"),
                                                           ("kern", "not-run")]
    assert lines[-1]["summary"]["not_run"] == 1


def test_a_skipped_group_is_reported_not_silently_dropped():
    code, out = run_main(small_registry(cannot_run=True), "--skip-group", "kernel")
    assert code == 0
    assert "group kernel skipped by --skip-group (1 probes)" in out.splitlines()[-1]
    code, out = run_main(small_registry(), "--skip-group", "kernel", "--json")
    summary = json.loads(out.splitlines()[-1])["summary"]
    assert summary["skipped_groups"] == {"kernel": ["kern"]}
    assert summary["unselected"] == {"needs-private": "needs --private-name"}


def test_only_runs_the_named_probes_and_one_it_cannot_try_is_not_run():
    code, out = run_main(small_registry(), "--only", "needs-private", "--json")
    (probe, _) = [json.loads(line) for line in out.splitlines()]
    assert code == 1 and probe["state"] == "not-run"
    assert probe["detail"] == "needs --private-name"
    code, out = run_main(small_registry(), "--only", "needs-private", "--private-name", "p.test")
    assert code == 0 and out.startswith("PASS ")


def test_unknown_probes_and_groups_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        run_main(small_registry(), "--only", "no-such-probe")
    assert info.value.code == 2 and "unknown probe(s) no-such-probe" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_main(small_registry(), "--skip-group", "disk")


def test_list_shows_every_probe_with_what_records_it():
    out = io.StringIO()
    assert cli.main(["--list"], out=out) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == len(REGISTRY.probes)
    (cap,) = [line for line in lines if line.startswith("proxy-connection-cap ")]
    assert "T21" in cap and "connections open" in cap


# -- what the probes build ---------------------------------------------------------------


def test_the_worst_dns_packet_chains_pointers_and_references_the_chain_many_times():
    data = pointer_chain_query(1200, 0x1234)
    assert 1180 <= len(data) <= 1232  # fits a UDP query
    record = DNSRecord.parse(data)  # well-formed for a parser that follows pointers
    assert record.header.id == 0x1234 and len(record.questions) == 1
    references = record.rr[1:]
    assert len(references) >= 25  # many names...
    depth = len(references[0].rname.label)
    assert depth >= 200  # ...each one a walk down the whole chain
    assert all(len(r.rname.label) == depth for r in references)
    assert record.header.a > 0  # a query with answers: refusable before any name is read
    big = pointer_chain_query(12_000, 1)  # over TCP: the chain as long as Python recurses
    assert 11_900 <= len(big) <= 12_000
    assert int.from_bytes(big[6:8], "big") > 600


def test_a_stream_reads_pipelined_responses_one_by_one():
    left, right = socket.socketpair()
    with left, right:
        right.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
                      b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\nTrailer: t\r\n\r\n"
                      b"HTTP/1.1 403 Forbidden\r\nX-Corral-Deny: no\r\nContent-Length: 0\r\n\r\n")
        right.shutdown(socket.SHUT_WR)
        left.settimeout(2)
        stream = Stream(left)
        assert stream.response() == (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", b"hello")
        assert stream.response()[1] == b"abcde"
        head, _ = stream.response()
        assert wire.from_corral(head, 403, "X-Corral-Deny")
        assert not wire.from_origin(head)
        assert stream.rest(timeout=1) == (b"", True)


def test_rest_tells_an_open_connection_from_a_closed_one():
    left, right = socket.socketpair()
    with left, right:
        right.sendall(b"more")
        assert Stream(left).rest(timeout=0.05) == (b"more", False)


def test_a_reset_ends_a_response_as_a_close_would():
    """A server that answers, then closes with the client's bytes unread, resets: what came
    before the reset is the answer, read as far as it goes, never an exception."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=2)
        conn, _ = server.accept()
        with client, conn:
            client.sendall(b"unread by the server")
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nX-Corral-Error: no\r\n"
                         b"Content-Length: 3\r\n\r\nn")
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            conn.close()  # linger 0: a reset
            stream = Stream(client)
            head, body = stream.response()
            assert wire.from_corral(head, 400, "X-Corral-Error") and body == b"n"
            assert stream.rest(timeout=1) == (b"", True)


def test_the_hostile_tree_holds_every_entry_it_names(tmp_path):
    root = os.fsencode(tmp_path / "review")
    made = hostile_tree(root)
    kinds = {}
    for name in made:
        info = os.lstat(os.path.join(root, name))
        kinds[name] = stat.S_IFMT(info.st_mode)
    assert kinds[b"fifo"] == stat.S_IFIFO
    assert kinds[b"loop-a"] == kinds[b"loop-b"] == kinds[b"loop-self"] == stat.S_IFLNK
    with pytest.raises(OSError) as info:
        os.stat(os.path.join(root, b"loop-a"))
    assert info.value.errno == errno.ELOOP
    assert os.lstat(os.path.join(root, b"hardlink.txt")).st_nlink == 2
    with open(os.path.join(root, b"late-invalid-utf8.txt"), "rb") as f:
        late = f.read()
    late[:8192].decode()  # valid for the first 8 KiB...
    with pytest.raises(UnicodeDecodeError):
        late.decode()  # ...and not after
    (odd,) = [n for n in made if n.startswith(b"name-")]
    with pytest.raises(UnicodeDecodeError):
        odd.decode()
    assert any(b"\n" in n and b"\x1b[" in n for n in made)
    (deep,) = [n for n in made if n.startswith(b"deep/")]
    assert deep.count(b"/") == 200 and os.path.isfile(os.path.join(root, deep))


def test_the_review_probe_names_its_files_relative_to_the_workspace(tmp_path):
    ctx = Context(args("--workdir", str(tmp_path)))
    outcome = review.review_hostile_files(ctx)
    assert outcome.ok and outcome.expect["kind"] == "review"
    paths = outcome.expect["paths"]
    assert all(p.startswith("corral-selftest-review/") for p in paths)
    assert all(os.path.lexists(tmp_path / p) for p in paths)
    assert json.loads(json.dumps(paths)) == paths  # survives the trip as JSON
    again = review.review_hostile_files(ctx)  # a second run replaces the first
    assert again.expect["paths"] == paths


def test_the_changed_after_diff_probe_leaves_a_writer_that_outlives_it(tmp_path):
    """The probe returns at once; its writer goes on rewriting the file (a new version each
    time) until its directory is removed, as the appliance does after its check."""
    outcome = review.review_changed_after_diff(Context(args("--workdir", str(tmp_path))))
    assert outcome.ok and outcome.expect == {"kind": "review-snapshot",
                                             "root": review.SNAPSHOT_DIR,
                                             "path": review.CHANGING}
    pid = int(outcome.detail.split()[1])
    path = tmp_path / review.CHANGING
    seen = set()
    deadline = time.monotonic() + 10
    while len(seen) < 3 and time.monotonic() < deadline:
        seen.add(path.read_bytes().split(b"\n", 1)[0])
        time.sleep(0.03)
    assert len(seen) >= 3, seen  # still writing, a new version each time
    (tmp_path / review.SNAPSHOT_DIR).rename(tmp_path / "gone")  # as the appliance does:
    shutil.rmtree(tmp_path / "gone")  # moved away first, so it cannot write a file back in
    deadline = time.monotonic() + 10
    while os.waitpid(pid, os.WNOHANG) == (0, 0):  # it stops by itself
        assert time.monotonic() < deadline, "the writer outlived its directory"
        time.sleep(0.05)


def test_the_review_probe_is_not_run_where_it_cannot_write(tmp_path):
    ctx = Context(args("--workdir", str(tmp_path / "missing")))
    with pytest.raises(NotRun, match="cannot write the files"):
        review.review_hostile_files(ctx)


# -- kernel refusals ---------------------------------------------------------------------


def test_every_attempt_refused_passes_anything_done_or_unclear_fails():
    assert judge_attempts([("unshare", -1, errno.EPERM), ("mount", -1, errno.EROFS),
                           ("bpf", -1, errno.ENOSYS), ("open", -1, errno.EACCES)]).ok
    done = judge_attempts([("unshare", -1, errno.EPERM), ("clone", 4242, 0)])
    assert not done.ok and "clone: DONE (returned 4242)" in done.detail
    unclear = judge_attempts([("bpf", -1, errno.EINVAL)])
    assert not unclear.ok and "EINVAL (neither refused nor done)" in unclear.detail
    assert "cannot tell" in unclear.detail


def test_an_attempt_runs_in_a_child_and_changes_nothing_here(tmp_path):
    before = os.getcwd()

    def attempt():
        os.chdir(tmp_path)  # what a successful unshare or mount would be: the child's own
        return os.getpid(), 0

    pid, err = kernel._attempt(attempt)
    assert pid != os.getpid() and err == 0
    assert os.getcwd() == before


def test_an_attempt_that_cannot_try_is_not_run_and_one_that_breaks_fails():
    def cannot():
        raise NotRun("no such system call here")

    with pytest.raises(NotRun, match="no such system call"):
        kernel._attempt(cannot)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        kernel._attempt(lambda: 1 / 0)


def test_the_battery_is_standard_library_only():
    """It runs in sandboxes where nothing of corral is installed (the image carries it as one
    zipapp): every module imports the standard library or its siblings, nothing else."""
    import ast
    import sys
    from pathlib import Path

    import appliance.selftest

    package = Path(appliance.selftest.__file__).parent
    files = sorted(package.rglob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "__main__.py", "registry.py", "wire.py",
                                       "kernel.py", "cli.py"}
    for path in files:
        tree = ast.parse(path.read_text())
        modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                   for a in n.names}
        modules |= {n.module.split(".")[0] for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module}
        assert modules - {"__future__"} <= sys.stdlib_module_names, (path.name, modules)
        beyond = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                  and n.level > 1]
        assert not beyond, f"{path.name} imports from outside the package at lines {beyond}"


def test_what_an_echoing_origin_got_is_checked_and_a_real_origin_is_taken_at_its_word():
    echo = json.dumps({"method": "GET", "headers": {"host": "a.test"}}).encode()
    assert wire.host_seen(echo, "a.test") == (True, "the origin got Host a.test")
    assert wire.host_seen(echo, "b.test") == (False, "the origin got Host a.test")
    port = json.dumps({"headers": {"host": "a.test:80"}}).encode()
    assert wire.host_seen(port, "a.test")[0]  # the same authority, port written out
    assert not wire.host_seen(json.dumps({"headers": {"host": "a.test:8080"}}).encode(),
                              "a.test")[0]
    no_host = json.dumps({"headers": {}}).encode()
    assert wire.host_seen(no_host, "a.test") == (False, "the origin got no Host")
    assert wire.host_seen(b"<html>", "a.test") == (True, "the origin does not echo what "
                                                    "it got")


@pytest.mark.parametrize(("spell", "path", "spelt"), [
    (inspection.suffixed, "/corral-selftest-denied", "/corral-selftest-denied.json"),
    (inspection.suffixed, "/a/b/", "/a/b.json"),
    (inspection.escaped_separator, "/corral-selftest-denied", "/corral-selftest-denied%3Bx"),
    (inspection.escaped_separator, "/a/b", "/a%3Bx/b"),
    (inspection.fullwidth, "/corral-selftest-denied", "/%EF%BD%83orral-selftest-denied"),
    (inspection.fullwidth, "/-/9", "/-/%EF%BC%99"),
])
def test_the_path_probes_spell_the_denied_request_as_servers_route_it(spell, path, spelt):
    """Each T27 probe's spelling of `--denied-request`, and the policy's verdict on it where
    the throwaway session's rule denies the plain path (cli/sessions.py)."""
    assert spell(path) == spelt
    if path == "/corral-selftest-denied":
        policy = Policy([Rule.parse("request", f"!h.example GET {path}/**")])
        assert not policy.inspection(parse_host("h.example")).decide("GET", spelt).allowed


@pytest.mark.parametrize(("spell", "path"), [(inspection.suffixed, "/"),
                                             (inspection.fullwidth, "/-/_")])
def test_a_path_probe_without_anything_to_spell_is_not_run(spell, path):
    with pytest.raises(NotRun):
        spell(path)


@pytest.fixture
def resolver():
    """A resolver on 127.0.0.1 answering every A question with NEIGHBOUR_ADDRESS, as the
    session gateway answers a name the policy allows."""
    import threading

    from dnslib import QTYPE, RR, A

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    done = threading.Event()

    def serve():
        while not done.is_set():
            try:
                data, peer = sock.recvfrom(512)
            except OSError:
                continue
            query = DNSRecord.parse(data)
            reply = query.reply()
            reply.add_answer(RR(query.q.qname, QTYPE.A, rdata=A(NEIGHBOUR_ADDRESS), ttl=5))
            sock.sendto(reply.pack(), peer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield sock.getsockname()[1]
    done.set()
    thread.join(2)
    sock.close()


NEIGHBOUR_ADDRESS = "127.77.29.1"
"""An address nothing listens on: TCP 443 there is refused at connect."""


def test_a_neighbour_tunnel_refused_before_tls_is_no_pass_of_the_neighbour_probe(resolver):
    """neighbour-transparent-refused passes only on the filter's recorded refusal of TLS to
    the neighbour (an access_denied alert naming the inspected host). A connection refused
    before TLS never reached that refusal: the probe was not run, not passed unrecorded."""
    with pytest.raises(ConnectionRefusedError):  # what the probe meets there
        socket.create_connection((NEIGHBOUR_ADDRESS, 443), timeout=2).close()
    probe = REGISTRY.probes["neighbour-transparent-refused"]
    ctx = Context(args("--gateway", "127.0.0.1", "--dns-port", str(resolver), "--inspected",
                       "inspected.test", "--neighbour", "neighbour.test"))
    result = run_probe(probe, ctx)
    assert result.state != PASSED or result.expect, result.to_json()
    assert result.state == NOT_RUN and "refused" in result.detail, result.to_json()
