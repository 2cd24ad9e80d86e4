"""`corral agents` and what `corral run --agent NAME` checks before a session starts.

A profile (appliance/agents/profile.py) is found on this host — the project's, the person's,
then corral's own — and sent whole to the appliance, which checks it again. Before anything
is copied, the profile's needs are held against what the appliance and the project say: a
secret it expects that the appliance does not hold (or holds for other hosts, or sends in
another form), a host it needs that the project denies. Each is named with the command that
fixes it; nothing starts until the required ones are there.
"""

from __future__ import annotations

from pathlib import Path

from appliance.agents.profile import Profile, available, find, parse_profile, search_path
from appliance.policy import DEFAULT_RULES, Policy
from appliance.policy.config import ConfigError
from appliance.policy.layers import dedupe, policy_file_rules
from appliance.policy.names import HostNameError, parse_host

from . import exitcodes, output, render
from .client import Client, CliError, config_home


def places(project: Path | None) -> list[tuple[str, Path]]:
    return search_path(project, config_home())


def resolve(name: str, project: Path | None) -> Profile:
    """The profile `name` as the first place that has it says; CliError when there is none
    or it does not parse (the error names file, line and key)."""
    where = places(project)
    found = find(name, where)
    if found is None:
        known = ", ".join(sorted(available(where))) or "none"
        raise CliError(f"no agent profile {name!r} (known: {known})",
                       "`corral agents` lists them; a team adds its own as "
                       f"{where[0][1]}/{name}.toml",
                       exitcodes.USAGE)
    _, path = found
    try:
        return parse_profile(path.read_text("utf-8"), str(path), name)
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}", "", exitcodes.USAGE) from None
    except ConfigError as exc:
        raise CliError(str(exc), "fix the profile (`corral agents show NAME` checks it)",
                       exitcodes.USAGE) from None


def _sent_as(secret: dict) -> str:
    return f"header {secret.get('header')}" if secret.get("scheme") == "header" else \
        secret.get("scheme", "?")


def secret_problems(profile: Profile, held: list[dict]) -> list[tuple[bool, str, str]]:
    """(required, what is wrong, the command that fixes it) for each of the profile's
    secrets the appliance does not hold as the profile sends it. Pure: `held` is
    GET /secrets' list."""
    by_name = {s.get("name"): s for s in held}
    problems = []
    for secret in profile.secrets:
        stored = by_name.get(secret.name)
        if stored is None:
            hint = f" ({render.text(secret.hint)})" if secret.hint else ""  # one line
            problems.append((secret.required, f"secret {secret.name} is not set{hint}",
                             secret.set_command()))
            continue
        missing = [h for h in secret.hosts if h not in stored.get("hosts", [])]
        if missing:
            problems.append((secret.required, f"secret {secret.name} is held for "
                             f"{', '.join(stored.get('hosts', []))}, not for "
                             f"{', '.join(missing)}", secret.set_command()))
            continue
        wanted = secret.form
        if _sent_as(stored) != wanted:
            problems.append((secret.required, f"secret {secret.name} is sent as "
                             f"{_sent_as(stored)}; {profile.name} sends it as {wanted}",
                             secret.set_command()))
    return problems


def rule_problems(profile: Profile, project: Path | None) -> list[str]:
    """Hosts the profile's secrets go to that the project's corral.toml and the profile's
    own layer together do not allow (a project's deny wins over the profile's allow).
    The appliance's own layer is checked where it lives, when the session starts."""
    rules = [*DEFAULT_RULES, *policy_file_rules(profile.policy, f"agent {profile.name}",
                                                "project")]
    path = project / "corral.toml" if project is not None else None
    if path is not None and path.is_file():
        try:
            rules += policy_file_rules(path.read_text("utf-8"), str(path), "project")
        except (ConfigError, OSError, UnicodeDecodeError) as exc:
            raise CliError(str(exc), "fix corral.toml (`corral check` prints what it says)",
                           exitcodes.USAGE) from None
    policy = Policy(dedupe(rules))
    problems = []
    for secret in profile.secrets:
        for name in secret.hosts:
            try:
                host = parse_host(name.removeprefix("*."))
            except HostNameError:
                continue
            decision = policy.decide_http(host, 443)
            if not decision.allowed:
                source = f" ({decision.rule.source})" if decision.rule else ""
                problems.append(f"{profile.name} sends {secret.name} to {name}, which the "
                                f"policy does not allow: {decision.reason}{source}")
    return problems


def check_ready(client: Client, profile: Profile, project: Path | None) -> None:
    """Refuse to start (naming each missing piece and its fix) when a required secret or
    a host the agent needs is missing; a missing optional secret is a notice."""
    blocking = [f"{p}; denied by the policy" for p in rule_problems(profile, project)]
    fixes = ["edit the corral.toml rule named above"] if blocking else []
    held = client.request("GET", "/secrets").get("secrets", [])
    for required, problem, fix in secret_problems(profile, held):
        if required:
            blocking.append(problem)
            fixes.append(fix)
        else:
            output.notice(f"{problem}: without it, sign in inside the session (the login "
                          f"is kept in the project's home); to have the appliance hold "
                          f"it: `{fix}`")
    if blocking:
        raise CliError(f"agent {profile.name} cannot start: " + "; ".join(blocking),
                       "; then ".join(dict.fromkeys(fixes)), exitcodes.USAGE)


def cmd_agents(args) -> int:
    project = Path(args.project).resolve() if args.project else Path.cwd()
    where = places(project)
    if args.name:
        profile = resolve(args.name, project)
        if args.json:
            output.data(profile.to_json())
            return exitcodes.OK
        origin = next(o for o, d in where if Path(profile.source).parent == d)
        output.line(f"{profile.name}: {render.text(profile.description)}")
        output.line(f"  profile   {render.text(profile.source)} ({origin})")
        output.line(f"  installs  {profile.install.kind} {render.text(profile.install.spec)}"
                    f" from {render.text(profile.install.index)}, once per appliance")
        output.line(f"  runs      {render.text(' '.join(profile.command))}")
        for key, value in profile.environment:
            output.line(f"  env       {render.text(key)}={render.text(value)}")
        if profile.persist:
            output.line(f"  keeps     {render.text(', '.join(profile.persist))} in the "
                        "project's home")
        for secret in profile.secrets:
            need = "needs" if secret.required else "may use"
            output.line(f"  {need:9} {secret.name} for {', '.join(secret.hosts)} "
                        f"({secret.form}): `{secret.set_command()}`")
        output.line("  policy    " + (render.text(profile.policy.strip().replace("\n", "; "))
                                      or "(none)"))
        return exitcodes.OK
    profiles = []
    for name, (origin, path) in sorted(available(where).items()):
        try:
            profile = parse_profile(path.read_text("utf-8"), str(path), name)
            profiles.append({"name": name, "origin": origin, "source": str(path),
                             "description": profile.description,
                             "package": f"{profile.install.kind} {profile.install.spec}"})
        except (ConfigError, OSError, UnicodeDecodeError) as exc:
            profiles.append({"name": name, "origin": origin, "source": str(path),
                             "error": str(exc)})
    if args.json:
        output.data({"agents": profiles})
        return exitcodes.OK
    output.table([[p["name"], p["origin"], p.get("package", "-"),
                   render.text(p.get("description") or f"broken: {p['error']}")]
                  for p in profiles], ["AGENT", "FROM", "PACKAGE", "DESCRIPTION"])
    output.line("\n`corral run --agent NAME [PROJECT]` runs one; `corral agents NAME` shows "
                "what it installs, runs, keeps and needs")
    return exitcodes.OK if all("error" not in p for p in profiles) else exitcodes.USAGE


def register(sub) -> None:
    agent_list = sub.add_parser(
        "agents", help="the agent profiles `corral run --agent` can run",
        description="List the agent profiles (the project's .corral/agents/, yours in "
        "~/.config/corral/agents/, then corral's), or show one: what it installs, runs, "
        "keeps in the project's home and which secrets it needs. Reads no appliance.")
    agent_list.add_argument("name", nargs="?", metavar="NAME", help="show this one, checked")
    agent_list.add_argument("--project", metavar="DIR", help="whose .corral/agents/ to read "
                            "(default: the current directory)")
    agent_list.add_argument("--json", action="store_true", help="machine-readable output")
    agent_list.set_defaults(run=cmd_agents)
