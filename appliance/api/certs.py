"""/v1/certs: the filter's interception CA (the certificate sessions trust); a new one."""

from __future__ import annotations

from flask import Blueprint, jsonify

from .request import call

blueprint = Blueprint("certs", __name__)


@blueprint.get("/certs/interception")
def interception():
    return jsonify(call({"op": "inspect-ca"}))


@blueprint.post("/certs/interception/rotate")
def rotate():
    """A new CA in the filter, then every running session's trust anew: a session trusts
    the new CA once this answers (an appliance without sessions has none to refresh)."""
    answer = call({"op": "inspect-rotate"})
    refreshed = call({"op": "trust-refresh"}, "sandbox")["refreshed"]
    return jsonify(ca=answer["ca"], previous=answer["previous"], sessions=refreshed)
