"""Writing rules into a project's corral.toml on this host: `corral approve --always` and
`corral learn`. Only the CLI writes a project's file (the appliance never does), and only
after showing the change as a diff and being told to.

The edit keeps what a person wrote (comments, order, keys; a list it extends becomes one
item per line): tomlkit, not tomllib, which only reads. The new text must parse as a policy
before it is written; it is written atomically (a temporary file beside it, renamed over
it), keeping the file's mode, and only if the file still holds what the diff was made
against.
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
        if isinstance(container, tomlkit.TOMLDocument):
            _put_top_level(container, key, tomlkit.array())
        else:
            container[key] = tomlkit.array()
        return container[key]
    if not isinstance(value, list):
        raise CliError(f"{path}: {where}{key} is not a list", code=exitcodes.USAGE)
    return value


def _put_top_level(document, key: str, value) -> None:
    """A new top-level key: after the last one there (`description = ...`), or first in the
    file, so that no comment written above a table ends up above it instead. (tomlkit puts it
    right before the first table, after that table's comment.)"""
    import tomlkit

    plain = [i for i, (k, item) in enumerate(document.body)
             if k is not None and not isinstance(item, tomlkit.items.Table | tomlkit.items.AoT)]
    if not plain:
        value.trivia.trail = "\n\n"  # a blank line between it and what was first
    try:
        document._insert_at(plain[-1] + 1 if plain else 0, key, value)
    except AttributeError:  # a tomlkit without it: its own placement
        document[key] = value


def _extend(array, addition: Addition) -> None:
    if addition.rule in [str(item) for item in array]:
        return
    array.multiline(True)
    array.add_line(addition.rule, comment=addition.comment or None)


def diff(path: Path, before: str, after: str) -> str:
    return "".join(difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True),
        fromfile=f"a/{path.name}" if before else "/dev/null", tofile=f"b/{path.name}"))


def policy_of(path: Path, text: str):
    """The file's rules (presets expanded) as a Policy, or None for no file yet. Raises
    CliError naming what is wrong, as `corral check` would."""
    from appliance.policy import Policy
    from appliance.policy.layers import policy_file_rules

    if not text:
        return None
    try:
        return Policy(policy_file_rules(text, str(path), "project"))
    except ValueError as exc:  # ConfigError, RuleError: located in the file
        raise CliError(f"{exc}", f"fix {path} first (`corral check` says what is wrong)",
                       exitcodes.USAGE) from None


def confirm(path: Path, before: str, after: str, yes: bool, as_json: bool) -> bool:
    """Show the change to `path` as a diff and ask (or take --yes), after checking the new
    text is a policy the appliance will take. Returns whether to write it. Raises CliError
    when it may not be written (not a policy; no terminal to ask on; --json without --yes)."""
    try:
        parse_policy(after, str(path), "project")
    except ConfigError as exc:
        raise CliError(f"the change would make {path} unusable: {exc}",
                       "nothing was written; add the rules by hand") from None
    if as_json:
        if not yes:
            raise CliError(f"not written: with --json, {path} is changed only with --yes",
                           code=exitcodes.USAGE)
        return True
    output.line(diff(path, before, after).rstrip("\n"))
    if yes:
        return True
    if not sys.stdin.isatty():
        raise CliError(f"not written: {path} is only changed when you say so",
                       "look at the diff above, then run again with --yes", exitcodes.USAGE)
    drop_typeahead()  # what was typed before the question is no answer to it
    output.notice(f"write this into {path}? [y/N] ")
    if sys.stdin.readline().strip().lower() not in ("y", "yes"):
        output.notice(f"{path} left as it was")
        return False
    return True


def drop_typeahead() -> None:
    try:
        import termios

        termios.tcflush(sys.stdin.fileno(), termios.TCIFLUSH)
    except (ImportError, OSError, ValueError):
        pass


def replace(path: Path, before: str, after: str) -> None:
    """Write `after` over the file, atomically (a temporary file beside it, renamed over it),
    keeping its mode; through a symlink, the file it points to. Refused when the file no
    longer holds `before` (it changed while the diff was read)."""
    target = Path(os.path.realpath(path))
    try:
        now = target.read_text(encoding="utf-8") if target.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {target} again: {exc}") from None
    if now != before:
        raise CliError(f"not written: {target} changed since it was read",
                       "run the command again to see the change against it")
    if path.is_symlink() and not target.parent.is_dir():
        raise CliError(f"not written: {path} is a symlink to {target}, whose directory is "
                       "not there", code=exitcodes.USAGE)
    try:
        _replace(target, after)
    except OSError as exc:
        raise CliError(f"cannot write {target}: {exc.strerror or exc}",
                       "nothing was changed; check the directory's permissions and space"
                       ) from None


def _replace(path: Path, text: str) -> None:
    if path.exists():
        mode = path.stat().st_mode & 0o7777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
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
    """The project's corral.toml and its text ("" when there is none yet; through a symlink,
    the file it points to)."""
    path = project / "corral.toml"
    try:
        return path, path.read_text(encoding="utf-8") if path.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}", code=exitcodes.USAGE) from None
