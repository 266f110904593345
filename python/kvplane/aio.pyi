"""Type stubs of kvplane.aio (the asyncio client)."""

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, final, overload

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

from kvplane import Error, Key
from kvplane._settings import Settings

@final
class Client:
    """An asyncio client of one kvplane node, or of a whole cluster: the
    operations of ``kvplane.Client`` as awaitables (coroutines to
    ``asyncio``), with no Python threads. A node client over TCP reads and
    writes its sockets on the event loop itself; any other (or with
    ``KVPLANE_AIO_IO=thread``) runs each call as one task on an I/O thread.

    Making one does no I/O: it connects on ``await connect()``, on
    ``async with``, or at its first call. Once a cancelled call raised
    ``CancelledError``, no buffer of it is written any more (which were
    before is not known).
    """

    def __new__(
        cls,
        endpoints: str | Sequence[str],
        *,
        cluster: bool = False,
        connections: int | None = None,
        token: str | None = None,
        timeout: float = 30.0,
        write_quorum: int | None = None,
        shared_memory: bool = True,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_server_name: str | None = None,
    ) -> Client:
        """Checks the options (``Invalid`` naming the one at fault) and
        connects nothing yet. The options are ``kvplane.Client``'s:
        ``write_quorum`` (cluster only) defaults to the cluster's own
        (``cluster.writeQuorum``, carried by the slot table), and every owner
        not down where the cluster states none."""

    async def connect(self) -> None:
        """Connects now (once), so that a wrong address or token raises here
        (``Unavailable``, ``Timeout``, ``Denied``, ``Invalid``)."""

    async def put_from(self, keys: Sequence[Key], buffers: Sequence[Buffer]) -> None:
        """Stores ``buffers[i]`` under ``keys[i]``, sent from the buffers' own
        memory; do not modify them until the call returns. Raises the typed
        exception of the first key not stored (``key``, ``index`` set)."""

    async def get_into(self, keys: Sequence[Key], buffers: Sequence[Buffer | Sequence[Buffer]]) -> list[int | None]:
        """Reads the value of ``keys[i]`` into ``buffers[i]`` (a buffer, or a
        list of buffers filled in order); per key the bytes written, or
        ``None`` when absent. Buffers must be writable,
        C-contiguous and apart (checked before any I/O); a value larger than
        its buffer raises ``BufferTooSmall`` and leaves it unwritten."""

    @overload
    async def get(self, key: Key) -> bytes | None:  # type: ignore[overload-overlap]
        """The value of one key as new ``bytes`` (``None`` when absent), or of
        a list of keys, in order."""
    @overload
    async def get(self, key: Sequence[Key]) -> list[bytes | None]: ...
    async def put(self, key: Key, value: Buffer) -> None:
        """Stores ``value`` under ``key``: ``put_from`` of one key."""

    async def exists(self, keys: Sequence[Key]) -> list[bool]:
        """Which keys are stored, in order."""

    async def delete(self, keys: Sequence[Key]) -> list[bool]:
        """Removes the keys; per key, whether it was stored."""

    async def match_prefix(self, keys: Sequence[Key], lease_ms: int = 0) -> tuple[int, int]:
        """How many leading keys of a chain are stored, and the granted pin
        lease in ms (``lease_ms > 0``, capped by the node)."""

    async def stats(self) -> dict[str, int]:
        """The node's counters, by name. ``Unsupported`` on a cluster client."""

    def cluster_table(self) -> tuple[int, list[tuple[str, str, str]]]:
        """The slot table of a connected cluster client: ``(version,
        members)``, each ``(id, endpoint, state)``. ``Invalid`` on a node
        client; ``Error`` before a connection is made."""

    def close(self) -> None:
        """Closes the connections; later calls raise ``kvplane.Error``. With
        the event loop's own sockets, a loop that is not running closes them
        when it next runs, or when it is closed."""

    @property
    def closed(self) -> bool:
        """True once ``close`` was called."""

    @property
    def connected(self) -> bool:
        """Whether a connection was made (by ``connect`` or a call)."""

    @property
    def endpoints(self) -> list[str]:
        """The endpoints given (for a cluster, the seeds)."""

    @property
    def cluster(self) -> bool:
        """Whether this is a cluster client."""

    @property
    def max_block_bytes(self) -> int | None:
        """The largest value the node stores, or None from a node that does
        not say. ``Error`` before a connection is made."""

    @property
    def max_lease_ms(self) -> int:
        """The longest pin lease the node grants. ``Error`` before a
        connection is made."""

    async def __aenter__(self) -> Client: ...
    async def __aexit__(self, *args: object) -> bool: ...

class ReconnectingClient:
    """A ``Client`` made from a connector's settings on first use, and again
    after a loss, at most every ``settings.retry_after_s``."""

    def __init__(self, settings: Settings, *, log: logging.Logger | None = None) -> None: ...
    async def get(self) -> Client | None: ...
    async def call(self, op: str, default: Any, *args: Any, **kwargs: Any) -> Any: ...
    def failed(self, client: Client, error: Error) -> None: ...
    def close(self) -> None: ...

__all__ = ["Client", "ReconnectingClient"]
