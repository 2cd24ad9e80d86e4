"""/v1/approvals: what sessions in ask mode wait for, and a person's decision on each.

  GET  /approvals[?session=S]      the open approvals
  POST /approvals/<id>             {"grant": "once" | "for" | "session" | "refuse",
                                    "duration": SECONDS (with "for"), "note": TEXT?}
The decision is recorded with who took it: the client certificate's name and serial.
"""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from .request import body, call, who

blueprint = Blueprint("approvals", __name__)


@blueprint.get("/approvals")
def listing():
    return jsonify(call({"op": "approvals", "session": request.args.get("session")}))


@blueprint.post("/approvals/<approval_id>")
def decide(approval_id: str):
    data = body({"grant": str}, {"duration": (int, float), "note": str})
    return jsonify(call({"op": "approval-decide", "id": approval_id, "by": who(), **data}))
