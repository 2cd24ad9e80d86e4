"""Policy documents (corral.toml, appliance files, presets): TOML text in, rules out.

Pure: callers read the file and pass its text, so the same parser serves the filter, the
CLI and the tests. Every error is a ConfigError naming the file, the line where it can be
found, the key and the offending value. Unknown keys are errors: a typo such as `[htttp]`
must never silently drop the rules a team meant to write.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass

from .git import OPTION_FLAG, GitRuleError, check_push_option
from .parameters import PARAMETERS, ParameterError, PresetRef, expand, parse_refs
from .patterns import PatternError, RequestSpec
from .rules import Rule, RuleError

# key in the document -> (table, field, rule kind)
SECTIONS = {
    ("dns", "allow"): "dns",
    ("http", "allow"): "http",
    ("tcp", "allow"): "tcp",
    ("cidr", "allow"): "cidr",
    ("host", "ports"): "host",
    ("host", "force_ports"): "host",
    ("deny", "names"): "deny",
}
RESOLVER_PORTS = {53: "DNS", 853: "DNS over TLS"}
"""Ports of the VM host that `[host] ports` refuses: a session reaching the host's resolver
resolves any name through it, around the filter (DNS exfiltration, names the policy never
saw). `[host] force_ports` lists them when that is meant, and takes nothing else."""
TOP_LEVEL = ("presets", "description", "version")
WORKSPACE = "workspace"
"""`[workspace] exclude = [...]`: what `corral run` leaves out of the copy (no rules)."""
INSPECT = "inspect"
"""The array of tables `[[inspect]]`: one host each, with optional allow and deny lists of
request patterns (patterns.py). A table becomes an `inspect` rule for its host and a
`request` rule per pattern; `allow = []` also becomes `HOST nothing` (an empty allow list,
which restricts), while a missing `allow` restricts nothing."""
INSPECT_KEYS = ("host", "allow", "deny", "scan")
GIT = "git"
"""The array of tables `[[git]]`: one host each, the repositories git may reach there, the
refs a push may write and the push options it may carry (git.py); each repository becomes a
`git` rule."""
GIT_KEYS = ("host", "repos", "push", "push_options")
APPROVAL = "approval"
"""`[approval] mode = "ask" | "deny"`, `hold = SECONDS`: whether a request the policy does not
name waits for a person's decision (approvals.py); becomes one `approval` rule."""
APPROVAL_KEYS = ("mode", "hold")
WORKSPACE_KEYS = ("exclude",)
KEYS: dict[str, tuple[str, ...]] = {
    "": TOP_LEVEL,
    **{table: tuple(f for t, f in SECTIONS if t == table)
       for table in dict.fromkeys(t for t, _ in SECTIONS)},
    APPROVAL: APPROVAL_KEYS,
    WORKSPACE: WORKSPACE_KEYS,
    INSPECT: INSPECT_KEYS,
    GIT: GIT_KEYS,
}
"""Every table a policy document may hold ("": its top level) and the keys each takes: what
the parser accepts, and nothing else (every other key is refused by name). INSPECT and GIT
are arrays of tables (`[[inspect]]`); the rest are plain tables. tests/unit/test_docs.py
holds the reference (docs/) to every one of them."""


class ConfigError(ValueError):
    """A config or policy file that cannot be used, located as precisely as possible."""

    def __init__(self, path: str, key: str, message: str, line: int | None = None):
        self.path, self.key, self.message, self.line = path, key, message, line
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {key}: {message}" if key else f"{where}: {message}")


@dataclass(frozen=True)
class PolicyDocument:
    """What one policy file says, before presets are expanded."""

    rules: tuple[Rule, ...]
    """The file's own rules, each tagged with the layer and the file as its source."""
    presets: tuple[PresetRef, ...]
    """The presets the file names, in order, with the parameters it gives them."""
    exclude: tuple[str, ...] = ()
    """`[workspace] exclude`: paths of the project `corral run` does not copy into a session
    (globs relative to the project; the CLI reads them, cli/scan.py)."""


def parse_toml(text: str, path: str) -> dict:
    """tomllib with errors that name the file (tomllib already gives line and column)."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = _line_from_message(str(exc))
        raise ConfigError(path, "", f"not valid TOML: {exc}", line) from None
    except RecursionError:  # tomllib recurses once per level of nested arrays or tables
        raise ConfigError(path, "", "not usable TOML: arrays or inline tables nested "
                          "thousands of levels deep") from None


def parse_policy(text: str, path: str, layer: str, *, allow_presets: bool = True,
                 arguments: dict[str, tuple[str, ...]] | None = None) -> PolicyDocument:
    """Parse a policy document; raises ConfigError. A preset's text (`allow_presets` off)
    may declare `[parameters]`; `arguments` are their values, put in first (parameters.py)."""
    data = parse_toml(text, path)
    if arguments:
        data = expand(data, arguments)
    locate = Locator(text)
    rules: list[Rule] = []
    presets: tuple[PresetRef, ...] = ()
    exclude: tuple[str, ...] = ()
    for key, value in data.items():
        if key == WORKSPACE:
            if layer != "project" or not allow_presets:
                raise ConfigError(path, WORKSPACE, "[workspace] belongs in a project's "
                                  "corral.toml (what `corral run` copies)",
                                  locate.key("", WORKSPACE))
            exclude = _workspace(value, path, locate)
            continue
        if key == INSPECT:
            rules.extend(_inspect_tables(value, path, layer, locate))
            continue
        if key == GIT:
            rules.extend(_git_tables(value, path, layer, locate))
            continue
        if key == APPROVAL:
            rules.append(_approval(value, path, layer, locate))
            continue
        if key == PARAMETERS and not allow_presets:
            continue  # a preset's: checked where the preset is named (layers.preset_rules)
        if key in TOP_LEVEL:
            if key == "presets":
                if not allow_presets:
                    raise ConfigError(path, key, "a preset cannot include other presets",
                                      locate.key("", key))
                line = locate.key("", key)
                try:
                    presets = tuple(PresetRef(r.name, r.arguments, line)
                                    for r in parse_refs(value))
                except ParameterError as exc:
                    raise ConfigError(path, key, str(exc), line) from None
            elif not isinstance(value, str):
                raise ConfigError(path, key, "must be a string", locate.key("", key))
            continue
        if not isinstance(value, dict) or key not in {table for table, _ in SECTIONS}:
            raise ConfigError(path, key, f"unknown key; expected tables {_tables()}"
                              f" and top-level {', '.join(TOP_LEVEL)}", locate.key("", key))
        for field, items in value.items():
            full = f"[{key}] {field}"
            kind = SECTIONS.get((key, field))
            if kind is None:
                known = [f for (t, f) in SECTIONS if t == key]
                expected = (f"expected {', '.join(known)}" if known
                            else f"expected tables {_tables()}")
                raise ConfigError(path, full, f"unknown key; {expected}", locate.key(key, field))
            if not isinstance(items, list):
                raise ConfigError(path, full, f"must be a list, got {type(items).__name__}",
                                  locate.key(key, field))
            for item in items:
                if kind == "host" and (not isinstance(item, int) or isinstance(item, bool)):
                    raise ConfigError(path, full, f"{item!r} is not a port number",
                                      locate.value(key, item))
                if kind == "host":
                    _host_port(item, field, path, full, locate.key(key, field))
                if kind != "host" and not isinstance(item, str):
                    raise ConfigError(path, full, f"{item!r} is not a string",
                                      locate.value(key, item))
                try:
                    rules.append(Rule.parse(kind, str(item), layer, path))
                except RuleError as exc:
                    raise ConfigError(path, full, str(exc), locate.value(key, item)) from None
    return PolicyDocument(tuple(rules), presets, exclude)


def _host_port(port: int, field: str, path: str, full: str, line: int | None) -> None:
    """A resolver port (RESOLVER_PORTS) only in `force_ports`, and only those there."""
    what = RESOLVER_PORTS.get(port)
    if field == "ports" and what is not None:
        raise ConfigError(path, full, f"{port} is the host's {what} port: a session would "
                          "resolve any name through the host's resolver, around the filter "
                          "(names the policy never sees, DNS exfiltration). If that is meant, "
                          f"write it as [host] force_ports = [{port}]", line)
    if field == "force_ports" and what is None:
        raise ConfigError(path, full, f"{port} needs no forcing: list it in [host] ports "
                          f"(force_ports takes {', '.join(map(str, RESOLVER_PORTS))} only)",
                          line)


def _inspect_tables(tables, path: str, layer: str, locate: Locator) -> list[Rule]:
    if isinstance(tables, dict):
        raise ConfigError(path, INSPECT, "write [[inspect]] (an array of tables, one per host), "
                          "not [inspect]", locate.key("", INSPECT))
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(path, INSPECT, "must be [[inspect]] tables, one per host",
                          locate.key("", INSPECT))
    rules: list[Rule] = []
    for index, table in enumerate(tables):
        where = f"{INSPECT}#{index}"
        for key in table:
            if key not in INSPECT_KEYS:
                raise ConfigError(path, f"[[inspect]] {key}", "unknown key; expected "
                                  f"{', '.join(INSPECT_KEYS)}", locate.key(where, key))
        host = table.get("host")
        if not isinstance(host, str):
            line = locate.key(where, "host") or locate.array_table(INSPECT, index)
            problem = "missing" if host is None else f"{host!r} is not a string"
            raise ConfigError(path, "[[inspect]] host", f"{problem}: name the host to inspect, "
                              'e.g. host = "api.github.com"', line)
        scan = table.get("scan", True)
        if not isinstance(scan, bool):
            raise ConfigError(path, "[[inspect]] scan", "must be true or false (false: request "
                              "bodies to the host are not read for leaks)",
                              locate.key(where, "scan"))
        try:
            mark = Rule.parse("inspect", host if scan else f"{host} unscanned", layer, path)
        except RuleError as exc:
            raise ConfigError(path, "[[inspect]] host", str(exc), locate.key(where, "host")
                              ) from None
        rules.append(mark)
        for field in ("allow", "deny"):
            items = table.get(field)
            if items is None:
                continue
            full = f"[[inspect]] {field}"
            if not isinstance(items, list):
                raise ConfigError(path, full, f"must be a list, got {type(items).__name__}",
                                  locate.key(where, field))
            for item in items:
                if not isinstance(item, str):
                    raise ConfigError(path, full, f"{item!r} is not a string",
                                      locate.value(where, item))
                try:
                    spec = RequestSpec.parse(item, deny=field == "deny")
                except PatternError as exc:
                    raise ConfigError(path, full, f"{item!r}: {exc}", locate.value(where, item)
                                      ) from None
                rules.append(Rule.for_request(mark.host, spec, layer, path))
        if table.get("allow") == []:
            rules.append(Rule.for_request(mark.host, RequestSpec.parse("nothing"), layer, path))
    return rules


def _approval(table, path: str, layer: str, locate: Locator) -> Rule:
    if not isinstance(table, dict):
        raise ConfigError(path, APPROVAL, 'must be a table: [approval] mode = "ask"',
                          locate.key("", APPROVAL))
    for key in table:
        if key not in APPROVAL_KEYS:
            raise ConfigError(path, f"[approval] {key}",
                              f"unknown key; expected {', '.join(APPROVAL_KEYS)}",
                              locate.key(APPROVAL, key))
    mode, hold = table.get("mode", "deny"), table.get("hold")
    if mode not in ("ask", "deny"):
        raise ConfigError(path, "[approval] mode", f"{mode!r}: expected \"ask\" (a denied "
                          "request waits for a person) or \"deny\"", locate.key(APPROVAL, "mode"))
    if hold is not None and (mode != "ask" or not isinstance(hold, int)
                             or isinstance(hold, bool)):
        raise ConfigError(path, "[approval] hold", "a whole number of seconds, with mode = "
                          '"ask"', locate.key(APPROVAL, "hold"))
    try:
        return Rule.parse("approval", f"ask {hold}" if hold is not None else mode, layer, path)
    except RuleError as exc:
        raise ConfigError(path, "[approval] hold", str(exc), locate.key(APPROVAL, "hold")
                          ) from None


def _workspace(table, path: str, locate: Locator) -> tuple[str, ...]:
    if not isinstance(table, dict):
        raise ConfigError(path, WORKSPACE, "must be a table: [workspace] exclude = [...]",
                          locate.key("", WORKSPACE))
    for key in table:
        if key not in WORKSPACE_KEYS:
            raise ConfigError(path, f"[workspace] {key}",
                              f"unknown key; expected {', '.join(WORKSPACE_KEYS)}",
                              locate.key(WORKSPACE, key))
    items = table.get("exclude", [])
    if not isinstance(items, list) or not all(isinstance(i, str) and i.strip("/") and
                                              "\0" not in i for i in items):
        raise ConfigError(path, "[workspace] exclude", "must be a list of paths or globs "
                          'relative to the project, e.g. ["secrets/", "*.pem"]',
                          locate.key(WORKSPACE, "exclude"))
    return tuple(items)


def _git_tables(tables, path: str, layer: str, locate: Locator) -> list[Rule]:
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(path, GIT, "write [[git]] tables, one per host, e.g. [[git]] host = "
                          '"github.com" repos = ["acme/widget"]', locate.key("", GIT))
    rules: list[Rule] = []
    for index, table in enumerate(tables):
        where = f"{GIT}#{index}"
        for key in table:
            if key not in GIT_KEYS:
                raise ConfigError(path, f"[[git]] {key}", "unknown key; expected "
                                  f"{', '.join(GIT_KEYS)}", locate.key(where, key))
        host = table.get("host")
        if not isinstance(host, str):
            line = locate.key(where, "host") or locate.array_table(GIT, index)
            raise ConfigError(path, "[[git]] host", "missing or not a string: name the git "
                              'host, e.g. host = "github.com"', line)
        lists = {}
        for field in ("repos", "push", "push_options"):
            items = table.get(field, [])
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise ConfigError(path, f"[[git]] {field}", "must be a list of strings",
                                  locate.key(where, field))
            lists[field] = items
        if not lists["repos"]:
            raise ConfigError(path, "[[git]] repos", "name the repositories git may reach, "
                              'e.g. repos = ["acme/widget"]', locate.key(where, "repos")
                              or locate.array_table(GIT, index))
        for field in ("repos", "push"):
            for item in lists[field]:
                if not item or any(c.isspace() for c in item):
                    raise ConfigError(path, f"[[git]] {field}", f"{item!r}: one path or "
                                      "pattern per string, without spaces",
                                      locate.value(where, item))
        for option in lists["push_options"]:
            try:
                check_push_option(option)
            except GitRuleError as exc:
                raise ConfigError(path, "[[git]] push_options", str(exc),
                                  locate.value(where, option) or locate.key(where,
                                                                            "push_options")
                                  ) from None
        options = [w for option in lists["push_options"] for w in (OPTION_FLAG, option)]
        for repo in lists["repos"]:
            text = " ".join([host, repo, *lists["push"], *options])
            try:
                rules.append(Rule.parse("git", text, layer, path))
            except RuleError as exc:
                raise ConfigError(path, "[[git]]", str(exc), locate.value(where, repo)
                                  ) from None
    return rules


def _tables() -> str:
    return ", ".join([*sorted({f"[{t}]" for t, _ in SECTIONS} | {f"[{APPROVAL}]"}),
                      "[[inspect]]", "[[git]]",
                      "[workspace]"])


def _line_from_message(message: str) -> int | None:
    match = re.search(r"line (\d+)", message)
    return int(match.group(1)) if match else None


class Locator:
    """Finds the line of a key or value in TOML text. tomllib drops positions, so this is a
    best effort that is right for the ordinary `[table]` + `key = [...]` layout."""

    _HEADER = re.compile(r"^\s*\[\s*([A-Za-z0-9_.-]+)\s*\]")
    _ARRAY = re.compile(r"^\s*\[\[\s*([A-Za-z0-9_.-]+)\s*\]\]")

    def __init__(self, text: str):
        self.lines = text.splitlines()

    def _scan(self, table: str):
        """The lines of `table`: a `[name]`, or the n-th `[[name]]` spelt `name#n`."""
        current = ""
        arrays: dict[str, int] = {}
        for number, line in enumerate(self.lines, 1):
            array = self._ARRAY.match(line)
            if array:
                name = array.group(1)
                arrays[name] = arrays.get(name, -1) + 1
                current = f"{name}#{arrays[name]}"
                continue
            header = self._HEADER.match(line)
            if header:
                current = header.group(1)
                continue
            stripped = line.split("#", 1)[0]
            if current == table:
                yield number, stripped

    def key(self, table: str, key: str) -> int | None:
        if table == "" :
            for number, line in enumerate(self.lines, 1):
                if re.match(rf"^\s*\[\s*{re.escape(key)}\s*\]", line):
                    return number
        pattern = re.compile(rf"^\s*{re.escape(key)}\s*=")
        for number, line in self._scan(table):
            if pattern.match(line):
                return number
        return None

    def array_table(self, name: str, index: int) -> int | None:
        """The line of the `index`-th `[[name]]` header."""
        seen = -1
        for number, line in enumerate(self.lines, 1):
            array = self._ARRAY.match(line)
            if array and array.group(1) == name:
                seen += 1
                if seen == index:
                    return number
        return None

    def value(self, table: str, value) -> int | None:
        needles = [repr(value), f'"{value}"'] if isinstance(value, str) else [str(value)]
        for number, line in self._scan(table):
            if any(n in line for n in needles):
                return number
        return None
