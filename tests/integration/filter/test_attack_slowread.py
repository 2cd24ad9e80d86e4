"""A client that stops reading holds its connection for ever: `idle_timeout` bounds every
read, but no write (`drain()` in relay.copy_exact, copy_until_eof, the pumps) has a bound.
A session keeps its connections, their upstream connections and their flows open past any
idle timeout, at no cost to itself (within its caps: other sessions are not affected)."""

from __future__ import annotations

import socket
import time

import pytest

from tests.integration.conftest import FilterProcess, connect


def test_a_client_that_stops_reading_is_closed_after_the_idle_timeout(internet, tmp_path):
    if internet.privileged:
        pytest.skip(internet.privileged)
    corral = FilterProcess(tmp_path, internet.dns.address, proxy_extra="idle_timeout = 1")
    try:
        sock = connect(corral.proxy_port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET http://allowed.test/big/200000000 HTTP/1.1\r\n"
                     b"Host: allowed.test\r\n\r\n")
        assert sock.recv(12) == b"HTTP/1.1 200"
        time.sleep(5)  # five idle timeouts without reading a byte
        status = corral.control({"op": "status"})
        sock.close()
        assert status["active_connections"] == 0, (
            f"still open after 5 x idle_timeout: {status['active_connections']} connection(s),"
            f" {status['proxy']['open_flows']} flow(s)")
    finally:
        corral.stop()
