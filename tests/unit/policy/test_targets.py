"""Request targets: what is normalised (unambiguous) and what is refused (servers disagree)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.policy.targets import Ambiguous, query_pairs, read_target


@pytest.mark.parametrize(("target", "path", "readings"), [
    ("/", "/", ((),)),
    ("/repos/a/b", "/repos/a/b", (("repos", "a", "b"),)),
    ("/repos/a/b/", "/repos/a/b", (("repos", "a", "b"),)),  # one trailing slash dropped
    ("/%67ists/%31", "/gists/1", (("gists", "1"),)),  # unreserved escapes decoded
    ("/%7e%2D%5f%2e", "/~-_.", (("~-_.",),)),
    ("/caf%c3%a9", "/caf%C3%A9", (("caf%C3%A9",),)),  # the others keep, hex upper-cased
    ("/a%3Fb%23c", "/a%3Fb%23c", (("a%3Fb%23c",),)),
    ("/@types%2fnode", "/@types%2Fnode", (("@types%2Fnode",), ("@types", "node"))),
    ("/a%2Fb/c/", "/a%2Fb/c", (("a%2Fb", "c"), ("a", "b", "c"))),
    ("/x?q=1&r", "/x", (("x",),)),
    ("/x?", "/x", (("x",),)),
    ("/.well-known/x..y/...", "/.well-known/x..y/...", ((".well-known", "x..y", "..."),)),
])
def test_canonical_targets(target, path, readings):
    parsed = read_target(target)
    assert (parsed.path, parsed.readings) == (path, readings)


@pytest.mark.parametrize(("target", "why"), [
    ("/a/./b", "dot segment"),
    ("/a/../b", "dot segment"),
    ("/a/..", "dot segment"),
    ("/%2e%2e/gists", "dot segment"),  # encoded dots decode into one
    ("/a/%2E/b", "dot segment"),
    ("/.%2e/b", "dot segment"),
    ("//gists", "empty segment"),
    ("/a//b", "empty segment"),
    ("/a\\b", "backslash"),
    ("/a%5Cb", "encoded backslash"),
    ("/a%5cb", "encoded backslash"),
    ("/gists;x/1", "';' in a path segment"),
    ("/a%252Fb", "encoded '%'"),
    ("/a%00b", "control byte"),
    ("/a%0Ab", "control byte"),
    ("/a%7f", "control byte"),
    ("/a\x00b", "control character"),
    ("/a\r\nb", "control character"),
    ("/a b", "space"),
    ("/café", "non-ASCII"),
    ("/a%zz", "malformed"),
    ("/a%4", "malformed"),
    ("/a%", "malformed"),
    ("/%C0%AF", "not UTF-8"),  # an overlong '/'
    ("/%E0%80%AE%E0%80%AE/x", "not UTF-8"),  # overlong '.'s
    ("/x#frag", "fragment"),
    ("/a%2F..%2Fgists", "dot segment"),  # only once the encoded slash is read as '/'
    ("/a%2F%2Fb", "empty segment"),
    ("/a<b", "not a path character"),
    ("x/y", "does not start with '/'"),
    ("/" + "a" * 8192, "at most 8192 are judged"),
])
def test_ambiguous_targets_are_refused_with_the_reason(target, why):
    with pytest.raises(Ambiguous, match=why):
        read_target(target)


def test_query_pairs_are_canonical_and_ordered():
    assert query_pairs("a=1&b&c=%7e&&a=%41%3d") == (("a", "1"), ("b", ""), ("c", "~"),
                                                   ("a", "A%3D"))
    with pytest.raises(Ambiguous, match="malformed"):
        query_pairs("a=%g1")
    with pytest.raises(Ambiguous, match="control, space or non-ASCII character"):
        query_pairs("a=b c")


@given(st.text(max_size=60))
def test_reading_never_raises_anything_but_ambiguous(text):
    for target in (text, "/" + text):
        try:
            parsed = read_target(target)
        except Ambiguous:
            continue
        for reading in parsed.readings:
            assert all(s and s not in (".", "..") and "/" not in s for s in reading)
