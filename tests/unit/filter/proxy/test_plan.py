"""The request's checks as a plan (proxy/plan.py), replayed as transcripts without sockets:
given this request and these results fed in, these steps out. One table per check, then
one that pins their order: a request two checks would refuse is refused by the earlier."""

from __future__ import annotations

import gzip

import pytest

from appliance.filter import secrets
from appliance.filter.git import http as git
from appliance.filter.http import HttpError, parse_request
from appliance.filter.proxy.credentials import Credentials
from appliance.filter.proxy.pipeline import InTunnel, Transparent, route
from appliance.filter.proxy.plan import (
    KEPT,
    OFF_LOOP,
    OPEN,
    TUNNEL,
    OnJudgeThread,
    ReadBody,
    Refuse,
    Request,
    Send,
    plan,
)
from appliance.filter.proxy.reading import BodyReading, examine
from appliance.policy import DEFAULT_RULES, Decision, Policy, dedupe, parse_host, policy_file_rules

VALUE = "sk-live-0123456789abcdef"
SCAN = 4096
POLICY = """
[http]
allow = ["a.test", "open.test", "bulk.test", "git.test", "api.test"]
[[inspect]]
host = "a.test"
deny = ["DELETE /**"]
[[inspect]]
host = "open.test"
[[inspect]]
host = "bulk.test"
scan = false
[[git]]
host = "git.test"
repos = ["acme/widget"]
push = ["refs/heads/corral/{session}/**"]
"""
CREDENTIALS = Credentials(b"k" * 32, {"API_TOKEN": secrets.parse(
    {"name": "API_TOKEN", "value": VALUE, "hosts": ["api.test", "a.test"]})})
PLACEHOLDER = CREDENTIALS.placeholder("s1", "API_TOKEN")
THREAD = object()
"""Fed for an OnJudgeThread step: run its work here, as the judge's thread would."""


def policy() -> Policy:
    return Policy(dedupe([*DEFAULT_RULES, *policy_file_rules(POLICY, "p.toml", "project")]))


def request(text: str, tls: bool = False, kept=None, session: str | None = "s1",
            decision: Decision | None = None) -> Request:
    """The plan's start for a request written as on the wire (`{p}`: the session's
    placeholder): plain HTTP on a transparent port 80, or inside TLS the filter ended."""
    head = parse_request(text.replace("{p}", PLACEHOLDER).encode())
    host = parse_host(head.get("host").partition(":")[0])
    mode = InTunnel(host, 443, inspected=True) if tls else Transparent(80)
    where = route(head, mode)
    rules = policy()
    if decision is None:
        decision = rules.decide_http(where.host, where.port)
    return Request(head, where, session, rules, decision, CREDENTIALS, in_tunnel=tls,
                   ended=tls, kept=kept, scan_bytes=SCAN)


def transcript(start: Request, *fed) -> list:
    """Every step of the plan, each fed the next of `fed`, up to its last; and nothing after
    the last."""
    steps, out, fed = plan(start), [], list(fed)
    step = next(steps)
    while True:
        out.append(step)
        if isinstance(step, Refuse | Send):
            with pytest.raises(StopIteration):
                next(steps)
            assert not fed, f"left unfed: {fed}"
            return out
        given = fed.pop(0)
        step = steps.send(step.work(*step.args) if given is THREAD else given)


def brief(step) -> tuple:
    """A step as the tables spell it."""
    if isinstance(step, ReadBody):
        return ("read", step.limit, step.hold, step.expects_continue)
    if isinstance(step, OnJudgeThread):
        return ("thread", step.work.__name__)
    if isinstance(step, Refuse):
        return ("refuse", step.kind, "ends" if step.ends else "keep" if step.keep else "close",
                step.discard, step.leak is not None, step.report is not None)
    return ("send", step.upstream, tuple(step.event.get("secrets", ())),
            None if step.body is None else len(step.body))


def reason(steps: list) -> str:
    return steps[-1].decision.reason


def get(host: str, extra: str = "", target: str = "/x", method: str = "GET") -> str:
    return f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n"


def posted(host: str, body: bytes, extra: str = "", method: str = "POST",
           target: str = "/x") -> str:
    return get(host, f"{extra}Content-Length: {len(body)}\r\n", target, method)


# -- 1. the host, then the route's conflict: the connection ends ------------------------------

HOST = [
    ("a host the policy denies", get("denied.test"), None, "denied.test"),
    ("an allowed host whose Host header names another",
     "GET http://a.test/x HTTP/1.1\r\nHost: b.test\r\n\r\n", None, "differs"),
    ("a denied host whose Host header names another: the host is reported",
     "GET http://denied.test/x HTTP/1.1\r\nHost: a.test\r\n\r\n", None, "denied.test"),
]


@pytest.mark.parametrize("what, text, decision, found", HOST, ids=[r[0] for r in HOST])
def test_a_request_its_host_or_route_refuses_ends_the_connection_unread(what, text, decision,
                                                                         found):
    steps = transcript(request(text, decision=decision))
    assert [brief(s) for s in steps] == [("refuse", "http", "ends", 0, False, False)]
    assert found in reason(steps) and steps[0].event == {}


# -- 2. the host's request rules: the connection goes on when HTTP allows -------------------

RULES = [
    ("a method the rules deny", get("a.test", method="DELETE"), "keep", 0),
    ("its small body is read and dropped", posted("a.test", b"12345", method="DELETE"),
     "keep", 5),
    ("a client that closes", get("a.test", "Connection: close\r\n", method="DELETE"),
     "close", 0),
    ("a body waited on with 100 Continue is never asked for",
     posted("a.test", b"12345", "Expect: 100-continue\r\n", "DELETE"), "close", 0),
    ("a method asked for by an override field",
     get("a.test", "X-HTTP-Method-Override: DELETE\r\n"), "keep", 0),
]


@pytest.mark.parametrize("what, text, keep, discard", RULES, ids=[r[0] for r in RULES])
def test_a_request_its_hosts_rules_deny_is_refused_before_anything_is_read(what, text, keep,
                                                                           discard):
    steps = transcript(request(text))
    assert [brief(s) for s in steps] == [("refuse", "http", keep, discard, False, False)]
    assert steps[0].target == "DELETE /x on a.test:80" or "override" in what
    assert steps[0].event == {"method": parse_request(text.encode()).start[0], "path": "/x"}


# -- 3. a secret's value written into a field ------------------------------------------------

FIELDS = [
    ("on an inspected host", get("open.test", f"X-Key: {VALUE}\r\n"), "leak"),
    ("inside TLS the filter ended, to a host with no [[inspect]] table",
     get("api.test", f"Cookie: k={VALUE}\r\n"), "leak"),
    ("on a host nobody reads: it goes", get("plain.test", f"X-Key: {VALUE}\r\n"), None),
]


@pytest.mark.parametrize("what, text, kind", FIELDS, ids=[r[0] for r in FIELDS])
def test_a_secrets_value_in_a_field_is_refused_where_the_request_is_read(what, text, kind):
    tls = "api.test" in text
    rules_allowing = Decision(True, "allowed for the test")
    steps = transcript(request(text, tls=tls, decision=rules_allowing))
    if kind is None:
        assert [brief(s) for s in steps] == [("send", OPEN, (), None)]
        return
    assert [brief(s) for s in steps] == [("refuse", "leak", "keep", 0, False, False)]
    assert steps[0].event["detector"] == "the secret API_TOKEN"


# -- 4. the secrets attached ------------------------------------------------------------------


def test_a_placeholder_inside_tls_to_its_host_becomes_its_value_and_is_watched_for():
    steps = transcript(request(get("api.test", "Authorization: Bearer {p}\r\n"), tls=True))
    assert [brief(s) for s in steps] == [("send", TUNNEL, ("API_TOKEN",), None)]
    assert steps[0].head.get("authorization") == f"Bearer {VALUE}"
    assert steps[0].attached == (VALUE.encode(),)


PLACEHOLDERS = [
    ("in plain HTTP", get("api.test", "Authorization: Bearer {p}\r\n"), False),
    ("to a host its secret is not bound to", get("open.test", "Authorization: Bearer {p}\r\n"),
     True),
    ("in the target", get("api.test", target="/x?key={p}"), True),
    ("of no session's", get("api.test", "X-A: corral-secret-x-" + "0" * 32 + "\r\n"), True),
]


@pytest.mark.parametrize("what, text, tls", PLACEHOLDERS, ids=[r[0] for r in PLACEHOLDERS])
def test_a_placeholder_left_anywhere_is_refused_with_a_secret_event(what, text, tls):
    steps = transcript(request(text, tls=tls, decision=Decision(True, "allowed for the test")))
    assert [brief(s) for s in steps] == [("refuse", "http", "keep", 0, True, False)]
    assert "a placeholder goes only to its secret's hosts" in reason(steps)


# -- 5. an echo of a request given a secret ---------------------------------------------------

ECHOES = [
    ("TRACE with a secret", get("api.test", "Authorization: Bearer {p}\r\n", method="TRACE"),
     "TRACE sends the request back"),
    ("asked to be read as TRACK",
     get("api.test", "Authorization: Bearer {p}\r\nX-HTTP-Method-Override: TRACK\r\n"),
     "TRACK sends the request back"),
    ("TRACE with no secret: it goes", get("api.test", method="TRACE"), None),
]


@pytest.mark.parametrize("what, text, found", ECHOES, ids=[r[0] for r in ECHOES])
def test_an_echo_never_carries_a_secret(what, text, found):
    steps = transcript(request(text, tls=True))
    if found is None:
        assert [brief(s) for s in steps] == [("send", TUNNEL, (), None)]
        return
    assert [brief(s) for s in steps] == [("refuse", "http", "keep", 0, False, False)]
    assert found in reason(steps)


# -- 6. git, on a [[git]] host ----------------------------------------------------------------

PUSH = "/acme/widget/git-receive-pack"
PUSH_TYPE = "Content-Type: application/x-git-receive-pack-request\r\n"
REFUSED_GIT = [
    ("a path servers read in two ways",
     get("git.test", target="/acme/../x/git-receive-pack"), "read in different ways"),
    ("WebDAV", get("git.test", method="MOVE"), "WebDAV"),
    ("a bare repository's file written",
     posted("git.test", b"x", method="PUT", target="/acme/widget/refs/heads/main"),
     "files of a bare repository"),
    ("a repository not listed", get("git.test", target="/acme/other/info/refs"),
     "is not listed"),
    ("a write other than a push", get("git.test", method="PUT", target=PUSH),
     "refuses other writes"),
    ("a push from no session", posted("git.test", b"0000", PUSH_TYPE, target=PUSH),
     "no session holds"),
    ("a push typed as a form", posted("git.test", b"0000", "Content-Type: application/"
                                      "x-www-form-urlencoded\r\n", target=PUSH),
     "Content-Type is not git's"),
]


@pytest.mark.parametrize("what, text, found", REFUSED_GIT, ids=[r[0] for r in REFUSED_GIT])
def test_git_calls_its_table_does_not_allow_are_refused_unread(what, text, found):
    session = None if "no session" in what else "s1"
    steps = transcript(request(text, tls=True, session=session))
    assert [s for s in steps if isinstance(s, ReadBody)] == []
    assert brief(steps[-1])[:2] == ("refuse", "http") and found in reason(steps)


def test_git_calls_that_are_not_pushes_go_on_as_sent():
    for text in (get("git.test", target="/acme/widget/issues"),
                 get("git.test", target="/acme/widget/info/refs?service=git-receive-pack"),
                 posted("git.test", b"0000", "Content-Type: application/x-git-upload-pack-"
                        "request\r\n", target="/acme/widget/git-upload-pack")):
        assert [brief(s) for s in transcript(request(text, tls=True), *(
            [b"0000"] if "upload-pack-request" in text else []))][-1][:2] == (
            "send", TUNNEL)


ALLOWED_PUSH = git.Verdict((), frozenset({"report-status"}))


def refused_push(capabilities: frozenset) -> git.Verdict:
    command = git.Command("1" * 40, "2" * 40, "refs/heads/main")
    return git.Verdict(((command, "outside the refs a push may move"),), capabilities,
                       (command,))


def test_a_push_is_read_whole_judged_on_a_judges_thread_then_sent_as_read():
    body = b"0000PACK"
    text = posted("git.test", body, PUSH_TYPE + "Expect: 100-continue\r\n", target=PUSH)
    steps = transcript(request(text, tls=True), body, ALLOWED_PUSH)
    assert [brief(s) for s in steps] == [
        ("read", git.MAX_PUSH, len(body), True), ("thread", "judge_push"),
        ("send", TUNNEL, (), len(body))]  # read once: never again for leaks
    raw, encodings, spec, session = steps[1].args
    assert (raw, encodings, session) == (body, (), "s1") and spec.repo == "acme/widget"


@pytest.mark.parametrize("capabilities, report", [
    (frozenset({"report-status"}), True),  # git shows the report's reason
    (frozenset(), False),  # it would read a 200 as success: a refusal instead
])
def test_a_refused_push_is_answered_with_gits_report_when_git_shows_one(capabilities, report):
    body = b"0000PACK"
    steps = transcript(request(posted("git.test", body, PUSH_TYPE, target=PUSH), tls=True),
                       body, refused_push(capabilities))
    assert [brief(s) for s in steps] == [
        ("read", git.MAX_PUSH, len(body), False), ("thread", "judge_push"),
        ("refuse", "git", "keep", 0, False, report)]
    assert "refs/heads/main" in reason(steps) and "corral/s1" in steps[-1].decision.hint
    if report:
        assert steps[-1].report.startswith(b"HTTP/1.1 200 OK\r\n")


def test_a_push_larger_than_the_filter_holds_is_refused_before_it_is_read():
    text = get("git.test", f"{PUSH_TYPE}Content-Length: {git.MAX_PUSH + 1}\r\n", PUSH, "POST")
    with pytest.raises(HttpError) as raised:
        transcript(request(text, tls=True))
    assert raised.value.status == 413


# -- 7. the body, where the request is read ---------------------------------------------------

BODIES = [
    ("a clean body is read and sent as read", posted("open.test", b"hello"), [b"hello"],
     [("read", SCAN, 5, False), ("send", OPEN, (), 5)]),
    ("a secret's value in it", posted("open.test", VALUE.encode()), [VALUE.encode()],
     [("read", SCAN, 5 + 19, False), ("refuse", "leak", "keep", 0, False, False)]),
    ("a body past OFF_LOOP is examined on a judge's thread",
     posted("open.test", b"x" * (OFF_LOOP + 1)), [b"x" * (OFF_LOOP + 1), THREAD],
     [("read", SCAN, OFF_LOOP + 1, False), ("thread", "examine"),
      ("send", OPEN, (), OFF_LOOP + 1)]),
    ("a coded body too", posted("open.test", gzip.compress(b"hi"), "Content-Encoding: gzip\r\n"),
     [gzip.compress(b"hi"), THREAD],
     [("read", SCAN, len(gzip.compress(b"hi")), False), ("thread", "examine"),
      ("send", OPEN, (), len(gzip.compress(b"hi")))]),
    ("a method override in a form, on a host whose rules deny it",
     posted("a.test", b"_method=DELETE", "Content-Type: application/x-www-form-urlencoded\r\n"),
     [b"_method=DELETE"], [("read", SCAN, 14, False), ("refuse", "http", "keep", 0, False,
                                                       False)]),
    ("a body that cannot be read as its origin would", posted(
        "open.test", b"not gzip", "Content-Encoding: gzip\r\n"), [b"not gzip", THREAD],
     [("read", SCAN, 8, False), ("thread", "examine"),
      ("refuse", "http", "keep", 0, False, False)]),
    ("a host that says scan = false: not read", posted("bulk.test", b"hello"), [],
     [("send", OPEN, (), None)]),
    ("a leak in the target: refused unread, the body dropped",
     posted("open.test", b"hello", target=f"/x?k={VALUE}"), [],
     [("refuse", "leak", "keep", 5, False, False)]),
    ("a host nobody reads: its body streams", posted("plain.test", b"hello"), [],
     [("send", OPEN, (), None)]),
]


@pytest.mark.parametrize("what, text, fed, expected", BODIES, ids=[r[0] for r in BODIES])
def test_a_body_is_read_whole_and_judged_where_the_request_is_read(what, text, fed, expected):
    allowed = Decision(True, "allowed for the test") if "plain.test" in text else None
    assert [brief(s) for s in transcript(request(text, decision=allowed), *fed)] == expected


def test_a_body_larger_than_the_filter_reads_is_refused_before_it_is_asked_for():
    text = get("open.test", f"Expect: 100-continue\r\nContent-Length: {SCAN + 1}\r\n")
    with pytest.raises(HttpError) as raised:
        transcript(request(text))
    assert raised.value.status == 413 and "scan = false" in str(raised.value)


def test_a_body_read_on_a_judges_thread_is_judged_by_what_it_found():
    found = BodyReading(methods=(("the _method form field", "DELETE"),))
    text = posted("a.test", b"x" * (OFF_LOOP + 1),
                  "Content-Type: application/x-www-form-urlencoded\r\n")
    steps = transcript(request(text), b"x" * (OFF_LOOP + 1), found)
    assert steps[1].work is examine and brief(steps[-1])[:2] == ("refuse", "http")
    assert "DELETE" in reason(steps)


# -- 8. where it is sent ----------------------------------------------------------------------

UPSTREAMS = [
    ("nothing kept", False, None, OPEN),
    ("kept from a request to the same host and port", False, ("open.test", 80), KEPT),
    ("kept from a request elsewhere", False, ("a.test", 80), OPEN),
    ("inside a tunnel: its own", True, None, TUNNEL),
]


@pytest.mark.parametrize("what, tls, kept, upstream", UPSTREAMS, ids=[r[0] for r in UPSTREAMS])
def test_an_allowed_request_is_sent_on_the_upstream_the_connection_holds(what, tls, kept,
                                                                        upstream):
    steps = transcript(request(get("open.test"), tls=tls, kept=kept))
    assert [brief(s) for s in steps] == [("send", upstream, (), None)]
    assert steps[0].event == {"method": "GET", "path": "/x"}


# -- the order: a request two checks refuse is refused by the earlier ------------------------

ORDER = [
    ("host before request rules", get("denied.test", method="DELETE"), False, "ends", "http"),
    ("request rules before a value in a field",
     get("a.test", f"X-Key: {VALUE}\r\n", method="DELETE"), False, "rules", "http"),
    ("a value in a field before a placeholder left",
     get("open.test", f"X-Key: {VALUE}\r\nX-B: {{p}}\r\n"), False, "field", "leak"),
    ("a placeholder left before an echo",
     get("api.test", "Authorization: Bearer {p}\r\nX-B: {p}\r\n", method="TRACE"), True,
     "placeholder", "http"),
    ("an echo before git", get("git.test", "Authorization: Bearer {p}\r\n",
                               "/acme/other/info/refs", "TRACE"), True, "echo", "http"),
    ("git before the body", posted("git.test", VALUE.encode(), method="MOVE"), True, "git",
     "http"),
    ("a leak in the target before the body's method",
     posted("a.test", b"_method=DELETE", "Content-Type: application/x-www-form-urlencoded"
            "\r\n", target=f"/x?k={VALUE}"), False, "target", "leak"),
]


@pytest.mark.parametrize("what, text, tls, first, kind", ORDER, ids=[r[0] for r in ORDER])
def test_each_check_comes_in_its_order(what, text, tls, first, kind):
    allowed = None if first in ("ends", "rules") else Decision(True, "allowed for the test")
    credentials = CREDENTIALS
    if "git.test" in text:  # a secret bound to the git host, to attach
        credentials = Credentials(b"k" * 32, {"API_TOKEN": secrets.parse(
            {"name": "API_TOKEN", "value": VALUE, "hosts": ["git.test"]})})
    start = request(text.replace("{p}", credentials.placeholder("s1", "API_TOKEN")), tls=tls,
                    decision=allowed)
    start = Request(start.head, start.where, start.session, start.policy, start.decision,
                    credentials, start.in_tunnel, start.ended, start.kept, start.scan_bytes)
    steps = transcript(start)
    assert len(steps) == 1 and steps[0].kind == kind
    said = {"ends": "denied.test", "rules": "DELETE", "field": "the secret API_TOKEN",
            "placeholder": "placeholder", "echo": "TRACE sends", "git": "WebDAV",
            "target": "the target"}[first]
    assert said in reason(steps) or said in steps[0].event.get("detector", "")
    assert steps[0].ends == (first == "ends")


CHECKS = {"judge_request", "judge_asked", "asked_methods", "keeps_after_refusal",
          "request_fields", "examine", "body_kinds", "header_paths", "classify",
          "in_fields", "apply", "unpermitted", "bare_file", "lfs_batch"}
"""The plan's checks, by the names it calls them: none of them is made outside it."""


@pytest.mark.parametrize("module", ["forward", "tunnel"])
def test_the_modules_that_move_a_requests_bytes_make_none_of_its_checks(module):
    """forward.py (explicit, transparent and in-tunnel HTTP, inspected TLS included: tunnel.py
    hands its plaintext to forward.serve) only executes the plan's steps: it imports and
    calls none of the checks the plan makes, so that no path has a sequence of its own."""
    import ast
    from pathlib import Path

    import appliance.filter.proxy as proxy

    tree = ast.parse((Path(proxy.__file__).parent / f"{module}.py").read_text())
    named = {alias.asname or alias.name for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) for alias in node.names}
    called = {node.func.attr if isinstance(node.func, ast.Attribute) else
              getattr(node.func, "id", None) for node in ast.walk(tree)
              if isinstance(node, ast.Call)}
    assert (named | called) & CHECKS == set()
