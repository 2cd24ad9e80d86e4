"""The filter's own config file (TOML): where to listen, where to forward, which sessions.

Parsed completely before anything is bound: an invalid file is a ConfigError naming the
file, key and reason, and `corral-filter` exits 2 without starting half-configured.

Each setting is written once: a dataclass field with its default, its docstring, and (in
its metadata) the TOML key it is read from and the function that checks and converts the
value. The parser walks the fields; a key the file leaves out keeps the field's default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import grp
import ipaddress
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from appliance.policy import ConfigError, HostNameError, parse_toml, split_host_port
from appliance.policy.config import Locator

Address = tuple[str, int]
GATEWAY = "gateway"
"""A listener's host meaning "each session's gateway address": `listen = ["gateway:53"]`
binds port 53 on every session's gateway, opened when the session comes and closed when it
goes (gateways.py), and on no other address."""
SESSION_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
Fail = Callable[..., None]
"""fail(message, value=None) raises a ConfigError for the key being read (on the line that
holds `value`, when given)."""


# -- value checkers: (value, fail) -> the converted value ------------------------------------


def number(low: float = 0, kind: type = float):
    """A finite number greater than `low` (a whole one with kind=int): TOML reads `nan` and
    `inf` as floats, and nan compares as greater than nothing and less than nothing."""
    def check(value, fail: Fail):
        if isinstance(value, bool) or not isinstance(value, int | float) or (
                kind is int and not isinstance(value, int)):
            fail(f"must be a {'whole ' if kind is int else ''}number, got {value!r}")
        if not math.isfinite(value):
            fail(f"must be a finite number, got {value!r}")
        if value <= low:
            fail(f"must be greater than {low}, got {value!r}")
        return kind(value)
    return check


def whole(low: int = 0):
    return number(low, int)


def processes(value, fail: Fail) -> int:
    """A count of processes, or "cores": the CPUs this process may run on, read at start."""
    if value == "cores":
        return max(1, len(os.sched_getaffinity(0)))
    return whole(0)(value, lambda m, v=None: fail(f'{m} (or "cores")', v))


def string(value, fail: Fail) -> str:
    if not isinstance(value, str) or not value:
        fail(f"must be a non-empty string, got {value!r}")
    return value


def paths(value, fail: Fail) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        fail("must be a list of file paths")
    return tuple(value)


def readable(value, fail: Fail) -> str:
    """A file this process can read now (a missing key file is named before anything binds)."""
    path = string(value, fail)
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}", value)
    return path


def boolean(value, fail: Fail) -> bool:
    if not isinstance(value, bool):
        fail(f"must be true or false, got {value!r}")
    return value


def addresses(value, fail: Fail) -> tuple[Address, ...]:
    if not isinstance(value, list):
        fail("must be a list of \"host:port\" strings")
    return tuple(_address(item, lambda m, i=item: fail(m, i)) for item in value)


def listeners(value, fail: Fail) -> tuple[Address, ...]:
    """Where a service listens: `gateway:PORT` (each session's gateway) or a fixed
    `IP:PORT`. Never a wildcard: 0.0.0.0:53 takes port 53 from every resolver on the host
    (systemd-resolved's stub on 127.0.0.53, libvirt's dnsmasq on its bridges), and a
    sandbox only ever reaches its own gateway anyway."""
    if not isinstance(value, list):
        fail("must be a list of \"gateway:PORT\" or \"IP:PORT\" strings")
    found = []
    for item in value:
        if isinstance(item, str) and item.partition(":")[0] == GATEWAY:
            port = item.partition(":")[2]
            if not (port.isascii() and port.isdigit()) or not 0 < int(port) <= 65535:
                fail(f"{item!r} needs a fixed port number, as in gateway:53 (sandboxes are "
                     "told it)", item)
            found.append((GATEWAY, int(port)))
            continue
        host, port = _address(item, lambda m, i=item: fail(m, i))
        if ipaddress.ip_address(host).is_unspecified:
            fail(f"{item!r}: a wildcard address takes the port on every address of the host, "
                 "from its own resolvers too (systemd-resolved, dnsmasq); write "
                 f"\"gateway:{port}\" to listen on each session's gateway", item)
        found.append((host, port))
    return tuple(found)


def interfaces(value, fail: Fail) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(
            isinstance(p, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,14}\*?", p) for p in value):
        fail("must be a non-empty list of interface names, with an optional trailing '*' "
             "(for example \"corral*\")")
    return tuple(value)


def ipv4(value, fail: Fail) -> ipaddress.IPv4Address | None:
    with contextlib.suppress(ValueError):
        return ipaddress.IPv4Address(string(value, fail))
    fail(f"{value!r} is not an IPv4 address", value)
    return None


def group(value, fail: Fail) -> str:
    """A group that exists on this host."""
    if not isinstance(value, str) or not value:
        fail(f"must be a group name, got {value!r}")
    try:
        grp.getgrnam(value)
    except KeyError:
        fail(f"no group {value!r} on this host")
    return value


def setting(default, check, key: str | None = None):
    """A field read through `check` from the TOML key `key` ("table.key"); by default the
    key is the field's own name in its dataclass's table."""
    return field(default=default, metadata={"check": check, "key": key})


SEGMENT_BYTES = 64 * 1024 * 1024
"""Default size at which the active segment is rotated ([state] audit_segment_bytes)."""
SEGMENTS_KEPT = 8
"""Default number of segments kept, the active one included ([state] audit_segments)."""
SCAN_BYTES = 1 << 20
"""`[inspect] scan_bytes`' default: the largest request body read for leaks."""


@dataclass(frozen=True)
class DnsConfig:
    listen: tuple[Address, ...] = setting((), listeners)
    """UDP and TCP listeners: "gateway:PORT" on each session's gateway, or "IP:PORT"."""
    upstream: tuple[Address, ...] = setting((), addresses)
    """Resolvers that allowed names are forwarded to, tried in order (or `upstream_from`: the
    nameservers of a resolv.conf, read when the filter starts)."""
    timeout: float = setting(2.0, number())
    """Seconds to wait for one upstream before trying the next."""
    ttl_min: int = setting(5, whole())
    """Answers are cached and handed out for at least this long ..."""
    ttl_max: int = setting(3600, whole())
    """... and at most this long, whatever the upstream says."""
    rate: float = setting(200.0, number())
    """Queries a second one session may send on average (a token bucket, cached answers
    included). A sandbox that resolves for itself asks A and AAAA per connection; 200 a
    second is far above what builds and package managers ask."""
    burst: int = setting(1000, whole())
    """Queries one session may send at once above `rate`. Beyond, a query is answered
    REFUSED at once, and an event (deny) says so at most once a second per session, with
    the count refused since the last one."""
    denied_rate: float = setting(20.0, number())
    """Names the policy denies that one session may have answered a second on average (a
    bucket of its own, taken only by a name decided afresh: a denied name asked again is a
    cached answer). Nothing legitimate asks many names it may not have, and a flood of them
    is the exfiltration and starvation pattern: this limit is reached at a few dozen a
    second, so it holds on a filter far slower than `rate` (a VM under emulation)."""
    denied_burst: int = setting(200, whole())
    """Denied names one session may have answered at once above `denied_rate`. Beyond,
    REFUSED at once (no event per name: one a second with the count); the session's other
    names are answered as before."""
    max_pending: int = setting(256, whole())
    """Queries of one session waiting for an upstream at once; more are answered REFUSED
    (the upstream timeout bounds how long each one waits)."""
    max_tcp: int = setting(32, whole())
    """DNS-over-TCP connections one session may hold open; more are closed at once. A stub
    resolver opens one per truncated answer and closes it."""
    cache_share: int = setting(2000, whole())
    """Entries one session may hold in the wire cache (20,000 answers in all) and in the
    resolver's cache (100,000): a session at its share evicts its own oldest entry, never
    another session's. 2,000 names is more than a build asks; ten sessions at their share
    still fit in the wire cache."""
    exfil_length: int = setting(128, whole())
    """For a name a wildcard rule allows (`*.zone`): the most characters the client may
    choose, i.e. the labels before the zone, dots included. Longer looks like DNS
    exfiltration: NXDOMAIN, never sent upstream. Real names stay well under: the longest
    S3 forms (a 63-character bucket or access point with `.s3-accesspoint.dualstack.REGION`)
    choose about 105 under `amazonaws.com`; exfiltration tools fill names to 253."""
    exfil_entropy: float = setting(4.8, number())
    """For a name a wildcard rule allows: a label of `exfil_entropy_length` characters or
    more whose characters carry more bits each than this (Shannon) looks like encoded data.
    Names are judged in lower case, so the alphabet is 38 characters (5.25 bits at most).
    Real long labels mix words and numbers and stay below 4.7 (S3 bucket names such as
    `aws-sam-cli-managed-default-samclisourcebucket-2cjx583p9q74`: 4.55); random base36 or
    base64 at 63 characters is around 4.7 to 5.0. Hex and base32 stay under it: the length
    and `exfil_names` limits bound those."""
    exfil_entropy_length: int = setting(48, whole())
    """How long a label must be before its entropy is judged (short labels have too few
    characters to tell randomness from words: CloudFront ids, hashes, Codespaces names)."""
    exfil_names: int = setting(60, whole())
    """Distinct names one session may ask under one wildcard zone in a minute. Package
    and CDN traffic asks a handful (raw, objects, codeload under githubusercontent.com);
    with `exfil_length` this bounds a channel to about 5 KB a minute per zone."""


@dataclass(frozen=True)
class ProxyConfig:
    listen: tuple[Address, ...] = setting((), listeners)
    """Explicit proxy: CONNECT and absolute-form HTTP ("gateway:PORT" or "IP:PORT", as
    every listener)."""
    transparent_http: tuple[Address, ...] = setting((), listeners)
    """Where nftables redirects TCP 80 (to the port, on the address of the interface the
    packet came in on: the session's gateway); decided by the Host header."""
    transparent_tls: tuple[Address, ...] = setting((), listeners)
    """Where nftables redirects TCP 443; decided by the TLS ClientHello SNI."""
    header_timeout: float = setting(10.0, number())
    """Seconds a client has to send a complete request head or ClientHello."""
    idle_timeout: float = setting(300.0, number())
    """Seconds a tunnel or keep-alive connection may sit with no bytes either way."""
    connect_timeout: float = setting(10.0, number())
    """Seconds to establish the upstream TCP connection."""
    max_header_bytes: int = setting(65536, whole(1023))
    """Largest request head accepted; larger gets 431."""
    max_connections: int = setting(10000, whole())
    """Client connections served at once, all sessions together; more are reset on accept."""
    max_connections_per_session: int = setting(256, whole())
    """Client connections one session may hold at once (a sandbox outside every session
    counts as one more); more are reset on accept, with an event once a second. With the
    tunnels below, what makes one session's flood unable to starve another."""
    max_tunnels_per_session: int = setting(128, whole())
    """Of those, tunnels (CONNECT, transparent TLS): each costs six descriptors more than a
    plain connection (a spliced tunnel's pipes and socket duplicates). More get 503."""
    kept_upstreams_per_session: int = setting(8, whole(-1))
    """Idle plain-HTTP upstream connections one session may keep for its next requests to
    the same origin (proxy/pool.py), for at most 15 s each; 0 keeps none."""


@dataclass(frozen=True)
class SshgateConfig:
    listen: tuple[Address, ...] = setting((), listeners)
    """The git gateway (filter/git/sshgate.py): where sessions reach it with git over SSH. Empty: no
    gateway, and git over SSH reaches only what a tcp rule allows."""


@dataclass(frozen=True)
class InspectConfig:
    ca_dir: str | None = setting(None, string)
    """Where the filter keeps an interception CA of its own: made on its first start when
    there is none (ECDSA P-256, 180 days), replaced by `corral certs rotate`, which also
    gives every running session the new certificate. What the roles set. Or, instead:"""
    ca_cert: str | None = setting(None, readable)
    """The interception CA's certificate (PEM), made by `python -m appliance.pki intercept-ca`.
    With `ca_key`, TLS to a host the policy marks inspected is terminated by the filter with
    a leaf certificate this CA signs, and every request in it judged. Without them inspection
    is off: a host the policy marks inspected is denied, never tunnelled uninspected."""
    ca_key: str | None = setting(None, readable)
    """The CA's private key (PEM, unencrypted), readable by the filter's user alone."""
    upstream_ca: str | None = setting(None, readable)
    """CA certificates (PEM bundle) that inspected upstreams are verified against, instead of
    the system trust store. A certificate that fails is a denial with its reason."""
    leaf_cache: int = setting(1024, whole())
    """Leaf certificates kept, one per host, the least recently used dropped first (each with
    its TLS context: about 20 KB, so 20 MB at the default)."""
    mint_rate: float = setting(10.0, number())
    """Leaf certificates a second one session may have made for hosts not in the cache (a
    token bucket). Each costs about a millisecond, off the event loop, on one worker shared
    by every session; a flood of new names under an inspected wildcard is refused with an
    event beyond this, rather than queued ahead of the other sessions' hosts."""
    mint_burst: int = setting(50, whole())
    """New leaf certificates one session may have made at once above `mint_rate`."""
    scan_bytes: int = setting(SCAN_BYTES, whole())
    """The largest request body to an inspected host that is read for leaks (proxy/leaks.py):
    held whole, read, then sent. A larger one is refused (413) unless its host's [[inspect]]
    table says `scan = false`."""

    @property
    def enabled(self) -> bool:
        return self.ca_cert is not None or self.ca_dir is not None


@dataclass(frozen=True)
class FirewallConfig:
    manage: bool = setting(False, boolean)
    """Re-apply the ruleset whenever a session is registered or unregistered at run time.
    Off, a new session's traffic is dropped (not in any known subnet) until someone runs
    `corral-firewall apply`: closed either way."""
    interfaces: tuple[str, ...] = setting(("podman*",), interfaces)
    """Name patterns of the sandbox-facing interfaces (bridges); `*` only at the end. The
    role's default (corral_firewall_interfaces): podman 4.3 names session bridges podmanN."""
    log_group: int = setting(2713, whole())
    """NFLOG group that rejected packets are reported on (the filter reads it)."""
    log_rate: int = setting(20, whole())
    """Rejected packets reported per second and session (the counters count them all)."""
    learn_ttl_min: int = setting(60, whole())
    """Floor for how long a DNS-learned tcp allowance lasts, in seconds."""
    dns_packets: int = setting(2000, whole())
    """DNS datagrams a second one session may send the filter (a burst of twice as many);
    more are rejected by the kernel before they reach the filter, whose one process serves
    every session (and a fixed `IP:PORT` listener is one socket that every session shares:
    a flood would fill its receive queue and the kernel would drop every session's queries
    alike). Far above `[dns] rate`, which the filter answers with
    REFUSED first."""
    new_connections: int = setting(500, whole())
    """TCP connections a second one session may open to the filter's listeners (a burst of
    twice as many); more are reset by the kernel, before they wait in the listening
    queues every session shares. The kernel also resets one past the session's caps
    (`[proxy] max_connections_per_session` and `[dns] max_tcp`, with room for those
    closing)."""


@dataclass(frozen=True)
class AuditConfig:
    heads_every: int = setting(1000, whole(1))
    """The filter signs the audit log's head (appliance/filter/audit/heads.py) after this
    many records ..."""
    heads_interval: float = setting(60.0, number(0.1))
    """... or this many seconds after the last signed head, whichever comes first; never
    when the head has not moved. A rewrite of the log is caught at the last head a client
    kept: at most this long (or this many records) of history is unpinned."""
    appliance: str | None = setting(None, string)
    """The name signed into each head (default: the host's name)."""


@dataclass(frozen=True)
class EventsConfig:
    journal: bool = setting(False, boolean)
    """Every event to journald too, one entry each: the event as a JSON line and its fields
    as CORRAL_* (filter/journal.py; README, "Events in your log system"), for rsyslog, Vector,
    Fluent Bit or journald's own forwarding to carry. Off unless asked for (the role asks:
    journald runs on every appliance); a journal that is missing or full loses entries
    (counted in `status`), never slows the filter."""
    journal_socket: str = setting("/run/systemd/journal/socket", string)
    """journald's native socket."""


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
    dns: DnsConfig = field(default_factory=DnsConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    policy_files: tuple[str, ...] = setting((), paths, "policy.files")
    """The appliance layer: applies to every client."""
    state_dir: str = setting("/var/lib/corral-filter", string, "state.dir")
    """Runtime rules and the audit log live here."""
    audit_segment_bytes: int = setting(SEGMENT_BYTES, whole(4095),
                                       "state.audit_segment_bytes")
    """The audit log's active segment is rotated before it grows past this many bytes. 64 MiB
    (about 170,000 DNS denials of ~380 bytes): large enough that rotations are rare, small
    enough that retention drops an eighth of the log at a time and one segment verifies in
    under a second (0.7 s on the CI machine). Paging costs the same whatever the size: it
    bisects."""
    audit_segments: int = setting(SEGMENTS_KEPT, whole(1), "state.audit_segments")
    audit_events_per_session: int = setting(200, whole(), "state.audit_events_per_session")
    """Records a second one session may add to the audit log (ten seconds' worth at once);
    past that its events still reach `monitor`, and the log gets one record a second saying
    how many it did not get. An agent's busiest build stays well under it; a session
    flooding denials cannot push the log's history out of retention (a few MB a second
    otherwise: eight 64 MiB segments turned over in minutes)."""
    """Segments kept, the active one included; older ones are deleted. The log then takes
    at most segments times segment bytes: 8 x 64 MiB = 512 MiB, about 1.4 million records, or
    half an hour of the heaviest flood measured (9.7 MB in 30 s, issue 14) and far longer
    for ordinary work. `verify` reports a log whose oldest segments went this way as intact
    from the first record kept."""
    control_socket: str = setting("/run/corral-filter/control.sock", string, "control.socket")
    control_group: str | None = setting(None, group, "control.group")
    """A group that may use the control socket too (mode 0660): the admin API's user."""
    gateway: ipaddress.IPv4Address | None = setting(None, ipv4, "host.gateway")
    """What host.corral resolves to."""
    workers: int = setting(1, processes, "filter.workers")
    """Processes that serve the sessions' gateways, each session by one of them
    (filter/workers/); 1: the filter serves them itself, as one process."""
    worker_silence: float = setting(60.0, number(2), "filter.worker_silence")
    """Seconds a serving worker may go without answering its coordinator's beats (one a
    second; so more than 2) before it is taken for stuck, killed and started again; a change
    in flight to it has its own minute instead."""
    sessions: tuple[SessionConfig, ...] = ()
    firewall: FirewallConfig = field(default_factory=FirewallConfig)
    inspect: InspectConfig = field(default_factory=InspectConfig)
    sshgate: SshgateConfig = field(default_factory=SshgateConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    events: EventsConfig = field(default_factory=EventsConfig)

    @property
    def audit_path(self) -> Path:
        return Path(self.state_dir) / "audit.jsonl"


TABLES = {"dns": DnsConfig, "proxy": ProxyConfig, "firewall": FirewallConfig,
          "inspect": InspectConfig, "sshgate": SshgateConfig, "audit": AuditConfig,
          "events": EventsConfig}
"""The tables that are a dataclass of their own; FilterConfig's fields name their keys."""
EXTRA_KEYS = {"dns": {"upstream_from"}, "session": {"name", "subnet", "files", "gateway"}}
"""Keys that are not a field of their own."""


def schema() -> dict[str, set[str]]:
    """Every table and its keys, from the fields: what parse_config accepts (and
    tests/unit/test_docs.py holds the reference to)."""
    schema: dict[str, set[str]] = {t: {f.name for f in dataclasses.fields(c)}
                                   for t, c in TABLES.items()}
    for f in dataclasses.fields(FilterConfig):
        if f.metadata.get("key"):
            table, key = f.metadata["key"].split(".")
            schema.setdefault(table, set()).add(key)
    for table, keys in EXTRA_KEYS.items():
        schema.setdefault(table, set()).update(keys)
    return schema


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
    accepted = schema()

    def failer(table: str, key: str) -> Fail:
        def fail(message: str, value=None):
            line = where.value(table, value) if value is not None else None
            raise ConfigError(path, f"[{table}] {key}" if key else f"[{table}]", message,
                              line or where.key(table, key))
        return fail

    for table, value in data.items():
        if table not in accepted:
            raise ConfigError(path, table, f"unknown key; expected {', '.join(sorted(accepted))}",
                              where.key("", table))
        tables = value if table == "session" else [value]
        if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
            raise ConfigError(path, table, "must be a table" + (" array ([[session]])"
                              if table == "session" else ""), where.key("", table))
        for t in tables:
            for key in t:
                if key not in accepted[table]:
                    expected = ", ".join(sorted(accepted[table]))
                    failer(table, key)(f"unknown key; expected {expected}")

    def read(cls, table: str | None, **given):
        """`cls` with each field the file sets read through its checker; the rest default."""
        values = dict(given)
        for f in dataclasses.fields(cls):
            if f.name in values or "check" not in f.metadata:
                continue
            section, key = (f.metadata["key"] or f"{table}.{f.name}").split(".")
            if key in data.get(section, {}):
                fail = failer(section, key)
                values[f.name] = f.metadata["check"](data[section][key],
                                                     lambda m, v=None, fail=fail: fail(m, v))
        return cls(**values)

    dns_table = data.get("dns", {})
    upstream = None
    if "upstream_from" in dns_table:
        fail = failer("dns", "upstream_from")
        if "upstream" in dns_table:
            fail("give upstream or upstream_from, not both")
        upstream = _resolv_conf(string(dns_table["upstream_from"], fail), fail)
    dns = read(DnsConfig, "dns", **({"upstream": upstream} if upstream is not None else {}))
    if dns.ttl_min > dns.ttl_max:
        failer("dns", "ttl_min")(f"{dns.ttl_min} is larger than ttl_max {dns.ttl_max}")
    if dns.listen and not dns.upstream:
        failer("dns", "upstream")("DNS listens but has no upstream resolver to forward to")
    firewall = read(FirewallConfig, "firewall")
    if firewall.log_group > 65535:
        failer("firewall", "log_group")("must be at most 65535")

    inspect = read(InspectConfig, "inspect")
    if (inspect.ca_cert is None) != (inspect.ca_key is None):
        failer("inspect", "ca_key" if inspect.ca_key is None else "ca_cert")(
            "ca_cert and ca_key go together: give both (inspection on) or neither (off)")
    if inspect.ca_dir is not None and inspect.ca_cert is not None:
        failer("inspect", "ca_dir")("give ca_dir (the filter keeps its own CA there) or "
                                    "ca_cert and ca_key (a CA made by hand), not both")

    sessions: list[SessionConfig] = []
    for entry in data.get("session", []):
        try:
            files = paths(entry.get("files", []), failer("session", "files"))
            sessions.append(make_session(entry.get("name"), entry.get("subnet"),
                                         entry.get("gateway"), files, sessions))
        except SessionError as exc:
            failer("session", exc.key)(str(exc), exc.value)

    config = read(FilterConfig, None, path=path, dns=dns, proxy=read(ProxyConfig, "proxy"),
                  sessions=tuple(sessions), firewall=firewall, inspect=inspect,
                  sshgate=read(SshgateConfig, "sshgate"), audit=read(AuditConfig, "audit"),
                  events=read(EventsConfig, "events"))
    if inspect.ca_dir is not None:
        ca_dir, state_dir = Path(inspect.ca_dir), Path(config.state_dir)
        if not ca_dir.is_absolute() or ca_dir == state_dir or ca_dir in state_dir.parents:
            failer("inspect", "ca_dir")(f"{inspect.ca_dir} must be an absolute directory of "
                                        "its own (a rotation clears old CAs out of it), not "
                                        "the state directory or one above it")
    return config


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
    if not isinstance(item, str):
        fail(f"{item!r} is not a \"host:port\" string")
    try:
        host, port = split_host_port(item)
    except HostNameError as exc:
        fail(str(exc))
    if not port or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        fail(f"{item!r} needs a port number, as in 127.0.0.1:53")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        fail(f"{item!r}: listen and upstream addresses must be IP addresses, not names")
    return host, int(port)
