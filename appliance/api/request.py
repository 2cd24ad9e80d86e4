"""What every view needs: a validated JSON body, query arguments, and a service call."""

from __future__ import annotations

from flask import current_app, request

from . import ApiError

VERDICTS = ("allow", "deny", "error", "change", "pending")


def body(required: dict[str, type], optional: dict[str, type] | None = None) -> dict:
    """The JSON object body, with exactly these keys of these types; ApiError(400) otherwise."""
    optional = optional or {}
    if not request.is_json:
        raise ApiError(415, "send a JSON body with Content-Type: application/json")
    data = request.get_json(silent=True)
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    unknown = sorted(set(data) - set(required) - set(optional))
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(unknown)}; expected "
                       f"{', '.join([*required, *optional])}", fields=unknown)
    for name, kind in {**required, **optional}.items():
        if name not in data:
            if name in required:
                raise ApiError(400, f"missing field {name!r}", field=name)
            continue
        if not isinstance(data[name], kind) or isinstance(data[name], bool):
            names = (" or ".join(k.__name__ for k in kind) if isinstance(kind, tuple)
                     else kind.__name__)
            raise ApiError(400, f"field {name!r} must be a {names}", field=name)
    return data


def arg_int(name: str, default: int, low: int = 0, high: int = 10000) -> int:
    raw = request.args.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise ApiError(400, f"query argument {name!r} must be a whole number in {low}-{high}")
    return int(raw)


def arg_verdict() -> str | None:
    verdict = request.args.get("verdict")
    if verdict is not None and verdict not in VERDICTS:
        raise ApiError(400, f"verdict must be one of {', '.join(VERDICTS)}")
    return verdict


def who() -> str:
    """Who is asking: the client certificate's common name and serial (gunicorn hands the
    TLS socket to the view); "api" where no certificate can be read (a test client)."""
    sock = request.environ.get("gunicorn.socket")
    try:
        cert = sock.getpeercert()
    except (AttributeError, ValueError, OSError):
        return "api"
    names = [value for rdn in cert.get("subject", ()) for key, value in rdn
             if key == "commonName"]
    serial = cert.get("serialNumber", "")[-8:].lower()
    return f"{names[0] if names else 'client'}#{serial}" if serial else (
        names[0] if names else "api")


def call(message: dict, service: str = "filter", **options) -> dict:
    """Ask the filter (or the sandbox service); its refusals become 400 (or 404 for an
    unknown session). `options` go to the client: a payload, a timeout."""
    client = current_app.extensions[f"corral.{service}"]
    if client is None:
        raise ApiError(501, "this appliance has no sandbox service ([api] sandbox_socket is "
                       "empty): it cannot run sessions")
    answer = client.request(message, **options)
    if not answer.pop("ok", False):
        error = answer.get("error", "the filter refused the request")
        missing = error.startswith(("no session", "no secret", "no pending approval"))
        raise ApiError(404 if missing else 400, error)
    return answer
