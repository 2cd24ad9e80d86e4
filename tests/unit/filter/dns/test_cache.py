"""The DNS caches: O(1) LRU eviction with per-session shares, and the wire cache on top."""

from __future__ import annotations

from dnslib import RR, DNSRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.filter.dns.cache import SharedLru, WireCache, ttl_offsets


def test_a_full_cache_evicts_its_least_recently_used_entry_one_at_a_time():
    cache = SharedLru(limit=3, share=3)
    for key in "abc":
        cache.put(key, key.upper(), "s1")
    assert cache.get("a") == "A"  # a is now the most recently used
    cache.put("d", "D", "s1")
    assert ("b" in cache, len(cache), cache.evicted) == (False, 3, 1)
    cache.put("e", "E", "s1")
    assert [k for k in "abcde" if k in cache] == ["a", "d", "e"]
    assert cache.evicted == 2


def test_a_session_at_its_share_evicts_only_its_own_entries():
    cache = SharedLru(limit=10, share=3)
    cache.put("s1-cached", 1, "s1")
    for i in range(1000):  # s2 floods random names
        cache.put(f"s2-{i}", i, "s2")
    assert cache.get("s1-cached") == 1
    assert cache.owned("s2") == 3 and cache.owned("s1") == 1
    assert cache.owners() == {"s1": 1, "s2": 3}
    assert [f"s2-{i}" in cache for i in range(996, 1000)] == [False, True, True, True]


def test_replacing_an_entry_moves_it_to_its_new_owner():
    cache = SharedLru(limit=10, share=2)
    cache.put("k", 1, "s1")
    cache.put("k", 2, "s2")
    assert (cache.get("k"), cache.owned("s1"), cache.owned("s2")) == (2, 0, 1)


def test_dropping_an_owner_forgets_its_entries_only():
    cache = SharedLru(limit=10, share=5)
    cache.put("a", 1, "s1")
    cache.put("b", 2, "s2")
    cache.put("c", 3, None)
    cache.drop_owner("s1")
    cache.drop_owner("nobody")
    assert ("a" in cache, cache.get("b"), cache.get("c"), len(cache)) == (False, 2, 3, 2)


class Model:
    """What SharedLru must do, written the slow and obvious way."""

    def __init__(self, limit, share):
        self.limit, self.share = limit, share
        self.order: list[tuple] = []  # (key, owner, value), least recently used first

    def get(self, key):
        for i, (k, _owner, value) in enumerate(self.order):
            if k == key:
                self.order.append(self.order.pop(i))
                return value
        return None

    def pop(self, key):
        self.order = [e for e in self.order if e[0] != key]

    def put(self, key, value, owner):
        self.pop(key)
        while sum(1 for e in self.order if e[1] == owner) >= self.share:
            self.order.remove(next(e for e in self.order if e[1] == owner))
        while len(self.order) >= self.limit:
            self.order.pop(0)
        self.order.append((key, owner, value))


ops = st.lists(st.tuples(st.sampled_from(["put", "get", "pop", "drop"]),
                         st.integers(0, 12), st.sampled_from(["s1", "s2", None])), max_size=80)


@settings(max_examples=400)
@given(ops=ops, limit=st.integers(1, 8), share=st.integers(1, 8))
def test_the_cache_does_what_the_obvious_model_does(ops, limit, share):
    cache, model = SharedLru(limit, share), Model(limit, share)
    for op, key, owner in ops:
        if op == "put":
            cache.put(key, (key, owner), owner)
            model.put(key, (key, owner), owner)
        elif op == "get":
            assert cache.get(key) == model.get(key)
        elif op == "pop":
            cache.pop(key)
            model.pop(key)
        else:
            cache.drop_owner(owner)
            model.order = [e for e in model.order if e[1] != owner]
        assert len(cache) == len(model.order) <= limit
        assert all(cache.owned(o) <= share for o in ("s1", "s2", None))
    assert sorted(map(repr, cache.owners().items())) == sorted(
        repr((o, sum(1 for e in model.order if e[1] == o)))
        for o in {e[1] for e in model.order})


def answer(name: str = "a.example") -> bytes:
    reply = DNSRecord.question(name).reply()
    reply.add_answer(*RR.fromZone(f"{name}. 300 IN A 192.0.2.1"))
    reply.add_answer(*RR.fromZone(f"{name}. 300 IN A 192.0.2.2"))
    return reply.pack()


def test_a_wire_hit_has_its_own_id_and_the_ttl_left():
    cache = WireCache(limit=10, share=10)
    wire = answer()
    cache.put(("k",), "s1", wire, expires=100.0, event={"id": 7, "verdict": "allow"})
    hit, event = cache.get(("k",), b"\x12\x34", "10.0.0.2", now=40.0)
    reply = DNSRecord.parse(hit)
    assert reply.header.id == 0x1234 and [rr.ttl for rr in reply.rr] == [60, 60]
    assert event == {"verdict": "allow", "client": "10.0.0.2"}  # a new event, no old id
    assert ttl_offsets(wire) == [len(wire) - 26, len(wire) - 10]  # 16-byte A records
    assert cache.hits == 1


def test_an_expired_wire_entry_is_dropped_when_next_asked_for():
    cache = WireCache(limit=10, share=10)
    cache.put(("k",), "s1", answer(), expires=100.0, event={})
    assert cache.get(("k",), b"\x00\x01", "c", now=100.0) is None
    assert len(cache.entries) == 0 and cache.hits == 0


def test_one_session_flooding_the_wire_cache_keeps_within_its_share():
    cache = WireCache(limit=100, share=10)
    cache.put(("s1", "hot"), "s1", answer(), expires=1e9, event={})
    for i in range(500):
        cache.put(("s2", i), "s2", answer(f"n{i}.example"), expires=1e9, event={})
    assert cache.get(("s1", "hot"), b"\x00\x01", "c", now=0.0) is not None
    assert cache.entries.owned("s2") == 10
    cache.drop_session("s2")
    assert len(cache.entries) == 1
