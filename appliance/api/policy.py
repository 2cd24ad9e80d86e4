"""/v1/policy: a session's effective rules; runtime rules added (for good, or for
`expires_in` seconds) and revoked; presets."""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from appliance.policy import preset_description, preset_names, preset_parameters

from .request import body, call, who

blueprint = Blueprint("policy", __name__)


@blueprint.get("/policy")
def effective():
    return jsonify(call({"op": "policy", "session": request.args.get("session")}))


@blueprint.post("/policy/rules")
def add():
    data = body({"session": str, "kind": str, "rule": str}, {"expires_in": (int, float)})
    answer = call({"op": "add", **data, "by": who()})
    return jsonify(answer), 201 if answer["added"] else 200


@blueprint.delete("/policy/rules")
def revoke():
    data = body({"session": str, "kind": str, "rule": str})
    return jsonify(call({"op": "remove", **data, "by": who()}))


@blueprint.get("/presets")
def presets():
    return jsonify(presets=[{"name": n, "description": preset_description(n),
                             "parameters": preset_parameters(n)} for n in preset_names()])
