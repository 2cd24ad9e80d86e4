"""Inspected hosts and the requests they let through, compiled once per policy.

A host is inspected when an `inspect`, `request` or `git` rule covers it (by exact name,
IP literal or `*.suffix`, as other rules do; a git rule adds no request pattern).
Inspection does not allow the host: the http policy still decides whether it is reached at
all, and the filter asks `decide_http` first. For one host, every covering rule counts,
from every table, layer and preset:

- **Deny wins.** Any deny pattern that matches refuses the request, whatever allows it.
- **Allows add up.** The host's allow list is the union of every covering table's `allow`.
- **An allow list anywhere restricts.** If no covering table has an `allow` key, every
  request that no deny matches passes (inspection for credentials or git alone). If any
  has one — even `allow = []`, kept as the rule `HOST nothing` — a request needs an allow
  pattern. A table without `allow` thus never widens what another table restricts: it
  adds denies and nothing else. (So a team cannot narrow a preset's allows by adding
  narrower ones next to it; it copies the preset's tables instead.)
- **Nothing to evade, nothing refused.** A host with no request rule at all lets every
  request through unread. Once it has one, a target that servers read in different ways
  (`targets.py`) is refused, as are a method that is not an HTTP token, the asterisk-form
  `OPTIONS *` (it names no path for a rule to judge) and a target not in origin-form
  (the filter passes the path it sends upstream; anything else is a wiring mistake, and a
  mistake denies).
- **Every reading.** A target that servers read in more than one way (`targets.py`: an
  encoded slash, an escaped `@` or `:`, Unicode a server normalises) is judged under each:
  a deny that matches any reading denies; an allow must hold under all, else the request
  is refused, the reason naming the reading it does not hold under.
- **Format suffixes.** A deny covers its path with a `.suffix` on the last segment
  (`patterns.py`: Rails and Grape route `/gists.json` as `/gists`); an allow does not.

The per-host rule sets are merged when the Policy is built (an exact host with the
wildcards above it, a wildcard with the wildcards above it), so `Policy.inspection(host)`
is O(labels) and `Inspection.decide` looks only at that host's own patterns.
"""

from __future__ import annotations

import shlex
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from .decision import Decision
from .names import Host, parse_address
from .patterns import TOKEN
from .rules import LAYERS, Rule
from .targets import Ambiguous, Target, query_pairs, read_target

AMBIGUOUS_HINT = ("send the target in plain form (no dot segments, '//', backslashes, ';', "
                  "escaped ';', '?' or '#', double encoding or Unicode lookalikes); no rule "
                  "allows an ambiguous one on a host with request rules")


@dataclass(frozen=True, slots=True)
class HostRules:
    """Every rule covering one host pattern, merged and ordered: exact before wildcard, a
    narrower wildcard before a broader one, an inner layer before an outer one."""

    marks: tuple[Rule, ...]
    """The `inspect` rules."""
    allows: tuple[Rule, ...] | None
    """The allow patterns; None when no covering table has an allow list."""
    denies: tuple[Rule, ...]
    reads_query: bool
    """Whether some pattern names a query parameter (else the query is never parsed)."""
    names_methods: bool = False
    """Whether some pattern names a method (else a method override changes nothing, and a
    body is never read to find one)."""

    @classmethod
    def merge(cls, rules: Iterable[Rule]) -> HostRules:
        marks, allows, denies = [], [], []
        for rule in rules:
            if rule.request is None:
                marks.append(rule)
            else:
                (denies if rule.request.deny else allows).append(rule)
        return cls(tuple(marks), tuple(allows) if allows else None, tuple(denies),
                   any(r.request.query for r in (*allows, *denies)),
                   any(r.request.method is not None for r in (*allows, *denies)))


Pairs = tuple[tuple[str, str], ...]


class _Unreadable(Exception):
    """A pattern naming a query parameter applies, and the query cannot be read."""

    def __init__(self, rule: Rule):
        super().__init__(rule.text)
        self.rule = rule


def _query(rule: Rule, pairs: Pairs | None) -> bool:
    """The rule's query conditions hold; raises _Unreadable if it has some and the query
    could not be read (so an unreadable query is refused only where it matters)."""
    if not rule.request.query:
        return True
    if pairs is None:
        raise _Unreadable(rule)
    return rule.request.matches_query(pairs)


class Inspection:
    """An inspected host and the requests it lets through. Built per lookup (cheap: the
    rules were merged when the policy was), so reasons name the host asked for."""

    __slots__ = ("host", "rules")

    def __init__(self, host: Host, rules: HostRules):
        self.host = host
        self.rules = rules

    def __repr__(self) -> str:
        return f"Inspection({self.host}, {len(self.rules.denies)} denies, allows=" + (
            "any" if self.rules.allows is None else str(len(self.rules.allows))) + ")"

    @property
    def restricted(self) -> bool:
        """Whether a request needs an allow pattern (some covering table has `allow`)."""
        return self.rules.allows is not None

    @property
    def judges(self) -> bool:
        """Do request rules judge the host's requests (an allow list, or a deny)? Without
        any, every request passes, whatever it asks to be read as."""
        return self.rules.allows is not None or bool(self.rules.denies)

    @property
    def names_methods(self) -> bool:
        """Do the host's request rules tell methods apart (so that what a request asks to
        be read as matters, bodies included)?"""
        return self.rules.names_methods

    @property
    def scanned(self) -> bool:
        """Are request bodies to the host read for leaks? Yes unless a table covering it
        says `scan = false`."""
        return not any(mark.unscanned for mark in self.rules.marks)

    def decide(self, method: str, target: str) -> Decision:
        """May this request (method, origin-form target as sent upstream) go to the host?"""
        rules, host = self.rules, self.host
        if not self.judges:
            return Decision(True, f"{host} is inspected without request rules",
                            rules.marks[0] if rules.marks else None)
        if not TOKEN.fullmatch(method):
            return self._refused(f"method {method[:40]!r} on {host}: not an HTTP method name")
        if target == "*":
            return self._refused(f"{method} * on {host}: the asterisk-form target names no path "
                                 f"for {host}'s request rules to judge",
                                 "no rule allows it on a host with request rules")
        if not target.startswith("/"):
            return self._refused(f"{method} {_shown(target)} on {host}: not an origin-form "
                                 "target (the path the proxy sends upstream is what is judged)",
                                 "judge the origin-form target the upstream is sent")
        try:
            parsed = read_target(target)
        except Ambiguous as exc:
            return self._refused(f"{method} {_shown(target)} on {host} refused: {exc}")
        pairs: Pairs | None = ()
        unreadable = ""
        if rules.reads_query and parsed.query:
            try:
                pairs = query_pairs(parsed.query)
            except Ambiguous as exc:  # refused only if a pattern naming a parameter applies
                pairs, unreadable = None, str(exc)
        try:
            deny = self._deny(method, parsed, pairs)
            if deny is not None:
                return self._denied(*deny, method, parsed)
            if rules.allows is None:
                return Decision(True, f"{method} {parsed.path} on {host}: no deny pattern "
                                f"matches and no allow list restricts {host}",
                                rules.marks[0] if rules.marks else None)
            found = [self._allow(method, reading, pairs) for reading in parsed.readings]
        except _Unreadable as exc:
            return self._refused(f"{method} {parsed.path} on {host} refused: request rule "
                                 f"{exc.rule.text} names a query parameter, and the query has "
                                 f"{unreadable}")
        if all(found):
            return Decision(True, f"{method} {parsed.path} on {host} allowed by request rule "
                            f"{found[0].text}", found[0])
        hint = self._allow_hint(method, parsed)
        some = next((i for i, r in enumerate(found) if r is not None), None)
        if some is not None:
            missed = found.index(None)
            return Decision(False, f"{method} {parsed.path} on {host}: request rule "
                            f"{found[some].text} allows it {parsed.how[some]} but not "
                            f"{parsed.how[missed]}; servers read it either way, and an allow "
                            "must hold under every reading", None, hint)
        return Decision(False, f"no allow pattern matches {method} {parsed.path} on {host}",
                        None, hint)

    def _deny(self, method: str, parsed: Target, pairs: Pairs | None
              ) -> tuple[Rule, str] | None:
        """The first deny matching under any reading, all of it case-folded, and how it
        matched in words ("" as sent and as written)."""
        if not self.rules.denies:
            return None
        upper = method.upper()
        readings = parsed.folded()
        folded = None if pairs is None else tuple((n.lower(), v.lower()) for n, v in pairs)
        for rule in self.rules.denies:
            spec = rule.request
            matched = [i for i, r in enumerate(readings) if spec.matches_head(upper, r)]
            if matched and _query(rule, folded):
                how = [] if 0 in matched else [parsed.how[matched[0]]]
                if not any(spec.matches_as_written(readings[i]) for i in matched):
                    how.append("which covers its format suffixes")
                return rule, ", ".join(how)
        return None

    def _allow(self, method: str, reading: tuple[str, ...], pairs: Pairs | None
               ) -> Rule | None:
        """The first allow matching this reading exactly."""
        for rule in self.rules.allows or ():
            if rule.request.matches_head(method, reading) and _query(rule, pairs):
                return rule
        return None

    def _refused(self, reason: str, hint: str = AMBIGUOUS_HINT) -> Decision:
        return Decision(False, reason, None, hint)

    def _denied(self, rule: Rule, how: str, method: str, parsed: Target) -> Decision:
        return Decision(
            False, f"{method} {parsed.path} on {self.host} denied by request rule {rule.text} "
            f"({rule.layer} layer)" + (f", {how}" if how else ""), rule,
            f"remove request rule {rule.text} from the {rule.layer} layer"
            + (f" ({rule.source})" if rule.source else ""))

    def _allow_hint(self, method: str, parsed: Target) -> str:
        if method != method.upper():
            return "HTTP methods are case-sensitive and patterns name them in upper case: " \
                   "send the method in upper case"
        path = parsed.path
        if len(parsed.readings) > 1:  # read several ways: allow what lies below the first
            head = path[: path.index("%")].rpartition("/")[0]  # segment an escape is in
            path = f"{head}/**"
        host = self.host
        name = f"[{host}]" if host.address is not None and host.address.version == 6 else host
        # quoted for a shell: the path is the agent's, and a person pastes the command
        command = f"corral allow-request {name} {shlex.quote(method)} {shlex.quote(path)}"
        return (f"{command} (or add '{method} {path}' to an allow list of an [[inspect]] "
                f"table for {name})")


def _shown(target: str) -> str:
    """A refused target as a reason shows it: the path, never the query (events and the
    audit log keep reasons, and credentials ride in queries too)."""
    path, query, _ = target.partition("?")
    return repr(path[:80]) + (" (query not shown)" if query else "")


class Inspections:
    """The inspected host patterns of a policy, each with its merged rules."""

    __slots__ = ("_exact", "_wild")

    def __init__(self, rules: Iterable[Rule]):
        exact: dict[str, list[Rule]] = defaultdict(list)
        wild: dict[str, list[Rule]] = defaultdict(list)
        for rule in rules:
            (wild[rule.suffix] if rule.wildcard else exact[rule.host]).append(rule)
        order = {layer: i for i, layer in enumerate(reversed(LAYERS))}

        def covering(key: str, own: list[Rule]) -> HostRules:
            found = sorted(own, key=lambda r: order[r.layer])
            if parse_address(key) is None:
                for suffix in _parents(key):
                    found.extend(sorted(wild.get(suffix, ()), key=lambda r: order[r.layer]))
            return HostRules.merge(found)

        self._exact = {key: covering(key, own) for key, own in exact.items()}
        self._wild = {key: covering(key, own) for key, own in wild.items()}

    def __bool__(self) -> bool:
        return bool(self._exact or self._wild)

    @property
    def patterns(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(exact host keys: names and IP literals, wildcard suffixes: `x.y` for `*.x.y`)."""
        return tuple(self._exact), tuple(self._wild)

    def lookup(self, host: Host) -> Inspection | None:
        rules = self._exact.get(host.key)
        if rules is None and host.name is not None and self._wild:
            for suffix in _parents(host.name):
                rules = self._wild.get(suffix)
                if rules is not None:
                    break
        return None if rules is None else Inspection(host, rules)


def _parents(name: str) -> Iterable[str]:
    """`a.b.c` -> `b.c`, `c`: the suffixes a `*.suffix` wildcard covering `name` is keyed by."""
    dot = name.find(".")
    while dot >= 0:
        name = name[dot + 1 :]
        yield name
        dot = name.find(".")
