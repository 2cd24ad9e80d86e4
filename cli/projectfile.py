"""Writing rules into a project's corral.toml on this host: `corral approve --always` and
`corral learn`. Only the CLI writes a project's file (the appliance never does), and only
after showing the change as a diff and being told to.

The edit keeps what a person wrote (comments, order, layout): tomlkit, not tomllib, which
only reads. The new text must parse as a policy before it is written, and is written
atomically (a temporary file beside it, renamed over it), keeping the file's mode.
"""

from __future__ import annotations

import difflib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from appliance.policy.config import ConfigError, parse_policy

from . import exitcodes, output
from .client import CliError

KINDS = ("http", "dns", "tcp")
"""The rule kinds a grant or a proposal adds: `[KIND] allow = [...]`."""


@dataclass(frozen=True)
class Addition:
    kind: str
    """http, dns or tcp; or `preset` (a name for the top-level `presets`)."""
    rule: str
    comment: str = ""
    """Why it is proposed (how often, by what): a comment at the end of its line."""


def added(text: str, additions: list[Addition], path: str = "corral.toml") -> str:
    """`text` (a corral.toml, or "" for none yet) with these rules and presets added: each to
    its table's list, once (one already there is left as it is). Raises CliError when the
    text is not TOML, or a key to extend is not a list."""
    try:
        import tomlkit  # comes with corral[host]; only these commands need it
    except ImportError:
        raise CliError("writing corral.toml needs tomlkit, which is not installed",
                       "pip install tomlkit (it comes with corral[host])") from None
    try:
        document = tomlkit.parse(text)
    except tomlkit.exceptions.ParseError as exc:
        raise CliError(f"{path}: {exc}", "fix the file (`corral check` says what is wrong)",
                       exitcodes.USAGE) from None
    for addition in additions:
        if addition.kind == "preset":
            _extend(_list(document, "presets", path), addition)
            continue
        if addition.kind not in KINDS:
            raise ValueError(f"not a kind a grant adds: {addition.kind!r}")
        table = document.get(addition.kind)
        if table is None:
            table = tomlkit.table()
            document.append(addition.kind, table)
        elif not isinstance(table, dict):
            raise CliError(f"{path}: {addition.kind} is not a table", code=exitcodes.USAGE)
        _extend(_list(table, "allow", path, f"[{addition.kind}] "), addition)
    return tomlkit.dumps(document)


def _list(container, key: str, path: str, where: str = ""):
    import tomlkit

    value = container.get(key)
    if value is None:
        value = tomlkit.array()
        if key == "presets" and isinstance(container, tomlkit.TOMLDocument):
            _put_first(container, key, value)
        else:
            container[key] = value
        return container[key]
    if not isinstance(value, list):
        raise CliError(f"{path}: {where}{key} is not a list", code=exitcodes.USAGE)
    return value


def _put_first(document, key: str, value) -> None:
    """A top-level key goes before every table (after one it would belong to that table)."""
    rest = [(k, document[k]) for k in list(document.keys())]
    for k, _ in rest:
        del document[k]
    document[key] = value
    for k, v in rest:
        document[k] = v


def _extend(array, addition: Addition) -> None:
    if addition.rule in [str(item) for item in array]:
        return
    array.multiline(True)
    array.add_line(addition.rule, comment=addition.comment or None)


def diff(path: Path, before: str, after: str) -> str:
    return "".join(difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True),
        fromfile=f"a/{path.name}" if before else "/dev/null", tofile=f"b/{path.name}"))


def write(path: Path, before: str, after: str, yes: bool, as_json: bool) -> bool:
    """Show the change to `path` as a diff, ask (or take --yes), check the new text is a
    policy the appliance will take, and write it atomically. Returns whether it was written.
    Raises CliError when it may not be written (not a policy, no terminal to ask on)."""
    try:
        parse_policy(after, str(path), "project")
    except ConfigError as exc:
        raise CliError(f"the change would make {path} unusable: {exc}",
                       "nothing was written; add the rules by hand") from None
    if not as_json:
        output.line(diff(path, before, after).rstrip("\n"))
    if not yes:
        if not sys.stdin.isatty():
            raise CliError(f"not written: {path} is only changed when you say so",
                           "look at the diff above, then run again with --yes",
                           exitcodes.USAGE)
        output.notice(f"write this into {path}? [y/N] ")
        if sys.stdin.readline().strip().lower() not in ("y", "yes"):
            output.notice(f"{path} left as it was")
            return False
    _replace(path, after)
    return True


def _replace(path: Path, text: str) -> None:
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:  # the original stays as it was; the half-written copy goes
        Path(temporary).unlink(missing_ok=True)
        raise


def read(project: Path) -> tuple[Path, str]:
    """The project's corral.toml and its text ("" when there is none yet)."""
    path = project / "corral.toml"
    try:
        return path, path.read_text(encoding="utf-8") if path.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}", code=exitcodes.USAGE) from None
