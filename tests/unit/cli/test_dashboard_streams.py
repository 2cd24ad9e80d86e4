"""The dashboard's cap on event streams, with Flask's test client: a stream takes its slot
when it is answered and gives it back when its response is closed (a closed tab, a cut
connection), closing its stream from the API too. The API's client is a stand-in here (the
relay against the real API is in tests/integration/api/test_dashboard.py): what is under
test is the dashboard's own bookkeeping."""

from __future__ import annotations

from cli.dashboard.server import MAX_STREAMS, create_app


class Live:
    """The API's event stream as `Client.stream(keepalive=True)` gives it: keep-alives."""

    def __init__(self, opened: list):
        self.closed = False
        opened.append(self)

    def __iter__(self):
        while not self.closed:
            yield None

    def close(self):
        self.closed = True


class Appliance:
    def __init__(self):
        self.opened: list[Live] = []

    def stream(self, path, keepalive=False):
        assert path == "/events/stream" and keepalive
        return Live(self.opened)

    def request(self, method, path, body=None, **query):
        assert (method, path) == ("GET", "/events")
        return {"events": []}


def stream(client):
    return client.get("/api/events?token=t0ken", headers={"Host": "127.0.0.1:1"},
                      buffered=False)


def test_streams_past_the_cap_are_refused_and_a_closed_one_frees_its_slot():
    appliance = Appliance()
    client = create_app(appliance, "t0ken").test_client()
    open_ = [stream(client) for _ in range(MAX_STREAMS)]
    assert [r.status_code for r in open_] == [200] * MAX_STREAMS
    assert all(r.mimetype == "text/event-stream" for r in open_)
    refused = stream(client)
    assert refused.status_code == 503
    assert f"{MAX_STREAMS} event streams are open already" in refused.get_json()["error"]
    assert len(appliance.opened) == MAX_STREAMS  # the refused one asked the API nothing
    open_.pop().close()  # a tab closed: its slot is free, and only one
    assert appliance.opened[-1].closed  # and its stream from the API is closed too
    again = stream(client)
    assert again.status_code == 200
    assert stream(client).status_code == 503
    for response in [*open_, again]:
        response.close()
    assert all(live.closed for live in appliance.opened)
    assert [stream(client).status_code for _ in range(MAX_STREAMS + 1)] == (
        [200] * MAX_STREAMS + [503])


def test_a_refused_stream_takes_no_slot():
    client = create_app(Appliance(), "t0ken").test_client()
    held = [stream(client) for _ in range(MAX_STREAMS)]
    for _ in range(20):  # refusals do not leak slots, nor give any back
        refused = stream(client)
        assert refused.status_code == 503
        refused.close()
    held[0].close()
    assert stream(client).status_code == 200
    assert stream(client).status_code == 503
