"""Agent profiles: what `corral run --agent NAME` needs to run one agent, as data.

A profile is one TOML file (profiles/NAME.toml ships with corral; a team adds its own, see
`search_path`). Pure: callers read the file and pass its text, so the same parser serves the
CLI (which finds the profile and checks the appliance has what it needs) and the sandbox
service (which checks it again: the appliance never trusts what a host sends it). Errors
are ConfigErrors naming the file, line, key and value, as corral.toml's are.

    description = "Claude Code, Anthropic's coding agent"

    [install]                       # one of npm / pypi, at one exact version
    npm = "@anthropic-ai/claude-code@2.1.90"

    [run]
    command = ["claude", "--dangerously-skip-permissions"]
    environment = { DISABLE_AUTOUPDATER = "1" }

    [home]
    persist = [".claude", ".claude.json"]

    [[secret]]
    name = "ANTHROPIC_API_KEY"
    hosts = ["api.anthropic.com"]
    header = "x-api-key"            # or bearer = true (the default)

    [policy]                        # corral.toml's tables: the profile's own layer
    presets = ["anthropic"]
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from appliance.policy.config import ConfigError, Locator, parse_policy, parse_toml
from appliance.policy.layers import policy_file_rules
from appliance.policy.names import HostNameError, normalise_name

NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
"""A profile's name: its file's stem, and part of the install's directory name."""
VARIABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
NPM_SPEC = re.compile(r"^(?P<name>(@[a-z0-9][a-z0-9._-]*/)?[a-z0-9][a-z0-9._-]*)"
                      r"@(?P<version>\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?)$")
"""An npm package at one exact version: no range, tag or URL (those move under a profile)."""
PYPI_SPEC = re.compile(r"^(?P<name>[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?"
                       r"(\[[A-Za-z0-9._,-]+\])?)==(?P<version>[0-9][0-9A-Za-z.+!-]*)$")
"""A PyPI distribution (extras allowed) at one exact version (`==`, never `>=`)."""
REGISTRIES = {"npm": "https://registry.npmjs.org/", "pypi": "https://pypi.org/simple/"}
"""Where a package comes from unless the profile says `index`."""
REGISTRY_PRESETS = {"npm": "npm", "pypi": "pypi"}
"""What the install step may reach when the profile names no `index`."""
FORMS = ("bearer", "header")
TOP = ("description", "version", "install", "run", "home", "secret", "policy")
INSTALL_KEYS = ("npm", "pypi", "index", "hosts")
RUN_KEYS = ("command", "environment")
HOME_KEYS = ("persist",)
SECRET_KEYS = ("name", "hosts", "header", "bearer", "required", "hint")
MOUNT = "/opt/corral/agent"
"""Where an agent's installed files are in its sessions (read-only); its bin/ leads PATH."""
PYPI_INSTALL = """set -e
python3 -m venv "$0/venv"
ls "$0/venv/bin" > /tmp/venv-before
"$0/venv/bin/pip" install --no-cache-dir --disable-pip-version-check --index-url "$1" "$2"
mkdir -p "$0/bin"
for path in "$0"/venv/bin/*; do
  name=${path##*/}
  grep -qxF -- "$name" /tmp/venv-before || ln -s "../venv/bin/$name" "$0/bin/$name"
done"""
"""The PyPI install, as `sh -c PYPI_INSTALL MOUNT INDEX SPEC` runs it."""
RESERVED_ENVIRONMENT = ("HOME", "PATH", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy",
                        "https_proxy", "NO_PROXY", "no_proxy", "SSL_CERT_FILE",
                        "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "CURL_CA_BUNDLE",
                        "GIT_SSL_CAINFO", "NODE_OPTIONS", "LD_PRELOAD", "LD_LIBRARY_PATH",
                        "PYTHONPATH", "JAVA_TOOL_OPTIONS")
"""Variables the session's confinement sets (proxy, trust) or that change what code runs:
a profile does not set them."""


@dataclass(frozen=True)
class Install:
    """How the agent is installed, once per appliance and install key."""

    kind: str
    """npm or pypi."""
    package: str
    """The package's name (with extras, for pypi)."""
    version: str
    index: str
    """The registry's URL."""
    hosts: tuple[str, ...] = ()
    """What the install step may reach besides the registry (a custom index's file host)."""

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}" if self.kind == "npm" else \
            f"{self.package}=={self.version}"

    def key(self, image: str) -> str:
        """Names one installed tree: the same package, version, source and sandbox image
        share it; anything else gets its own (a new image may bring a new node or python)."""
        ident = json.dumps([self.kind, self.spec, self.index, sorted(self.hosts), image])
        return hashlib.sha256(ident.encode()).hexdigest()[:16]

    def policy_text(self) -> str:
        """The install step's own policy: its registry and nothing else."""
        if self.index != REGISTRIES[self.kind]:
            return f"[http]\nallow = {json.dumps([_index_host(self.index), *self.hosts])}\n"
        preset = f'presets = ["{REGISTRY_PRESETS[self.kind]}"]\n'
        return preset + (f"[http]\nallow = {json.dumps(list(self.hosts))}\n" if self.hosts
                         else "")

    def command(self) -> list[str]:
        """What installs it into MOUNT (run in a throwaway session whose policy is
        `policy_text`). Nothing is run from the package at install time that npm or pip
        would not run anyway; the tree is mounted read-only afterwards."""
        if self.kind == "npm":
            return ["npm", "install", "--global", "--prefix", MOUNT, "--no-fund",
                    "--no-audit", "--registry", self.index, self.spec]
        # a venv of its own under venv/, and only the commands the package added linked
        # into bin/: the venv's python3 and pip on the session's PATH would shadow the
        # image's, and pip would then try to install into the read-only tree
        return ["sh", "-c", PYPI_INSTALL, MOUNT, self.index, self.spec]


@dataclass(frozen=True)
class Secret:
    """A secret the agent expects in `name`, attached by the filter on `hosts` only."""

    name: str
    hosts: tuple[str, ...]
    header: str = ""
    """Sent as `header: VALUE`; empty: `Authorization: Bearer VALUE`."""
    required: bool = True
    hint: str = ""
    """Where a person gets the value (shown when it is missing)."""

    @property
    def form(self) -> str:
        return f"header {self.header}" if self.header else "bearer"

    def set_command(self) -> str:
        """The command that stores it as the profile expects it."""
        hosts = " ".join(f"--host {h}" for h in self.hosts)
        form = f" --header {self.header}" if self.header else ""
        return f"printenv {self.name} | corral secret set {self.name} {hosts}{form}"


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    description: str
    install: Install
    command: tuple[str, ...]
    environment: tuple[tuple[str, str], ...] = ()
    persist: tuple[str, ...] = ()
    secrets: tuple[Secret, ...] = ()
    policy: str = ""
    """The profile's own policy layer, as corral.toml text (checked by parse_policy)."""
    text: str = field(default="", repr=False)
    """The file as read: what the CLI sends the appliance, which parses it again."""

    def to_json(self) -> dict:
        return {"name": self.name, "source": self.source, "description": self.description,
                "install": {"kind": self.install.kind, "package": self.install.package,
                            "version": self.install.version, "index": self.install.index},
                "command": list(self.command), "environment": dict(self.environment),
                "persist": list(self.persist),
                "secrets": [{"name": s.name, "hosts": list(s.hosts), "form": s.form,
                             "required": s.required} for s in self.secrets],
                "policy": self.policy}


def parse_profile(text: str, path: str, name: str | None = None) -> Profile:
    """Parse and check a profile; raises ConfigError. `name` defaults to the file's stem."""
    name = name if name is not None else PurePosixPath(path).stem
    if not NAME.match(name):
        raise ConfigError(path, "", f"profile name {name!r} must be 1-32 of a-z, 0-9 and "
                          "'-' (it is the file's name without .toml)")
    data = parse_toml(text, path)
    locate = Locator(text)
    for key in data:
        if key not in TOP:
            raise ConfigError(path, key, f"unknown key; expected {', '.join(TOP)}",
                              locate.key("", key))
    description = data.get("description")
    if not isinstance(description, str) or not description.strip():
        raise ConfigError(path, "description", "a profile says what it runs: "
                          'description = "..."', locate.key("", "description"))
    if "version" in data and data["version"] != "1":
        raise ConfigError(path, "version", f"{data['version']!r}: this corral reads profile "
                          'version "1"', locate.key("", "version"))
    install = _install(_table(data, "install", path, locate, INSTALL_KEYS), path, locate)
    run = _table(data, "run", path, locate, RUN_KEYS)
    command = run.get("command")
    if (not isinstance(command, list) or not command
            or not all(isinstance(w, str) and w for w in command)):
        raise ConfigError(path, "[run] command", "the agent's launch command: a list of "
                          'words, e.g. ["claude", "--dangerously-skip-permissions"]',
                          locate.key("run", "command"))
    environment = _environment(run.get("environment", {}), path, locate)
    home = _table(data, "home", path, locate, HOME_KEYS, required=False)
    persist = _persist(home.get("persist", []), path, locate)
    secrets = _secrets(data.get("secret", []), path, locate)
    policy = _policy(data.get("policy", {}), path, locate)
    return Profile(name, path, description.strip(), install, tuple(command), environment,
                   persist, secrets, policy, text)


def _table(data: dict, key: str, path: str, locate: Locator, keys: tuple[str, ...],
           required: bool = True) -> dict:
    table = data.get(key)
    if table is None and not required:
        return {}
    if not isinstance(table, dict):
        raise ConfigError(path, f"[{key}]", "missing table" if table is None else
                          "must be a table", locate.key("", key))
    for field_ in table:
        if field_ not in keys:
            raise ConfigError(path, f"[{key}] {field_}", f"unknown key; expected "
                              f"{', '.join(keys)}", locate.key(key, field_))
    return table


def _index_host(url: str) -> str:
    parts = urlsplit(url)
    return parts.hostname + (f":{parts.port}" if parts.port else "")


def _install(table: dict, path: str, locate: Locator) -> Install:
    kinds = [k for k in ("npm", "pypi") if k in table]
    if len(kinds) != 1:
        raise ConfigError(path, "[install]", "name the package once: npm = "
                          '"PACKAGE@VERSION" or pypi = "PACKAGE==VERSION"', locate.key("",
                                                                                    "install"))
    kind = kinds[0]
    spec = table[kind]
    pattern = NPM_SPEC if kind == "npm" else PYPI_SPEC
    match = pattern.match(spec) if isinstance(spec, str) else None
    if not match:
        example = "@scope/tool@1.2.3" if kind == "npm" else "tool==1.2.3"
        raise ConfigError(path, f"[install] {kind}", f"{spec!r} is not a package at one exact "
                          f"version (e.g. {example!r}): a range or tag would install "
                          "something else tomorrow", locate.key("install", kind))
    index = table.get("index", REGISTRIES[kind])
    parts = urlsplit(index) if isinstance(index, str) else None
    try:
        if parts is None or parts.scheme != "https" or not parts.hostname or parts.username \
                or parts.password or parts.query or parts.fragment:
            raise ValueError
        normalise_name(parts.hostname)
        _ = parts.port
    except (ValueError, HostNameError):
        raise ConfigError(path, "[install] index", f"{index!r} must be an https:// URL of a "
                          "registry, by name, without credentials", locate.key("install",
                                                                               "index")) from None
    hosts = table.get("hosts", [])
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        raise ConfigError(path, "[install] hosts", "a list of hosts the install may reach "
                          "besides the registry", locate.key("install", "hosts"))
    install = Install(kind, match.group("name"), match.group("version"), index, tuple(hosts))
    try:  # the install's own policy must be one the filter takes
        parse_policy(install.policy_text(), f"{path} [install]", "project")
    except ConfigError as exc:
        raise ConfigError(path, "[install] hosts", exc.message,
                          locate.key("install", "hosts")) from None
    return install


def _environment(table, path: str, locate: Locator) -> tuple[tuple[str, str], ...]:
    if not isinstance(table, dict):
        raise ConfigError(path, "[run] environment", 'a table: { NAME = "value" }',
                          locate.key("run", "environment"))
    for key, value in table.items():
        if not VARIABLE.match(key) or key in RESERVED_ENVIRONMENT:
            raise ConfigError(path, "[run] environment", f"{key!r} is not a variable a "
                              "profile may set (the session's confinement sets "
                              f"{', '.join(RESERVED_ENVIRONMENT[:8])}, ...)",
                              locate.key("run", "environment"))
        if not isinstance(value, str) or "\0" in value or len(value) > 4096:
            raise ConfigError(path, f"[run] environment {key}", "must be a string",
                              locate.key("run", "environment"))
    return tuple(sorted(table.items()))


def _persist(items, path: str, locate: Locator) -> tuple[str, ...]:
    if not isinstance(items, list):
        raise ConfigError(path, "[home] persist", "a list of paths under the home",
                          locate.key("home", "persist"))
    for item in items:
        parts = PurePosixPath(item).parts if isinstance(item, str) else ()
        if not parts or item.startswith("/") or ".." in parts or "." in parts \
                or any(c in item for c in "\0\n\\"):
            raise ConfigError(path, "[home] persist", f"{item!r} must be a path relative to "
                              "the home, without '..'", locate.value("home", item))
    return tuple(items)


def _secrets(tables, path: str, locate: Locator) -> tuple[Secret, ...]:
    if not isinstance(tables, list):
        raise ConfigError(path, "[[secret]]", "write each secret as a [[secret]] table",
                          locate.key("", "secret"))
    secrets: list[Secret] = []
    for index, table in enumerate(tables):
        where = locate.array_table("secret", index)
        if not isinstance(table, dict):
            raise ConfigError(path, "[[secret]]", "must be a table", where)
        for key in table:
            if key not in SECRET_KEYS:
                raise ConfigError(path, f"[[secret]] {key}", f"unknown key; expected "
                                  f"{', '.join(SECRET_KEYS)}", where)
        name = table.get("name")
        if not isinstance(name, str) or not VARIABLE.match(name):
            raise ConfigError(path, "[[secret]] name", f"{name!r} is not a variable name",
                              where)
        hosts = table.get("hosts")
        if not isinstance(hosts, list) or not hosts or not all(
                isinstance(h, str) for h in hosts):
            raise ConfigError(path, f"[[secret]] {name}: hosts", "the hosts it may go to",
                              where)
        for host in hosts:
            try:
                normalise_name(host.removeprefix("*."))
            except HostNameError as exc:
                raise ConfigError(path, f"[[secret]] {name}: hosts", f"{host!r}: {exc}",
                                  where) from None
        header = table.get("header", "")
        if "header" in table and "bearer" in table:
            raise ConfigError(path, f"[[secret]] {name}", "header or bearer, not both", where)
        if not isinstance(header, str) or (header and not re.fullmatch(r"[A-Za-z0-9-]{1,64}",
                                                                       header)):
            raise ConfigError(path, f"[[secret]] {name}: header", f"{header!r} is not a "
                              "header name", where)
        if table.get("bearer", True) is not True:
            raise ConfigError(path, f"[[secret]] {name}: bearer", "bearer = true, or leave "
                              "it out (it is the default without header)", where)
        required, hint = table.get("required", True), table.get("hint", "")
        if not isinstance(required, bool) or not isinstance(hint, str):
            raise ConfigError(path, f"[[secret]] {name}", "required is true or false, hint a "
                              "string", where)
        if any(s.name == name for s in secrets):
            raise ConfigError(path, f"[[secret]] {name}", "named twice", where)
        secrets.append(Secret(name, tuple(hosts), header, required, hint))
    return tuple(secrets)


def _policy(table, path: str, locate: Locator) -> str:
    if not isinstance(table, dict):
        raise ConfigError(path, "[policy]", "a table holding corral.toml's keys",
                          locate.key("", "policy"))
    if "workspace" in table or "approval" in table:
        raise ConfigError(path, "[policy]", "[workspace] and [approval] are the project's "
                          "(corral.toml) and the person's (--ask), not an agent's",
                          locate.key("", "policy"))
    text = toml_text(table)
    try:  # with its presets expanded: an unknown preset is named here, not at the filter
        policy_file_rules(text, f"{path} [policy]", "project")
    except ConfigError as exc:
        raise ConfigError(path, f"[policy] {exc.key}".strip(), exc.message,
                          locate.key("", "policy")) from None
    return text


def toml_text(table: dict) -> str:
    """A policy table as TOML again (tomllib only reads): strings, numbers, booleans,
    lists of them, tables and arrays of tables, which is all corral.toml holds. Strings are
    written as JSON strings, which TOML reads the same but for DEL, which TOML wants escaped."""
    def scalar(value) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (int, float)):
            return json.dumps(value)
        if isinstance(value, str):
            return _string(value)
        if isinstance(value, list) and not any(isinstance(v, dict) for v in value):
            return "[" + ", ".join(scalar(v) for v in value) + "]"
        raise ConfigError("", "", f"{value!r} cannot be written in a policy")

    def key(name: str) -> str:
        return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else _string(name)

    lines: list[str] = []
    tables: list[tuple[str, dict]] = []
    arrays: list[tuple[str, list]] = []
    for name, value in table.items():
        if isinstance(value, dict):
            tables.append((name, value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            arrays.append((name, value))
        else:
            lines.append(f"{key(name)} = {scalar(value)}")
    for name, value in tables:
        lines.append(f"[{key(name)}]")
        for field_, item in value.items():
            if isinstance(item, dict):
                raise ConfigError("", name, "corral.toml tables hold no tables")
            lines.append(f"{key(field_)} = {scalar(item)}")
    for name, items in arrays:
        for item in items:
            lines.append(f"[[{key(name)}]]")
            for field_, value in item.items():
                lines.append(f"{key(field_)} = {scalar(value)}")
    return "\n".join(lines) + "\n" if lines else ""


def _string(value: str) -> str:
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def shipped() -> Path:
    return Path(__file__).with_name("profiles")


def search_path(project: Path | None, config_home: Path) -> list[tuple[str, Path]]:
    """Where `corral run --agent NAME` looks, first found wins: the project's own
    (`.corral/agents/`, checked in with the project and never copied into a session: the
    agent cannot write the profile its next session runs with), the person's
    (`~/.config/corral/agents/`), then corral's."""
    places = []
    if project is not None:
        places.append(("project", project / ".corral" / "agents"))
    places.append(("user", config_home / "agents"))
    places.append(("shipped", shipped()))
    return places


def find(name: str, places: list[tuple[str, Path]]) -> tuple[str, Path] | None:
    if not NAME.match(name):
        return None
    for origin, directory in places:
        path = directory / f"{name}.toml"
        if path.is_file():
            return origin, path
    return None


def available(places: list[tuple[str, Path]]) -> dict[str, tuple[str, Path]]:
    """Every profile name these places hold, with the one that wins."""
    found: dict[str, tuple[str, Path]] = {}
    for origin, directory in places:
        if directory.is_dir():
            for path in sorted(directory.glob("*.toml")):
                found.setdefault(path.stem, (origin, path))
    return found
