"""/v1/audit: page through the audit log; verify its hash chain; the signed heads and the
key they are signed with (appliance/filter/audit/heads.py).

  GET  /audit/key                   the audit key's public half (PEM) and the appliance's name
  GET  /audit/heads?since=SEQ       signed heads with seq > SEQ, oldest first (limit 1000)
  POST /audit/heads                 sign the head now (if it moved): the latest signed head
"""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from . import ApiError
from .request import arg_int, call

blueprint = Blueprint("audit", __name__)


@blueprint.get("/audit")
def page():
    since = request.args.get("since")
    try:
        since_ts = float(since) if since is not None else None
    except ValueError:
        raise ApiError(400, "since must be a UNIX timestamp in seconds") from None
    return jsonify(call({"op": "audit", "after": arg_int("after", 0, 0, 2**62),
                         "since": since_ts, "limit": arg_int("limit", 100, 1, 1000)}))


@blueprint.get("/audit/verify")
def verify():
    # the filter reads every segment: hundreds of MB at the default retention
    return jsonify(call({"op": "audit-verify"}, timeout=VERIFY_TIMEOUT))


@blueprint.get("/audit/key")
def key():
    return jsonify(call({"op": "audit-key"}))


@blueprint.get("/audit/heads")
def heads():
    return jsonify(call({"op": "audit-heads", "after": arg_int("since", 0, 0, 2**62),
                         "limit": arg_int("limit", 1000, 1, 1000)}))


@blueprint.post("/audit/heads")
def sign():
    return jsonify(call({"op": "audit-sign"}))


VERIFY_TIMEOUT = 600.0
"""Seconds to wait for the filter's verify (the CLI waits as long)."""
