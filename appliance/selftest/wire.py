"""What the probes speak, standard library only: DNS queries and answers, TCP, HTTP heads and
responses (a Stream reads pipelined ones), TLS, CONNECT through the proxy, and the Context
every probe gets (the arguments, the allowed name's address looked up once).

A helper here never judges a probe; it says what happened (`refused`, `from_corral`,
`tls_denied`), and the probe decides.
"""

from __future__ import annotations

import argparse
import json
import secrets
import socket
import ssl
import struct

from .registry import FAST, NotRun

# -- DNS ---------------------------------------------------------------------------------


def dns_query(name, qtype=1, qid=None):
    return dns_query_labels([p.encode() for p in name.rstrip(".").split(".")], qtype, qid)


def dns_query_labels(labels: list[bytes], qtype=1, qid=None):
    """A query for the name of these labels, whatever bytes they hold."""
    qid = qid if qid is not None else secrets.randbelow(65536)
    name = b"".join(bytes([len(label)]) + label for label in labels)
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + name + b"\0" + struct.pack(
        "!HH", qtype, 1)


def dns_answer(data):
    """(rcode, [addresses]) of a reply to one A/AAAA question."""
    rcode = data[3] & 0x0F
    ancount = struct.unpack("!H", data[6:8])[0]
    pos = 12
    while data[pos] != 0:
        pos += data[pos] + 1
    pos += 5
    out = []
    for _ in range(ancount):
        if data[pos] & 0xC0 == 0xC0:
            pos += 2
        else:
            while data[pos] != 0:
                pos += data[pos] + 1
            pos += 1
        rtype, _, _, length = struct.unpack("!HHIH", data[pos : pos + 10])
        rdata = data[pos + 10 : pos + 10 + length]
        if rtype == 1:
            out.append(socket.inet_ntop(socket.AF_INET, rdata))
        elif rtype == 28:
            out.append(socket.inet_ntop(socket.AF_INET6, rdata))
        pos += 10 + length
    return rcode, out


def resolve(args, name, qtype=1):
    return resolve_query(args, dns_query(name, qtype))


def resolve_query(args, query: bytes):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(FAST)
        sock.connect((args.gateway, args.dns_port))
        sock.send(query)
        return dns_answer(sock.recv(4096))



# -- TCP, HTTP, TLS ----------------------------------------------------------------------


def tcp(host, port, timeout=FAST):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def read_head(sock):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def status(head):
    try:
        return int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def headers(head: bytes) -> dict[str, str]:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        name, colon, value = line.partition(b":")
        if colon:
            out[name.strip().lower().decode(errors="replace")] = value.strip().decode(
                errors="replace")
    return out


def from_origin(head):
    """An HTTP answer that the origin gave, whatever its status (a real host need not serve
    /selftest): the proxy marks every answer of its own with an X-Corral-* header."""
    return status(head) > 0 and b"\r\nx-corral-" not in head.lower()


def from_corral(head, code, header):
    """corral's own answer: this status, with X-Corral-Deny (403) or X-Corral-Error."""
    return status(head) == code and header.lower() in headers(head)


class Stream:
    """HTTP responses read off a socket one by one: pipelined answers may share a recv."""

    def __init__(self, sock):
        self.sock, self.buf = sock, b""

    def _more(self) -> bool:
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:  # a close with our bytes unread: the answer came first
            return False
        self.buf += chunk
        return bool(chunk)

    def head(self) -> bytes:
        """The next response head (b"" when the connection closed first)."""
        while b"\r\n\r\n" not in self.buf:
            if not self._more():
                head, self.buf = self.buf, b""
                return head
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        return head + b"\r\n\r\n"

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n and self._more():
            pass
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            if not self._more():
                line, self.buf = self.buf, b""
                return line
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def response(self) -> tuple[bytes, bytes]:
        """(head, body) of the next response, framed as it says."""
        head = self.head()
        code, fields = status(head), headers(head)
        if not head or code in (204, 304) or 100 <= code < 200:
            return head, b""
        if "chunked" in fields.get("transfer-encoding", "").lower():
            body = b""
            while size := int(self.line().split(b";")[0].strip() or b"0", 16):
                body += self.exactly(size)
                self.exactly(2)
            while self.line():  # trailers, up to the empty line
                pass
            return head, body
        if "content-length" in fields:
            return head, self.exactly(int(fields["content-length"]))
        return head, self.rest()[0]

    def rest(self, timeout: float = FAST) -> tuple[bytes, bool]:
        """Whatever else arrives within `timeout`, and whether the peer closed."""
        previous = self.sock.gettimeout()
        self.sock.settimeout(timeout)
        try:
            while self._more():
                pass
            closed = True
        except TimeoutError:
            closed = False
        finally:
            self.sock.settimeout(previous)
        data, self.buf = self.buf, b""
        return data, closed


def echoed_headers(body: bytes) -> dict | None:
    """The headers an echoing origin (the e2e one) says it got; None from a real origin."""
    try:
        fields = json.loads(body)["headers"]
    except (ValueError, KeyError, TypeError):
        return None
    return fields if isinstance(fields, dict) else None


def host_seen(body: bytes, expected: str) -> tuple[bool, str]:
    """Whether the origin got Host `expected` on port 80 (when it says what it got: the e2e
    origin echoes), and what it got."""
    fields = echoed_headers(body)
    if fields is None:
        return True, "the origin does not echo what it got"
    host = fields.get("host")
    return host in (expected, f"{expected}:80"), (f"the origin got Host {host}" if host
                                                  else "the origin got no Host")


def connect_via_proxy(args, target):
    sock = tcp(args.gateway, args.proxy_port)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    return sock, read_head(sock)


def tls_context(args):
    if args.cafile:
        return ssl.create_default_context(cafile=args.cafile)
    # Without a CA the probes test reachability, not trust: the filter never terminates TLS.
    return ssl._create_unverified_context()  # noqa: S323


def https_get(args, sock, server_name):
    context = tls_context(args)
    if server_name is None:
        context.check_hostname = False
    with context.wrap_socket(sock, server_hostname=server_name) as tls:
        tls.sendall(f"GET /selftest HTTP/1.1\r\nHost: {server_name or 'x'}\r\n"
                    "Connection: close\r\n\r\n".encode())
        return read_head(tls)


def refused(exc):
    """A fast, explicit network refusal (RST, ICMP error), not a hang."""
    return isinstance(exc, (ConnectionRefusedError, ConnectionResetError, PermissionError)) or (
        isinstance(exc, OSError) and exc.errno in (101, 113, 13, 111, 104, 1))


def first_line(head):
    """An answer's first line, for a probe's detail."""
    return head.split(b"\r\n", 1)[0].decode(errors="replace") or "(connection closed)"


def tls_denied(args, sock, server_name) -> tuple[bool, str]:
    """Whether TLS with this SNI on `sock` was refused (an access_denied alert, or the
    connection refused), and what happened."""
    try:
        reply = https_get(args, sock, server_name)
        return False, f"TLS with SNI {server_name} went through: {first_line(reply)}"
    except ssl.SSLError as exc:
        return "ACCESS_DENIED" in str(exc) or "access denied" in str(exc), \
            f"TLS alert: {exc.reason}"
    except OSError as exc:
        return refused(exc), f"{type(exc).__name__}: {exc}"


def proxy_request(args, request: bytes) -> bytes:
    """Send one request to the proxy; the head of what it answers."""
    with tcp(args.gateway, args.proxy_port) as sock:
        sock.sendall(request)
        return read_head(sock)


def tunnel(args, port):
    """A CONNECT tunnel to the allowed name; NotRun if the proxy does not open it (the legit
    probes say why: this one is about what happens inside)."""
    sock, head = connect_via_proxy(args, f"{args.allowed}:{port}")
    if status(head) != 200:
        sock.close()
        raise NotRun(f"CONNECT {args.allowed}:{port} was not opened: {first_line(head)}")
    return sock


# -- what every probe gets --------------------------------------------------------------


class Context:
    """What every probe may use: the arguments, and lookups shared between probes."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self._allowed_ip: str | None = None

    def allowed_ip(self) -> str:
        """The allowed name's IPv4 address, as the sandbox's resolver gives it."""
        if self._allowed_ip is None:
            v4 = [a for a in resolve(self.args, self.args.allowed)[1] if ":" not in a]
            if not v4:
                raise NotRun(f"{self.args.allowed} does not resolve: is it allowed by the "
                             "policy?")
            self._allowed_ip = v4[0]
        return self._allowed_ip

