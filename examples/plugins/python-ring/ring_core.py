"""Consistent hashing with virtual nodes: a bit-for-bit port of the Rust
`kvplane-ring-core` crate behind `builtin:ring`.

It is kept free of any WIT bindings so it can be unit-tested with plain
CPython (``python3 -m pytest``) against vectors produced by the Rust crate;
``app.py`` only adapts it to the `key-placement` world.
"""

import json
from bisect import bisect_left
from typing import List, Sequence, Tuple

DEFAULT_VNODES = 160
MAX_VNODES = 4096

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
        # Python orders str by code point, which for UTF-8 is the byte order
        # Rust uses for String, so both sides index members identically.
        ids = sorted(members)
        for a, b in zip(ids, ids[1:]):
            if a == b:
                raise RingError(f"member id {rust_debug(a)} appears more than once")
        points: List[Tuple[int, int]] = []
        for index, member in enumerate(ids):
            prefix = member.encode("utf-8") + b"#"
            for v in range(vnodes):
                points.append((hash64(prefix + str(v).encode("ascii")), index))
        # Ties between two members' points are broken by member index, as in
        # Rust, so the ring does not depend on the order members arrived in.
        points.sort()
        self.members: List[str] = ids
        self._hashes: List[int] = [p for p, _ in points]
        self._owners: List[int] = [m for _, m in points]

    def owners(self, key: bytes, replicas: int) -> List[str]:
        """Up to `replicas` distinct owners of `key`, primary first."""
        if replicas == 0:
            raise RingError("replicas must be at least 1")
        if not self.members:
            raise RingError("the membership is empty")
        wanted = min(replicas, len(self.members))
        n = len(self._hashes)
        start = bisect_left(self._hashes, hash64(key))
        found: List[int] = []
        for step in range(n):
            m = self._owners[(start + step) % n]
            if m not in found:
                found.append(m)
                if len(found) == wanted:
                    break
        return [self.members[m] for m in found]


def parse_vnodes(value: str) -> int:
    """The `vnodes` config value, validated as the Rust plugin does."""
    # Rust's u32 parse accepts an optional '+' and ASCII digits only.
    digits = value[1:] if value.startswith("+") else value
    if digits.isascii() and digits.isdigit():
        v = int(digits)
        if 1 <= v <= MAX_VNODES:
            return v
    raise RingError(f"config vnodes={rust_debug(value)}: expected an integer in 1..={MAX_VNODES}")
