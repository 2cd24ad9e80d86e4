"""The roles' defaults and templates, rendered here as Ansible renders them on an appliance.

The roles are the one source of the services' configuration: the local backend renders the
same templates with the same defaults and only the values a host without a VM needs changed
(`corral up --backend local`), and the tests render them into the services' real loaders.
A role reads only its own variables; what it needs of another role is an input, which
playbooks/site.yml wires from the role that owns it: the same wiring applies here.
Jinja2 and PyYAML come with ansible-core (the CLI's `host` extra).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

from .client import CliError

ROOT = Path(__file__).resolve().parents[1]
ROLES = ROOT / "roles"
SITE = ROOT / "playbooks" / "site.yml"
CONFIG_DIR = "/etc/corral"
"""Where the roles put the services' config files (templates name their siblings there)."""


def _libraries():
    try:
        import jinja2
        import yaml
    except ImportError:  # pragma: no cover - the host extra brings both
        raise CliError("Jinja2 and PyYAML are missing from corral's environment",
                       "install the host extra: pip install 'corral[host]' (scripts/setup "
                       "does)") from None
    return jinja2, yaml


def _roles() -> Path:
    """The roles next to this CLI: it renders them for the local backend, as `corral up`
    runs them for a VM. A wheel installed elsewhere does not carry them."""
    if not ROLES.is_dir():
        raise CliError(f"no roles at {ROLES}: this corral was installed without its "
                       "playbooks", "run corral from a checkout (scripts/setup installs it "
                       "there in editable mode)")
    return ROLES


def defaults() -> dict:
    """Every role's defaults/main.yml, merged (role variables are prefixed: none collide)."""
    _, yaml = _libraries()
    _roles()
    values: dict = {}
    for path in sorted(ROLES.glob("*/defaults/main.yml")):
        values.update(yaml.safe_load(path.read_text()) or {})
    return values


def wiring() -> dict[str, dict[str, str]]:
    """Each role's inputs as playbooks/site.yml passes them (its `vars:`): role -> {input:
    expression over the other roles' variables}."""
    _, yaml = _libraries()
    plays = yaml.safe_load(SITE.read_text())
    return {entry["role"]: dict(entry.get("vars") or {})
            for play in plays for entry in play.get("roles", [])}


def inputs(role: str, values: Mapping) -> dict:
    """The role's inputs that `values` does not give, computed from it as site.yml wires
    them (Ansible keeps the type of a value that is one expression: a list stays a list)."""
    jinja2, _ = _libraries()
    environment = _environment()
    found = {}
    for name, source in wiring().get(role, {}).items():
        if name in values:
            continue
        expression = re.fullmatch(r"\{\{(.*)\}\}", source.strip(), re.DOTALL)
        if expression is None:
            raise ValueError(f"{SITE}: {role}: {name}: {source!r} is not one expression")
        value = environment.compile_expression(expression.group(1),
                                               undefined_to_none=False)(**values)
        try:
            str(value)  # an undefined variable raises here, by its name
        except jinja2.UndefinedError as error:
            raise ValueError(f"{SITE}: {role}: {name} = {source!r}: {error}") from None
        found[name] = value
    return found


def _environment():
    jinja2, _ = _libraries()
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True,
                                     keep_trailing_newline=True)  # as Ansible's template
    environment.filters.update(to_json=json.dumps, basename=lambda p: Path(p).name,
                               dirname=lambda p: str(Path(p).parent))
    return environment


def render(role: str, template: str, values: Mapping, config_dir: str = CONFIG_DIR) -> str:
    """A role's template rendered with `values` (which must define every variable it and
    its inputs' wiring use, `ansible_managed` included) and the role's inputs computed from
    them; an input given in `values` is taken as given. `config_dir` stands for /etc/corral
    wherever the template names a file there, for a host that keeps its configs elsewhere."""
    source = (_roles() / role / "templates" / template).read_text()
    if config_dir != CONFIG_DIR:
        source = source.replace(CONFIG_DIR + "/", config_dir.rstrip("/") + "/")
    text = _environment().from_string(source).render(**inputs(role, values), **values)
    if "{{" in text or "{%" in text:  # a default that is itself a template: Ansible's job
        raise ValueError(f"{role}/templates/{template}: unrendered template text left")
    return text
