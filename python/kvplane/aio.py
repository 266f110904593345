"""The kvplane client for asyncio.

``kvplane.aio.Client`` has the operations of `kvplane.Client`, as
awaitables, on the same native core, with no Python thread involved and an
event loop that never waits for the network::

    import kvplane.aio

    async with kvplane.aio.Client("127.0.0.1:9600") as kv:
        await kv.put_from(keys, blocks)
        matched, lease_ms = await kv.match_prefix(keys, lease_ms=5000)
        lengths = await kv.get_into(keys[:matched], blocks[:matched])

Where the I/O happens: a node client over plain TCP uses sockets the event
loop itself watches (``loop.add_reader``), so the node's answer wakes the
loop, which reads it straight into the caller's buffers: the same system
calls as the sync client, and no thread hand-off. Its connections belong to
the loop of its first call: a call from another loop that runs at the same
time is refused (make one client per loop); once that loop is not running
(closed, or stopped), the next loop takes the client over. A cluster client, TLS and a Unix socket
run each call as one task on an I/O thread (Rust, tokio), which wakes the
loop when the call is done; ``KVPLANE_AIO_IO=thread`` does so for every
client (``loop`` insists on the loop, and refuses a client it cannot carry).

Each call's arguments are checked, and its buffers exported, when the
method is called; nothing is sent until it is first awaited.

Making a client does no I/O; it connects on ``await kv.connect()``, on
``async with``, or at its first call (once, however many calls wait for
it; a failed attempt is made again by the next call). ``max_block_bytes``,
``max_lease_ms`` and ``cluster_table()`` need a connection.

Buffers passed to ``put_from`` / ``get_into`` stay exported (they cannot be
resized or freed) until the call is done; do not touch them meanwhile.

Cancelling a call (``task.cancel()``, ``asyncio.timeout``, ``wait_for``)
drops it (on an I/O thread: aborts its task, and raises ``CancelledError``
only once that task is gone): after that no buffer of the call is written
any more. Which buffers a cancelled ``get_into`` had written is not known
(treat them all as unwritten); a cancelled ``put_from`` may have stored
some of its keys.

``ReconnectingClient`` is what the engine connectors hold: a client made
on first use and dropped when the node is lost, so that a node that is down
costs a miss, never an error in the engine.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import kvplane
from kvplane._native import AsyncClient as Client
from kvplane._reconnecting import _Policy

if TYPE_CHECKING:
    from kvplane._settings import Settings

__all__ = ["Client", "ReconnectingClient"]


class ReconnectingClient:
    """A `Client` made from a connector's `kvplane._settings.Settings` on
    first use, and again after a loss, at most every
    ``settings.retry_after_s``: the asyncio twin of
    `kvplane._reconnecting.ReconnectingClient` (same rules, same log lines)."""

    def __init__(self, settings: Settings, *, log: logging.Logger | None = None) -> None:
        self._policy = _Policy(settings, log or logging.getLogger(__name__))
        self._client: Client | None = None
        # Made on first use: an asyncio.Lock belongs to the loop it first waits on.
        self._lock: asyncio.Lock | None = None

    @property
    def _options(self) -> dict[str, Any]:
        """The keywords the client is made with (the connectors' tests check
        what their settings became)."""
        return self._policy.options

    async def get(self) -> Client | None:
        """The connected client, or None while the node is taken to be down."""
        if self._client is not None:
            return self._client
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._client is not None:
                return self._client
            if self._policy.down():
                return None
            try:
                client = Client(self._policy.endpoint, **self._policy.options)
                await client.connect()
            except kvplane.Error as e:
                self._policy.unreachable(e)
                return None
            self._policy.connected(client.max_lease_ms)
            self._client = client
            return client

    async def call(self, op: str, default: Any, *args: Any, **kwargs: Any) -> Any:
        """``await client.op(*args, **kwargs)``, or `default` when the node is
        taken to be down or the call raises (logged; see `failed`)."""
        client = await self.get()
        if client is None:
            return default
        try:
            return await getattr(client, op)(*args, **kwargs)
        except kvplane.Error as e:
            self.failed(client, e)
            return default

    def failed(self, client: Client, error: kvplane.Error) -> None:
        """After a call on `client` raised `error`: a lost node (unavailable,
        timed out) drops the client until the next attempt; any other error
        concerns that call alone."""
        if not isinstance(error, (kvplane.Unavailable, kvplane.Timeout)):
            self._policy.log.warning("kvplane: %s", error)
            return
        if self._client is client:
            self._client = None
            self._policy.lost()
        self._policy.log.warning("kvplane: call to %s failed: %s", self._policy.endpoint, error)
        client.close()

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()
