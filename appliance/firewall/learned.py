"""The learned set as the filter keeps it: nftables' set, the ledger of who taught each
element, and the connections to end when one is taken back, with one lock around the three.

  learn()   a DNS answer teaches elements. Each is judged again under the lock, against the
            policy in force now: an answer decided under a policy that was changed while it
            waited for its upstream teaches nothing the new policy would not.
  revoke()  after a policy change: the elements none of whose names the policy allows any
            more (or whose session has gone) are deleted in one transaction, then their
            established connections are ended (conntrack.py says why that stops them).
  apply()   a new ruleset is built with the ledger's live elements and loaded under the
            lock: nothing learned meanwhile is lost, nothing taken back comes back. At
            start-up, the elements a previous filter left in the set are not carried over
            and their connections are ended: nobody can say any more which name allowed
            them, so nobody could take them back (the proxy's flows die with the process too).

Every call blocks (libnftables, netlink): the filter makes them off its event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from appliance.policy import Decision

from .conntrack import Conntrack
from .ledger import PER_SESSION, Judge, Key, Ledger, Revoked

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Teaching:
    """One element a DNS answer teaches: this sandbox may reach this address on this port,
    because `name` (which a tcp rule of `session` allows) resolved to it."""

    session: str
    name: str
    sandbox: str
    destination: str
    port: int
    timeout: int
    """Seconds (the answer's TTL, at least [firewall] learn_ttl_min)."""

    @property
    def key(self) -> Key:
        return (self.sandbox, self.destination, self.port)


@dataclass(frozen=True, slots=True)
class Learned:
    taught: list[Teaching]
    refused: str | None = None
    """Why some were not taught (None: all were)."""


@dataclass(frozen=True, slots=True)
class Cut:
    """An element taken back, and what became of its connections."""

    revoked: Revoked
    connections: int = 0
    """Established connections ended."""
    error: str | None = None
    """Why its connections could not be ended (the element is gone all the same)."""


class LearnedSet:
    def __init__(self, nft, judge: Judge, conntrack=None, per_session: int = PER_SESSION,
                 clock: Callable[[], float] = time.monotonic):
        self.nft, self.judge, self.clock = nft, judge, clock
        self.conntrack = conntrack if conntrack is not None else Conntrack()
        self.ledger = Ledger(per_session)
        self.lock = threading.Lock()

    def learn(self, teachings: list[Teaching]) -> Learned:
        """Teach what the policy in force still allows and the session has room for, in one
        transaction; raises NftError (then nothing was taught)."""
        taught, refused = [], []
        new: Counter[str] = Counter()
        with self.lock:
            self.ledger.expire(self.clock())
            for teaching in teachings:
                session, key = teaching.session, teaching.key
                decision = self.judge(session, key, teaching.name)
                if not decision.allowed:
                    refused.append(f"{teaching.destination}:{teaching.port}: "
                                   f"{decision.reason}")
                elif not self.ledger.room(session, key, new[session]):
                    refused.append(f"{teaching.destination}:{teaching.port}: session "
                                   f"{session} holds {self.ledger.per_session} learned "
                                   "allowances already")
                else:
                    taught.append(teaching)
                    new[session] += not self.ledger.holds(session, key)
            self.nft.learn([(t.sandbox, t.destination, t.port, t.timeout) for t in taught])
            done = self.clock()  # nftables counts each timeout from before this
            for teaching in taught:
                self.ledger.record(teaching.session, teaching.name, teaching.key,
                                   done + teaching.timeout)
        return Learned(taught, "; ".join(refused)[:500] or None)

    def revoke(self) -> list[Cut]:
        """Take back every element the policy in force no longer allows; raises NftError
        when nftables refuses (then the ledger keeps them, and the next change tries
        again)."""
        with self.lock:
            self.ledger.expire(self.clock())
            doomed = self.ledger.doomed(self.judge)
            if not doomed:
                return []
            self.nft.forget([r.key for r in doomed])
            self.ledger.forget(r.key for r in doomed)
        return self._end(doomed)

    def apply(self, build: Callable[[list[dict]], list[dict]], sessions: set[str],
              end_strangers: bool = False) -> list[Cut]:
        """Load `build(learned elements)` with the live elements of these sessions. With
        `end_strangers` (start-up), elements in the set that the ledger does not know are
        left out, and their connections ended."""
        with self.lock:
            now = self.clock()
            self.ledger.expire(now)
            strangers = []
            if end_strangers:
                strangers = sorted(self.nft.learned_keys() - self.ledger.elements.keys())
            learned = [{"elem": {"val": {"concat": list(key)}, "timeout": left}}
                       for key, left in self.ledger.live(now, sessions)]
            self.nft.apply(build(learned))
        unknown = Decision(False, "the filter restarted: no one can tell which name taught "
                                  "this allowance, so no one could take it back")
        return self._end([Revoked(key, "", (), unknown) for key in strangers])

    def _end(self, revoked: list[Revoked]) -> list[Cut]:
        """End the established connections of these elements (after they left the set:
        else the next packet would find its way back in as a new flow)."""
        if not revoked:
            return []
        try:
            ended = self.conntrack.end([r.key for r in revoked])
        except OSError as exc:
            log.error("learned set: could not end connections: %s", exc)
            return [Cut(r, 0, f"connections not ended: {exc}") for r in revoked]
        return [Cut(r, ended.get(r.key, 0)) for r in revoked]
