"""/v1/audit: page through the audit log; verify its hash chain."""

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


VERIFY_TIMEOUT = 600.0
"""Seconds to wait for the filter's verify (the CLI waits as long)."""
