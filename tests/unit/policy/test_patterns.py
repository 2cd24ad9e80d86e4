"""Request patterns: parsing, canonical text, and glob semantics (against a regex reference)."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from appliance.policy.patterns import PatternError, RequestSpec


@pytest.mark.parametrize(("text", "canonical"), [
    ("GET /**", "GET /**"),
    ("  GET   /repos/*/*  ", "GET /repos/*/*"),
    ("GET /%67ists/", "GET /gists"),
    ("* /gists/**", "* /gists/**"),
    ("PUT /@*/*", "PUT /@*/*"),
    ("GET /search?q=*", "GET /search?q=*"),
    ("GET /*/*/info/refs?service=git-upload-pack", "GET /*/*/info/refs?service=git-upload-pack"),
    ("GET /x?a&b=%7e*", "GET /x?a&b=~*"),
    ("GET /", "GET /"),
    ("M-SEARCH /", "M-SEARCH /"),
    ("nothing", "nothing"),
    ("PUT /%40acme/x%3Ay", "PUT /@acme/x:y"),  # escaped ':' and '@' are what servers route
    ("GET /a%2C%21", "GET /a,!"),
])
def test_patterns_are_kept_in_canonical_form(text, canonical):
    assert RequestSpec.parse(text).text == canonical


@pytest.mark.parametrize(("text", "deny", "message"), [
    ("get /x", False, "HTTP methods are case-sensitive; write 'GET'"),
    ("Delete /x", True, "write 'DELETE'"),
    ("/x", False, "is not 'METHOD /path'"),
    ("GET", False, "is not 'METHOD /path'"),
    ("GET /a /b", False, "is not 'METHOD /path'"),
    ("G(T /x", False, "not an HTTP method name"),
    ("GET x", False, "must start with '/'"),
    ("GET https://api.github.com/x", False, "name the path, not a URL"),
    ("GET /a/../b", False, "dot segment"),
    ("GET //a", False, "empty segment"),
    ("GET /a\\b", False, "backslash"),
    ("GET /a;b", False, "';'"),
    ("GET /a%2Fb", False, "encoded slash"),
    ("GET /a**", False, "'**' must be a whole segment"),
    ("GET /***", False, "'**' must be a whole segment"),
    ("GET /a/**/**", False, "'**/**' is one '**'"),
    ("GET /x?", False, "empty query"),
    ("GET /x?a=1&a=2", False, "named twice"),
    ("GET /x?*=1", False, "'*' in a parameter name"),
    ("GET /x?=1", False, "without a name"),
    ("nothing", True, "empty allow list"),
    ("GET /a%3Bb", True, "encoded ';' (%3B)"),  # what a request may not hold, nor may a pattern
    ("GET /a%23b", False, "encoded '#' (%23)"),
    ("GET /a%3Fb", True, "encoded '?' (%3F)"),
    ("GET /%EF%BC%8Fx", True, "U+FF0F"),
    ("GET /a%2Ab", True, "an encoded '*' (%2A)"),
    ("GET /%EF%BD%87ists", True, "servers that normalise Unicode read it as /gists"),
    ("GET /%E2%80%8Bx", False, "servers that normalise Unicode read it as /x"),
])
def test_bad_patterns_are_refused_with_the_reason(text, deny, message):
    with pytest.raises(PatternError, match=re.escape(message)):
        RequestSpec.parse(text, deny)


def _segments(path: str) -> tuple[str, ...]:
    return tuple(s for s in path.split("/") if s)


@pytest.mark.parametrize(("pattern", "path", "matches"), [
    ("/*", "/a", True),
    ("/*", "/", False),
    ("/*", "/a/b", False),
    ("/**", "/", True),
    ("/**", "/a/b/c", True),
    ("/a/**", "/a", True),  # ** is zero or more
    ("/a/**", "/a/b/c", True),
    ("/a/**", "/ab", False),
    ("/**/x", "/x", True),
    ("/**/x", "/a/b/x", True),
    ("/**/x", "/x/a", False),
    ("/a/**/b/**/c", "/a/b/c", True),
    ("/a/**/b/**/c", "/a/x/b/y/z/c", True),
    ("/a/**/b/**/c", "/a/c/b", False),
    ("/@*/*", "/@scope/name", True),
    ("/@*/*", "/scope/name", False),
    ("/*.json", "/a.json", True),
    ("/*.json", "/.json", True),
    ("/*.json", "/json", False),
    ("/a*b*c", "/abc", True),
    ("/a*b*c", "/aXbYc", True),
    ("/a*b*c", "/acb", False),
    ("/a*a", "/a", False),  # the two pieces may not overlap
    ("/repos/*/*/pulls/*/merge", "/repos/o/r/pulls/1/merge", True),
    ("/repos/*/*/pulls/*/merge", "/repos/o/r/pulls/merge", False),
])
def test_glob_semantics(pattern, path, matches):
    spec = RequestSpec.parse(f"GET {pattern}")
    assert spec.matches("GET", _segments(path), ()) is matches


@pytest.mark.parametrize(("pattern", "path", "matches"), [
    ("/gists/**", "/gists.json", True),  # '**' matches no segment: /gists, suffixed
    ("/gists/**", "/gists.atom", True),
    ("/gists/**", "/gists.", True),  # Windows drops a trailing dot
    ("/gists/**", "/gists.json/x", False),  # a format is the last segment's only
    ("/gists/**", "/gistsx", False),
    ("/gists/**", "/gists-json", False),
    ("/repos/*/*/pulls/*/merge", "/repos/o/r/pulls/1/merge.json", True),
    ("/repos/*/*/pulls/*/merge", "/repos/o/r/pulls/1/merge.json.json", True),
    ("/repos/*/*/pulls/*/merge", "/repos/o/r/pulls/1/merge.json/x", False),
    ("/repos/*/*/pulls/*/merge", "/repos/o/r/pulls/1/merged", False),
    ("/**/merge", "/a/b/merge.xml", True),
    ("/a/**/b", "/a/x/b.y", True),
    ("/*.json", "/a.json.xml", True),
    ("/foo.bar", "/foo.bar.baz", True),  # Symfony's /foo.bar.{_format}
    ("/foo.bar", "/foo.baz", False),
    ("/repos/*/widget", "/repos/o/widget.js", True),  # a dotted name: the safe side
    ("/x/a*b", "/x/a1b.json", True),
    ("/", "/.json", False),  # the root has no segment to suffix
])
def test_a_deny_covers_the_format_suffixes_of_what_it_names(pattern, path, matches):
    """Rails (`(.:format)`), Grape, Django REST framework's format_suffix_patterns, Symfony's
    `{_format}` and Spring's suffix patterns route `/gists.json` as `/gists`: a deny covers
    its path with any `.suffix` on the last segment. An allow covers what it names only."""
    deny = RequestSpec.parse(f"GET {pattern}", deny=True)
    assert deny.matches("GET", _segments(path), ()) is matches
    allow = RequestSpec.parse(f"GET {pattern}")
    assert allow.matches("GET", _segments(path), ()) is (
        bool(_reference(tuple(_segments(pattern))).fullmatch(path)) if pattern != "/" else False)


def test_methods_and_case():
    allow, deny = RequestSpec.parse("PUT /A/b"), RequestSpec.parse("PUT /A/b", deny=True)
    assert allow.matches("PUT", ("A", "b"), ())
    assert not allow.matches("PUT", ("a", "b"), ())  # an allow matches exactly
    assert not allow.matches("put", ("A", "b"), ())
    assert deny.matches("PUT", ("a", "b"), ())  # a deny is given folded input, matches folded
    assert RequestSpec.parse("* /x").matches("whatever", ("x",), ())
    assert not RequestSpec.parse("nothing").matches("GET", (), ())


def test_query_conditions_every_value_for_an_allow_any_value_for_a_deny():
    allow = RequestSpec.parse("GET /r?service=git-upload-pack")
    deny = RequestSpec.parse("GET /r?service=git-receive-pack", deny=True)
    upload, receive = ("service", "git-upload-pack"), ("service", "git-receive-pack")
    assert allow.matches("GET", ("r",), (upload, ("x", "1")))  # other parameters are free
    assert not allow.matches("GET", ("r",), ())  # a named parameter must be there
    assert not allow.matches("GET", ("r",), (upload, receive))  # every value must match
    assert deny.matches("GET", ("r",), (upload, receive))  # any value does
    present = RequestSpec.parse("GET /search?q")
    assert present.matches("GET", ("search",), (("q", ""),))
    assert not present.matches("GET", ("search",), (("p", "q"),))


segment = st.text("ab.", min_size=1, max_size=4).filter(lambda s: s not in (".", ".."))
glob_segment = st.one_of(segment, st.sampled_from(["*", "**", "a*", "*b", "a*b", "*.*"]))


def _reference(pattern: tuple[str, ...]) -> re.Pattern:
    """A regex over '/'-prefixed segments: the strict reference the matcher is checked by."""
    out = []
    for item in pattern:
        if item == "**":
            out.append(r"(?:/[^/]+)*")
        else:
            out.append("/" + "[^/]*".join(re.escape(p) for p in item.split("*")))
    return re.compile("".join(out))


@given(pattern=st.lists(glob_segment, max_size=5), path=st.lists(segment, max_size=6))
def test_matching_agrees_with_a_regex_reference(pattern, path):
    text = "/" + "/".join(pattern)
    try:
        spec = RequestSpec.parse(f"GET {text}")
    except PatternError:
        return  # '**/**'
    expected = bool(_reference(tuple(pattern)).fullmatch("".join("/" + s for s in path)))
    assert spec.matches("GET", tuple(path), ()) is expected


def _suffixes_stripped(path: list[str]) -> list[list[str]]:
    """The path, and the path with its last segment cut at each of its dots."""
    if not path:
        return [path]
    last = path[-1]
    return [path] + [[*path[:-1], last[:i]] for i, c in enumerate(last) if c == "."]


@settings(max_examples=500)
@example(pattern=["gists", "**"], path=["gists.json"])
@example(pattern=["a", "*", "merge"], path=["a", "b", "merge.a.b"])
@given(pattern=st.lists(glob_segment, max_size=5), path=st.lists(segment, max_size=6))
def test_a_deny_matches_as_the_reference_reads_any_format_suffix(pattern, path):
    """A deny matches a path when the reference matches it, or matches it with the last
    segment's suffix cut at any dot: whatever a router takes for the format."""
    text = "/" + "/".join(pattern)
    try:
        spec = RequestSpec.parse(f"GET {text}", deny=True)
    except PatternError:
        return
    reference = _reference(tuple(pattern))
    expected = any(reference.fullmatch("".join("/" + s for s in p))
                   for p in _suffixes_stripped(path) if all(p))
    assert spec.matches("GET", tuple(path), ()) is expected
