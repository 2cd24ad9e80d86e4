"""What a request to an inspected host may not carry out, without sockets: the appliance's
secret values, placeholders not the session's own, and token formats (shaped as the real
ones are); a finding names the detector, never the value."""

from __future__ import annotations

import pytest

from appliance.filter.proxy.credentials import Credentials
from appliance.filter.proxy.leaks import Leaks
from appliance.filter.secrets import Secret
from appliance.policy import parse_host
from appliance.policy.config import parse_policy
from appliance.policy.decide import Policy

TOKENS = {
    "private key": b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEA\n",
    "AWS access key": b"aws_access_key_id = AKIAIOSFODNN7EXAMPLE\n",
    "GitHub token": b'{"token": "ghp_' + b"a1B2" * 9 + b'"}',
    "GitLab token": b"glpat-" + b"x1Y2z3" * 3 + b"ab",
    "Slack token": b"xoxb-1234567890-abcdefghijklmnop",
    "Anthropic API key": b"sk-ant-api03-" + b"A1b2C3d4" * 6,
    "JSON Web Token": b"eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0."
                      b"dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
}


@pytest.mark.parametrize("detector", TOKENS)
def test_each_token_format_is_found_and_named(detector):
    found = Leaks({}).scan(b"prefix " + TOKENS[detector] + b" suffix", "the body")
    assert found is not None and found.detector == f"a {detector}"
    assert TOKENS[detector].decode() not in found.reason


@pytest.mark.parametrize("text", [
    b"ghp_short", b"AKIA1234", b"xyzghp_" + b"a" * 36, b"eyJhbGciOi.eyJzdWIi.sig",
    b"def main():\n    return 'private key handling'\n", b"-----BEGIN PUBLIC KEY-----",
    b"glpat-short",
])
def test_text_that_only_looks_alike_passes(text):
    assert Leaks({}).scan(text, "the body") is None


@pytest.mark.parametrize("detector", [d for d in TOKENS if d != "private key"])
@pytest.mark.parametrize("escape", [b"\\n", b"\\t", b"\\r", b"\\u000a", b"\\u00A0"])
def test_a_token_right_after_a_json_escape_is_found(detector, escape):
    """What `json.dumps` writes for a token at the start of a line: `\\n` then the token,
    whose server-side first byte follows a newline, not the `n`."""
    token = TOKENS[detector].split(b'"')[3] if detector == "GitHub token" else TOKENS[detector]
    token = token.split(b" = ")[-1].rstrip(b"\n")
    found = Leaks({}).scan(b'{"body": "my token:' + escape + token + b'"}', "the body")
    assert found is not None and found.detector == f"a {detector}"


def test_a_private_key_form_encoded_with_plus_for_spaces_is_found():
    from urllib.parse import urlencode

    body = urlencode({"key": TOKENS["private key"].decode()}).encode()
    assert b"-----BEGIN+OPENSSH+PRIVATE+KEY-----" in body
    found = Leaks({}).scan(body, "the body")
    assert found is not None and found.detector == "a private key"


def test_secret_values_and_foreign_placeholders_are_found_percent_decoded_too():
    secret = Secret("API_TOKEN", "sk-live-0123456789abcdef", ("api.test",), "header",
                    "x-api-key", nonce="n1")
    credentials = Credentials(b"k" * 32, {"API_TOKEN": secret})
    mine = credentials.placeholder("s1", "API_TOKEN").encode()
    theirs = credentials.placeholder("s2", "API_TOKEN").encode()
    leaks = credentials.leaks("s1")
    assert leaks.scan(b"note=" + mine, "the body") is None  # worthless: passes
    found = leaks.scan(b"note=" + theirs, "the body")
    assert found.detector == "a placeholder that is not this session's"
    found = leaks.scan(b"v=sk-live-0123456789abcdef", "the body")
    assert found.detector == "the secret API_TOKEN" and "sk-live" not in found.reason
    found = leaks.scan(b"v=sk%2Dlive%2D0123456789abcdef", "the target")
    assert found.where == "the target (percent-decoded)"
    assert credentials.leaks("s1") is leaks  # built once per session and snapshot


def test_scan_false_turns_body_reading_off_for_its_host_only():
    document = parse_policy('[[inspect]]\nhost = "bulk.test"\nscan = false\n'
                            '[[inspect]]\nhost = "api.test"\n', "corral.toml", "project")
    assert [r.text for r in document.rules] == ["bulk.test unscanned", "api.test"]
    policy = Policy(document.rules)
    assert not policy.inspection(parse_host("bulk.test")).scanned
    assert policy.inspection(parse_host("api.test")).scanned


def _two_secrets() -> Credentials:
    bearer = Secret("API_TOKEN", "sk-live-0123456789abcdef", ("api.test",), "bearer",
                    nonce="n1")
    basic = Secret("DEPLOY", "hunter2-hunter2", ("deploy.test",), "basic", user="bot",
                   nonce="n2")
    return Credentials(b"k" * 32, {"API_TOKEN": bearer, "DEPLOY": basic})


@pytest.mark.parametrize("fields", [
    [("Authorization", "Bearer sk-live-0123456789abcdef")],
    [("Cookie", "a=1; session=sk-live-0123456789abcdef")],
    [("Cookie", "session=sk%2Dlive%2D0123456789abcdef")],
    [("X-Anything", "x sk-live-0123456789abcdef y")],
    [("sk-live-0123456789abcdef", "a header's name")],
    [("Authorization", "Basic " + __import__("base64").b64encode(
        b"me:sk-live-0123456789abcdef").decode())],
    [("Proxy-Authorization", "basic " + __import__("base64").b64encode(
        b"sk-live-0123456789abcdef:x").decode().rstrip("="))],
    [("Authorization", "Basic " + __import__("base64").b64encode(
        b"bot:hunter2-hunter2").decode())],
    [("X-Note", "hunter2-hunter2")],
])
def test_a_held_value_in_any_header_or_header_name_is_found(fields):
    found = _two_secrets().leaks("s1").in_fields(tuple(fields))
    assert found is not None and found.detector.startswith("the secret ")
    assert found.where.startswith("the field ") or found.where == "a field's name"
    assert "sk-live" not in found.reason and "hunter2" not in found.reason


def test_headers_without_a_held_value_pass_and_token_formats_there_are_not_read():
    leaks = _two_secrets().leaks("s1")
    assert leaks.in_fields((("Authorization", "Bearer ghp_" + "a1B2" * 9),
                            ("Cookie", "a=b"), ("User-Agent", "curl/8"))) is None


@pytest.mark.parametrize("spell", [str.upper, str.title, lambda p: p[:14].upper() + p[14:]])
def test_a_foreign_placeholder_is_a_tripwire_in_any_letter_case(spell):
    credentials = _two_secrets()
    theirs = spell(credentials.placeholder("s2", "API_TOKEN")).encode()
    found = credentials.leaks("s1").scan(b"note=" + theirs, "the body")
    assert found is not None and found.detector == "a placeholder that is not this session's"
