"""/v1/events: the last N decisions, and a live Server-Sent Events stream of them."""

from __future__ import annotations

import json

from flask import Blueprint, Response, current_app, jsonify, request, stream_with_context

from .request import arg_int, arg_verdict, call

blueprint = Blueprint("events", __name__)


@blueprint.get("/events")
def last():
    return jsonify(call({"op": "events", "last": arg_int("last", 100, 1),
                         "session": request.args.get("session"), "verdict": arg_verdict()}))


@blueprint.get("/events/stream")
def stream():
    subscription = {"op": "subscribe", "session": request.args.get("session"),
                    "verdict": arg_verdict()}
    events = current_app.extensions["corral.filter"].stream(subscription)
    first = next(events)  # subscribe now, so a failure is an error status, not a broken stream

    def generate():
        yield ": subscribed\n\n"
        for event in ([first] if first is not None else []):
            yield _sse(event)
        for event in events:
            yield ": keep-alive\n\n" if event is None else _sse(event)

    return Response(stream_with_context(generate()), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _sse(event: dict) -> str:
    return f"id: {event.get('id', '')}\nevent: decision\ndata: {json.dumps(event)}\n\n"
