"""Learning a policy from what a session was denied: `corral learn SESSION` (and `corral run
--learn`, which ends with it).

Every denial is in the appliance's audit log with the command that would allow it (`hint`);
the ones a person could approve (denied by the default alone: no deny rule, no IP literal,
none of the appliance's own names; approvals.approvable) are the candidates. The proposal
is the smallest change to the project's corral.toml that lets them through:
  - a preset, where one allows at least PRESET_MIN of the names (and adds nothing but
    allow rules: a preset that inspects or restricts requests is left to a person);
  - a wildcard, where WILDCARD_MIN or more names share a parent domain of two labels or
    more (`*.cdn.example.com`, never `*.com`);
  - each remaining name as it was asked for, in the text `grants.rule_texts` gives a grant
    (`example.com:443`; the bare name only where both 80 and 443 were asked; `[tcp]` for
    what was asked as tcp; `[dns]` for a name only looked up): what `corral approve
    --always` writes for the same ask;
each annotated with how often and by what it was asked.
Nothing proposed opens what a person refused in the session (a name, or a name on a
port, whatever kind asked for it): the records of a refused target are no candidates,
and a rule, preset or wildcard that would allow a refused target (`example.com` when 443
was refused, `*.cdn.example.com` over a refused name, a preset over one) is not proposed;
nor a fold over a name the session's own runtime deny rules cover (they end with it).
`propose` is pure: records in, additions out; the command fetches and writes.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from appliance.policy import (
    Decision,
    Policy,
    Rule,
    RuleError,
    parse_host,
    preset_names,
    preset_rules,
)
from appliance.policy.grants import approvable, grant_of, rule_texts
from appliance.policy.layers import preset_parameters
from appliance.policy.names import HostNameError, split_host_port
from appliance.policy.rules import overlap

from . import exitcodes, output, projectfile, render
from .arguments import appliance_command, project_file
from .targets import client_for, pick_session, project_of

PRESET_MIN = 2
WILDCARD_MIN = 3
DEFAULT_PORTS = {"80", "443"}
REASON_WIDTH = 50
"""Characters of the agent's reasons shown in the table (`--json` has them whole)."""
PAGES = 500
"""Audit pages of 1,000 records read at most (the session's records are among them)."""


@dataclass
class Candidate:
    kind: str
    """http, dns or tcp: the kind of rule that would allow it."""
    name: str
    ports: set[str] = field(default_factory=set)
    asked: int = 0
    by: Counter = field(default_factory=Counter)
    """What asked: connect, http, tls, dns (the event kinds), agent (an ask with a reason)."""
    reasons: list[str] = field(default_factory=list)
    """What the agent said it needed it for (untrusted text, as the appliance cleaned it)."""

    @property
    def rules(self) -> list[str]:
        """The rules a grant of exactly the ports asked adds (grants.rule_texts)."""
        return rule_texts(self.kind, self.name, self.ports)

    def annotation(self) -> str:
        by = ", ".join(f"{kind} {count}" for kind, count in sorted(self.by.items()))
        return f"asked {self.asked}x ({by})"


def candidates(records: list[dict], session: str) -> list[Candidate]:
    """What the session was denied that a person could allow, one per name and kind; never
    a target a person refused in that session (however often it was asked for after)."""
    mine = [r for r in records if r.get("session") == session]
    refused = refusals(records, session)
    found: dict[tuple[str, str], Candidate] = {}
    for record in mine:
        target = _target(record)
        if target is None:
            continue
        kind, name, port, by = target
        if (name, None) in refused or (name, port) in refused:
            continue
        candidate = found.get((kind, name))
        if candidate is None:
            candidate = found[(kind, name)] = Candidate(kind, name)
        if port:
            candidate.ports.add(port)
        candidate.asked += 1
        candidate.by[by] += 1
        if by == "agent" and record.get("note") and len(candidate.reasons) < 3:
            candidate.reasons.append(record["note"])
    return sorted(found.values(), key=lambda c: (-c.asked, c.kind, c.name))


def refusals(records: list[dict], session: str) -> frozenset[tuple[str, str | None]]:
    """(name, port) of each target a person refused in the session: port None for every
    port (a refusal without one, and DNS)."""
    return frozenset(r for r in (_refused(r) for r in records if r.get("session") == session)
                     if r is not None)


def _refused(record: dict) -> tuple[str, str | None] | None:
    """(name, port) of an approval a person refused: port None for every port (and for
    DNS), whatever kind asked for it."""
    if record.get("kind") != "approval" or record.get("action") != "refused":
        return None
    parsed = _parsed(str(record.get("grant_kind")), str(record.get("target")))
    return parsed and parsed[1:]


def _target(record: dict) -> tuple[str, str, str | None, str] | None:
    """(kind, name, port, what asked) of a record a person could allow, else None."""
    if record.get("kind") == "approval":
        # an agent's ask, with its reason (a held request's approval is counted by its
        # own denial already)
        if record.get("verdict") != "pending" or not record.get("note"):
            return None
        hint = f"corral allow-{record.get('grant_kind')} {record.get('target')}"
        by = "agent"
    elif record.get("verdict") == "deny" and record.get("hint") and not record.get("rule"):
        hint, by = record["hint"], record.get("kind") or "?"
    elif (record.get("verdict") == "allow" and record.get("learning") == "open"
          and record.get("hint")):
        hint, by = record["hint"], record.get("kind") or "?"  # learning open: let through
    else:
        return None
    decision = Decision(False, record.get("reason") or "", None, str(hint))
    if not approvable(decision):
        return None
    parsed = _parsed(*grant_of(decision))
    return parsed and (*parsed, by)


def _parsed(kind: str, target: str) -> tuple[str, str, str | None] | None:
    """(kind, normalised name, port) of a grant's target, or None for anything that is not
    a plain name (an address, a wildcard, one of the appliance's names) and a number port:
    whatever the records say, only that goes into a file."""
    if kind not in projectfile.KINDS:
        return None
    try:
        name, port = split_host_port(target)
        host = parse_host(name)
    except HostNameError:
        return None
    if host.name is None or host.name == "corral" or host.name.endswith(".corral"):
        return None
    if port is not None and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return None
    port = str(int(port)) if port is not None else None
    try:
        Rule.parse(kind, f"{host.name}:{port}" if port else host.name, "project", "learn")
    except RuleError:
        return None
    return kind, host.name, port


@dataclass
class Proposal:
    additions: list[projectfile.Addition]
    covered: dict[str, list[str]]
    """Each proposed rule or preset -> the names it lets through."""
    already: list[str]
    """Names the project's file allows already (since the session began, say)."""
    foldable: list[str] = field(default_factory=list)
    """Presets and wildcards that could replace several names (without `fold`)."""


def propose(found: list[Candidate], current: Policy | None = None, fold: bool = False,
            refused: frozenset[tuple[str, str | None]] = frozenset(),
            denies: Policy | None = None) -> Proposal:
    """The smallest corral.toml change letting every candidate through. `fold`: a preset
    where one covers PRESET_MIN names, `*.parent` where WILDCARD_MIN siblings were asked
    for. Both let through more than was asked (a preset's other hosts, every other name
    under the parent), so they are proposed only when asked for; otherwise `foldable`
    says what could fold. No addition allows a `refused` target (refusals()), and no fold
    covers a name a runtime deny rule of `denies` covers (_keeps_closed)."""
    left, already = [], []
    for c in found:
        narrowed = _narrowed(current, c) if current is not None else c
        (left.append(narrowed) if narrowed is not None else already.append(c.name))
    additions, covered, foldable = [], {}, []
    for preset in _plain_presets():
        rules = preset_rules(preset, "project")
        policy = Policy(list(rules))
        taken = [c for c in left if _allows(policy, c)]
        if len(taken) < PRESET_MIN or not _keeps_closed(rules, refused, denies):
            continue
        if not fold:
            foldable.append(f"preset {preset} ({len(taken)} of the names)")
            continue
        asked = sum(c.asked for c in taken)
        additions.append(projectfile.Addition(
            "preset", preset, f"{len(taken)} of its names, asked {asked}x"))
        covered[f"preset {preset}"] = [c.name for c in taken]
        left = [c for c in left if c not in taken]
    by_parent: dict[str, list[Candidate]] = defaultdict(list)
    for c in left:
        if c.kind == "http" and c.ports <= DEFAULT_PORTS and c.name.count(".") >= 2:
            by_parent[c.name.split(".", 1)[1]].append(c)
    for parent, siblings in sorted(by_parent.items()):
        if len({c.name for c in siblings}) < WILDCARD_MIN:
            continue
        (wildcard,) = rule_texts("http", f"*.{parent}", set().union(*(c.ports
                                                                      for c in siblings)))
        if not _keeps_closed([Rule.parse("http", wildcard, "project", "learn")], refused,
                             denies):
            continue
        if not fold:
            foldable.append(f"{wildcard} ({len(siblings)} names)")
            continue
        asked = sum(c.asked for c in siblings)
        additions.append(projectfile.Addition(
            "http", wildcard, f"{len(siblings)} names under {parent}, asked "
            f"{asked}x: allows any name under it"))
        covered[f"http {wildcard}"] = [c.name for c in siblings]
        left = [c for c in left if c not in siblings]
    for c in left:
        for rule in c.rules:
            if not _keeps_closed([Rule.parse(c.kind, rule, "project", "learn")], refused):
                continue
            additions.append(projectfile.Addition(c.kind, rule, c.annotation()))
            covered[f"{c.kind} {rule}"] = [c.name]
    return Proposal(additions, covered, already, foldable)


def _keeps_closed(rules, refused: frozenset[tuple[str, str | None]],
                  denies: Policy | None = None) -> bool:
    """Whether `rules`, written into the project, leave every refused target closed (a
    name refused without a port: any rule that names it; with one: an http or tcp rule
    covering that port), and cover no name a runtime deny rule of the session covers (a
    deny in a file stays next to them; one given at run time ends with the session, and
    the rule would open its names in the next)."""
    policy = Policy(list(rules))
    for name, port in refused:
        host = parse_host(name)
        if port is None:
            if policy.decide_dns(host).allowed:
                return False
        elif policy.decide_http(host, int(port)).allowed or policy.decide_tcp(
                host, int(port)).allowed:
            return False
    runtime = [r for r in denies.rules if r.kind == "deny" and r.layer == "session"
               ] if denies is not None else []
    return not any(overlap(rule, deny) for rule in policy.rules for deny in runtime)


def _narrowed(policy: Policy, c: Candidate) -> Candidate | None:
    """`c` with only the ports `policy` still denies; None when it allows them all."""
    if not c.ports:
        return None if _allows(policy, c) else c
    ports = {p for p in c.ports if not _allows(policy, replace(c, ports={p}))}
    return replace(c, ports=ports) if ports else None


def _allows(policy: Policy, c: Candidate) -> bool:
    host = parse_host(c.name)
    if c.kind == "dns":
        return policy.decide_dns(host).allowed
    if c.kind == "tcp":
        return all(policy.decide_tcp(host, int(p)).allowed for p in c.ports or {"0"}
                   if p.isdigit())
    return all(policy.decide_http(host, int(p)).allowed for p in c.ports or DEFAULT_PORTS
               if p.isdigit())


def _plain_presets() -> list[str]:
    """Presets made of allow rules alone, named alone (an inspecting or restricting preset
    changes what passes on hosts that were allowed whole, and one that takes parameters
    needs a person's: a person picks those)."""
    return [name for name in preset_names() if not preset_parameters(name)
            and all(r.kind in projectfile.KINDS for r in preset_rules(name, "project"))]


# -- the command ---------------------------------------------------------------------------


def session_records(client, session: str, created: float | None) -> list[dict]:
    """The session's records in the audit log, from when it was created (the whole log
    when that is not known)."""
    records, after, read = [], 0, 0
    since = max(0.0, created - 1) if created else None
    for page in range(PAGES):
        answer = client.request("GET", "/audit", after=after, since=since, limit=1000)
        read += len(answer["records"])
        records += [r for r in answer["records"] if r.get("session") == session]
        if not answer.get("more") or not answer["records"]:
            return records
        after = answer["records"][-1]["seq"]
        if page and page % 20 == 0:
            output.notice(f"read {read} audit records ...")
    output.notice(f"stopped after {read} audit records: the proposal may miss some")
    return records


def denied_by_rules(client, session: str) -> Policy:
    """The session's deny rules as they stand (any layer): a name one covers now is not
    proposed, whatever it was asked for."""
    rules = []
    for r in client.request("GET", "/policy", session=session)["rules"]:
        if r.get("kind") == "deny":
            try:
                rules.append(Rule.parse("deny", r["rule"], r["layer"], r["source"]))
            except (RuleError, KeyError):
                continue
    return Policy(rules)


def learn(client, session: str, project: Path, yes: bool, as_json: bool,
          fold: bool = False) -> int:
    """Propose, show and (when told) write the rules the session needed."""
    path, before = projectfile.read(project)
    current = projectfile.policy_of(path, before)
    record = client.request("GET", f"/sessions/{session}")
    if not record.get("created"):
        output.notice(f"when session {session} began is not known: reading the whole audit "
                      "log")
    denies = denied_by_rules(client, session)
    records = session_records(client, session, record.get("created"))
    found = [c for c in candidates(records, session)
             if denies.denied_by(parse_host(c.name)) is None]
    proposal = propose(found, current, fold, refusals(records, session), denies)
    if as_json:
        output.data({"session": session, "file": str(path),
                     "candidates": [{"kind": c.kind, "name": c.name, "rules": c.rules,
                                     "ports": sorted(c.ports), "asked": c.asked,
                                     "by": dict(c.by), "reasons": c.reasons} for c in found],
                     "proposal": [{"kind": a.kind, "rule": a.rule, "comment": a.comment,
                                   "covers": proposal.covered.get(f"{a.kind} {a.rule}", [])}
                                  for a in proposal.additions],
                     "allowed_already": proposal.already, "foldable": proposal.foldable})
    if not proposal.additions:
        if not as_json:
            output.line(f"nothing to learn: session {session} was denied nothing a person "
                        "could allow" + (f" that {path} does not allow already"
                                         if proposal.already else ""))
        return exitcodes.OK
    if as_json and not yes:
        return exitcodes.OK  # the proposal alone: --yes writes it
    if not as_json:
        output.table([[c.kind, c.name, str(c.asked), c.annotation().split("(", 1)[1][:-1],
                       render.text("; ".join(c.reasons), REASON_WIDTH)] for c in found
                      if c.name not in proposal.already],
                     ["KIND", "NAME", "ASKED", "BY", "AGENT'S REASON"])
        if proposal.foldable:
            output.line("\ncould be folded (--fold; each lets through more than was asked "
                        "for): " + ", ".join(proposal.foldable))
        output.line(f"\nproposed for {path}:")
    after = projectfile.added(before, proposal.additions, str(path))
    if projectfile.confirm(path, before, after, yes, as_json):
        projectfile.replace(path, before, after)
        if not as_json:
            output.line(f"wrote {path}: a new session of this project starts with it (this "
                        "one keeps its policy; `corral allow-http` changes it)")
    return exitcodes.OK


def cmd_learn(args) -> int:
    client = client_for(args)
    session = pick_session(client, args.session)
    project = project_of(client, session, args.project, args.force)
    return learn(client, session, project, args.yes, args.json, args.fold)


def register(sub) -> None:
    learning = appliance_command(
        sub, "learn", "propose the corral.toml rules a session needed, from its denials",
        cmd_learn, session=False,
        description="Read what the session was denied that a person could allow (the audit "
        "log; never what a person refused or a deny rule covers) and propose the corral.toml "
        "change letting exactly that through, each line saying how often and by what it was "
        "asked (--fold: presets and wildcards where they cover several). Shown as a diff and "
        "written only when you say so.")
    learning.add_argument("session", nargs="?", help="default: the only one")
    learning.add_argument("--fold", action="store_true", help="propose a preset where one "
                          "covers two or more names, and *.parent where three or more share "
                          "a parent (each lets through more than was asked for)")
    project_file(learning)
