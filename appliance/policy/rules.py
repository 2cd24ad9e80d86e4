"""Rules: what a line of policy says, parsed once into a frozen, typed value.

A rule's text is its identity: `Rule.parse("http", "API.example.com:443")` and
`Rule.parse("http", "api.example.com:443")` are the same rule, so revoking by the text
`corral rules` printed always finds it.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from dataclasses import dataclass, field
from functools import lru_cache

from .git import GitRuleError, GitSpec, parse_rule_text
from .names import Host, HostNameError, normalise_name, parse_address, parse_host, split_host_port
from .patterns import PatternError, RequestSpec

KINDS = ("dns", "http", "tcp", "cidr", "host", "deny", "inspect", "request", "git", "approval")
"""dns: a name DNS answers. http: host[:port] the proxy reaches. tcp: host:port reached
directly (nftables set filled from DNS answers). cidr: a blocked range made reachable.
host: a port of the VM host reachable as host.corral. deny: a name (and its subdomains),
`*.suffix` (the subdomains) or an IP literal (that address) that wins over allows.
inspect: a host (name, `*.suffix` or IP literal) whose TLS the filter terminates, so that
its requests can be judged; it does not allow the host (that stays with http).
request: a method and path on an inspected host — `HOST METHOD /path` allows,
`!HOST METHOD /path` denies (deny wins), `HOST nothing` is an empty allow list.
git: `HOST REPO [REF ...]`, a repository git may fetch and push to over smart HTTP, and
the refs a push may write (git.py); it makes its host inspected too.

Why two kinds and a `!` rather than one kind per table or a kind per polarity: a rule's
text is its identity, so each pattern is a rule of its own that `corral rules` prints,
`corral revoke` removes and `dedupe` folds, one line each; the host leads the text, so
the same pattern on two hosts is two rules; and the `!` puts allow and deny of the same
pattern under one kind with different texts, so revoking by text alone is never
ambiguous. A request rule makes its host inspected by itself (a deny that nothing
enforces would be a silent hole); the `inspect` rule says so for a table with no pattern,
and heads the table's rules in `corral rules`."""

LAYERS = ("default", "appliance", "project", "session")
"""From the outside in: built-in defaults, appliance-wide (Ansible), project file
(corral.toml), session runtime additions (CLI/API)."""
HOLD_DEFAULT = 60
"""Seconds a request denied in ask mode waits for a person's decision."""
HOLD_MAX = 600
"""The longest hold an approval rule may ask for."""

HTTP_DEFAULT_PORTS = frozenset({80, 443})
MAX_TCP_PORTS = 256
ALL_PORTS = None  # a PortSpec whose `ports` is None matches every port


class RuleError(ValueError):
    """A rule that cannot be parsed; the message names the rule and what is wrong."""


@lru_cache(maxsize=1024)
def _glob_ports(pattern: str) -> frozenset[int]:
    # Expanded once per distinct glob, so a decision is a set lookup, never a match.
    return frozenset(p for p in range(1, 65536) if fnmatch.fnmatchcase(str(p), pattern))


@dataclass(frozen=True, slots=True)
class PortSpec:
    """Which ports a rule covers."""

    text: str
    """As written: `443`, `8*`, `*`, or empty for the kind's default."""
    ports: frozenset[int] | None = field(repr=False)
    """The ports covered; None covers every port."""

    @classmethod
    def parse(cls, text: str | None, default: frozenset[int] | None) -> PortSpec:
        if text is None or text == "":
            return cls("", default)
        if text == "*":
            return cls("*", ALL_PORTS)
        if text.isascii() and text.isdigit():
            port = int(text)
            if not 1 <= port <= 65535:
                raise RuleError(f"port {text} is outside 1-65535")
            return cls(str(port), frozenset({port}))
        if text.isascii() and all(c.isdigit() or c in "*?[]-" for c in text):
            ports = _glob_ports(text)
            if not ports:
                raise RuleError(f"port pattern {text!r} matches no port in 1-65535")
            return cls(text, ports)
        raise RuleError(f"port {text!r} is not a number, a glob such as '8*', or '*'")

    def covers(self, port: int) -> bool:
        return self.ports is None or port in self.ports


@dataclass(frozen=True, slots=True)
class Rule:
    """One allow or deny, remembering where it came from."""

    kind: str
    """One of KINDS."""
    host: str
    """Normalised name, `*.suffix` wildcard, IP literal, or CIDR (kind `cidr`); empty for `host`."""
    port: PortSpec = field(default_factory=lambda: PortSpec("", None))
    """Ports covered (http, tcp, host); empty text for dns, cidr and deny."""
    layer: str = "session"
    """One of LAYERS."""
    source: str = ""
    """Where it was written: a file path, `preset:NAME`, or `api`."""
    request: RequestSpec | None = None
    """The requests a `request` rule covers (and whether it denies them); None otherwise."""
    git: GitSpec | None = None
    """The repository and refs of a `git` rule; None otherwise."""
    unscanned: bool = False
    """An `inspect` rule written `HOST unscanned` (`scan = false`): request bodies to the
    host are not read for leaks."""
    setting: str = ""
    """An `approval` rule's text: `ask` (hold denied requests for a person, HOLD_DEFAULT
    seconds), `ask SECONDS`, `deny` (deny at once, the default), or `open` (learning: what a
    person could approve is allowed and recorded; a session's runtime layer only)."""
    text: str = field(init=False, compare=False, repr=False)
    """The rule as a user writes it (and as `corral revoke` accepts it); computed once."""

    def __post_init__(self):
        if self.kind == "host":
            text = self.port.text
        elif self.kind == "approval":
            text = self.setting
        else:
            host = f"[{self.host}]" if ":" in self.host and self.kind != "cidr" else self.host
            text = f"{host}:{self.port.text}" if self.port.text else host
            if self.request is not None:
                text = f"{'!' if self.request.deny else ''}{host} {self.request.text}"
            elif self.git is not None:
                text = f"{host} {self.git.text}"
            elif self.unscanned:
                text = f"{host} unscanned"
        object.__setattr__(self, "text", text)

    @property
    def wildcard(self) -> bool:
        return self.host.startswith("*.")

    @property
    def suffix(self) -> str:
        """For `*.example.com`: `example.com`; for an exact name: the name itself."""
        return self.host[2:] if self.wildcard else self.host

    def key(self) -> tuple[str, str]:
        """Identity within a layer: kind and text."""
        return (self.kind, self.text)

    def to_json(self) -> dict:
        return {"kind": self.kind, "rule": self.text, "layer": self.layer, "source": self.source}

    @classmethod
    def parse(cls, kind: str, text: str, layer: str = "session", source: str = "") -> Rule:
        """Parse `text` as a rule of `kind`; raises RuleError naming what is wrong."""
        if kind not in KINDS:
            raise RuleError(f"unknown rule kind {kind!r}; expected one of {', '.join(KINDS)}")
        if layer not in LAYERS:
            raise RuleError(f"unknown layer {layer!r}; expected one of {', '.join(LAYERS)}")
        if not isinstance(text, str | int) or isinstance(text, bool):
            raise RuleError(f"{kind} rule must be a string, not {type(text).__name__}")
        text = str(text).strip()
        try:
            return getattr(cls, f"_parse_{kind}")(text, layer, source)
        except HostNameError as exc:
            raise RuleError(str(exc)) from None

    @property
    def hold(self) -> float | None:
        """An `approval` rule's hold in seconds; None for `deny`."""
        words = self.setting.split()
        if words[:1] != ["ask"]:
            return None
        return float(words[1]) if len(words) > 1 else HOLD_DEFAULT

    @classmethod
    def _parse_approval(cls, text: str, layer: str, source: str) -> Rule:
        words = text.split()
        if words == ["deny"] or words == ["ask"]:
            return cls("approval", "", layer=layer, source=source, setting=words[0])
        if words == ["open"]:
            if layer != "session":
                raise RuleError("approval 'open' (learning: allow what the default denies, "
                                "and record it) is only for a running session, given by a "
                                "person: `corral run --learn=open`; never in a file")
            return cls("approval", "", layer=layer, source=source, setting="open")
        if len(words) == 2 and words[0] == "ask" and re.fullmatch(r"[0-9]+s?", words[1]):
            seconds = int(words[1].removesuffix("s"))
            if 1 <= seconds <= HOLD_MAX:
                return cls("approval", "", layer=layer, source=source,
                           setting=f"ask {seconds}")
        raise RuleError(f"approval rule {text!r}: expected 'deny', 'ask', 'ask SECONDS' "
                        f"(1-{HOLD_MAX}: how long a denied request waits for a person) or "
                        "'open' (learning, a session's runtime layer only)")

    @classmethod
    def _parse_dns(cls, text: str, layer: str, source: str) -> Rule:
        return cls("dns", _pattern(text), PortSpec("", None), layer, source)

    @classmethod
    def _parse_deny(cls, text: str, layer: str, source: str) -> Rule:
        host, port = split_host_port(text)
        if port is not None:
            raise RuleError(f"deny {text!r}: a deny names a host for every port; drop ':{port}'")
        address = parse_address(host)
        pattern = str(address) if address is not None else _pattern(host)
        return cls("deny", pattern, PortSpec("", None), layer, source)

    @classmethod
    def _parse_http(cls, text: str, layer: str, source: str) -> Rule:
        host, port = split_host_port(text)
        return cls("http", _host_pattern(host), PortSpec.parse(port, HTTP_DEFAULT_PORTS),
                   layer, source)

    @classmethod
    def _parse_tcp(cls, text: str, layer: str, source: str) -> Rule:
        host, port = split_host_port(text)
        if not port:
            raise RuleError(f"tcp rule {text!r} needs a port, e.g. {host}:22")
        spec = PortSpec.parse(port, None)
        if spec.ports is None or len(spec.ports) > MAX_TCP_PORTS:
            raise RuleError(f"tcp rule {text!r}: name the ports (a number, or a glob covering at "
                            f"most {MAX_TCP_PORTS}); each one becomes a firewall set element")
        return cls("tcp", _host_pattern(host), spec, layer, source)

    @classmethod
    def _parse_inspect(cls, text: str, layer: str, source: str) -> Rule:
        words = text.split()
        if len(words) > 1 and (words[1] == "*" or words[1].isupper()):
            raise RuleError(f"inspect rule {text!r} names a host only; a method and path make "
                            "a request rule ('HOST METHOD /path')")
        if len(words) == 2 and words[1] == "unscanned":
            return cls("inspect", _inspected_host(words[0]), PortSpec("", None), layer, source,
                       unscanned=True)
        return cls("inspect", _inspected_host(text), PortSpec("", None), layer, source)

    @classmethod
    def _parse_request(cls, text: str, layer: str, source: str) -> Rule:
        deny = text.startswith("!")
        words = text[1:].split(None, 1) if deny else text.split(None, 1)
        if len(words) != 2:
            raise RuleError(f"request rule {text!r} is not 'HOST METHOD /path' ('!HOST METHOD "
                            "/path' to deny, 'HOST nothing' for an empty allow list)")
        try:
            spec = RequestSpec.parse(words[1], deny)
        except PatternError as exc:
            raise RuleError(f"request rule {text!r}: {exc}") from None
        return cls.for_request(_inspected_host(words[0]), spec, layer, source)

    @classmethod
    def for_request(cls, host: str, spec: RequestSpec, layer: str = "session",
                    source: str = "") -> Rule:
        """The request rule for an already parsed host pattern and spec."""
        return cls("request", host, PortSpec("", None), layer, source, spec)

    @classmethod
    def _parse_git(cls, text: str, layer: str, source: str) -> Rule:
        try:
            host, spec = parse_rule_text(text)
        except GitRuleError as exc:
            raise RuleError(str(exc)) from None
        return cls.for_git(_inspected_host(host), spec, layer, source)

    @classmethod
    def for_git(cls, host: str, spec: GitSpec, layer: str = "session", source: str = ""
                ) -> Rule:
        """The git rule for an already parsed host pattern and spec."""
        return cls("git", host, PortSpec("", None), layer, source, None, spec)

    @classmethod
    def _parse_cidr(cls, text: str, layer: str, source: str) -> Rule:
        try:
            network = ipaddress.ip_network(text, strict=False)
        except ValueError as exc:
            raise RuleError(f"cidr {text!r} is not a network such as 203.0.113.0/24: {exc}"
                            ) from None
        if network.prefixlen == 0:
            raise RuleError(f"cidr {text!r} would make every address reachable; name a range")
        return cls("cidr", str(network), PortSpec("", None), layer, source)

    @classmethod
    def _parse_host(cls, text: str, layer: str, source: str) -> Rule:
        if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:
            raise RuleError(f"host port {text!r} must be a number in 1-65535")
        return cls("host", "", PortSpec.parse(text, None), layer, source)


def _pattern(text: str) -> str:
    """A name or `*.suffix` wildcard, normalised. A wildcard never covers a bare TLD."""
    if text.startswith("*."):
        suffix = normalise_name(text[2:])
        if "." not in suffix:
            raise RuleError(f"{text!r} would allow a whole top-level domain; name a domain")
        return "*." + suffix
    if "*" in text:
        raise RuleError(f"{text!r}: '*' may only stand alone as the first label,"
                        " as in *.example.com")
    return normalise_name(text)


def _inspected_host(text: str) -> str:
    """The host of an inspect or request rule: a name pattern or IP literal, every port."""
    host, port = split_host_port(text)
    if port is not None:
        raise RuleError(f"{text!r}: an inspected host is inspected on every port its http "
                        f"rules allow; drop ':{port}'")
    return _host_pattern(host)


def _host_pattern(text: str) -> str:
    """A name pattern or an IP literal (which names exactly that address)."""
    if "*" not in text:
        host: Host = parse_host(text)
        if host.address is not None:
            return str(host.address)
    return _pattern(text)


def overlap(a: Rule, b: Rule) -> bool:
    """Some name both rules' host patterns cover (ports aside). An exact name covers
    itself (and, for a deny, its subdomains too), `*.suffix` the names under the suffix,
    an IP literal that address only; `corral check` and `corral learn` ask it, never a
    decision (those walk a name's labels)."""
    (base_a, own_a, below_a), (base_b, own_b, below_b) = _extent(a), _extent(b)
    if base_a == base_b:
        return (own_a and own_b) or (below_a and below_b)
    if base_a.endswith("." + base_b):
        return below_b
    if base_b.endswith("." + base_a):
        return below_a
    return False


def _extent(rule: Rule) -> tuple[str, bool, bool]:
    """(base name, covers the base itself, covers the names under it)."""
    if rule.wildcard:
        return rule.suffix, False, True
    literal = parse_address(rule.host) is not None
    return rule.host, True, rule.kind == "deny" and not literal
