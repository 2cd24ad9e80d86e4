"""Placeholders in, secrets out, for the bound hosts only: decisions without I/O.

A session knows each secret by a placeholder (`corral-secret-<name>-<32 hex>`, an HMAC of
the session's and the secret's names under the store's key: the same for a session across
restarts, different for every session). On a request inside TLS the filter terminated, to
a host the secret is bound to, the placeholder is replaced by the value where the secret
says it goes: its own header, `Authorization: Bearer|token`, or the password (or user) of
basic auth, which is re-written with the secret's user. Anything that still carries a
placeholder after that, anywhere in the request line or the fields (a placeholder of
another session, in another field, in the query, on another host, in plain HTTP) is a
`Leak`: the request is refused, nothing of it leaves. Bodies are not read here.

The real value never reaches a session; a placeholder that escapes is worthless outside the
filter, so this check is a tripwire that names what an agent tried, not the boundary.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote

from appliance.policy import PLACEHOLDER_MARK, Host

from ..redact import Redactor
from ..secrets import Secret
from .leaks import Leaks, basic_credential
from .pipeline import MAX_READINGS

DIGEST_HEX = 32


class Leak(Exception):
    """A placeholder going where its secret may not; the message names where (never the
    value, never the placeholder in full)."""

    def __init__(self, where: str, secret: str | None):
        super().__init__(where)
        self.where, self.secret = where, secret


@dataclass(frozen=True)
class Applied:
    headers: tuple[tuple[str, str], ...]
    used: tuple[str, ...]
    """The secrets attached, by name (for the event)."""


class Credentials:
    """The secrets as the proxy uses them: a snapshot, replaced whole on a change."""

    def __init__(self, key: bytes, secrets: Mapping[str, Secret]):
        self.key, self.secrets = key, dict(secrets)
        self._leaks: dict[str | None, Leaks] = {}
        self.wire = {label: value for name in self.secrets
                     for label, value in zip((name, f"{name} (basic auth)"),
                                             self.values((name,)), strict=False)}
        """Each value as it goes on the wire, by what names it (a finding, a redaction)."""
        self.redactor = Redactor(self.wire)
        """What every door of the filter passes its words through (redact.py)."""

    def placeholder(self, session: str, name: str) -> str:
        """The secret's nonce is in it: a secret removed and set again under its name has
        placeholders of its own, and the old ones stay dead."""
        secret = self.secrets.get(name)
        nonce = secret.nonce if secret is not None else ""
        digest = hmac.new(self.key, f"{session}\0{name}\0{nonce}".encode(), hashlib.sha256)
        slug = name.lower().replace("_", "-")
        return f"{PLACEHOLDER_MARK}{slug}-{digest.hexdigest()[:DIGEST_HEX]}"

    def environment(self, session: str) -> dict[str, str]:
        """What a session is started with: each secret's variable, holding its placeholder."""
        return {name: self.placeholder(session, name) for name in sorted(self.secrets)}

    def values(self, names: tuple[str, ...]) -> tuple[bytes, ...]:
        """The values of these secrets, as they go on the wire (to look for them coming
        back)."""
        out = []
        for secret in (self.secrets[n] for n in names if n in self.secrets):
            out.append(secret.value.encode())
            if secret.scheme == "basic":
                out.append(base64.b64encode(f"{secret.user}:{secret.value}".encode()))
        return tuple(out)

    def leaks(self, session: str | None) -> Leaks:
        """What a request of `session` must not carry out (leaks.py): every secret's value
        as it goes on the wire, and every placeholder but the session's own."""
        cached = self._leaks.get(session)
        if cached is None:
            own = frozenset(self.placeholder(session, n).encode() for n in self.secrets
                            ) if session is not None else frozenset()
            if len(self._leaks) > 4096:
                self._leaks.clear()
            cached = self._leaks[session] = Leaks(self.wire, own)
        return cached

    def bound(self, host: Host) -> list[str]:
        """The secrets that may go to `host` (its TLS must be ended to attach them)."""
        return [s.name for s in self.secrets.values() if s.binds(host.name)]

    def apply(self, session: str | None, host: Host, target: str,
              headers: tuple[tuple[str, str], ...], tls: bool, method: str = "GET",
              overrides: tuple[str, ...] = (), paths: tuple[str, ...] = ()) -> Applied:
        """The request's fields with this session's placeholders replaced where their secret
        goes to `host` (only inside TLS the filter ended: `tls`) with this method and target
        (a secret limited to request patterns: for its own method and every method it asks
        to be read as, `overrides`, at its target and every path a rewrite field routes it
        by, `paths`). Raises Leak if any placeholder is left anywhere: the target (decoded
        too), a field's name or value, or a basic-auth credential."""
        mine = {self.placeholder(session, s.name): s for s in self.secrets.values()
                if s.binds(host.name)} if tls and session is not None else {}
        readings = _readings((method, *overrides), (target, *paths))
        out, used = [], []
        for name, value in headers:
            if mine:
                low = name.lower()
                for placeholder, secret in mine.items():
                    swapped = _swap(secret, low, value, placeholder)
                    # limited to requests: asked only of a placeholder actually found
                    if swapped is not None and readings is not None and all(
                            secret.permits(m, t) for m, t in readings):
                        value = swapped
                        used.append(secret.name)
                        break
            out.append((name, value))
        # every request pays for this: one look at all of it first, field by field only
        # when something is there to name
        if _marked("\0".join(f"{n}\0{v}" for n, v in out)):
            for name, value in out:
                if _marked(name) or _marked(value):
                    raise self._leak(f"the field {name[:40]}", name + value, session)
        for name, value in out:
            if name.lower() in ("authorization", "proxy-authorization"):
                decoded = basic_credential(value)
                if decoded is not None and _marked(decoded):
                    raise self._leak(f"the basic-auth credential in {name}", decoded, session)
        if _marked(target) or ("%" in target and _marked(unquote(target))):
            raise self._leak("the request target", unquote(target), session)
        return Applied(tuple(out), tuple(used))

    def unpermitted(self, used: tuple[str, ...], methods: list[str], target: str,
                    paths: list[str] = ()) -> str | None:
        """Why a request that was given these secrets may not keep them once its body asks
        to be read as `methods` (a secret limited to request patterns goes only with what
        they allow, for every method the request asks for, at its target and every path a
        rewrite field routes it by, `paths`); None when all may."""
        readings = _readings(methods, (target, *paths))
        for name in used:
            secret = self.secrets.get(name)
            if readings is None or secret is None:
                return f"secret {name} goes only with requests the filter can judge"
            refused = next((m for m, t in readings if not secret.permits(m, t)), None)
            if refused is not None:
                return (f"secret {name} goes only with its request patterns, and the body "
                        f"asks for the request to be read as {refused[:20]!r}")
        return None

    def _leak(self, where: str, text: str, session: str | None) -> Leak:
        """Which secret a placeholder in `text` stands for, when it is one of this
        session's (another session's, or a made-up one, is named as such)."""
        for name in self.secrets:
            if session is not None and self.placeholder(session, name) in text:
                return Leak(where, name)
        return Leak(where, None)


def _marked(text: str) -> bool:
    return PLACEHOLDER_MARK in text.lower()


def _readings(methods, targets) -> list[tuple[str, str]] | None:
    """Each (method, target) a request may be read as, once, its own included; None past
    MAX_READINGS others (a secret never goes with a request read in more ways than the
    filter judges)."""
    readings = [(m, t) for m in dict.fromkeys(methods) for t in dict.fromkeys(targets)]
    return readings if len(readings) <= MAX_READINGS + 1 else None


def _swap(secret: Secret, field: str, value: str, placeholder: str) -> str | None:
    """`value` of `field` with the secret in place of the placeholder, where the secret goes
    in that field and in that form; None where it does not."""
    if secret.scheme == "header":
        return secret.value if field == secret.header and value.strip() == placeholder \
            else None
    if field != "authorization":
        return None
    scheme, _, credential = value.strip().partition(" ")
    credential = credential.strip()
    if secret.scheme == "bearer":
        if scheme.lower() in ("bearer", "token") and credential == placeholder:
            return f"{scheme} {secret.value}"
        return None
    if scheme.lower() != "basic":  # basic: the placeholder as password (or as user, alone)
        return None
    decoded = basic_credential(value)
    if decoded is None:
        return None
    user, _, password = decoded.partition(":")
    if password == placeholder or (user == placeholder and password in ("", "x-oauth-basic")):
        pair = f"{secret.user}:{secret.value}".encode()
        return f"{scheme} {base64.b64encode(pair).decode()}"
    return None
