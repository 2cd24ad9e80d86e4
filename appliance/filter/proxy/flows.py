"""What the proxy holds open, per session: caps, and the flows a policy change must cut.

Pure bookkeeping, no I/O. A session may hold at most `max_connections` client connections
and `max_tunnels` tunnels (which cost more descriptors) at once; a session at its caps is
refused more, and nothing it does takes from another session's share. Every allowed flow —
a tunnel, a request in progress — is registered with what it was allowed to reach and how to
cut it; when the policy changes, `judge()` names the flows the new policy denies.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from appliance.policy import Decision, Host


@dataclass(slots=True)
class Flow:
    id: int
    """The decision event's id: the cut and the closed events carry it too."""
    session: str | None
    client: str
    """The client's address: the session is looked up again when the policy changes."""
    label: str
    """The client's address:port, as events name it."""
    kind: str
    """connect | tls | http, as in events."""
    host: Host
    port: int
    cut: Callable[[], None]
    """Ends the flow at once: both connections close."""
    address: str | None = None
    """The address it reached; None while it is still dialling."""
    spliced: bool = False
    """A TLS tunnel passed on uninspected: cut if the policy comes to inspect its host."""
    once: bool = False
    """Let through by an approval granted once: the default deny does not cut it (a deny
    rule, a blocked address or inspection still do)."""


class Cap:
    """How many of one thing (connections, tunnels) each session may hold at once, and the
    refusals to report: once a second per session, so a flood is one event a second."""

    def __init__(self, what: str, limit: int):
        self.what, self.limit = what, limit
        self.held: Counter[str | None] = Counter()
        self.refused: Counter[str | None] = Counter()
        """session -> refused since the last report."""
        self._reported: dict[str | None, float] = {}

    def admit(self, session: str | None) -> bool:
        """Count one more for `session`, unless it holds its cap."""
        if self.held[session] >= self.limit:
            self.refused[session] += 1
            return False
        self.held[session] += 1
        return True

    def release(self, session: str | None) -> None:
        self.held[session] -= 1
        if self.held[session] <= 0:
            del self.held[session]

    def report(self, session: str | None, now: float) -> int:
        """How many refusals to report now (0: not yet)."""
        if now - self._reported.get(session, float("-inf")) < 1.0:
            return 0
        self._reported[session] = now
        return self.refused.pop(session, 0)


class Flows:
    def __init__(self, max_connections: int, max_tunnels: int):
        self.connections = Cap("connections", max_connections)
        self.tunnels = Cap("tunnels", max_tunnels)
        self.open: dict[int, Flow] = {}

    def add(self, flow: Flow) -> None:
        self.open[flow.id] = flow

    def remove(self, flow_id: int) -> None:
        self.open.pop(flow_id, None)

    def denied_by(self, decide: Callable[[Flow], Decision]) -> Iterator[tuple[Flow, Decision]]:
        """The open flows that `decide` (the policy in force now) denies."""
        for flow in list(self.open.values()):
            decision = decide(flow)
            if not decision.allowed:
                yield flow, decision
