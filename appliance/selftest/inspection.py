"""On a host the session inspects (`--inspected`: named in an [[inspect]] or [[git]] table,
or bound to a secret; its body scan on, and no request rule refusing GET or POST
/selftest): what TLS termination must still refuse. A client that does not trust the
corral CA fails, however often it tries, and the host is never tunnelled instead (T13);
inside the TLS the filter ends, a request for another host is refused (T13) and so is a
body carrying a token (T24). Each sends nothing to the origin.

More run when the harness says what the session's policy forbids there: a request a
request rule denies (`--denied-request "METHOD /PATH"`, T12) and spellings of it that
servers route to the same handler (T27: a format suffix, an encoded ';', a fullwidth
letter), a git push onto refs/heads/main of a repository a [[git]] table lists for the
host (`--git-repo OWNER/REPO`, T25: only the session's own branches may be pushed), and a
push onto the session's own branch carrying push options (T31: none named in the table),
asked for as git's receive-pack reads them, not as `git push` writes them. The throwaway
session of `corral selftest --inspected HOST` has them (cli/selftest.py, `PROBE_DENIED`,
`PROBE_REPO`). With `--git-ssh HOST` the pushes go over SSH through the git gateway
instead.
With `--neighbour NAME` (a name the session allows and does not inspect, on an address the
inspected host uses, as two sites of one CDN edge or one server are), a tunnel to it is
refused on the proxy and on the transparent listener (T29): spliced, its TLS could carry a
request for the inspected host that the filter never reads.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import socket
import ssl
import string
import struct
import subprocess

from .registry import NotRun, Outcome, probe
from .wire import (
    connect_via_proxy,
    first_line,
    from_corral,
    headers,
    read_head,
    refused,
    resolve,
    status,
    tcp,
)

CA_NAME = b"corral interception CA"
"""The common name the filter's interception CA carries (appliance/pki/), in every leaf's
issuer: how a probe tells the filter's certificate from the origin's without trusting it."""
REFUSALS = 3
"""Handshakes a distrusting client fails before the probe looks again: a proxy that falls
back to a tunnel after a client refuses its certificate would do so by the second."""


def _inspected_tunnel(args) -> socket.socket:
    sock, head = connect_via_proxy(args, f"{args.inspected}:443")
    if status(head) != 200:
        sock.close()
        raise NotRun(f"CONNECT {args.inspected}:443 was not opened: {first_line(head)}; is "
                     "--inspected a host the session's policy allows and inspects?")
    return sock


def _distrusting_context(args) -> ssl.SSLContext:
    """A careful client that has never heard of the corral CA: the origin's own CA when the
    battery was given one (`--cafile`), else no CA at all."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, and checks the name
    if args.cafile:
        context.load_verify_locations(cafile=args.cafile)
    return context


def _inside(args, request: bytes, whole: bool = False) -> bytes:
    """One request inside TLS the filter ends (the probe does not check the leaf: the
    sandbox's trust store holds the corral CA, and the first probe checks the issuer): the
    answer's head, or with `whole` all of it until the connection closes."""
    context = ssl._create_unverified_context()  # noqa: S323
    context.set_alpn_protocols(["http/1.1"])
    with context.wrap_socket(_inspected_tunnel(args), server_hostname=args.inspected) as tls:
        tls.sendall(request)
        if not whole:
            return read_head(tls)
        data = b""
        while len(data) < 1 << 20:
            try:
                chunk = tls.recv(65536)
            except (ssl.SSLError, OSError):
                break
            if not chunk:
                break
            data += chunk
        return data


def _denied(head: bytes, what: str, expect: dict) -> Outcome:
    """Passed when the filter itself answered 403 with X-Corral-Deny (its reason shown)."""
    ok = from_corral(head, 403, "x-corral-deny")
    return Outcome(ok, f"{what}: {first_line(head)}"
                   + (f" ({headers(head).get('x-corral-deny', '')})" if ok else ""), expect)


@probe("inspected-never-tunnelled", 13, needs="inspected",
       records="connect event, reason 'handshake with the client failed'")
def inspected_never_tunnelled(ctx):
    a = ctx.args
    for attempt in range(1, REFUSALS + 1):
        with _inspected_tunnel(a) as sock:
            try:
                with _distrusting_context(a).wrap_socket(sock, server_hostname=a.inspected):
                    return Outcome(False, f"attempt {attempt}: a client that does not trust "
                                   "the corral CA completed TLS: the host was tunnelled")
            except ssl.SSLCertVerificationError:
                pass  # what must happen: the filter's leaf, refused
    context = ssl._create_unverified_context()  # noqa: S323
    with context.wrap_socket(_inspected_tunnel(a), server_hostname=a.inspected) as tls:
        leaf = tls.getpeercert(binary_form=True) or b""
    ours = CA_NAME in leaf
    return Outcome(ours, f"{REFUSALS} handshakes refused the certificate; the next one was "
                   + ("still the filter's (issued by the corral interception CA)" if ours
                      else "not the filter's: the host was tunnelled after the refusals"),
                   {"kind": "connect", "reason": "handshake with the client failed"})


@probe("inspected-host-differs", 13, needs="inspected",
       records="http event, reason 'differs from CONNECT host'")
def inspected_host_differs(ctx):
    """Domain fronting inside TLS the filter ends: the SNI and CONNECT name the inspected
    host, the Host header a denied one (a splice cannot see this; inspection must)."""
    a = ctx.args
    head = _inside(a, f"GET /selftest HTTP/1.1\r\nHost: {a.denied}\r\n"
                   "Connection: close\r\n\r\n".encode())
    return _denied(head, f"Host {a.denied} inside TLS to {a.inspected}",
                   {"kind": "http", "reason": "differs from CONNECT host"})


def _token_shape() -> str:
    """A string shaped as a GitHub personal access token, made up here (it opens nothing)."""
    alphabet = string.ascii_letters + string.digits
    return "ghp_" + "".join(secrets.choice(alphabet) for _ in range(36))


@probe("inspected-token-in-body", 24, needs="inspected",
       records="leak event, reason 'GitHub token'")
def inspected_token_in_body(ctx):
    """A request body carrying a token to an inspected host: refused before a byte of it
    leaves, naming the detector, never the value."""
    a = ctx.args
    body = f'{{"note": "deploy with {_token_shape()}"}}'.encode()
    head = _inside(a, f"POST /selftest HTTP/1.1\r\nHost: {a.inspected}\r\nContent-Type: "
                   f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close"
                   "\r\n\r\n".encode() + body)
    return _denied(head, f"a token in a POST body to {a.inspected}",
                   {"kind": "leak", "reason": "GitHub token"})


def _denied_request(a) -> tuple[str, str]:
    """The method and path of `--denied-request` (NotRun without `--inspected`)."""
    if not a.inspected:
        raise NotRun("needs --inspected (the host whose request rule denies it)")
    method, _, path = a.denied_request.partition(" ")
    if not method or not path.startswith("/"):
        raise NotRun(f"--denied-request {a.denied_request!r}: give METHOD /PATH")
    return method, path


def _sent(a, method: str, path: str, what: str, reason: str) -> Outcome:
    head = _inside(a, f"{method} {path} HTTP/1.1\r\nHost: {a.inspected}\r\n"
                   "Connection: close\r\n\r\n".encode())
    return _denied(head, f"{what}{method} {path} on {a.inspected}",
                   {"kind": "http", "reason": reason})


@probe("inspected-request-denied", 12, needs="denied_request",
       records="http event, reason 'denied by request rule'")
def inspected_request_denied(ctx):
    """A method and path the session's request rules deny on an inspected host: answered
    by the filter (403, X-Corral-Deny), never sent to the origin."""
    method, path = _denied_request(ctx.args)
    return _sent(ctx.args, method, path, "", "denied by request rule")


def suffixed(path: str) -> str:
    """The path with a format suffix on its last segment (`/gists` -> `/gists.json`)."""
    if path.rstrip("/") == "":
        raise NotRun("--denied-request names '/': no segment to suffix")
    return path.rstrip("/") + ".json"


def escaped_separator(path: str) -> str:
    """The path with `%3Bx` after its first segment (`/a/b` -> `/a%3Bx/b`)."""
    head, _, rest = path[1:].partition("/")
    return f"/{head}%3Bx" + (f"/{rest}" if rest else "")


def fullwidth(path: str) -> str:
    """The path with its first letter or digit in fullwidth form, percent-encoded."""
    at = next((i for i, c in enumerate(path) if c.isascii() and c.isalnum()), None)
    if at is None:
        raise NotRun(f"--denied-request {path!r} has no letter or digit to spell otherwise")
    wide = "".join(f"%{b:02X}" for b in chr(ord(path[at]) + 0xFEE0).encode())
    return path[:at] + wide + path[at + 1:]


@probe("inspected-format-suffix", 27, needs="denied_request",
       records="http event, reason 'denied by request rule'")
def inspected_format_suffix(ctx):
    """The denied request with a format suffix on its last segment (`/gists.json`, which
    Rails, Grape and Django REST framework route as `/gists`): the deny covers it."""
    method, path = _denied_request(ctx.args)
    return _sent(ctx.args, method, suffixed(path), "with a format suffix, ",
                 "denied by request rule")


@probe("inspected-escaped-separator", 27, needs="denied_request",
       records="http event, reason \"encoded ';' (%3B)\"")
def inspected_escaped_separator(ctx):
    """The denied path with `%3Bx` after its first segment: a server that decodes before it
    drops path parameters reads the denied path; refused as `;` is, whatever the rules."""
    method, path = _denied_request(ctx.args)
    return _sent(ctx.args, method, escaped_separator(path), "an encoded ';', ",
                 "encoded ';' (%3B)")


@probe("inspected-unicode-lookalike", 27, needs="denied_request",
       records="http event, reason 'denied by request rule'")
def inspected_unicode_lookalike(ctx):
    """The denied path with its first letter in fullwidth form (U+FF41.., percent-encoded),
    which servers that normalise Unicode (NFKC) read as the letter: the deny covers it."""
    method, path = _denied_request(ctx.args)
    return _sent(ctx.args, method, fullwidth(path), "in fullwidth form, ",
                 "denied by request rule")


ZERO = "0" * 40
MERGE = ("merge_request.create", "merge_request.target=main")
"""Push options that have GitLab open a merge request of the pushed branch into main."""


def receive_pack(lines: list[str], options: tuple[str, ...] = ()) -> bytes:
    """A receive-pack request body: the command lines, a flush, the push options and a
    flush when there are any, and an empty pack (the push is refused before it matters)."""
    pack = b"PACK" + struct.pack(">II", 2, 0)
    trailer = hashlib.sha1(pack, usedforsecurity=False).digest()  # git's checksum
    body = b"".join(_pkt(line.encode()) for line in lines) + b"0000"
    if options:
        body += b"".join(_pkt(option.encode()) for option in options) + b"0000"
    return body + pack + trailer


def _pkt(data: bytes) -> bytes:
    return b"%04x" % (len(data) + 4) + data


def _push_to_main() -> bytes:
    """What `git push origin HEAD:main` sends, less the objects (the ref is refused before
    they matter)."""
    new = secrets.token_hex(20)
    return receive_pack([f"{ZERO} {new} refs/heads/main\0report-status side-band-64k\n"])


def push_with_options(session: str) -> tuple[str, bytes]:
    """(the first ref, the body) of a push onto two new branches of the session's own, which
    it may push, carrying MERGE: asked for on the second command line as `push-options=1`
    (git's receive-pack reads a capability list on every line, and `feature=value`)."""
    ref = f"refs/heads/corral/{session}/selftest-{secrets.token_hex(4)}"
    new = secrets.token_hex(20)
    return ref, receive_pack([f"{ZERO} {new} {ref}\0report-status side-band-64k\n",
                              f"{ZERO} {new} {ref}-2\0push-options=1\n"], MERGE)


def _session(args) -> str:
    if not _BRANCH.fullmatch(args.session or ""):
        raise NotRun(f"--session {args.session!r}: not a session name")
    return args.session


@probe("inspected-push-refused", 25, needs="git_repo",
       records="git event, reason 'git push to refs/heads/main refused'")
def inspected_push_refused(ctx):
    """A push onto refs/heads/main of a repository the session may push to only on its own
    branches: refused by the filter in git's report-status (`ng refs/heads/main corral:
    ...`, what `git push` prints), never sent to the origin."""
    a = ctx.args
    if not a.inspected:
        raise NotRun("needs --inspected (the host whose [[git]] table lists --git-repo)")
    head = _inspected_push(a, _push_to_main())
    ok = status(head) == 200 and b"ng refs/heads/main corral: " in head
    said = head.split(b"ng refs/heads/main ", 1)[-1].split(b"\n", 1)[0][:160] if ok else b""
    return Outcome(ok, f"push to refs/heads/main of {a.git_repo} on {a.inspected}: "
                   f"{first_line(head)}" + (f" ({said.decode(errors='replace')})" if ok else ""),
                   {"kind": "git", "reason": "git push to refs/heads/main refused"})


def _inspected_push(a, body: bytes) -> bytes:
    """A receive-pack POST of `body` to --git-repo inside TLS the filter ends: the answer."""
    if not a.inspected:
        raise NotRun("needs --inspected (the host whose [[git]] table lists --git-repo)")
    return _inside(a, f"POST /{a.git_repo}.git/git-receive-pack HTTP/1.1\r\nHost: "
                   f"{a.inspected}\r\nContent-Type: application/x-git-receive-pack-request\r\n"
                   f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                   + body, whole=True)


@probe("inspected-push-options-refused", 31, needs="git_repo",
       records="git event, reason \"push option 'merge_request.create'\"")
def inspected_push_options_refused(ctx):
    """A push onto the session's own branch carrying push options that would have GitLab
    merge it into main, asked for on a later command line as `push-options=1`: refused
    whole by the filter in git's report-status, never sent to the origin."""
    a = ctx.args
    ref, body = push_with_options(_session(a))
    head = _inspected_push(a, body)
    said = _refusal(head, ref)
    return Outcome(status(head) == 200 and said is not None,
                   f"push with options onto {ref} of {a.git_repo} on {a.inspected}: "
                   f"{first_line(head)}" + (f" ({said})" if said else ""),
                   {"kind": "git", "reason": "push option 'merge_request.create'"})


def _refusal(answer: bytes, ref: str) -> str | None:
    """The filter's reason for refusing `ref`'s push options in git's report, if it is
    there."""
    line = f"ng {ref} corral: push option 'merge_request.create'".encode()
    if line not in answer:
        return None
    return answer.split(f"ng {ref} ".encode(), 1)[1].split(b"\n", 1)[0][:160].decode(
        errors="replace")


_SSH_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*")
_REPO = re.compile(r"[A-Za-z0-9._-]+/[A-Za-z0-9._-]+")
_BRANCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""A session name, as it is written in a ref."""


@probe("ssh-push-refused", 25, needs="git_ssh",
       records="git event, reason 'git push to refs/heads/main refused'")
def ssh_push_refused(ctx):
    """The same push over SSH (`git@HOST:OWNER/REPO.git`): the session's ssh reaches the
    host only through the appliance's git gateway, which reads the push whole and refuses
    it in git's report-status before a byte of it goes on."""
    a = ctx.args
    done = _ssh_push(a, _push_to_main())
    ok = b"ng refs/heads/main corral: " in done.stdout
    said = (done.stdout.split(b"ng refs/heads/main ", 1)[-1].split(b"\n", 1)[0] if ok
            else (done.stderr.strip().splitlines() or [b"no answer"])[-1])
    return Outcome(ok, f"push to refs/heads/main of {a.git_repo} on {a.git_ssh} over SSH: "
                   f"{said[:160].decode(errors='replace')}",
                   {"kind": "git", "reason": "git push to refs/heads/main refused"})


@probe("ssh-push-options-refused", 31, needs="git_ssh",
       records="git event, reason \"push option 'merge_request.create'\"")
def ssh_push_options_refused(ctx):
    """The push with options over SSH: the git gateway reads it whole and refuses it in
    git's report-status before a byte of it goes on to the host."""
    a = ctx.args
    ref, body = push_with_options(_session(a))
    done = _ssh_push(a, body)
    said = _refusal(done.stdout, ref)
    detail = said or (done.stderr.strip().splitlines() or [b"no answer"])[-1][:160].decode(
        errors="replace")
    return Outcome(said is not None, f"push with options onto {ref} of {a.git_repo} on "
                   f"{a.git_ssh} over SSH: {detail}",
                   {"kind": "git", "reason": "push option 'merge_request.create'"})


def _ssh_push(a, body: bytes) -> subprocess.CompletedProcess:
    """git-receive-pack on --git-repo of --git-ssh, through the gateway, fed `body`."""
    if not a.git_repo:
        raise NotRun("needs --git-repo (a repository the [[git]] table of --git-ssh lists)")
    if not _SSH_HOST.fullmatch(a.git_ssh) or not _REPO.fullmatch(a.git_repo):
        raise NotRun("--git-ssh must be a host name and --git-repo OWNER/REPO")
    return subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
                           f"git@{a.git_ssh}", f"git-receive-pack '{a.git_repo}.git'"],
                          input=body, capture_output=True, timeout=60, check=False)


# -- a neighbour on the same front-end (T29) --------------------------------------------------

NEIGHBOUR_REASON = "an address of inspected host"
"""What the filter's refusal of a tunnel to a name on an inspected host's address says."""


def _fronted(a, sock: socket.socket) -> str:
    """The attack, once a tunnel to the neighbour is open: TLS to it with its own name (the
    origin's certificate), then a request for the inspected host inside. What came back."""
    request = a.denied_request or "GET /selftest"
    method, _, path = request.partition(" ")
    context = ssl._create_unverified_context()  # noqa: S323  (the origin's own certificate)
    try:
        with context.wrap_socket(sock, server_hostname=a.neighbour) as tls:
            tls.sendall(f"{method} {path} HTTP/1.1\r\nHost: {a.inspected}\r\n"
                        "Connection: close\r\n\r\n".encode())
            head = read_head(tls)
    except (ssl.SSLError, OSError) as exc:
        return f"TLS to it failed afterwards ({exc}), but it was not refused"
    return (f"{method} {path} for {a.inspected} inside TLS to {a.neighbour} was answered "
            f"{first_line(head)!r} unread")


@probe("neighbour-connect-refused", 29, needs="neighbour",
       records=f"connect event, reason '{NEIGHBOUR_REASON}'")
def neighbour_connect_refused(ctx):
    """A name the session allows and does not inspect, on an address --inspected uses (one
    CDN edge or one server for both): a tunnel to it is refused, or the Host header inside
    its TLS, which the filter would never read, could name the inspected host."""
    a = ctx.args
    if not a.inspected:
        raise NotRun("needs --inspected (the host --neighbour shares an address with)")
    sock, head = connect_via_proxy(a, f"{a.neighbour}:443")
    with sock:
        if status(head) == 200:
            return Outcome(False, f"CONNECT {a.neighbour}:443 was opened; " + _fronted(a, sock))
    reason = headers(head).get("x-corral-deny", "")
    ok = from_corral(head, 403, "x-corral-deny") and NEIGHBOUR_REASON in reason
    return Outcome(ok, f"CONNECT {a.neighbour}:443: {first_line(head)}"
                   + (f" ({reason})" if reason else ""),
                   {"kind": "connect", "name": a.neighbour, "reason": NEIGHBOUR_REASON})


@probe("neighbour-transparent-refused", 29, needs="neighbour",
       records=f"tls event, reason '{NEIGHBOUR_REASON}'")
def neighbour_transparent_refused(ctx):
    """The same without the proxy: TLS straight to the neighbour's address on 443 (the
    transparent listener), SNI the neighbour's own name: an access_denied alert."""
    a = ctx.args
    if not a.inspected:
        raise NotRun("needs --inspected (the host --neighbour shares an address with)")
    addresses = [x for x in resolve(a, a.neighbour)[1] if ":" not in x]
    if not addresses:
        raise NotRun(f"{a.neighbour} does not resolve: is it allowed by the policy?")
    try:
        sock = tcp(addresses[0], 443)
    except OSError as exc:  # no TLS was tried: the refusal this probe is for never came
        raise NotRun(f"{addresses[0]}:443 ({a.neighbour}) did not take a connection ({exc}): "
                     "the transparent listener was not reached") from None
    with sock:
        ok, detail = _alerted(a, sock)
    return Outcome(ok, f"TLS to {a.neighbour} ({addresses[0]}:443): {detail}",
                   {"kind": "tls", "name": a.neighbour, "reason": NEIGHBOUR_REASON})


def _alerted(a, sock: socket.socket) -> tuple[bool, str]:
    """Whether TLS with the neighbour's name on `sock` met the filter's access_denied alert
    (else the attack went on: what came back)."""
    context = ssl._create_unverified_context()  # noqa: S323
    try:
        with context.wrap_socket(sock, server_hostname=a.neighbour) as tls:
            tls.sendall(f"GET /selftest HTTP/1.1\r\nHost: {a.inspected}\r\n"
                        "Connection: close\r\n\r\n".encode())
            head = read_head(tls)
    except ssl.SSLError as exc:
        denied = "ACCESS_DENIED" in str(exc) or "access denied" in str(exc)
        return denied, f"TLS alert: {exc.reason}"
    except OSError as exc:
        return refused(exc), f"{type(exc).__name__}: {exc}"
    return False, f"a request for {a.inspected} inside it was answered {first_line(head)!r}"
