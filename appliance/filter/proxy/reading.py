"""What a request body held whole tells the filter before any of it is sent: the leaks it
carries, and the methods it asks its origin to read the request as. Sans-IO: one call, on
the loop for a small body, on a worker thread for a large or encoded one (plan.py).

The body is read as the origin will read it (content.py): its content codings undone, the
parts of a multipart body with their transfer encodings undone, and in a charset that hides
ASCII (UTF-16, UTF-32) when its type declares one or a JSON parser would detect one. Each
of those views is scanned for leaks (leaks.py), as the raw bytes are; the `_method` fields
a stack would read are found in the decoded body (overrides.py). A body that cannot be read
that way is refused where reading matters, with `refusal` saying why: a scanner that cannot
decode denies (THREATS 14).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..http import Head
from . import content, overrides
from .leaks import Finding, Leaks

DECODED_MAX = 8 << 20
"""The most a body is inflated to, whatever its codings (and never more than
content.MAX_RATIO times a layer's input)."""


@dataclass(frozen=True, slots=True)
class BodyReading:
    methods: tuple[tuple[str, str], ...] = ()
    """(where, method) for every method the body asks to be read as."""
    finding: Finding | None = None
    """The first leak found."""
    refusal: str | None = None
    """Why the body cannot be read as the origin would (never quoting it)."""


def examine(body: bytes, head: Head, leaks: Leaks | None, methods: bool) -> BodyReading:
    """Scan `body` with `leaks` (None: the host's bodies are not scanned) and find the
    methods it asks for (when `methods`: its host has rules that name methods)."""
    applied = content.codings(head)
    try:
        decoded = content.decode(body, applied, DECODED_MAX) if applied else body
    except content.Unreadable as exc:
        return BodyReading(refusal=f"the body cannot be read to judge it: {exc}")
    pieces = None
    if overrides.MULTIPART in overrides.body_kinds(head) and leaks is not None:
        try:
            pieces = overrides.multipart(decoded, head)
        except content.Unreadable as exc:  # its parts' encodings could hide a value
            return BodyReading(refusal=f"the body cannot be read to scan it: {exc}")
    if leaks is not None:
        found = leaks.scan(body, "the body")
        if found is None and applied:
            found = leaks.scan(decoded, f"the body ({', '.join(applied)}-decoded)")
        for part in pieces or ():
            if found is None and part.encoded:
                found = leaks.scan(part.value, "a part of the multipart body (decoded)")
        charset = _hiding_charset(decoded, head)
        if found is None and charset is not None:
            text = decoded.decode(charset, errors="replace").encode("utf-8", "replace")
            found = leaks.scan(text, f"the body ({charset}-decoded)")
        if found is not None:
            return BodyReading(finding=found)
    if not methods:
        return BodyReading()
    try:
        return BodyReading(methods=tuple(overrides.body_methods(decoded, head, pieces)))
    except content.Unreadable as exc:
        return BodyReading(refusal=f"the body cannot be read to judge it: {exc}, and a "
                                   "server's parser may find a method override in it")


def _hiding_charset(body: bytes, head: Head) -> str | None:
    """The charset the origin reads the body in when it hides ASCII (UTF-16, UTF-32): the
    one its Content-Type declares, or the one a JSON parser detects by itself."""
    declared = overrides.charset(head)
    if declared is not None or overrides.JSON not in overrides.body_kinds(head):
        return declared
    detected = json.detect_encoding(body)
    return detected if detected.startswith("utf-16") or detected.startswith("utf-32") else None
