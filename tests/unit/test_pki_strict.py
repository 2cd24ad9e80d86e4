"""Every certificate corral issues passes OpenSSL's strict (RFC 5280) verification, which
Python 3.13 turns on by default: Debian 13's interpreter runs the appliance's API and the
sessions' pip. Real TLS handshakes on loopback, with VERIFY_X509_STRICT set on each side as
3.13's `ssl.create_default_context` sets it (the flag exists on 3.11 too)."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import threading

import pytest

from appliance import pki
from appliance.pki.intercept import Authority, mint, server_context
from appliance.policy.names import parse_host


def strict(context: ssl.SSLContext) -> ssl.SSLContext:
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    return context


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, name: str | None) -> None:
    """One TLS handshake over a real loopback connection; raises the side's error."""
    listener = socket.create_server(("127.0.0.1", 0))
    failures: list[BaseException] = []

    def serve():
        connection, _ = listener.accept()
        try:
            with server.wrap_socket(connection, server_side=True) as tls:
                tls.recv(1)
        except (ssl.SSLError, OSError) as exc:
            failures.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with socket.create_connection(listener.getsockname()) as raw, \
                client.wrap_socket(raw, server_hostname=name) as tls:
            tls.sendall(b"x")
    finally:
        thread.join(10)
        listener.close()
    if failures:
        raise failures[0]


def files(tmp_path, bundle: pki.Bundle):
    pki.write_server(bundle, tmp_path / "server")
    pki.write_client(bundle, tmp_path / "client")
    return tmp_path / "server", tmp_path / "client"


def test_the_control_planes_certificates_pass_strict_verification_both_ways(tmp_path):
    server_dir, client_dir = files(tmp_path, pki.issue(["127.0.0.1"]))
    # the API's: gunicorn's context (its cert, the CA, CERT_REQUIRED)
    server = strict(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    server.load_cert_chain(server_dir / "server.crt", server_dir / "server.key")
    server.load_verify_locations(server_dir / "ca.crt")
    server.verify_mode = ssl.CERT_REQUIRED
    # the CLI's (cli/client.py)
    client = strict(ssl.create_default_context(cafile=str(client_dir / "ca.crt")))
    client.load_cert_chain(client_dir / "client.crt", client_dir / "client.key")
    client.check_hostname = False  # an IP address: the SAN is checked by the default check
    handshake(server, client, None)


def test_a_certificate_without_key_identifiers_is_what_strict_verification_refuses(tmp_path):
    """The check above can fail: a chain as corral issued it before (no key identifiers)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    now = datetime.datetime.now(datetime.UTC)
    key = ed25519.Ed25519PrivateKey.generate()
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "old")])
    leaf_key = ed25519.Ed25519PrivateKey.generate()
    ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
          .public_key(key.public_key()).serial_number(1).not_valid_before(now)
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(key, None))
    leaf = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(leaf_key.public_key()).serial_number(2).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(
                ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, None))
    pem = serialization.Encoding.PEM
    (tmp_path / "ca.crt").write_bytes(ca.public_bytes(pem))
    (tmp_path / "leaf.crt").write_bytes(leaf.public_bytes(pem))
    (tmp_path / "leaf.key").write_bytes(leaf_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "leaf.crt", tmp_path / "leaf.key")
    client = strict(ssl.create_default_context(cafile=str(tmp_path / "ca.crt")))
    client.check_hostname = False
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(server, client, None)


def test_an_interception_leaf_passes_strict_verification(tmp_path):
    cert, key = pki.intercept_ca(permit=["pypi.org"])
    (tmp_path / "ca.crt").write_bytes(cert)
    (tmp_path / "ca.key").write_bytes(key)
    (tmp_path / "ca.key").chmod(0o600)
    authority = Authority.load(str(tmp_path / "ca.crt"), str(tmp_path / "ca.key"))
    leaf, leaf_key = mint(authority, parse_host("pypi.org"), datetime.datetime.now(datetime.UTC))
    client = strict(ssl.create_default_context(cafile=str(tmp_path / "ca.crt")))
    handshake(server_context(leaf, leaf_key), client, "pypi.org")
