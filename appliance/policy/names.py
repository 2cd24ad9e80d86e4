"""Host names and IP literals: normalise once, so that matching is plain string equality.

Everything that names a host — a rule, a DNS question, a CONNECT target, a Host header,
a TLS SNI — goes through `parse_host()` before it meets the policy. Normalising here, in
one place, is what makes `Example.COM.` and `example.com` the same name everywhere, and
what makes `2130706433`, `0x7f.1` and `127.0.0.1` the same (blocked) address.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_NAME = re.compile(r"(?:[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\.)*"
                   r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
_NOT_INET_ATON = re.compile(r"[g-wyzG-WYZ_-]")
"""A character that no spelling inet_aton accepts can contain (x is 0x)."""
_MAX_NAME = 253


class HostNameError(ValueError):
    """A host name or address that cannot be used; the message says why."""


PLACEHOLDER_MARK = "corral-secret-"
"""What every secret placeholder begins with (the filter's credentials): a name that carries
one is never resolved or reached, whatever the policy says."""


@dataclass(frozen=True, slots=True)
class Host:
    """A normalised host: exactly one of `name` or `address` is set."""

    name: str | None = None
    """Lower-case A-label name without trailing dot, e.g. `xn--bcher-kva.example`."""
    address: IPAddress | None = None
    """An IP literal; v4-mapped IPv6 (`::ffff:a.b.c.d`) is already unwrapped to IPv4."""
    key: str = field(init=False, compare=False, repr=False)
    """The name, or the address as text: what policy lookups are keyed on (computed once)."""

    def __post_init__(self):
        object.__setattr__(self, "key", self.name if self.name is not None else str(self.address))

    def __str__(self) -> str:
        return self.key


def unmap(address: IPAddress) -> IPAddress:
    """Judge v4-mapped IPv6 as the IPv4 address it carries (DESIGN invariant 3)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def parse_address(text: str) -> IPAddress | None:
    """An IP literal in any spelling a resolver would accept, or None if it is not one.

    Besides dotted quads this accepts the legacy forms `inet_aton` takes (`127.1`,
    `0x7f000001`, `2130706433`): libc resolves them, so an agent can use them, so they
    must be judged as the address they mean and never as names.
    """
    text = text.strip()
    if ":" not in text and _NOT_INET_ATON.search(text):
        return None  # the common case, a name: no exception-driven probing
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if "%" in text:  # a zone index (fe80::1%eth0) names a link-local address
        text = text.split("%", 1)[0]
    try:
        return unmap(ipaddress.ip_address(text))
    except ValueError:
        pass
    if text and all(c in "0123456789abcdefxABCDEFX." for c in text) and (
        text[0].isdigit()
    ):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None
    return None


def normalise_name(text: str) -> str:
    """Lower-case, strip one trailing dot, IDNA-encode; raise HostNameError when invalid."""
    if not text:
        raise HostNameError("empty host name")
    name = text.strip()
    if name.endswith("."):
        name = name[:-1]
    if not name:
        raise HostNameError(f"{text!r} is not a host name")
    if not name.isascii():
        try:
            name = name.encode("idna").decode("ascii")
        except UnicodeError as exc:
            raise HostNameError(f"{text!r} is not a valid internationalised name: {exc}") from None
    name = name.lower()
    if len(name) <= _MAX_NAME and _NAME.fullmatch(name) and not name.rpartition(".")[2].isdigit():
        return name  # valid: the per-label checks below only explain what is wrong
    if len(name) > _MAX_NAME:
        raise HostNameError(f"{text[:40]!r}... is longer than {_MAX_NAME} characters")
    labels = name.split(".")
    for label in labels:
        if not _LABEL.match(label):
            raise HostNameError(
                f"{text!r} is not a valid host name: label {label!r} must be 1-63 characters"
                " of a-z, 0-9, '-' or '_', not starting or ending with '-'"
            )
    if labels[-1].isdigit():
        raise HostNameError(f"{text!r} looks like an IP address but is not a valid one")
    return name


def parse_host(text: str) -> Host:
    """A host as a client or a rule wrote it: an IP literal or a name. Raises HostNameError."""
    address = parse_address(text)
    if address is not None:
        return Host(address=address)
    return Host(name=normalise_name(text))


def split_host_port(text: str) -> tuple[str, str | None]:
    """Split `host:port`, `[v6]:port`, `host`, `[v6]` or a bare v6 literal.

    The port is returned as text (it may be a glob in rules); None when absent.
    """
    text = text.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise HostNameError(f"{text!r}: '[' without closing ']'")
        host, rest = text[1:end], text[end + 1 :]
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise HostNameError(f"{text!r}: expected ':port' after ']'")
        return host, rest[1:]
    if text.count(":") > 1:  # a bare IPv6 literal has no port
        return text, None
    host, sep, port = text.partition(":")
    return host, (port if sep else None)

