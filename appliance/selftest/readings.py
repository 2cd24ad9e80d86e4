"""On a host the session inspects: a request the origin would read another way than the
filter judged it. Each attack carries what a request rule or the leak scanner forbids in a
form a server stack reads and a naive proxy does not; each must be refused by the filter
itself and recorded, and nothing of it reach the origin.

- T27 (`--denied-request`): the denied request asked for by a method override, in every
  form stacks read (a field spelt as CGI folds it, `_method` in the query under a name PHP
  rewrites, in a form, a JSON and a multipart body, a rewrite field naming the path).
- T28 (`--fake-upgrade PATH`: a path on --inspected that answers 101 without switching, as
  httpbin's /status/101 does): a WebSocket asked for there, the denied request right after
  it on the same connection; the filter answers 502 and reads nothing more as raw relay.
- T14: a token in a gzip-encoded body; a body in an encoding the filter cannot read.
- T30 (`--echo-secret NAME@HOST`: a bearer secret of the session whose host echoes the
  request in its answer, as httpbin's /headers does): the agent comes to hold the value,
  then sends it in a header field (a leak, refused), and gets it quoted in a reason (the
  filter's answer and its records name the secret, never the value).
"""

from __future__ import annotations

import gzip
import os
import re
import ssl
from urllib.parse import quote

from .inspection import _denied_request, _inside
from .registry import NotRun, Outcome, probe
from .wire import connect_via_proxy, echoed_headers, first_line, from_corral, headers, status


def _post(a, path: str, fields: str = "", body: bytes = b"", method: str = "POST") -> bytes:
    return _inside(a, f"{method} {path} HTTP/1.1\r\nHost: {a.inspected}\r\n{fields}"
                   f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)


@probe("inspected-override-denied", 27, needs="denied_request",
       records="http event, reason 'asks by'")
def inspected_override_denied(ctx):
    """The denied method asked for the ways Rack, Symfony, Laravel, Spring, Express and
    IIS read it, on a request the rules would otherwise let by: every one refused."""
    a = ctx.args
    denied, path = _denied_request(a)
    carrier = "PUT" if denied == "POST" else "POST"  # a method the deny does not name
    boundary = "corral-selftest"
    multipart = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\n"
                 f"{denied}\r\n--{boundary}--\r\n").encode()
    attempts = {
        "an override field spelt with '_'": (path, f"X_HTTP_Method_Override: {denied}\r\n", b""),
        "'.method' in the query": (f"{path}?.method={denied}", "", b""),
        "_method in a form body": (path, "", f"a=1&_method={denied}".encode()),
        "_method in a JSON body": (path, "Content-Type: application/json\r\n",
                                   f'{{"_method": "{denied}"}}'.encode()),
        "_method in a multipart body": (
            path, f"Content-Type: multipart/form-data; boundary={boundary}\r\n", multipart),
        "X-Original-URL naming the path": ("/selftest", f"X-Original-URL: {path}\r\n", b""),
    }
    let_by = []
    for what, (target, fields, body) in attempts.items():
        method = denied if what.startswith("X-Original") else carrier
        head = _post(a, target, fields, body, method)
        if not from_corral(head, 403, "x-corral-deny"):
            let_by.append(f"{what}: {first_line(head)}")
    return Outcome(not let_by, f"{denied} {path} on {a.inspected} asked for {len(attempts)} "
                   "other ways: " + ("every one refused" if not let_by else
                                     "let by: " + "; ".join(let_by)),
                   {"kind": "http", "reason": "asks by"})


@probe("inspected-fake-upgrade", 28, needs="fake_upgrade",
       records="http event, reason 'answered 101 without'")
def inspected_fake_upgrade(ctx):
    """A 101 that switched nothing must not turn the connection into raw relay: the denied
    request sent right behind the WebSocket request never reaches the origin."""
    a = ctx.args
    if not a.inspected:
        raise NotRun("needs --inspected (the host --fake-upgrade is a path of)")
    behind = (f"DELETE /corral-selftest-after-101 HTTP/1.1\r\nHost: {a.inspected}\r\n"
              "Connection: close\r\n\r\n")
    if a.denied_request:
        method, _, path = a.denied_request.partition(" ")
        behind = (f"{method} {path} HTTP/1.1\r\nHost: {a.inspected}\r\n"
                  "Connection: close\r\n\r\n")
    answer = _inside(a, f"GET {a.fake_upgrade} HTTP/1.1\r\nHost: {a.inspected}\r\n"
                     "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                     "Sec-WebSocket-Key: Y29ycmFsLXNlbGZ0ZXN0IQ==\r\n\r\n".encode()
                     + behind.encode(), whole=True)
    ok = from_corral(answer, 502, "x-corral-error") and answer.count(b"HTTP/1.1 ") == 1
    return Outcome(ok, f"a WebSocket asked of {a.fake_upgrade} on {a.inspected}, then a "
                   f"request behind it: {first_line(answer)}" + (
                       f" ({headers(answer).get('x-corral-error', '')})" if ok else
                       f"; {answer.count(b'HTTP/1.1 ')} answers came back"),
                   {"kind": "http", "reason": "answered 101 without"})


@probe("inspected-encoded-token", 14, needs="inspected",
       records="leak event, reason 'gzip-decoded'")
def inspected_encoded_token(ctx):
    """A token in a body the origin inflates (`Content-Encoding: gzip`) is a token."""
    a = ctx.args
    key_id = "AKIAQZ5XW2RT7YV3U6PN"  # shaped as an AWS access key id, made up
    head = _post(a, "/selftest", "Content-Encoding: gzip\r\n",
                 gzip.compress(f"aws_access_key_id={key_id}".encode()))
    return Outcome(from_corral(head, 403, "x-corral-deny"),
                   f"a gzip body with a token: {first_line(head)}",
                   {"kind": "leak", "reason": "gzip-decoded"})


@probe("inspected-undecodable-body", 14, needs="inspected",
       records="http event, reason 'cannot decode'")
def inspected_undecodable_body(ctx):
    """A body in a coding the filter cannot read (`br`) is refused on a host that scans: a
    scanner that cannot decode denies."""
    a = ctx.args
    head = _post(a, "/selftest", "Content-Encoding: br\r\n", b"\x0b\x02\x80hi\x03")
    return Outcome(from_corral(head, 403, "x-corral-deny"), f"a br body: {first_line(head)}",
                   {"kind": "http", "reason": "cannot decode"})


# -- T30: a value the agent came to hold ---------------------------------------------------


def _held_value(a) -> tuple[str, str, str]:
    """(the secret's name, its host, its value): fetched as an agent would, through the
    secret's own host, which echoes the request the filter attached the value to."""
    name, _, host = (a.echo_secret or "").partition("@")
    placeholder = os.environ.get(name, "")
    if not host or not placeholder:
        raise NotRun(f"--echo-secret {a.echo_secret!r}: give NAME@HOST, NAME a bearer "
                     "secret of this session (its placeholder in the environment)")
    data = _inside_host(a, host, f"GET /headers HTTP/1.1\r\nHost: {host}\r\nAuthorization: "
                        f"Bearer {placeholder}\r\nConnection: close\r\n\r\n")
    fields = echoed_headers(data.partition(b"\r\n\r\n")[2]) or {}
    said = next((v for k, v in fields.items() if k.lower() == "authorization"), "")
    value = said.partition(" ")[2]
    if not value or value == placeholder:
        raise NotRun(f"{host} did not echo the value it was given ({first_line(data)})")
    return name, host, value


@probe("held-value-in-a-field", 30, needs="echo_secret",
       records="leak event, reason 'the secret'")
def held_value_in_a_field(ctx):
    """A value the agent came to hold, sent again in a header field (a cookie, a field of
    its own, a field's name): a leak on any inspected host, its own included."""
    a = ctx.args
    name, host, value = _held_value(a)
    let_by = []
    carriers = [f"Cookie: session={value}", f"X-Note: {value}"]
    if _TOKEN.fullmatch(value):  # a value that can be a field's name is tried as one too
        carriers.append(f"{value}: x")
    for fields in carriers:
        answer = _inside_host(a, host, f"GET /selftest HTTP/1.1\r\nHost: {host}\r\n{fields}"
                              "\r\nConnection: close\r\n\r\n")
        if not from_corral(answer, 403, "x-corral-deny"):
            let_by.append(f"{fields.split(':')[0][:8]}...: {first_line(answer)}")
    return Outcome(not let_by, f"the value of {name} in {len(carriers)} header fields to "
                   f"{host}: " + ("each refused" if not let_by else "let by: "
                                  + "; ".join(let_by)),
                   {"kind": "leak", "reason": f"the secret {name}"})


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _inside_host(a, host: str, request: str) -> bytes:
    """`request` inside TLS the filter ends to `host`: everything answered until close."""
    sock, head = connect_via_proxy(a, f"{host}:443")
    if status(head) != 200:
        sock.close()
        raise NotRun(f"CONNECT {host}:443 was not opened: {first_line(head)}")
    data = b""
    with ssl._create_unverified_context().wrap_socket(sock, server_hostname=host) as tls:  # noqa: S323
        tls.sendall(request.encode())
        try:
            while chunk := tls.recv(65536):
                data += chunk
        except (ssl.SSLError, OSError):
            pass
    return data


@probe("held-value-never-quoted", 30, needs="echo_secret",
       records="http event, reason '[secret NAME]'")
def held_value_never_quoted(ctx):
    """A value the agent holds, in what the filter quotes back (a malformed field): the
    answer and the record name the secret, and hold no run of its value."""
    a = ctx.args
    name, host, value = _held_value(a)
    # a first request, so that the second is one of the connection's (an error there is
    # the request's, not the tunnel's opening)
    answer = _inside_host(a, host, f"GET /selftest HTTP/1.1\r\nHost: {host}\r\n\r\n"
                          f"GET /selftest HTTP/1.1\r\nHost: {host}\r\nBearer {value}\r\n\r\n")
    last = b"HTTP/1.1 " + answer.rpartition(b"HTTP/1.1 ")[2]
    quoted = value[:8].encode() in answer or quote(value[:8]).encode() in answer
    return Outcome(from_corral(last, 400, "x-corral-error") and not quoted,
                   f"a malformed field holding the value of {name}: {first_line(last)}"
                   + (" — the answer quotes the value" if quoted else ""),
                   {"kind": "http", "reason": f"[secret {name}]"})
