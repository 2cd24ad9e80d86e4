"""What a worker holds of the policy store, and how a change reaches it. Pure.

Each session is served by one worker (`Shards`): every DNS question and proxy connection of
a session reaches the one worker that serves its gateway, so what a session counts (rate
limits, exfiltration scores, held connections, kept upstreams, mint budgets) lives in one
place, as with one process. A session goes to the worker with the fewest sessions when it
comes, and stays there while it lives: a hash of the name would be stateless, but spreads a
team's few sessions unevenly (two of two landed on one worker in the e2e tier).

A worker is never told to read a file. The coordinator works every change out, writes it
and follows it with the firewall as before (changes.py); then it sends each worker the
result in compiled form: the registered sessions, the appliance rules when they changed,
and the rules of each of the worker's own sessions whose policy changed (`state_for`). The
worker compiles those rules into the same Policy the coordinator holds. A policy file edited
between the coordinator's reading it and the worker's turn cannot make them disagree.

A worker knows every session's name and subnet, so a client is always told apart, but holds
a policy only for its own: another session's client (which the firewall never lets reach
this worker's gateway) is judged by FOREIGN, which allows nothing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

from appliance.policy import Policy
from appliance.policystore import Change, PolicyStore, Session

FOREIGN = Policy()
"""The policy of a session another worker serves: nothing is allowed."""


class Shards:
    """Which worker serves each session: the one with the fewest sessions when it came (the
    lowest index on a tie), for as long as it lives. Kept by the coordinator alone; a
    restarted filter assigns its sessions again, in the store's order."""

    def __init__(self, count: int):
        self.count = count
        self.of: dict[str, int] = {}
        self._load = [0] * count

    def assign(self, names: Iterable[str]) -> None:
        """The sessions there are now: those gone are let go, those new assigned."""
        names = list(names)
        present = set(names)
        for gone in [n for n in self.of if n not in present]:
            self._load[self.of.pop(gone)] -= 1
        for name in names:
            if name not in self.of:
                index = min(range(self.count), key=lambda k: (self._load[k], k))
                self.of[name] = index
                self._load[index] += 1

    def serves(self, index: int) -> Callable[[str], bool]:
        return lambda name: self.of.get(name) == index


def state_for(before: PolicyStore | Change | None, after: PolicyStore | Change,
           owns: Callable[[str], bool]) -> dict:
    """What a worker is sent for the step from `before` to `after` (`before` None:
    everything, for a worker that starts); `owns`: is a session that worker's?"""
    state: dict = {"registered": after.registered, "policies": {}}
    if before is None or after.base is not before.base:
        state["base"] = after.base
    for name, session in after.sessions.items():
        if not owns(name):
            continue
        if before is not None and before.sessions.get(name) is session:
            continue
        state["policies"][name] = (dataclasses.replace(session, policy=FOREIGN),
                                   session.policy.rules)
    return state


class Heard:
    """An answer another process's resolver fetched, as a Frontends book records it
    (`addresses(name)`, `expires`): what a worker tells of an inspected name's addresses."""

    def __init__(self, addresses: list, ttl: int):
        self._addresses = tuple(addresses)
        self.expires = time.monotonic() + ttl

    def addresses(self, name: str) -> tuple:
        return self._addresses


def replica(config) -> PolicyStore:
    """An empty store for a worker: nothing read from disk, filled by `apply`."""
    return PolicyStore(config, read=False)


def served(store: PolicyStore) -> list[str]:
    """The sessions a worker's store holds a policy for: its own."""
    return [name for name, s in store.sessions.items() if s.policy is not FOREIGN]


def apply(store: PolicyStore, state: dict) -> Change:
    """The change `state` (from `state_for`) makes to a worker's store, to commit."""
    base = state.get("base", store.base)
    outside = Policy(base) if "base" in state else store.outside
    policies = state["policies"]
    sessions: dict[str, Session] = {}
    for config in (*store.config.sessions, *state["registered"]):
        if config.name in policies:
            session, rules = policies[config.name]
            sessions[config.name] = dataclasses.replace(session, policy=Policy(rules))
            continue
        kept = store.sessions.get(config.name)
        if kept is not None and kept.subnet == config.subnet:
            sessions[config.name] = kept
        else:
            sessions[config.name] = Session(config.name, config.subnet, (), (), FOREIGN)
    return Change(config=store.config, registered=state["registered"], sessions=sessions,
                  base=base, outside=outside)
