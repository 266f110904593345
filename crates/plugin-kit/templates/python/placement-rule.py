"""A placement-rule plugin. It pins pods to the zone named by the KVCache
annotation `example.com/zone`, if present; add your own rules in `place`.
"""

import re
from typing import List, Tuple

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports import scheduling
from wit_world.imports import types

_ZONE = re.compile(r"^[A-Za-z0-9-]{1,63}$")


class Scheduling(exports.Scheduling):
    def configure(self, config: List[Tuple[str, str]]) -> None:
        pass

    def place(self, request: scheduling.PodRequest) -> scheduling.Placement:
        zone = dict(request.annotations).get("example.com/zone")
        node_affinity = None
        if zone is not None:
            if not _ZONE.match(zone):
                raise Err(types.Error_Invalid(f"annotation example.com/zone={zone!r}: not a valid zone name"))
            requirement = scheduling.NodeRequirement("topology.kubernetes.io/zone", scheduling.NodeOperator.IN, [zone])
            node_affinity = scheduling.NodeAffinity([[requirement]], [])
        return scheduling.Placement(node_affinity, None, None, [], [])
