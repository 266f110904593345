"""Type stubs of the kvplane package (the native clients and the exceptions)."""

import os
import sys
from collections.abc import Callable, Sequence
from typing import final, overload

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

# The native classes cannot be subclassed (pyo3): @final says so.
from . import aio as aio
from ._errors import (
    BadBuffer as BadBuffer,
    BufferTooSmall as BufferTooSmall,
    Busy as Busy,
    Capacity as Capacity,
    Corrupt as Corrupt,
    Denied as Denied,
    Error as Error,
    GpuError as GpuError,
    GpuUnavailable as GpuUnavailable,
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

@final
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
        """Connects now, so that a wrong address or token fails here.

        ``connections``: per node (default 4 for a node, 2 per member for a
        cluster); over TCP a batch of more than 512 KiB is split over them
        and its parts sent at once. ``token``: for nodes started with ``--token-file``.
        ``timeout``: seconds allowed for connecting and for each answer.
        ``write_quorum`` (cluster only): owners that must store a block
        before ``put_from`` succeeds; default the cluster's own
        (``cluster.writeQuorum`` of its nodes, carried by the slot table),
        and every owner not down where the cluster states none.
        ``shared_memory``: over a Unix socket (``unix:///path``), move block
        bytes through memory the node shares, when it offers some; False
        keeps every byte on the socket.
        ``tls_ca``: speak TLS to TCP endpoints (nodes started with
        ``--tls-cert``), trusting certificates this PEM CA file signed;
        ``tls_cert`` and ``tls_key``: a client certificate for nodes started
        with ``--tls-client-ca``; ``tls_server_name``: the name their
        certificates must carry (default: the endpoint's host). Each TLS
        refusal is an ``Invalid`` saying which (docs/security.md).
        """

    def put_from(self, keys: Sequence[Key], buffers: Sequence[Buffer]) -> None:
        """Stores ``buffers[i]`` under ``keys[i]``, sent straight from the
        buffers' memory (no copy). Buffers must be C-contiguous; read-only is
        fine. Do not modify them until the call returns.

        Raises the typed exception of the first key not stored (``key`` and
        ``index`` set; others of the batch may have been stored), or
        ``NonContiguousBuffer`` / ``BadBuffer`` before any I/O. Name each key
        once per batch: a key named twice is refused (``Invalid``,
        ``duplicate-key``; which value should win is not the node's to guess),
        with the rest of the request it travels in.
        """

    def get_into(self, keys: Sequence[Key], buffers: Sequence[Buffer | Sequence[Buffer]]) -> list[int | None]:
        """Reads the value of ``keys[i]`` into ``buffers[i]`` (from its start)
        and answers the number of bytes written, or ``None`` for an absent key.
        ``buffers[i]`` may be a list (or tuple) of buffers, which the value
        fills in order: a KV block whose layers lie in separate tensors is
        read straight into them, with no staging copy.

        Buffers must be writable, C-contiguous and apart (``ReadOnlyBuffer``,
        ``NonContiguousBuffer``, ``OverlappingBuffers`` before any I/O). The
        client reads each value straight into its buffer (through the memory
        it shares with a node on the same host, or from the received frame).
        A value larger than its buffer raises ``BufferTooSmall`` and leaves
        that buffer unwritten; bytes past a value's length are never touched;
        when a call raises, other buffers may already hold their values.
        """

    def get_pages(
        self,
        pages: _HostPages,
        hashes: Sequence[str],
        host_indices: Buffer,
        describe: Callable[[list[int]], tuple[Sequence[int], Sequence[int]]],
    ) -> tuple[list[bool], list[int]]:
        """Reads pages of a host memory pool straight into it, in one call
        per batch: page ``i`` is ``hashes[i]`` at the pool's slots
        ``host_indices[i * page_tokens:(i + 1) * page_tokens]`` (int64 or
        int32, such as ``tensor.numpy()``); ``describe(starts)`` is asked
        where the blocks of page slots not seen before lie. Answers per page
        whether every block was read whole, and the pages read only in part.
        ``Invalid`` for indices that are not pages of the pool (naming the
        index), before any I/O. What the SGLang backend's page interface
        calls (``kvplane.sglang_backend``).
        """

    def put_pages(
        self,
        pages: _HostPages,
        hashes: Sequence[str],
        host_indices: Buffer,
        describe: Callable[[list[int]], tuple[Sequence[int], Sequence[int]]],
    ) -> list[bool]:
        """Stores the pages of ``get_pages``'s arguments that the node lacks
        (one EXISTS, then one PUT sent from the pool's memory); per page,
        whether it was already stored (and not sent)."""

    # A str is also a Sequence[str]: the first overload wins for it, as at
    # run time (a str or bytes is one key).
    @overload
    def get(self, key: Key) -> bytes | None:  # type: ignore[overload-overlap]
        """The value of one key as new ``bytes`` (``None`` when absent), or of
        a list of keys, in order: a copying convenience; engines use
        ``get_into``."""
    @overload
    def get(self, key: Sequence[Key]) -> list[bytes | None]: ...

    def put(self, key: Key, value: Buffer) -> None:
        """Stores ``value`` under ``key``: ``put_from`` of one key."""

    def exists(self, keys: Sequence[Key]) -> list[bool]:
        """Which keys are stored, in order."""

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        """Removes the keys; per key, whether it was stored."""

    def match_prefix(self, keys: Sequence[Key], lease_ms: int = 0) -> tuple[int, int]:
        """How many leading keys of a chain are stored, and the granted pin
        lease in ms: with ``lease_ms > 0`` the matched blocks are kept from
        eviction that long (capped by the node), so the ``get_into`` that
        follows finds them. The lease is 0 when nothing matched."""

    def cluster_table(self) -> tuple[int, list[tuple[str, str, str]]]:
        """The slot table a cluster client routes by: ``(version, members)``,
        each member ``(id, endpoint, state)`` with state ``"up"``,
        ``"joining"``, ``"draining"`` or ``"down"``; the client follows it by
        itself (this is for tools, tests and logs). ``Invalid`` on a node
        client."""

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

    def stats(self) -> dict[str, int]:
        """The node's counters, by name (what ``kvplane stats`` prints).
        ``Unsupported`` on a cluster client."""

    @property
    def max_block_bytes(self) -> int | None:
        """The largest value the node stores (``kvplane node --max-block``), or
        None from a node that does not say; a longer value is refused
        (``Invalid``, naming both sizes)."""

    @property
    def max_lease_ms(self) -> int:
        """The longest pin lease the node grants (``kvplane node --max-lease``)."""

    def __enter__(self) -> Client: ...
    def __exit__(self, *args: object) -> bool: ...

def gpu_unavailable_reason() -> str | None:
    """Why ``DeviceClient`` cannot work here (built without the ``cuda``
    feature, no NVIDIA driver, no GPU), or ``None`` when it can."""

@final
class DeviceClient:
    """KV blocks between GPU memory and a kvplane node on the same host.

    ``DeviceClient("unix:///run/kvplane/node.sock", device=0)`` opens one
    connection over the node's Unix socket and registers the memory the node
    shares with it as pinned for ``device``; blocks move between device
    memory and that memory with the GPU's copy engines, and the node copies
    them into and out of its pool. Nothing crosses the socket but keys and
    offsets.

    Device memory is given as addresses and sizes, as an engine holds it:
    ``tensor.data_ptr()`` and ``tensor.nbytes`` of contiguous CUDA tensors on
    ``device``. ``stream``: a ``CUstream`` address of this device (for
    instance ``torch.cuda.current_stream(device).cuda_stream``), after whose
    queued work the copies run; default, the client's own stream. Every call
    returns once its copies are done.

    Raises ``GpuUnavailable`` when the package was built without its
    ``cuda`` feature or no GPU answers, ``Invalid`` for an endpoint that is
    not ``unix://``. Calls run one at a time; after ``fork``, make a new one.
    """

    def __new__(
        cls,
        endpoint: str,
        *,
        device: int = 0,
        token: str | None = None,
        timeout: float = 30.0,
    ) -> DeviceClient: ...
    def put_from_device(
        self,
        keys: Sequence[Key],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        *,
        stream: int | None = None,
    ) -> None:
        """Stores ``sizes[i]`` bytes at device address ``ptrs[i]`` under
        ``keys[i]``, copied after the work queued on ``stream``; the device
        memory may be reused once the call returns. Raises the typed
        exception of the first key not stored (``key``, ``index`` set)."""

    def get_into_device(
        self,
        keys: Sequence[Key],
        ptrs: Sequence[int],
        capacities: Sequence[int],
        *,
        stream: int | None = None,
    ) -> list[int | None]:
        """Reads the value of ``keys[i]`` into device memory at ``ptrs[i]``
        (``capacities[i]`` bytes there) and answers the bytes written, or
        ``None`` for an absent key. A value larger than its capacity raises
        ``BufferTooSmall`` and is not written."""

    def close(self) -> None:
        """Unregisters the shared memory and closes the connection."""

    @property
    def closed(self) -> bool: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def device(self) -> int: ...
    def __enter__(self) -> DeviceClient: ...
    def __exit__(self, *args: object) -> bool: ...

__all__ = [
    "Client",
    "DeviceClient",
    "Key",
    "gpu_unavailable_reason",
    "__version__",
    "Error",
    "NotFound",
    "Timeout",
    "Unavailable",
    "Invalid",
    "Capacity",
    "Internal",
    "Unsupported",
    "Busy",
    "Denied",
    "Corrupt",
    "BadBuffer",
    "ReadOnlyBuffer",
    "NonContiguousBuffer",
    "OverlappingBuffers",
    "BufferTooSmall",
    "GpuError",
    "GpuUnavailable",
]

@final
class _HostPages:
    """``kvplane._native.HostPages`` (not exported from ``kvplane``): a host
    memory pool of pages, each stored as ``len(block_sizes)`` node blocks
    under ``{prefix}{page hash}{suffix}``; a page is ``page_tokens``
    consecutive slots below ``tokens``. The buffers stay exported while it
    lives. For ``Client.get_pages`` / ``put_pages``."""

    def __new__(
        cls,
        regions: Sequence[Buffer],
        *,
        prefix: str,
        suffixes: Sequence[str],
        block_sizes: Sequence[int],
        page_tokens: int,
        tokens: int,
    ) -> _HostPages: ...
    def keys(self, hashes: Sequence[str]) -> list[str]:
        """The keys of pages ``hashes``, block by block."""

    @property
    def per_page(self) -> int:
        """Blocks per page."""

    def counts(self) -> dict[str, int]:
        """Pages moved so far: ``get_pages`` / ``get_pages_read`` (asked of
        ``get_pages``, read whole), ``set_pages`` / ``set_pages_present``
        (stored by ``put_pages`` or found there)."""

    def __len__(self) -> int:
        """Page slots described so far."""
