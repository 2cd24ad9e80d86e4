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
