"""The whole product path on the local backend: `corral run/shell/ls/selftest/diff/apply/
stop/rm/down/up` against the API, the sandbox service, real podman, the real filter and
firewall — as a person would use it, in the appliance namespace the World brought up."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import pty
import select
import signal
import subprocess
import time
import tomllib

import pytest

from appliance.sandbox.podman import Podman

from . import netns
from .conftest import APPLIANCE_NAME, BIN

PROJECT_POLICY = """
[http]
allow = ["allowed.test", "private.test"]
[tcp]
allow = ["ssh.test:22"]
"""
BATTERY = ["--allowed", "allowed.test", "--denied", "denied.test", "--foreign-resolver",
           "203.0.113.53", "--v6-target", "3fff:ff::10", "--private-name", "private.test",
           "--tcp-name", "ssh.test:22", "--silence", "6"]  # the e2e header_timeout is 5


def corral(world, *args, check=True, timeout=600):
    command, *rest = args
    result = world.corral(command, "--appliance", APPLIANCE_NAME, *rest, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"corral {' '.join(args)}: exit {result.returncode}\n"
                             f"{result.stdout}{result.stderr}")
    return result


@pytest.fixture(scope="module")
def project(world):
    path = world.dir / "cli-project"
    (path / ".corral").mkdir(parents=True)
    (path / ".corral" / "client.key").write_text("never inside")
    (path / "corral.toml").write_text(PROJECT_POLICY)
    (path / "app.py").write_text("print('v1')\n")
    (path / "notes.md").write_text("notes\n")
    return path


@pytest.fixture(scope="module")
def c1(world, sandbox_image, project):
    started = time.monotonic()
    result = corral(world, "run", "--project", str(project), "--name", "c1", "--detach",
                    "--preset", "pypi", "--json")
    print(f"corral run --detach: session c1 up in {time.monotonic() - started:.2f}s")
    yield json.loads(result.stdout)
    corral(world, "rm", "c1", check=False)


def test_run_says_where_a_starts_time_went(c1):
    """`corral run --json` carries each step of the start on the appliance, in order."""
    assert list(c1["took"]) == ["network", "files", "filter", "container"], c1
    assert all(isinstance(v, float) and 0 <= v < 600 for v in c1["took"].values()), c1
    print(f"session c1's start on the appliance: {c1['took']}")


def test_run_starts_a_listed_session(world, c1):
    listed = {s["name"]: s for s in json.loads(corral(world, "ls", "--json").stdout)["sessions"]}
    assert listed["c1"]["container_state"] == "running" and listed["c1"]["state"] == "running"
    assert listed["c1"]["presets"] == ["pypi"] and listed["c1"]["project"].startswith(
        "cli-project-")
    table = corral(world, "ls").stdout
    assert table.splitlines()[0].split() == ["SESSION", "STATE", "AGE", "LEFT", "SUBNET",
                                             "ALLOWED", "DENIED", "MEM/CPU/PIDS", "AGENT"]
    assert listed["c1"]["memory"] == "4g" and listed["c1"]["left"] is None  # no limit set
    assert any(line.split()[:2] == ["c1", "running"] for line in table.splitlines())
    rules = json.loads(corral(world, "rules", "--session", "c1", "--json").stdout)["rules"]
    assert {"allowed.test", "pypi.org"} <= {r["rule"] for r in rules}  # project + preset


def test_the_filter_listens_on_gateways_and_leaves_the_hosts_resolvers_their_port(world, c1):
    """`corral up --backend local` came up next to a workstation's resolvers holding port 53
    (resolvers.py: systemd-resolved's 127.0.0.53, dnsmasq's 192.168.122.1), and a session
    resolves through the filter on its own gateway."""
    assert world.resolvers.poll() is None  # still holding their sockets
    held = (world.dir / "resolvers-ready").read_text().split()
    assert held == ["127.0.0.53:53", "127.0.0.53:53", "192.168.122.1:53", "192.168.122.1:53"]
    listeners = world.control({"op": "status"})["listeners"]
    sessions = world.control({"op": "sessions"})["sessions"]
    gateways = {str(next(ipaddress.ip_network(s["subnet"]).hosts())) for s in sessions}
    assert {"10.213.1.1", "10.213.2.1", c1["gateway"]} <= gateways
    assert {a.rpartition(":")[0] for names in listeners.values() for a in names} <= gateways
    assert f"{c1['gateway']}:53" in listeners["dns_udp"]
    out = corral(world, "shell", "c1", "--", "getent", "ahostsv4", "allowed.test").stdout
    assert out.split()[0] == "203.0.113.10"  # the fake internet's answer, through the filter


def test_a_command_runs_as_the_hardened_user_in_work(world, c1):
    out = corral(world, "shell", "c1", "--", "sh", "-c",
                 "id -u; pwd; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; ls -A; "
                 "touch /x 2>&1 || echo read-only").stdout.split()
    assert out[0] != "0" and out[1] == "/work"
    assert out[2:6] == ["CapEff:", "0000000000000000", "NoNewPrivs:", "1"]
    assert sorted(out[6:9]) == ["app.py", "corral.toml", "notes.md"]  # no .corral
    assert out[-1] == "read-only"


class Terminal:
    """`corral shell` on a real pseudo-terminal, as a person types into it."""

    def __init__(self, world, session):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the CLI in the appliance namespace
            os.execve("/usr/bin/nsenter", ["nsenter", f"--net=/run/netns/{netns.APPLIANCE}",
                                           str(BIN / "corral"), "shell", "--appliance",
                                           APPLIANCE_NAME, session], world.cli_env)
        self.seen = b""

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode() + b"\n")

    def expect(self, marker: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while marker.encode() not in self.seen:
            ready, _, _ = select.select([self.fd], [], [], max(0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"no {marker!r} within {timeout}s; saw {self.seen[-500:]!r}")
            try:
                self.seen += os.read(self.fd, 65536)
            except OSError:
                raise AssertionError(f"the terminal closed; saw {self.seen[-500:]!r}") from None
        return self.seen.decode(errors="replace")

    def close(self, timeout: float = 30) -> None:
        """`exit` typed; killed if the shell is not gone within `timeout` (never a hang)."""
        self.send("exit")
        deadline = time.monotonic() + timeout
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    self.kill()
                    break
                if select.select([self.fd], [], [], 0.05)[0]:  # a full terminal stops it
                    with contextlib.suppress(OSError):
                        os.read(self.fd, 65536)
        os.close(self.fd)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)


def test_reattach_gives_a_second_shell_in_the_same_container(world, c1):
    first, second = Terminal(world, "c1"), Terminal(world, "c1")
    try:
        first.send("echo $((6*7))-first; touch /tmp/left-by-first; tty")
        first.expect("42-first")
        assert "/dev/pts/" in first.expect("/dev/pts/")  # a real terminal inside
        second.send("test -e /tmp/left-by-first && echo $((6*7))-second-sees-it")
        second.expect("42-second-sees-it")
        first.send("echo shell-$$-of-$(hostname)")
        second.send("echo shell-$$-of-$(hostname)")
        mine = [line for line in first.expect("of-corral-c1").split() if
                line.startswith("shell-") and line.endswith("of-corral-c1")]
        theirs = [line for line in second.expect("of-corral-c1").split() if
                  line.startswith("shell-") and line.endswith("of-corral-c1")]
        assert mine and theirs and mine[-1] != theirs[-1]  # two shells, one container
        first.close()
        second.close()
    finally:
        first.kill()
        second.kill()


def test_selftest_passes_in_the_session_and_every_denial_is_recorded(world, c1):
    """Every group, as a person runs it; the appliance checked each denial's record."""
    result = corral(world, "selftest", "c1", *BATTERY, "--json", check=False)
    answer = json.loads(result.stdout)
    failed = [p for p in answer["probes"] if p["state"] != "passed"]
    assert result.returncode == 0 and answer["passed"] and not failed, json.dumps(failed)
    assert answer["tally"]["unrecorded"] == 0
    assert {p["group"] for p in answer["probes"]} == {"network", "kernel", "review"}
    human = corral(world, "selftest", "c1", *BATTERY, "--only", "dns-exfiltration").stdout
    assert "1/1 probes passed in c1" in human


def test_selftest_shows_what_did_not_run_and_what_was_left_out(world, c1):
    result = corral(world, "selftest", "c1", "--allowed", "allowed.test", "--only",
                    "rebinding-private-answer", "--only", "dns-exfiltration", check=False)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert any(line.startswith("NOT RUN") and "rebinding-private-answer" in line
               and "needs --private-name" in line for line in lines)
    assert lines[-1] == "1/2 probes passed in c1; 1 not run (could not be tried: see DETAIL)"


def test_selftest_without_a_session_uses_a_throwaway_one(world, sandbox_image):
    result = corral(world, "selftest", "--allowed", "allowed.test", "--only",
                    "dns-exfiltration", "--only", "metadata-direct", "--json")
    assert json.loads(result.stdout)["passed"]
    names = [s["name"] for s in json.loads(corral(world, "ls", "--json").stdout)["sessions"]]
    assert not [n for n in names if n.startswith("selftest-")]  # removed again


def test_selftest_inspected_on_a_throwaway_session_inspects_that_host(world, sandbox_image):
    """`--inspected` without a session: the throwaway's project allows and inspects the host
    (a request rule and a [[git]] table for the battery to run into) and allows
    `--neighbour` (on the same address, not inspected), and the inspection probes pass in a
    real session (the CA in its trust store)."""
    probes = ["inspected-never-tunnelled", "inspected-host-differs", "inspected-token-in-body",
              "inspected-request-denied", "inspected-format-suffix",
              "inspected-escaped-separator", "inspected-unicode-lookalike",
              "inspected-push-refused", "neighbour-connect-refused",
              "neighbour-transparent-refused"]
    result = corral(world, "selftest", "--allowed", "allowed.test", "--inspected",
                    "inspected.test", "--neighbour", "neighbour.test",
                    *[a for p in probes for a in ("--only", p)], "--json", check=False)
    answer = json.loads(result.stdout)
    assert result.returncode == 0 and answer["passed"], json.dumps(answer["probes"])
    assert [p["id"] for p in answer["probes"]] == probes
    assert answer["tally"]["unrecorded"] == 0


def test_diff_and_apply_on_the_host_with_a_refused_conflict(world, c1, project):
    corral(world, "shell", "c1", "--", "sh", "-c",
           "printf \"print('v2')\\n\" > app.py && echo new > added.txt "
           "&& echo 'by the agent' > notes.md")
    diff = corral(world, "diff", "c1").stdout
    assert "-print('v1')\n+print('v2')\n" in diff and "+++ b/added.txt" in diff
    *_, summary, named = diff.rstrip().splitlines()
    assert summary == "1 added, 2 modified, 0 removed, 0 binary"
    assert named.startswith("digest ")
    digest = named.split()[1]
    (project / "notes.md").write_text("by the human\n")
    refused = corral(world, "apply", "c1", "--digest", digest, "--project", str(project),
                     check=False)
    assert refused.returncode == 1 and "changed on the host since the session started: " \
        "notes.md" in refused.stderr and "--force" in refused.stderr
    assert (project / "app.py").read_text() == "print('v1')\n"  # nothing at all was written
    applied = corral(world, "apply", "c1", "--digest", digest, "--project", str(project),
                     "--path", "app.py", "--path", "added.txt").stdout
    assert "applied 2 change(s)" in applied
    assert (project / "app.py").read_text() == "print('v2')\n"
    assert (project / "added.txt").read_text() == "new\n"
    assert (project / "notes.md").read_text() == "by the human\n"
    remaining = json.loads(corral(world, "diff", "c1", "--json").stdout)["changes"]
    assert [c["path"] for c in remaining] == ["notes.md"]
    elsewhere = world.dir / "elsewhere"
    elsewhere.mkdir()
    wrong = corral(world, "apply", "c1", "--project", str(elsewhere), check=False)
    assert wrong.returncode == 2 and "started from another project" in wrong.stderr


def test_apply_writes_the_diff_that_was_reviewed_not_what_the_agent_wrote_after_it(
        world, c1, project):
    """THREATS 32: the running session is paused while its diff is read; what the agent
    writes afterwards is not applied under that diff's digest (it is in the next diff), a
    digest no diff showed is refused naming both, and without a digest and a terminal
    nothing is applied."""
    corral(world, "shell", "c1", "--", "sh", "-c", "mkdir reviewed && echo shown > reviewed/f")
    shown = json.loads(corral(world, "diff", "c1", "--json").stdout)
    assert "not_paused" not in shown, shown["not_paused"]  # podman paused it for the read
    corral(world, "shell", "c1", "--", "sh", "-c",
           "echo 'written after the diff' > reviewed/f && echo sneaked > reviewed/g")
    applied = json.loads(corral(world, "apply", "c1", "--digest", shown["digest"], "--json",
                                "--project", str(project), "--path", "reviewed").stdout)
    assert applied["digest"] == shown["digest"] and applied["applied"] == ["reviewed/f"]
    assert (project / "reviewed" / "f").read_text() == "shown\n"
    assert not (project / "reviewed" / "g").exists()
    unknown = "0" * 64
    refused = corral(world, "apply", "c1", "--digest", unknown, "--project", str(project),
                     check=False)
    now = json.loads(corral(world, "diff", "c1", "--json").stdout)
    assert refused.returncode != 0 and unknown in refused.stderr, refused.stderr
    assert f"its changes now have digest {now['digest']}" in refused.stderr
    assert {"reviewed/f", "reviewed/g"} <= {c["path"] for c in now["changes"]}
    asked = corral(world, "apply", "c1", "--project", str(project), "--path", "reviewed",
                   check=False)  # no terminal to ask on
    assert asked.returncode == 2 and "--digest" in asked.stderr
    assert (project / "reviewed" / "f").read_text() == "shown\n"
    corral(world, "shell", "c1", "--", "rm", "-r", "reviewed")  # as it was, in both
    corral(world, "apply", "c1", "--yes", "--project", str(project), "--path", "reviewed")
    assert not (project / "reviewed" / "f").exists()


HOSTILE = r"""
import os, socket
os.makedirs("/work/hostile")
os.chdir("/work/hostile")
open("late-ff", "wb").write(b"a" * 9000 + b"\xff\n")
open("late-nul", "wb").write(b"b" * 9000 + b"\0\n")
open("lines", "wb").write(b"a\n" * 4500 + b"\xff\n")
open(b"\xffname\n\x1b[2J", "wb").write(b"\x1b]0;owned\x07\x1b[2J\rhidden\n")
open("huge", "wb").truncate(1 << 40)
os.mkfifo("fifo")
socket.socket(socket.AF_UNIX).bind("sock")
os.symlink("/etc/passwd", "out")
os.symlink("loop", "loop")
os.link("late-ff", "hard")
os.makedirs("locked")
open("locked/f", "w").write("in a locked directory\n")
os.chmod("locked", 0)
os.chmod("late-nul", 0)
fd = os.open(".", os.O_RDONLY)
for _ in range(1500):
    os.mkdir("d", dir_fd=fd)
    fd, up = os.open("d", os.O_RDONLY, dir_fd=fd), fd
    os.close(up)
os.close(os.open("leaf", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
"""


def test_whatever_the_agent_leaves_in_work_diff_and_apply_answer(world, c1, project):
    """Bytes the diff used to choke on, names with escapes, a TiB sparse file, a FIFO, a
    socket, links out and in a loop, a hard link, mode 000, a tree 1500 levels deep: the
    diff answers with every byte escaped, apply writes what it can and names the rest."""
    corral(world, "shell", "c1", "--", "python3", "-c", HOSTILE)
    diff = corral(world, "diff", "c1").stdout
    assert not [c for c in diff if not (c.isprintable() or c in "\n\t")]
    for line in ("added: hostile/fifo (not a regular file: fifo, not carried)",
                 "added: hostile/sock (not a regular file: socket, not carried)",
                 "added: hostile/huge (too large: 1099511627776 bytes",
                 "added: hostile/out (symlink -> /etc/passwd)",
                 "added: hostile/late-nul (binary file, 9002 bytes)",
                 '+++ "b/hostile/\\xffname\\n\\x1b[2J"',
                 "+\\x1b]0;owned\\x07\\x1b[2J\\rhidden",
                 "+" + "a" * 2000 + " [... 7002 more characters not shown]",
                 "\n+\\xff\n", "deeper than 128 levels: not read, not shown or carried"):
        assert line in diff, line
    applied = corral(world, "apply", "c1", "--yes", "--project", str(project), "--path",
                     "hostile", check=False)  # a diff taken, shown and applied in one step
    assert applied.returncode == 1, applied.stdout + applied.stderr
    refused = [line.split()[1] for line in applied.stdout.splitlines()
               if line.startswith(" refused")]
    assert refused == ["hostile/fifo:", "hostile/huge:", "hostile/out:", "hostile/sock:"]
    here = project / "hostile"
    assert (here / "late-ff").read_bytes() == b"a" * 9000 + b"\xff\n"
    assert (here / "hard").read_bytes() == b"a" * 9000 + b"\xff\n"
    assert (here / "lines").read_bytes() == b"a\n" * 4500 + b"\xff\n"
    assert (here / "late-nul").read_bytes() == b"b" * 9000 + b"\0\n"
    assert (here / "locked" / "f").read_text() == "in a locked directory\n"
    assert os.readlink(here / "loop") == "loop"
    weird = os.path.join(os.fsencode(here), b"\xffname\n\x1b[2J")
    with open(weird, "rb") as f:
        assert f.read() == b"\x1b]0;owned\x07\x1b[2J\rhidden\n"
    assert not (here / "out").exists() and not (here / "fifo").exists()
    again = json.loads(corral(world, "diff", "c1", "--json").stdout)["changes"]
    assert sorted(c["path"] for c in again if c["path"].startswith("hostile/")) == [
        "hostile/fifo", "hostile/huge", "hostile/out", "hostile/sock"]


def test_a_session_whose_container_died_is_reconciled(world, sandbox_image):
    corral(world, "run", "--name", "c2", "--detach", "--project", str(world.dir / "cli-project"))
    podman = Podman(world.dir / "containers.conf",
                    prefix=("nsenter", f"--net=/run/netns/{netns.APPLIANCE}"))
    podman.remove_container("corral-c2")  # behind corral's back (retries podman#11594)
    supervisor = int((world.dir / "supervisor.pid").read_text())
    sandbox = subprocess.run(["pgrep", "-P", str(supervisor), "-f", "corral-sandbox serve"],
                             capture_output=True, text=True).stdout.split()
    assert len(sandbox) == 1
    os.kill(int(sandbox[0]), signal.SIGKILL)  # a crash: the supervisor restarts it
    deadline = time.monotonic() + 30
    while True:
        result = corral(world, "ls", "--json", check=False)
        sessions = {s["name"]: s for s in json.loads(result.stdout or "{}").get("sessions", [])} \
            if result.returncode == 0 else {}
        if sessions.get("c2", {}).get("state") == "stopped":
            break
        assert time.monotonic() < deadline, result.stdout + result.stderr
        time.sleep(0.5)
    assert "container was absent" in sessions["c2"]["reason"]
    assert "c2" not in {s["name"] for s in world.control({"op": "sessions"})["sessions"]}
    assert podman.run("network", "exists", "corral-c2", check=False).returncode == 1
    assert "restarting" in (world.dir / "logs" / "supervisor.log").read_text()
    shared = corral(world, "rm", "c2", "--home", check=False)  # c1 has the same project
    assert shared.returncode == 1 and "also used by c1" in shared.stderr
    corral(world, "rm", "c2")


def test_run_with_a_command_attaches_runs_it_and_keeps_the_session(world, project):
    ran = corral(world, "run", "--name", "c5", "--project", str(project), "--", "sh", "-c",
                 "echo inside-$(id -u)-$(cat /work/app.py | wc -l); exit 3", check=False)
    assert ran.returncode == 3 and "inside-" in ran.stdout  # the command's own exit status
    assert "corral shell c5" in ran.stderr  # how to come back
    listed = {s["name"]: s for s in json.loads(corral(world, "ls", "--json").stdout)["sessions"]}
    assert listed["c5"]["container_state"] == "running"
    corral(world, "rm", "c5")


def fetch_in(world, session: str, url: str) -> subprocess.Popen:
    """curl inside the session, through its proxy settings, in the background: its stdout is
    the HTTP status."""
    return subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{netns.APPLIANCE}", str(BIN / "corral"), "shell",
         "--appliance", APPLIANCE_NAME, session, "--", "curl", "-sS", "-o", "/dev/null",
         "-w", "%{http_code}", "--max-time", "90", url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=world.cli_env)


def api(world, method: str, path: str, body: dict | None = None) -> dict:
    """The appliance's API with curl and the CLI's client certificate, in the appliance
    namespace: no corral code on this side."""
    where = world.dir / "config" / "corral" / "appliances" / APPLIANCE_NAME
    endpoint = tomllib.loads((where / "appliance.toml").read_text())["endpoint"]
    result = subprocess.run(
        ["nsenter", f"--net=/run/netns/{netns.APPLIANCE}", "curl", "-sS", "--fail-with-body",
         "--cacert", str(where / "ca.crt"), "--cert", str(where / "client.crt"),
         "--key", str(where / "client.key"), "-X", method, "-H",
         "Content-Type: application/json", "--data", json.dumps(body or {}),
         f"https://{endpoint}{path}"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout)


def held_in(world, session: str) -> dict:
    """The first approval of the session with a request waiting on it."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        listed = json.loads(corral(world, "approvals", "--session", session,
                                   "--json").stdout)["approvals"]
        held = [a for a in listed if a["waiting"]]
        if held:
            return held[0]
        time.sleep(0.5)
    raise AssertionError(f"no request held: {listed}")


def test_ask_mode_holds_a_request_in_the_session_until_a_person_decides(world, c1):
    """A request from inside a real session to a host the policy does not name waits while
    `corral approvals` shows it; `corral approve --once` lets it through, `corral refuse`
    gives the usual denial, and a grant `--for 2s` lets the next one straight in until it
    ends: then a request is held again. A grant made on the API itself (curl with the
    client certificate) lets a held request through as well."""

    def fetch():
        return fetch_in(world, "c1", "http://other.test/")

    def waiting() -> dict:
        return held_in(world, "c1")

    corral(world, "ask", "--session", "c1", "--hold", "90")
    try:
        first = fetch()
        approval = waiting()
        assert approval["target"] == "other.test:80" and approval["origin"] == "proxy"
        assert first.poll() is None  # still waiting for the decision
        corral(world, "approve", approval["id"], "--once")
        out, err = first.communicate(timeout=60)
        assert out == "200", (out, err)

        second = fetch()
        corral(world, "refuse", waiting()["id"], "--reason", "not in this session")
        out, _ = second.communicate(timeout=60)
        assert out == "403"

        third = fetch()
        corral(world, "approve", waiting()["id"], "--for", "2s")
        assert third.communicate(timeout=60)[0] == "200"
        time.sleep(3)  # the grant ends: the next request is held again
        fourth = fetch()
        approval = waiting()
        corral(world, "refuse", approval["id"])
        assert fourth.communicate(timeout=60)[0] == "403"

        fifth = fetch()  # the API itself, as any client holding the certificate calls it
        decided = api(world, "POST", f"/v1/approvals/{waiting()['id']}", {"grant": "once"})
        assert decided["approval"]["target"] == "other.test:80", decided
        assert fifth.communicate(timeout=60)[0] == "200"
        records = world.control({"op": "events", "last": 2000, "session": "c1"})["events"]
        actions = [e["action"] for e in records if e.get("kind") == "approval"]
        assert actions.count("approved") == 3 and actions.count("refused") == 2, actions
        assert any(e.get("action") == "expired" and e.get("rule") == "other.test:80"
                   for e in records)
        # the agent may ask, with its reason, by the line a denial gives it
        corral(world, "ask", "--session", "c1", "--off")
        denied = corral(world, "shell", "c1", "--", "curl", "-sS", "-i",
                        "http://denied.test/").stdout
        (line,) = [x for x in denied.splitlines() if x.startswith("X-Corral-Request: ")]
        command = line.split(": ", 1)[1].replace("WHY+YOU+NEED+IT", "to+read+the+docs")
        command = command.replace("&wait=60", "")
        asked = corral(world, "shell", "c1", "--", "sh", "-c", command).stdout
        assert json.loads(asked)["status"] == "pending", asked
        listed = corral(world, "approvals", "--session", "c1").stdout
        assert "to read the docs" in listed and "agent" in listed, listed
        # or with the image's corral-request, which a person's grant answers
        requested = corral(world, "shell", "c1", "--", "corral-request", "stream.test:7007",
                           "--kind", "tcp", "--reason", "the build log", check=False)
        assert requested.returncode == 3 and requested.stdout.startswith("pending: approval ")
        approval_id = requested.stdout.split()[2]
        (approval,) = [a for a in json.loads(corral(world, "approvals", "--json").stdout)[
            "approvals"] if a["id"] == approval_id]
        assert approval["target"] == "stream.test:7007" and approval["kind"] == "tcp"
        assert approval["note"] == "the build log"
        corral(world, "refuse", approval_id)
    finally:
        corral(world, "ask", "--session", "c1", "--off")


def test_what_a_session_learned_and_an_always_grant_hold_in_the_projects_next_session(
        world, sandbox_image):
    """A scripted agent in a `--learn` session is denied a host over HTTP and a name over
    DNS; `corral learn` proposes exactly those, and writes them into the project's
    corral.toml on this host when told. An approval granted `--always` in ask mode lets the
    held request through and goes into the same file. A new session of the project then
    reaches all three without asking anyone."""
    project = world.dir / "learn-project"
    project.mkdir()
    policy = project / "corral.toml"
    policy.write_text('# the team\'s policy\n[http]\nallow = ["allowed.test"]\n')
    agent = ("curl -s -o /dev/null -w 'other %{http_code}\\n' http://other.test/; "
             "getent hosts inspected.test || echo 'inspected unresolved'; "
             "curl -s -o /dev/null -w 'allowed %{http_code}\\n' http://allowed.test/")
    try:
        ran = corral(world, "run", "--project", str(project), "--name", "c11", "--learn",
                     "--", "sh", "-c", agent, check=False)
        assert ran.stdout.splitlines()[:3] == ["other 403", "inspected unresolved",
                                               "allowed 200"], ran.stdout
        # leaving the shell proposes it; with no terminal to say yes, nothing is written
        assert '+    "other.test:80", # asked 1x' in ran.stdout, ran.stdout
        assert '"inspected.test", # asked' in ran.stdout and "not written" in ran.stderr
        added = [line for line in ran.stdout.splitlines() if "# asked" in line]
        assert len(added) == 2, ran.stdout  # exactly those two, nothing more
        assert policy.read_text() == '# the team\'s policy\n[http]\nallow = ["allowed.test"]\n'
        learned = corral(world, "learn", "c11", "--project", str(project), "--yes")
        assert "wrote " in learned.stdout, learned.stdout
        assert policy.read_text().startswith("# the team's policy\n")

        corral(world, "ask", "--session", "c11", "--hold", "90")
        waiting = fetch_in(world, "c11", "http://git.test/")
        approval = held_in(world, "c11")
        assert approval["target"] == "git.test:80", approval
        corral(world, "approve", approval["id"], "--always", "--project", str(project),
               "--yes")
        assert waiting.communicate(timeout=60)[0] == "200"
        checked = json.loads(world.corral("check", str(policy), "--json").stdout)
        rules = {(r["kind"], r["rule"]) for r in checked["rules"]}
        assert {("http", "allowed.test"), ("http", "other.test:80"), ("dns", "inspected.test"),
                ("http", "git.test:80")} <= rules, rules  # the grant, exactly
        corral(world, "rm", "c11")

        again = corral(world, "run", "--project", str(project), "--name", "c12", "--", "sh",
                       "-c", agent.replace("allowed.test", "git.test").replace(
                           "'allowed ", "'git "))
        lines = again.stdout.splitlines()
        assert lines[0] == "other 200" and lines[2] == "git 200", again.stdout
        assert lines[1].split()[-1] == "inspected.test", again.stdout  # getent's answer
    finally:
        corral(world, "rm", "c11", check=False)
        corral(world, "rm", "c12", check=False)


def test_a_session_stops_itself_when_its_idle_time_is_up(world, podman, sandbox_image,
                                                          project):
    """`--idle 4s`: no network activity for 4 s and the sandbox service stops it (the
    workspace stays), with the reason in `corral ls` and an event; its resource limits are
    the ones `corral run` asked for, inside the container too."""
    corral(world, "run", "--project", str(project), "--name", "c9", "--detach",
           "--idle", "4s", "--max-uptime", "1h", "--memory", "1g", "--cpus", "1.5",
           "--pids", "512")
    try:
        host = podman.json("container", "inspect", "corral-c9")[0]["HostConfig"]
        assert (host["Memory"], host["NanoCpus"], host["PidsLimit"]) == (
            1 << 30, 1_500_000_000, 512)
        listed = {s["name"]: s for s in json.loads(corral(world, "ls", "--json").stdout)[
            "sessions"]}
        assert listed["c9"]["idle"] == 4 and 0 <= listed["c9"]["left"] <= 4
        assert "1g/1.5/512" in corral(world, "ls").stdout
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            listed = {s["name"]: s for s in json.loads(corral(world, "ls", "--json").stdout)[
                "sessions"]}
            if listed["c9"]["state"] == "stopped":
                break
            time.sleep(1)
        assert listed["c9"]["state"] == "stopped", listed["c9"]
        assert listed["c9"]["reason"] == "no network activity for its --idle (4s)"
        assert "stopped (no network activity" in corral(world, "ls").stdout
        events = world.control({"op": "events", "last": 200, "session": "c9"})["events"]
        assert any(e["kind"] == "session" and e.get("action") == "stopped"
                   and "--idle (4s)" in e["reason"] for e in events), events[-3:]
        corral(world, "diff", "c9")  # the workspace stays: its diff still answers
        bad = corral(world, "run", "--project", str(project), "--name", "c10", "--detach",
                     "--memory", "lots", check=False)
        assert bad.returncode != 0 and "'memory' must be a size" in bad.stderr, bad
    finally:
        corral(world, "rm", "c9", check=False)


def test_stop_then_rm_leave_nothing_behind(world, c1):
    corral(world, "shell", "c1", "--", "sh", "-c", "echo kept > left-before-stop.txt")
    corral(world, "stop", "c1")
    listed = {s["name"]: s for s in json.loads(corral(world, "ls", "--json").stdout)["sessions"]}
    assert listed["c1"]["state"] == "stopped" and listed["c1"]["container_state"] == "absent"
    assert "c1" not in {s["name"] for s in world.control({"op": "sessions"})["sessions"]}
    kept = corral(world, "diff", "c1").stdout  # the workspace stays until rm
    assert "+++ b/left-before-stop.txt" in kept and "+kept" in kept
    ruleset = netns.sh("nft", "list", "table", "inet", "corral", ns=netns.APPLIANCE).stdout
    assert c1["subnet"] not in ruleset
    corral(world, "rm", "c1")
    assert "c1" not in corral(world, "ls").stdout
    assert not (world.dir / "sandbox" / "workspaces" / "c1").exists()


def test_down_stops_everything_and_up_brings_it_back(world, c1):
    corral(world, "run", "--name", "c3", "--detach", "--project", str(world.dir / "cli-project"))
    down = corral(world, "down")
    assert "is down" in down.stdout
    table = netns.sh("nft", "list", "tables", ns=netns.APPLIANCE).stdout
    assert "corral" not in table
    assert not (world.dir / "supervisor.pid").exists()
    up = world.corral("up", "--backend", "local", "--name", APPLIANCE_NAME, "--state-dir",
                      str(world.dir), "--no-image", timeout=120)
    assert up.returncode == 0, up.stderr
    listed = {s["name"]: s for s in json.loads(corral(world, "ls", "--json").stdout)["sessions"]}
    assert listed["c3"]["state"] == "stopped"  # the session did not outlive its ruleset
    assert "appliance going down" in listed["c3"]["reason"]
    assert json.loads(corral(world, "audit", "--verify", "--json").stdout)["intact"]
    corral(world, "rm", "c3")


