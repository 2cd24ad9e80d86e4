"""/v1/status: the API's version and uptime, the filter's and the sandbox service's health,
the ruleset."""

from __future__ import annotations

import time
from importlib.metadata import version

from flask import Blueprint, current_app, jsonify

from appliance.control_client import ServiceUnavailable

blueprint = Blueprint("status", __name__)
STARTED = time.time()


@blueprint.get("/status")
def status():
    try:
        answer = current_app.extensions["corral.filter"].request({"op": "status"})
        answer.pop("ok", None)
        filter_health = {"healthy": True, **answer}
    except ServiceUnavailable as exc:
        filter_health = {"healthy": False, "error": str(exc)}
    return jsonify(version=version("corral"), uptime=round(time.time() - STARTED, 3),
                   filter=filter_health, firewall=filter_health.pop("firewall", None),
                   sandbox=_health("corral.sandbox"))


def _health(service: str) -> dict | None:
    client = current_app.extensions[service]
    if client is None:
        return None
    try:
        answer = client.request({"op": "status"})
    except ServiceUnavailable as exc:
        return {"healthy": False, "error": str(exc)}
    healthy = answer.pop("ok", False)
    return {"healthy": healthy, **answer}
