"""The other methods and paths a request asks its origin to read it as. Sans-IO.

A `POST` that says `X-HTTP-Method-Override: DELETE` is a DELETE to Rack (Rails, GitLab),
Express's method-override, Symfony and Laravel, ASP.NET and Google's APIs; a `_method`
field in its form or JSON body is one to Rack, Symfony, Laravel and Spring's
HiddenHttpMethodFilter; `X-Original-URL` and `X-Rewrite-URL` route it by another path on
Symfony (before 5) and IIS's URL Rewrite. A host's request rules judge every one of them
(pipeline.judge_request), so each is found here the way those stacks find it:

- **Field names** as CGI, WSGI, Puma and lighttpd read them: case-folded, and every
  character that is not a letter or a digit one character (`X_HTTP_Method_Override` and,
  behind lighttpd, `X.HTTP.Method.Override` are HTTP_X_HTTP_METHOD_OVERRIDE).
- **Parameter names** (query and form body; `_method`, and `X-HTTP-Method-Override`, which
  ASP.NET MVC reads as a form field and a query parameter) as PHP-style parsers key them:
  cut at a NUL (PHP's names are C strings), leading spaces dropped, ` ` and `.` read as `_`, a `[`
  without its `]` read as `_`, an array's `[...]` left off (`_method[]` is still
  `_method`); and as Rack 2 and qs (Express's extended forms) key them, leading brackets
  dropped (`[_method]` is `_method`); any letter case (fail closed: Rack and PHP compare
  exactly, and judging one more spelling only refuses more). `+` is a space and escapes are
  decoded, as form decoding does, and a form that declares a charset is read in it too
  (Tomcat and Jetty decode names and values in it).
- **Values**: each comma-separated part (Express reads the first of a list), upper-cased as
  the frameworks do (Unicode-aware, as Ruby and Java are: `opt\u0131ons` is OPTIONS to Rack).
- **Bodies** whose type a stack parses: a form (`application/x-www-form-urlencoded`, the
  type PHP reads up to a space, and no Content-Type or an empty one, which Rack reads as a
  form), multipart, and JSON (`application/json`, `+json`, and any type that contains
  `/json` or `+json`, as Laravel tests it), top-level keys only, every duplicate. A body of
  such a type that cannot be parsed and mentions `method` is `Unreadable`: the caller
  refuses it where methods are judged, since the origin's parser may read what this one
  could not.
"""

from __future__ import annotations

import codecs
import json
import re
from urllib.parse import unquote_plus, unquote_to_bytes

from ..http import Head
from .content import Part, Unreadable, boundaries, params, parts

METHOD_FIELDS = frozenset({"x-http-method-override", "x-http-method", "x-method-override"})
PATH_FIELDS = frozenset({"x-original-url", "x-rewrite-url"})
PARAMETER = "_method"
PARAMETERS = frozenset({PARAMETER, "x-http-method-override"})
"""Parameter names a stack reads a method from: `_method`, and the override field's name,
which ASP.NET MVC (GetHttpMethodOverride) reads as a form field and a query parameter."""
FORM, MULTIPART, JSON = "form", "multipart", "json"
"""The kinds of body a server stack reads parameters from."""


_NOT_ALNUM = re.compile(r"[^a-z0-9]")


def field_name(name: str) -> str:
    """A header field's name as CGI/WSGI/Puma/lighttpd key it: case folded, and every
    character but a letter or a digit read as `-`."""
    return _NOT_ALNUM.sub("-", name.lower())


def parameter_name(name: str) -> str:
    """A query or form parameter's name as PHP-style parsers key it (see the module)."""
    name = name.partition("\0")[0].lstrip(" ").replace(" ", "_").replace(".", "_")
    bracket = name.find("[")
    if bracket >= 0:
        if "]" in name[bracket:]:
            name = name[:bracket]  # an array: its base name
        else:
            name = name[:bracket] + "_" + name[bracket + 1:]
    return name.lower()


_RACK2_KEY = re.compile(r"[\[\]]*([^\[\]]*)")


def is_parameter(name: str) -> bool:
    """Does some stack key this parameter name as one of PARAMETERS: PHP-style parsers
    (`parameter_name`), or Rack 2 and qs, which drop leading brackets?"""
    return not PARAMETERS.isdisjoint((
        parameter_name(name), parameter_name(_RACK2_KEY.match(name.partition("\0")[0])[1])))


def methods_in(value: str) -> list[str]:
    """The methods a field's value asks for: each comma-separated part, upper-cased."""
    return [m.upper() for m in (p.strip() for p in value.split(",")) if m]


def header_methods(head: Head) -> list[tuple[str, str]]:
    """(where, method) for every method an override field asks for."""
    return [(f"the {name} field", method) for name, value in head.headers
            if field_name(name) in METHOD_FIELDS for method in methods_in(value)]


def header_paths(head: Head) -> list[tuple[str, str]]:
    """(where, path) for every path a rewrite field routes the request by."""
    return [(f"the {name} field", value.strip()) for name, value in head.headers
            if field_name(name) in PATH_FIELDS]


def form_methods(text: str, where: str, charset: str | None = None
                 ) -> list[tuple[str, str]]:
    """(where, method) for `_method` in a query or a form body (`&` or `;` between pairs),
    its escapes decoded as UTF-8 and, when the form declares one, in its `charset`."""
    if charset is None and "method" not in unquote_plus(text, errors="replace").lower():
        return []  # no name in it is one of PARAMETERS, decoded (one look at all of it)
    found, names = [], {}
    for item in text.replace(";", "&").split("&"):
        name, _, value = item.partition("=")
        named = names.get(name)
        if named is None:
            named = ("method" in name.lower() or "%" in name) and (  # the cheap look first
                any(is_parameter(n) for n in _decoded(name, charset)))
            if len(names) < _NAMES_KEPT:
                names[name] = named
        if named:
            found += [(where, m) for v in _decoded(value, charset) for m in methods_in(v)]
    return found


_NAMES_KEPT = 64
"""Names a form's reading remembers the look at (a name repeated is looked at once); a
bounded few: a dict of a body's every name would be rehashed in one go as it grows, holding
the interpreter (and so the event loop) for tens of milliseconds on a judge's thread."""


def _decoded(text: str, charset: str | None) -> list[str]:
    readings = [unquote_plus(text, errors="replace")]
    if charset is not None and "%" in text:
        raw = unquote_to_bytes(text.replace("+", " "))
        readings.append(raw.decode(charset, errors="replace"))
    return readings


def body_kinds(head: Head) -> frozenset[str]:
    """Which parsers a stack may run on this request's body, by its Content-Type fields
    (every one, and every comma-separated type in each: servers read the first or the
    last; each type up to a `;` or a space, as PHP cuts it)."""
    values = head.get_all("content-type")
    if not values:
        return frozenset({FORM})
    kinds = set()
    for value in values:
        if "/json" in value.lower() or "+json" in value.lower():  # Laravel's isJson
            kinds.add(JSON)
        for media in (re.split(r"[;\s]", t.strip(" \t"), maxsplit=1)[0].lower()
                      for t in value.split(",")):
            if media in ("application/x-www-form-urlencoded", ""):  # Rack: "" is no type
                kinds.add(FORM)
            elif media.startswith("multipart/"):
                kinds.add(MULTIPART)
            elif media.endswith(("/json", "+json")):
                kinds.add(JSON)
    return frozenset(kinds)


def charset(head: Head) -> str | None:
    """The charset a body's Content-Type declares when it is one that hides ASCII (UTF-16,
    UTF-32: Tomcat and Jetty decode forms in it); None for an ASCII-compatible or unknown
    one, which the UTF-8 and Latin-1 readings already cover."""
    for value in head.get_all("content-type"):
        for key, raw in params(value):
            if key == "charset":
                try:
                    name = codecs.lookup(raw.strip()).name
                    if "_method".encode(name) != b"_method":
                        return name
                except LookupError:  # unknown, or no text encoding (base64, rot13)
                    continue
    return None


def multipart(body: bytes, head: Head) -> list[Part]:
    """The parts of a multipart body, under every boundary a server may read in its
    Content-Type fields. Raises Unreadable."""
    marks = dict.fromkeys(m for v in head.get_all("content-type")
                          if v.strip().lower().startswith("multipart/")
                          for m in boundaries(v))
    return [p for mark in marks for p in parts(body, mark)]


def body_methods(body: bytes, head: Head, pieces: list[Part] | None = None
                 ) -> list[tuple[str, str]]:
    """(where, method) for every `_method` the body carries in a form a stack reads (the
    body as the origin reads it: content codings undone; `pieces`: its multipart parts,
    when the caller has them). Raises Unreadable."""
    kinds, declared = body_kinds(head), charset(head)
    found: list[tuple[str, str]] = []
    if FORM in kinds:
        where = "a _method field of the form body"
        found += form_methods(body.decode("latin-1"), where, declared)
        if declared is not None:  # Jetty decodes a UTF-16 form whole, then splits it
            found += form_methods(body.decode(declared, errors="replace"), where)
    if MULTIPART in kinds:
        if pieces is None:
            try:
                pieces = multipart(body, head)
            except Unreadable:
                if _mentions_method(body):
                    raise
                pieces = []
        found += [("a _method part of the multipart body", m) for p in pieces
                  if any(is_parameter(n) for n in p.names)
                  for text in _values(p.value, declared) for m in methods_in(text)]
    if JSON in kinds:
        found += _json_methods(body)
    return found


def _values(value: bytes, declared: str | None) -> list[str]:
    texts = [value.decode("latin-1")]
    if declared is not None:
        texts.append(value.decode(declared, errors="replace"))
    return texts


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
