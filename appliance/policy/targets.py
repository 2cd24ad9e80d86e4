"""Request targets read as an upstream will route them: canonical path segments, or a refusal.

Per-request rules (`inspection.py`) match a method and a path. An agent that wants past a
deny such as `* /gists/**` does not send `/gists`: it sends a spelling that the proxy and
the upstream read differently, and the rule only helps if the proxy reads it the way the
upstream does. Servers disagree, so the question for each spelling is whether every
server reads it the same way:

- **Unambiguous, normalised** (RFC 3986 §6.2.2): `%67` is `g` for every server, so
  percent-encoded unreserved characters (`A-Z a-z 0-9 - . _ ~`) are decoded before
  matching, and the hex of the escapes that stay is upper-cased (`%c3` is `%C3`). A single
  trailing slash is dropped (`/repos/x/` is `/repos/x`): frameworks that route both to the
  same handler are common, and a rule must catch both.
- **Ambiguous, refused**: dot segments (`/./`, `/../`, and `%2E%2E`, which decodes to
  one), empty segments (`//`: nginx merges them, others do not), backslashes and `%5C` (IIS
  and some frameworks read them as `/`), `;` in a segment (servlet containers drop what
  follows it), `%25` (a server that decodes twice reads `%252F` as `/`), percent-encoded
  control bytes and NUL, malformed escapes, escaped bytes that are not UTF-8 (an overlong
  `/` or `.` in disguise), a fragment, and raw characters outside RFC 3986's path grammar
  (spaces, controls, non-ASCII). Real clients (curl, git, pip, npm, browsers) never send
  these — they resolve dot segments themselves — so refusing them costs nothing and
  closes every door a reading difference could open. `Ambiguous` carries the reason. So is
  a target longer than 8 KiB (`MAX_TARGET`), which also bounds the work per request.
- **Ambiguous, judged both ways**: an encoded slash `%2F` is routine (npm names scoped
  packages `/@scope%2fname`, and GitHub branch names travel that way), and servers split
  on it or do not. A target that contains one is given two readings — `%2F` as data
  inside a segment, and as `/` — and `inspection.py` lets a deny match either and an
  allow only both.

The target must be in origin-form (`/path?query`): it is what the proxy re-serialises and
sends upstream, so it is what the upstream sees. The query is split off at the first `?`
and only read when a rule names a parameter (`query()`).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~")
_PATH = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@%/]*")
"""RFC 3986 path characters (pchar and '/'), '%' escapes checked separately."""
_QUERY = re.compile(r"[!-~]*")
"""Visible ASCII: the query is only matched by parameter, so any printable byte will do."""
_HIGH_ESCAPE = re.compile(r"%[89A-F]")
_MALFORMED = re.compile(r"%(?![0-9A-Fa-f]{2})")
_REFUSED = re.compile(r"%(?:[01][0-9A-Fa-f]|7[Ff]|25|5[Cc])")
"""Escapes of control bytes, '%' and '\\': refused wherever they appear."""
MAX_TARGET = 8192
"""Longer targets are refused on hosts with request rules: it is the request-line limit of
nginx and Apache (so an upstream refuses them too), and it bounds the work per request."""
ENCODED_SLASH = "%2F"


class Ambiguous(ValueError):
    """A target that servers read in different ways; the message says which part and why."""


@dataclass(frozen=True, slots=True)
class Target:
    """An origin-form target, canonical."""

    path: str
    """The canonical path, `/` + segments joined (escapes of unreserved characters decoded,
    a trailing slash dropped): how reasons name it."""
    readings: tuple[tuple[str, ...], ...]
    """The ways an upstream may split the path into segments: one, or two when it holds an
    encoded slash (first `%2F` as data, then `%2F` as `/`)."""
    query: str | None
    """What follows the first `?`, as sent; None without one."""

    def folded(self) -> list[tuple[str, ...]]:
        """The readings lower-cased (what deny patterns match), at C speed."""
        return [tuple("/".join(r).lower().split("/")) if r else () for r in self.readings]


def read_target(target: str) -> Target:
    """Canonicalise an origin-form target. Raises Ambiguous."""
    if len(target) > MAX_TARGET:
        raise Ambiguous(f"a target of {len(target)} bytes; at most {MAX_TARGET} are judged")
    path, mark, query = target.partition("?")
    if "#" in target:
        raise Ambiguous("a fragment ('#') in the target: clients never send one")
    segments = path_segments(path)
    canonical = "/" + "/".join(segments)
    readings: tuple[tuple[str, ...], ...] = (segments,)
    if ENCODED_SLASH in canonical:
        try:
            readings = (segments, path_segments(canonical.replace(ENCODED_SLASH, "/")))
        except Ambiguous as exc:
            raise Ambiguous(f"{exc}, once the encoded slash (%2F) is read as '/'") from None
    return Target(canonical, readings, query if mark else None)


def path_segments(path: str) -> tuple[str, ...]:
    """The canonical segments of an absolute path (`/` is none). Raises Ambiguous."""
    if not path.startswith("/"):
        raise Ambiguous("the path does not start with '/'")
    if not _PATH.fullmatch(path):
        raise Ambiguous(_bad_character(path))
    if "%" in path:
        path = decode(path)
    segments = path[1:].split("/")
    if segments[-1] == "":
        segments.pop()  # a trailing slash, or the root itself
    if "" in segments:  # list scans at C speed: a path may hold thousands of segments
        raise Ambiguous("an empty segment ('//'): some servers merge slashes, some do not")
    for dots in (".", ".."):
        if dots in segments:
            raise Ambiguous(f"a dot segment ({dots!r}): servers that resolve it reach "
                            "another path than the one judged")
    if ";" in path:
        raise Ambiguous("';' in a path segment: some servers drop what follows it")
    return tuple(segments)


def decode(text: str) -> str:
    """Decode escapes of unreserved characters, upper-case the rest. Raises Ambiguous for
    escapes that are malformed or that servers decode differently. (Regexes and a table:
    an agent can send thousands of escapes, and each must cost a fraction of a microsecond.)"""
    if "%" not in text:
        return text
    bad = _MALFORMED.search(text)
    if bad is not None:
        raise Ambiguous(f"malformed percent-encoding {text[bad.start():bad.start() + 3]!r}")
    refused = _REFUSED.search(text)
    if refused is not None:
        raise Ambiguous(_refusal(refused.group().upper()))
    parts = text.split("%")  # each part after the first starts with two hex digits
    decoded = parts[0] + "".join([_TABLE[part[:2]] + part[2:] for part in parts[1:]])
    if _HIGH_ESCAPE.search(decoded):  # ASCII bytes end a sequence, so one pass checks all
        try:
            unquote_to_bytes(decoded).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Ambiguous(f"percent-encoded bytes that are not UTF-8 ({exc.reason}): some "
                            "servers decode overlong forms of '/' and '.'") from None
    return decoded


def _refusal(escape: str) -> str:
    if escape == "%25":
        return "an encoded '%' (%25): a server that decodes twice reads another path"
    if escape == "%5C":
        return "an encoded backslash (%5C): some servers read it as '/'"
    return f"a percent-encoded control byte ({escape})"


def _escape_table() -> dict[str, str]:
    """The two hex digits of every escape, in either case -> the escape's canonical form
    (the character itself when unreserved)."""
    table = {}
    for byte in range(256):
        digits = f"{byte:02X}"
        canonical = chr(byte) if chr(byte) in UNRESERVED else "%" + digits
        for high in {digits[0], digits[0].lower()}:
            for low in {digits[1], digits[1].lower()}:
                table[high + low] = canonical
    return table


_TABLE = _escape_table()


def query_pairs(query: str) -> tuple[tuple[str, str], ...]:
    """The parameters of a query, in order, canonical; `name` without `=` has value "".
    Parameters are separated by '&' only. Raises Ambiguous."""
    if not _QUERY.fullmatch(query):
        raise Ambiguous("a control, space or non-ASCII character")
    pairs = []
    for item in query.split("&"):
        if item:
            name, _, value = item.partition("=")
            pairs.append((decode(name) if "%" in name else name,
                          decode(value) if "%" in value else value))
    return tuple(pairs)


def _bad_character(path: str) -> str:
    char = next(c for c in path if not _PATH.fullmatch(c))
    if char == "\\":
        return "a backslash in the path: some servers read it as '/'"
    if char == "#":
        return "a fragment ('#') in the target: clients never send one"
    if ord(char) < 0x20 or ord(char) == 0x7F:
        return f"a control character ({ord(char):#04x}) in the path"
    if char == " ":
        return "a space in the path"
    if not char.isascii():
        return f"a raw non-ASCII character ({char!r}) in the path: send it percent-encoded"
    return f"{char!r} in the path: not a path character (RFC 3986)"
