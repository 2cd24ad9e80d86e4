"""/v1/manifest: what provisioning recorded this appliance runs (/etc/corral/manifest.json,
written by site.yml's corral_manifest role), for `corral verify --against`."""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, current_app, jsonify

from appliance.manifest import ManifestError, loads

from . import ApiError

blueprint = Blueprint("manifest", __name__)


@blueprint.get("/manifest")
def manifest():
    path = Path(current_app.extensions["corral.config"].manifest)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ApiError(404, f"this appliance has no manifest at {path}: provisioning writes it "
                       "(site.yml; `corral provision` for a VM)") from None
    except OSError as exc:
        raise ApiError(500, f"cannot read {path}: {exc.strerror}") from None
    try:
        return jsonify(loads(data, str(path)))
    except ManifestError as exc:
        raise ApiError(500, str(exc)) from None
