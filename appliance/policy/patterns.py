"""Request patterns — `METHOD /path/glob[?name=glob&...]` — parsed once into matchers.

- **Method**: an HTTP method name, or `*` for any. Methods are case-sensitive tokens (RFC
  9110 §9.1) and every standard one is upper-case, so a pattern must write them so: `get`
  is refused with an error naming `GET`, never silently upper-cased (a rule's text is its
  identity; what a person wrote is what `corral rules` shows).
- **Path**: starts with `/`; `*` alone matches exactly one segment, `**` alone any number
  of segments (zero included: `/gists/**` covers `/gists`), `*` inside a segment any run of
  characters within it (`/@*/*`, `/*.json`). The path is canonicalised like a request
  (`targets.py`: `%67` is `g`, a trailing slash dropped, `%40` is `@`, as servers that
  decode route it), and what a request may not contain (dot segments, `//`, `;` and `%3B`,
  `%3F`, `%23`, backslashes, `%25`, Unicode read as those) a pattern may not either. An
  encoded slash `%2F` is refused too, and so are an encoded `*` (a glob's `*` matches one)
  and Unicode that servers normalise (a fullwidth `g`): write the path as the upstream routes it.
- **Format suffixes**: a deny also covers its path with a `.suffix` on the last segment —
  `/gists/**` covers `/gists.json`, `PUT /repos/*/*/pulls/*/merge` covers `merge.json` and
  `merge.json.xml` — because Rails (`(.:format)`), Grape, Django REST framework's
  `format_suffix_patterns`, Symfony's `{_format}` and Spring's suffix patterns route them
  to the same handler, each taking a different part of the segment for the format; so
  the deny's last segment matches the path's up to any of its dots. Only the last segment:
  `/gists.json/1` is not `/gists/1` to any of them. Dotted names are covered too (a deny
  of `/repos/*/widget` denies `/repos/o/widget.js`): the safe side. An allow covers what it
  names and nothing more: `GET /x` does not allow `/x.json`.
- **Query**: ignored unless the pattern has one. `?name=glob&other` names parameters: each
  must be present (`other` alone: with any value); other parameters are free. A deny
  matches when any value of each named parameter matches its glob (a server may read the
  first or the last); an allow only when every value does, so a second `service=` cannot
  ride on an allowed first one. Parameters are separated by `&`; `+` is not a space.
- **Case**: an allow matches the method, path and query exactly; a deny ignores case
  (ASCII), because upstreams route case-insensitively (GitHub does for owners and
  repositories: `/repos/ACME/widget` is `/repos/acme/widget`).
- **`nothing`**: the pattern of an empty allow list (`allow = []`): it matches no request
  and, being an allow, makes the host's requests need one.

Matching never backtracks: a glob's pieces are found left to right with `str.find`, and a
path's runs between `**` left to right over the segments — O(length x pattern) at worst,
whatever the agent sends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .targets import ENCODED_SLASH, Ambiguous, decode, decode_reserved, normalised, path_segments

NOTHING = "nothing"
"""The pattern text of an empty allow list."""
TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""An HTTP method name (RFC 9110 token)."""
ANY_SEGMENTS = "**"

Glob = tuple[str, ...]
"""A glob split at its '*'s: one piece is a literal, `("", "")` is `*`."""
Run = tuple[Glob, ...]
"""Consecutive single-segment globs between two `**`."""


class PatternError(ValueError):
    """A request pattern that cannot be parsed; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """Which requests a request rule covers. Identity is (text, deny)."""

    text: str
    """Canonical `METHOD /path[?query]`, or `nothing`."""
    deny: bool = False
    """A deny pattern (written `!HOST ...` as a rule); compiled case-folded."""
    method: str | None = field(default=None, compare=False, repr=False)
    """The method, None for `*` (and for `nothing`)."""
    runs: tuple[Run, ...] | None = field(default=None, compare=False, repr=False)
    """The path split at its `**`s: one run for a fixed depth, k+1 runs for k `**`s;
    None for `nothing`, which matches no request."""
    suffixed: tuple[Run, ...] | None = field(default=None, compare=False, repr=False)
    """A deny's runs for the path with a format suffix (a trailing `**` taken as none, the
    last glob extended by `.*`); None for an allow, and where `runs` cover it already (the
    last glob ends in `*`, or the path is `/` or `/**`)."""
    query: tuple[tuple[str, Glob | None], ...] = field(default=(), compare=False, repr=False)
    """Named parameters and the glob each value must match (None: present, any value)."""

    @classmethod
    def parse(cls, text: str, deny: bool = False) -> RequestSpec:
        text = text.strip()
        if text == NOTHING:
            if deny:
                raise PatternError(f"{NOTHING!r} stands for an empty allow list; a deny names "
                                   "'METHOD /path'")
            return cls(NOTHING)
        words = text.split()
        if len(words) != 2:
            raise PatternError(f"{text!r} is not 'METHOD /path', e.g. 'GET /repos/**'")
        method, target = words
        if method != "*" and not TOKEN.fullmatch(method):
            raise PatternError(f"method {method!r} is not an HTTP method name (or '*')")
        if method != method.upper():
            raise PatternError(f"method {method!r}: HTTP methods are case-sensitive; "
                               f"write {method.upper()!r}")
        if not target.startswith("/"):
            hint = " (name the path, not a URL)" if "://" in target else ""
            raise PatternError(f"path {target!r} must start with '/'{hint}")
        path, mark, query = target.partition("?")
        segments = _pattern_segments(path)
        conditions = _conditions(query) if mark else ()
        canonical = f"{method} /{'/'.join(segments)}"
        if conditions:
            canonical += "?" + "&".join(n if g is None else f"{n}={'*'.join(g)}"
                                        for n, g in conditions)
        fold = str.lower if deny else str
        return cls(canonical, deny, None if method == "*" else method,
                   _runs(segments, fold), _suffixed(segments) if deny else None,
                   tuple((fold(n), None if g is None else tuple(fold(p) for p in g))
                         for n, g in conditions))

    def matches(self, method: str, segments: tuple[str, ...],
                pairs: tuple[tuple[str, str], ...]) -> bool:
        """Does the request match? For a deny the caller passes the method upper-cased and
        the segments and pairs lower-cased (folded once per request, not per pattern)."""
        return self.matches_head(method, segments) and self.matches_query(pairs)

    def matches_head(self, method: str, segments: tuple[str, ...]) -> bool:
        """Do the method and path match (the query aside)? A deny's path matches with a
        format suffix too."""
        if self.runs is None or (self.method is not None and method != self.method):
            return False
        return _path(self.runs, segments) or (
            self.suffixed is not None and _path(self.suffixed, segments))

    def matches_as_written(self, segments: tuple[str, ...]) -> bool:
        """Does the path match without a format suffix taken off (how reasons tell)?"""
        return self.runs is not None and _path(self.runs, segments)

    def matches_query(self, pairs: tuple[tuple[str, str], ...]) -> bool:
        """Do the named parameters match (always, when the pattern names none)?"""
        for name, glob in self.query:
            values = [v for n, v in pairs if n == name]
            if not values:
                return False
            if glob is not None and not (any if self.deny else all)(
                    _glob(glob, v) for v in values):
                return False
        return True


def _runs(segments: tuple[str, ...], fold) -> tuple[Run, ...]:
    runs: list[list[Glob]] = [[]]
    for segment in segments:
        if segment == ANY_SEGMENTS:
            runs.append([])
        else:
            runs[-1].append(tuple(fold(segment).split("*")))
    return tuple(tuple(run) for run in runs)


def _suffixed(segments: tuple[str, ...]) -> tuple[Run, ...] | None:
    """The runs of a deny for its path's suffixed forms: `/gists/**` -> `/gists.*`, `/a/b`
    -> `/a/b.*` (`G.*` matches a segment whenever `G` matches it up to one of its dots)."""
    items = list(segments[:-1] if segments and segments[-1] == ANY_SEGMENTS else segments)
    if not items or items[-1].endswith("*"):
        return None
    items[-1] += ".*"
    return _runs(tuple(items), str.lower)


def _pattern_segments(path: str) -> tuple[str, ...]:
    try:
        segments = path_segments(path)
        canonical = "/" + "/".join(segments)
        if "%2A" in canonical:
            raise PatternError(f"path {path!r}: an encoded '*' (%2A); a '*' matches one")
        decoded = decode_reserved(canonical)
        normal = normalised(decoded)
    except Ambiguous as exc:
        raise PatternError(f"path {path!r}: {exc}; requests spelt so are refused anyway"
                           ) from None
    if normal is not None:
        raise PatternError(f"path {path!r}: servers that normalise Unicode read it as "
                           f"{normal}; write that")
    if decoded != canonical:
        segments = tuple(decoded[1:].split("/"))
    previous = None
    for segment in segments:
        if ENCODED_SLASH in segment:
            raise PatternError(f"path {path!r}: an encoded slash (%2F); write the path as the "
                               "upstream routes it, with '/'")
        if ANY_SEGMENTS in segment and segment != ANY_SEGMENTS:
            raise PatternError(f"path {path!r}: '**' must be a whole segment, as in /a/**/b")
        if segment == previous == ANY_SEGMENTS:
            raise PatternError(f"path {path!r}: '**/**' is one '**'")
        previous = segment
    return segments


def _conditions(query: str) -> tuple[tuple[str, Glob | None], ...]:
    if not query:
        raise PatternError("an empty query after '?'; leave the '?' out to ignore the query")
    conditions: dict[str, Glob | None] = {}
    for item in query.split("&"):
        name, eq, value = item.partition("=")
        if not name:
            raise PatternError(f"query {query!r}: a parameter without a name")
        if "*" in name:
            raise PatternError(f"query {query!r}: '*' in a parameter name; name it")
        try:
            name, value = decode(name), decode(value)
        except Ambiguous as exc:
            raise PatternError(f"query {query!r}: {exc}") from None
        if name in conditions:
            raise PatternError(f"query {query!r}: parameter {name!r} named twice")
        conditions[name] = tuple(value.split("*")) if eq else None
    return tuple(conditions.items())


def _glob(pieces: Glob, text: str) -> bool:
    """`text` matches the glob: pieces found in order, the first and last anchored."""
    if len(pieces) == 1:
        return text == pieces[0]
    first, last = pieces[0], pieces[-1]
    if len(text) < len(first) + len(last) or not (
            text.startswith(first) and text.endswith(last)):
        return False
    position, end = len(first), len(text) - len(last)
    for piece in pieces[1:-1]:
        found = text.find(piece, position, end)
        if found < 0:
            return False
        position = found + len(piece)
    return True


def _run_at(run: Run, segments: tuple[str, ...], start: int) -> bool:
    return all(_glob(glob, segments[start + i]) for i, glob in enumerate(run))


def _path(runs: tuple[Run, ...], segments: tuple[str, ...]) -> bool:
    """The runs match the segments: the first run anchored at the start, the last at the
    end, the ones between found leftmost in order (each `**` absorbs what lies between)."""
    head, tail = runs[0], runs[-1]
    if len(runs) == 1:
        return len(head) == len(segments) and _run_at(head, segments, 0)
    start, end = len(head), len(segments) - len(tail)
    if end < start or not (_run_at(head, segments, 0) and _run_at(tail, segments, end)):
        return False
    for run in runs[1:-1]:
        last = end - len(run)  # the last place the run may start
        literal = run[0][0] if run and len(run[0]) == 1 else None
        while start <= last:
            if literal is not None:  # jump to its next occurrence at C speed
                try:
                    start = segments.index(literal, start, last + 1)
                except ValueError:
                    return False
            if _run_at(run, segments, start):
                break
            start += 1
        else:
            return False
        start += len(run)
    return True
