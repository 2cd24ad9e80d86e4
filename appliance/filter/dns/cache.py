"""The DNS filter's caches, sans-IO: an LRU whose entries belong to sessions, and the wire
cache of answers kept as the bytes that went out.

Both caches used to rebuild their whole dict when full, on every insert once full of live
entries: a stream of random names (the exfiltration pattern) made every answer, for every
session, cost a walk over tens of thousands of entries (issue 14, B11). `SharedLru` evicts
in O(1), and gives each session a share: a session over its share evicts its own oldest
entry, so one session's flood of random names never pushes out another's answers. Expired
entries are dropped when they are next looked up (or age out of the LRU order).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

WIRE_CACHE_MAX = 20_000
"""Answers the wire cache holds in all."""
RESOLVER_CACHE_MAX = 100_000
"""Answers the resolver's cache holds in all."""


class SharedLru:
    """A bounded map in least-recently-used order whose entries each belong to an owner.

    An owner at its `share` loses its own least recently used entry to make room; the map at
    its `limit` loses the least recently used entry of all (only when the shares add up to
    more than the limit). Every operation is O(1) but `drop_owner`, which is O(that owner's
    entries)."""

    def __init__(self, limit: int, share: int):
        self.limit, self.share = limit, share
        self._entries: OrderedDict[Hashable, tuple[Hashable, Any]] = OrderedDict()
        self._owned: dict[Hashable, OrderedDict[Hashable, None]] = {}
        self.evicted = 0
        """Entries pushed out to make room (not those dropped as expired or replaced)."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable) -> Any:
        """The value under `key` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        self._owned[entry[0]].move_to_end(key)
        return entry[1]

    def put(self, key: Hashable, value: Any, owner: Hashable) -> None:
        self.pop(key)
        owned = self._owned.get(owner)
        while owned and len(owned) >= self.share:
            self._evict(next(iter(owned)))
        while len(self._entries) >= self.limit:
            self._evict(next(iter(self._entries)))
        self._entries[key] = (owner, value)
        self._owned.setdefault(owner, OrderedDict())[key] = None

    def _evict(self, key: Hashable) -> None:
        self.pop(key)
        self.evicted += 1

    def pop(self, key: Hashable) -> Any:
        """Remove `key`; its value, or None."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        owned = self._owned[entry[0]]
        del owned[key]
        if not owned:
            del self._owned[entry[0]]
        return entry[1]

    def owned(self, owner: Hashable) -> int:
        """How many entries `owner` holds."""
        owned = self._owned.get(owner)
        return len(owned) if owned is not None else 0

    def owners(self) -> dict[Hashable, int]:
        return {owner: len(keys) for owner, keys in self._owned.items()}

    def drop_owner(self, owner: Hashable) -> None:
        for key in list(self._owned.get(owner, ())):
            self.pop(key)


def _skip_name(wire: bytes, pos: int) -> int:
    while True:
        length = wire[pos]
        if length >= 0xC0:  # a compression pointer ends the name
            return pos + 2
        if length == 0:
            return pos + 1
        pos += 1 + length


def ttl_offsets(wire: bytes) -> list[int]:
    """Where the TTL fields are in a reply we packed ourselves (OPT's TTL slot holds flags,
    not a TTL). Only ever given our own replies: never a client's or an upstream's bytes."""
    counts = struct.unpack_from("!4H", wire, 4)
    pos = 12
    for _ in range(counts[0]):
        pos = _skip_name(wire, pos) + 4
    out = []
    for _ in range(sum(counts[1:])):
        pos = _skip_name(wire, pos)
        rtype, _, _, length = struct.unpack_from("!HHIH", wire, pos)
        if rtype != 41:
            out.append(pos + 4)
        pos += 10 + length
    return out


class WireCache:
    """Hot answers kept as the bytes that went out, keyed by (policy, session, transport,
    the query after its ID): a hit patches the ID and the TTLs and emits the same decision
    event — no parsing, no deciding, no encoding. Only answers that need nothing per client
    are kept (never one that taught the firewall, never SERVFAIL). Each session holds at
    most `share` of the `limit` entries."""

    def __init__(self, limit: int = WIRE_CACHE_MAX, share: int = WIRE_CACHE_MAX):
        self.entries = SharedLru(limit, share)
        self.hits = 0

    def get(self, key: tuple, query_id: bytes, client: str, now: float
            ) -> tuple[bytes, dict] | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        wire, offsets, expires, event = entry
        if expires <= now:
            self.entries.pop(key)
            return None
        self.hits += 1
        reply = bytearray(wire)
        reply[:2] = query_id
        ttl = max(1, int(expires - now))
        for offset in offsets:
            struct.pack_into("!I", reply, offset, ttl)
        return bytes(reply), {**event, "client": client}

    def put(self, key: tuple, session: str | None, wire: bytes, expires: float,
            event: dict) -> None:
        template = {k: v for k, v in event.items() if k not in ("id", "ts", "client")}
        self.entries.put(key, (wire, ttl_offsets(wire), expires, template), session)

    def drop_session(self, session: str | None) -> None:
        """Forget a session's answers (its policy changed, or it has gone): old Policy
        objects, which the keys hold, must not stay alive for the length of a TTL."""
        self.entries.drop_owner(session)
