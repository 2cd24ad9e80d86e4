"""/v1/secrets: secrets the filter holds for sessions. A value goes in, never out: listings
name each secret, its hosts and how it is sent."""

from __future__ import annotations

from flask import Blueprint, jsonify

from .request import body, call

blueprint = Blueprint("secrets", __name__)


@blueprint.get("/secrets")
def listing():
    return jsonify(call({"op": "secret-list"}))


@blueprint.put("/secrets/<name>")
def store(name: str):
    data = body({"value": str, "hosts": list},
                {"scheme": str, "header": str, "user": str, "requests": list,
                 "host_keys": list, "port": int})
    answer = call({"op": "secret-set", "name": name, **data})
    return jsonify(secret=answer["secret"]), 201 if answer["added"] else 200


@blueprint.delete("/secrets/<name>")
def forget(name: str):
    return jsonify(call({"op": "secret-remove", "name": name}))
