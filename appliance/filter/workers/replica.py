"""What a worker holds of the policy store, and how a change reaches it. Pure.

Sessions are sharded across the workers by a hash of their name (`shard_of`): every DNS
question and proxy connection of a session reaches the one worker that serves its gateway,
so what a session counts (rate limits, exfiltration scores, held connections, kept
upstreams, mint budgets) lives in one place, as with one process.

A worker is never told to read a file. The coordinator works every change out, writes it
and follows it with the firewall as before (changes.py); then it sends each worker the
result in compiled form: the registered sessions, the appliance rules when they changed,
and the rules of each of the worker's own sessions whose policy changed (`follow`). The
worker compiles those rules into the same Policy the coordinator holds. A policy file edited
between the coordinator's reading it and the worker's turn cannot make them disagree.

A worker knows every session's name and subnet, so a client is always told apart, but holds
a policy only for its own: another session's client (which the firewall never lets reach
this worker's gateway) is judged by FOREIGN, which allows nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

from appliance.policy import Policy
from appliance.policystore import Change, PolicyStore, Session

FOREIGN = Policy()
"""The policy of a session another worker serves: nothing is allowed."""


def shard_of(name: str, count: int) -> int:
    """The worker (0 .. count-1) that serves session `name`: the same in every process and
    across restarts (never Python's salted `hash`)."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


def follow(before: PolicyStore | Change | None, after: PolicyStore | Change, index: int,
           count: int) -> dict:
    """What worker `index` of `count` is sent for the step from `before` to `after`
    (`before` None: everything, for a worker that starts)."""
    state: dict = {"registered": after.registered, "policies": {}}
    if before is None or after.base is not before.base:
        state["base"] = after.base
    for name, session in after.sessions.items():
        if shard_of(name, count) != index:
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
    store = PolicyStore.__new__(PolicyStore)
    store.config = config
    store.registered, store.base, store.outside, store.sessions = (), (), Policy(), {}
    store._clients, store._listeners = {}, []
    return store


def apply(store: PolicyStore, state: dict) -> Change:
    """The change `state` (from `follow`) makes to a worker's store, to commit."""
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
