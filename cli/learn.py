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
  - each remaining name as it was asked for (`example.com` for ports 80 and 443, else
    `example.com:8443`; `[tcp]` for what was asked as tcp);
each annotated with how often and by what it was asked. A name the DNS filter denied is
proposed for http (a client resolves before it connects; an http rule answers DNS too).
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
from appliance.policy.grants import approvable, grant_of
from appliance.policy.layers import policy_file_rules
from appliance.policy.names import HostNameError, split_host_port

from . import exitcodes, output, projectfile
from .client import CliError
from .control import client_for, pick_session

PRESET_MIN = 2
WILDCARD_MIN = 3
DEFAULT_PORTS = {"80", "443"}
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
        """`name` for http's own ports (80, 443), `name:PORT` for each other port asked."""
        if self.kind == "http" and (not self.ports or self.ports & DEFAULT_PORTS):
            plain = [self.name]
            others = self.ports - DEFAULT_PORTS
        else:
            plain, others = [], self.ports or {""}
        return plain + [f"{self.name}:{p}" if p else self.name
                        for p in sorted(others, key=lambda p: int(p or 0))]

    def annotation(self) -> str:
        by = ", ".join(f"{kind} {count}" for kind, count in sorted(self.by.items()))
        return f"asked {self.asked}x ({by})"


def candidates(records: list[dict], session: str) -> list[Candidate]:
    """What the session was denied that a person could allow, one per name and kind."""
    found: dict[tuple[str, str], Candidate] = {}
    for record in records:
        if record.get("session") != session:
            continue
        target = _target(record)
        if target is None:
            continue
        kind, name, port, by = target
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
    else:
        return None
    decision = Decision(False, record.get("reason") or "", None, hint)
    if not approvable(decision):
        return None
    kind, target = grant_of(decision)
    try:
        name, port = split_host_port(target)
        Rule.parse(kind, target, "project", "learn")  # what the file would get must parse
    except (HostNameError, RuleError):
        return None
    name = name.rstrip(".").lower()
    if kind == "dns":  # the name is wanted: a client resolves it before it connects
        return "http", name, None, by
    return kind, name, port, by


@dataclass
class Proposal:
    additions: list[projectfile.Addition]
    covered: dict[str, list[str]]
    """Each proposed rule or preset -> the names it lets through."""
    already: list[str]
    """Names the project's file allows already (since the session began, say)."""


def propose(found: list[Candidate], current: Policy | None = None, wildcards: bool = True
            ) -> Proposal:
    """The smallest corral.toml change letting every candidate through (`wildcards`: fold
    siblings into `*.parent`, which lets every other name under it through too)."""
    left, already = [], []
    for c in found:
        if current is not None:  # only what the file does not allow yet
            c = _narrowed(current, c)
        (left if c is not None else already).append(c)
    already = [c.name for c in found if c.name not in {x.name for x in left}]
    additions, covered = [], {}
    for preset in _plain_presets():
        policy = Policy(list(preset_rules(preset, "project")))
        taken = [c for c in left if _allows(policy, c)]
        if len(taken) >= PRESET_MIN:
            asked = sum(c.asked for c in taken)
            additions.append(projectfile.Addition(
                "preset", preset, f"{len(taken)} of its names, asked {asked}x"))
            covered[f"preset {preset}"] = [c.name for c in taken]
            left = [c for c in left if c not in taken]
    by_parent: dict[str, list[Candidate]] = defaultdict(list)
    for c in left:
        if c.kind == "http" and c.rules == [c.name] and c.name.count(".") >= 2:
            by_parent[c.name.split(".", 1)[1]].append(c)
    for parent, siblings in sorted(by_parent.items()):
        if wildcards and len({c.name for c in siblings}) >= WILDCARD_MIN:
            asked = sum(c.asked for c in siblings)
            additions.append(projectfile.Addition(
                "http", f"*.{parent}", f"{len(siblings)} names under {parent}, asked "
                f"{asked}x: allows any name under it"))
            covered[f"http *.{parent}"] = [c.name for c in siblings]
            left = [c for c in left if c not in siblings]
    for c in left:
        for rule in c.rules:
            additions.append(projectfile.Addition(c.kind, rule, c.annotation()))
            covered[f"{c.kind} {rule}"] = [c.name]
    return Proposal(additions, covered, already)


def _narrowed(policy: Policy, c: Candidate) -> Candidate | None:
    """`c` with only the ports `policy` still denies; None when it allows them all."""
    if not c.ports:
        return None if _allows(policy, c) else c
    ports = {p for p in c.ports if not _allows(policy, replace(c, ports={p}))}
    return replace(c, ports=ports) if ports else None


def _allows(policy: Policy, c: Candidate) -> bool:
    host = parse_host(c.name)
    if c.kind == "tcp":
        return all(policy.decide_tcp(host, int(p)).allowed for p in c.ports or {"0"}
                   if p.isdigit())
    return all(policy.decide_http(host, int(p)).allowed for p in c.ports or DEFAULT_PORTS
               if p.isdigit())


def _plain_presets() -> list[str]:
    """Presets made of allow rules alone (an inspecting or restricting preset changes what
    passes on hosts that were allowed whole: a person picks those)."""
    return [name for name in preset_names()
            if all(r.kind in projectfile.KINDS for r in preset_rules(name, "project"))]


# -- the command ---------------------------------------------------------------------------


def session_records(client, session: str) -> list[dict]:
    """The audit log's records since the session was created (every session's: the page
    filter is the time)."""
    created = client.request("GET", f"/sessions/{session}").get("created") or 0
    records, after = [], 0
    for page in range(PAGES):
        answer = client.request("GET", "/audit", after=after, since=max(0, created - 1),
                                limit=1000)
        records += answer["records"]
        if not answer.get("more") or not answer["records"]:
            return records
        after = answer["records"][-1]["seq"]
        if page and page % 20 == 0:
            output.notice(f"read {len(records)} audit records ...")
    output.notice(f"stopped after {len(records)} audit records: the proposal may miss some")
    return records


def learn(client, session: str, project: Path, yes: bool, as_json: bool,
          wildcards: bool = True) -> int:
    """Propose, show and (when told) write the rules the session needed."""
    path, before = projectfile.read(project)
    try:
        current = Policy(policy_file_rules(before, str(path), "project")) if before else None
    except ValueError as exc:  # ConfigError: the file as corral check would name it
        raise CliError(f"{path}: {exc}", "fix it first (`corral check`)", exitcodes.USAGE
                       ) from None
    found = candidates(session_records(client, session), session)
    proposal = propose(found, current, wildcards)
    if as_json:
        output.data({"session": session, "file": str(path),
                     "candidates": [{"kind": c.kind, "name": c.name, "rules": c.rules,
                                     "ports": sorted(c.ports), "asked": c.asked,
                                     "by": dict(c.by), "reasons": c.reasons} for c in found],
                     "proposal": [{"kind": a.kind, "rule": a.rule, "comment": a.comment,
                                   "covers": proposal.covered.get(f"{a.kind} {a.rule}", [])}
                                  for a in proposal.additions],
                     "allowed_already": proposal.already})
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
                       _shown("; ".join(c.reasons))] for c in found
                      if c.name not in proposal.already],
                     ["KIND", "NAME", "ASKED", "BY", "AGENT'S REASON"])
        output.line(f"\nproposed for {path}:")
    after = projectfile.added(before, proposal.additions, str(path))
    written = projectfile.write(path, before, after, yes, as_json)
    if written and not as_json:
        output.line(f"wrote {path}: a new session of this project starts with it (this one "
                    f"keeps its policy; `corral allow-http` changes it)")
    return exitcodes.OK


def project_of(client, session: str, project_dir: str | None, force: bool) -> Path:
    """The project directory whose corral.toml a session's rules go into: --project or the
    current directory, which must be the one the session was started from (or --force)."""
    from .sessions import project_id

    project = Path(project_dir or ".").resolve()
    if not project.is_dir():
        raise CliError(f"no project directory {project}", code=exitcodes.USAGE)
    started = client.request("GET", f"/sessions/{session}").get("project")
    if started and started != project_id(project) and not force:
        raise CliError(f"session {session} was started from another project ({started}), "
                       f"not {project}", "run it in that project, pass --project DIR, or "
                       "--force", exitcodes.USAGE)
    return project


def cmd_learn(args) -> int:
    client = client_for(args)
    session = pick_session(client, args.session)
    project = project_of(client, session, args.project, args.force)
    return learn(client, session, project, args.yes, args.json, not args.exact)


def _shown(text: str, width: int = 50) -> str:
    text = "".join(c if " " <= c <= "~" else "?" for c in text)
    return text if len(text) <= width else text[:width - 3] + "..."
