"""A client that engines can hold for their whole life.

An engine must keep serving when its kvplane node is down, restarting or
unreachable: a lost cache is a miss, never a failed request. So the engine
connectors do not hold a `kvplane.Client` directly (it connects when made,
and a call on a lost connection raises); they hold this, which makes the
client on first use, drops it when a call finds the node gone, and makes it
again on a later call, not more often than every `retry_after_s`, so a
node that is down costs one connection attempt per interval, not one per
request. Both connectors make it from their `kvplane._settings.Settings`,
so every option of `kvplane.Client` is theirs to set.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import kvplane
from kvplane._settings import Settings


class ReconnectingClient:
    """A `kvplane.Client` made from `settings` (every option of the client
    comes from them, see `Settings.client_options`) on first use, and again
    after a loss, at most every ``settings.retry_after_s``."""

    def __init__(self, settings: Settings, *, log: logging.Logger | None = None) -> None:
        self._endpoint = settings.endpoint
        self._options = settings.client_options()
        self._retry_after_s = settings.retry_after_s
        self._lease_ms = settings.lease_ms
        self._lease_checked = False
        self._log = log or logging.getLogger(__name__)
        self._lock = threading.Lock()
        self._client: kvplane.Client | None = None
        self._down_until = 0.0

    def get(self) -> kvplane.Client | None:
        """The client, or None while the node is taken to be down."""
        with self._lock:
            if self._client is not None:
                return self._client
            if time.monotonic() < self._down_until:
                return None
            try:
                self._client = kvplane.Client(self._endpoint, **self._options)
            except kvplane.Error as e:
                self._log.warning("kvplane: cannot reach %s (%s); treating lookups as misses", self._endpoint, e)
                self._down_until = time.monotonic() + self._retry_after_s
                return None
            if not self._lease_checked:
                self._lease_checked = True
                if self._lease_ms > self._client.max_lease_ms:
                    self._log.warning(
                        "kvplane: lease_ms %d is longer than %s grants (kvplane node --max-lease %d ms); pins last %d ms",
                        self._lease_ms,
                        self._endpoint,
                        self._client.max_lease_ms,
                        self._client.max_lease_ms,
                    )
            return self._client

    def call(self, op: str, default: Any, *args: Any, **kwargs: Any) -> Any:
        """`client.op(*args, **kwargs)`, or `default` when the node is taken
        to be down or the call raises (logged; see `failed`): what every
        engine-side call wants, since a lost cache is a miss."""
        client = self.get()
        if client is None:
            return default
        try:
            return getattr(client, op)(*args, **kwargs)
        except kvplane.Error as e:
            self.failed(client, e)
            return default

    def failed(self, client: kvplane.Client, error: kvplane.Error) -> None:
        """After a call on `client` raised `error`: a lost node (unavailable,
        timed out) drops the client until the next attempt; any other error
        concerns that call alone."""
        if not isinstance(error, (kvplane.Unavailable, kvplane.Timeout)):
            self._log.warning("kvplane: %s", error)
            return
        with self._lock:
            if self._client is client:
                self._client = None
                self._down_until = time.monotonic() + self._retry_after_s
        self._log.warning("kvplane: call to %s failed: %s", self._endpoint, error)
        try:
            client.close()
        except kvplane.Error:
            pass

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
