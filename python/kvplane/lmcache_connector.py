"""A ``kvplane://`` remote connector for stock LMCache (0.5), loaded as one
of its ``remote_storage_plugins``::

    remote_storage_plugins: ["kvplane"]
    extra_config:
      remote_storage_plugin.kvplane.module_path: kvplane.lmcache_connector
      remote_storage_plugin.kvplane.class_name: KVPlaneConnectorAdapter
      remote_storage_plugin.kvplane.url: "kvplane://127.0.0.1:9600"

URLs: ``kvplane://HOST:PORT`` (one node), ``kvplane:///run/kvplane/node.sock``
(a node's Unix socket on this host; block bytes then move through the
memory it shares), ``kvplane://H1:P1,H2:P2`` (a cluster, from those
seeds; ``?cluster=true`` makes one host a cluster's seed). Query
parameters: ``token``, ``connections``, ``timeout_s`` (5),
``write_quorum`` (a cluster's owners that must store a chunk; default
the cluster's ``writeQuorum``, else every owner), ``shared_memory`` (true; false keeps every byte on a Unix
socket), ``lease_ms`` (10000, at most the node's ``--max-lease``: how long
a pinned lookup keeps the chunks from eviction), ``retry_after_s`` (1): the vLLM connector's settings, read
and checked by the same `kvplane._settings.Settings`. The deprecated ``remote_url:
kvplane://...`` works too, with the same two ``module_path`` /
``class_name`` entries.

Each chunk is stored under ``CacheEngineKey.to_string()`` (model, world
size, worker, chunk hash, dtype) as the chunk's bytes alone: LMCache's
metadata of a chunk (shapes, dtypes, format) is the engine's own, so a GET
reads straight into a chunk LMCache allocates, and a shorter (last) chunk
is recognised by its length. A full chunk larger than the node's largest
block (LMCache's 256-token chunk of an 8B model is 36 MiB, the node's
default ``--max-block`` 16 MiB) is stored as ``N`` parts no larger than
that block, under ``KEY#part<j>of<N>``, each part at a fixed offset of the
chunk (a shorter chunk's trailing parts are empty), and read back into the
chunk's own memory all or nothing: a chunk with a part missing is a miss.

LMCache hashes a prompt's tokens with Python's ``hash`` unless
``pre_caching_hash_algorithm: sha256_cbor`` is set, and Python salts that
hash per process: two engines (or one restarted) then never find each
other's chunks. The connector says so at start when neither that setting
nor ``PYTHONHASHSEED`` makes the keys deterministic. Every call is batched where LMCache offers a
batched form: one PUT for ``batched_put``, one GET into LMCache's buffers
for ``batched_get`` and ``batched_get_non_blocking``, and one MATCH_PREFIX
for ``batched_async_contains`` (with ``pin``, a lease keeps the matched
chunks until the GET that follows). LMCache's coroutines (``exists``,
``batched_async_contains``, the gets and puts) await `kvplane.aio.Client`,
whose sockets LMCache's event loop itself watches (over TCP): the loop never
waits on the network and no thread is spent per call. Its synchronous calls
(``exists_sync``, ``batched_contains``, ``remove_sync``), made from
LMCache's own threads, use the synchronous `kvplane.Client`; both are made
from the same settings. A node that cannot be reached makes lookups misses
and puts no-ops, never an error in LMCache.
"""

from __future__ import annotations

import os

from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvplane._reconnecting import ReconnectingClient
from kvplane._settings import SCHEME, Settings
from kvplane.aio import ReconnectingClient as AsyncReconnectingClient

logger = init_logger(__name__)

__all__ = ["KVPlaneConnectorAdapter", "KVPlaneRemoteConnector", "parse_url"]

# What a ``kvplane://`` URL says (the name this module gave it before the
# connectors shared their settings).
Target = Settings


def parse_url(url: str) -> Settings:
    """Parses a ``kvplane://`` URL; a ValueError names what is wrong (the
    URL, and the parameter at fault)."""
    return Settings.from_url(url)


class KVPlaneConnectorAdapter(ConnectorAdapter):
    """Makes a `KVPlaneRemoteConnector` for ``kvplane://`` URLs and for the
    ``plugin://kvplane`` name LMCache gives a remote storage plugin."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        return url.startswith(SCHEME) or url == "plugin://kvplane" or url.startswith("plugin://kvplane.")

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        url = context.url
        if not url.startswith(SCHEME):
            name = context.plugin_name or "kvplane"
            setting = f"remote_storage_plugin.{name}.url"
            url = (context.config.extra_config or {}).get(setting) if context.config is not None else None
            if not url:
                raise ValueError(f"extra_config.{setting}: the kvplane node to use is required (kvplane://HOST:PORT)")
        return KVPlaneRemoteConnector(parse_url(url), context)


class KVPlaneRemoteConnector(RemoteConnector):
    """LMCache's remote connector interface over a kvplane node or cluster
    (see the module documentation)."""

    def __init__(self, target: Settings, context: ConnectorContext) -> None:
        super().__init__(context.config, context.metadata)
        self._target = target
        self._loop = context.loop
        self._local = context.local_cpu_backend
        # The synchronous calls' client and the coroutines' one.
        self._node = ReconnectingClient(target, log=logger)
        self._aio = AsyncReconnectingClient(target, log=logger)
        # How chunks are split (see `_layout`), once a node said its largest block.
        self._parts: _Parts | None = None
        algorithm = getattr(context.config, "pre_caching_hash_algorithm", None) if context.config is not None else None
        if algorithm == "builtin" and os.environ.get("PYTHONHASHSEED") in (None, "", "random"):
            logger.warning(
                "kvplane: LMCache's pre_caching_hash_algorithm is 'builtin' and PYTHONHASHSEED is not set, so chunk keys "
                "differ per process: other engines (and this one after a restart) will not find these chunks. Set "
                "pre_caching_hash_algorithm: sha256_cbor (or a fixed PYTHONHASHSEED) to share chunks across instances."
            )

    def __repr__(self) -> str:
        return f"<KVPlaneRemoteConnector {self._target.endpoint}>"

    # --- lookups --------------------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        parts = await self._alayout()
        if parts is None:
            return False
        return all(await self._aio.call("exists", [False] * parts.count, parts.keys(key.to_string())))

    def exists_sync(self, key: CacheEngineKey) -> bool:
        parts = self._layout()
        if parts is None:
            return False
        return all(self._node.call("exists", [False] * parts.count, parts.keys(key.to_string())))

    def _layout(self) -> _Parts | None:
        """How a chunk is split into node blocks, fixed the first time a node
        answers (None while none does)."""
        if self._parts is None:
            client = self._node.get()
            if client is None:
                return None
            self._fix_layout(client.max_block_bytes)
        return self._parts

    async def _alayout(self) -> _Parts | None:
        """`_layout` for the coroutines, asking the async client."""
        if self._parts is None:
            client = await self._aio.get()
            if client is None:
                return None
            self._fix_layout(client.max_block_bytes)
        return self._parts

    def _fix_layout(self, max_block: int | None) -> None:
        if self._parts is not None:
            return
        self._parts = _Parts.of(self.full_chunk_size_bytes, max_block)
        if self._parts.count > 1:
            logger.info(
                "kvplane: chunks of %d bytes are stored in %d parts of at most %d bytes (the node's largest block is %d)",
                self.full_chunk_size_bytes,
                self._parts.count,
                self._parts.size,
                max_block,
            )

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self._prefix(keys, 0)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        parts = await self._alayout()
        if not keys or parts is None:
            return 0
        matched, _lease = await self._aio.call("match_prefix", (0, 0), _flat(parts, keys), self._target.lease_ms if pin else 0)
        return matched // parts.count

    def _prefix(self, keys: list[CacheEngineKey], lease_ms: int) -> int:
        """How many leading chunks the node holds (one MATCH_PREFIX),
        pinned for `lease_ms`."""
        parts = self._layout()
        if not keys or parts is None:
            return 0
        matched, _lease = self._node.call("match_prefix", (0, 0), _flat(parts, keys), lease_ms)
        # A chunk counts only with every part.
        return matched // parts.count

    # --- reads ----------------------------------------------------------------------

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return await self._read(keys)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The leading chunks that were read; the chunks after the first miss
        are given back to LMCache's allocator."""
        objs = await self._read(keys)
        prefix: list[MemoryObj] = []
        missed = False
        for obj in objs:
            if obj is None:
                missed = True
            elif missed:
                obj.ref_count_down()
            else:
                prefix.append(obj)
        return prefix

    async def _read(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """One GET of `keys` straight into chunks allocated from LMCache's
        local CPU backend; a chunk not read is given back. A cancelled read
        gives the chunks back only once the client says no byte of them is
        written any more (kvplane.aio's cancellation)."""
        parts = await self._alayout()
        if parts is None:  # node down: no chunks to allocate and free
            return [None] * len(keys)
        # One batched allocation; LMCache's is all or nothing, so when it
        # finds no room for the whole batch, chunk by chunk for what fits.
        batch = self._local.batched_allocate(self.meta_shapes, self.meta_dtypes, len(keys), self.meta_fmt)
        objs: list[MemoryObj | None] = (
            list(batch)
            if batch is not None
            else [self._local.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt) for _ in keys]
        )
        wanted = [i for i, o in enumerate(objs) if o is not None]
        if len(wanted) < len(keys):
            logger.warning("kvplane: LMCache's CPU backend had no room for %d of %d chunks", len(keys) - len(wanted), len(keys))
        part_keys: list[str] = []
        part_views: list[memoryview] = []
        for i in wanted:
            obj = objs[i]
            assert obj is not None
            part_keys.extend(parts.keys(keys[i].to_string()))
            part_views.extend(parts.views(_bytes(obj)))
        try:
            part_lengths = await self._aio.call("get_into", [None] * len(part_keys), part_keys, part_views)
        except BaseException:
            for i in wanted:
                obj = objs[i]
                assert obj is not None
                obj.ref_count_down()
            raise
        results: list[MemoryObj | None] = [None] * len(keys)
        for w, i in enumerate(wanted):
            obj = objs[i]
            assert obj is not None
            n = parts.total(part_lengths[w * parts.count : (w + 1) * parts.count])
            if not n:
                obj.ref_count_down()
                continue
            try:
                results[i] = self.reshape_partial_chunk(obj, n)
            except ValueError as e:
                # A value that is no whole number of tokens: not a chunk of
                # this engine's shape. A miss, and said.
                logger.warning("kvplane: key %s: %s", keys[i].to_string(), e)
                obj.ref_count_down()
        return results

    # --- writes ---------------------------------------------------------------------

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        # Sent from the chunks' own memory; a put that fails is a future
        # miss (logged), never an error in LMCache.
        parts = await self._alayout()
        if parts is None:
            return
        part_keys: list[str] = []
        part_views: list[memoryview] = []
        for k, o in zip(keys, memory_objs):
            part_keys.extend(parts.keys(k.to_string()))
            part_views.extend(parts.views(_bytes(o)))
        await self._aio.call("put_from", None, part_keys, part_views)

    def remove_sync(self, key: CacheEngineKey) -> bool:
        parts = self._layout()
        if parts is None:
            return False
        return any(self._node.call("delete", [False] * parts.count, parts.keys(key.to_string())))

    async def list(self) -> list[str]:
        # kvplane nodes do not enumerate their keys (a cluster holds
        # millions, spread over members); LMCache uses this for tooling only.
        logger.warning("kvplane: list() is not supported; answering no keys")
        return []

    async def close(self) -> None:
        self._aio.close()
        self._node.close()


def _flat(parts: _Parts, keys: list[CacheEngineKey]) -> list[str]:
    """The node keys of a chain of chunks, part by part."""
    return [p for k in keys for p in parts.keys(k.to_string())]


def _bytes(obj: MemoryObj) -> memoryview:
    """The chunk's memory itself (LMCache's CPU buffer), as a buffer."""
    view = obj.byte_array
    return view if isinstance(view, memoryview) else memoryview(view)


class _Parts:
    """How one chunk maps onto node blocks: ``count`` parts of ``size``
    bytes at fixed offsets (the last may be shorter, a shorter chunk's
    trailing parts empty). One part, under the chunk's own key, when the
    chunk fits in the node's largest block or the node does not say."""

    def __init__(self, count: int, size: int) -> None:
        self.count = count
        self.size = size

    @staticmethod
    def of(full_chunk_bytes: int, max_block: int | None) -> _Parts:
        if not max_block or full_chunk_bytes <= max_block:
            return _Parts(1, full_chunk_bytes)
        count = -(-full_chunk_bytes // max_block)
        return _Parts(count, -(-full_chunk_bytes // count))

    def keys(self, key: str) -> list[str]:
        if self.count == 1:
            return [key]
        return [f"{key}#part{j}of{self.count}" for j in range(self.count)]

    def views(self, chunk: memoryview) -> list[memoryview]:
        """The chunk's bytes, part by part (a whole chunk when one part)."""
        if self.count == 1:
            return [chunk]
        return [chunk[j * self.size : (j + 1) * self.size] for j in range(self.count)]

    def total(self, lengths: list[int | None]) -> int:
        """The chunk's length from its parts' lengths, or 0 (a miss) unless
        every part was read and they join up: each part but the last full
        until one falls short, and only empty parts after it."""
        if any(n is None for n in lengths):
            return 0
        got = [n for n in lengths if n is not None]
        if self.count == 1:
            return got[0]
        short = next((j for j, n in enumerate(got) if n < self.size), len(got))
        if any(got[short + 1 :]):
            logger.warning("kvplane: a chunk's parts do not join up (lengths %s); treating it as a miss", got)
            return 0
        return sum(got)

