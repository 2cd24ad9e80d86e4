"""A session's trust directory: the appliance's bundle and the interception CA, as PEM for
every OpenSSL-, Go- and node-based client and as a JKS store a real JVM reads."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from appliance import pki
from appliance.sandbox import hardening, trust


def pem(der: bytes) -> str:
    return x509.load_der_x509_certificate(der).public_bytes(
        serialization.Encoding.PEM).decode()


@pytest.fixture
def system(tmp_path):
    """A system bundle of two CAs, with the comments Debian's has between them."""
    first, second = pki.intercept_ca()[0], pki.intercept_ca()[0]
    path = tmp_path / "ca-certificates.crt"
    path.write_bytes(b"# first\n" + first + b"\n# second\n" + second)
    return path


def test_the_bundle_is_the_system_one_then_the_interception_ca(tmp_path, system):
    ca = pki.intercept_ca()[0].decode()
    trust.write(tmp_path / "trust", ca, system.read_bytes())
    bundle = (tmp_path / "trust" / trust.BUNDLE).read_bytes()
    assert bundle.startswith(system.read_bytes())
    ders = trust.certificates(bundle)
    assert len(ders) == 3 and pem(ders[-1]) == ca
    assert [d.name for d in (tmp_path / "trust").iterdir()] != []
    for path in [tmp_path / "trust", *(tmp_path / "trust").iterdir()]:
        assert path.stat().st_mode & 0o755 in (0o755, 0o644)  # the sandbox's user reads them


def test_without_an_interception_ca_the_bundle_is_the_system_one(tmp_path, system):
    trust.write(tmp_path / "trust", None, system.read_bytes())
    assert trust.certificates((tmp_path / "trust" / trust.BUNDLE).read_bytes()) == \
        trust.certificates(system.read_bytes())


def test_an_empty_base_still_trusts_the_interception_ca(tmp_path):
    ca = pki.intercept_ca()[0].decode()
    trust.write(tmp_path / "trust", ca, b"")
    assert [pem(d) for d in trust.certificates(
        (tmp_path / "trust" / trust.BUNDLE).read_bytes())] == [ca]


def test_what_is_not_a_certificate_block_is_skipped():
    ca = pki.intercept_ca()[0]
    broken = b"-----BEGIN CERTIFICATE-----\n!!!not base64!!!\n-----END CERTIFICATE-----\n"
    assert len(trust.certificates(broken + b"junk\n" + ca)) == 1


@pytest.mark.skipif(shutil.which("keytool") is None, reason="no JDK keytool on this host")
def test_the_jks_store_is_read_and_its_digest_checked_by_the_jdk(tmp_path, system):
    ca = pki.intercept_ca()[0].decode()
    trust.write(tmp_path / "trust", ca, system.read_bytes())
    listed = subprocess.run(
        ["keytool", "-list", "-v", "-keystore", str(tmp_path / "trust" / trust.JKS),
         "-storetype", "JKS", "-storepass", trust.JKS_PASSWORD],
        capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert "contains 3 entries" in listed.stdout
    assert f"Alias name: {trust.CORRAL_ALIAS}" in listed.stdout
    assert listed.stdout.count("trustedCertEntry") == 3
    tampered = bytearray((tmp_path / "trust" / trust.JKS).read_bytes())
    tampered[40] ^= 1
    (tmp_path / "bad.jks").write_bytes(bytes(tampered))
    refused = subprocess.run(["keytool", "-list", "-keystore", str(tmp_path / "bad.jks"),
                              "-storetype", "JKS", "-storepass", trust.JKS_PASSWORD],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0  # the digest covers every byte


def test_a_session_mounts_its_trust_read_only_and_every_stack_is_pointed_there():
    spec = hardening.Sandbox(name="corral-s1", image="i", network="n1", gateway="10.213.1.1",
                             seccomp_profile="/p", init="/i", trust="/state/s1/trust")
    arguments = hardening.run_arguments(spec, ["true"])
    volumes = [arguments[i + 1] for i, a in enumerate(arguments) if a == "--volume"]
    assert f"/state/s1/trust:{trust.TRUST_DIR}:ro" in volumes
    env = dict(arguments[i + 1].split("=", 1) for i, a in enumerate(arguments) if a == "--env")
    bundle = f"{trust.TRUST_DIR}/{trust.BUNDLE}"
    for key in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT",
                "GIT_SSL_CAINFO", "NODE_EXTRA_CA_CERTS"):
        assert env[key] == bundle
    assert "-Dhttps.proxyHost=10.213.1.1" in env["JAVA_TOOL_OPTIONS"]  # still there
    assert f"-Djavax.net.ssl.trustStore={trust.TRUST_DIR}/{trust.JKS}" in env["JAVA_TOOL_OPTIONS"]
    untrusting = hardening.run_arguments(
        hardening.Sandbox(name="x", image="i", network="n1", gateway="10.213.1.1",
                          seccomp_profile="/p", init="/i"), ["true"])
    assert not any(trust.TRUST_DIR in a for a in untrusting)
