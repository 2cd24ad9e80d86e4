"""File descriptors: what the filter may need, and whether the process has them.

Every client connection, upstream connection, tunnel pipe and DNS socket is a descriptor.
If one session could take them all, every other session's DNS and proxy would fail with
EMFILE. So each session has caps (`[proxy] max_*_per_session`, `[dns] max_tcp` and
`max_pending`), each cap costs a known number of descriptors, and the filter only takes as
many sessions as its limit can hold with every one of them at its caps, plus HEADROOM for
its own needs. A session at its caps then never affects another: that is checked at start
and whenever a session is registered, never discovered by a failing accept().
"""

from __future__ import annotations

import resource

from appliance.sessionconfig import FilterConfig

from .dns.filter import MAX_PENDING
from .relay import TUNNEL_FDS

HEADROOM = 256
"""Descriptors the filter keeps for itself: listeners, control connections (the API's
threads and monitor streams), the audit log, netlink sockets, the event loop's own."""


class DescriptorBudget:
    """The descriptor budget of a running filter, and the global caps that must hold every
    session at its own caps too (or a session at its caps would take from the others)."""

    def __init__(self, config: FilterConfig, limit: int):
        self.limit = limit
        self.per_session = per_session(config)
        proxy, dns = config.proxy, config.dns
        fits = {
            f"the open-files limit ({limit}, {self.per_session} per session at its caps "
            f"plus {HEADROOM} for the filter)": (limit - HEADROOM) // self.per_session,
            f"[proxy] max_connections ({proxy.max_connections})":
                proxy.max_connections // proxy.max_connections_per_session,
            f"the DNS queries waiting at once ({MAX_PENDING})": MAX_PENDING // dns.max_pending,
        }
        self.bound, shares = min(fits.items(), key=lambda item: item[1])
        self.sessions = max(0, shares)
        """Session shares that fit (clients outside every session take one)."""

    def check(self, sessions: int) -> None:
        """Raise ValueError when `sessions` (configured and registered) would not fit."""
        if sessions + 1 > self.sessions:
            held = (f"holds {self.sessions - 1} sessions at their caps" if self.sessions > 1
                    else "does not hold even one session at its caps")
            raise ValueError(
                f"{self.bound} {held}; this would be session {sessions}: raise LimitNOFILE "
                "(the unit sets 1048576) or [proxy] max_connections, or lower the "
                "per-session caps ([proxy] max_connections_per_session, "
                "max_tunnels_per_session, [dns] max_tcp, max_pending)")

    def to_json(self, open_now: int | None = None) -> dict:
        return {"limit": self.limit, "open": open_now, "per_session": self.per_session,
                "sessions": max(0, self.sessions - 1), "bound": self.bound,
                "headroom": HEADROOM}


def per_session(config: FilterConfig) -> int:
    """Descriptors one session holds at its caps: each client connection and its upstream,
    what a tunnel adds on top of its two, the idle upstreams it keeps (proxy/pool.py), each
    DNS-over-TCP connection, and a socket for each query waiting on an upstream resolver."""
    proxy, dns = config.proxy, config.dns
    return (2 * proxy.max_connections_per_session + TUNNEL_FDS * proxy.max_tunnels_per_session
            + proxy.kept_upstreams_per_session + dns.max_tcp + dns.max_pending)


def raise_limit() -> int:
    """Raise the soft limit on open files to the hard one; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
