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
finding means nothing of it left); a larger one is refused unless its host is `unscanned`
(bulk uploads). Not read: header fields for token formats (a request's own credentials ride
there; credentials.py watches placeholders in them), encodings other than the raw bytes
and percent-escapes (gzip, base64: an agent that encodes a secret on purpose is not stopped
by this; it is a tripwire for the accidents and the careless, the firewall is the boundary),
and git pushes (their packs are compressed; git.py judges them by ref).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

DETECTORS: tuple[tuple[str, re.Pattern[bytes]], ...] = (
    ("private key", re.compile(rb"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")),
    ("AWS access key", re.compile(rb"(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])")),
    ("GitHub token", re.compile(
        rb"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{82})")),
    ("GitLab token", re.compile(rb"(?<![A-Za-z0-9_])glpat-[A-Za-z0-9_\-]{20}")),
    ("Slack token", re.compile(rb"(?<![A-Za-z0-9])xox[abposr]-[0-9A-Za-z]{2,}-[0-9A-Za-z-]{8,}")),
    ("Anthropic API key", re.compile(rb"(?<![A-Za-z0-9])sk-ant-[a-z0-9]+-[A-Za-z0-9_\-]{40,}")),
    ("JSON Web Token", re.compile(
        rb"(?<![A-Za-z0-9_-])eyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{16,}")),
)
"""(name, pattern): token formats that are secrets whatever host they go to."""
PLACEHOLDER = re.compile(rb"corral-secret-[a-z0-9-]{1,80}-[0-9a-f]{32}")


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
        self._values = {name: value for name, value in values.items() if len(value) >= 8}
        self._own = own

    def scan(self, data: bytes, where: str) -> Finding | None:
        """The first leak in `data` (also read percent-decoded when it holds escapes)."""
        found = self._scan(data, where)
        if found is None and b"%" in data:
            found = self._scan(unquote_to_bytes(data), f"{where} (percent-decoded)")
        return found

    def _scan(self, data: bytes, where: str) -> Finding | None:
        for name, value in self._values.items():
            if value in data:
                return Finding(f"the secret {name}", where)
        for match in PLACEHOLDER.finditer(data):
            if match.group() not in self._own:
                return Finding("a placeholder that is not this session's", where)
        for name, pattern in DETECTORS:
            if pattern.search(data) is not None:
                return Finding(f"a {name}", where)
        return None
