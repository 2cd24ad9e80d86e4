"""/v1/secrets: secrets the filter holds for sessions. A value goes in, never out: listings
name each secret, its hosts and how it is sent."""

from __future__ import annotations

from flask import Blueprint, current_app, jsonify, request

from .request import body, call

blueprint = Blueprint("secrets", __name__)


@blueprint.get("/secrets")
def listing():
    return jsonify(call({"op": "secret-list"}))


SECRET_BODY = 48 * 1024
"""The largest secret the filter takes (an 8 KiB value, 32 hosts, 16 host keys) is more than
a JSON body may be ([api] max_body); the filter's control requests stop at 64 KiB."""


@blueprint.put("/secrets/<name>")
def store(name: str):
    request.max_content_length = max(SECRET_BODY, current_app.config["MAX_CONTENT_LENGTH"])
    data = body({"value": str, "hosts": list},
                {"scheme": str, "header": str, "user": str, "requests": list,
                 "host_keys": list, "port": int})
    answer = call({"op": "secret-set", "name": name, **data})
    return jsonify(secret=answer["secret"]), 201 if answer["added"] else 200


@blueprint.delete("/secrets/<name>")
def forget(name: str):
    return jsonify(call({"op": "secret-remove", "name": name}))
