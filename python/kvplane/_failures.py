"""The counters and the rate-limited failure log of an engine connector.

An engine connector answers every failure as a miss and must never flood
the engine's log: a node that is down fails every call, thousands a second.
So each failure is counted (``failed_{op}_{reason}``, in the connector's
``stats()``) and logged at warning at most once per kind every
``LOG_EVERY_S`` seconds, the rest at debug, with the count so far. The
SGLang backend and the AIBrix connector share this (they had a copy each);
each names its own logger and wording (``failed`` / ``answered as a miss``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

# A failure of one kind is logged at warning at most this often (seconds);
# every one is counted.
LOG_EVERY_S = 10.0


class Failures:
    """Counters (thread-safe) and the failure log of one connector.

    `verb` is what the log line says happened to the call: ``"kvplane: {op}
    {verb} ({reason}, {count} so far): {detail}"``."""

    def __init__(self, log: logging.Logger, verb: str, *, every_s: float = LOG_EVERY_S) -> None:
        self._log = log
        self._format = f"kvplane: %s {verb} (%s, %d so far): %s"
        self._every_s = every_s
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._logged: dict[str, float] = {}

    def failure(self, op: str, reason: str, detail: str, *, log: bool = True) -> None:
        """Counts ``failed_{op}_{reason}`` and logs it: at warning if `log`
        and none of its kind was in the last ``every_s`` seconds, else at
        debug (``log=False``: the reason was logged elsewhere already)."""
        name = f"failed_{op}_{reason}"
        now = time.monotonic()
        with self._lock:
            self._counters[name] += 1
            count = self._counters[name]
            loud = log and now - self._logged.get(name, -self._every_s) >= self._every_s
            if loud:
                self._logged[name] = now
        (self._log.warning if loud else self._log.debug)(self._format, op, reason, count, detail)

    def count(self, *pairs: tuple[str, int]) -> None:
        """Adds each ``(name, n)`` under one lock."""
        with self._lock:
            for name, n in pairs:
                self._counters[name] += n

    def snapshot(self) -> dict[str, int]:
        """Every counter so far."""
        with self._lock:
            return dict(self._counters)
