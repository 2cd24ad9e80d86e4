"""Request targets read as an upstream will route them: every reading a server may make, or a
refusal.

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
  and some frameworks read them as `/`), `;` and `%3B` in a segment (servlet containers
  drop what follows it, some after decoding), `%3F` and `%23` (a server that decodes
  before it splits reads the rest as the query or a fragment), `%25` (a server that
  decodes twice reads `%252F` as `/`), percent-encoded control bytes (C0 and C1) and NUL,
  malformed escapes (IIS's `%u002F` among them), escaped bytes that are not UTF-8 (an
  overlong `/` or `.` in disguise), escaped Unicode that servers normalising it (NFKC,
  Windows' best fit) read as one of those (the fullwidth solidus U+FF0F, percent sign,
  reverse solidus and semicolon, the yen sign of Japanese Windows, the division slash
  U+2215) or as a dot or empty segment (two fullwidth full stops, the two-dot leader
  U+2025, a zero-width space alone), a fragment, and raw characters outside RFC 3986's
  path grammar (spaces, controls, non-ASCII). Real clients (curl, git, pip, npm,
  browsers) never send these — they resolve dot segments themselves — so refusing them
  costs nothing and closes every door a reading difference could open. `Ambiguous`
  carries the reason. So is a target longer than 8 KiB (`MAX_TARGET`), which also bounds
  the work per request. An escape of what a path may not hold raw only for its grammar
  (`%20`, `%22`, `%3C`) is that character's proper spelling: no server reads structure
  into it, and it is kept.
- **Ambiguous, judged every way**: a target may have up to six readings, and
  `inspection.py` lets a deny match any and an allow only all of them:
  - an encoded slash `%2F` is routine (npm names scoped packages `/@scope%2fname`, and
    GitHub branch names travel that way), and servers split on it or do not: `%2F` as
    data inside a segment, and as `/`;
  - an escaped sub-delimiter, `:` or `@` (`%40`, `%3A`, `%2C`, ...) is data to a server
    that routes the path as sent (Express) and the character itself to one that decodes
    first (Django, Flask, Go): the escape kept, and decoded;
  - escaped Unicode that normalisation changes (a fullwidth `g`, the dotless i U+0131
    that upper-cases to `I`, the Kelvin sign, a zero-width space or soft hyphen inside a
    name, `e` + a combining accent): as sent, and as a server that normalises it reads it
    (NFKC, those case mappings, invisible characters dropped).

A format suffix (`/gists.json` routed as `/gists`) is not a reading of the target: every
last segment with a dot could be one, so it is the deny pattern that covers its path's
suffixed forms (`patterns.py`).

The target must be in origin-form (`/path?query`): it is what the proxy re-serialises and
sends upstream, so it is what the upstream sees. The query is split off at the first `?`
and only read when a rule names a parameter (`query()`); a `;` in it is refused then (Rack
before 3, Python before 3.9.2 and Go before 1.17 split parameters at it).
"""

from __future__ import annotations

import re
import string
import unicodedata
from dataclasses import dataclass
from urllib.parse import quote, unquote

UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~")
_PATH = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@%/]*")
"""RFC 3986 path characters (pchar and '/'), '%' escapes checked separately."""
_QUERY = re.compile(r"[!-~]*")
"""Visible ASCII: the query is only matched by parameter, so any printable byte will do."""
_HIGH_ESCAPE = re.compile(r"%[89A-F]")
_MALFORMED = re.compile(r"%(?![0-9A-Fa-f]{2})")
_REFUSED = re.compile(r"%(?:[01][0-9A-Fa-f]|7[Ff]|25|5[Cc])")
"""Escapes of control bytes, '%' and '\\': refused wherever they appear."""
_PATH_REFUSED = re.compile(r"%(?:3[BbFf]|23)")
"""Escapes of ';', '?' and '#': refused in a path (a query holds them as data)."""
_RESERVED = re.compile(r"%(?:2[1246-9ABC]|3[AD]|40)")
"""Canonical escapes of the sub-delimiters, ':' and '@': pchar a server may decode or not."""
_RESERVED_CHARS = tuple((f"%{ord(c):02X}", c) for c in "!$&'()*+,:=@")
_LOW_ESCAPE = re.compile(r"%(?=[0-7])")
_INVISIBLE = re.compile("[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u2065\u3164"
                        "\ufe00-\ufe0f\uffa0\ufff0-\ufff8\U000e0100-\U000e01ef]")
"""Unicode's default-ignorable code points outside the format characters (Cf): with them,
what servers that normalise names drop."""
_LOOKALIKES = {
    "\u00a5": "\\", "\u20a9": "\\",  # yen and won: the backslash of Japanese, Korean Windows
    "\u2215": "/", "\u2044": "/", "\u29f8": "/",  # division, fraction and big solidus
    "\u2216": "\\", "\u29f5": "\\", "\u29f9": "\\",  # set minus, reverse solidi
}
"""Windows' best-fit mappings to separators, which NFKC leaves: refused like NFKC's."""
_CASE = {"\u0131": "i", "\u0130": "i", "\u00df": "ss"}
"""The characters NFKC leaves whose case mapping is ASCII: the dotless i upper-cases to I,
the dotted I lower-cases to i (char by char, as Java does), sharp s upper-cases to SS (a
test scans every code point for more)."""
STRUCTURE = "/\\;%?#"
"""What a normalised character may not become: it would split, escape or cut the path."""
MAX_TARGET = 8192
"""Longer targets are refused on hosts with request rules: it is the request-line limit of
nginx and Apache (so an upstream refuses them too), and it bounds the work per request."""
ENCODED_SLASH = "%2F"


class Ambiguous(ValueError):
    """A target that servers read in different ways; the message says which part and why."""


AS_SENT = "as sent"


@dataclass(frozen=True, slots=True)
class Target:
    """An origin-form target, canonical."""

    path: str
    """The canonical path, `/` + segments joined (escapes of unreserved characters decoded,
    a trailing slash dropped): how reasons name it."""
    readings: tuple[tuple[str, ...], ...]
    """The ways an upstream may read the path, as segments: the first as sent, then (when
    the path holds such escapes) with reserved characters decoded, Unicode normalised, each
    with an encoded slash as data and as `/` (duplicates dropped)."""
    query: str | None
    """What follows the first `?`, as sent; None without one."""
    how: tuple[str, ...] = (AS_SENT,)
    """For each reading, how a server reads the path so, in words for reasons: `as sent`,
    `with the encoded slash (%2F) read as '/'`, ..."""

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
    if "%" not in canonical:
        return Target(canonical, (segments,), query if mark else None)
    spellings = [(canonical, AS_SENT)]
    decoded = decode_reserved(canonical)
    if decoded != canonical:
        escape = _RESERVED.search(canonical).group()
        spellings.append((decoded, f"with {escape} read as {unquote(escape)!r}"))
    normal = normalised(decoded)
    if normal is not None:
        spellings.append((normal, f"as servers that normalise Unicode read it ({normal})"))
    readings: dict[tuple[str, ...], str] = {}  # reading -> how: the first way wins
    for text, how in spellings:
        readings.setdefault(segments if text is canonical else _split(text, how), how)
        if ENCODED_SLASH in text:
            slashed = ("with" if how == AS_SENT else f"{how} and") + \
                " the encoded slash (%2F) read as '/'"
            readings.setdefault(_split(text.replace(ENCODED_SLASH, "/"), slashed), slashed)
    return Target(canonical, tuple(readings), query if mark else None,
                  tuple(readings.values()))


def decode_reserved(path: str) -> str:
    """A canonical path with its escaped sub-delimiters, ':' and '@' decoded (as servers
    that decode before routing read it)."""
    if "%" in path:
        for escape, char in _RESERVED_CHARS:  # at C speed: a path may hold thousands
            if escape in path:
                path = path.replace(escape, char)
    return path


def _split(path: str, how: str) -> tuple[str, ...]:
    """The segments of a path read another way; Raises Ambiguous (naming the way) for an
    empty or dot segment it makes."""
    segments = path[1:].split("/")
    if segments[-1] == "":
        segments.pop()
    if "" in segments:
        raise Ambiguous(f"an empty segment ('//'), {how}: some servers merge slashes, "
                        "some do not")
    for dots in (".", ".."):
        if dots in segments:
            raise Ambiguous(f"a dot segment ({dots!r}), {how}: servers that resolve it reach "
                            "another path than the one judged")
    return tuple(segments)


def normalised(path: str) -> str | None:
    """The canonical path as a server that normalises Unicode reads it (NFKC, the case
    mappings and best-fit lookalikes that reach ASCII, invisible characters dropped), in
    canonical form; None when that changes nothing. Raises Ambiguous for escaped Unicode
    read as a control or as what splits, escapes or cuts a path (`STRUCTURE`)."""
    if not _HIGH_ESCAPE.search(path):
        return None
    # the escapes of non-ASCII bytes decoded (valid UTF-8: decode() said so), the others kept
    text = _unescaped(_LOW_ESCAPE.sub("%25", path)).decode()
    for char in set(text):
        if char.isascii():
            continue
        if unicodedata.category(char) == "Cc":
            raise Ambiguous(f"a percent-encoded control character (U+{ord(char):04X})")
        read = _LOOKALIKES.get(char) or unicodedata.normalize("NFKC", char)
        bad = next((c for c in read if c in STRUCTURE), None)
        if bad is not None:
            raise Ambiguous(f"U+{ord(char):04X}, which servers that normalise Unicode read "
                            f"as {bad!r}")
    read = unicodedata.normalize("NFKC", text)
    table: dict[int, str | None] = {}
    for char in set(read):
        if char.isascii():
            continue
        if unicodedata.category(char) == "Cf" or _INVISIBLE.match(char):
            table[ord(char)] = None
        elif char in _CASE:
            table[ord(char)] = _CASE[char]
    read = read.translate(table)
    if read == text:
        return None
    return quote(read, safe="/%:@!$&'()*+,=")


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
    refused = _PATH_REFUSED.search(path)
    if refused is not None:
        raise Ambiguous(_PATH_REFUSALS[refused.group().upper()])
    return tuple(segments)


_PATH_REFUSALS = {
    "%3B": "an encoded ';' (%3B) in the path: a server that decodes before it drops path "
           "parameters drops what follows it",
    "%3F": "an encoded '?' (%3F) in the path: a server that decodes before it splits off the "
           "query reads what follows it as the query",
    "%23": "an encoded '#' (%23) in the path: a server that decodes before it splits reads "
           "what follows it as a fragment",
}


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
            _unescaped(decoded).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Ambiguous(f"percent-encoded bytes that are not UTF-8 ({exc.reason}): some "
                            "servers decode overlong forms of '/' and '.'") from None
    return decoded


def _unescaped(text: str) -> bytes:
    """The bytes of a text whose escapes (all well-formed) are decoded, at C speed (which
    unquote_to_bytes is not): backslashes doubled, each '%' made a Python `\\x` escape, and
    Python's own escape decoder run."""
    return text.replace("\\", "\\\\").replace("%", "\\x").encode().decode(
        "unicode_escape").encode("latin-1")


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
    if ";" in query:
        raise Ambiguous("';' in the query: some servers (Rack before 3, Python before 3.9.2, "
                        "Go before 1.17) split parameters at it, others do not")
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
