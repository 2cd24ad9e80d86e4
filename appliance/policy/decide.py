"""A compiled policy and the pure decisions made against it.

`Policy(rules)` builds hash lookups once: exact names, and wildcard suffixes keyed by the
suffix. Deciding walks the name's labels (O(labels)), never the rules. A deny anywhere, in
any layer, wins over every allow (DESIGN: exceptions inside wildcards), and a denied name
takes its subdomains with it: denying `s3.amazonaws.com` under a `*.amazonaws.com` allow
also denies `bucket.s3.amazonaws.com` (a deny of `*.x` covers the subdomains only, a deny
of an IP literal that address only). When several allows match, the most specific one is
reported — exact before wildcard, a narrower wildcard before
a broader one, an inner layer (session) before an outer one (default) — so that `monitor`
names the rule a person would point at.

Inspected hosts (`[[inspect]]` and `[[git]]`, kinds `inspect`, `request` and `git`) are
compiled here too, into `inspection.Inspections`: `Policy.inspection(host)` answers whether
the filter terminates a host's TLS, and the Inspection it returns judges each request there;
`Policy.git(host)` the repositories and refs git may reach there (git.py).
"""

from __future__ import annotations

import ipaddress
from collections import defaultdict
from collections.abc import Iterable
from typing import NamedTuple

from .decision import Decision
from .git import GitAccess, GitHosts
from .grants import approvable, rule_text
from .inspection import Inspection, Inspections
from .names import PLACEHOLDER_MARK, Host, IPAddress, parse_address, unmap
from .ranges import blocked_range
from .rules import LAYERS, Rule

HOST_NAME = "host.corral"
"""The name under which a session reaches the VM host's allowed ports."""
MEMO_MAX = 4096
"""Decisions a Policy remembers (then it starts again): an agent asks for the same few
hosts over and over, and a remembered answer costs a dict lookup, not a walk and a
formatted reason."""


_Index = dict[str, tuple[Rule, ...]]


def _index(rules: Iterable[Rule], subtree: bool = False) -> tuple[_Index, _Index]:
    """Split rules into exact-name and wildcard-suffix lookups, inner layers first.

    With `subtree` (denies), a rule naming a host name covers its subdomains too: it is
    also filed as a suffix, so the same label walk finds it, still O(labels)."""
    exact: dict[str, list[Rule]] = defaultdict(list)
    wild: dict[str, list[Rule]] = defaultdict(list)
    for rule in rules:
        (wild[rule.suffix] if rule.wildcard else exact[rule.host]).append(rule)
        if subtree and not rule.wildcard and parse_address(rule.host) is None:
            wild[rule.host].append(rule)
    order = {layer: -i for i, layer in enumerate(LAYERS)}

    def freeze(d):
        return {k: tuple(sorted(v, key=lambda r: order[r.layer])) for k, v in d.items()}

    return freeze(exact), freeze(wild)


class _Denied(NamedTuple):
    """A key some deny rule is filed under, in a merged index."""

    deny: Rule
    allows: tuple[Rule, ...]


_Judged = dict[str, "tuple[Rule, ...] | _Denied"]
"""A key (a name, an IP literal, a wildcard suffix) -> the allow rules filed under it, inner
layers first; or, where a deny is filed too, `_Denied` (the deny, and those allows). The
allows' own tuples, shared with nothing copied: most keys are allows alone."""


def _judged(deny: tuple[_Index, _Index], allow: tuple[_Index, _Index]
            ) -> tuple[_Judged, _Judged]:
    """The deny index and one kind's allow index, merged by key: a decision then walks a
    name's labels once, asking at each step for both (the first decision for a host is the
    one that walks; `Policy._memo` answers the rest)."""
    merged = []
    for denies, allows in zip(deny, allow, strict=True):
        judged: _Judged = dict(allows)
        for key, rules in denies.items():  # a few, against the allows' many
            judged[key] = _Denied(rules[0], allows.get(key, ()))
        merged.append(judged)
    return merged[0], merged[1]


def _allows(exact: _Judged, wild: _Judged, host: Host) -> list[Rule]:
    """The allow rules of a merged index whose pattern matches `host`, most specific first
    (denies not asked: the caller does). O(labels)."""
    found: list[Rule] = []
    entry = exact.get(host.key)
    if entry is not None:
        found.extend(entry.allows if entry.__class__ is _Denied else entry)
    name = host.name
    if name is not None:
        dot = name.find(".")
        while dot >= 0:
            name = name[dot + 1 :]
            entry = wild.get(name)
            if entry is not None:
                found.extend(entry.allows if entry.__class__ is _Denied else entry)
            dot = name.find(".")
    return found


def _judge(exact: _Judged, wild: _Judged, host: Host, port: int | None
           ) -> tuple[Rule | None, Rule | None, bool]:
    """One walk of `host`'s labels: (the most specific deny rule covering it; else the most
    specific allow rule covering `port` (None: any port); whether an allow rule matched the
    name on other ports only). A deny anywhere wins, so the walk goes on after an allow."""
    allow, other_ports = None, False
    entry = exact.get(host.key)
    if entry is not None:
        if entry.__class__ is _Denied:
            return entry.deny, None, False
        for rule in entry:
            ports = rule.port.ports
            if port is None or ports is None or port in ports:
                allow = rule
                break
            other_ports = True
    name = host.name
    if name is not None:
        dot = name.find(".")
        while dot >= 0:
            name = name[dot + 1 :]
            entry = wild.get(name)
            if entry is not None:
                if entry.__class__ is _Denied:
                    return entry.deny, None, False
                if allow is None:
                    for rule in entry:
                        ports = rule.port.ports
                        if port is None or ports is None or port in ports:
                            allow = rule
                            break
                        other_ports = True
            dot = name.find(".")
    return None, allow, other_ports


def _first(exact: _Index, wild: _Index, host: Host) -> Rule | None:
    """The most specific matching rule, without building the list (the deny check)."""
    rules = exact.get(host.key)
    if rules:
        return rules[0]
    name = host.name
    if name is not None:
        dot = name.find(".")
        while dot >= 0:
            name = name[dot + 1 :]
            rules = wild.get(name)
            if rules:
                return rules[0]
            dot = name.find(".")
    return None


class Policy:
    """Rules compiled into lookup structures. Immutable: a change builds a new Policy."""

    __slots__ = ("_deny", "_git", "_inspect", "_judged", "_memo", "approval", "cidrs",
                 "host_ports", "rules")

    def __init__(self, rules: Iterable[Rule] = ()):
        self.rules: tuple[Rule, ...] = tuple(rules)
        self._memo: dict[tuple, Decision] = {}
        """Decisions already made: a Policy never changes, so neither do they."""
        by_kind: dict[str, list[Rule]] = defaultdict(list)
        for rule in self.rules:
            by_kind[rule.kind].append(rule)
        self._deny = _index(by_kind["deny"], subtree=True)
        # DNS answers every name some rule lets a client reach (issue: "a name allowed by
        # an http or tcp rule is also answered by DNS").
        self._judged = {kind: _judged(self._deny, _index(rules)) for kind, rules in (
            ("http", by_kind["http"]), ("tcp", by_kind["tcp"]),
            ("dns", by_kind["dns"] + by_kind["http"] + by_kind["tcp"]))}
        """Each kind's allows merged with the denies: what a decision walks, and the one
        index of them kept."""
        self._inspect = Inspections(by_kind["inspect"] + by_kind["request"] + by_kind["git"])
        self._git = GitHosts(by_kind["git"])
        self.cidrs: tuple[tuple[object, Rule], ...] = tuple(
            (ipaddress.ip_network(r.host), r) for r in by_kind["cidr"]
        )
        self.approval: Rule | None = max(
            by_kind["approval"], key=lambda r: LAYERS.index(r.layer), default=None)
        """The approval rule in force: the most specific layer's (the last one written in
        it); None, like `deny`, denies at once."""
        if self.approval is not None:
            last = [r for r in by_kind["approval"] if r.layer == self.approval.layer][-1]
            self.approval = last
        self.host_ports: dict[int, Rule] = {}
        for rule in sorted(by_kind["host"], key=lambda r: -LAYERS.index(r.layer)):
            for port in rule.port.ports or ():
                self.host_ports.setdefault(port, rule)

    def __len__(self) -> int:
        return len(self.rules)

    @property
    def learning_open(self) -> bool:
        """`corral run --learn=open`: what a person could approve is allowed, and recorded
        as learned (the decision keeps the command that would allow it)."""
        return self.approval is not None and self.approval.setting == "open"

    def _learned(self, decision: Decision) -> Decision:
        """In learning-open mode, a denial a person could approve becomes an allowance that
        carries its hint (the only allowed decisions that do: events mark them learned).
        Deny rules, placeholders, IP literals and the appliance's names stay denied, and a
        name's addresses are still checked against the blocked ranges when dialled."""
        if decision.allowed or not self.learning_open or not approvable(decision):
            return decision
        return Decision(True, f"learning (open): {decision.reason}; allowed and recorded "
                        "for `corral learn`", None, decision.hint)

    @property
    def hold(self) -> float | None:
        """Seconds a request denied by the default waits for a person (ask mode); None:
        denied at once."""
        return self.approval.hold if self.approval is not None else None

    # -- decisions ---------------------------------------------------------------------

    def denied_by(self, host: Host) -> Rule | None:
        """The deny rule covering `host` (the name itself or a parent it names), if any."""
        return _first(*self._deny, host)

    def _remember(self, key: tuple, decision: Decision) -> Decision:
        if len(self._memo) >= MEMO_MAX:
            self._memo.clear()
        self._memo[key] = decision
        return decision

    def inspection(self, host: Host) -> Inspection | None:
        """The host's request rules if it is inspected (TLS terminated, each request judged
        by `Inspection.decide`); None if it is not (its TLS is spliced, never terminated).
        Says nothing about whether the host may be reached: ask `decide_http` first."""
        return self._inspect.lookup(host)

    def inspected(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """What the policy inspects: (exact names and IP literals, as rules key them;
        wildcard suffixes, `example.org` for `*.example.org`)."""
        return self._inspect.patterns

    def git(self, host: Host) -> GitAccess | None:
        """The repositories git may reach on `host` and the refs it may push there; None
        when no git rule names the host (its git requests are then judged as any other)."""
        return self._git.lookup(host) if self._git else None

    def decide_dns(self, host: Host) -> Decision:
        """May a client learn this name's addresses? Denied names are never sent upstream."""
        key = ("dns", host.name, host.key)
        decision = self._memo.get(key)
        if decision is None:
            decision = self._remember(key, self._learned(self._decide_dns(host)))
        return decision

    def _decide_dns(self, host: Host) -> Decision:
        if host.name is not None and PLACEHOLDER_MARK in host.name:
            return _placeholder(host)
        deny, rule, _ = _judge(*self._judged["dns"], host, None)
        if deny is not None:
            return _denied_by_rule(host, deny)
        if rule is not None:
            return Decision(True, f"{host.key} allowed by {rule.kind} rule {rule.text}", rule)
        return Decision(False, f"name {host.key} is not in the policy", None,
                        f"corral allow-dns {host.key}")

    def decide_http(self, host: Host, port: int) -> Decision:
        """May the proxy connect to host:port (CONNECT, absolute URI, Host header, SNI)?"""
        return self._decide_port(host, port, "http")

    def decide_tcp(self, host: Host, port: int) -> Decision:
        """May a client reach host:port directly (non-HTTP protocols, learned from DNS)?"""
        return self._decide_port(host, port, "tcp")

    def tcp_rules(self, host: Host) -> list[Rule]:
        """The tcp rules that cover `host` (unless denied): what DNS answers teach nftables."""
        if self.denied_by(host) is not None:
            return []
        return _allows(*self._judged["tcp"], host)

    def decide_address(self, address: IPAddress, host: Host | None = None,
                       port: int | None = None, kind: str = "http") -> Decision:
        """May the proxy dial this address, or DNS hand it out? Blocked ranges need a rule.

        `host` is what the client asked for; `port` the port it asked for (None for a DNS
        answer); `kind` which rules name ports ("http" for the proxy, "tcp" for direct).
        A public address is allowed; a blocked one only by a cidr rule covering it, or by
        an http/tcp rule naming that very literal when the client asked for the literal
        itself, on a port that rule covers. A *name* that resolves into a blocked range is
        never opened by a rule naming the address: that rule opens the address, for its
        ports, and nothing that happens to point at it (a CDN's shared or a rebinding name).
        """
        if kind not in ("http", "tcp"):
            raise ValueError(f"kind must be http or tcp, not {kind!r}")
        address = unmap(address)
        network = blocked_range(address)
        if network is None:
            return Decision(True, f"{address} is a public address")
        for cidr, rule in self.cidrs:
            if address.version == cidr.version and address in cidr:
                return Decision(True, f"{address} allowed by cidr rule {rule.text}", rule)
        if port is not None and host is not None and host.address is not None and (
                unmap(host.address) == address):
            rule = self._literal_rule(address, port, kind)
            if rule is not None:
                target = f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"
                return Decision(True, f"{target} named by {kind} rule {rule.text}", rule)
        via = f" ({host} resolved to it)" if host is not None and host.name is not None else ""
        return Decision(False, f"{address} is in blocked range {network}{via}", None,
                        f"add \"{address}/{address.max_prefixlen}\" to [cidr] allow in corral.toml"
                        " if it is meant")

    def _literal_rule(self, address: IPAddress, port: int, kind: str) -> Rule | None:
        """The `kind` rule naming this IP literal on `port`, unless a deny names it."""
        literal = Host(address=address)
        if self.denied_by(literal) is not None:
            return None
        return next((r for r in _allows(*self._judged[kind], literal) if r.port.covers(port)),
                    None)

    def decide_host_port(self, port: int) -> Decision:
        """May a client reach the VM host (host.corral) on this port?"""
        rule = self.host_ports.get(port)
        if rule is not None:
            return Decision(True, f"{HOST_NAME}:{port} allowed by host rule", rule)
        return Decision(False, f"{HOST_NAME}:{port} is not a listed host port", None,
                        f"add {port} to [host] ports in corral.toml")

    def _decide_port(self, host: Host, port: int, kind: str) -> Decision:
        # the hot path of every connection: memo first, then one walk; written out flat
        # (each call saved is a tenth of a microsecond of a first decision)
        key = (kind, host.name, host.key, port)
        memo = self._memo
        decision = memo.get(key)
        if decision is not None:
            return decision
        if host.name is not None and PLACEHOLDER_MARK in host.name:
            decision = _placeholder(host)
        else:
            exact, wild = self._judged[kind]
            deny, rule, other_ports = _judge(exact, wild, host, port)
            if rule is not None:
                decision = Decision(True, f"{host.key}:{port} allowed by {kind} rule "
                                    f"{rule.text}", rule)
            elif deny is not None:
                decision = _denied_by_rule(host, deny)
            else:
                decision = self._not_allowed(host, port, kind, other_ports)
        if kind == "http" and not decision.allowed:  # learning opens names and the proxy,
            decision = self._learned(decision)       # never the firewall
        if len(memo) >= MEMO_MAX:
            memo.clear()
        memo[key] = decision
        return decision

    def _not_allowed(self, host: Host, port: int, kind: str, other_ports: bool) -> Decision:
        """The default denial, with the command that would allow it."""
        if other_ports:
            reason = f"{host} is allowed, but not on port {port}"
        elif host.address is not None:
            reason = f"IP literal {host.key} is not named by any {kind} rule"
        else:
            reason = f"{host.key} is not in the {kind} policy"
            if kind == "http" and self._inspect and self.inspection(host) is not None:
                reason += " (an [[inspect]] table does not allow a host; [http] allow does)"
        return Decision(False, reason, None,
                        f"corral allow-{kind} {rule_text(kind, host.key, port)}")

    def to_json(self) -> list[dict]:
        return [rule.to_json() for rule in self.rules]


def _placeholder(host: Host) -> Decision:
    """No rule opens a name that carries a secret's placeholder: that is a way out for it."""
    return Decision(False, "a name that carries a corral secret placeholder: a placeholder "
                    "goes only to its secret's hosts, in its header")


def _denied_by_rule(host: Host, rule: Rule) -> Decision:
    return Decision(False, f"{host} denied by deny rule {rule.text} ({rule.layer} layer)", rule,
                    f"corral revoke deny {rule.text}" if rule.layer == "session"
                    else f"remove deny {rule.text} from the {rule.layer} layer ({rule.source})")

