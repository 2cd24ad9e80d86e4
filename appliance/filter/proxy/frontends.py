"""Keeps neighbours.AddressBook filled, and asks it about one session's connection.

The book learns an inspected name's addresses two ways. Every answer the resolver fetches
(for the DNS filter, for a proxy's dial, for anyone) is heard here, and those of names the
Watch covers are recorded. And before a session's tunnel is spliced, or a tcp rule's
address is taught to the firewall, `ready()` makes sure the exact names the session's policy
inspects have been resolved within their TTL: the filter resolves them itself (through the
same resolver and cache, counted against no session: the names are the policy's, not an
agent's choice, and few), so their addresses are known whether or not the agent ever looked
them up. A name that cannot be resolved then refuses the tunnel (fail closed: nobody can
tell what is shared). A policy or secrets change rebuilds the Watch and resolves the names
again at once; an address that turns out to be an inspected name's while a neighbour's
tunnel is open (a round-robin set, a TTL that ran out, a rule added) is told to `listeners`:
the proxy cuts the tunnel, the firewall takes back what a tcp rule learned there.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dnslib import QTYPE

from appliance.policy import Decision, Host, Policy
from appliance.policystore import PolicyStore

from ..dns.resolver import Answer, Resolver, UpstreamError
from .neighbours import REMEMBER, AddressBook, Watch, address_of, neighbour

if TYPE_CHECKING:
    from appliance.policy.names import IPAddress

    from .credentials import Credentials

EXPIRE_EVERY = 60.0
"""Seconds between two sweeps of what the book has remembered long enough."""


class Frontends:
    def __init__(self, store: PolicyStore, resolver: Resolver):
        self.store, self.resolver = store, resolver
        self.credentials: Credentials | None = None
        """The secrets (`use`): their hosts are inspected in every session."""
        self.book = AddressBook()
        self.watch = Watch(frozenset(), frozenset())
        self.unknown_v6: dict[str, str] = {}
        """Inspected name -> why its IPv6 addresses are unknown (its AAAA lookup failed)."""
        self.fresh: dict[Policy, float] = {}
        """policy -> until when its exact inspected names' addresses are known."""
        self.listeners: list[Callable[[], None]] = []
        """Told (on the loop, once a turn) when an inspected name was seen at an address
        new to it."""
        self._told = False
        self._swept = time.monotonic()
        self._tasks: set[asyncio.Task] = set()
        resolver.observers.append(self.heard)
        store.on_change(self.changed)
        self.changed()

    def use(self, credentials: Credentials) -> None:
        """The secrets changed (replaced whole): their hosts are watched from now."""
        self.credentials = credentials
        self.changed()

    def bound(self, name: str) -> bool:
        """Is a secret bound to `name` (its TLS ended, so inspected in every session)?"""
        return self.credentials is not None and bool(self.credentials.bound(Host(name=name)))

    def changed(self) -> None:
        """The policies or the secrets changed: watch what they inspect now, forget what
        none does, and resolve the names again (when a loop runs; else at the next
        ready())."""
        policies = [self.store.outside, *(s.policy for s in self.store.sessions.values())]
        secrets = self.credentials.secrets.values() if self.credentials is not None else ()
        self.watch = Watch.of(policies, [h for s in secrets for h in s.hosts])
        self.book.keep(self.watch.all_patterns())
        self.fresh = {}
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self._refresh(policies), name="corral-frontends")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refresh(self, policies: list[Policy]) -> None:
        for policy in policies:
            await self.ready(policy)

    def heard(self, name: str, answer: Answer) -> None:
        """The resolver fetched `answer` for `name` (a resolver observer)."""
        patterns = tuple(self.watch.patterns(name))
        if patterns:
            self._record(name, patterns, answer)

    def _record(self, name: str, patterns: tuple[str, ...], answer: Answer) -> None:
        addresses = answer.addresses(name)
        if not addresses:
            return
        now = time.monotonic()
        until = max(answer.expires, now + REMEMBER)
        new = [a for pattern in patterns
               for a in self.book.record(pattern, name, addresses, until)]
        if now - self._swept > EXPIRE_EVERY:
            self._swept = now
            self.book.expire(now)
        if new and self.listeners and not self._told:
            self._told = True
            asyncio.get_running_loop().call_soon(self._tell)

    def _tell(self) -> None:
        self._told = False
        for listener in self.listeners:
            listener()

    async def ready(self, policy: Policy) -> str | None:
        """Make sure the addresses of the exact names `policy` inspects are known (resolved
        within their TTL). None when they are; else why they cannot be (a name's resolvers
        failed): the caller refuses what needed them."""
        if self.fresh.get(policy, 0.0) > time.monotonic():
            return None
        names = self.watch.names(policy)
        results = await asyncio.gather(*(self._resolve(name) for name in names))
        failures = [r for r in results if isinstance(r, str)]
        if failures:
            return failures[0]
        self.fresh[policy] = min(results, default=math.inf)
        return None

    async def _resolve(self, name: str) -> float | str:
        """Resolve an inspected name (A and AAAA) and record what it has: until when that
        holds, or why it could not be resolved. An AAAA lookup that fails after the A one
        gave addresses (resolvers that refuse AAAA for a name they hold only IPv4 for,
        dnsmasq without an upstream among them) leaves the name's IPv6 addresses unknown
        (`unknown_v6`): only IPv6 tunnels need them, and only those are refused."""
        until, v4 = math.inf, ()
        patterns = tuple(self.watch.patterns(name)) or (name,)
        for qtype in (QTYPE.A, QTYPE.AAAA):
            try:
                answer = await self.resolver.query(name, qtype, None)
            except UpstreamError as exc:
                if qtype == QTYPE.AAAA and v4:
                    self.unknown_v6[name] = f"resolving inspected host {name} failed: {exc}"
                    return until
                return f"resolving inspected host {name} failed: {exc}"
            if qtype == QTYPE.A:
                v4 = answer.addresses(name)
            else:
                self.unknown_v6.pop(name, None)
            self._record(name, patterns, answer)
            until = min(until, answer.expires)
        return until

    def refusal(self, policy: Policy, host: Host, address: str | IPAddress,
                kind: str = "http") -> Decision | None:
        """The refusal of a tunnel to `host` (not inspected) at `address` under `policy` (a
        tcp rule's connection, with `kind` "tcp"), or None. No I/O: may run on a worker
        thread (the firewall's learned set)."""
        ip = address_of(address)
        if ip.version == 6 and self.unknown_v6:
            for name in self.watch.names(policy):
                why = self.unknown_v6.get(name)
                if why is not None:  # fail closed where the book cannot tell
                    return Decision(False, f"cannot tell whether {host} at {address} shares "
                                    f"an IPv6 address with an inspected host: {why}")
        return neighbour(policy, host, ip, self.book.at(ip, time.monotonic()), self.bound,
                         kind)
