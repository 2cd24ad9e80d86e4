"""One worker process: the DNS filter and the proxy for the sessions of its shard.

Started by the coordinator (coordinator.py) as `python -m appliance.filter.workers`, with
its end of the link on descriptor `--link-fd`. It reads no file of the policy: its first
message is the whole state (`start`: the filter's config and every session's policy it
serves), then a message for each change, acknowledged once committed (replica.py). It
binds nothing: each gateway's listening sockets come bound from the coordinator (`serve`),
and they stay open in the coordinator, so while a worker is down its sessions' connections
wait in the kernel's queues and nothing answers them: they fail closed, and are served by
the worker that comes next.

What stays single lives in the coordinator and is reached over the link: every event goes
there (the one audit chain, the event bus, `monitor`); so does each firewall teaching (the
one learned set, which revocation judges) and each approval opened (the one book a person
decides from); a request held for one waits here (holds.py).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import ipaddress
import logging
import os
import signal
import socket
import sys
import time

from ..dns.filter import DnsFilter
from ..dns.resolver import Resolver
from ..plane import interception, loop_factory, servers, tune_gc
from ..proxy import Proxy
from ..proxy.credentials import Credentials
from ..proxy.frontends import Frontends
from ..proxy.inspect import Authority
from ..redact import LogFilter
from ..revocation import Reach
from . import replica
from .confine import confine
from .holds import RemoteHolds
from .link import JSON, Link
from .outbox import Learner, RelayBus

log = logging.getLogger("corral.filter")
STALE = 5.0
"""Seconds without a beat from the coordinator (coordinator.py BEAT) before a worker stops
serving."""


class Worker:
    def __init__(self, link_sock: socket.socket, index: int, first_id: int):
        self.link = Link(link_sock, sends=JSON, handle=self.handle)
        self.index, self.first_id = index, first_id
        self.store = None
        self.gateways: dict[str, list] = {}
        """Gateway address -> the servers and transports listening there."""
        self.stopping = asyncio.Event()
        self.changing = asyncio.Lock()
        self.beat = asyncio.get_running_loop().time()
        """When the coordinator's loop was last heard from (`beat`)."""

    def handle(self, message: dict, fds: list[int]):
        op = message["op"]
        if op == "start":
            return self.start(message)
        if op == "change":
            return self.change(message["state"])
        if op == "serve":
            return self.serve(message["address"], message["keys"], fds)
        if op == "close":
            return self.close(message["address"])
        if op == "secrets":
            self.proxy.credentials = Credentials(message["key"], message["http"])
            return {}
        if op == "authority":
            return self.authority()
        if op == "status":
            return self.status()
        if op == "held":
            return {"held": dict(self.proxy.flows.connections.held)}
        if op == "heard":
            self.frontends.heard(message["name"], replica.Heard(
                [ipaddress.ip_address(a) for a in message["addresses"]], message["ttl"]))
            return None
        if op == "ruling":
            self.holds.ruling(message["approval"], message["grant"], message["reason"],
                              message["open"])
            return None
        if op == "beat":
            self.beat = asyncio.get_running_loop().time()
            return None
        if op == "stop":
            self.stopping.set()
            return {}
        raise ValueError(f"unknown op {op!r}")

    def start(self, message: dict) -> dict:
        """Build the data plane from the coordinator's state; nothing is served yet."""
        config = self.config = message["config"]
        self.store = replica.replica(config)
        self.bus = RelayBus(self.link, self.first_id)
        self.store.on_change(lambda: self.bus.forget(set(self.store.sessions)))
        self.resolver = Resolver(config.dns.upstream, config.dns.timeout, config.dns.ttl_min,
                                 config.dns.ttl_max, config.dns.cache_share)
        self.frontends = Frontends(self.store, self.resolver)
        self.resolver.observers.append(self._heard)  # after the book's own
        learner = Learner(self.link, Reach(self.store, self.frontends),
                          asyncio.get_running_loop())
        self.holds = RemoteHolds(self.link)
        self.store.on_change(self.holds.changed)
        self.dns = DnsFilter(self.store, self.resolver, self.bus, config.gateway, learner,
                             config.firewall.learn_ttl_min, config.dns, self.holds,
                             self.frontends)
        self.inspector, _ = interception(config.inspect)
        self.proxy = Proxy(self.store, self.resolver, self.bus, config.proxy, config.gateway,
                           self.dns.exfil, self.inspector,
                           Credentials(message["key"], message["http"]), self.holds,
                           self.frontends)
        self.store.commit(replica.apply(self.store, message["state"]))
        tune_gc()
        return {"pid": os.getpid()}

    def _heard(self, name: str, answer) -> None:
        """The resolver fetched an answer: one for a name some policy here inspects goes
        to the coordinator, which tells its book and the other workers' (coordinator.py)."""
        if not any(True for _ in self.frontends.watch.patterns(name)):
            return
        addresses = answer.addresses(name)
        if addresses and not self.link.closed.done():
            self.link.send({"op": "heard", "name": name,
                            "addresses": [str(a) for a in addresses[:64]],
                            "ttl": answer.ttl(time.monotonic())})

    async def change(self, state: dict) -> dict:
        """Compiled off the loop (a session of 100k rules takes about half a second: its
        neighbours' DNS and proxy go on meanwhile), committed on it, one at a time."""
        async with self.changing:
            change = await asyncio.to_thread(replica.apply, self.store, state)
            self.store.commit(change)
        return {}

    async def serve(self, address: str, keys: list[str], fds: list[int]) -> dict:
        """Serve a gateway's sockets: all of them, or none (a socket already served is
        closed through its server: the loop polls it, and closing it behind the loop's back
        aborts libuv)."""
        serve = servers(self.config, self.dns, self.proxy)
        socks = [socket.socket(fileno=fd) for fd in fds]
        if address in self.gateways or len(keys) != len(socks) or not all(
                k in serve for k in keys):
            for sock in socks:
                sock.close()
            if address in self.gateways:  # sent again by a start that raced the first
                return {}
            raise ValueError(f"cannot serve {keys} on {len(socks)} sockets")
        served: list = []
        try:
            for key, sock in zip(keys, socks, strict=True):
                served.append(await serve[key](sock))
        except BaseException:
            for server in served:
                server.close()
            for sock in socks[len(served):]:
                sock.close()
            raise
        self.gateways[address] = served
        return {}

    def close(self, address: str) -> dict:
        for served in self.gateways.pop(address, []):
            served.close()
        return {}

    async def authority(self) -> dict:
        """The interception CA was rotated: sign with the new one (read from its directory,
        where the coordinator put it)."""
        inspector = self.inspector
        if inspector is not None and inspector.directory is not None:
            directory = inspector.directory
            inspector.use(await asyncio.to_thread(Authority.load, str(directory.cert),
                                                  str(directory.key)))
        return {}

    async def watch(self) -> None:
        """Returns (and the worker ends) when the coordinator has not been heard for STALE
        seconds: stopped or stuck, it records none of this worker's decisions and no
        change reaches it (a revoke's call cannot even be made), so serving on would be
        serving unrecorded, under a policy nobody can change. Its sessions then wait
        unanswered, as while any worker is down, until the coordinator, running again,
        starts the next. A round this worker's own loop was too busy to keep does not
        count: beats may be waiting unread."""
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(STALE / 10)
            now = loop.time()
            if now - before < STALE / 5 and now - self.beat > STALE:
                log.error("the coordinator was not heard for %.0fs: not serving", STALE)
                return

    def status(self) -> dict:
        proxy = self.proxy
        return {"pid": os.getpid(), "sessions": replica.served(self.store),
                "active_connections": proxy.active, "proxy": dict(proxy.stats),
                "secrets": len(proxy.credentials.secrets),
                "dns": self.dns.stats(), "resolver": dict(self.resolver.stats)}

    def redactor(self):
        """The secrets' values out of every log line, as in the filter (redact.py)."""
        proxy = getattr(self, "proxy", None)  # none before `start`
        return proxy.redactor if proxy is not None else None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stopping.set)
        loop.add_signal_handler(signal.SIGINT, lambda: None)  # the coordinator says when
        closed = asyncio.ensure_future(self.link.closed)
        stopping = asyncio.ensure_future(self.stopping.wait())
        watching = asyncio.ensure_future(self.watch())
        await asyncio.wait([closed, stopping, watching], return_when=asyncio.FIRST_COMPLETED)
        for task in (closed, stopping, watching):
            task.cancel()
        for address in list(self.gateways):
            self.close(address)
        if self.store is not None:
            self.proxy.forward.drop_kept()
            self.proxy.close_lanes()
            if self.inspector is not None:
                self.inspector.close()
            self.resolver.close()
        self.link.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="corral-filter worker")
    parser.add_argument("--link-fd", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--first-id", type=int, required=True)
    parser.add_argument("--event-loop", default="auto")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--read", action="append", default=[],
                        help="a path it may read beneath besides its code's (the CA's)")
    parser.add_argument("--keep-out", action="append", default=[],
                        help="a path no grant may hold (the state directory)")
    args = parser.parse_args(argv)
    jailed = confine(args.link_fd, args.read, args.keep_out)  # first, before any thread
    faulthandler.enable()  # a worker that dies in C says where, in the filter's log
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[worker {args.index}]: "
                        "%(message)s")
    if jailed.startswith("Landlock"):
        log.info("confined: %s", jailed)
    else:
        log.warning("confined, but %s", jailed)
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    link_sock = socket.socket(fileno=args.link_fd)

    async def serve() -> None:
        worker = Worker(link_sock, args.index, args.first_id)
        for handler in logging.getLogger().handlers:  # no secret's value in a log line
            handler.addFilter(LogFilter(worker.redactor))
        await worker.run()

    with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
        runner.run(serve())
    return 0

