"""A lax server's reading of a request target: the reference the path rules are checked by.

Every trick some server is known to play on a path, in every combination: decode escapes
(once, twice, overlong UTF-8 too), normalise Unicode (NFKC, Windows best-fit lookalikes,
invisible characters dropped, case mapped), read a backslash as '/', split off the query
and the fragment after decoding, drop path parameters (';...'), merge slashes, resolve dot
segments, drop a trailing slash, and route the last segment without its format suffix
(Rails' `.json`, Spring's suffix patterns). Deliberately simple and independent of
`appliance/policy/targets.py`: slow, exhaustive, and written from the servers' side.
"""

from __future__ import annotations

import itertools
import re
import unicodedata

BEST_FIT = {"\u00a5": "\\", "\u20a9": "\\", "\u2215": "/", "\u2044": "/", "\u2216": "\\",
            "\u29f5": "\\", "\u29f8": "/", "\u29f9": "\\", "\u0131": "i", "\u0130": "i"}
INVISIBLE = re.compile("[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f"
                       "\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8]")


def _lax_utf8(data: bytes) -> str:
    """UTF-8 decoded without the overlong check (as old IIS and Tomcat did)."""
    out, i = [], 0
    while i < len(data):
        b = data[i]
        need = 1 if 0xC0 <= b < 0xE0 else 2 if 0xE0 <= b < 0xF0 else 3 if 0xF0 <= b < 0xF8 else 0
        tail = data[i + 1 : i + 1 + need]
        if need and len(tail) == need and all(0x80 <= t < 0xC0 for t in tail):
            value = b & (0x3F >> need)
            for t in tail:
                value = value << 6 | (t & 0x3F)
            out.append(chr(value) if value < 0x110000 else "\ufffd")
            i += 1 + need
        else:
            out.append(chr(b))
            i += 1
    return "".join(out)


def _decode(text: str) -> str:
    data = re.sub(rb"%([0-9A-Fa-f]{2})", lambda m: bytes([int(m.group(1), 16)]),
                  text.encode("utf-8", "surrogatepass"))
    return _lax_utf8(data)


def _unicode(text: str) -> str:
    text = unicodedata.normalize("NFKC", text)
    text = INVISIBLE.sub("", "".join(BEST_FIT.get(c, c) for c in text))
    return text.lower()


def _resolve(path: str, backslash: bool) -> tuple[str, ...] | None:
    if backslash:
        path = path.replace("\\", "/")
    out: list[str] = []
    for segment in path.split("/"):
        segment = segment.split(";", 1)[0]
        if segment in ("", "."):
            continue
        if segment == "..":
            if out:
                out.pop()
            continue
        out.append(segment)
    return tuple(out)


def readings(target: str) -> set[tuple[str, ...]]:
    """Every path (lower-cased segments) a lax server may route `target` to."""
    found: set[tuple[str, ...]] = set()
    path = target.split("?", 1)[0].split("#", 1)[0]
    for times, normalise, backslash, split in itertools.product((0, 1, 2), (False, True),
                                                                (False, True), (False, True)):
        text = path
        for _ in range(times):
            text = _decode(text)
        if normalise:
            text = _unicode(text)
        if split:  # decoded, then split: '%3F' and '%23' end the path
            text = text.split("?", 1)[0].split("#", 1)[0]
        segments = _resolve(text.lower(), backslash)
        found.add(segments)
        if segments and "." in segments[-1]:
            last = segments[-1]
            found.update((*segments[:-1], last[:i]) for i, c in enumerate(last) if c == ".")
    return found


def covers(pattern: str, segments: tuple[str, ...]) -> bool:
    """A deny pattern's path (`*`, `**`) covers these lower-case segments (a regex reference)."""
    parts = []
    for item in pattern.lower().strip("/").split("/") if pattern != "/" else []:
        if item == "**":
            parts.append(r"(?:/[^/]+)*")
        else:
            parts.append("/" + "[^/]*".join(re.escape(p) for p in item.split("*")))
    return re.fullmatch("".join(parts), "".join("/" + s for s in segments)) is not None
