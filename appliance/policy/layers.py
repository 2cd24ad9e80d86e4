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
from .parameters import ParameterError, PresetRef, arguments, declared
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


@cache
def _preset_data(name: str) -> dict:
    import tomllib

    return tomllib.loads(_preset_text(name))


def preset_description(name: str) -> str:
    return _preset_data(name).get("description", "")


def preset_parameters(name: str) -> dict[str, str]:
    """What a preset needs to be told (parameters.py): NAME -> what the values are; {} for
    a preset named alone."""
    return declared(_preset_data(name), name)


def preset_rules(name: str | PresetRef, layer: str, referrer: str = "") -> tuple[Rule, ...]:
    """The rules of a preset (a name, or a reference with its parameters), tagged with
    `layer`. Raises ConfigError, located at the referrer's `presets`, for an unknown preset
    and for parameters that are missing, unknown or malformed."""
    ref = PresetRef(name) if isinstance(name, str) else name
    where = referrer or "presets"
    if ref.name not in preset_names():
        raise ConfigError(where, "presets", f"unknown preset {ref.name!r}; known: "
                          f"{', '.join(preset_names())}", ref.line)
    try:
        values = arguments(ref, preset_parameters(ref.name))
    except ParameterError as exc:
        raise ConfigError(where, "presets", str(exc), ref.line) from None
    document = parse_policy(_preset_text(ref.name), f"preset:{ref.name}", layer,
                            allow_presets=False, arguments=values)
    return tuple(replace(r, layer=layer, source=f"preset:{ref.name}") for r in document.rules)


def policy_file_rules(text: str, path: str, layer: str) -> list[Rule]:
    """A policy file's own rules followed by those of the presets it names."""
    document = parse_policy(text, path, layer)
    rules = list(document.rules)
    for ref in document.presets:
        rules.extend(preset_rules(ref, layer, path))
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
