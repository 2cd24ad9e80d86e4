"""Outliving a revoke (THREATS 26): a flow decided before a policy change but dialled after
it. `Proxy.rejudge` cuts the flows registered in `Flows`; a CONNECT used to be registered
only once its upstream answered, so a rule removed while the dial was in flight cut
nothing. It is registered before it dials now."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import pytest

from tests.integration.conftest import recv_all
from tests.integration.filter.attacklab import open_lab, s3_connect


@pytest.fixture(scope="module")
def lab(internet, tmp_path_factory):
    yield from open_lab(internet, tmp_path_factory)

SLOW = "127.31.0.8"


class SlowTlsOrigin:
    """A TLS origin whose accept queue is full: a SYN to it is dropped and retried by the
    kernel a second later, so whoever dials it waits ~1 s (a slow or distant origin)."""

    def __init__(self, context: ssl.SSLContext):
        self.context = context
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((SLOW, 443))
        self.sock.listen(0)
        self.filler = socket.create_connection((SLOW, 443), 2)  # the queue is now full
        self.served: list[bytes] = []

    def release(self) -> None:
        """Accept the filler, then serve TLS to whoever comes next."""
        self.sock.accept()[0].close()
        self.filler.close()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with self.context.wrap_socket(conn, server_side=True) as tls:
            tls.settimeout(5)
            try:
                while data := tls.recv(65536):
                    self.served.append(data)
                    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nserved")
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


def test_a_rule_removed_while_the_tunnel_dials_is_enforced(lab, request):
    """Remove the rule while the CONNECT's upstream connect is in flight: the flow was
    registered before it dialled, so it is cut, and nothing reaches the origin."""
    lab.internet.dns.zone["slow.test"] = [("A", SLOW, 300)]
    origin = SlowTlsOrigin(lab.internet.ca.server_context(["slow.test"]))
    control = lab.filter.control
    assert control({"op": "add", "session": "s3", "kind": "http", "rule": "slow.test"})["ok"]
    try:
        sock = s3_connect(lab.filter.proxy_port, timeout=10)
        request.addfinalizer(sock.close)
        sock.sendall(b"CONNECT slow.test:443 HTTP/1.1\r\nHost: slow.test:443\r\n\r\n")
        time.sleep(0.3)  # the filter has decided and is dialling (its SYN was dropped)
        removed = control({"op": "remove", "session": "s3", "kind": "http",
                           "rule": "slow.test"})
        assert removed["ok"], removed
        revoked_at = time.time()
        origin.release()  # the retried SYN, ~1 s after the first, now gets through
        status = sock.recv(100)
        context = lab.internet.ca.client_context()
        if status.startswith(b"HTTP/1.1 200"):
            with context.wrap_socket(sock, server_hostname="slow.test") as tls:
                for _ in range(3):
                    tls.sendall(b"GET / HTTP/1.1\r\nHost: slow.test\r\n\r\n")
                    time.sleep(0.5)
                tls.settimeout(1)
                reply = recv_all(tls)
        else:
            reply = status
        events = [e for e in lab.filter.events()
                  if e.get("name") == "slow.test" and e.get("kind") == "connect"]
        allowed_after = [e for e in events if e["verdict"] == "allow" and not e.get("closed")]
        cut = [e for e in events if "cut:" in (e.get("reason") or "")]
        # the invariant: nothing the new policy denies is carried after the change
        assert not origin.served, (
            f"{len(origin.served)} request(s) reached slow.test after its rule was removed "
            f"at {revoked_at:.3f}; reply {reply[:60]!r}; allow events {allowed_after}; "
            f"cut events {cut}")
    finally:
        origin.close()
