"""The other methods and paths a request asks its origin to read it as. Sans-IO.

A `POST` that says `X-HTTP-Method-Override: DELETE` is a DELETE to Rack (Rails, GitLab),
Express's method-override, Symfony and Laravel, ASP.NET and Google's APIs; a `_method`
field in its form or JSON body is one to Rack, Symfony, Laravel and Spring's
HiddenHttpMethodFilter; `X-Original-URL` and `X-Rewrite-URL` route it by another path on
Symfony (before 5) and IIS's URL Rewrite. A host's request rules judge every one of them
(pipeline.judge_request), so each is found here the way those stacks find it:

- **Field names** as CGI, WSGI and Puma read them: case-folded, `_` and `-` one character
  (`X_HTTP_Method_Override` is HTTP_X_HTTP_METHOD_OVERRIDE to all of them).
- **Parameter names** (query and form body) as PHP-style parsers key them: leading spaces
  dropped, ` ` and `.` read as `_`, a `[` without its `]` read as `_`, an array's `[...]`
  left off (`_method[]` is still `_method`), any letter case (fail closed: Rack and PHP
  compare exactly, and judging one more spelling only refuses more). `+` is a space and
  escapes are decoded, as form decoding does.
- **Values**: each comma-separated part (Express reads the first of a list), upper-cased as
  the frameworks do.
- **Bodies** whose type a stack parses: a form (`application/x-www-form-urlencoded`, and no
  Content-Type at all, which Rack reads as a form), multipart, and JSON (`application/json`,
  `+json`), top-level keys only, every duplicate. A body of such a type that cannot be
  parsed and mentions `method` is `Unreadable`: the caller refuses it where methods are
  judged, since the origin's parser may read what this one could not.
"""

from __future__ import annotations

import json
from urllib.parse import unquote_plus, unquote_to_bytes

from ..http import Head
from .content import Part, Unreadable, boundary, parts

METHOD_FIELDS = frozenset({"x-http-method-override", "x-http-method", "x-method-override"})
PATH_FIELDS = frozenset({"x-original-url", "x-rewrite-url"})
PARAMETER = "_method"
FORM, MULTIPART, JSON = "form", "multipart", "json"
"""The kinds of body a server stack reads parameters from."""


def field_name(name: str) -> str:
    """A header field's name as CGI/WSGI/Puma key it: case and `_`/`-` folded."""
    return name.lower().replace("_", "-")


def parameter_name(name: str) -> str:
    """A query or form parameter's name as PHP-style parsers key it (see the module)."""
    name = name.lstrip(" ").replace(" ", "_").replace(".", "_")
    bracket = name.find("[")
    if bracket >= 0:
        if "]" in name[bracket:]:
            name = name[:bracket]  # an array: its base name
        else:
            name = name[:bracket] + "_" + name[bracket + 1:]
    return name.lower()


def methods_in(value: str) -> list[str]:
    """The methods a field's value asks for: each comma-separated part, upper-cased."""
    return [m.upper() if m.isascii() else m for m in (p.strip() for p in value.split(","))
            if m]


def header_methods(head: Head) -> list[tuple[str, str]]:
    """(where, method) for every method an override field asks for."""
    return [(f"the {name} field", method) for name, value in head.headers
            if field_name(name) in METHOD_FIELDS for method in methods_in(value)]


def header_paths(head: Head) -> list[tuple[str, str]]:
    """(where, path) for every path a rewrite field routes the request by."""
    return [(f"the {name} field", value.strip()) for name, value in head.headers
            if field_name(name) in PATH_FIELDS]


def form_methods(text: str, where: str) -> list[tuple[str, str]]:
    """(where, method) for `_method` in a query or a form body (`&` or `;` between pairs)."""
    found = []
    for item in text.replace(";", "&").split("&"):
        name, _, value = item.partition("=")
        if ("method" in name.lower() or "%" in name) and (  # the cheap look first
                parameter_name(unquote_plus(name, errors="replace")) == PARAMETER):
            found += [(where, m) for m in methods_in(unquote_plus(value, errors="replace"))]
    return found


def body_kinds(head: Head) -> frozenset[str]:
    """Which parsers a stack may run on this request's body, by its Content-Type fields
    (every one, and every comma-separated type in each: servers read the first or the
    last)."""
    types = [t.partition(";")[0].strip().lower() for v in head.get_all("content-type")
             for t in v.split(",")]
    if not types:
        return frozenset({FORM})
    kinds = set()
    for media in types:
        if media == "application/x-www-form-urlencoded":
            kinds.add(FORM)
        elif media.startswith("multipart/"):
            kinds.add(MULTIPART)
        elif media.endswith(("/json", "+json")):
            kinds.add(JSON)
    return frozenset(kinds)


def multipart(body: bytes, head: Head) -> list[Part]:
    """The parts of a multipart body, under every boundary its Content-Type fields name.
    Raises Unreadable."""
    marks = [boundary(v) for v in head.get_all("content-type")
             if v.strip().lower().startswith("multipart/")]
    return [p for mark in marks for p in parts(body, mark)]


def body_methods(body: bytes, head: Head, pieces: list[Part] | None = None
                 ) -> list[tuple[str, str]]:
    """(where, method) for every `_method` the body carries in a form a stack reads (the
    body as the origin reads it: content codings undone; `pieces`: its multipart parts,
    when the caller has them). Raises Unreadable."""
    kinds = body_kinds(head)
    found: list[tuple[str, str]] = []
    if FORM in kinds:
        found += form_methods(body.decode("latin-1"), "a _method field of the form body")
    if MULTIPART in kinds:
        if pieces is None:
            try:
                pieces = multipart(body, head)
            except Unreadable:
                if _mentions_method(body):
                    raise
                pieces = []
        found += [("a _method part of the multipart body", m) for p in pieces
                  if any(parameter_name(n) == PARAMETER for n in p.names)
                  for m in methods_in(p.value.decode("latin-1"))]
    if JSON in kinds:
        found += _json_methods(body)
    return found


def _json_methods(body: bytes) -> list[tuple[str, str]]:
    try:
        top = json.loads(body, object_pairs_hook=_Pairs)
    except (ValueError, RecursionError):
        if _mentions_method(body):
            raise Unreadable("a JSON body that cannot be parsed and names a method") from None
        return []
    if not isinstance(top, _Pairs):
        return []
    return [("a _method key of the JSON body", m) for key, value in top
            if parameter_name(key) == PARAMETER and isinstance(value, str)
            for m in methods_in(value)]


class _Pairs(list):
    """A JSON object as its (key, value) pairs, duplicates kept."""


def _mentions_method(body: bytes) -> bool:
    """Could a parser more lenient than ours find a `_method` in it? (Looked for raw,
    percent-decoded, and in the UTF-16 or -32 a JSON parser would detect.)"""
    lowered = body.lower()
    if b"method" in lowered or b"method" in unquote_to_bytes(lowered).lower():
        return True
    text = body.decode(json.detect_encoding(body), errors="replace").lower()
    return "method" in text
