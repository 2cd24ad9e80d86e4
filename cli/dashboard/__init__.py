"""`corral dashboard`: its options here; its server (server.py) is imported only when the
command runs, so that no other command loads Flask and werkzeug."""

from __future__ import annotations

from ..arguments import appliance_command


def _dashboard(args) -> int:
    from .server import cmd_dashboard  # Flask and werkzeug: only this command needs them

    return cmd_dashboard(args)


def register(sub) -> None:
    board = appliance_command(
        sub, "dashboard", "a web page for approvals, sessions, decisions, rules and health",
        _dashboard, session=False,
        description="Serve a local web page on 127.0.0.1 that talks to the appliance with "
        "this CLI's client certificate (the browser needs none). The address it prints "
        "carries a random token: anyone with it acts as you.")
    board.add_argument("--port", type=int, default=0, help="default: a free one")
    board.add_argument("--no-open", action="store_true", help="print the address only (no "
                       "browser is started)")
