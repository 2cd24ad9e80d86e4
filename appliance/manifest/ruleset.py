"""The corral table as nftables lists it, with what changes by itself taken out. Pure.

Two listings of one ruleset differ in what the kernel counts and learns while it runs:
counters' packets and bytes, the learned set's elements (the DNS filter fills it for the
sessions), and the handles nft numbers objects with. Those never count as drift: they are
dropped here, and what remains (tables, chains, sets' definitions, counters' names, rules in
order) is the ruleset as it was loaded.

The expected listing is made by loading the rendered transaction into a scratch network
namespace and listing it back (collect.py): the same nft, the same kernel, so the two
listings are written alike, and no hand-made translation between nft's input and output
forms can drift from nft itself.
"""

from __future__ import annotations

import json

from . import digest_json

VOLATILE = {
    "counter": ("packets", "bytes"),
}
"""Per kind of object, the fields the running kernel changes."""
LEARNED_SET = "learned"
"""The one set whose elements the running filter changes (the DNS filter teaches it). The
others' are the ruleset itself: `sessions`, the sources a sandbox may use, is compared."""


def normalise(items: list[dict]) -> list[dict]:
    """A listing (`nft -j list table inet corral`'s "nftables" list) without metainfo,
    handles, counter values and set elements."""
    out = []
    for item in items:
        if "metainfo" in item:
            continue
        kind, body = next(iter(item.items()))
        body = {k: v for k, v in body.items()
                if k != "handle" and k not in VOLATILE.get(kind, ())
                and not (kind == "set" and k == "elem" and body.get("name") == LEARNED_SET)}
        if kind == "rule":
            body["expr"] = [_statement(e) for e in body.get("expr", [])]
        out.append({kind: body})
    return out


def _statement(statement):
    """A rule's anonymous counter (`counter` with its values inline) without the values;
    a named one (`counter name X`: the name alone) is kept as it is."""
    if isinstance(statement, dict) and isinstance(statement.get("counter"), dict):
        return {"counter": None}
    return statement


def digest(items: list[dict]) -> str:
    return digest_json(normalise(items))


def describe(item: dict) -> str:
    """One object as a difference line names it: `rule filter_input: {...}`."""
    kind, body = next(iter(item.items()))
    if kind == "rule":
        return f"rule {body.get('chain')}: {json.dumps(body.get('expr'), sort_keys=True)}"
    return f"{kind} {body.get('name')}"


def differences(loaded: list[dict], rendered: list[dict], limit: int = 10) -> list[str]:
    """What the loaded table has that the rendered one lacks (+) and the reverse (-), each
    object named, at most `limit` of them: a reader needs the first few, not a dump."""
    want = [json.dumps(i, sort_keys=True) for i in normalise(rendered)]
    have = [json.dumps(i, sort_keys=True) for i in normalise(loaded)]
    lines = [f"- {describe(json.loads(i))} (rendered, not loaded)" for i in want if i not in have]
    lines += [f"+ {describe(json.loads(i))} (loaded, not rendered)" for i in have if i not in want]
    if not lines and want != have:
        lines = ["the same objects in another order"]
    if len(lines) > limit:
        lines = [*lines[:limit], f"... and {len(lines) - limit} more"]
    return lines
