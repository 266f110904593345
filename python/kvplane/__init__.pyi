"""Type stubs of the kvplane package (the native Client and the exceptions)."""

import sys
from collections.abc import Sequence
from types import TracebackType

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

from ._errors import (
    BadBuffer as BadBuffer,
    BufferTooSmall as BufferTooSmall,
    Busy as Busy,
    Capacity as Capacity,
    Denied as Denied,
    Error as Error,
    Internal as Internal,
    Invalid as Invalid,
    NonContiguousBuffer as NonContiguousBuffer,
    OverlappingBuffers as OverlappingBuffers,
    NotFound as NotFound,
    ReadOnlyBuffer as ReadOnlyBuffer,
    Timeout as Timeout,
    Unavailable as Unavailable,
    Unsupported as Unsupported,
)

__version__: str

Key = str | bytes
"""A key: ``str`` (sent as its UTF-8 bytes) or ``bytes``."""

class Client:
    """A client of one kvplane node, or of a whole cluster.

    ``Client("127.0.0.1:9600")`` keeps a pool of ``connections`` connections
    to one node; ``Client([...seeds], cluster=True)`` fetches the cluster's
    slot table from any seed, follows its changes and sends each key to its
    owners. Endpoints are ``HOST:PORT``, ``tcp://HOST:PORT`` or
    ``unix:///path/to.sock``.

    Every call releases the GIL while it waits for the network; a client may
    be shared by threads. After ``fork``, make a new client in the child.

    Raises ``Unavailable`` (no node answers), ``Timeout``, ``Invalid`` (a bad
    endpoint, token or setting).
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        cluster: bool = False,
        connections: int | None = None,
        token: str | None = None,
        timeout: float = 30.0,
        write_quorum: int | None = None,
        shared_memory: bool = True,
    ) -> None:
        """Connects now, so that a wrong address or token fails here.

        ``connections``: per node (default 4 for a node, 2 per member for a
        cluster); over TCP a batch of more than 512 KiB is split over them
        and its parts sent at once. ``token``: for nodes started with ``--token-file``.
        ``timeout``: seconds allowed for connecting and for each answer.
        ``write_quorum`` (cluster only): owners that must store a block
        before ``put_from`` succeeds; default every owner.
        ``shared_memory``: over a Unix socket (``unix:///path``), move block
        bytes through memory the node shares, when it offers some; False
        keeps every byte on the socket.
        """

    def put_from(self, keys: Sequence[Key], buffers: Sequence[Buffer]) -> None:
        """Stores ``buffers[i]`` under ``keys[i]``, sent straight from the
        buffers' memory (no copy). Buffers must be C-contiguous; read-only is
        fine. Do not modify them until the call returns.

        Raises the typed exception of the first key not stored (``key`` and
        ``index`` set; others of the batch may have been stored), or
        ``NonContiguousBuffer`` / ``BadBuffer`` before any I/O.
        """

    def get_into(self, keys: Sequence[Key], buffers: Sequence[Buffer]) -> list[int | None]:
        """Reads the value of ``keys[i]`` into ``buffers[i]`` (from its start)
        and answers the number of bytes written, or ``None`` for an absent key.

        Buffers must be writable, C-contiguous and apart (``ReadOnlyBuffer``,
        ``NonContiguousBuffer``, ``OverlappingBuffers`` before any I/O). The
        client reads each value straight into its buffer (through the memory
        it shares with a node on the same host, or from the received frame).
        A value larger than its buffer raises ``BufferTooSmall`` and leaves
        that buffer unwritten; bytes past a value's length are never touched;
        when a call raises, other buffers may already hold their values.
        """

    def get(self, keys: Sequence[Key]) -> list[bytes | None]:
        """The values as new ``bytes`` (``None`` where absent): a copying
        convenience; engines use ``get_into``."""

    def exists(self, keys: Sequence[Key]) -> list[bool]:
        """Which keys are stored, in order."""

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        """Removes the keys; per key, whether it was stored."""

    def match_prefix(self, keys: Sequence[Key], lease_ms: int = 0) -> tuple[int, int]:
        """How many leading keys of a chain are stored, and the granted pin
        lease in ms: with ``lease_ms > 0`` the matched blocks are kept from
        eviction that long (capped by the node), so the ``get_into`` that
        follows finds them. The lease is 0 when nothing matched."""

    def close(self) -> None:
        """Closes the connections; later calls raise ``kvplane.Error``."""

    @property
    def closed(self) -> bool:
        """True once ``close`` was called."""

    @property
    def endpoints(self) -> list[str]:
        """The endpoints given (for a cluster, the seeds)."""

    @property
    def cluster(self) -> bool:
        """Whether this is a cluster client."""

    def __enter__(self) -> Client: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool: ...

__all__: list[str]
