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


class _Policy:
    """What the sync and the asyncio `ReconnectingClient` (`kvplane.aio`)
    share: the client's options from the settings, when a node is taken to
    be down, and the log lines. Each client keeps its own lock and client
    (a `threading.Lock` here, an `asyncio.Lock` there), so only this is
    common."""

    def __init__(self, settings: Settings, log: logging.Logger | None) -> None:
        self.endpoint = settings.endpoint
        self.options = settings.client_options()
        self.retry_after_s = settings.retry_after_s
        self.lease_ms = settings.lease_ms
        self.log = log or logging.getLogger(__name__)
        self._lease_checked = False
        self._down_until = 0.0

    def down(self) -> bool:
        """Whether the node is taken to be down (no attempt until then)."""
        return time.monotonic() < self._down_until

    def unreachable(self, error: kvplane.Error) -> None:
        """A connection attempt failed: down for ``retry_after_s``."""
        self.log.warning("kvplane: cannot reach %s (%s); treating lookups as misses", self.endpoint, error)
        self._down_until = time.monotonic() + self.retry_after_s

    def lost(self) -> None:
        """The connection in use was lost: down for ``retry_after_s``."""
        self._down_until = time.monotonic() + self.retry_after_s

    def connected(self, max_lease_ms: int) -> None:
        """After the first connection: warns once when the pins asked for
        are longer than the node grants."""
        if self._lease_checked:
            return
        self._lease_checked = True
        if self.lease_ms > max_lease_ms:
            self.log.warning(
                "kvplane: lease_ms %d is longer than %s grants (kvplane node --max-lease %d ms); pins last %d ms",
                self.lease_ms,
                self.endpoint,
                max_lease_ms,
                max_lease_ms,
            )


class ReconnectingClient:
    """A `kvplane.Client` made from `settings` (every option of the client
    comes from them, see `Settings.client_options`) on first use, and again
    after a loss, at most every ``settings.retry_after_s``."""

    def __init__(self, settings: Settings, *, log: logging.Logger | None = None) -> None:
        self._policy = _Policy(settings, log)
        self._lock = threading.Lock()
        self._client: kvplane.Client | None = None

    @property
    def _options(self) -> dict[str, Any]:
        """The keywords the client is made with (the connectors' tests check
        what their settings became)."""
        return self._policy.options

    def get(self) -> kvplane.Client | None:
        """The client, or None while the node is taken to be down."""
        with self._lock:
            if self._client is not None:
                return self._client
            if self._policy.down():
                return None
            try:
                self._client = kvplane.Client(self._policy.endpoint, **self._policy.options)
            except kvplane.Error as e:
                self._policy.unreachable(e)
                return None
            self._policy.connected(self._client.max_lease_ms)
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
            self._policy.log.warning("kvplane: %s", error)
            return
        with self._lock:
            if self._client is client:
                self._client = None
                self._policy.lost()
        self._policy.log.warning("kvplane: call to %s failed: %s", self._policy.endpoint, error)
        try:
            client.close()
        except kvplane.Error:
            pass

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
