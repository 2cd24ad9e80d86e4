"""Text that came from a session, as a person's terminal shows it: the CLI's one renderer.

Whatever the appliance sends may hold what an agent wrote: a DNS label, a Host header or
SNI, a path, a header, the reason it gave, a file name. A terminal acts on some of it
(ESC and CSI sequences, OSC 8 links and OSC 52 clipboard writes, title changes, C1
controls such as a raw 0x9b CSI, CR and backspace that redraw a line), and shows other
parts as something they are not (bidi overrides and isolates that reorder text, zero-width
and invisible characters, line and paragraph separators, letters from another script that
look like Latin ones, runs of spaces that push the rest onto a line of its own). So every
such value is drawn through `text()` (or `host()` for a name), whatever the appliance
sent, and comes out as printable ASCII on one line:

  - printable ASCII stays as it is (a backslash too: the escapes below are for showing,
    not for reading back);
  - `\\n`, `\\r`, `\\t`; other C0 and C1 controls, DEL and each byte that was not UTF-8 as
    `\\xNN`; every other character beyond ASCII as `\\uNNNN` (`\\UNNNNNNNN` past the BMP);
  - a run of RUN spaces or more as `[N spaces]`;
  - cut at `width` (then ending in `...`) where a place in a table or a line is bounded.

A host name's labels beyond ASCII are shown in their IDNA form (`xn--...`, what the name
really is on the wire), or escaped when they have none.

`prose()` is the backstop for the CLI's own lines, which may quote a value someone forgot
to draw through `text()`: lines are kept, tabs too, and every other character a terminal
would act on or hide is escaped as above. Only cli/output.py writes to the terminal, and it
runs everything it writes through one of these.
"""

from __future__ import annotations

import re
import unicodedata

RUN = 3
"""Spaces in a row from which the run is shown as its count."""
_SPACES = re.compile(f" {{{RUN},}}")
_PLAIN = re.compile(r"[!-~]+| ")  # printable ASCII, or a space (runs are matched first)
_SIMPLE = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape(ch: str) -> str:
    """One character as a visible escape."""
    if ch in _SIMPLE:
        return _SIMPLE[ch]
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _pieces(value: str) -> list[str]:
    """`value` as shown, in pieces that a cut never splits (an escape, a run's count)."""
    out: list[str] = []
    at = 0
    while at < len(value):
        run = _SPACES.match(value, at)
        if run:
            out.append(f"[{run.end() - at} spaces]")
            at = run.end()
            continue
        plain = _PLAIN.match(value, at)
        if plain:
            out.extend(plain.group())
            at = plain.end()
            continue
        out.append(escape(value[at]))
        at += 1
    return out


def _cut(pieces: list[str], width: int | None) -> str:
    whole = "".join(pieces)
    if width is None or len(whole) <= width:
        return whole
    kept, size = [], 0
    for piece in pieces:
        if size + len(piece) > width - 3:
            break
        kept.append(piece)
        size += len(piece)
    return "".join(kept) + "..."


def text(value: object, width: int | None = None) -> str:
    """Any value from the appliance (None as `-`) as one line of printable ASCII, at most
    `width` characters when given."""
    if value is None:
        return "-"
    value = value if isinstance(value, str) else str(value)
    if value.isascii() and value.isprintable() and " " * RUN not in value:
        return value if width is None or len(value) <= width else _cut(list(value), width)
    return _cut(_pieces(value), width)


_PORT = re.compile(r"(.*?)(:[0-9]{1,5})?", re.DOTALL)


def host(value: object, port: object = None) -> str:
    """A host name (or `name:port`, `[v6]:port`, an address) as one line of printable
    ASCII: labels beyond ASCII in their IDNA form, anything else escaped as text() does,
    spaces too (no name holds one). Never cut: what a person decides on is shown whole."""
    if value is None:
        return "-"
    value = value if isinstance(value, str) else str(value)
    if port is not None:
        value = f"{value}:{port}"
    if value.isascii() and value.isprintable() and " " not in value:
        return value
    name, suffix = _PORT.fullmatch(value).groups()
    if name.startswith("["):  # an IPv6 literal: no labels to convert
        return _name_text(value)
    return ".".join(_label(label) for label in name.split(".")) + _name_text(suffix or "")


def _label(label: str) -> str:
    if not label.isascii():
        try:
            if unicodedata.normalize("NFC", label) == label and label.isprintable():
                ascii_form = label.encode("idna").decode("ascii")
                if ascii_form.isascii() and ascii_form.isprintable():
                    return _name_text(ascii_form)
        except UnicodeError:
            pass
    return _name_text(label)


def _name_text(value: str) -> str:
    return "".join(ch if "!" <= ch <= "~" else escape(ch) for ch in value)


def prose(value: str) -> str:
    """The CLI's own text, as it is written to the terminal: its lines and tabs kept, every
    character a terminal acts on or hides escaped (a value quoted in it that did not come
    through text() cannot move the cursor, rewrite a line or reorder one)."""
    if value.isprintable() or all(ch in "\n\t" or ch.isprintable() for ch in value):
        return value
    return "".join(ch if ch in "\n\t" or ch.isprintable() else escape(ch) for ch in value)
