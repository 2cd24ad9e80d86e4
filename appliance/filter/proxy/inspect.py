"""Opt-in TLS inspection: leaf certificates as sessions ask for them, the upstream's TLS
context. The interception CA, what a leaf is and how one is minted: appliance/pki/intercept.py.

A host the policy marks inspected (`Policy.inspection(host)`) is not spliced: the filter ends
the client's TLS with a leaf certificate for the name the client asked for, signed by the
appliance's interception CA, opens TLS of its own to the upstream (verified against the
system trust store or `[inspect] upstream_ca`), and runs every request in between through
the same pipeline as plain HTTP. tunnel.py moves those bytes; this module holds no socket.

Leaves are minted on first use and kept in an LRU (`[inspect] leaf_cache`), one per host.
A mint costs about a millisecond, nearly all of it OpenSSL loading the new certificate and
key into a TLS context, which it does with the GIL released: so mints run on one worker
thread and the event loop never pays for them (invariant 10). The worker is shared, so a
session may have only `mint_rate` minted a second (`mint_burst` at once): a flood of new
names under an inspected wildcard is refused with a reason. What a session's burst queues
waits its turn (`FairQueue`): another session's first mint waits for the one under way and
no more. Concurrent first connections to one host share one mint. A leaf depends on its
host alone (one interception CA), so the cache serves every session.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import heapq
import itertools
import logging
import ssl
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes, serialization

from appliance.pki import CaDirectory
from appliance.pki.intercept import ALPN, LEAF_REUSE, Authority, Unusable, mint, server_context
from appliance.policy import ConfigError, Decision, Host
from appliance.sessionconfig import InspectConfig

from ..denied import Denied
from ..ratelimit import TokenBucket

log = logging.getLogger(__name__)

UPSTREAM_TLS: ContextVar[tuple[str | None, str, int] | None] = ContextVar(
    "corral_upstream_tls", default=None)
"""(session, host, port) of the inspected upstream the current task's TLS goes to: which TLS
session `ResumingContext` may resume. Set in the task that calls start_tls (tunnel.py); the
loop runs the handshake's start in a copy of that task's context."""
TICKETS_MAX = 4096
"""TLS sessions kept for resumption, the least recently kept dropped first."""


class ResumingContext(ssl.SSLContext):
    """The client context towards inspected upstreams, which resumes the TLS session of the
    last connection the same corral session made to the same host and port: a resumed
    handshake skips the key exchange's signature and the chain's verification, which the
    first connection did (the session is kept only from a handshake that verified). Never
    across sessions: an upstream could tell two sandboxes apart by their tickets otherwise,
    and a session's ticket is its own."""

    tickets: OrderedDict

    def wrap_bio(self, incoming, outgoing, server_side=False, server_hostname=None,
                 session=None):
        key = UPSTREAM_TLS.get()
        if session is None and not server_side and key is not None and key[1] == (
                server_hostname):
            session = self.tickets.get(key)
        return super().wrap_bio(incoming, outgoing, server_side, server_hostname, session)

    def keep(self, key: tuple[str | None, str, int], ssl_object) -> None:
        """Keep the TLS session of a connection that ends (TLS 1.3 sends its tickets after
        the handshake: at the end, what the upstream gave is there). Not for clients outside
        every session: they are no one in particular, and would share one."""
        if key[0] is None:
            return
        session = getattr(ssl_object, "session", None)
        if session is None or not getattr(session, "has_ticket", False):
            return
        self.tickets[key] = session
        self.tickets.move_to_end(key)
        while len(self.tickets) > TICKETS_MAX:
            self.tickets.popitem(last=False)

    def forget(self, alive: set) -> None:
        """Drop the TLS sessions of corral sessions that are gone: a later session of the
        same name is another sandbox, and must not resume the first one's."""
        for key in [k for k in self.tickets if k[0] not in alive]:
            del self.tickets[key]


def upstream_context(cafile: str | None) -> ResumingContext:
    """The filter's TLS towards inspected upstreams: verified (chain and name) against
    `cafile`, or the system trust store, as ssl.create_default_context would; TLS 1.2 or
    later; HTTP/1.1 by ALPN; sessions resumed per (session, host, port)."""
    context = ResumingContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname, CERT_REQUIRED
    context.tickets = OrderedDict()
    try:
        if cafile is not None:
            context.load_verify_locations(cafile)
        else:
            context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(cafile or "the system trust store", "",
                          f"holds no usable CA certificate: "
                          f"{getattr(exc, 'reason', None) or exc}") from None
    if cafile is not None and not context.get_ca_certs():
        raise ConfigError(cafile, "", "holds no usable CA certificate")
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(ALPN)
    return context


# -- the cache ----------------------------------------------------------------------------------


class FairQueue:
    """Work from many sessions, taken one item at a time, fairly: each session's items in
    the order it asked, the sessions in turn, so that a session that queued many waits
    behind one that asked once (start-time fair queueing, each item costing the same).

    An item's tag is one more than the later of the tag being served and its session's
    last tag; the smallest tag goes first, and of equal tags, the session whose previous
    tag was earlier (a session served just now waits behind one that was not). Pure."""

    def __init__(self):
        self._heap: list[tuple[int, int, int, object]] = []
        self._last: dict[object, int] = {}
        """Session -> the tag of its last item (kept while it may still break a tie)."""
        self._now = 0
        """The tag of the item taken last."""
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, session, item) -> None:
        previous = self._last.get(session, 0)
        tag = max(self._now, previous) + 1
        self._last[session] = tag
        heapq.heappush(self._heap, (tag, previous, next(self._order), item))

    def pop(self):
        """The next item, or None when nothing waits."""
        if not self._heap:
            return None
        tag, _, _, item = heapq.heappop(self._heap)
        self._now = tag
        if len(self._last) > 2 * len(self._heap) + 16:  # idle sessions no longer matter
            self._last = {s: t for s, t in self._last.items() if t >= tag}
        return item


@dataclass(slots=True)
class Leaf:
    context: ssl.SSLContext
    until: float
    """Monotonic time after which it is minted again."""


class Leaves:
    """Leaf TLS contexts by host: an LRU of `size`, minted off the loop on first use, within
    each session's mint budget."""

    def __init__(self, authority: Authority, size: int, rate: float, burst: int):
        self.authority = authority
        self.size, self.rate, self.burst = size, rate, burst
        self.cache: OrderedDict[str, Leaf] = OrderedDict()
        self.pending: dict[str, asyncio.Future] = {}
        """Mints under way or waiting their turn, by host: later askers wait for the same."""
        self.buckets: dict[str | None, TokenBucket] = {}
        self.queue = FairQueue()
        """(host, future) waiting for the worker, each session in turn: a session that asks
        for a host another session's mint is waiting for is queued for it too, in its own
        turn (whichever turn comes first mints it)."""
        self.queued: dict[str, set[str | None]] = {}
        """Host -> the sessions whose turn waits for its mint."""
        self.minting: str | None = None
        """The host the worker mints now: it is given one at a time, so the queue decides."""
        self.retired: str | None = None
        """Why no mint is made any more (the CA changed, the filter stops); None: in use."""
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="corral-mint")
        self.stats = {"minted": 0, "hits": 0, "refused": 0, "evicted": 0, "failed": 0}

    async def get(self, host: Host, session: str | None) -> ssl.SSLContext:
        """The server context for `host`. Raises Denied when the session is over its mint
        budget or the mint fails."""
        now = time.monotonic()
        leaf = self.cache.get(host.key)
        if leaf is not None and now < leaf.until:
            self.cache.move_to_end(host.key)
            self.stats["hits"] += 1
            return leaf.context
        if self.retired is not None:
            raise Denied(Decision(False, f"cannot make a certificate for {host}: "
                                  f"{self.retired}"), str(host))
        pending = self.pending.get(host.key)
        if pending is not None and host.key != self.minting and (
                session not in self.queued.setdefault(host.key, set())):
            self.queued[host.key].add(session)  # waits in its own turn too
            self.queue.push(session, (host, pending))
        if pending is None:
            bucket = self.buckets.get(session)
            if bucket is None:
                bucket = self.buckets[session] = TokenBucket(self.rate, self.burst, now)
            if not bucket.take(now):
                self.stats["refused"] += 1
                raise Denied(Decision(False, f"session {session or '(outside every session)'}"
                                      f" asked for more new inspected hosts than {self.rate:g}"
                                      f" a second ({self.burst} at once): [inspect] mint_rate"),
                             str(host))
            pending = asyncio.get_running_loop().create_future()
            self.pending[host.key] = pending
            pending.add_done_callback(lambda done, key=host.key: self._minted(key, done))
            self.queued[host.key] = {session}
            self.queue.push(session, (host, pending))
            self._next()
        try:  # shielded: one client that gives up does not cancel the others' mint
            return await asyncio.shield(pending)
        except Exception as exc:  # a mint that fails is a denial, like any other error
            raise Denied(Decision(False, f"cannot make a certificate for {host}: {exc}"),
                         str(host)) from None

    def _next(self) -> None:
        """Give the worker the next mint in turn, if it has none."""
        if self.minting is not None:
            return
        while (queued := self.queue.pop()) is not None:
            host, pending = queued
            if pending.done():  # minted in an earlier turn, or failed
                continue
            if self.retired is not None:
                _fail(pending, self.retired)
                continue
            try:
                work = asyncio.get_running_loop().run_in_executor(self.worker, self._mint,
                                                                  host)
            except RuntimeError as exc:  # the worker was shut down: never a wait forever
                _fail(pending, f"the mint worker is gone ({exc})")
                continue
            self.minting = host.key
            work.add_done_callback(lambda done, pending=pending: self._handed(done, pending))
            return

    def _handed(self, done: asyncio.Future, pending: asyncio.Future) -> None:
        """On the loop: the worker's mint to those waiting for it, then the next in turn."""
        self.minting = None
        if not pending.done():
            if done.cancelled():
                _fail(pending, self.retired or "the mint was cancelled")
            elif done.exception() is not None:
                pending.set_exception(done.exception())
            else:
                pending.set_result(done.result())
        self._next()

    def _mint(self, host: Host) -> ssl.SSLContext:
        """On the worker thread."""
        return server_context(*mint(self.authority, host, datetime.datetime.now(datetime.UTC)))

    def _minted(self, key: str, done: asyncio.Future) -> None:
        """On the loop: keep what was minted, drop the least recently used beyond `size`."""
        self.pending.pop(key, None)
        self.queued.pop(key, None)
        if done.cancelled() or done.exception() is not None:
            self.stats["failed"] += 1
            return
        self.stats["minted"] += 1
        self.cache[key] = Leaf(done.result(), time.monotonic() + LEAF_REUSE)
        self.cache.move_to_end(key)
        while len(self.cache) > self.size:
            self.cache.popitem(last=False)
            self.stats["evicted"] += 1

    def forget(self, alive: set) -> None:
        """Drop the budgets of sessions that are gone."""
        for session in [s for s in self.buckets if s is not None and s not in alive]:
            del self.buckets[session]

    def retire(self, reason: str) -> None:
        """Make no more mints: each one waiting its turn fails with `reason` (a denial to its
        client, who may connect again), the one under way finishes, then the worker stops."""
        self.retired = reason
        while (queued := self.queue.pop()) is not None:
            _fail(queued[1], reason)
        self.worker.shutdown(wait=False)

    def close(self) -> None:
        self.retire("the filter is stopping")
        self.worker.shutdown(wait=False, cancel_futures=True)


def _fail(pending: asyncio.Future, reason: str) -> None:
    """A mint's waiters told it will not come (a denial each, in `Leaves.get`)."""
    if not pending.done():
        with contextlib.suppress(RuntimeError):  # its loop may be closed already
            pending.set_exception(RuntimeError(reason))


class Inspector:
    """What the proxy needs to inspect: leaves for clients, a context for upstreams."""

    def __init__(self, authority: Authority, upstream: ssl.SSLContext, config: InspectConfig,
                 directory: CaDirectory | None = None):
        self.authority = authority
        self.upstream = upstream
        self.config = config
        self.directory = directory
        """The filter's own CA (`[inspect] ca_dir`), which `renewed` replaces; None for a
        CA given as files, which only its maker replaces."""
        self.leaves = self._leaves()

    def _leaves(self) -> Leaves:
        config = self.config
        return Leaves(self.authority, config.leaf_cache, config.mint_rate, config.mint_burst)

    @classmethod
    def from_config(cls, config: InspectConfig) -> Inspector | None:
        """None when no CA is configured (inspection off). With `ca_dir`, the filter's own CA
        is made there when there is none, or none usable (expired, damaged: it could sign
        nothing a client accepts). Raises ConfigError."""
        if not config.enabled:
            return None
        upstream = upstream_context(config.upstream_ca)
        if config.ca_dir is not None:
            directory = CaDirectory(config.ca_dir)
            try:
                if directory.ensure():
                    log.info("inspect: made an interception CA in %s", directory.path)
                try:
                    authority = Authority.load(str(directory.cert), str(directory.key))
                except Unusable as exc:
                    log.warning("inspect: the CA in %s is not usable (%s): making a new one; "
                                "running sessions trust it after `corral certs rotate "
                                "--interception`", directory.path, exc)
                    directory.rotate()
                    authority = Authority.load(str(directory.cert), str(directory.key))
            except OSError as exc:
                raise ConfigError(config.ca_dir, "[inspect] ca_dir", f"cannot keep the "
                                  f"interception CA there: {exc.strerror or exc}") from None
            return cls(authority, upstream, config, directory)
        return cls(Authority.load(config.ca_cert, config.ca_key), upstream, config)

    def renewed(self) -> Authority:
        """A new CA in the directory, loaded (blocking: run it off the loop). Raises
        ConfigError for a CA given as files."""
        if self.directory is None:
            raise ConfigError(self.config.ca_cert or "", "[inspect]", "the CA is given as "
                              "ca_cert and ca_key: make a new pair with `python -m "
                              "appliance.pki intercept-ca` and restart the filter, or let it "
                              "keep its own with ca_dir")
        self.directory.rotate()
        return Authority.load(str(self.directory.cert), str(self.directory.key))

    def use(self, authority: Authority) -> None:
        """Sign with `authority` from now on: the leaves of the old CA go (the mint under way
        finishes into the old cache, which nothing reads; those waiting their turn are
        denied, and their clients connect again)."""
        old, self.authority = self.leaves, authority
        self.leaves = self._leaves()
        old.retire("the interception CA changed while this host's certificate waited its "
                   "turn: connect again")

    def forget_upstream_tls(self, alive: set) -> None:
        """The TLS sessions towards upstreams of corral sessions that are gone go."""
        if isinstance(self.upstream, ResumingContext):
            self.upstream.forget(alive)

    def days_left(self) -> int:
        left = self.authority.cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
        return left.days

    def describe(self) -> dict:
        """The CA as sessions need it (its certificate) and people check it."""
        cert = self.authority.cert
        return {"pem": cert.public_bytes(serialization.Encoding.PEM).decode(),
                "sha256": cert.fingerprint(hashes.SHA256()).hex(":"),
                "subject": cert.subject.rfc4514_string(),
                "not_before": cert.not_valid_before_utc.isoformat(),
                "not_after": cert.not_valid_after_utc.isoformat(),
                "days_left": self.days_left(),
                "permitted": list(self.authority.permitted) if self.authority.permitted
                is not None else None,
                "rotatable": self.directory is not None}

    async def leaf(self, host: Host, session: str | None) -> ssl.SSLContext:
        """The context to answer a client of `host` with. Raises Denied."""
        if not self.authority.covers(host):
            raise Denied(Decision(False, f"{host} is outside the interception CA's name "
                                  f"constraints ({', '.join(self.authority.permitted or ())})"
                                  ": its clients would refuse the certificate"), str(host))
        return await self.leaves.get(host, session)

    def status(self) -> dict:
        cert = self.authority.cert
        return {**self.leaves.stats, "leaves": len(self.leaves.cache),
                "ca_sha256": cert.fingerprint(hashes.SHA256()).hex(":"),
                "ca_not_after": cert.not_valid_after_utc.isoformat(),
                "ca_days_left": self.days_left()}

    def close(self) -> None:
        self.leaves.close()


def no_inspector(host: Host) -> Denied:
    """An inspected host where the filter has no interception CA: denied, never spliced."""
    return Denied(Decision(False, f"{host} is to be inspected, but the filter has no "
                           "interception CA ([inspect] ca_dir)"), str(host))
