"""Attacks inside TLS: the filter sees the ClientHello, never what follows. What a real
server (nginx) serves when the name that decided (CONNECT host / SNI) is allowed and the
request inside names a denied vhost on the same address (domain fronting, THREATS 13)."""

from __future__ import annotations

import socket
import ssl

import pytest

from tests.integration.conftest import recv_all
from tests.integration.filter.attacklab import open_lab, s3_connect


@pytest.fixture(scope="module")
def lab(internet, tmp_path_factory):
    yield from open_lab(internet, tmp_path_factory)


def _tls_get(lab, sock: socket.socket, sni: str, host: str) -> bytes:
    context = lab.internet.ca.client_context()
    with context.wrap_socket(sock, server_hostname=sni) as tls:
        tls.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        return recv_all(tls)


TERMINATION = pytest.mark.xfail(strict=True, reason=(
    "the Host header inside TLS is only seen where TLS is terminated (issue 15, opt-in "
    "inspection per host); docs/filter.md and THREATS 13 say so"))


@TERMINATION
def test_connect_allowed_sni_allowed_host_header_denied(lab):
    """BYPASS (inherent without TLS termination): CONNECT ng-a.test:443, SNI ng-a.test, and
    `Host: ng-d.test` inside: nginx picks the virtual server by Host, not SNI."""
    sock = s3_connect(lab.filter.proxy_port)
    sock.sendall(b"CONNECT ng-a.test:443 HTTP/1.1\r\nHost: ng-a.test:443\r\n\r\n")
    assert sock.recv(100).startswith(b"HTTP/1.1 200")
    reply = _tls_get(lab, sock, "ng-a.test", "ng-d.test")
    assert b"SECRET" not in reply, reply
    assert lab.denied_seen() == []


@TERMINATION
def test_transparent_tls_allowed_sni_host_header_denied(lab):
    """BYPASS (same, proxy-unaware): TLS to the transparent listener with SNI ng-a.test."""
    sock = s3_connect(lab.filter.tls_port)
    reply = _tls_get(lab, sock, "ng-a.test", "ng-d.test")
    assert b"SECRET" not in reply, reply


def test_connect_without_sni(lab):
    """CONNECT ng-a.test:443 and a ClientHello with no SNI at all: the server would pick
    any vhost, so the hello is refused (an access_denied alert), never spliced."""
    sock = s3_connect(lab.filter.proxy_port)
    sock.sendall(b"CONNECT ng-a.test:443 HTTP/1.1\r\nHost: ng-a.test:443\r\n\r\n")
    assert sock.recv(100).startswith(b"HTTP/1.1 200")
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with pytest.raises(ssl.SSLError, match=r"ACCESS_DENIED|access denied"):
        context.wrap_socket(sock, server_hostname=None)
    sock.close()
