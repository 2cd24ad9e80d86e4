"""The filter's own config file (TOML): where to listen, where to forward, which sessions.

Parsed completely before anything is bound: an invalid file is a ConfigError naming the
file, key and reason, and `corral-filter` exits 2 without starting half-configured.
"""

from __future__ import annotations

import contextlib
import grp
import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

from appliance.policy import ConfigError, parse_toml
from appliance.policy.config import Locator

Address = tuple[str, int]
SESSION_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")


@dataclass(frozen=True)
class DnsConfig:
    listen: tuple[Address, ...] = ()
    """UDP and TCP listeners."""
    upstream: tuple[Address, ...] = ()
    """Resolvers that allowed names are forwarded to, tried in order."""
    timeout: float = 2.0
    """Seconds to wait for one upstream before trying the next."""
    ttl_min: int = 5
    """Answers are cached and handed out for at least this long ..."""
    ttl_max: int = 3600
    """... and at most this long, whatever the upstream says."""


@dataclass(frozen=True)
class ProxyConfig:
    listen: tuple[Address, ...] = ()
    """Explicit proxy: CONNECT and absolute-form HTTP."""
    transparent_http: tuple[Address, ...] = ()
    """Where nftables redirects TCP 80; decided by the Host header."""
    transparent_tls: tuple[Address, ...] = ()
    """Where nftables redirects TCP 443; decided by the TLS ClientHello SNI."""
    header_timeout: float = 10.0
    """Seconds a client has to send a complete request head or ClientHello."""
    idle_timeout: float = 300.0
    """Seconds a tunnel or keep-alive connection may sit with no bytes either way."""
    connect_timeout: float = 10.0
    """Seconds to establish the upstream TCP connection."""
    max_header_bytes: int = 65536
    """Largest request head accepted; larger gets 431."""
    max_connections: int = 10000
    """Client connections served at once; more are closed on accept."""


@dataclass(frozen=True)
class FirewallConfig:
    manage: bool = False
    """Re-apply the ruleset whenever a session is registered or unregistered at run time.
    Off, a new session's traffic is dropped (not in any known subnet) until someone runs
    `corral-firewall apply`: closed either way."""
    interfaces: tuple[str, ...] = ("corral*",)
    """Name patterns of the sandbox-facing interfaces (bridges); `*` only at the end."""
    log_group: int = 2713
    """NFLOG group that rejected packets are reported on (the filter reads it)."""
    log_rate: int = 20
    """Rejected packets reported per second and session (the counters count them all)."""
    learn_ttl_min: int = 60
    """Floor for how long a DNS-learned tcp allowance lasts, in seconds."""


@dataclass(frozen=True)
class SessionConfig:
    name: str
    subnet: ipaddress.IPv4Network | ipaddress.IPv6Network
    files: tuple[str, ...] = ()
    """The session's project layer (corral.toml files)."""
    gateway: ipaddress.IPv4Address | None = None
    """Where the session reaches DNS and the proxy: the subnet's first address by default."""


@dataclass(frozen=True)
class FilterConfig:
    path: str
    dns: DnsConfig
    proxy: ProxyConfig
    policy_files: tuple[str, ...] = ()
    """The appliance layer: applies to every client."""
    state_dir: str = "/var/lib/corral"
    """Runtime rules and the audit log live here."""
    control_socket: str = "/run/corral/filter.sock"
    control_group: str | None = None
    """A group that may use the control socket too (mode 0660): the admin API's user."""
    gateway: ipaddress.IPv4Address | None = None
    """What host.corral resolves to."""
    sessions: tuple[SessionConfig, ...] = field(default_factory=tuple)
    firewall: FirewallConfig = field(default_factory=FirewallConfig)

    @property
    def audit_path(self) -> Path:
        return Path(self.state_dir) / "audit.jsonl"


_SCHEMA = {
    "dns": {"listen", "upstream", "upstream_from", "timeout", "ttl_min", "ttl_max"},
    "proxy": {"listen", "transparent_http", "transparent_tls", "header_timeout",
              "idle_timeout", "connect_timeout", "max_header_bytes", "max_connections"},
    "policy": {"files"},
    "state": {"dir"},
    "control": {"socket", "group"},
    "host": {"gateway"},
    "session": {"name", "subnet", "files", "gateway"},
    "firewall": {"manage", "interfaces", "log_group", "log_rate", "learn_ttl_min"},
}


def read_text(path: str) -> str:
    """A config or policy file's text; ConfigError naming the file when it cannot be read."""
    try:
        return Path(path).read_text("utf-8")
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(path, "", "is not UTF-8 text") from None


def load_config(path: str) -> FilterConfig:
    return parse_config(read_text(path), path)


def parse_config(text: str, path: str) -> FilterConfig:
    data = parse_toml(text, path)
    where = Locator(text)

    def fail(table: str, key: str, message: str, value=None):
        line = where.value(table, value) if value is not None else None
        raise ConfigError(path, f"[{table}] {key}" if key else f"[{table}]", message,
                          line or where.key(table, key))

    for table, value in data.items():
        if table not in _SCHEMA:
            raise ConfigError(path, table, f"unknown key; expected {', '.join(sorted(_SCHEMA))}",
                              where.key("", table))
        tables = value if table == "session" else [value]
        if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
            raise ConfigError(path, table, "must be a table" + (" array ([[session]])"
                              if table == "session" else ""), where.key("", table))
        for t in tables:
            for key in t:
                if key not in _SCHEMA[table]:
                    fail(table, key, f"unknown key; expected {', '.join(sorted(_SCHEMA[table]))}")

    def section(name):
        return data.get(name, {})

    def addresses(table, key) -> tuple[Address, ...]:
        items = section(table).get(key, [])
        if not isinstance(items, list):
            fail(table, key, "must be a list of \"host:port\" strings")
        return tuple(_address(item, lambda m, i=item: fail(table, key, m, i)) for item in items)

    def number(table, key, default, kind=float, low=0):
        value = section(table).get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or (
            kind is int and not isinstance(value, int)
        ):
            fail(table, key, f"must be a {'whole ' if kind is int else ''}number, got {value!r}")
        if value <= low:
            fail(table, key, f"must be greater than {low}, got {value!r}")
        return kind(value)

    def string(table, key, default):
        value = section(table).get(key, default)
        if not isinstance(value, str) or not value:
            fail(table, key, f"must be a non-empty string, got {value!r}")
        return value

    def strings(table, key, container=None):
        container = section(table) if container is None else container
        value = container.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            fail(table, key, "must be a list of file paths")
        return tuple(value)

    upstream = addresses("dns", "upstream")
    if "upstream_from" in section("dns"):
        if upstream:
            fail("dns", "upstream_from", "give upstream or upstream_from, not both")
        upstream = _resolv_conf(string("dns", "upstream_from", ""),
                                lambda m: fail("dns", "upstream_from", m))
    dns = DnsConfig(
        listen=addresses("dns", "listen"),
        upstream=upstream,
        timeout=number("dns", "timeout", 2.0),
        ttl_min=number("dns", "ttl_min", 5, int),
        ttl_max=number("dns", "ttl_max", 3600, int),
    )
    if dns.ttl_min > dns.ttl_max:
        fail("dns", "ttl_min", f"{dns.ttl_min} is larger than ttl_max {dns.ttl_max}")
    if dns.listen and not dns.upstream:
        fail("dns", "upstream", "DNS listens but has no upstream resolver to forward to")
    proxy = ProxyConfig(
        listen=addresses("proxy", "listen"),
        transparent_http=addresses("proxy", "transparent_http"),
        transparent_tls=addresses("proxy", "transparent_tls"),
        header_timeout=number("proxy", "header_timeout", 10.0),
        idle_timeout=number("proxy", "idle_timeout", 300.0),
        connect_timeout=number("proxy", "connect_timeout", 10.0),
        max_header_bytes=number("proxy", "max_header_bytes", 65536, int, 1023),
        max_connections=number("proxy", "max_connections", 10000, int),
    )
    gateway = None
    if "gateway" in section("host"):
        text = string("host", "gateway", "")
        try:
            gateway = ipaddress.IPv4Address(text)
        except ValueError:
            fail("host", "gateway", f"{text!r} is not an IPv4 address", text)

    sessions: list[SessionConfig] = []
    for entry in data.get("session", []):
        try:
            sessions.append(make_session(entry.get("name"), entry.get("subnet"),
                                         entry.get("gateway"), strings("session", "files", entry),
                                         sessions))
        except SessionError as exc:
            fail("session", exc.key, str(exc), exc.value)

    patterns = section("firewall").get("interfaces", ["corral*"])
    if not isinstance(patterns, list) or not patterns or not all(
        isinstance(p, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,14}\*?", p) for p in patterns
    ):
        fail("firewall", "interfaces", "must be a non-empty list of interface names, with an "
             "optional trailing '*' (for example \"corral*\")")
    manage = section("firewall").get("manage", False)
    if not isinstance(manage, bool):
        fail("firewall", "manage", f"must be true or false, got {manage!r}")
    firewall = FirewallConfig(
        manage=manage,
        interfaces=tuple(patterns),
        log_group=number("firewall", "log_group", 2713, int),
        log_rate=number("firewall", "log_rate", 20, int),
        learn_ttl_min=number("firewall", "learn_ttl_min", 60, int),
    )
    if firewall.log_group > 65535:
        fail("firewall", "log_group", "must be at most 65535")

    return FilterConfig(
        path=path,
        dns=dns,
        proxy=proxy,
        policy_files=strings("policy", "files"),
        state_dir=string("state", "dir", "/var/lib/corral"),
        control_socket=string("control", "socket", "/run/corral/filter.sock"),
        control_group=_group(section("control").get("group"),
                             lambda m: fail("control", "group", m)),
        gateway=gateway,
        sessions=tuple(sessions),
        firewall=firewall,
    )


class SessionError(ValueError):
    """A session that cannot be had; `key` and `value` say which field and what it was."""

    def __init__(self, key: str, message: str, value=None):
        super().__init__(message)
        self.key, self.value = key, value


def make_session(name, subnet_text, gateway_text, files, existing) -> SessionConfig:
    """Validate one session against those that exist (config file or registered at run time)."""
    if not isinstance(name, str) or not SESSION_NAME.match(name):
        raise SessionError("name", f"{name!r} must be 1-32 of a-z, 0-9 and '-'", name)
    if any(other.name == name for other in existing):
        raise SessionError("name", f"session {name!r} is defined twice", name)
    try:
        subnet = ipaddress.ip_network(str(subnet_text), strict=True)
    except ValueError as exc:
        raise SessionError("subnet", f"session {name}: {subnet_text!r} is not a subnet: {exc}",
                           subnet_text) from None
    if subnet.version != 4 or subnet.prefixlen > 30:
        raise SessionError("subnet", f"session {name}: {subnet} must be IPv4, /30 or larger",
                           subnet_text)
    for other in existing:
        if subnet.overlaps(other.subnet):
            raise SessionError("subnet", f"session {name}: {subnet} overlaps session "
                               f"{other.name}'s {other.subnet}", subnet_text)
    gateway = next(subnet.hosts())
    if gateway_text is not None:
        try:
            gateway = ipaddress.IPv4Address(str(gateway_text))
        except ValueError:
            gateway = None
        if gateway is None or gateway not in subnet:
            raise SessionError("gateway", f"session {name}: {gateway_text!r} is not an address "
                               f"in {subnet}", gateway_text)
    return SessionConfig(name, subnet, tuple(files), gateway)


def _group(name, fail) -> str | None:
    """A group that exists on this host, or None when the key is absent."""
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        fail(f"must be a group name, got {name!r}")
    try:
        grp.getgrnam(name)
    except KeyError:
        fail(f"no group {name!r} on this host")
    return name


def _resolv_conf(path: str, fail) -> tuple[Address, ...]:
    """The nameservers of a resolv.conf, read when the filter starts: a DHCP-configured
    appliance forwards to what its network gives it. Loopback stubs are skipped (the
    filter holds port 53 itself), and link-local ones (they need an interface scope)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}")
    found = []
    for line in lines:
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            with contextlib.suppress(ValueError):
                address = ipaddress.ip_address(words[1].partition("%")[0])
                if not (address.is_loopback or address.is_link_local):
                    found.append((str(address), 53))
    if not found:
        fail(f"{path} names no nameserver other than loopback stubs")
    return tuple(found)


def _address(item, fail) -> Address:
    from appliance.policy import HostNameError, split_host_port

    if not isinstance(item, str):
        fail(f"{item!r} is not a \"host:port\" string")
    try:
        host, port = split_host_port(item)
    except HostNameError as exc:
        fail(str(exc))
    if not port or not port.isdigit() or int(port) > 65535:
        fail(f"{item!r} needs a port number, as in 127.0.0.1:53")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        fail(f"{item!r}: listen and upstream addresses must be IP addresses, not names")
    return host, int(port)
