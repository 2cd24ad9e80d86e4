"""A push's pack, read as far as its commits: each commit's id and parents, whole or as a
delta of another commit in the pack, and whether one commit descends from another. Sans-IO,
standard library only, bounded (objects, commits, inflated bytes, time); what judges a push
with them is http.py.
"""

from __future__ import annotations

import hashlib
import time
import zlib

from .protocol import OID, GitProtocolError

JUDGE_SECONDS = 20.0
"""How long judging one push may take (on a worker thread) before it is refused."""
COMMIT, TREE, BLOB, TAG, OFS_DELTA, REF_DELTA = 1, 2, 3, 4, 6, 7


MAX_OBJECTS = 1_000_000
"""The most objects a push's pack may say it holds (each costs a few microseconds to walk
past, on a worker thread)."""
MAX_COMMITS = 100_000
"""The most commits of a push read (each is kept while the push is judged, a few hundred
bytes: 200,000 cost 40 MiB and 11 s, measured). An agent pushes its own few commits; a
push of more is refused with the reason."""
MAX_COMMIT = 1 << 20
"""The largest commit object read (a real one is a few hundred bytes)."""
MAX_INFLATED = 1 << 30
"""The most a push's objects may inflate to, all together, before the push is refused (a
zlib bomb costs CPU, never memory: what is not a commit is inflated and thrown away)."""
STEP = 1 << 16


def _varint_header(data, pos: int) -> tuple[int, int, int]:
    byte = data[pos]
    kind, size, shift = (byte >> 4) & 7, byte & 15, 4
    pos += 1
    while byte & 0x80:
        if shift > 60:
            raise GitProtocolError("an object header longer than git writes")
        byte = data[pos]
        size |= (byte & 0x7F) << shift
        shift += 7
        pos += 1
    return kind, size, pos


class InflateBudget:
    """What the objects of one push may still inflate to."""

    def __init__(self, left: int = MAX_INFLATED):
        self.left = left

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise GitProtocolError(f"the pack inflates to more than {MAX_INFLATED >> 20} MiB")


def _inflate(data, pos: int, size: int, keep: bool, budget: InflateBudget) -> tuple[bytes, int]:
    """The object at `pos` inflated (b"" unless `keep`), and where its zlib stream ends.
    Output is taken a step at a time, never more than the object says it holds."""
    if keep and size > MAX_COMMIT:
        raise GitProtocolError(f"a commit of {size} bytes in the pack; git writes them small")
    inflater = zlib.decompressobj()
    out, total, at = bytearray(), 0, pos
    while not inflater.eof:  # fed in steps: an object's compressed size is not written
        if at >= len(data):
            raise GitProtocolError("the pack ends inside an object")
        piece = data[at : at + STEP]
        at += len(piece)
        while piece:
            chunk = inflater.decompress(piece, STEP)
            total += len(chunk)
            if total > size:
                raise GitProtocolError("an object inflates past the size it declares")
            budget.spend(len(chunk))
            if keep:
                out += chunk
            piece = inflater.unconsumed_tail
            if inflater.eof:
                break
    if total != size:
        raise GitProtocolError("an object inflates to less than the size it declares")
    return bytes(out), at - len(inflater.unused_data)


def _delta_size(delta: bytes, pos: int) -> tuple[int, int]:
    size, shift = 0, 0
    while True:
        if shift > 60:
            raise GitProtocolError("a delta header longer than git writes")
        byte = delta[pos]
        pos += 1
        size |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return size, pos


def apply_delta(base: bytes, delta: bytes, deadline: float | None = None) -> bytes:
    """A git delta applied to its base (a commit: never more than MAX_COMMIT). Raises
    GitProtocolError."""
    try:
        source, pos = _delta_size(delta, 0)
        target, pos = _delta_size(delta, pos)
        if source != len(base):
            raise GitProtocolError("a delta's base is not the size it says")
        if target > MAX_COMMIT:
            raise GitProtocolError(f"a delta makes an object of {target} bytes from a commit")
        out, ops = bytearray(), 0
        while pos < len(delta):
            ops += 1
            if ops % 65536 == 0:
                check_deadline(deadline)
            op = delta[pos]
            pos += 1
            if op & 0x80:
                offset = length = 0
                for i in range(4):
                    if op & (1 << i):
                        offset |= delta[pos] << (8 * i)
                        pos += 1
                for i in range(3):
                    if op & (0x10 << i):
                        length |= delta[pos] << (8 * i)
                        pos += 1
                length = length or 0x10000
                if offset + length > len(base):
                    raise GitProtocolError("a delta copies from past its base")
                piece = base[offset : offset + length]
            elif op:
                piece = delta[pos : pos + op]
                pos += op
            else:
                raise GitProtocolError("a delta holds the reserved opcode 0")
            if len(out) + len(piece) > target:
                raise GitProtocolError("a delta's result is larger than it says")
            out += piece
    except IndexError:
        raise GitProtocolError("a delta ends early") from None
    if len(out) != target:
        raise GitProtocolError("a delta's result is not the size it says")
    return bytes(out)


def check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise GitProtocolError(f"the push took more than {JUDGE_SECONDS:g} s to read")


def iter_commits(pack, sha256: bool = False, deadline: float | None = None):
    """(id, parents) of every commit a pack holds whole or as a delta of another commit in
    it, in pack order, up to the first object that is neither: git writes commits first, so
    trees and blobs are never inflated (a pack that puts a commit after them only has it
    unread, and what it would have shown unshown). Raises GitProtocolError for what is not
    a pack, a pack that lies about its objects, or past `deadline` (time.monotonic())."""
    pack = memoryview(pack)  # slices without copies
    if len(pack) < 12 or pack[:4] != b"PACK" or pack[4:8] not in (b"\0\0\0\2", b"\0\0\0\3"):
        raise GitProtocolError("the push's pack does not start with a pack header")
    count = int.from_bytes(pack[8:12], "big")
    if count > MAX_OBJECTS:
        raise GitProtocolError(f"a pack of {count} objects; corral reads at most {MAX_OBJECTS}")
    hash_len = 32 if sha256 else 20
    digest = hashlib.sha256 if sha256 else hashlib.sha1
    kept: dict[int, bytes] = {}  # offset -> commit body, for deltas against it
    by_id: dict[bytes, bytes] = {}  # binary id -> commit body
    budget, pos, commits = InflateBudget(), 12, 0
    try:
        for index in range(count):
            if index % 256 == 0:
                check_deadline(deadline)
            start = pos
            kind, size, pos = _varint_header(pack, pos)
            base: bytes | None = None
            if kind == OFS_DELTA:
                byte = pack[pos]
                pos += 1
                back = byte & 0x7F
                for _ in range(10):
                    if not byte & 0x80:
                        break
                    byte = pack[pos]
                    pos += 1
                    back = ((back + 1) << 7) | (byte & 0x7F)
                else:
                    raise GitProtocolError("a delta offset longer than git writes")
                base = kept.get(start - back)
            elif kind == REF_DELTA:
                base = by_id.get(bytes(pack[pos : pos + hash_len]))
                pos += hash_len
            elif kind not in (COMMIT, TREE, BLOB, TAG):
                raise GitProtocolError(f"an object of unknown type {kind} in the pack")
            if kind != COMMIT and base is None:
                return  # the commits are behind: nothing after this is read
            commits += 1
            if commits > MAX_COMMITS:
                raise GitProtocolError(f"a push of more than {MAX_COMMITS} commits; corral "
                                       "judges at most that many")
            data, pos = _inflate(pack, pos, size, True, budget)
            body = data if kind == COMMIT else apply_delta(base, data, deadline)
            oid = digest(b"commit %d\0" % len(body) + body)
            kept[start] = body
            by_id[oid.digest()] = body
            yield oid.hexdigest(), _parents(body, 2 * hash_len)
    except IndexError:
        raise GitProtocolError("the pack ends inside an object header") from None
    except zlib.error as exc:
        raise GitProtocolError(f"the pack holds data that does not inflate: {exc}") from None


def pack_commits(pack, sha256: bool = False) -> dict[str, tuple[str, ...]]:
    """Every commit of the pack (iter_commits): id -> parents."""
    return dict(iter_commits(pack, sha256))


def _parents(body: bytes, hex_len: int) -> tuple[str, ...]:
    """The parents as git reads them: the `parent` lines right after the `tree` line. A
    commit that says anything else in their place is refused, not read another way."""
    lines = body.split(b"\n\n", 1)[0].split(b"\n")
    if not lines[0].startswith(b"tree "):
        raise GitProtocolError("a commit in the pack does not start with its tree")
    parents: list[str] = []
    rest = lines[1:]
    while rest and rest[0].startswith(b"parent "):
        oid = rest.pop(0)[7:]
        if len(oid) != hex_len or not OID.fullmatch(oid):
            raise GitProtocolError("a commit in the pack names a parent that is not an id")
        parents.append(oid.decode())
    if any(line.startswith(b"parent ") for line in rest):
        raise GitProtocolError("a commit in the pack has a parent line out of its place")
    return tuple(parents)


def fast_forward(commits: dict[str, tuple[str, ...]], old: str, new: str) -> bool:
    """Does `new` descend from `old`, as far as the pack's commits show?"""
    seen, todo = set(), [new]
    while todo:
        oid = todo.pop()
        if oid == old:
            return True
        if oid in seen or oid not in commits:
            continue
        seen.add(oid)
        todo.extend(commits[oid])
    return False
