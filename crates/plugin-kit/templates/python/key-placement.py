"""A key-placement plugin: consistent hashing with virtual nodes, weighted.

Each member that may own keys puts `VNODES * weight / 100` points on a 64-bit
ring; slot `s` sits at point `mix(s)` and is owned by the first `replicas`
distinct members met walking clockwise from there. One member joining or
leaving moves only the slots whose arc it takes or gives up: about 1/N.

A ring costs O(log points) per slot; rendezvous hashing would cost
O(members) per slot, too slow in interpreted Python for large pools.
"""

from bisect import bisect_left
from typing import List, Tuple

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports import placement
from wit_world.imports import types

VNODES = 128
MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    """SplitMix64 finaliser: spreads the bits of `z` over 64 bits."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _hash(data: bytes) -> int:
    """FNV-1a 64, finalised by `_mix`."""
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & MASK
    return _mix(h)


class Placement(exports.Placement):
    def configure(self, config: List[Tuple[str, str]]) -> None:
        for name, _ in config:
            raise Err(types.Error_Invalid(f"config {name!r}: unknown setting"))

    def compute(self, members: List[types.Member], slots: int, replicas: int) -> placement.SlotTable:
        if replicas == 0:
            raise Err(types.Error_Invalid("replicas must be at least 1"))
        ids = sorted(m.id for m in members)
        if len(set(ids)) != len(ids):
            raise Err(types.Error_Invalid("a member appears twice"))
        # Down and draining members own nothing, nor does a weight of 0.
        may_own = (types.MemberState.UP, types.MemberState.JOINING)
        owning = [i for i, m in enumerate(members) if m.state in may_own and m.weight > 0]
        if not owning:
            raise Err(types.Error_Invalid("no member may own keys: every one is down, draining or of weight 0"))
        # (point, id, index into `members`): ties between points go to the
        # id that sorts first, so the ring does not depend on list order.
        points = []
        for i in owning:
            m = members[i]
            seed = _hash(m.id.encode())
            for v in range(min(max(VNODES * m.weight // 100, 1), 1 << 16)):
                points.append((_mix(seed ^ ((v * GOLDEN) & MASK)), m.id, i))
        points.sort()
        hashes = [p[0] for p in points]
        holders = [p[2] for p in points]
        r = min(replicas, len(owning))
        n = len(points)
        owners: List[int] = []
        for slot in range(slots):
            at = bisect_left(hashes, _mix((slot * GOLDEN) & MASK))
            found: List[int] = []
            while len(found) < r:
                i = holders[at % n]
                if i not in found:
                    found.append(i)
                at += 1
            owners.extend(found)
        return placement.SlotTable(r, owners)
