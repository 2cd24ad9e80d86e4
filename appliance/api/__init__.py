"""The admin API: a Flask app that is a thin adapter over the control sockets of the filter
(policy, events, audit) and of the sandbox service (sessions).

`create_app(config)` builds everything (nothing happens at import time); one blueprint per
resource under /v1; every answer, errors included, is JSON.
"""

from __future__ import annotations

import flask
from flask import Flask, jsonify
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from appliance.control_client import ControlClient, ServiceUnavailable

from .config import ApiConfig


class ApiError(Exception):
    """An error with an HTTP status and a message naming what is wrong."""

    def __init__(self, status: int, message: str, **detail):
        super().__init__(message)
        self.status, self.message, self.detail = status, message, detail


def create_app(config: ApiConfig) -> Flask:
    app = Flask("corral-api")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body  # uploads raise it for themselves
    app.json.sort_keys = False
    app.extensions["corral.config"] = config
    app.extensions["corral.filter"] = ControlClient(config.control_socket, "the filter")
    # creating a session builds a network and starts a container: allow it minutes
    app.extensions["corral.sandbox"] = ControlClient(
        config.sandbox_socket, "the sandbox service", timeout=600) if config.sandbox_socket \
        else None

    from . import (
        approvals,
        audit,
        certs,
        events,
        evidence,
        manifest,
        policy,
        secrets,
        sessions,
        status,
    )

    for module in (policy, events, audit, evidence, sessions, status, certs, secrets,
                   approvals, manifest):
        app.register_blueprint(module.blueprint, url_prefix="/v1")

    @app.errorhandler(ApiError)
    def api_error(exc: ApiError):
        return jsonify(error={"status": exc.status, "message": exc.message, **exc.detail}), (
            exc.status)

    @app.errorhandler(ServiceUnavailable)
    def service_down(exc: ServiceUnavailable):
        return jsonify(error={"status": 503, "message": str(exc)}), 503

    @app.errorhandler(RequestEntityTooLarge)
    def too_large(exc: RequestEntityTooLarge):
        limit = flask.request.max_content_length  # (`request` here is our module of that name)
        return jsonify(error={"status": 413, "message": (
            f"the request body is larger than {limit} bytes, all this request may send"
            + (" ([api] max_body)" if limit == config.max_body else ""))}), 413

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        return jsonify(error={"status": exc.code, "message": exc.description}), exc.code

    @app.errorhandler(Exception)
    def unexpected(exc: Exception):
        app.logger.exception("unhandled error")
        return jsonify(error={"status": 500, "message": f"internal error: {type(exc).__name__}"}
                       ), 500

    return app
