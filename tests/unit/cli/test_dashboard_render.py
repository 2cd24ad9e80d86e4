"""The dashboard draws text from the appliance as the CLI does: static/render.js against
cli/render.py, character for character, on hostile strings and on a seeded random corpus
(run in node, the JavaScript engine Debian ships); and dashboard.js gives a text node
nothing but a literal of its own or what shown() drew, and never writes markup."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
from importlib import resources

import pytest

from cli import render
from tests.unit.cli.test_render import HOSTILE

NODE = shutil.which("node") or shutil.which("nodejs")
STATIC = resources.files("cli.dashboard").joinpath("static")
ALPHABET = [
    *(chr(c) for c in range(0x00, 0x100)), " ", " ", " ", "a", "\\",
    "\u061c", "\u180e", "\u200b", "\u200d", "\u200e", "\u2028", "\u2029", "\u202a", "\u202e",
    "\u2066", "\u2069", "\u0430", "\u0456", "\u05d0", "\ufeff", "\ufffd", "\U0001f600",
    "\U000e0041", "\udc80", "\udcff", "\ud800", "\udfff",
]


def corpus(seed: int = 26, count: int = 3000) -> list[str]:
    rng = random.Random(seed)
    return [*HOSTILE, "", "plain.example", "a  b", "a   b", *(
        "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40)))
        for _ in range(count))]


def in_node(cases: list[list]) -> list[str]:
    """render.js's text(value, width) for each [value, width], in one node process."""
    script = STATIC.joinpath("render.js").read_text() + """
const cases = JSON.parse(require("fs").readFileSync(0, "utf8"));
process.stdout.write(JSON.stringify(cases.map(([value, width]) => shown(value, width))));
"""
    done = subprocess.run([NODE, "-e", script], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout)


@pytest.mark.skipif(NODE is None, reason="node is not installed (Debian: nodejs)")
def test_the_page_draws_every_string_as_the_cli_does():
    strings = corpus()
    cases = [[s, None] for s in strings] + [[s, w] for s in strings[:800]
                                            for w in (3, 8, 20)]
    drawn = in_node(cases)
    expected = [render.text(value, width) for value, width in cases]
    wrong = [(value, width, got, want) for (value, width), got, want
             in zip(cases, drawn, expected, strict=True) if got != want]
    assert not wrong, ascii(wrong[:5])


def test_the_page_gives_text_nodes_only_literals_or_what_shown_drew():
    code = STATIC.joinpath("dashboard.js").read_text()
    for markup in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write",
                   "createContextualFragment", "DOMParser", ".srcdoc", "eval("):
        assert markup not in code, markup
    given = re.findall(r"\.textContent\s*=\s*([^;]+);", code)
    assert given, "no text node found: the check reads nothing"
    for value in given:
        assert re.fullmatch(r'(shown\(.*\)|"[^"$`]*"|[a-z.]+ \? "[^"]*" : "[^"]*")', value,
                            re.S), value
    for asked in re.findall(r"confirm\((`[^`]*`(?:\s*\+\s*`[^`]*`)*)", code):
        for placed in re.findall(r"\$\{([^}]*)\}", asked):
            assert placed == "ask" or placed.startswith("shown("), (asked, placed)
    page = STATIC.joinpath("index.html").read_text()
    assert page.index("/static/render.js") < page.index("/static/dashboard.js")


@pytest.mark.skipif(NODE is None, reason="node is not installed (Debian: nodejs)")
def test_the_pages_scripts_load_together_as_a_browser_loads_them():
    """Classic scripts share one global scope: a name declared in two of them stops the
    second from running at all (the whole page then shows nothing)."""
    page = STATIC.joinpath("index.html").read_text()
    names = re.findall(r'<script src="/static/([^"]+)"', page)
    assert names[0] == "render.js" and "dashboard.js" in names
    script = """
const vm = require("vm");
const context = vm.createContext({});
for (const [name, code] of JSON.parse(require("fs").readFileSync(0, "utf8"))) {
  try { new vm.Script(code, { filename: name }).runInContext(context); }
  catch (error) { if (error.name === "SyntaxError") console.log(`${name}: ${error}`); }
}
"""
    sources = [[name, STATIC.joinpath(name).read_text()] for name in names]
    done = subprocess.run([NODE, "-e", script], input=json.dumps(sources), capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout == "", done.stdout
