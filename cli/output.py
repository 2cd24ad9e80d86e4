"""The only module of the CLI that prints: human tables by default, JSON for scripts."""

from __future__ import annotations

import json
import sys


def data(value) -> None:
    """Machine-readable output for --json."""
    sys.stdout.write(json.dumps(value, indent=2) + "\n")


def table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        sys.stdout.write("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True))
                         .rstrip() + "\n")


def line(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def error(message: str, hint: str = "") -> None:
    sys.stderr.write(f"corral: error: {message}\n")
    if hint:
        sys.stderr.write(f"corral: hint: {hint}\n")


def data_line(value) -> None:
    """One JSON object per line, flushed: for streams (`monitor --json`)."""
    sys.stdout.write(json.dumps(value, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def warning(text: str) -> None:
    """A notice that must not be missed: red on a terminal (NO_COLOR respected)."""
    import os

    red = sys.stderr.isatty() and "NO_COLOR" not in os.environ
    sys.stderr.write(f"\033[1;31mcorral: {text}\033[0m\n" if red else f"corral: {text}\n")
    sys.stderr.flush()


def notice(text: str) -> None:
    sys.stderr.write(f"corral: {text}\n")
    sys.stderr.flush()


_COLORS = {"allow": "\033[32m", "deny": "\033[31m", "error": "\033[33m",
           "pending": "\033[1;35m"}


def event(e: dict, color: bool = False) -> None:
    """One decision, one line: time, session, verdict, kind, target, reason, and the fix."""
    import datetime

    when = datetime.datetime.fromtimestamp(e.get("ts", 0)).strftime("%H:%M:%S")
    verdict = e.get("verdict", "?")
    verdict_text = "done" if e.get("closed") else verdict.upper()
    target = e.get("name") or e.get("target") or "-"  # an approval's: what a grant allows
    if e.get("port"):
        target = f"{target}:{e['port']}"
    detail = e.get("reason") or ""
    if e.get("closed"):
        detail = f"{e.get('up', 0)} B up, {e.get('down', 0)} B down, {e.get('duration', 0)}s"
    text = (f"{when} {e.get('session') or '-':<10} {verdict_text:<5} {e.get('kind', '?'):<8} "
            f"{target:<40} {detail}")
    if verdict != "allow" and e.get("hint") and not e.get("closed"):
        text += f"  -> {e['hint']}"
    if color and verdict in _COLORS and not e.get("closed"):
        text = f"{_COLORS[verdict]}{text}\033[0m"
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
