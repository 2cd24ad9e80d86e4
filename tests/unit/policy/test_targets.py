"""Request targets: what is normalised (unambiguous) and what is refused (servers disagree)."""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import quote

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
    ("/a%2Cb%3D%7e", "/a%2Cb%3D~", (("a%2Cb%3D~",), ("a,b=~",))),
    ("/@types%2fnode", "/@types%2Fnode", (("@types%2Fnode",), ("@types", "node"))),
    ("/a%2Fb/c/", "/a%2Fb/c", (("a%2Fb", "c"), ("a", "b", "c"))),
    ("/x?q=1&r", "/x", (("x",),)),
    ("/x?", "/x", (("x",),)),
    ("/.well-known/x..y/...", "/.well-known/x..y/...", ((".well-known", "x..y", "..."),)),
    # escaped sub-delimiters, ':' and '@': data to a server that routes the path as sent,
    # the character itself to one that decodes first (Django, Flask, Go): both readings
    ("/%40acme/x%3ay", "/%40acme/x%3Ay", (("%40acme", "x%3Ay"), ("@acme", "x:y"))),
    ("/%40scope%2Fname", "/%40scope%2Fname", (("%40scope%2Fname",), ("%40scope", "name"),
                                              ("@scope%2Fname",), ("@scope", "name"))),
    ("/a%21%24%26%27%28%29%2A%2B%2C%3D", "/a%21%24%26%27%28%29%2A%2B%2C%3D",
     (("a%21%24%26%27%28%29%2A%2B%2C%3D",), ("a!$&'()*+,=",))),
    # Unicode a server may normalise (NFKC, case mapped, invisible characters dropped)
    ("/%EF%BD%87ists", "/%EF%BD%87ists", (("%EF%BD%87ists",), ("gists",))),  # fullwidth g
    ("/g%C4%B1sts", "/g%C4%B1sts", (("g%C4%B1sts",), ("gists",))),  # dotless i
    ("/gi%E2%80%8Bsts", "/gi%E2%80%8Bsts", (("gi%E2%80%8Bsts",), ("gists",))),  # zero width
    ("/%E2%84%AAey", "/%E2%84%AAey", (("%E2%84%AAey",), ("Key",))),  # Kelvin sign
    ("/merge%EF%BC%8Ejson", "/merge%EF%BC%8Ejson", (("merge%EF%BC%8Ejson",), ("merge.json",))),
    ("/cafe%CC%81", "/cafe%CC%81", (("cafe%CC%81",), ("caf%C3%A9",))),  # composed
    ("/caf%C3%A9/%E2%80%A6", "/caf%C3%A9/%E2%80%A6", (("caf%C3%A9", "%E2%80%A6"),
                                                      ("caf%C3%A9", "..."))),
    ("/%E3%80%80", "/%E3%80%80", (("%E3%80%80",), ("%20",))),  # ideographic space
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
    ("/a%2F%E2%80%8B%2Fb", "empty segment"),
    ("/a<b", "not a path character"),
    ("x/y", "does not start with '/'"),
    # escaped forms of what is refused raw: a server that decodes first reads them raw
    ("/gists%3Bx/1", "encoded ';' (%3B)"),
    ("/gists%3b", "encoded ';' (%3B)"),
    ("/a%3Fb", "encoded '?' (%3F)"),
    ("/a%23b", "encoded '#' (%23)"),
    ("/a%253Bb", "encoded '%'"),  # twice
    ("/a%u002Fb", "malformed"),  # IIS's %u escapes
    ("/a%C0%BB", "not UTF-8"),  # an overlong ';'
    ("/a%C2%85b", "control character (U+0085)"),  # C1 controls, as C0
    # Unicode that servers normalising it (NFKC, Windows best fit) read as structure
    ("/%EF%BC%8Fgists", "U+FF0F, which servers that normalise Unicode read as '/'"),
    ("/a%EF%BC%BCb", "U+FF3C, which servers that normalise Unicode read as '\\\\'"),
    ("/a%EF%B9%A8b", "U+FE68"),
    ("/a%EF%BC%9Bb", "U+FF1B, which servers that normalise Unicode read as ';'"),
    ("/a%CD%BEb", "U+037E"),  # the Greek question mark is NFKC ';'
    ("/a%EF%BC%85%32%46", "U+FF05, which servers that normalise Unicode read as '%'"),
    ("/a%EF%BC%9F", "read as '?'"),
    ("/a%EF%BC%83", "read as '#'"),
    ("/a%C2%A5b", "U+00A5, which servers that normalise Unicode read as '\\\\'"),  # cp932
    ("/a%E2%88%95b", "U+2215, which servers that normalise Unicode read as '/'"),
    ("/x/%EF%BC%8E%EF%BC%8E/gists", "dot segment"),
    ("/x/%E2%80%A5/gists", "dot segment"),  # the two-dot leader is NFKC '..'
    ("/x/%EF%B9%92", "dot segment"),
    ("/a/%E2%80%8B/b", "empty segment"),  # a zero-width space alone
    ("/" + "a" * 8192, "at most 8192 are judged"),
])
def test_ambiguous_targets_are_refused_with_the_reason(target, why):
    with pytest.raises(Ambiguous, match=re.escape(why)):
        read_target(target)


def test_query_pairs_are_canonical_and_ordered():
    assert query_pairs("a=1&b&c=%7e&&a=%41%3d") == (("a", "1"), ("b", ""), ("c", "~"),
                                                   ("a", "A%3D"))
    with pytest.raises(Ambiguous, match="malformed"):
        query_pairs("a=%g1")
    with pytest.raises(Ambiguous, match="control, space or non-ASCII character"):
        query_pairs("a=b c")


@pytest.mark.parametrize("query", ["a=1;service=git-receive-pack", ";x", "a;b=c"])
def test_a_semicolon_in_the_query_is_ambiguous(query):
    """Rack before 3, Python before 3.9.2 and Go before 1.17 split parameters at ';'."""
    with pytest.raises(Ambiguous, match="';' in the query"):
        query_pairs(query)
    assert query_pairs("a=1%3Bb") == (("a", "1%3Bb"),)  # escaped, it is data everywhere


def test_backslashes_next_to_escapes_are_data():
    """UTF-8 is checked by Python's escape decoder: a backslash in a query is not one."""
    assert query_pairs("a=\\x41%c3%a9\\") == (("a", "\\x41%C3%A9\\"),)
    assert query_pairs("a=\\xc3%c3%a9") == (("a", "\\xc3%C3%A9"),)
    with pytest.raises(Ambiguous, match="not UTF-8"):  # the escape alone is a lone byte
        query_pairs("a=\\xc3%a9")
    with pytest.raises(Ambiguous, match="not UTF-8"):
        query_pairs("a=\\%C0%AF")


@given(st.text(max_size=60))
def test_reading_never_raises_anything_but_ambiguous(text):
    for target in (text, "/" + text, "/" + quote(text, safe="/%;")):
        try:
            parsed = read_target(target)
        except Ambiguous:
            continue
        for reading in parsed.readings:
            assert all(s and s not in (".", "..") and "/" not in s and ";" not in s
                       and "\\" not in s for s in reading)
        assert parsed.readings[0] == tuple(parsed.path[1:].split("/")) if parsed.path != "/" \
            else parsed.readings[0] == ()


def test_every_code_point_whose_case_mapping_is_ascii_is_read_so():
    """A server comparing names without case (Java's equalsIgnoreCase, upper-casing) reads
    the dotless i as `i` and sharp s as `ss`: after NFKC, every non-ASCII character whose
    upper or lower case is ASCII is mapped (so the list in targets.py is whole)."""
    missed = []
    for point in range(0x80, 0x110000):
        if 0xD800 <= point < 0xE000:
            continue
        for char in unicodedata.normalize("NFKC", chr(point)):
            if char.isascii():
                continue
            if char.upper().isascii() or char.lower().isascii():
                target = "/" + quote(chr(point))
                reading = read_target(target).readings[-1]
                if not reading[0].isascii() or "%" in reading[0]:
                    missed.append(f"U+{point:04X}")
    assert not missed


def test_invisible_characters_are_dropped_in_the_normalised_reading():
    """Every format character (category Cf) and default-ignorable code point a server may
    drop is dropped (or refused)."""
    kept = []
    for point in range(0x80, 0x110000):
        if unicodedata.category(chr(point)) != "Cf" and point not in (
                0x034F, 0x115F, 0x1160, 0x17B4, 0x3164, 0xFE0F, 0xFFA0, 0xE0100):
            continue
        try:
            reading = read_target("/a" + quote(chr(point)) + "b").readings[-1]
        except Ambiguous:
            continue
        if reading != ("ab",):
            kept.append(f"U+{point:04X}")
    assert kept == [], kept
