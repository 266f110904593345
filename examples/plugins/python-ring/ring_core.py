"""Consistent hashing with virtual nodes: a bit-for-bit port of the Rust
ring behind `builtin:ring` (`kvplane_slots::ring`, in crates/slots).

It is kept free of any WIT bindings so it can be unit-tested with plain
CPython (``python3 -m pytest``) against vectors produced by the Rust crate;
``app.py`` only adapts it to the `key-placement` world: ``slot_table`` is
what its ``compute`` answers.
"""

import json
from bisect import bisect_left
from typing import List, NamedTuple, Sequence, Tuple

DEFAULT_VNODES = 160
MAX_VNODES = 4096
#: Most points one member puts on a slot-table ring, whatever its weight.
MAX_POINTS = 1 << 16

_MASK = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x00000100000001B3


def mix64(z: int) -> int:
    """SplitMix64 finaliser, on 64-bit wrapping arithmetic."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def hash64(data: bytes) -> int:
    """64-bit FNV-1a followed by the SplitMix64 finaliser."""
    h = _FNV_OFFSET
    for b in data:
        h = ((h ^ b) * _FNV_PRIME) & _MASK
    return mix64(h)


def rust_debug(text: str) -> str:
    """A string quoted the way Rust's `{:?}` quotes it, so error messages read
    the same whichever ring produced them."""
    return json.dumps(text, ensure_ascii=False)


class RingError(Exception):
    """Why a ring cannot answer; the message matches the Rust crate's."""


class Ring:
    """A consistent-hash ring over member ids."""

    def __init__(self, members: Sequence[str] = (), vnodes: int = DEFAULT_VNODES):
        vnodes = max(vnodes, 1)
        self._build([(m, vnodes) for m in members])

    @classmethod
    def weighted(cls, members: Sequence[Tuple[str, int]]) -> "Ring":
        """A ring where each member has its own number of points (its
        weight); a member with 0 points owns nothing but is still a member."""
        ring = cls.__new__(cls)
        ring._build(members)
        return ring

    def _build(self, members: Sequence[Tuple[str, int]]) -> None:
        # Python orders str by code point, which for UTF-8 is the byte order
        # Rust uses for String, so both sides index members identically.
        ordered = sorted(members)
        for a, b in zip(ordered, ordered[1:]):
            if a[0] == b[0]:
                raise RingError(f"member id {rust_debug(a[0])} appears more than once")
        points: List[Tuple[int, int]] = []
        for index, (member, vnodes) in enumerate(ordered):
            prefix = member.encode("utf-8") + b"#"
            for v in range(vnodes):
                points.append((hash64(prefix + str(v).encode("ascii")), index))
        # Ties between two members' points are broken by member index, as in
        # Rust, so the ring does not depend on the order members arrived in.
        points.sort()
        self.members: List[str] = [m for m, _ in ordered]
        self._hashes: List[int] = [p for p, _ in points]
        self._owners: List[int] = [m for _, m in points]

    def owners(self, key: bytes, replicas: int) -> List[str]:
        """Up to `replicas` distinct owners of `key`, primary first."""
        return [self.members[m] for m in self.owners_at(hash64(key), replicas)]

    def owners_at(self, point: int, replicas: int) -> List[int]:
        """The distinct owners met walking clockwise from `point`, as indices
        into `members`."""
        if replicas == 0:
            raise RingError("replicas must be at least 1")
        if not self._hashes:
            raise RingError("the membership is empty")
        wanted = min(replicas, len(self.members))
        n = len(self._hashes)
        start = bisect_left(self._hashes, point)
        found: List[int] = []
        for step in range(n):
            m = self._owners[(start + step) % n]
            if m not in found:
                found.append(m)
                if len(found) == wanted:
                    break
        return found


class SlotMember(NamedTuple):
    """A member as the slot table sees it."""

    id: str
    #: Relative share of keys; 100 is the usual weight, 0 owns nothing.
    weight: int
    #: Whether the member may own keys (up or joining; not draining or down).
    eligible: bool


def slot_table(members: Sequence[SlotMember], slots: int, replicas: int, vnodes: int = DEFAULT_VNODES) -> Tuple[int, List[int]]:
    """The slot table of `builtin:ring`: slot `s` sits at `hash64(s as u32
    little-endian)` on a ring of the eligible members, each with
    `vnodes * weight // 100` points (at least 1, at most 65536), and is owned
    by the first `replicas` distinct members clockwise from there.

    Returns (owners per slot, `slots * that` indices into `members` as
    passed, slot-major), as `kvplane_slots::ring::slot_table` does.
    """
    if replicas == 0:
        raise RingError("replicas must be at least 1")
    owning = [(i, m) for i, m in enumerate(members) if m.eligible and m.weight > 0]
    ring = Ring.weighted([(m.id, min(max(vnodes * m.weight // 100, 1), MAX_POINTS)) for _, m in owning])
    if not ring._hashes:
        raise RingError("the membership is empty")
    # Ring member index (sorted by id) -> index in `members`.
    index = {m.id: i for i, m in reversed(owning)}
    back = [index[member] for member in ring.members]
    r = min(replicas, len(ring.members))
    table: List[int] = []
    for slot in range(slots):
        table.extend(back[m] for m in ring.owners_at(hash64(slot.to_bytes(4, "little")), r))
    return r, table


def parse_vnodes(value: str) -> int:
    """The `vnodes` config value, validated as the Rust plugin does."""
    # Rust's u32 parse accepts an optional '+' and ASCII digits only.
    digits = value[1:] if value.startswith("+") else value
    if digits.isascii() and digits.isdigit():
        v = int(digits)
        if 1 <= v <= MAX_VNODES:
            return v
    raise RingError(f"config vnodes={rust_debug(value)}: expected an integer in 1..={MAX_VNODES}")
