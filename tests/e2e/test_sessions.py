"""Sessions for real: a hardened container on its own podman bridge inside the appliance
namespace, registered with the real filter and firewall; the whole battery runs inside it."""

from __future__ import annotations

import ipaddress
import json
import time

import pytest

from appliance.sandbox.podman import Podman
from appliance.sandbox.service import SandboxConfig, Sessions
from appliance.sandbox.sessions import SessionError, SessionManager

from . import netns
from .conftest import CONTAINERS_CONF

PROJECT = """
[http]
allow = ["allowed.test", "private.test"]
[tcp]
allow = ["ssh.test:22"]
"""


@pytest.fixture(scope="module")
def manager(world, sandbox_image):
    inside = Podman(CONTAINERS_CONF, prefix=("nsenter", f"--net=/run/netns/{netns.APPLIANCE}"))
    return SessionManager(inside, world.control, world.dir / "manager", image=sandbox_image)


@pytest.fixture(scope="module")
def service(manager):
    """The sandbox service's request handling (what its socket answers), on that manager."""
    return Sessions(SandboxConfig(), manager)


@pytest.fixture(scope="module")
def session(world, manager):
    manager.podman.remove_container("corral-p1")  # what an interrupted run may have left
    manager.podman.run("network", "rm", "--force", "corral-p1", check=False)
    policy = world.dir / "p1.toml"
    policy.write_text(PROJECT)
    project = world.dir / "project"
    (project / ".corral").mkdir(parents=True)
    (project / ".corral" / "client.key").write_text("never inside")
    (project / "app.py").write_text("print('v1')\n")
    (project / "notes.md").write_text("notes\n")
    started = time.monotonic()
    record = manager.create("p1", [str(policy)], project=project)
    print(f"session p1 started in {time.monotonic() - started:.2f}s on {record.subnet}")
    yield record
    if any(r.name == "p1" and r.state != "stopped" for r in manager.records()):
        manager.stop("p1")


NETWORK = {"allowed": "allowed.test", "denied": "denied.test",
           "foreign_resolver": "203.0.113.53", "v6_target": "3fff:ff::10",
           "private_name": "private.test", "tcp_name": "ssh.test:22",
           "silence": 6}  # the e2e filter's header_timeout is 5


def test_the_battery_passes_inside_a_real_session(world, service, session):
    """Through the sandbox service's selftest op, as `corral selftest` runs it: the battery
    in the container, then the appliance's check that every denial was recorded."""
    answer = service.answer({"op": "selftest", "name": "p1", "options": {
        **NETWORK, "skip_group": ["kernel", "review"]}}, None)
    failed = [p for p in answer["probes"] if p["state"] != "passed"]
    assert answer["passed"] and not failed, json.dumps(failed, indent=1)
    assert set(answer["summary"]["skipped_groups"]) == {"kernel", "review"}
    (icmp,) = [p for p in answer["probes"] if p["id"] == "icmp-echo"]
    assert icmp["state"] == "passed"  # really tried: the sandbox may open an ICMP socket
    assert any(e.get("session") == "p1" and e["verdict"] == "deny" for e in world.events())


def test_the_kernel_and_review_groups_pass_inside_a_real_session(manager, service, session):
    """What a container must refuse (seccomp: user namespaces, mount, keyctl, bpf, ...), and
    files in /work the session's diff must survive; passes once the sandbox's seccomp profile
    and the robust workspace diff are in."""
    answer = service.answer({"op": "selftest", "name": "p1", "options": {
        "allowed": "allowed.test", "skip_group": ["network"]}}, None)
    states = {p["id"]: (p["state"], p["detail"]) for p in answer["probes"]}
    assert {"userns-unshare", "userns-clone", "mount", "keyctl", "bpf", "perf-event-open",
            "userfaultfd", "ptrace-outside", "proc-sys-write", "raw-socket", "packet-socket",
            "review-hostile-files", "review-changed-after-diff"} == set(states)
    listing = manager.podman.run("exec", session.container, "ls", "-A", "/work").stdout
    assert b"corral-selftest-review" not in listing  # the service took its files away again
    assert answer["passed"], json.dumps(states, indent=1)


def test_the_proxy_settings_reach_every_tool(manager, session):
    env = manager.podman.run("exec", session.container, "env").stdout.decode()
    proxy = f"http://{session.gateway}:3128"
    for key in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "npm_config_https_proxy",
                "PIP_PROXY", "GIT_CONFIG_VALUE_0"):
        assert f"{key}={proxy}" in env
    assert "NO_PROXY=localhost" in env
    resolv = manager.podman.run("exec", session.container, "cat", "/etc/resolv.conf").stdout
    assert f"nameserver {session.gateway}".encode() in resolv


def test_names_are_checked_and_duplicates_refused(manager, session):
    with pytest.raises(SessionError, match="must be 1-32"):
        manager.create("Bad Name")
    with pytest.raises(SessionError, match="exists"):
        manager.create("p1")


def test_work_holds_the_project_without_corral(manager, session):
    listing = manager.podman.run("exec", session.container, "ls", "-A", "/work").stdout.split()
    assert sorted(listing) == [b"app.py", b"notes.md"]
    assert manager.podman.run("exec", session.container, "cat", "/work/.corral/client.key",
                              check=False).returncode != 0


def test_diff_and_apply_round_trip_with_a_refused_conflict(world, manager, session):
    project = world.dir / "project"
    run = manager.podman.run
    run("exec", session.container, "sh", "-c",
        "printf \"print('v2')\\n\" > /work/app.py && echo new > /work/added.txt "
        "&& printf 'edited by agent\\n' > /work/notes.md")
    from appliance.workspace import Conflict, apply, carry, render

    def host_apply(**options):  # what `corral apply` does on the host, then tells the manager
        applied = apply(project, carry(manager.diff("p1")), **options)
        assert manager.fold("p1", applied.changes) == []
        return applied.changes

    text = render(manager.diff("p1"))
    assert "-print('v1')\n+print('v2')\n" in text and "+++ b/added.txt" in text
    assert text.endswith("1 added, 2 modified, 0 removed, 0 binary")
    (project / "notes.md").write_text("edited by the human\n")  # meanwhile, on the host
    with pytest.raises(Conflict) as info:
        host_apply()
    assert info.value.paths == ["notes.md"]
    assert (project / "app.py").read_text() == "print('v1')\n"  # nothing was written
    applied = host_apply(paths=["app.py", "added.txt"])
    assert {c.path for c in applied} == {"app.py", "added.txt"}
    assert (project / "app.py").read_text() == "print('v2')\n"
    assert (project / "notes.md").read_text() == "edited by the human\n"
    assert [c.path for c in manager.diff("p1")] == ["notes.md"]


def test_two_sessions_get_only_their_own_policy_and_cannot_reach_each_other(
        world, manager, session):
    other_policy = world.dir / "p2.toml"
    other_policy.write_text('[http]\nallow = ["other.test"]\n')
    manager.podman.remove_container("corral-p2")
    manager.podman.run("network", "rm", "--force", "corral-p2", check=False)
    other = manager.create("p2", [str(other_policy)])
    try:
        assert other.subnet != session.subnet

        def curl(record, url):
            result = manager.podman.run("exec", record.container, "curl", "-sS", "-m", "5",
                                        "-o", "/dev/null", "-w", "%{http_code}", url,
                                        check=False)
            return result.stdout.decode()

        assert curl(session, "http://allowed.test/") == "200"
        assert curl(session, "http://other.test/") == "403"
        assert curl(other, "http://other.test/") == "200"
        assert curl(other, "http://allowed.test/") == "403"
        address = manager.podman.json("inspect", other.container)[0]["NetworkSettings"][
            "Networks"][other.network]["IPAddress"]
        assert curl(session, f"http://{address}:8080/") == "403"  # through the proxy
        started = time.monotonic()
        across = manager.podman.run("exec", session.container, "curl", "-sS", "-m", "5",
                                    "--noproxy", "*", f"http://{address}:8080/", check=False)
        assert across.returncode == 7 and time.monotonic() - started < 3  # refused at once
    finally:
        manager.remove("p2")


LINK_LOCAL = (ipaddress.ip_network("224.0.0.0/24"), ipaddress.ip_network("ff02::/16"))
QUERY = b"\x12\x34\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x06corral\x00\x00\x01\x00\x01"
"""An LLMNR/mDNS query for `corral`, as a host asks for its own name on a new link."""
RESOLVED = r"""
import socket, struct, sys, time
ifname, query = sys.argv[1], bytes.fromhex(sys.argv[2])
index = socket.if_nametoindex(ifname)
v4 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
v4.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, struct.pack(
    "4s4si", socket.inet_aton("224.0.0.252"), bytes(4), index))
v4.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, struct.pack("4s4si", bytes(4),
                                                                     bytes(4), index))
v4.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
v6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_JOIN_GROUP, socket.inet_pton(
    socket.AF_INET6, "ff02::1:3") + struct.pack("@I", index))
v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, index)
v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_LOOP, 1)
sent = {4: 0, 6: 0}
for _ in range(3):  # resolved's probes for its own name
    v4.sendto(query, ("224.0.0.252", 5355))
    sent[4] += 1
deadline = time.monotonic() + 5
while sent[6] < 3 and time.monotonic() < deadline:
    try:  # a new bridge's link-local address is tentative for a second (DAD)
        v6.sendto(query, ("ff02::1:3", 5355, 0, index))
        sent[6] += 1
    except OSError:
        time.sleep(0.1)
print("joined", sent[4], sent[6], flush=True)
time.sleep(4)
"""
AGENT = r"""
import socket, sys, time
query, index = bytes.fromhex(sys.argv[1]), socket.if_nametoindex("eth0")
deadline = time.monotonic() + 5
for family, target in ((socket.AF_INET, ("224.0.0.252", 5355)),
                       (socket.AF_INET, ("224.0.0.251", 5353)),
                       (socket.AF_INET, ("224.0.0.1", 5355)),
                       (socket.AF_INET6, ("ff02::1:3", 5355, 0, index)),
                       (socket.AF_INET6, ("ff02::1", 5355, 0, index))):
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        while True:
            try:
                sock.sendto(query, target)
                break
            except OSError:  # a new link's IPv6 address is tentative for a second (DAD)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
print("sent", flush=True)
"""


def link_local(event: dict) -> bool:
    try:
        address = ipaddress.ip_address(event.get("address") or "")
    except ValueError:
        return False
    return any(address.version == n.version and address in n for n in LINK_LOCAL)


def test_link_local_multicast_is_counted_quietly_never_a_denial(world, manager, session):
    """Name queries a host sends on a new link (LLMNR, mDNS) — the appliance's own, as
    systemd-resolved sends them on each session bridge, looped back, and the agent's — are
    no firewall denials: they are counted quietly (issue 26, F15). The role turns resolved's
    off (tests/unit/test_roles.py); here a process in the appliance joins and sends as
    resolved does, so that the path is the real kernel's."""
    firewall = [(e["session"], e["protocol"], e["client"], e["address"], e["port"])
                for e in world.events() if e.get("kind") == "firewall" and link_local(e)]
    assert not firewall, firewall  # the sessions' starts: router solicitations, name queries
    bridge = manager.podman.json("network", "inspect", session.network)[0]["network_interface"]
    before, seen = world.counters().get("quiet_multicast", 0), len(world.events())
    import subprocess

    with subprocess.Popen(["ip", "netns", "exec", netns.APPLIANCE, "python3", "-c", RESOLVED,
                           bridge, QUERY.hex()], stdout=subprocess.PIPE, text=True) as resolved:
        joined, v4, v6 = resolved.stdout.readline().split()
        assert joined == "joined" and int(v4) == 3, (joined, v4, v6)
        agent = manager.podman.run("exec", session.container, "python3", "-c", AGENT,
                                   QUERY.hex())
        assert agent.stdout.strip() == b"sent"
        resolved.wait(10)
    # looped back: the probes; the agent's to the groups the appliance is in: 224.0.0.252
    # and 224.0.0.1, ff02::1:3 (where the bridge has IPv6) and ff02::1. mDNS's group it is
    # not in: that never reaches the firewall's input at all.
    expected = 3 + 2 + (int(v6) + 2 if int(v6) else 0)
    deadline = time.monotonic() + 5
    while world.counters().get("quiet_multicast", 0) - before < expected and (
            time.monotonic() < deadline):
        time.sleep(0.1)
    time.sleep(0.5)  # a report, had there been one, reaches the audit log meanwhile
    counted = world.counters().get("quiet_multicast", 0) - before
    later = [(e["session"], e["protocol"], e["client"], e["address"], e["port"])
             for e in world.events()[seen:] if e.get("kind") == "firewall" and link_local(e)]
    assert not later, later
    assert counted >= expected, (counted, expected, v6)


def test_stop_leaves_nothing_behind(world, manager, session):
    listed = {s["name"]: s for s in manager.list()}
    assert listed["p1"]["container_state"] == "running"
    manager.stop("p1")
    podman = manager.podman
    assert podman.run("container", "exists", session.container, check=False).returncode == 1
    assert podman.run("network", "exists", session.network, check=False).returncode == 1
    assert "p1" not in {s["name"] for s in world.control({"op": "sessions"})["sessions"]}
    ruleset = netns.sh("nft", "list", "table", "inet", "corral", ns=netns.APPLIANCE).stdout
    assert session.subnet not in ruleset and "deny_p1" not in ruleset
    learned = json.loads(netns.sh("nft", "-j", "list", "set", "inet", "corral", "learned",
                                  ns=netns.APPLIANCE).stdout)
    sources = [e["elem"]["val"]["concat"][0] for item in learned["nftables"] if "set" in item
               for e in item["set"].get("elem", [])]
    subnet = ipaddress.ip_network(session.subnet)
    assert not [s for s in sources if ipaddress.ip_address(s) in subnet]  # nothing inherited
    assert {s["name"]: s for s in manager.list()}["p1"]["container_state"] == "absent"
    manager.remove("p1")
    with pytest.raises(SessionError, match="no session 'p1'"):
        manager.get("p1")


def test_a_failed_create_leaves_nothing_behind(world, manager, tmp_path):
    broken = SessionManager(manager.podman, world.control, manager.records_dir.parent,
                            image="localhost/corral-no-such-image:0")
    project = tmp_path / "project"
    project.mkdir()
    (project / "f.txt").write_text("x\n")
    with pytest.raises(SessionError, match="cannot inspect image localhost/corral-no-such"):
        broken.create("p3", project=project)  # its trust is read from the image first
    podman = manager.podman
    assert podman.run("container", "exists", "corral-p3", check=False).returncode == 1
    assert podman.run("network", "exists", "corral-p3", check=False).returncode == 1
    assert "p3" not in {s["name"] for s in world.control({"op": "sessions"})["sessions"]}
    assert not broken.workspace("p3")[0].parent.exists()
    with pytest.raises(SessionError, match="no session 'p3'"):
        broken.get("p3")
