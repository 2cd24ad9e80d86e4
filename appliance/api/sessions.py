"""/v1/sessions: agent sessions (the sandbox service) with their counters (the filter).

  GET    /sessions                     every session: record, container state, counters
  POST   /sessions                     create: a JSON body, or a project archive (tar, gzip
                                       allowed) as the body with the settings as query args;
                                       `agent` (a profile's TOML) with `agent_name` runs that
                                       agent (appliance/sandbox/agents.py)
  GET    /sessions/NAME                one
  POST   /sessions/NAME/stop           container and network go; workspace and home stay
  DELETE /sessions/NAME[?home=1]       forget it (and the project's home)
  GET    /sessions/NAME/diff           unified diff + summary of the agent's changes, and
                                       the digest of the snapshot it shows
  GET    /sessions/NAME/changes?digest=D   that snapshot's changes with contents, for the
                                       host to apply (a digest no diff showed is refused)
  POST   /sessions/NAME/applied        what the host applied: the next diff starts there
  POST   /sessions/NAME/selftest       the bypass battery inside the session
"""

from __future__ import annotations

import time

from flask import Blueprint, current_app, jsonify, request

from appliance.agents.profile import NAME as AGENT_NAME
from appliance.control_client import ServiceUnavailable
from appliance.sandbox import lifetime
from appliance.sandbox.battery import OPTIONS as SELFTEST_OPTIONS

from . import ApiError
from .request import body, call

blueprint = Blueprint("sessions", __name__)

ARCHIVES = ("application/x-tar", "application/gzip")
LIMITS = ("max_uptime", "idle", "memory", "cpus", "pids")
"""A session's limits, as `corral run` sets them (appliance/sandbox/lifetime.py)."""
MAX_PROFILE = 16 * 1024
"""Bytes of an agent's profile (the sandbox service parses it again, and says the same)."""


def _sandbox_sessions() -> tuple[dict[str, dict], str | None]:
    if current_app.extensions["corral.sandbox"] is None:
        return {}, None
    try:
        return {s["name"]: s for s in call({"op": "list"}, "sandbox")["sessions"]}, None
    except ServiceUnavailable as exc:
        return {}, str(exc)


def _sessions() -> dict:
    """The filter's sessions (every one has a policy) joined with the sandbox's records
    (a stopped session is only there), and for a running one with limits the seconds
    `left` before they stop it."""
    now = time.time()
    filtered = {s["name"]: s for s in call({"op": "sessions"})["sessions"]}
    sandboxes, problem = _sandbox_sessions()
    merged = []
    for name in sorted(set(filtered) | set(sandboxes)):
        entry = {"name": name, "allowed": 0, "denied": 0, **filtered.get(name, {})}
        if name in sandboxes:
            entry.update(sandboxes[name])
            record = sandboxes[name]
            if record.get("state") == "running":  # when its limits stop it, if nothing happens
                entry["left"] = lifetime.left(record.get("created") or now, lifetime.Limits(
                    record.get("max_uptime", 0), record.get("idle", 0)),
                    filtered.get(name), now)
        else:
            entry.setdefault("state", "running")  # a session from the filter's config
        merged.append(entry)
    answer = {"sessions": merged}
    if problem:
        answer["sandbox_error"] = problem
    return answer


@blueprint.get("/sessions")
def listing():
    return jsonify(_sessions())


@blueprint.get("/sessions/<name>")
def one(name: str):
    for session in _sessions()["sessions"]:
        if session["name"] == name:
            return jsonify(session)
    raise ApiError(404, f"no session {name!r}")


@blueprint.post("/sessions")
def create():
    if request.mimetype in ARCHIVES:
        settings = _query_settings()
        size = request.content_length
        if size is None:
            raise ApiError(411, "send the project archive with a Content-Length")
        limit = current_app.extensions["corral.config"].max_upload
        if size > limit:
            raise ApiError(413, f"the project archive is {size} bytes; the limit is {limit} "
                           "([api] max_upload)")
        # the app's limit is a JSON body's ([api] max_body): without this, request.stream
        # refuses every project larger than that (Werkzeug checks it there too)
        request.max_content_length = limit
        answer = call({"op": "create", **settings}, "sandbox", payload=request.stream, size=size)
    else:
        # a profile of up to MAX_PROFILE bytes fits, escaped as JSON ([api] max_body is
        # 16 KiB by default: what the other requests need)
        request.max_content_length = max(current_app.extensions["corral.config"].max_body,
                                         3 * MAX_PROFILE)
        settings = body({"name": str}, {"presets": list, "project_id": str, "uid": int,
                                        "gid": int, "max_uptime": int, "idle": int,
                                        "memory": str, "cpus": str, "pids": int,
                                        "agent": str, "agent_name": str})
        _check_agent(settings)
        answer = call({"op": "create", **settings}, "sandbox")
    return jsonify(answer["session"]), 201


def _query_settings() -> dict:
    args = request.args
    unknown = sorted(set(args) - {"name", "preset", "project_id", "uid", "gid", "agent",
                                  "agent_name", *LIMITS})
    if unknown:
        raise ApiError(400, f"unknown query argument(s): {', '.join(unknown)}")
    if not args.get("name"):
        raise ApiError(400, "missing query argument 'name'")
    settings: dict = {"name": args["name"], "presets": args.getlist("preset")}
    if args.get("project_id"):
        settings["project_id"] = args["project_id"]
    for key in ("uid", "gid", "max_uptime", "idle", "pids"):
        if key in args:
            if not args[key].isdigit():
                raise ApiError(400, f"query argument {key!r} must be a whole number")
            settings[key] = int(args[key])
    for key in ("memory", "cpus"):  # checked by the sandbox service (lifetime.Limits)
        if key in args:
            settings[key] = args[key]
    for key in ("agent", "agent_name"):
        if key in args:
            settings[key] = args[key]
    _check_agent(settings)
    return settings


def _check_agent(settings: dict) -> None:
    """An agent is named with its profile, or not at all; the profile itself is parsed by
    the sandbox service (which trusts no reading of it but its own)."""
    if ("agent" in settings) != ("agent_name" in settings):
        raise ApiError(400, "'agent' (the profile's TOML text) and 'agent_name' go together")
    if "agent" not in settings:
        return
    if not AGENT_NAME.match(settings["agent_name"]):
        raise ApiError(400, f"agent_name {settings['agent_name']!r} must be 1-32 of a-z, 0-9 "
                       "and '-' (the profile's file name without .toml)")
    size = len(settings["agent"].encode())
    if size > MAX_PROFILE:
        raise ApiError(400, f"the profile of agent {settings['agent_name']} is {size} bytes; "
                       f"the limit is {MAX_PROFILE}")
    if not settings["agent"].strip():
        raise ApiError(400, f"the profile of agent {settings['agent_name']} is empty")


@blueprint.post("/sessions/<name>/stop")
def stop(name: str):
    return jsonify(call({"op": "stop", "name": name}, "sandbox")["session"])


@blueprint.delete("/sessions/<name>")
def remove(name: str):
    home = request.args.get("home", "0")
    if home not in ("0", "1"):
        raise ApiError(400, "home must be 0 or 1")
    return jsonify(call({"op": "remove", "name": name, "home": home == "1"}, "sandbox"))


@blueprint.get("/sessions/<name>/diff")
def diff(name: str):
    return jsonify(call({"op": "diff", "name": name}, "sandbox"))


@blueprint.get("/sessions/<name>/changes")
def changes(name: str):
    digest = request.args.get("digest")
    if not digest:
        raise ApiError(400, "missing query argument 'digest': the changeset to apply, as "
                       "`corral diff` printed it")
    return jsonify(call({"op": "changes", "name": name, "digest": digest}, "sandbox"))


@blueprint.post("/sessions/<name>/applied")
def applied(name: str):
    request.max_content_length = current_app.extensions["corral.config"].max_upload
    data = body({"changes": list})
    return jsonify(call({"op": "fold", "name": name, "changes": data["changes"]}, "sandbox"))


@blueprint.post("/sessions/<name>/selftest")
def selftest(name: str):
    options = body({"allowed": str}, {k: v for k, v in SELFTEST_OPTIONS.items()
                                      if k != "allowed"})
    return jsonify(call({"op": "selftest", "name": name, "options": options}, "sandbox"))
