"""Leak detection on inspected hosts: what a request carries out — its target (URL and
query, decoded too) and its body — is read for the appliance's secret values, placeholders
of other sessions, and token formats that are secrets whatever host they go to. Sans-IO:
bytes in, the first finding out (a detector's name and where; never the value).

Why a short pattern list here rather than a detector library: this runs on every request
body to an inspected host, on the data plane; each detector is one compiled regex (C speed)
anchored on a fixed prefix, chosen for near-zero false positives. The wider, slower
heuristics (entropy, keywords) belong to the scan of a project before it enters a session,
where detect-secrets runs (not here).

What is read: a body up to `[inspect] scan_bytes` (held whole before any of it is sent: a
finding means nothing of it left), as sent and as the origin decodes it (reading.py:
content codings and multipart transfer encodings undone, UTF-16 and -32 decoded); a larger
one is refused unless its host is `unscanned` (bulk uploads). Header fields are read for
secret values only (`in_fields`, as the agent wrote them, before a secret is attached): a
request's own credentials ride there, so token formats are not looked for, and placeholders
in them are credentials.py's. Not read: encodings a request does not declare (base64 inside
a JSON string: an agent that encodes a secret on purpose is not stopped by this; it is a
tripwire for the accidents and the careless, the firewall is the boundary), git pushes
(their packs are compressed; git.py judges them by ref), and WebSocket frames after an
upgrade (relayed, not read). JSON's escapes are read as far as the token's start (a token
right after `\\n` is found), not inside the token (`\\u0067hp_...` is not). """

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from ..secrets import MIN_VALUE

AUTH_FIELDS = frozenset({"authorization", "proxy-authorization"})


def basic_credential(value: str) -> str | None:
    """The user:password of a basic-auth field, or None if it is not one. Read as leniently
    as servers do (no padding, URL-safe letters, spaces inside): leak checks look into it,
    and a strict reading would let a value or a placeholder by."""
    scheme, _, credential = value.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    text = "".join(credential.split()).replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4)).decode("latin-1")
    except (binascii.Error, ValueError):
        return None


_WORD = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_UPPER = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")


@dataclass(frozen=True, slots=True)
class Detector:
    """A token format: found by its literal prefixes (bytes.find, at C speed), then matched
    whole from there by `pattern`, only where no token character comes before the prefix
    (so a run of prefixes inside one long token costs one match, never one per prefix)."""

    name: str
    prefixes: tuple[bytes, ...]
    pattern: re.Pattern[bytes]
    boundary: frozenset[int] = frozenset()
    """Bytes that may not come right before the prefix."""

    def search(self, data: bytes) -> bool:
        for prefix in self.prefixes:
            at = data.find(prefix)
            while at >= 0:
                if _starts_token(data, at, self.boundary) and self.pattern.match(data, at):
                    return True
                at = data.find(prefix, at + 1)
        return False


def _starts_token(data: bytes, at: int, boundary: frozenset[int]) -> bool:
    """May a token start at `at`: nothing before it, a byte not of the token's alphabet, or
    an escape a server decodes into one (JSON's `\\n`, `\\t`, `\\u000a`: what
    `json.dumps` writes for a token at the start of a line; the `n` is not the token's)."""
    if not at or data[at - 1] not in boundary:
        return True
    return (at >= 2 and data[at - 2] == 0x5C) or (
        at >= 6 and data[at - 6:at - 4] == b"\\u" and _HEX.issuperset(data[at - 4:at]))


DETECTORS: tuple[Detector, ...] = (
    # `+` for a space: a form body or query (`urlencode`, what `requests` sends as data=)
    Detector("private key", (b"-----BEGIN ", b"-----BEGIN+"), re.compile(
        rb"-----BEGIN[ +](?:[A-Z0-9]{1,20}[ +]){0,4}PRIVATE[ +]KEY(?:[ +]BLOCK)?-----")),
    Detector("AWS access key", (b"AKIA", b"ASIA"), re.compile(
        rb"(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])"), _UPPER),
    Detector("GitHub token", (b"ghp_", b"gho_", b"ghu_", b"ghs_", b"ghr_", b"github_pat_"),
             re.compile(rb"gh[pousr]_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{82}"), _WORD),
    Detector("GitLab token", (b"glpat-",), re.compile(rb"glpat-[A-Za-z0-9_\-]{20}"), _WORD),
    Detector("Slack token", (b"xoxa-", b"xoxb-", b"xoxp-", b"xoxo-", b"xoxs-", b"xoxr-"),
             re.compile(rb"xox[abposr]-[0-9A-Za-z]{2,64}-[0-9A-Za-z-]{8}"), _WORD),
    Detector("Anthropic API key", (b"sk-ant-",), re.compile(
        rb"sk-ant-[a-z0-9]{1,16}-[A-Za-z0-9_\-]{40}"), _WORD),
    Detector("JSON Web Token", (b"eyJ",), re.compile(
        rb"eyJ[A-Za-z0-9_-]{10,}+\.eyJ[A-Za-z0-9_-]{10,}+\.[A-Za-z0-9_-]{16}"), _WORD),
)
"""Token formats that are secrets whatever host they go to."""
PLACEHOLDER = re.compile(rb"corral-secret-[a-z0-9-]{1,80}-[0-9a-f]{32}", re.IGNORECASE)
"""A placeholder in any letter case: servers that fold case (header values, hex digits)
would read it as the same placeholder, so the tripwire must too."""


@dataclass(frozen=True, slots=True)
class Finding:
    detector: str
    """What was found: a detector's name, `the secret NAME`, or `a placeholder of another
    session`; never the value."""
    where: str
    """`the body`, `the target`."""

    @property
    def reason(self) -> str:
        return f"{self.detector} in {self.where}: a leak, refused (nothing of it was sent)"


class Leaks:
    """What one request must not carry out: built per request from the secrets the filter
    holds (values, as bytes) and the placeholders the session may use (its own)."""

    __slots__ = ("_own", "_values")

    def __init__(self, values: dict[str, bytes], own: frozenset[bytes] = frozenset()):
        self._values = {name: value for name, value in values.items()
                        if len(value) >= MIN_VALUE}
        self._own = own

    def in_fields(self, fields: tuple[tuple[str, str], ...]) -> Finding | None:
        """The first secret value in a request's header fields, as the agent wrote them
        (before a secret is attached): in any field's name or value, percent-decoded too
        (cookies), and inside basic-auth credentials. Only values: a request's own
        credentials ride in its fields, so token formats are not looked for here, and
        placeholders are the credentials module's."""
        if not self._values:
            return None
        for name, value in fields:
            held = self._value_in(name.encode("latin-1", "replace"))
            if held is not None:  # never quoted: the name is the value
                return Finding(held, "a field's name")
            where = f"the field {name[:40]}"
            texts = [value.encode("latin-1", "replace")]
            decoded = basic_credential(value) if name.lower() in AUTH_FIELDS else None
            if decoded is not None:
                texts.append(decoded.encode("latin-1", "replace"))
            for text in texts:
                found = self._value_in(text)
                if found is None and b"%" in text:
                    found = self._value_in(unquote_to_bytes(text))
                if found is not None:
                    return Finding(found, where)
        return None

    def _value_in(self, data: bytes) -> str | None:
        for name, value in self._values.items():
            if value in data:
                return f"the secret {name}"
        return None

    def scan(self, data: bytes, where: str) -> Finding | None:
        """The first leak in `data` (also read percent-decoded when it holds escapes)."""
        found = self._scan(data, where)
        if found is None and b"%" in data:
            found = self._scan(unquote_to_bytes(data), f"{where} (percent-decoded)")
        return found

    def _scan(self, data: bytes, where: str) -> Finding | None:
        held = self._value_in(data)
        if held is not None:
            return Finding(held, where)
        for match in PLACEHOLDER.finditer(data):
            if match.group().lower() not in self._own:
                return Finding("a placeholder that is not this session's", where)
        for detector in DETECTORS:
            if detector.search(data):
                return Finding(f"a {detector.name}", where)
        return None
