"""Layers and presets: how rules from several places become one policy.

built-in defaults -> appliance (Ansible) -> project (corral.toml) -> session runtime.
A preset's rules join the layer of the file that named it, with `preset:NAME` as source.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from functools import cache
from importlib import resources

from .config import ConfigError, parse_policy
from .rules import Rule

DEFAULT_RULES = (
    # Cloud metadata by name: never answered, whatever a wildcard upstream says.
    Rule.parse("deny", "metadata.google.internal", "default", "built-in"),
    Rule.parse("deny", "instance-data.ec2.internal", "default", "built-in"),
)


@cache
def preset_names() -> tuple[str, ...]:
    files = resources.files(__package__).joinpath("presets").iterdir()
    return tuple(sorted(f.name[:-5] for f in files if f.name.endswith(".toml")))


@cache
def _preset_text(name: str) -> str:
    return resources.files(__package__).joinpath("presets", f"{name}.toml").read_text("utf-8")


def preset_description(name: str) -> str:
    import tomllib

    return tomllib.loads(_preset_text(name)).get("description", "")


def preset_rules(name: str, layer: str, referrer: str = "") -> tuple[Rule, ...]:
    """The rules of preset `name`, tagged with `layer`. Raises ConfigError if unknown."""
    if name not in preset_names():
        raise ConfigError(referrer or "presets", "presets",
                          f"unknown preset {name!r}; known: {', '.join(preset_names())}")
    document = parse_policy(_preset_text(name), f"preset:{name}", layer, allow_presets=False)
    return tuple(replace(r, layer=layer, source=f"preset:{name}") for r in document.rules)


def policy_file_rules(text: str, path: str, layer: str) -> list[Rule]:
    """A policy file's own rules followed by those of the presets it names."""
    document = parse_policy(text, path, layer)
    rules = list(document.rules)
    for name in document.presets:
        rules.extend(preset_rules(name, layer, path))
    return rules


def dedupe(rules: Iterable[Rule]) -> list[Rule]:
    """Drop repeats of the same rule in the same layer, keeping the first."""
    seen: set[tuple[str, str, str]] = set()
    out = []
    for rule in rules:
        key = (rule.layer, *rule.key())
        if key not in seen:
            seen.add(key)
            out.append(rule)
    return out
