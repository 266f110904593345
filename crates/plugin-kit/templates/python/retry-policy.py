"""A retry-policy plugin: capped exponential backoff with full jitter,
bounded by an attempt limit and an overall budget.

Config: budget-ms (default 500), max-attempts (default 4).
"""

from typing import List, Tuple

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports import retry
from wit_world.imports import types

_settings = {"budget-ms": 500, "max-attempts": 4}


class Retry(exports.Retry):
    def configure(self, config: List[Tuple[str, str]]) -> None:
        for name, value in config:
            if name not in _settings:
                raise Err(types.Error_Invalid(f"config {name!r}: unknown setting"))
            if not value.isdigit():
                raise Err(types.Error_Invalid(f"config {name}={value}: expected a non-negative integer"))
            _settings[name] = int(value)

    def decide(self, failure: retry.Failure) -> retry.Decision:
        if isinstance(failure.error, (types.Error_NotFound, types.Error_Invalid)):
            return retry.Decision_GiveUp()
        if failure.attempt >= _settings["max-attempts"]:
            return retry.Decision_GiveUp()
        cap = min(10 << min(failure.attempt, 16), 1000)
        delay = failure.jitter_seed % (cap + 1)
        if failure.elapsed_ms + delay > _settings["budget-ms"]:
            return retry.Decision_GiveUp()
        return retry.Decision_RetryAfter(delay)
