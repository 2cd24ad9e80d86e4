"""/v1/sessions: the sessions the filter knows, with allowed/denied counters."""

from __future__ import annotations

from flask import Blueprint, jsonify

from .request import call

blueprint = Blueprint("sessions", __name__)


@blueprint.get("/sessions")
def listing():
    return jsonify(call({"op": "sessions"}))
