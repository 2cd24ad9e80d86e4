"""The VM tier: two appliances, made as a user makes them, then proven.

`corral box build` (Debian 13, the appliance's packages, corral's venv and the sandbox
images baked in), then `corral up` with the real Vagrantfile (vagrant-libvirt, QEMU/TCG),
which provisions it with playbooks/site.yml. Then:
- a second VM booted from the same box (`corral up --no-provision`), and site.yml over one
  inventory naming both (`corral inventory`), the way a team provisions its Debian 13
  hosts: the second is made, the first (provisioned through Vagrant) changes nothing, so
  the two paths make one appliance; both verified; their manifests identical; a file edited
  and a package removed on the second named by `corral verify`; `corral ls --all`;
- `corral verify` on the first: its manifest, services active, the full ruleset loaded, the
  API answering only with the client certificate, the bypass battery in a real session;
- the units' hardening as systemd reports it, the boot ruleset, nothing of the appliance on
  this host;
- the CLI over the forwarded API: a session, a rule, a denial seen live in `corral monitor`
  and read back from journald, an inspected flow verified upstream, a push confined by the
  git gateway to a git server on this machine (host.corral), `corral destroy`.
Two VMs at most, because each boot and provisioning costs minutes under TCG.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import re
import shlex
import shutil
import subprocess
import threading
import time
import tomllib
from pathlib import Path

import asyncssh
import pytest

from cli import box
from tests import fakes

from . import host, pool
from .conftest import (
    BIN,
    CACHE,
    TASK_TIMEOUT,
    UP_TIMEOUT,
    free_port,
    playbook,
    recap,
    recaps,
    timed,
    up_with_one_more_try,
)

pytestmark = pytest.mark.vm
NAME = "vmtest"

EXTRA_CAS = sorted(str(p) for p in Path("/usr/local/share/ca-certificates").glob("*.crt"))
"""What this host trusts besides Debian's store: on these machines, the CA their egress ends
TLS with. The appliance is given them (`corral up --trust-ca`) as a deployment behind such a
network would be."""


@pytest.fixture(scope="module")
def libvirtd():
    """libvirt's daemons; started by hand where PID 1 is not systemd (and stopped after)."""
    if shutil.which("vagrant") is None or shutil.which("libvirtd") is None:
        pytest.skip("vagrant and libvirt are missing: scripts/setup installs them")
    started = []
    for daemon in ("virtlogd", "virtlockd", "libvirtd"):
        if subprocess.run(["pgrep", "-x", daemon], capture_output=True).returncode != 0:
            Path("/run/libvirt").mkdir(exist_ok=True)
            subprocess.run([f"/usr/sbin/{daemon}", "-d"], check=True)
            started.append(daemon)
    for _ in range(60):
        if subprocess.run(["virsh", "-c", "qemu:///system", "version"],
                          capture_output=True).returncode == 0:
            break
        time.sleep(0.5)
    for name in (NAME, SECOND):  # a killed run's domain would stop `vagrant up` at once
        if pool.remove_domain(f"corral-{name}-default"):
            print(f"vm: removed the domain corral-{name}-default an earlier run left")
    yield
    print(f"vm: box volumes no domain uses, removed: {pool.remove_unused_box_volumes()}")
    for daemon in reversed(started):
        subprocess.run(["pkill", "-x", daemon], check=False)


class Appliance:
    """The appliance `corral up` made: its environment, port and Vagrant state."""

    def __init__(self, env: dict[str, str], api_port: int):
        self.env, self.api_port = env, api_port
        self.config_home = Path(env["XDG_CONFIG_HOME"])
        self.directory = self.config_home / "corral" / "appliances" / NAME
        self.logs = self.config_home.parent  # the playbooks' output, not among the credentials

    def corral(self, *args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        return timed(f"corral {' '.join(args)[:50]}", [str(BIN / "corral"), *args], timeout,
                     env=self.env, **kwargs)

    def ssh(self, command: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """A command on the VM, through `corral ssh` (ssh to the address `corral up` kept).
        Keepalives: a VM that stops answering ends the ssh, not only the `corral` that the
        timeout kills."""
        return self.corral("ssh", "--appliance", NAME, "--", "-oServerAliveInterval=15",
                           "-oServerAliveCountMax=4", "sh", "-c", command, timeout=timeout)


@pytest.fixture(scope="module")
def appliance(tmp_path_factory, vm_image, libvirtd):
    home = tmp_path_factory.mktemp("vagrant-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_SANDBOX_IMAGE")}
    # (`corral inventory` gives site.yml what the Vagrantfile does: no archive)
    env = {**env, "XDG_CONFIG_HOME": str(home / "config"),
           "XDG_CACHE_HOME": str(CACHE / "xdg-cache"),
           "VAGRANT_HOME": str(CACHE / "vagrant.d"),
           # every task of every play, with a time stamp: where provisioning's time goes
           "ANSIBLE_LOG_PATH": str(home / "ansible.log"),
           "ANSIBLE_TASK_TIMEOUT": TASK_TIMEOUT,
           "PATH": f"{BIN}:{os.environ['PATH']}"}
    # the box from the image the tier already built (`corral box build` keeps an image that
    # is there and only packages and adds it)
    box_dir = CACHE / "xdg-cache" / "corral" / "box"
    box_dir.mkdir(parents=True, exist_ok=True)
    kept = box_dir / box.IMAGE
    if kept.exists() and not os.path.samefile(kept, vm_image):
        kept.unlink()  # an image made before this one (by another recipe): not this run's
    if not kept.exists():
        os.link(vm_image, kept)
    made = Appliance(env, free_port())
    built = made.corral("box", "build", timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    trust = [word for ca in EXTRA_CAS for word in ("--trust-ca", ca)]
    try:
        up = up_with_one_more_try(made, NAME, ["up", "--name", NAME, "--api-port",
                                               str(made.api_port), "--timeout",
                                               str(UP_TIMEOUT), *trust], home / "ansible.log")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-5000:]
        phases = [line for line in up.stderr.splitlines() if line.startswith("corral: [")]
        print("\n".join(phases))
        assert any("provisioning with playbooks/site.yml" in p for p in phases), phases
        assert "next:" in up.stdout
        yield made
    finally:
        down = made.corral("destroy", "--appliance", NAME, timeout=600)
        print(down.stdout, down.stderr)


SECOND = "vmtwo"


@pytest.fixture(scope="module")
def fleet(appliance, tmp_path_factory):
    """A second appliance booted from the same box and not provisioned, and one inventory
    that names both (`corral inventory`), as a team's inventory names its hosts."""
    trust = [word for ca in EXTRA_CAS for word in ("--trust-ca", ca)]
    try:
        booted = appliance.corral("up", "--name", SECOND, "--api-port", str(free_port()),
                                  "--no-provision", *trust, timeout=1800)
        assert booted.returncode == 0, booted.stdout[-3000:] + booted.stderr[-3000:]
        inventory = tmp_path_factory.mktemp("fleet") / "inventory.ini"
        made = appliance.corral("inventory", "-o", str(inventory))
        assert made.returncode == 0, made.stderr
        print(inventory.read_text())
        yield inventory
    finally:
        appliance.corral("destroy", "--appliance", SECOND, timeout=600)


def test_one_inventory_provisions_a_second_appliance_and_changes_nothing_on_the_first(
        appliance, fleet):
    """site.yml over an inventory of two, outside Vagrant, the way a team provisions its
    Debian 13 hosts: the second is made; the first, which `corral up` provisioned through
    Vagrant, is already exactly what the inventory path makes (changed=0)."""
    run = playbook("site.yml", fleet, appliance.config_home, appliance.logs, timeout=1800)
    assert run.returncode == 0, run.stdout[-6000:]
    counts = recaps(run.stdout)
    assert set(counts) == {NAME, SECOND}, counts
    changed = [line for line in run.stdout.splitlines()
               if line.startswith("changed:") and f"[{NAME}]" in line]
    assert counts[NAME]["changed"] == 0, changed
    assert counts[SECOND]["failed"] == 0 and counts[SECOND]["unreachable"] == 0, counts
    assert counts[SECOND]["changed"] > 0, counts
    # the play's last handlers restart the API: it answers within moments (as `corral up`
    # waits for it, so does a person here)
    deadline = time.monotonic() + 120
    while (status := appliance.corral("status", "--appliance", SECOND, "--json")).returncode \
            == 3 and time.monotonic() < deadline:
        time.sleep(3)
    assert status.returncode == 0, status.stderr
    state = json.loads(status.stdout)
    assert state["filter"]["healthy"] and state["firewall"]["loaded"], state


def test_the_second_appliance_verifies_and_lists_with_the_first(appliance, fleet):
    result = appliance.corral("verify", "--appliance", SECOND, timeout=900)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert recaps(result.stdout)[SECOND]["failed"] == 0
    listed = appliance.corral("ls", "--all", "--json")
    assert listed.returncode == 0, listed.stderr
    assert sorted(json.loads(listed.stdout)["appliances"]) == sorted([NAME, SECOND])


def test_two_appliances_from_one_commit_are_identical_and_drift_is_named(appliance, fleet):
    """Their manifests (what provisioning recorded) compare identical but for each one's
    own values; then a file edited and a package removed on the second are each named by
    `corral verify`, before its battery runs."""
    same = appliance.corral("verify", "--appliance", SECOND, "--against", NAME, "--json")
    assert same.returncode == 0, same.stdout[-4000:] + same.stderr
    answer = json.loads(same.stdout)
    assert answer["identical"] and answer["differences"] == [], answer["differences"]
    assert answer["expected_to_differ"], answer  # their names, at least
    drift = appliance.corral("ssh", "--appliance", SECOND, "--", "sudo", "sh", "-c",
                             "echo '# drift' >> /etc/corral/filter.toml && "
                             "dpkg --purge iputils-ping >/dev/null && echo drifted")
    assert "drifted" in drift.stdout, drift.stdout + drift.stderr
    found = appliance.corral("verify", "--appliance", SECOND, timeout=600)
    assert found.returncode != 0, found.stdout[-4000:]
    assert "/etc/corral/filter.toml" in found.stdout, found.stdout[-4000:]
    assert "iputils-ping" in found.stdout, found.stdout[-4000:]
    assert "probes passed" not in found.stdout  # drift stops it before the battery
    # site.yml puts back what its roles make: the edited file is seen through the state
    # fact and rewritten (a check that trusted the fact wrongly would skip it)
    again = playbook("site.yml", fleet, appliance.config_home, appliance.logs, timeout=900,
                     limit=SECOND)
    assert again.returncode == 0, again.stdout[-6000:]
    assert recaps(again.stdout)[SECOND]["changed"] > 0, again.stdout[-6000:]
    put_back = appliance.corral("ssh", "--appliance", SECOND, "--", "sudo", "grep", "-c",
                                "# drift", "/etc/corral/filter.toml")
    assert put_back.stdout.strip() == "0", put_back.stdout + put_back.stderr


def test_two_vms_from_one_box_answer_with_host_keys_of_their_own(appliance, fleet):
    """The box carries no SSH host keys: each VM makes its own on its first boot, so the
    keys `corral up` kept for one (and `corral ssh` checks) are no other VM's."""
    keys = {}
    for name in (NAME, SECOND):
        kept = appliance.config_home / "corral" / "appliances" / name / "known_hosts"
        keys[name] = {tuple(line.split()[1:]) for line in kept.read_text().splitlines()}
    assert keys[NAME] and keys[SECOND] and not keys[NAME] & keys[SECOND], keys
    assert {kind for kind, _ in keys[NAME]} <= {"ssh-ed25519", "ecdsa-sha2-nistp256"}  # made
    # at first boot by the box's unit, which makes no RSA key (seconds under TCG)


def test_the_second_appliance_is_destroyed(appliance, fleet):
    destroyed = appliance.corral("destroy", "--appliance", SECOND, timeout=600)
    assert destroyed.returncode == 0, destroyed.stderr


def test_verify_passes_with_the_battery_in_a_real_session(appliance):
    result = appliance.corral("verify", "--appliance", NAME, timeout=900)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert recap(result.stdout)["failed"] == 0
    passed = re.findall(r"(\d+)/(\d+) probes passed in", result.stdout)
    assert passed, result.stdout[-4000:]
    done, total = passed[-1]
    assert done == total and int(total) > 20, passed


def test_the_units_are_hardened_as_designed(appliance):
    result = appliance.ssh(
        "systemctl show -p User -p CapabilityBoundingSet -p ProtectSystem "
        "-p NoNewPrivileges corral-filter corral-api; "
        "ps -o user= -C corral-filter; sudo stat -c '%a %U %G' "
        "/run/corral-filter/control.sock /etc/corral/api/server.key")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "User=corral-filter" in out and "User=corral-api" in out
    assert "CapabilityBoundingSet=cap_net_bind_service cap_net_admin" in out
    assert out.count("ProtectSystem=strict") == 2 and out.count("NoNewPrivileges=yes") == 2
    assert "660 corral-filter corral" in out and "640 root corral-api" in out
    # the filter's workers (one per core, the role's default) each say what they were given
    jailed = appliance.ssh("sudo journalctl -u corral-filter -b --no-pager -o cat "
                           "| grep -a 'confined' | tail -n 4")
    lines = jailed.stdout.splitlines()
    assert lines and all("Landlock ABI" in line for line in lines), jailed.stdout


def test_the_boot_ruleset_is_loaded_before_networking(appliance):
    result = appliance.ssh("systemctl show -p Before -p WantedBy corral-firewall; "
                           "sudo nft -c -f /etc/corral/base.nft && echo base-valid")
    assert "network-pre.target" in result.stdout and "base-valid" in result.stdout, (
        result.stdout + result.stderr)


def test_no_corral_process_is_left_on_the_host(appliance):
    """The VM is the appliance: the CLI's port on this host is Vagrant's forwarding to the VM
    (vagrant-libvirt's ssh -L, whose pid it records), and no corral service runs here as an
    installed appliance would (a play that ran with a local connection). The e2e tier's
    services, alive in this session, are neither."""
    listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True)
    table = host.processes()
    owners = host.port_owners(listening.stdout, appliance.api_port)
    recorded = appliance.directory / "vagrant" / "machines" / "default" / "libvirt" / "pids"
    forwarder = int((recorded / f"ssh_{appliance.api_port}.pid").read_text())
    assert set(owners) == {forwarder}, host.describe(table, owners)
    assert Path(table[forwarder][0]).name == "ssh", table[forwarder]
    services = host.appliance_services(table)
    assert not services, host.describe(table, services)


def test_cli_against_the_forwarded_api(appliance, tmp_path):
    (tmp_path / "README").write_text("a small project\n")
    status = appliance.corral("status", "--appliance", NAME, "--json")
    assert status.returncode == 0, status.stderr
    state = json.loads(status.stdout)
    assert state["vm"]["state"] == "running" and state["filter"]["healthy"], state
    assert state["firewall"]["loaded"], state
    assert state["sandbox"]["healthy"] and state["sandbox"]["image_present"], state

    run = appliance.corral("run", "--appliance", NAME, "--name", "smoke", "--detach",
                           timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    allow = appliance.corral("allow-http", "--appliance", NAME, "--session", "smoke",
                             "api.example.org")
    assert allow.returncode == 0, allow.stderr
    rules = appliance.corral("rules", "--appliance", NAME, "--session", "smoke", "--json")
    assert any(r["rule"] == "api.example.org" for r in json.loads(rules.stdout)["rules"]), (
        rules.stdout)

    monitor = subprocess.Popen([str(BIN / "corral"), "monitor", "--appliance", NAME, "--json"],
                               env=appliance.env, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    # a thread reads, so the wait ends at its deadline even when monitor prints nothing
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in monitor.stdout],
                              daemon=True)
    reader.start()
    try:
        time.sleep(3)
        # a denied name looked up inside the session, through `corral shell` (ssh to the VM)
        lookup = appliance.corral("shell", "--appliance", NAME, "smoke", "--", "getent",
                                  "hosts", "denied.example.net", timeout=300)
        assert lookup.returncode != 0  # refused: no address
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("denied.example.net" in s for s in seen):
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
        assert any("denied.example.net" in line for line in seen), seen[-5:]
        # the same decision in journald, as the team's log system reads it (journald itself,
        # on the appliance: the sandboxed unit reached its socket)
        logged = appliance.ssh("sudo journalctl -t corral-events -o json --all --since -15min "
                               "CORRAL_NAME=denied.example.net CORRAL_VERDICT=deny",
                               timeout=120)
        assert logged.returncode == 0, logged.stderr
        entries = [json.loads(line) for line in logged.stdout.splitlines()
                   if line.startswith("{")]
        assert entries, logged.stdout[-2000:]
        entry = entries[-1]
        event = json.loads(entry["MESSAGE"])
        assert (event["name"], event["session"], event["verdict"]) == (
            "denied.example.net", "smoke", "deny")
        assert (entry["SYSLOG_IDENTIFIER"], entry["PRIORITY"], entry["CORRAL_KIND"]) == (
            "corral-events", "5", "dns")
        assert entry["_SYSTEMD_UNIT"] == "corral-filter.service"
    finally:
        monitor.terminate()
        monitor.wait(10)
        reader.join(10)  # it ends at EOF; then the pipe can be closed
        monitor.stdout.close()
    assert appliance.corral("rm", "--appliance", NAME, "smoke", timeout=300).returncode == 0


INSPECTED_PROJECT = """
[http]
allow = ["deb.debian.org"]

[[inspect]]
host = "deb.debian.org"
deny = ["* /forbidden/**"]
"""


def test_an_inspected_flow_in_a_real_session_inside_the_appliance(appliance, tmp_path):
    """The filter's own interception CA (made when the playbooks started it), a session
    that trusts it without being told, a request to the real deb.debian.org judged inside
    the TLS and verified upstream against the appliance's trust store (passed on, or, behind
    a network that intercepts TLS, refused with the reason), and a request the project's
    rules deny answered by the filter."""
    (tmp_path / "corral.toml").write_text(INSPECTED_PROJECT)
    started = appliance.corral("run", "--appliance", NAME, "--project", str(tmp_path),
                               "--name", "inspected", "--detach", timeout=600)
    assert started.returncode == 0, started.stderr
    try:
        script = ("curl -sS -o /dev/null -D /tmp/head -w 'allowed %{http_code}\\n' "
                  "https://deb.debian.org/debian/dists/trixie/Release; "
                  "grep -i '^x-corral' /tmp/head; "  # the filter's reason, if it refused
                  "curl -sS -o /dev/null -w 'denied %{http_code}\\n' "
                  "https://deb.debian.org/forbidden/x; "
                  "curl -sS -v -o /dev/null https://deb.debian.org/debian/ 2>&1 | grep issuer:")
        result = appliance.ssh(
            "sudo env CONTAINERS_CONF=/etc/corral/containers.conf podman exec "
            f"corral-inspected sh -c {shlex.quote(script)}; sudo stat -c '%a %U' "
            "/var/lib/corral-filter/intercept "
            "/var/lib/corral-filter/intercept/current/intercept-ca.key")
        out = result.stdout
        # The test machines' own egress ends TLS with a CA of its own, which this host
        # trusts (EXTRA_CAS) and the appliance is given: with it, the real upstream verifies.
        # A network that ends TLS with a CA nobody gave the appliance must be refused, with
        # the reason, never passed on unverified.
        intercepted = ("failed TLS verification: self-signed certificate in certificate "
                       "chain") in out
        if intercepted and not EXTRA_CAS:  # and this host told us of no CA to give it
            print("vm: this network intercepts TLS; the filter refused the upstream, as it must")
        else:  # the CAs given (`corral up --trust-ca`) are what it verifies against
            assert "allowed 200" in out, out
        assert "denied 403" in out, out + result.stderr
        assert "CN=corral interception CA" in out, out
        assert "700 corral-filter\n600 corral-filter" in out, out
    finally:
        appliance.corral("rm", "--appliance", NAME, "inspected", timeout=300)


GIT_PROJECT = """
[http]
allow = ["deb.debian.org"]    # the battery's allowed host (`--allowed`)

[[git]]
host = "host.corral"
repos = ["acme/widget"]
"""


def test_a_confined_push_from_a_real_session_inside_the_appliance(appliance, tmp_path):
    """git over SSH from a session in the VM through the appliance's git gateway to a git
    server on this machine, host.corral (the Vagrantfile gives the filter the VM's default
    gateway), with a key only the appliance holds: the session's branch is pushed, main is
    refused with the words git prints, the battery's probe passes, and the server's own port
    stays closed to the session."""
    config = tomllib.loads(appliance.ssh("sudo cat /etc/corral/filter.toml").stdout)
    address = config.get("host", {}).get("gateway")
    assert address, "the role wrote no [host] gateway: host.corral is no address"
    root = tmp_path / "repos"
    root.mkdir()
    fakes.GitHttp.seed(root, ["acme/widget"])
    held = asyncssh.generate_private_key("ssh-ed25519")
    loop = fakes.Loop()
    server = fakes.GitSsh(loop, root, held.export_public_key().decode(), address)
    try:
        (tmp_path / "known_hosts").write_text(f"host.corral {server.public}\n")
        project = tmp_path / "project"
        project.mkdir()
        (project / "corral.toml").write_text(GIT_PROJECT)
        # larger packed than a JSON body may be ([api] max_body, 16 KiB): uploads have a limit
        # of their own, and a project of any real size must pass
        blob = os.urandom(64 * 1024)
        (project / "blob.bin").write_bytes(blob)
        stored = appliance.corral("secret", "set", "VM_HOST_GIT", "--appliance", NAME, "--ssh",
                                  "--host", "host.corral", "--port", str(server.port),
                                  "--known-hosts", str(tmp_path / "known_hosts"),
                                  input=held.export_private_key().decode())
        assert stored.returncode == 0, stored.stderr
        started = appliance.corral("run", "--appliance", NAME, "--project", str(project),
                                   "--name", "pusher", "--detach", timeout=600)
        assert started.returncode == 0, started.stderr
        script = ("git config --global user.email agent@corral.test && "
                  "git config --global user.name agent && cd /tmp && "
                  "git clone -q git@host.corral:acme/widget.git w && cd w && "
                  "git commit -q --allow-empty -m vm && "
                  "git push -q origin HEAD:refs/heads/corral/pusher/vm && "
                  "echo pushed $(git rev-parse HEAD) && "
                  "{ git push origin HEAD:main 2>&1 || echo main refused; } && "
                  f"{{ ssh -o BatchMode=yes -o StrictHostKeyChecking=no -o ConnectTimeout=5 "
                  f"-p {server.port} git@{address} true; echo direct $?; }} && "
                  "sha256sum /work/blob.bin")
        done = appliance.corral("shell", "--appliance", NAME, "pusher", "--", "sh", "-c",
                                script, timeout=300)
        out = done.stdout
        assert done.returncode == 0, out + done.stderr
        pushed = re.search(r"^pushed ([0-9a-f]{40})$", out, re.M)
        refs = fakes.GitHttp.refs(root / "acme/widget.git")
        assert pushed and refs["refs/heads/corral/pusher/vm"] == pushed.group(1), (out, refs)
        assert "[remote rejected]" in out and "may push only" in out and "main refused" in out
        assert refs["refs/heads/main"] != pushed.group(1)
        assert "direct 255" in out, out  # no tcp rule: only the gateway reaches the host
        assert hashlib.sha256(blob).hexdigest() in out, out
        battery = appliance.corral("selftest", "--appliance", NAME, "pusher", "--allowed",
                                   "deb.debian.org", "--git-ssh",
                                   "host.corral", "--git-repo", "acme/widget", "--only",
                                   "ssh-push-refused", "--json", timeout=300)
        assert battery.returncode == 0, battery.stdout + battery.stderr
        answer = json.loads(battery.stdout)
        assert answer["passed"] and [p["id"] for p in answer["probes"]] == ["ssh-push-refused"]
        assert answer["tally"]["unrecorded"] == 0, answer["tally"]
        assert fakes.GitHttp.refs(root / "acme/widget.git") == refs
    finally:  # each whether or not it was made: what was not says so and changes nothing
        appliance.corral("rm", "--appliance", NAME, "pusher", timeout=300)
        appliance.corral("secret", "rm", "VM_HOST_GIT", "--appliance", NAME)
        server.close()
        loop.close()


def test_destroy_removes_the_domain(appliance):
    # where the VM's memory went by the end (2 GiB by default), in the log of a run with -s
    print(appliance.ssh("free -m; ps -eo rss,pid,args --sort=-rss | head -15 | cut -c1-120",
                        timeout=120).stdout)
    destroyed = appliance.corral("destroy", "--appliance", NAME, timeout=600)
    assert destroyed.returncode == 0, destroyed.stderr
    status = appliance.corral("status", "--appliance", NAME, "--json")
    assert status.returncode != 0
    assert json.loads(status.stdout)["vm"]["state"] == "not created"
