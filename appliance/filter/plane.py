"""The data plane's parts that are built the same way in the filter and in each of its
worker processes (workers/): the interception CA, what serves each listener, the event loop
and the collector's settings once serving.
"""

from __future__ import annotations

import asyncio
import gc
import logging

from appliance.policy import ConfigError
from appliance.sessionconfig import FilterConfig, InspectConfig

from .dns.filter import DnsFilter, UdpServer, serve_tcp
from .listeners import Serve
from .proxy import Proxy
from .proxy.express import listener
from .proxy.inspect import Inspector
from .proxy.pipeline import Explicit

log = logging.getLogger("corral.filter")


def interception(config: InspectConfig) -> tuple[Inspector | None, str | None]:
    """The interception CA, or None and why it could not be had (`ca_dir`): the filter runs
    without inspection then (inspected hosts denied, everything else as ever) rather than
    not at all. A CA given by hand is the operator's to fix: ConfigError."""
    try:
        inspector = Inspector.from_config(config)
    except ConfigError as exc:
        if config.ca_dir is None:
            raise
        log.error("inspect: no interception CA, inspected hosts are denied: %s", exc)
        return None, str(exc)
    if inspector is not None and inspector.days_left() < 30:
        log.warning("inspect: the interception CA expires in %d days: `corral certs "
                    "rotate --interception`", inspector.days_left())
    return inspector, None


def servers(config: FilterConfig, dns: DnsFilter, proxy: Proxy) -> dict[str, Serve]:
    """What serves each listener key (the git gateway's is added when it is on)."""
    async def dns_udp(sock):
        return UdpServer(dns).attach(asyncio.get_running_loop(), sock)

    async def dns_tcp(sock):
        return await asyncio.start_server(lambda r, w: serve_tcp(dns, r, w), sock=sock,
                                          backlog=1024)

    def http(handler) -> Serve:
        async def serve(sock):
            return await asyncio.start_server(handler, sock=sock, backlog=4096,
                                              limit=config.proxy.max_header_bytes)
        return serve

    def express(mode) -> Serve:  # plain HTTP: the express lane first (proxy/express.py)
        async def serve(sock):
            return await asyncio.get_running_loop().create_server(
                listener(proxy, mode), sock=sock, backlog=4096)
        return serve

    return {"dns_udp": dns_udp, "dns_tcp": dns_tcp, "proxy": express(Explicit()),
            "transparent_http": express(None),
            "transparent_tls": http(proxy.serve_transparent_tls)}


GC_THRESHOLDS = (700, 3, 300)
"""The cyclic collector's thresholds once serving: CPython's are (700, 10, 10). Each
uncached DNS answer allocates dozens of containers and the caches hold hundreds of
thousands; a full collection scans them all (0.1-0.16 s measured), and at CPython's it came
every few thousand queries: a sixth of the filter's CPU on uncached DNS. Here full
collections are nine times rarer, and the middle ones smaller (about a millisecond where
CPython's took two to four); young ones stay as they are (raising them was measured to
pause the loop for tens of milliseconds)."""


def tune_gc() -> None:
    """What start-up built is frozen (never scanned again), and full collections made
    rarer (GC_THRESHOLDS)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def loop_factory(choice: str):
    """uvloop when asked for or available: the same asyncio API with a loop written in C,
    which halves the time to answer a request here (bench/). Optional: asyncio's loop runs
    the same code."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("--event-loop", "", "uvloop is not installed; pip install uvloop "
                              "or use --event-loop asyncio") from None
        return None
    return uvloop.new_event_loop
