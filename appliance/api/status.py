"""/v1/status: the API's version and uptime, the filter's health, the ruleset."""

from __future__ import annotations

import time
from importlib.metadata import version

from flask import Blueprint, current_app, jsonify

from .filter_client import FilterUnavailable

blueprint = Blueprint("status", __name__)
STARTED = time.time()


@blueprint.get("/status")
def status():
    try:
        answer = current_app.extensions["corral.filter"].request({"op": "status"})
        answer.pop("ok", None)
        filter_health = {"healthy": True, **answer}
    except FilterUnavailable as exc:
        filter_health = {"healthy": False, "error": str(exc)}
    return jsonify(version=version("corral"), uptime=round(time.time() - STARTED, 3),
                   filter=filter_health, firewall=filter_health.pop("firewall", None))
