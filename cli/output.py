"""The only module of the CLI that prints: human tables by default, JSON for scripts.

Everything written goes through cli/render.py: the cells of a table and the fields of an
event as values from the appliance (`render.text`, `render.host`), the CLI's own lines
through `render.prose` (whatever was quoted in them). JSON is ASCII with every control
escaped, so `--json` carries nothing a terminal acts on either. `decision()` draws the
lines of what a person is deciding, each starting with a mark no rendered value holds.
"""

from __future__ import annotations

import json
import os
import sys

from appliance.event import decode

from . import render

MARK = "\u25b6"
"""Starts each line of a decision (`corral monitor --ask`): render.text() shows every
character beyond ASCII as an escape, so no value from a session can draw it."""
MARK_ASCII = ">>"
"""The mark where the terminal's encoding has no MARK (then only colour sets it apart)."""
REVERSE = "\033[7m"
RESET = "\033[0m"


def data(value) -> None:
    """Machine-readable output for --json."""
    sys.stdout.write(json.dumps(value, indent=2, ensure_ascii=True) + "\n")


def table(rows: list[list], header: list[str]) -> None:
    """Rows of values from the appliance (each cell drawn by render.text) under a header."""
    shown = [[render.text(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in [header, *shown]) for i in range(len(header))]
    for row in [header, *shown]:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                         .rstrip() + "\n")


def line(text: str = "") -> None:
    sys.stdout.write(render.prose(text) + "\n")


def error(message: str, hint: str = "") -> None:
    sys.stderr.write(f"corral: error: {render.prose(message)}\n")
    if hint:
        sys.stderr.write(f"corral: hint: {render.prose(hint)}\n")


def data_line(value) -> None:
    """One JSON object per line, flushed: for streams (`monitor --json`)."""
    sys.stdout.write(json.dumps(value, separators=(",", ":"), ensure_ascii=True) + "\n")
    sys.stdout.flush()


def warning(text: str) -> None:
    """A notice that must not be missed: red on a terminal (NO_COLOR respected)."""
    red = sys.stderr.isatty() and "NO_COLOR" not in os.environ
    text = render.prose(text)
    sys.stderr.write(f"\033[1;31mcorral: {text}\033[0m\n" if red else f"corral: {text}\n")
    sys.stderr.flush()


def notice(text: str) -> None:
    sys.stderr.write(f"corral: {render.prose(text)}\n")
    sys.stderr.flush()


_COLORS = {"allow": "\033[32m", "deny": "\033[31m", "error": "\033[33m",
           "pending": "\033[1;35m"}
REASON_WIDTH = 300
"""Characters of an event's reason or hint shown (the appliance keeps at most as many of an
agent's words; `--json` and the audit log have the rest)."""


def event(e: dict, color: bool = False) -> None:
    """One decision, one line: time, session, verdict, kind, target, reason, and the fix;
    every field as render draws it, whatever the appliance sent. Read by the names of the
    filter's event SCHEMA (appliance/event.py; a unit test holds this to them)."""
    import datetime

    e = decode(e)
    ts = e.get("ts", 0)
    when = datetime.datetime.fromtimestamp(ts if isinstance(ts, int | float) else 0)
    verdict = e.get("verdict", "?")
    verdict_text = "done" if e.get("closed") else render.text(verdict).upper()
    # an approval's: what a grant allows
    target = render.host(e.get("name") or e.get("target") or "-", e.get("port") or None)
    detail = render.text(e.get("reason") or "", REASON_WIDTH)
    if e.get("closed"):
        detail = render.text(f"{e.get('up', 0)} B up, {e.get('down', 0)} B down, "
                             f"{e.get('duration', 0)}s")
    text = (f"{when:%H:%M:%S} {render.text(e.get('session') or '-'):<10} {verdict_text:<5} "
            f"{render.text(e.get('kind', '?')):<8} {target:<40} {detail}")
    if verdict != "allow" and e.get("hint") and not e.get("closed"):
        text += f"  -> {render.text(e['hint'], REASON_WIDTH)}"
    if color and verdict in _COLORS and not e.get("closed"):
        text = f"{_COLORS[verdict]}{text}{RESET}"
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def decision(lines: list[str], color: bool = False) -> None:
    """What a person decides, drawn by the CLI: each line starts with the mark, which no
    value drawn by render can hold (in reverse video too, with colour). The lines are the
    CLI's own, with every value in them drawn by render already."""
    mark = MARK if _encodes(MARK) else MARK_ASCII
    for text in lines:
        text = f"{mark} {render.prose(text)}"
        sys.stdout.write((f"{REVERSE}{text}{RESET}" if color else text) + "\n")
    sys.stdout.flush()


def _encodes(text: str) -> bool:
    try:
        text.encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True
