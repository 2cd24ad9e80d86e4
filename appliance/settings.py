"""A service's config file: one TOML table read into a frozen dataclass, checked whole.

Every key must be a field of the dataclass and of its default's type (a list of strings
where the default is a list); anything else is a ConfigError naming the file, line and key.
Checks beyond types (ranges, formats) stay with each service's own loader.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TypeVar

from appliance.policy import ConfigError, parse_toml
from appliance.policy.config import Locator

T = TypeVar("T")


def load_table(path: str, table: str, cls: type[T]) -> tuple[T, Locator]:
    """The dataclass `cls` from `[table]` of the TOML file at `path`; raises ConfigError."""
    try:
        text = Path(path).read_text("utf-8")
    except OSError as exc:
        raise ConfigError(path, "", f"cannot read: {exc.strerror}") from None
    data = parse_toml(text, path)
    where = Locator(text)
    for key in data:
        if key != table:
            raise ConfigError(path, key, f"unknown key; expected [{table}]", where.key("", key))
    section = data.get(table, {})
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for key, value in section.items():
        if key not in defaults:
            raise ConfigError(path, f"[{table}] {key}", "unknown key; expected "
                              f"{', '.join(sorted(defaults))}", where.key(table, key))
        expected = type(defaults[key])
        if expected is list:
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        elif expected is bool:
            ok = isinstance(value, bool)
        else:  # TOML's true is not a number here
            ok = isinstance(value, expected) and not isinstance(value, bool)
        if not ok:
            kind = {str: "a string", int: "a whole number", list: "a list of strings",
                    bool: "true or false"}.get(expected, expected.__name__)
            raise ConfigError(path, f"[{table}] {key}", f"must be {kind}, got {value!r}",
                              where.key(table, key))
    return cls(**section), where


def positive(path: str, table: str, config, where: Locator, *keys: str) -> None:
    for key in keys:
        value = getattr(config, key)
        if value < 1:
            raise ConfigError(path, f"[{table}] {key}", f"must be a positive whole number, "
                              f"got {value!r}", where.key(table, key))


def non_empty(path: str, table: str, config, where: Locator, *keys: str) -> None:
    for key in keys:
        if not getattr(config, key):
            raise ConfigError(path, f"[{table}] {key}", "must be a non-empty string",
                              where.key(table, key))
