"""The filter's parts as service.py wires them: each given the narrow things it uses, and a
change in one told to those that follow it. The real service, store, proxy and control
socket on a unix socket; nothing listens on the network."""

from __future__ import annotations

import asyncio
import json

import pytest

from appliance.filter.service import Service
from tests.unit.filterconfig import one_session


@pytest.fixture
def service(tmp_path):
    config = one_session(tmp_path)
    service = Service(config)
    yield service
    service.blocking.shutdown()


async def ask(path, *requests: dict) -> list[dict]:
    reader, writer = await asyncio.open_unix_connection(path)
    answers = []
    for request in requests:
        writer.write(json.dumps(request).encode() + b"\n")
        try:  # a request the server never answers fails here, never waits for ever
            answers.append(json.loads(await asyncio.wait_for(reader.readline(), 10)))
        except TimeoutError:
            raise AssertionError(f"no answer to {request['op']} within 10s") from None
    writer.close()
    return answers


SECRET = {"op": "secret-set", "name": "API_TOKEN", "value": "sk-live-0123456789abcdef",
          "hosts": ["api.example.com"]}


def test_a_secret_set_on_the_control_socket_reaches_the_proxy_and_leaves_it_when_removed(
        service, tmp_path):
    """The control socket changes the secret store only; the proxy's credentials follow
    the store's announcement (they were replaced from the control server before)."""
    path = str(tmp_path / "control.sock")

    async def main():
        server = await service.control.start(path)
        try:
            added, environment = await ask(path, SECRET, {"op": "secret-environment",
                                                          "session": "s1"})
            bound = set(service.proxy.credentials.secrets)
            redacted = service.bus.redactor.text("x sk-live-0123456789abcdef y")
            removed, = await ask(path, {"op": "secret-remove", "name": "API_TOKEN"})
            return added, environment, bound, redacted, removed
        finally:
            server.close()
            await server.wait_closed()

    added, environment, bound, redacted, removed = asyncio.run(main())
    assert added["ok"] and added["added"] is True and bound == {"API_TOKEN"}
    assert "sk-live-0123456789abcdef" not in redacted
    assert environment["environment"]["API_TOKEN"].startswith("corral-secret-")
    assert removed["ok"] and service.proxy.credentials.secrets == {}
    events = [e for e in service.bus.recent if e["kind"] == "secret"]
    assert [e["reason"].split(":")[0] for e in events] == [
        "secret API_TOKEN set", "secret API_TOKEN removed"]


def test_the_sessions_listing_and_status_come_from_the_parts_not_the_service(service):
    listing = service.status.sessions()
    assert [(s["name"], s["open_connections"], s["registered"]) for s in listing] == [
        ("s1", 0, False)]
    described = service.status.describe()
    assert described["sessions"] == 1 and described["listeners"] == {}
    assert described["firewall"] == {"loaded": False, "error": "not checked yet"}


def test_no_part_of_the_filter_is_given_the_service():
    """service.py builds and wires; every other module gets the narrow parts it uses (the
    git gateway and the control socket took the whole service before)."""
    import ast
    from pathlib import Path

    import appliance.filter

    root = Path(appliance.filter.__file__).parent
    given = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "service.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("service"):
                given.append(f"{path.name} imports {node.module}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                given += [f"{path.name} {node.name}({a.arg})" for a in node.args.args
                          if a.arg == "service"]
    assert given == []
