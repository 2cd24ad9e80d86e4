"""/v1/sessions/NAME/evidence: what a session did and was allowed, as members an auditor can
check offline (`corral evidence`), under an index the appliance's audit key signs.

Members (text, UTF-8; `corral evidence` writes them into a deterministic tar):
  policy.json     the session's effective rules, layer by layer, each layer's sha256
  approvals.json  every approval decided and every runtime rule granted or revoked, with who
                  decided (the audit records of kind approval and rule), and those still open
  events.json     the session's recent events (the filter's memory of the last ones)
  audit.jsonl     the log's lines from the session's first record to a signed head: every
                  record between them, other sessions' too (a hash chain cannot skip one)
  heads.jsonl     the signed heads in that stretch; the last is the line audit.jsonl ends at
  manifest.json   the appliance manifest's sha256, or "absent"
  workspace.json  the changeset applied: the appliance does not record it (see its note)
  session.json    the session as the API lists it

The index (members by sha256, the session, the head) is signed by the filter with the audit
key behind the evidence prefix (appliance/pki/signed.py): this API cannot have it sign a
head, nor anything not shaped like an index. The audit records carry a proof of their own:
their chain ends at a head the filter signed by itself, on no one's request.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from flask import Blueprint, current_app, jsonify

from appliance.pki.signed import EVIDENCE_FORMAT, canonical

from . import ApiError
from .request import call
from .sessions import _sessions

blueprint = Blueprint("evidence", __name__)

WORKSPACE_NOTE = ("the appliance does not record which changeset was applied: `corral apply` "
                  "writes it into the project on the host, and the appliance keeps only the "
                  "snapshots `corral diff` showed (their digests are what `apply --digest` "
                  "takes); the host's shell history or CI log has the digest applied")


def _json(value) -> str:
    return json.dumps(value, indent=1, sort_keys=True) + "\n"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def policy_member(session: str, rules: list[dict]) -> dict:
    """The effective rules grouped by layer, each layer with the sha256 of its rules."""
    layers: dict[str, list] = {}
    for rule in rules:
        layers.setdefault(str(rule.get("layer")), []).append(rule)
    return {"session": session, "layers": {
        name: {"rules": found, "sha256": hashlib.sha256(canonical(found)).hexdigest()}
        for name, found in sorted(layers.items())}}


def decisions(session: str, lines: list[str], open_approvals: list[dict]) -> dict:
    """Approvals decided and rules granted or revoked, from the session's audit records
    (each says who decided), and the approvals still open."""
    decided = [record for record in map(json.loads, lines)
               if record.get("session") == session
               and record.get("kind") in ("approval", "rule")]
    return {"session": session, "decided": decided, "open": open_approvals}


def manifest_member(path: Path) -> dict:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {"path": str(path), "sha256": "absent"}
    return {"path": str(path), "sha256": hashlib.sha256(data).hexdigest()}


def _heads_between(after: int, last: int) -> list[dict]:
    """Every signed head after seq `after` up to seq `last`, page by page: a session that
    ran for days spans more heads than one answer holds, and the bundle must reach the head
    its chain ends at."""
    heads: list[dict] = []
    while True:
        page = call({"op": "audit-heads", "after": after, "limit": 1000})
        heads += [h for h in page["heads"] if h["seq"] <= last]
        if not page.get("more") or not page["heads"] or page["heads"][-1]["seq"] >= last:
            return heads
        after = page["heads"][-1]["seq"]


@blueprint.get("/sessions/<name>/evidence")
def evidence(name: str):
    listed = [s for s in _sessions()["sessions"] if s["name"] == name]
    if not listed:
        raise ApiError(404, f"no session {name!r}")
    call({"op": "audit-sign"})  # a signed head covers every record on disk up to now
    segment = call({"op": "audit-segment", "session": name})
    head, lines = segment["head"], segment["lines"]
    if head is None or not lines:
        raise ApiError(404, f"session {name!r} has no audit record up to the last signed head"
                       f"{' (seq ' + str(head['seq']) + ')' if head else ''}: nothing to "
                       "bundle yet")
    first = json.loads(lines[0])["seq"]
    heads = _heads_between(first - 1, head["seq"])
    config = current_app.extensions["corral.config"]
    members = {
        "policy.json": _json(policy_member(name, call({"op": "policy", "session": name})
                                           ["rules"])),
        "approvals.json": _json(decisions(name, lines, call(
            {"op": "approvals", "session": name})["approvals"])),
        "events.json": _json(call({"op": "events", "last": 10000, "session": name})["events"]),
        "audit.jsonl": "".join(line + "\n" for line in lines),
        "heads.jsonl": "".join(canonical(h).decode() + "\n" for h in heads),
        "manifest.json": _json(manifest_member(Path(config.manifest))),
        "workspace.json": _json({"session": name, "applied": None, "note": WORKSPACE_NOTE}),
        "session.json": _json(listed[0]),
    }
    index = {"format": EVIDENCE_FORMAT, "session": name, "appliance": head["appliance"],
             "created": round(time.time(), 3), "head": {"seq": head["seq"],
                                                        "hash": head["hash"]},
             "members": {member: sha256(text) for member, text in sorted(members.items())}}
    signature = call({"op": "evidence-sign", "index": index})
    return jsonify(index=index, signature=signature["signature"], key=signature["key"],
                   members=members)
