"""Inspection as an agent meets it: a real session (`corral run` on the local backend) whose
project names a host of the fake internet in [[inspect]]. Every client stack in the image
reaches it through the filter's TLS termination without being told anything, a request the
rules deny gets the filter's 403 inside the TLS, a client that does not trust the corral CA
fails closed, and `corral certs rotate --interception` reaches the running session. A
secret stored with `corral secret set` reaches the host in place of the placeholder the
session holds, and goes nowhere else."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import textwrap

import pytest

from appliance.sandbox import trust
from appliance.sandbox.podman import Podman

from . import netns
from .conftest import APPLIANCE_NAME
from .test_cli_sessions import corral

POLICY = """
[http]
allow = ["allowed.test"]

[[inspect]]
host = "allowed.test"
deny = ["* /forbidden/**"]
"""
SESSION = "i1"
SECRET = "sk-e2e-0123456789abcdefSECRET"
TLS_FAILURE = re.compile(r"ssl|certificate|verify|self.signed|unable to get", re.I)
"""How a client says it did not trust the certificate it was shown."""


@pytest.fixture(scope="module")
def inspected(world, sandbox_image):
    project = world.dir / "inspect-project"
    project.mkdir(exist_ok=True)
    (project / "corral.toml").write_text(POLICY)
    stored = world.corral("secret", "set", "API_TOKEN", "--appliance", APPLIANCE_NAME,
                          "--host", "allowed.test", "--header", "x-api-key", input=SECRET + "\n")
    assert stored.returncode == 0, stored.stdout + stored.stderr
    assert SECRET not in stored.stdout + stored.stderr
    corral(world, "run", "--project", str(project), "--name", SESSION, "--detach")
    yield project
    corral(world, "rm", SESSION, check=False)
    world.corral("secret", "rm", "API_TOKEN", "--appliance", APPLIANCE_NAME)


def inside(world, script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return corral(world, "shell", SESSION, "--", "sh", "-c", script, check=False,
                  timeout=timeout)


def certs(world, *args: str) -> str:
    """`corral certs SUBCOMMAND --appliance e2e ...`, its output."""
    sub, *rest = args
    result = world.corral("certs", sub, "--appliance", APPLIANCE_NAME, *rest, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def origin_saw(out: str, path: str) -> dict:
    """The fake origin answers with JSON describing the request it got."""
    seen = json.loads(out[out.index("{"):])
    assert seen["path"] == path, seen
    return seen


def test_the_session_trusts_the_appliance_bundle_and_the_interception_ca(world, inspected):
    ca = certs(world, "interception", "--pem")
    assert ca.startswith("-----BEGIN CERTIFICATE-----")
    shown = inside(world, f"cat /etc/ssl/certs/ca-certificates.crt; echo; env | sort; "
                   f"ls {trust.TRUST_DIR}")
    assert ca.strip() in shown.stdout  # the system bundle, through the image's link
    for key, value in trust.environment().items():
        assert f"{key}={value}\n" in shown.stdout
    assert trust.java_options() in shown.stdout
    assert "cacerts.jks" in shown.stdout


def test_curl_reaches_the_inspected_host_and_a_denied_request_gets_the_filters_403(
        world, inspected):
    ok = inside(world, "curl -sS https://allowed.test/curl")
    assert ok.returncode == 0, ok.stderr
    origin_saw(ok.stdout, "/curl")
    denied = inside(world, "curl -sS -D - -o /dev/null https://allowed.test/forbidden/x")
    assert denied.returncode == 0, denied.stderr
    # after the proxy's own "200 Connection established", the filter's answer inside the TLS
    inner = denied.stdout.split("\n\n", 1)[1] if denied.stdout.startswith(
        "HTTP/1.1 200 Connection established") else denied.stdout
    assert inner.startswith("HTTP/1.1 403"), denied.stdout
    assert "x-corral-deny: get /forbidden/x on allowed.test denied by request rule" in \
        inner.lower()


def test_python_urllib_through_the_proxy(world, inspected):
    result = inside(world, "python3 -c \"import urllib.request; "
                    "print(urllib.request.urlopen('https://allowed.test/python').read()"
                    ".decode())\"")
    assert result.returncode == 0, result.stderr
    origin_saw(result.stdout, "/python")


def test_node_without_the_proxy_takes_the_transparent_path(world, inspected):
    # node's https module ignores HTTPS_PROXY: its connection to :443 is redirected to the
    # filter's transparent TLS listener, and inspected there
    script = ("require('https').get('https://allowed.test/node', r => { let b = '';"
              " r.on('data', d => b += d); r.on('end', () => console.log(r.statusCode, b)) })"
              ".on('error', e => { console.log('ERROR', e.code, e.message); process.exit(1) })")
    result = inside(world, f"node -e \"{script}\"")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("200 "), result.stdout
    origin_saw(result.stdout, "/node")


def test_git_speaks_https_to_the_inspected_host(world, inspected):
    # the fake origin is no git server (one comes with git confinement): git takes its
    # answer for an empty repository, and a path the rules deny for the filter's 403
    listed = inside(world, "git ls-remote https://allowed.test/acme/widget.git")
    assert listed.returncode == 0, listed.stderr
    denied = inside(world, "git ls-remote https://allowed.test/forbidden/widget.git")
    assert denied.returncode != 0
    assert "The requested URL returned error: 403" in denied.stderr, denied.stderr
    assert not TLS_FAILURE.search(listed.stderr + denied.stderr), denied.stderr


def test_pip_reads_an_index_on_the_inspected_host(world, inspected):
    result = inside(world, "pip download --no-deps --no-cache-dir --retries 0 --timeout 20 "
                    "-d /tmp/pip --index-url https://allowed.test/simple/ corral-probe")
    assert result.returncode != 0  # the origin is no index: nothing matches
    assert "from versions: none" in result.stderr, result.stderr
    assert not TLS_FAILURE.search(result.stdout + result.stderr), result.stderr


def test_npm_reads_a_registry_on_the_inspected_host(world, inspected):
    read = inside(world, "npm view corral-probe --registry https://allowed.test/ "
                  "--fetch-retries 0")
    assert read.returncode == 0, read.stdout + read.stderr
    denied = inside(world, "npm view corral-probe --registry https://allowed.test/forbidden/ "
                    "--fetch-retries 0")
    assert denied.returncode != 0
    assert "E403" in denied.stderr, denied.stderr
    assert not TLS_FAILURE.search(read.stderr + denied.stderr), denied.stderr

def test_a_jvm_in_the_sessions_network_trusts_the_jks_store(world, inspected, tmp_path):
    """The image has no JVM: this host's runs in the session's network namespace, with the
    session's own JAVA_TOOL_OPTIONS (proxy and trust store) and trust directory."""
    java = shutil.which("java")
    if java is None:
        pytest.skip("no JVM on this host (apt-get install default-jre-headless)")
    podman = Podman(world.dir / "containers.conf",
                    prefix=("nsenter", f"--net=/run/netns/{netns.APPLIANCE}"))
    state = podman.json("inspect", f"corral-{SESSION}")[0]
    pid = state["State"]["Pid"]
    env = dict(item.split("=", 1) for item in state["Config"]["Env"])
    store = world.dir / "sandbox" / "workspaces" / SESSION / "trust" / trust.JKS
    options = env["JAVA_TOOL_OPTIONS"].replace(f"{trust.TRUST_DIR}/{trust.JKS}", str(store))
    probe = tmp_path / "Probe.java"
    probe.write_text(textwrap.dedent("""
        public class Probe {
            public static void main(String[] args) throws Exception {
                var url = new java.net.URL(args[0]);
                var connection = (javax.net.ssl.HttpsURLConnection) url.openConnection();
                System.out.println(connection.getResponseCode());
                System.out.println(new String(connection.getInputStream().readAllBytes()));
            }
        }"""))
    result = subprocess.run(
        ["nsenter", f"--net=/proc/{pid}/ns/net", java, str(probe), "https://allowed.test/jvm"],
        capture_output=True, text=True, timeout=120, env={"JAVA_TOOL_OPTIONS": options,
                                                          "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("200\n"), result.stdout
    origin_saw(result.stdout, "/jvm")


def test_a_client_that_refuses_the_corral_ca_fails_closed(world, inspected):
    result = inside(world, f"sed '/# corral interception CA/,$d' "
                    f"{trust.TRUST_DIR}/{trust.BUNDLE} > /tmp/no-corral.pem; "
                    "curl -sS --cacert /tmp/no-corral.pem https://allowed.test/refused")
    assert result.returncode == 60, result.stdout + result.stderr  # certificate problem
    assert "/refused" not in result.stdout  # nothing came back from the origin
    refusals = [e for e in world.events() if e.get("session") == SESSION
                and "trust the corral interception CA" in (e.get("reason") or "")]
    assert refusals and refusals[-1]["verdict"] in ("deny", "error"), refusals


def test_rotating_the_interception_ca_reaches_the_running_session(world, inspected, tmp_path):
    old = certs(world, "interception", "--pem")
    rotated = json.loads(certs(world, "rotate", "--interception", "--json"))
    assert SESSION in rotated["sessions"]
    new = certs(world, "interception", "--pem")
    assert new != old and rotated["ca"]["pem"] == new
    shown = inside(world, f"cat {trust.TRUST_DIR}/{trust.BUNDLE}")
    assert new.strip() in shown.stdout and old.strip() not in shown.stdout
    ok = inside(world, "curl -sS https://allowed.test/after-rotation")
    assert ok.returncode == 0, ok.stderr
    origin_saw(ok.stdout, "/after-rotation")
    # and the leaf it was shown is the new CA's: the old one alone does not verify it
    stale = inside(world, f"cat > /tmp/old.pem <<'END'\n{old}END\n"
                   "curl -sS --cacert /tmp/old.pem https://allowed.test/old")
    assert stale.returncode == 60, stale.stdout + stale.stderr
    events = [e for e in world.events() if e.get("kind") == "certs"]
    assert events and rotated["ca"]["sha256"] in events[-1]["reason"]


def test_the_session_holds_a_placeholder_and_the_host_gets_the_secret(world, inspected):
    env = inside(world, "printenv API_TOKEN").stdout.strip()
    assert env.startswith("corral-secret-api-token-") and SECRET not in env
    sent = inside(world, 'curl -sS -H "x-api-key: $API_TOKEN" https://allowed.test/secret')
    assert sent.returncode == 0, sent.stderr
    # the fake origin echoes what it got: the value, which the session itself never had
    assert origin_saw(sent.stdout, "/secret")["headers"]["x-api-key"] == SECRET
    listed = world.corral("secret", "ls", "--appliance", APPLIANCE_NAME, "--json")
    assert json.loads(listed.stdout)["secrets"][0]["hosts"] == ["allowed.test"]
    assert SECRET not in listed.stdout


def test_the_placeholder_goes_nowhere_else(world, inspected):
    before = len(world.events())
    query = inside(world, 'curl -sS -o /dev/null -w "%{http_code}" '
                   '"https://allowed.test/q?key=$API_TOKEN"')
    assert query.stdout.endswith("403"), query.stdout + query.stderr
    header = inside(world, 'curl -sS -o /dev/null -w "%{http_code}" '
                    '-H "Authorization: Bearer $API_TOKEN" https://allowed.test/wrong-form')
    assert header.stdout.endswith("403"), header.stdout + header.stderr
    name = inside(world, 'getent hosts "$API_TOKEN.allowed.test" || echo unresolved')
    assert "unresolved" in name.stdout, name.stdout
    events = world.events()[before:]
    leaks = [e for e in events if e.get("kind") == "secret" and e["verdict"] == "deny"]
    assert len(leaks) == 2 and {e["secret"] for e in leaks} == {"API_TOKEN"}, leaks
    assert any("placeholder" in (e.get("reason") or "") and e.get("kind") == "dns"
               for e in events), events[-5:]
    assert SECRET not in json.dumps(world.events())
