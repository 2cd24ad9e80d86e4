"""The roles' defaults and templates, rendered here as Ansible renders them on an appliance.

The roles are the one source of the services' configuration: the local backend renders the
same templates with the same defaults and only the values a host without a VM needs changed
(`corral up --backend local`), and the tests render them into the services' real loaders.
Jinja2 and PyYAML come with ansible-core (the CLI's `host` extra).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from .client import CliError

ROOT = Path(__file__).resolve().parents[1]
ROLES = ROOT / "roles"
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


def render(role: str, template: str, values: Mapping, config_dir: str = CONFIG_DIR) -> str:
    """A role's template rendered with `values` (which must define every variable it uses,
    `ansible_managed` included). `config_dir` stands for /etc/corral wherever the template
    names a file there, for a host that keeps its configs elsewhere."""
    jinja2, _ = _libraries()
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True,
                                     keep_trailing_newline=True)  # as Ansible's template
    environment.filters.update(to_json=json.dumps, basename=lambda p: Path(p).name,
                               dirname=lambda p: str(Path(p).parent))
    source = (_roles() / role / "templates" / template).read_text()
    if config_dir != CONFIG_DIR:
        source = source.replace(CONFIG_DIR + "/", config_dir.rstrip("/") + "/")
    text = environment.from_string(source).render(**values)
    if "{{" in text or "{%" in text:  # a default that is itself a template: Ansible's job
        raise ValueError(f"{role}/templates/{template}: unrendered template text left")
    return text
