"""The reference site (docs/, mkdocs.yml): it builds in strict mode, and it documents every
`corral` command, every `corral.toml` key, every key of the filter's config and every probe
of the battery. The lists come from the code that accepts them (the CLI's parser, the
policy parser's KEYS, the filter config's schema, the battery's registry), never from a list
kept by hand, so a new command or key without its documentation fails here by name."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import appliance.selftest  # noqa: F401  (the probes register themselves on import)
from appliance.policy.config import GIT, INSPECT, KEYS
from appliance.selftest.registry import REGISTRY
from appliance.sessionconfig import schema as filter_schema
from cli.main import parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MKDOCS = Path(sys.executable).parent / "mkdocs"


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    if not MKDOCS.exists():
        pytest.fail(f"{MKDOCS} is missing: scripts/setup installs it (the test extra)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([str(MKDOCS), "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, env=env,
                          capture_output=True, text=True, timeout=300)


def warnings(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines()
            if line.startswith(("WARNING", "ERROR"))]


def test_the_site_builds_in_strict_mode_without_a_warning(tmp_path):
    result = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0 and not warnings(result), result.stdout + result.stderr
    assert (tmp_path / "site" / "dashboard" / "approvals.png").exists()
    assert '<pre class="mermaid">' in (tmp_path / "site" / "index.html").read_text()


def test_a_broken_link_or_a_page_left_out_of_the_nav_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / name, copy / name)
    with (copy / "docs" / "policy.md").open("a") as page:
        page.write("\nSee [the gone page](gone.md) and [a missing part](cli.md#no-such-part).\n")
    (copy / "docs" / "orphan.md").write_text("# Nobody links here\n")
    result = build(copy / "mkdocs.yml", tmp_path / "site")
    said = result.stdout + result.stderr
    assert result.returncode != 0, said
    assert warnings(result), said
    assert "gone.md" in said and "no-such-part" in said and "orphan.md" in said, said


def test_the_readme_opens_with_the_two_commands_then_the_quick_start():
    """CI and the harness run the README's test command (`.ci/run`: scripts/test)."""
    readme = (ROOT / "README.md").read_text()
    assert readme.startswith("# corral\n\n```sh\nscripts/run\nscripts/test\n```\n\n"), readme[:80]
    first_heading = re.search(r"^## .*$", readme, re.MULTILINE)
    assert first_heading and first_heading[0] == "## Quick start", first_heading


def test_every_link_in_the_readme_reaches_a_file():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert targets and not missing, f"README.md links to what is not there: {missing}"


def docs_text() -> str:
    return "\n".join(page.read_text() for page in sorted(DOCS.rglob("*.md")))


def commands(command: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every command path the parser takes: ('run',), ('secret', 'set'), ..."""
    for action in command._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name)
                yield from commands(sub, (*path, name))


def test_the_walk_finds_nested_commands():
    found = set(commands(parser()))
    assert {("run",), ("secret", "set"), ("certs", "rotate"), ("image", "build"),
            ("box", "build")} <= found


def test_every_corral_command_is_documented():
    text = docs_text()
    missing = [" ".join(path) for path in commands(parser())
               if not re.search(r"\bcorral\s+" + r"\s+".join(map(re.escape, path)) + r"(?![\w-])",
                                text)]
    assert not missing, f"commands not in docs/ (write `corral COMMAND` on a page): {missing}"


def blocks(text: str):
    """(toml code, prose) pieces of a page: each TOML code block whole; outside code, each
    paragraph, and each table row alone."""
    fence, code, paragraph = None, [], []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if fence is None:
                fence, code = line.strip().strip("`").strip(), []
            else:
                if fence == "toml":
                    yield "\n".join(code), ""
                fence = None
            continue
        if fence is not None:
            code.append(line)
        elif line.lstrip().startswith("|"):
            yield None, line
        elif line.strip():
            paragraph.append(line)
        else:
            yield None, "\n".join(paragraph)
            paragraph = []
    yield None, "\n".join(paragraph)


def toml_keys(code: str) -> set[tuple[str, str]]:
    """(table, key) for every assignment in a TOML example; "" is the top level."""
    table, found = "", set()
    for line in code.splitlines():
        header = re.match(r"\s*\[\[?([\w.-]+)\]\]?", line)
        if header:
            table = header[1]
            continue
        key = re.match(r"\s*([\w-]+)\s*=", line)
        if key:
            found.add((table, key[1]))
    return found


def documented(keys: dict[str, set[str] | tuple[str, ...]], arrays: set[str]) -> list[str]:
    """The `[table] key`s no page documents: in a TOML example under its table, or in a
    paragraph or table row that names the table and the key (`[table] key`, or `[table]`
    and `key` in backticks)."""
    shown: set[tuple[str, str]] = set()
    prose: list[str] = []
    for page in sorted(DOCS.rglob("*.md")):
        for code, text in blocks(page.read_text()):
            if code is not None:
                shown |= toml_keys(code)
            elif text:
                prose.append(text)
    missing = []
    for table, names in keys.items():
        label = f"[[{table}]]" if table in arrays else f"[{table}]"
        for key in sorted(names):
            if (table, key) in shown:
                continue
            if table and any(label in p and (f"{label} {key}" in p or f"`{key}`" in p)
                             for p in prose):
                continue
            missing.append(f"{label} {key}" if table else key)
    return missing


def test_every_corral_toml_key_is_documented():
    missing = documented(KEYS, arrays={INSPECT, GIT})
    assert not missing, f"corral.toml keys not in docs/ (top level without a table): {missing}"


def test_every_key_of_the_filters_config_is_documented():
    missing = documented(filter_schema(), arrays={"session"})
    assert not missing, f"corral-filter config keys not in docs/: {missing}"


def test_every_probe_of_the_battery_is_on_the_threats_page():
    page = (DOCS / "threats.md").read_text()
    missing = [p.id for p in REGISTRY if f"`{p.id}`" not in page]
    assert not missing, f"probes not in docs/threats.md: {missing}"
