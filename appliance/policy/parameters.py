"""Presets that take parameters: what the file naming one must say, and how it is put in.

A preset that writes to "any repository" lets an agent act where nobody looked: comment-
triggered bots merge what a comment on any pull request asks. Such a preset names its
parameters in a `[parameters]` table, and the file naming it gives them:

    presets = ["pypi", {name = "github-pr", repos = ["acme/widget", "acme/tools-*"]}]

In the preset, `{repos}` in a string stands for each value: a list item that holds it is
written once per repository (`"POST /repos/{repos}/pulls"`). A preset that takes
parameters and is named without them is an error naming the fix, never a preset that
acts everywhere. Pure: the checks raise ParameterError, which config.py and layers.py
locate in the file (file, line, key).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PARAMETERS = "parameters"
"""A preset's table of parameters: NAME = "what the values are"."""


@dataclass(frozen=True)
class Form:
    """What one parameter's values must be."""

    pattern: re.Pattern
    """A value, whole."""
    shape: str
    """The form, as an error says it (`'x' is not OWNER/REPO`)."""
    example: str
    """A value list as a fix writes it."""
    acts: str
    """What a preset that takes it does: `acts on the repositories you name`."""

    def check(self, value: str) -> bool:
        """Of the form, and no path segment a router reads another way (`.`, `..`, `**`)."""
        return bool(self.pattern.fullmatch(value)) and not any(
            part in (".", "..") or "**" in part for part in value.split("/"))


FORMS = {
    "repos": Form(re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.*-]*[A-Za-z0-9_.-]"
                             r"[A-Za-z0-9_.*-]*"),
                  "OWNER/REPO (a `*` within REPO: `acme/tools-*`; the owner is always named)",
                  '["OWNER/REPO"]', "acts on the repositories you name"),
}
"""The parameters a preset may declare, and the form of their values."""


class ParameterError(ValueError):
    """A preset reference or its parameters cannot be used; the message says why."""


@dataclass(frozen=True)
class PresetRef:
    """A preset a policy file names, with the parameters it gives."""

    name: str
    arguments: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(parameter, values), in the order written."""
    line: int | None = field(default=None, compare=False)
    """The line of the file's `presets` key (errors found later point there)."""


def parse_refs(value) -> list[PresetRef]:
    """The `presets` list: names, or tables `{name = "...", PARAMETER = [...]}`."""
    if not isinstance(value, list):
        raise ParameterError("must be a list of preset names (a preset that takes parameters "
                             'as a table: {name = "github-pr", repos = ["OWNER/REPO"]})')
    refs = []
    for item in value:
        if isinstance(item, str):
            refs.append(PresetRef(item))
            continue
        if not isinstance(item, dict):
            raise ParameterError(f"{item!r} is neither a preset's name nor a table "
                                 '{name = "...", PARAMETER = [...]}')
        name = item.get("name")
        if not isinstance(name, str):
            raise ParameterError('a table names its preset: {name = "github-pr", repos = '
                                 '["OWNER/REPO"]}')
        arguments = []
        for key, values in item.items():
            if key == "name":
                continue
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise ParameterError(f"{name}: {key}: must be a list of strings")
            arguments.append((key, tuple(values)))
        refs.append(PresetRef(name, tuple(arguments)))
    return refs


def declared(data: dict, preset: str) -> dict[str, str]:
    """A preset's `[parameters]` (NAME -> what the values are), checked."""
    table = data.get(PARAMETERS, {})
    if not isinstance(table, dict) or not all(
            isinstance(k, str) and k in FORMS and isinstance(v, str) for k, v in table.items()):
        raise ParameterError(f"preset {preset!r}: [parameters] must map names among "
                             f"{', '.join(FORMS)} to what their values are")
    return table


def arguments(ref: PresetRef, parameters: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """The values `ref` gives each of the preset's parameters, checked: every parameter
    given, none other, each value of its form."""
    given = dict(ref.arguments)
    if given and not parameters:
        raise ParameterError(f"{ref.name} takes no parameters: name it as \"{ref.name}\"")
    for key in given:
        if key not in parameters:
            raise ParameterError(f"{ref.name}: unknown parameter {key!r}; it takes "
                                 f"{', '.join(parameters)}")
    for key, what in parameters.items():
        form = FORMS[key]
        if key not in given:
            raise ParameterError(
                f"preset {ref.name!r} {form.acts} ({key}: {what}); write presets = "
                f'[{{name = "{ref.name}", {key} = {form.example}}}]. Named alone it would '
                "act on any of them, which it no longer does")
        if not given[key]:
            raise ParameterError(f"{ref.name}: {key}: name at least one ({what})")
        for value in given[key]:
            if not form.check(value):
                raise ParameterError(f"{ref.name}: {key}: {value!r} is not {form.shape}")
    return given


def expand(data, values: dict[str, tuple[str, ...]]):
    """`data` (a preset's TOML, as tomllib reads it) with each list item that holds
    `{NAME}` written once per value of NAME."""
    if isinstance(data, dict):
        return {k: expand(v, values) for k, v in data.items()}
    if isinstance(data, list):
        out = []
        for item in data:
            if isinstance(item, str):
                out.extend(_each(item, values))
            else:
                out.append(expand(item, values))
        return out
    return data


def _each(text: str, values: dict[str, tuple[str, ...]]) -> list[str]:
    texts = [text]
    for name, given in values.items():
        mark = "{" + name + "}"
        texts = [t.replace(mark, value) for t in texts for value in given] if any(
            mark in t for t in texts) else texts
    return texts
