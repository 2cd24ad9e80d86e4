"""/v1/certs: the filter's interception CA (the certificate sessions trust); a new one; the
sessions given it again."""

from __future__ import annotations

from flask import Blueprint, current_app, jsonify

from appliance.control_client import ServiceUnavailable

from .request import call

blueprint = Blueprint("certs", __name__)


@blueprint.get("/certs/interception")
def interception():
    return jsonify(call({"op": "inspect-ca"}))


@blueprint.post("/certs/interception/rotate")
def rotate():
    """A new CA in the filter, then every running session's trust anew. The CA is new once
    this answers, whatever became of the sessions: `failed` names those not given it (retry
    with POST /certs/interception/refresh); `sessions` is null without a sandbox service."""
    answer = call({"op": "inspect-rotate"})
    return jsonify(ca=answer["ca"], previous=answer["previous"], **_refresh())


@blueprint.post("/certs/interception/refresh")
def refresh():
    """Every running session given the CA the filter has now (after a failed refresh)."""
    return jsonify(**_refresh())


def _refresh() -> dict:
    if current_app.extensions["corral.sandbox"] is None:
        return {"sessions": None, "failed": {}}
    try:
        answer = call({"op": "trust-refresh"}, "sandbox")
    except ServiceUnavailable as exc:
        return {"sessions": [], "failed": {"*": f"the sandbox service: {exc}"}}
    return {"sessions": answer["refreshed"], "failed": answer["failed"]}
