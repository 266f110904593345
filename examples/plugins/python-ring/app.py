"""`key-placement` plugin in Python: the same slot table as `builtin:ring`.

It shows that a policy can be written in another language and still agree
with the Rust plugin owner for owner, which is what lets a pool mix hosts
running either one. The algorithm lives in `ring_core.py`; this module only
maps WIT calls and errors onto it.
"""

from typing import List, Tuple

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports import placement
from wit_world.imports import types

import ring_core


# componentize-py constructs a fresh `Placement` for every exported call, so
# state kept on `self` would be lost between `configure` and `compute`. It
# lives at module level instead, which lasts exactly as long as the host's
# plugin instance.
_vnodes = ring_core.DEFAULT_VNODES

# Members that may own keys; draining and down members own nothing.
_MAY_OWN = (types.MemberState.UP, types.MemberState.JOINING)


class Placement(exports.Placement):
    def configure(self, config: List[Tuple[str, str]]) -> None:
        global _vnodes
        for name, value in config:
            if name != "vnodes":
                raise Err(types.Error_Invalid(f"config {ring_core.rust_debug(name)}: unknown setting (known: vnodes)"))
            try:
                _vnodes = ring_core.parse_vnodes(value)
            except ring_core.RingError as e:
                raise Err(types.Error_Invalid(str(e)))

    def compute(self, members: List[types.Member], slots: int, replicas: int) -> placement.SlotTable:
        view = [ring_core.SlotMember(m.id, m.weight, m.state in _MAY_OWN) for m in members]
        try:
            r, owners = ring_core.slot_table(view, slots, replicas, _vnodes)
        except ring_core.RingError as e:
            raise Err(types.Error_Invalid(str(e)))
        return placement.SlotTable(r, owners)
