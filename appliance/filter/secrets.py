"""Secrets the appliance holds for sessions: never sent to one, attached by the filter.

A secret is a value (an API token), the environment variable a session knows it by, the
hosts it may go to and how it goes (a header of its own, `Authorization: Bearer`, or basic
auth with a user). A session is given a placeholder in that variable instead of the value
(proxy/credentials.py swaps it on the way out to the secret's hosts).

An `ssh` secret is a private key the git gateway (git/sshgate.py) logs in to its hosts with, as
`user`, checking the host against `host_keys` (pinned: no key, no connection). A session
gets nothing for it, not even a placeholder: its git reaches the gateway with a key of its
own (sshgate.session_key).

Secrets live in one file in the filter's state directory, 0600 for the filter's user,
written atomically, with the key placeholders are derived from; nothing else ever holds a
value: events, the audit log, `secret-list` and `status` name secrets, never show them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets as random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

from appliance.atomic import write_atomic
from appliance.policy import ConfigError, HostNameError, normalise_name
from appliance.policy.patterns import PatternError, RequestSpec
from appliance.policy.targets import Ambiguous, query_pairs, read_target

log = logging.getLogger(__name__)

FILE = "secrets.json"
NAME = re.compile(r"[A-Z][A-Z0-9_]{0,63}")
"""A secret's name is the environment variable a session finds its placeholder in."""
FIELD = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
SCHEMES = ("bearer", "basic", "header", "ssh")
MAX_VALUE = 8192
MIN_VALUE = 8
"""The shortest value the leak scanner looks for (proxy/leaks.py): shorter ones would be
found in ordinary text, so a secret is never given one (it would go unscanned)."""
MAX_HOSTS = 32
MAX_REQUESTS = 32
MAX_HOST_KEYS = 16
SSH_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
RESERVED_FIELDS = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "upgrade", "te",
    "trailer", "keep-alive", "proxy-connection", "proxy-authorization", "expect"})
"""Fields the proxy writes itself or that steer the connection: never a secret's."""
RESERVED_NAMES = frozenset({
    "HOME", "TERM", "PATH", "USER", "SHELL", "HOSTNAME", "HTTP_PROXY", "HTTPS_PROXY",
    "ALL_PROXY", "NO_PROXY", "PIP_PROXY", "JAVA_TOOL_OPTIONS", "SSL_CERT_FILE",
    "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT", "GIT_SSL_CAINFO",
    "NODE_EXTRA_CA_CERTS", "NODE_OPTIONS", "PYTHONPATH", "BASH_ENV", "ENV"})
"""Variables a session's environment sets for its own workings (sandbox/hardening.py and
trust.py), or that run code: a secret may not take one over."""
RESERVED_PREFIXES = ("LD_", "GIT_CONFIG_", "NPM_CONFIG_", "CORRAL_")


class SecretError(ValueError):
    """A secret that cannot be stored; the message says which field and why (never the
    value itself)."""


@dataclass(frozen=True)
class Secret:
    name: str
    value: str
    hosts: tuple[str, ...]
    """Names and `*.suffix` wildcards it may be sent to."""
    scheme: str = "bearer"
    """bearer: `Authorization: Bearer` (or `token`, as gh writes it); basic: basic auth
    with `user`; header: the value alone in the field `header`."""
    header: str | None = None
    user: str | None = None
    created: float = 0.0
    nonce: str = ""
    """Random, made when the secret is first set, kept when it is replaced: in its
    placeholders (proxy/credentials.py), so a secret removed and set again has new ones."""
    requests: tuple[str, ...] = ()
    """Request patterns (`METHOD /path`, as in [[inspect]] allow lists) the value may go
    with; none: any request to its hosts."""
    host_keys: tuple[str, ...] = ()
    """ssh: the hosts' public keys (`TYPE BASE64`), the only ones the gateway accepts."""
    port: int = 22
    """ssh: the port the gateway reaches the hosts on."""

    def permits(self, method: str, target: str) -> bool:
        """May the value go with this request (its method and origin-form target)? A target
        servers read in different ways never gets it; an encoded slash must match both
        readings, as an allow pattern must."""
        if not self.requests:
            return True
        try:
            parsed = read_target(target)
            pairs = query_pairs(parsed.query) if parsed.query else ()
        except Ambiguous:  # what servers read in different ways never gets a value
            return False
        specs = [_spec(text) for text in self.requests]
        return all(any(spec.matches(method, reading, pairs) for spec in specs)
                   for reading in parsed.readings)

    def binds(self, host_name: str | None) -> bool:
        """May the value go to this host?"""
        if host_name is None:
            return False
        return any(host_name == h or (h.startswith("*.") and host_name.endswith(h[1:]))
                   for h in self.hosts)

    def describe(self) -> dict:
        """What may be shown of it: everything but the value."""
        shown = {k: v for k, v in asdict(self).items() if k not in ("value", "nonce")}
        shown["hosts"] = list(self.hosts)
        shown["requests"] = list(self.requests)
        if self.scheme == "ssh":
            shown["host_keys"] = list(self.host_keys)
        else:
            del shown["host_keys"], shown["port"]
        return shown


def parse(request: dict, minimum: int = MIN_VALUE) -> Secret:
    """A secret from a `secret-set` request (`minimum`: the shortest value taken; a secret
    stored before values had one is loaded with 1). Raises SecretError."""
    name = request.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise SecretError("'name' must be an environment variable name: A-Z, 0-9 and _, "
                          "starting with a letter, at most 64 (e.g. ANTHROPIC_API_KEY)")
    if name in RESERVED_NAMES or name.startswith(RESERVED_PREFIXES):
        raise SecretError(f"secret {name}: that variable is a session's own (proxy, trust, "
                          "paths, loaders): pick another name")
    value = request.get("value")
    if not isinstance(value, str) or not value:
        raise SecretError(f"secret {name}: 'value' must be a non-empty string")
    scheme = request.get("scheme", "bearer")
    if scheme == "ssh":
        return _ssh(name, request, value)
    if len(value) > MAX_VALUE or not all(" " < c <= "~" for c in value):
        raise SecretError(f"secret {name}: the value must be {MIN_VALUE}-{MAX_VALUE} printable "
                          "ASCII characters without spaces (it goes into an HTTP header)")
    if len(value) < minimum:
        raise SecretError(f"secret {name}: a value of {len(value)} characters; at least "
                          f"{MIN_VALUE}, the shortest the leak scanner looks for (a shorter one "
                          "would match ordinary text, and would go out unscanned)")
    normal = _hosts(name, request.get("hosts"))
    if scheme not in SCHEMES:
        raise SecretError(f"secret {name}: 'scheme' must be one of {', '.join(SCHEMES)}")
    header, user = request.get("header"), request.get("user")
    if scheme == "header":
        if not isinstance(header, str) or not FIELD.fullmatch(header) or (
                header.lower() in RESERVED_FIELDS):
            raise SecretError(f"secret {name}: 'header' must name a field (letters, digits, "
                              "'-'), not one the proxy writes itself")
        header = header.lower()
    elif header is not None:
        raise SecretError(f"secret {name}: 'header' goes with scheme 'header' only")
    if scheme == "basic":
        if not isinstance(user, str) or not user or ":" in user or not all(
                " " <= c <= "~" for c in user) or len(user) > 256:
            raise SecretError(f"secret {name}: basic auth needs a 'user' (printable, no ':')")
    elif user is not None:
        raise SecretError(f"secret {name}: 'user' goes with scheme 'basic' only")
    requests = request.get("requests") or []
    if (not isinstance(requests, list) or len(requests) > MAX_REQUESTS
            or not all(isinstance(r, str) for r in requests)):
        raise SecretError(f"secret {name}: 'requests' must list at most {MAX_REQUESTS} request "
                          "patterns such as 'POST /v1/messages'")
    patterns = []
    for text in requests:
        try:
            spec = RequestSpec.parse(text)
        except PatternError as exc:
            raise SecretError(f"secret {name}: request pattern {text!r}: {exc}") from None
        if spec.runs is None:
            raise SecretError(f"secret {name}: request pattern {text!r} matches nothing")
        patterns.append(spec.text)
    return Secret(name, value, tuple(dict.fromkeys(normal)), scheme, header, user,
                  round(time.time(), 3), random.token_hex(16), tuple(dict.fromkeys(patterns)))


def _hosts(name: str, hosts) -> list[str]:
    if (not isinstance(hosts, list) or not hosts or len(hosts) > MAX_HOSTS
            or not all(isinstance(h, str) for h in hosts)):
        raise SecretError(f"secret {name}: 'hosts' must list 1-{MAX_HOSTS} host names")
    normal = []
    for host in hosts:
        wild = host.startswith("*.")
        try:
            normal.append(("*." if wild else "") + normalise_name(host[2:] if wild else host))
        except HostNameError as exc:
            raise SecretError(f"secret {name}: host {host!r}: {exc}") from None
        if wild and "." not in normal[-1][2:]:
            raise SecretError(f"secret {name}: host {host!r} covers a whole top-level domain: "
                              "every name under a wildcard gets the value")
    return normal


def _ssh(name: str, request: dict, value: str) -> Secret:
    """An ssh secret: a private key without a passphrase, the login, the pinned host keys.
    Checked by parsing them as the gateway will (asyncssh), so a key it cannot use is
    refused here, when it is set, not at a push."""
    import asyncssh  # the filter's alone: the rest of this module runs without it

    if len(value) > MAX_VALUE:
        raise SecretError(f"secret {name}: a private key of at most {MAX_VALUE} characters")
    try:
        asyncssh.import_private_key(value)
    except (asyncssh.KeyImportError, ValueError) as exc:
        raise SecretError(f"secret {name}: the value is not a private key the gateway can use "
                          f"(OpenSSH or PEM, no passphrase): {str(exc)[:100]}") from None
    hosts = _hosts(name, request.get("hosts"))
    if any(h.startswith("*.") for h in hosts):
        raise SecretError(f"secret {name}: an ssh key goes to named hosts, not a wildcard")
    user = request.get("user", "git")
    if not isinstance(user, str) or not SSH_USER.fullmatch(user):
        raise SecretError(f"secret {name}: 'user' must be a login name such as git")
    port = request.get("port", 22)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise SecretError(f"secret {name}: 'port' must be a TCP port, got {port!r}")
    keys = request.get("host_keys")
    if (not isinstance(keys, list) or not keys or len(keys) > MAX_HOST_KEYS
            or not all(isinstance(k, str) for k in keys)):
        raise SecretError(f"secret {name}: 'host_keys' must list 1-{MAX_HOST_KEYS} public "
                          "keys of its hosts (TYPE BASE64, as ssh-keyscan prints them): the "
                          "gateway reaches no host it cannot check")
    pinned = []
    for text in keys:
        try:
            key = asyncssh.import_public_key(text.strip())
        except (asyncssh.KeyImportError, ValueError):
            raise SecretError(f"secret {name}: host key {text[:40]!r}... is not a public key "
                              "(TYPE BASE64)") from None
        pinned.append(key.export_public_key("openssh").decode().strip())
    for field_name in ("header", "requests"):
        if request.get(field_name):
            raise SecretError(f"secret {name}: {field_name!r} is for HTTP secrets, not ssh")
    return Secret(name, value, tuple(dict.fromkeys(hosts)), "ssh", None, user,
                  round(time.time(), 3), random.token_hex(16), (),
                  tuple(dict.fromkeys(pinned)), port)


@lru_cache(maxsize=1024)
def _spec(text: str) -> RequestSpec:
    return RequestSpec.parse(text)


@dataclass(frozen=True)
class SecretChange:
    """A change to the secrets, worked out aside (`SecretStore.plan_set`, `plan_remove`):
    the whole set it leads to. Written off the loop (`write`), then committed on it."""

    path: Path
    key: bytes
    secrets: dict[str, Secret]
    result: object
    """What the caller is told: True if a set secret is new; the removed secret."""

    def write(self) -> None:
        """Put the file on disk, atomically (it is as it was if this raises). Blocks."""
        data = {"key": self.key.hex(),
                "secrets": {n: {**asdict(s), "hosts": list(s.hosts),
                                "requests": list(s.requests), "host_keys": list(s.host_keys)}
                            for n, s in sorted(self.secrets.items())}}
        write_atomic(self.path, json.dumps(data, indent=1).encode(), mode=0o600)


class ListenerFailed(RuntimeError):
    """A change was committed, but a part that follows the store failed to take it."""


class SecretStore:
    """The file: {"key": hex, "secrets": {name: secret}}. Read at start; each change written
    (atomically) before it is committed and answered. As the policy store, it tells
    `on_change` listeners (the proxy's credentials, the git gateway) after each commit."""

    def __init__(self, path: Path, key: bytes, secrets: dict[str, Secret]):
        self.path, self.key, self.secrets = path, key, secrets
        self._listeners: list[Callable[[], None]] = []

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call `callback()` after every committed change, on the thread that commits (the
        event loop's, once the filter serves)."""
        self._listeners.append(callback)

    @classmethod
    def load(cls, state_dir: str | Path) -> SecretStore:
        """The store in `state_dir`, made (with a new key) when there is none. Raises
        OSError, or ConfigError naming the file when it cannot be read as one."""
        path = Path(state_dir) / FILE
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            store = cls(path, random.token_bytes(32), {})
            store.save()
            return store
        except ValueError as exc:
            raise ConfigError(str(path), "", f"not JSON ({exc}): restore it from a backup, or "
                              "remove it (every secret is lost, sessions get new "
                              "placeholders)") from None
        if os.stat(path).st_mode & 0o077:
            os.chmod(path, 0o600)  # it was copied in by hand: no one else reads it from now
        try:
            key = bytes.fromhex(data["key"])
            found = {}
            for name, fields in data["secrets"].items():
                if fields.get("name") != name:
                    raise ValueError(f"entry {name!r} holds secret {fields.get('name')!r}")
                # a file restored or edited by hand: as if set anew, but for the minimum
                # length (a value stored before there was one still works; it is never
                # scanned for, as before: setting it again is refused until it is longer)
                checked = parse(fields, minimum=1)
                found[name] = replace(checked, created=fields.get("created", 0.0),
                                      nonce=fields.get("nonce") or checked.nonce)
        except SecretError as exc:
            raise ConfigError(str(path), "", str(exc)) from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(str(path), "", f"not a secrets file ({exc})") from None
        return cls(path, key, found)

    def save(self) -> None:
        SecretChange(self.path, self.key, self.secrets, None).write()

    def http(self) -> dict[str, Secret]:
        """The secrets the proxy attaches (every one but ssh keys, which no session sees
        even as a placeholder)."""
        return {n: s for n, s in self.secrets.items() if s.scheme != "ssh"}

    def ssh(self, host_name: str) -> Secret | None:
        """The ssh key the gateway logs in to `host_name` with (the first by name)."""
        return next((s for _, s in sorted(self.secrets.items())
                     if s.scheme == "ssh" and host_name in s.hosts), None)

    def plan_set(self, secret: Secret) -> SecretChange:
        """Store it (replacing one of that name, whose placeholders stay good); the result
        is True if it is new."""
        old = self.secrets
        if secret.name in old:
            secret = replace(secret, nonce=old[secret.name].nonce)
        return SecretChange(self.path, self.key, {**old, secret.name: secret},
                            secret.name not in old)

    def plan_remove(self, name: str) -> SecretChange:
        """Forget it; the result is the secret. Raises LookupError naming the secrets
        there are."""
        if name not in self.secrets:
            raise LookupError(f"no secret {name!r}; secrets: "
                              f"{', '.join(sorted(self.secrets)) or 'none'}")
        return SecretChange(self.path, self.key,
                            {k: v for k, v in self.secrets.items() if k != name},
                            self.secrets[name])

    def commit(self, change: SecretChange) -> None:
        """Make a written change the store's state, then tell every listener. Raises
        ListenerFailed after all were told if one failed: the change is written and in force
        here, but a part of the filter (the proxy's credentials, the gateway) may not
        follow it, and the caller (a control call) must not answer that all is well."""
        self.secrets = change.secrets
        failed = 0
        for callback in self._listeners:
            try:
                callback()
            except Exception:  # one listener's bug must not keep the others from the change
                log.exception("secrets: a listener failed after a change")
                failed += 1
        if failed:
            raise ListenerFailed(f"the secret store changed, but {failed} of the parts that "
                                 "follow it failed to (the filter's log says which); "
                                 "restart corral-filter to load the store afresh")

    def set(self, secret: Secret) -> bool:
        """Plan, write and commit at once (callers on the loop's thread, or without one)."""
        change = self.plan_set(secret)
        change.write()
        self.commit(change)
        return change.result

    def remove(self, name: str) -> Secret:
        """Plan, write and commit at once (see `set`)."""
        change = self.plan_remove(name)
        change.write()
        self.commit(change)
        return change.result
