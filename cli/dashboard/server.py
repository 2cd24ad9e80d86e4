"""`corral dashboard`'s server: a web page on this host for what the CLI does, served on
127.0.0.1 (Flask and werkzeug, imported only when the command runs: see __init__.py).

The browser never talks to the appliance: this server does, with the CLI's own client
certificate (the appliance records decisions as that certificate's), for a fixed list of
calls (ROUTES; nothing else is passed through). The page is static (static/, no framework,
nothing from a CDN); live updates come over Server-Sent Events relayed from the API's
event stream.

Who may use it: whoever holds the random token in the URL it prints. Every request but the
static assets must carry it (`X-Corral-Token`, or `?token=` for the page and the event
stream, which a browser cannot give a header); the Host header must name this loopback
server (a DNS-rebound name cannot reach it); no cookies, so a cross-site form cannot act
with it. The page shows what agents wrote (reasons, names) as text, never as markup,
drawn as the CLI draws it (static/render.js: printable ASCII, the rest escaped), and its
Content-Security-Policy allows no script but its own.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import shutil
import threading
from collections.abc import Iterator
from importlib import resources

from flask import Flask, Response, abort, jsonify, request

from .. import heads
from ..client import Client, CliError

GRANTS = ("once", "for", "session", "refuse")
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self'; connect-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # the token is in the page's URL
    "Cache-Control": "no-store",
    "Cross-Origin-Resource-Policy": "same-origin",
}
MAX_BODY = 16 * 1024
"""Bytes a request to the dashboard may carry (a decision is a few dozen)."""
MAX_STREAMS = 4
"""Event streams open at once (each holds a thread here and one of the API's: its other
calls must still find one)."""
STATIC = {"render.js": "text/javascript", "dashboard.js": "text/javascript",
          "dashboard.css": "text/css"}
EVENTS_BACKLOG = 200
"""Recent events the stream starts with, before the live ones."""


def create_app(client: Client, token: str) -> Flask:
    app = Flask(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY
    relays = threading.BoundedSemaphore(MAX_STREAMS)

    @app.before_request
    def guard():
        if (request.host.rsplit(":", 1)[0] or "") not in ("127.0.0.1", "localhost"):
            abort(Response("corral dashboard: open it at the address it printed\n", 403))
        if request.headers.get("Sec-Fetch-Site") == "cross-site":  # another site's page
            abort(Response("corral dashboard: not from another site\n", 403))
        if request.path.startswith("/static/"):
            return None
        given = (request.headers.get("X-Corral-Token")
                 or (request.args.get("token") if request.method == "GET" else None) or "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            abort(Response("corral dashboard: open it at the address `corral dashboard` "
                           "printed (it carries the token)\n", 403, mimetype="text/plain"))
        return None

    @app.after_request
    def headers(response: Response) -> Response:
        response.headers.update(SECURITY_HEADERS)
        return response

    @app.errorhandler(CliError)
    def appliance_error(exc: CliError):
        return jsonify(error=str(exc)), 503 if exc.code == 3 else 502

    @app.get("/")
    def page():
        return Response(_static("index.html"), mimetype="text/html")

    @app.get("/static/<name>")
    def asset(name: str):
        if name not in STATIC:
            abort(404)
        return Response(_static(name), mimetype=STATIC[name])

    @app.get("/api/status")
    def status():
        answer = client.request("GET", "/status")
        try:  # the signed heads since the last look, kept as `corral status` keeps them
            answer["audit_heads"] = heads.keep(client, client.appliance)
        except CliError as exc:
            answer["audit_heads"] = {"error": str(exc), "hint": exc.hint}
        return jsonify(answer)

    @app.get("/api/sessions")
    def sessions():
        return jsonify(client.request("GET", "/sessions"))

    @app.post("/api/sessions/<name>/stop")
    def stop(name: str):
        return jsonify(client.request("POST", f"/sessions/{_part(name)}/stop", timeout=600))

    @app.delete("/api/sessions/<name>")
    def remove(name: str):
        return jsonify(client.request("DELETE", f"/sessions/{_part(name)}", timeout=600))

    @app.get("/api/approvals")
    def approvals():
        return jsonify(client.request("GET", "/approvals"))

    @app.post("/api/approvals/<approval_id>")
    def decide(approval_id: str):
        data = request.get_json(silent=True)
        if not isinstance(data, dict) or data.get("grant") not in GRANTS:
            return jsonify(error=f"grant: one of {', '.join(GRANTS)}"), 400
        body = {"grant": data["grant"]}
        if data["grant"] == "for":
            if not isinstance(data.get("duration"), int) or isinstance(data["duration"], bool):
                return jsonify(error="duration: whole seconds"), 400
            body["duration"] = data["duration"]
        if isinstance(data.get("note"), str) and data["note"]:
            body["note"] = data["note"][:300]
        return jsonify(client.request("POST", f"/approvals/{_part(approval_id)}", body))

    @app.get("/api/rules")
    def rules():
        return jsonify(client.request("GET", "/policy", session=request.args.get("session")))

    @app.delete("/api/rules")
    def revoke():
        data = request.get_json(silent=True)
        if not isinstance(data, dict) or not all(
                isinstance(data.get(k), str) and data[k] for k in ("session", "kind", "rule")):
            return jsonify(error="give session, kind and rule"), 400
        return jsonify(client.request("DELETE", "/policy/rules", {
            k: data[k] for k in ("session", "kind", "rule")}))

    @app.get("/api/audit/verify")
    def verify():
        verdict = client.request("GET", "/audit/verify", timeout=600)
        try:  # and the heads kept on this host, as `corral audit --verify` checks them
            kept = heads.verify(client, client.appliance)
        except CliError as exc:
            kept = {"intact": False, "error": f"{exc} ({exc.hint})"}
        return jsonify({**verdict, "intact": verdict["intact"] and kept["intact"],
                        "chain_intact": verdict["intact"], "heads": kept,
                        "error": verdict.get("error") or (
                            "" if kept["intact"] else f"signed heads: {kept['error']}")})

    @app.get("/api/events")
    def events():
        if not relays.acquire(blocking=False):
            return jsonify(error=f"{MAX_STREAMS} event streams are open already: close a "
                           "tab of the dashboard"), 503
        response = Response(_relay(client), mimetype="text/event-stream",
                            headers={"X-Accel-Buffering": "no"})
        response.call_on_close(relays.release)  # started or not, ended or cut
        return response

    return app


def _relay(client: Client) -> Iterator[str]:
    """The recent events, then the live ones, as SSE (subscribed before the recent ones are
    read, so that none falls between; one in both is sent once); an `error` event when the
    appliance cannot be reached (the browser reconnects by itself). The API's keep-alives
    are passed on: writing one is how a closed tab is noticed, and its threads here and in
    the API freed."""
    live = None
    try:
        live = client.stream("/events/stream", keepalive=True)
        recent = client.request("GET", "/events", last=EVENTS_BACKLOG)["events"]
        seen = {event.get("id") for event in recent}
        for event in recent:
            yield f"id: {event.get('id', '')}\ndata: {json.dumps(event)}\n\n"
        yield ": live\n\n"
        for event in live:
            if event is None:
                yield ": keep-alive\n\n"
            elif event.get("id") not in seen:
                yield f"id: {event.get('id', '')}\ndata: {json.dumps(event)}\n\n"
    except CliError as exc:
        yield f"event: trouble\ndata: {json.dumps({'error': str(exc)})}\n\n"
    finally:
        if live is not None:
            live.close()


def _part(text: str) -> str:
    """A name or id as one path segment of the API's URL (never a way to another path)."""
    from urllib.parse import quote

    return quote(text, safe="")


def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


class Dashboard:
    """The server, on 127.0.0.1 (port 0: one the system picks), in threads of its own."""

    def __init__(self, client: Client, port: int = 0, token: str | None = None):
        from werkzeug.serving import WSGIRequestHandler, make_server

        class Quiet(WSGIRequestHandler):
            timeout = 60  # an idle connection does not keep its thread (keep-alives: 15 s)

            def log_request(self, *args, **kwargs):  # the request line carries the token
                pass

        self.token = token or secrets.token_urlsafe(24)
        self.server = make_server("127.0.0.1", port, create_app(client, self.token),
                                  threaded=True, request_handler=Quiet)
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}/?token={self.token}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                       name="corral-dashboard")

    def start(self) -> Dashboard:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def cmd_dashboard(args) -> int:
    import time
    import webbrowser

    from .. import exitcodes, output
    from ..targets import client_for

    client = client_for(args)
    client.request("GET", "/status")  # unreachable or refused: say so now, not in the page
    try:
        dashboard = Dashboard(client, args.port).start()
    except OSError as exc:
        raise CliError(f"cannot listen on 127.0.0.1:{args.port}: {exc.strerror or exc}",
                       "pick another --port, or leave it out for a free one",
                       exitcodes.USAGE) from None
    if args.json:
        output.data_line({"url": dashboard.url, "port": dashboard.port})
    else:
        output.line(f"corral dashboard for {client.appliance.name}: {dashboard.url}")
        output.line("(the token in the address is the key: anyone with it acts with your "
                    "client certificate; Ctrl-C stops it)")
    opener = None if args.no_open else _opener(dashboard.url)
    if opener is not None:
        webbrowser.open(opener.as_uri())
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        dashboard.stop()
    finally:
        if opener is not None:
            shutil.rmtree(opener.parent, ignore_errors=True)
    return exitcodes.OK


def _opener(url: str):
    """A page only this user can read that sends the browser on to `url`: the browser is
    started with the page's path, so the token never shows in a process's arguments (which
    every local user can read)."""
    import html
    import tempfile
    from pathlib import Path

    directory = Path(tempfile.mkdtemp(prefix="corral-dashboard-"))  # 0700
    page = directory / "open.html"
    fd = os.open(page, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f'<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" '
                  f'content="0;url={html.escape(url)}"><title>corral</title>'
                  f'<a href="{html.escape(url)}">open the corral dashboard</a>\n')
    return page
