"""A retry-policy plugin: capped exponential backoff with full jitter,
bounded by an attempt limit, an overall budget and the caller's deadline.

Config: budget-ms (default 500), max-attempts (default 4).
"""

from typing import List, Tuple

from componentize_py_types import Err
from wit_world import exports
from wit_world.exports import retry
from wit_world.imports import types

# componentize-py creates a new export object per call: keep state at module
# level, which lives as long as the plugin instance.
_settings = {"budget-ms": 500, "max-attempts": 4}

# The answer would be the same next time.
_HOPELESS = (types.Error_NotFound, types.Error_Invalid, types.Error_Unsupported, types.Error_Denied)


class Retry(exports.Retry):
    def configure(self, config: List[Tuple[str, str]]) -> None:
        for name, value in config:
            if name not in _settings:
                raise Err(types.Error_Invalid(f"config {name!r}: unknown setting"))
            if not (value.isascii() and value.isdigit()):
                raise Err(types.Error_Invalid(f"config {name}={value}: expected a non-negative integer"))
            _settings[name] = int(value)

    def decide(self, failure: retry.Failure) -> retry.Decision:
        error = failure.error
        floor = 0  # the least delay the store asked for
        if isinstance(error, _HOPELESS):
            return retry.Decision_GiveUp()
        if isinstance(error, types.Error_Capacity):
            # A full store will not empty itself in milliseconds; another
            # replica may have room.
            return retry.Decision_FailOver()
        if isinstance(error, types.Error_Busy):
            # Refused, so it did not happen: safe to repeat after retry-after.
            floor = error.value.retry_after_ms
        elif not failure.idempotent:
            # After a timeout or a lost connection the operation may have
            # taken effect: repeat it only if that is harmless.
            return retry.Decision_GiveUp()
        if failure.attempt >= _settings["max-attempts"]:
            return retry.Decision_GiveUp()
        cap = min(10 << min(failure.attempt, 16), 1000)
        delay = max(failure.jitter_seed % (cap + 1), floor)
        # A retry that would outlast the budget or the caller's deadline is wasted.
        if failure.elapsed_ms + delay > _settings["budget-ms"] or delay >= failure.deadline_left_ms:
            return retry.Decision_GiveUp()
        return retry.Decision_RetryAfter(delay)
