"""The admin API over real mTLS: who may talk to it, and what every endpoint answers."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time

import pytest

from appliance import pki
from cli.client import CliError
from tests.integration.conftest import connect, recv_all
from tests.integration.filter.test_dns import ask

from .conftest import tls_client


def raw_get(api, context: ssl.SSLContext, path="/v1/status"):
    connection = http.client.HTTPSConnection("127.0.0.1", api.port, context=context, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


# -- who may talk to it -----------------------------------------------------------------


def test_a_valid_client_works(api):
    d = api.client_dir()
    status, body = raw_get(api, tls_client(d / "ca.crt", d / "client.crt", d / "client.key"))
    assert status == 200 and body["filter"]["healthy"] is True


def test_without_a_client_certificate_there_is_no_answer(api):
    d = api.client_dir()
    with pytest.raises((ssl.SSLError, ConnectionError)):
        raw_get(api, tls_client(d / "ca.crt"))


def test_a_certificate_from_another_ca_is_refused(api):
    d = api.client_dir("stranger", pki.issue())
    trusting = tls_client(api.client_dir() / "ca.crt", d / "client.crt", d / "client.key")
    with pytest.raises((ssl.SSLError, ConnectionError)):
        raw_get(api, trusting)


def test_a_tls_1_2_client_is_refused(api):
    d = api.client_dir()
    context = tls_client(d / "ca.crt", d / "client.crt", d / "client.key",
                         ssl.TLSVersion.TLSv1_2)
    with pytest.raises(ssl.SSLError, match=r"(?i)protocol version|alert"):
        raw_get(api, context)


def test_server_certificate_is_ed25519_for_127_0_0_1(api):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ed25519

    cert = x509.load_pem_x509_certificate(api.bundle.server_cert)
    assert isinstance(cert.public_key(), ed25519.Ed25519PublicKey)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]


# -- what it answers --------------------------------------------------------------------


def test_status(api):
    status = api.client().request("GET", "/status")
    assert status["filter"]["sessions"] == 2 and "version" in status
    assert status["firewall"] is not None  # loaded or not, it says which


def test_policy_add_list_and_revoke(api, corral_filter):
    client = api.client()
    added = client.request("POST", "/policy/rules",
                           {"session": "s2", "kind": "dns", "rule": "api-added.test"})
    assert added["added"] is True and added["rule"]["layer"] == "session"
    again = client.request("POST", "/policy/rules",
                           {"session": "s2", "kind": "dns", "rule": "API-ADDED.test."})
    assert again["added"] is False
    rules = client.request("GET", "/policy", session="s2")["rules"]
    assert {"kind": "dns", "rule": "api-added.test", "layer": "session", "source": "api"} in rules
    revoked = client.request("DELETE", "/policy/rules",
                             {"session": "s2", "kind": "dns", "rule": "api-added.test"})
    assert revoked["rule"]["rule"] == "api-added.test"


@pytest.mark.parametrize(("method", "path", "body", "status", "message"), [
    ("POST", "/v1/policy/rules", {"session": "s2", "kind": "http"}, 400, "missing field 'rule'"),
    ("POST", "/v1/policy/rules", {"session": "s2", "kind": "http", "rule": "x", "extra": 1},
     400, "unknown field(s): extra"),
    ("POST", "/v1/policy/rules", {"session": "s2", "kind": "http", "rule": 7}, 400,
     "field 'rule' must be a str"),
    ("POST", "/v1/policy/rules", {"session": "s2", "kind": "http", "rule": "bad name"}, 400,
     "not a valid host name"),
    ("POST", "/v1/policy/rules", {"session": "nope", "kind": "http", "rule": "a.test"}, 404,
     "no session 'nope'"),
    ("POST", "/v1/policy/rules", ["a", "list"], 400, "must be a JSON object"),
    ("POST", "/v1/policy/rules", {"session": "s2", "kind": "http", "rule": "a.test",
                                  "expires_in": "10m"}, 400,
     "field 'expires_in' must be a int or float"),
    ("POST", "/v1/policy/rules", {"session": "s2", "kind": "http", "rule": "a.test",
                                  "expires_in": 0}, 400, "'expires_in' must be more than 0"),
    ("DELETE", "/v1/policy/rules", {"session": "s2", "kind": "http", "rule": "never.test"}, 400,
     "has no runtime http rule never.test"),
    ("GET", "/v1/events?last=abc", None, 400, "'last' must be a whole number"),
    ("GET", "/v1/events?verdict=maybe", None, 400, "verdict must be one of"),
    ("GET", "/v1/audit?since=yesterday", None, 400, "UNIX timestamp"),
    ("GET", "/v1/nope", None, 404, "not found"),
    ("PUT", "/v1/status", None, 405, "not allowed"),
])
def test_bad_requests_get_precise_json_errors(api, method, path, body, status, message):
    d = api.client_dir()
    connection = http.client.HTTPSConnection(
        "127.0.0.1", api.port, timeout=5,
        context=tls_client(d / "ca.crt", d / "client.crt", d / "client.key"))
    headers = {"Content-Type": "application/json"} if body is not None else {}
    connection.request(method, path, body=json.dumps(body) if body is not None else None,
                       headers=headers)
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    assert response.status == status
    assert message.lower() in answer["error"]["message"].lower()


def test_body_size_limit_and_content_type(api):
    d = api.client_dir()
    context = tls_client(d / "ca.crt", d / "client.crt", d / "client.key")
    for body, content_type, status in ((b"{" + b" " * 8192 + b"}", "application/json", 413),
                                       (b"session=s2", "application/x-www-form-urlencoded", 415)):
        connection = http.client.HTTPSConnection("127.0.0.1", api.port, context=context,
                                                 timeout=5)
        connection.request("POST", "/v1/policy/rules", body=body,
                           headers={"Content-Type": content_type})
        response = connection.getresponse()
        assert response.status == status
        answer = json.loads(response.read())
        if status == 413:  # said in our words: the limit and its setting
            assert answer["error"]["message"] == (
                "the request body is larger than 4096 bytes, all this request may send "
                "([api] max_body)")
        connection.close()


def test_a_secret_larger_than_a_json_body_goes_in(api):
    """A valid ssh secret (a key, 32 hosts, 16 pinned host keys) passes [api] max_body
    (4096 here): secrets have a limit of their own, what the filter takes."""
    import asyncssh

    hosts = [f"git{i}.{'long-name.' * 8}example.org" for i in range(32)]
    keys = [asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
            for _ in range(16)]
    value = asyncssh.generate_private_key("ssh-ed25519").export_private_key().decode()
    body = {"value": value, "hosts": hosts, "scheme": "ssh", "host_keys": keys}
    assert len(json.dumps(body)) > 4096
    answer = api.client().request("PUT", "/secrets/BIG_SSH", body)
    assert answer["secret"]["hosts"] == hosts
    api.client().request("DELETE", "/secrets/BIG_SSH")
    with pytest.raises(CliError, match="larger than 49152 bytes"):
        api.client().request("PUT", "/secrets/HUGE", {**body, "value": "x" * 60000})


def test_presets_sessions_events_audit(api, corral_filter):
    client = api.client()
    assert {"pypi", "github"} <= {p["name"] for p in client.request("GET", "/presets")["presets"]}
    sessions = {s["name"] for s in client.request("GET", "/sessions")["sessions"]}
    assert sessions == {"s1", "s2"}
    for n in range(6):
        ask(corral_filter.dns_port, f"filler-{n}.test")
    ask(corral_filter.dns_port, "events-probe.test")
    corral_filter.wait_event(lambda e: e["name"] == "events-probe.test")
    events = client.request("GET", "/events", last=50, verdict="deny")["events"]
    assert any(e["name"] == "events-probe.test" for e in events)
    assert all(e["verdict"] == "deny" for e in events)
    deadline = time.monotonic() + 5
    while not (page := client.request("GET", "/audit", limit=5))["more"]:  # group commit
        assert time.monotonic() < deadline, page
        time.sleep(0.05)
    assert len(page["records"]) == 5
    following = client.request("GET", "/audit", after=page["records"][-1]["seq"], limit=5)
    assert following["records"][0]["seq"] == page["records"][-1]["seq"] + 1
    assert client.request("GET", "/audit/verify")["intact"] is True


def test_event_stream_delivers_live_events(api, corral_filter):
    client = api.client()
    received = []

    def read():
        for event in client.stream("/events/stream", verdict="deny", session="s1"):
            received.append(event)
            return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.5)  # subscribed
    started = time.monotonic()
    with connect(corral_filter.proxy_port) as sock:
        sock.sendall(b"CONNECT stream-probe.test:443 HTTP/1.1\r\n\r\n")
        recv_all(sock)
    reader.join(5)
    assert received and received[0]["name"] == "stream-probe.test"
    assert time.monotonic() - started < 1.0


def test_filter_down_is_503_not_a_hang(api, tmp_path):
    from .conftest import ApiProcess

    orphan = ApiProcess(tmp_path, tmp_path / "no-such.sock")
    try:
        status = orphan.client().request("GET", "/status")
        assert status["filter"]["healthy"] is False
        with pytest.raises(CliError) as info:
            orphan.client().request("GET", "/sessions")
        assert info.value.code == 3 and "not answering" in str(info.value)
    finally:
        orphan.stop()


def test_refuses_to_start_without_key_material(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "api.toml").write_text(f'[api]\ntls_dir = "{tmp_path}/none"\n')
    exe = Path(sys.executable).parent / "corral-api"
    result = subprocess.run([str(exe), "--config", str(tmp_path / "api.toml")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "refusing to start without key material: ca.crt, server.crt, server.key" in (
        result.stderr)


def test_rotation_makes_the_old_client_certificate_fail(api):
    old = api.client_dir("before-rotation")
    old_client = api.client(old)
    assert old_client.request("GET", "/status")
    bundle = pki.issue(["127.0.0.1"])
    pki.write_server(bundle, api.server_dir)
    api.proc.send_signal(1)  # SIGHUP: gunicorn starts new workers with the new files
    new = api.client_dir("after-rotation", bundle)
    deadline = time.monotonic() + 20
    while True:
        try:
            api.client(new).request("GET", "/status")
            break
        except CliError:
            assert time.monotonic() < deadline, api.log.read_text()[-2000:]
            time.sleep(0.2)
    with pytest.raises(CliError) as info:
        old_client.request("GET", "/status")
    assert info.value.code == 3 and "TLS" in str(info.value)
    api.bundle = bundle  # later tests in this module use the new set


def test_socket_level_garbage_does_not_break_the_server(api):
    with socket.create_connection(("127.0.0.1", api.port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")  # plaintext on a TLS port
        sock.recv(1024)
    assert api.client().request("GET", "/status")
