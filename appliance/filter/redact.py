"""Secret values out of everything the filter says. Sans-IO.

The filter quotes what it is sent in its reasons: a malformed field, a request line, a path
refused by a request rule, a DNS name. What it is sent may hold a secret's value: a bound
host's response that quotes the `Authorization` the filter attached (a malformed trailer
line, say), or a value an agent came to hold and writes into a name. A reason goes to the
client (an agent, who must never learn a value), to events and to the hash-chained audit
log (where it can never be scrubbed), and to the filter's log. So every text leaves
through one of four doors, and each door passes it through the same `Redactor`, built
once per snapshot of the secrets (proxy/credentials.py):

- the event bus (`EventBus.emit`: subscribers, the recent ring, the audit log);
- the proxy's own answers (`pipeline.response`, which every 403, 4xx and 5xx is built by);
- the control socket's answers (approvals and status quote what sessions sent);
- the filter's log records (`LogFilter`).

(Two more go to a client unredacted, as they quote only what that client sent or what an
ssh upstream, which is never given an HTTP secret, said: git's report of a refused push,
over HTTPS and the git gateway, naming its refs and options, and the gateway's lines to
the ssh client. The event of the same refusal passes the bus.)

A value is replaced by `[secret NAME]` in every form it travels in (as written; as basic
auth encodes it; percent-encoded; escaped as `repr` writes it inside either quote, and as
JSON writes it), in any letter case (the filter upper-cases override methods and
lower-cases host names it quotes), and so is any run of at least `MIN_VALUE` of its first
characters: reasons cut what they quote (`line[:60]`), and a cut keeps a value's
beginning.
"""

from __future__ import annotations

import json
import logging
import string
from collections.abc import Callable, Mapping
from urllib.parse import quote

from .secrets import MIN_VALUE


class Redactor:
    """Replaces the secrets' values in text; falsy when there are none (then free)."""

    __slots__ = ("_forms", "_heads")

    def __init__(self, values: Mapping[str, bytes] | None = None):
        forms: dict[str, str] = {}
        for name, value in (values or {}).items():
            text = value.decode("latin-1")
            if len(text) < MIN_VALUE:
                continue
            escaped = text.replace("\\", "\\\\")
            for form in (text, escaped, escaped.replace("'", "\\'"),  # repr, in " or '
                         json.dumps(text)[1:-1], quote(text, safe=""),
                         quote(text, safe="/:@!$&'()*+,;=")):
                forms.setdefault(form.translate(_FOLD), name)
        self._forms = sorted(forms.items(), key=lambda item: -len(item[0]))
        self._heads = tuple(form[:MIN_VALUE] for form, _ in self._forms)

    def __bool__(self) -> bool:
        return bool(self._forms)

    def text(self, text: str) -> str:
        """`text` with every value, and every cut-off beginning of one, replaced (in any
        letter case: the forms are kept folded, and looked for in the text folded). Where
        forms share a beginning, the longest run found is replaced, not the first form's."""
        if not self._forms:
            return text
        folded = text.translate(_FOLD)  # ASCII only: every character keeps its place
        if not any(head in folded for head in self._heads):
            return text
        runs = sorted(run for form, name in self._forms for run in _runs(folded, form, name))
        out, done = [], 0
        for start, end, name in runs:
            if start >= done:
                out += [text[done:start], f"[secret {name}]"]
            done = max(done, end)  # a run overlapping the last one widens what it covers
        out.append(text[done:])
        return "".join(out)

    def fields(self, record: dict) -> dict:
        """A flat record (an event, a control answer) with its strings redacted, in place
        (nested lists and dicts too); the same dict."""
        if self._forms:
            for key, value in record.items():
                record[key] = self._value(value)
        return record

    def _value(self, value):
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return self.fields(value)
        if isinstance(value, list | tuple):
            return type(value)(self._value(v) for v in value)
        return value


_FOLD = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def _runs(folded: str, form: str, name: str) -> list[tuple[int, int, str]]:
    """(start, end, name) of each run of `form`'s characters from its start, MIN_VALUE
    long or more, in `folded`."""
    head, found, at = form[:MIN_VALUE], [], folded.find(form[:MIN_VALUE])
    while at >= 0:
        end = at + MIN_VALUE
        while end < len(folded) and end - at < len(form) and folded[end] == form[end - at]:
            end += 1
        found.append((at, end, name))
        at = folded.find(head, end)
    return found


NONE = Redactor()


class LogFilter(logging.Filter):
    """A log handler's filter that redacts each record's message and traceback with the
    redactor in force (`current`, asked per record: secrets change while the filter runs)."""

    def __init__(self, current: Callable[[], Redactor]):
        super().__init__()
        self.current = current

    def filter(self, record: logging.LogRecord) -> bool:
        redactor = self.current()
        if redactor:
            try:
                message = record.getMessage()
            except (TypeError, ValueError):  # a call whose arguments do not fit its format:
                message = f"{record.msg!r} % {record.args!r}"  # said, never raised at it
            record.msg, record.args = redactor.text(message), None
            if record.exc_info:
                record.exc_text = redactor.text(logging.Formatter().formatException(
                    record.exc_info))
                record.exc_info = None
        return True
