"""Bad input must get a clear error, never a crash (DESIGN 9), and never be half-forwarded.

`str.isdigit()` is true for the superscript digits of Latin-1 (0xB2 0xB3 0xB9), which
`int()` refuses: a Content-Length or a Host port spelt with them passes the parser's checks
and raises ValueError later, outside every handler that answers. The connection is dropped
without a word or an event, a traceback goes to the log (one per request: a log flood),
and for Content-Length the request head has already been sent upstream."""

from __future__ import annotations

import pytest

from tests.integration.filter.attacklab import exchange, open_lab


@pytest.fixture(scope="module")
def lab(internet, tmp_path_factory):
    yield from open_lab(internet, tmp_path_factory)

CASES = {
    "content-length": ("proxy", "POST http://ng-a.test/x HTTP/1.1\r\nHost: ng-a.test\r\n"
                                "Content-Length: \xb2\r\n\r\nxx"),
    "host-port": ("http", "GET /x HTTP/1.1\r\nHost: ng-a.test:\xb9\r\n\r\n"),
    "host-port-explicit": ("proxy", "GET http://ng-a.test/x HTTP/1.1\r\n"
                                    "Host: ng-a.test:\xb3\r\n\r\n"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_superscript_digits_get_a_400_not_a_traceback(lab, case):
    listener, payload = CASES[case]
    port = lab.filter.proxy_port if listener == "proxy" else lab.filter.http_port
    size = lab.filter.log.stat().st_size
    reply = exchange(port, payload.encode("latin-1"))
    logged = lab.filter.log.read_text()[size:]
    assert reply.startswith(b"HTTP/1.1 400"), (
        f"no answer ({reply[:40]!r}); the filter logged: {logged[-400:]}")
    assert "Traceback" not in logged
