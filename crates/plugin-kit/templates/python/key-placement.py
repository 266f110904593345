"""A key-placement plugin: rendezvous (highest random weight) hashing.

Each key is owned by the members with the highest score(member, key); one
member joining or leaving moves only the keys it wins or held.
"""

from typing import List, Tuple

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import types

MASK = (1 << 64) - 1

# componentize-py creates a new export object per call: keep state at module
# level, which lives as long as the plugin instance.
_members: List[str] = []


def _score(member: str, key: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in member.encode() + b"\xff" + key:
        h = ((h ^ b) * 0x100000001B3) & MASK
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & MASK
    return h ^ (h >> 31)


class Placement(exports.Placement):
    def configure(self, config: List[Tuple[str, str]]) -> None:
        for name, _ in config:
            raise Err(types.Error_Invalid(f"config {name!r}: unknown setting"))

    def set_members(self, members: List[types.Node]) -> None:
        global _members
        ids = sorted(m.id for m in members)
        if len(set(ids)) != len(ids):
            raise Err(types.Error_Invalid("a member appears twice"))
        _members = ids

    def owners(self, keys: List[bytes], replicas: int) -> List[List[str]]:
        if not _members:
            raise Err(types.Error_Invalid("no members"))
        if replicas == 0:
            raise Err(types.Error_Invalid("replicas must be at least 1"))
        result = []
        for key in keys:
            ranked = sorted(_members, key=lambda m: (_score(m, bytes(key)), m), reverse=True)
            result.append(ranked[:replicas])
        return result
