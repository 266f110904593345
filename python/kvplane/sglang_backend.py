"""A HiCache storage backend for stock SGLang (0.5), loaded through its
``dynamic`` backend::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvplane",
            "module_path": "kvplane.sglang_backend", "class_name": "KVPlaneHiCacheStorage",
            "interface_v1": 1, "endpoint": "unix:///run/kvplane/node.sock"}'

SGLang builds the class as ``KVPlaneHiCacheStorage(storage_config, kwargs)``
(``sglang/srt/mem_cache/storage/backend_factory.py``) and hands it its host
memory pool (``register_mem_pool_host``). With ``interface_v1`` SGLang calls
the page interface: ``batch_get_v1`` / ``batch_set_v1`` with the pool's
host indices, and the pages move straight between the pool's own tensor and
the node (no copy in Python), through the memory a node on the same host
shares over its Unix socket (``unix://``), else on the socket. Each batch
is one native call (``Client.get_pages`` / ``put_pages`` on a
``kvplane._native.HostPages`` of the pool): the keys, the host indices and
the blocks' place in the pool are worked out there, since the same work in
Python cost 10-15% of the interface's throughput at 64 KiB pages. Where a
page slot's blocks lie is asked of SGLang's own ``get_page_buffer_meta``
once per slot (the pool's memory never moves).

Settings: the extra config's other keys are the engine connectors'
settings (`kvplane._settings`): ``endpoint`` (required), ``cluster``,
``token``, ``connections``, ``timeout_s`` (5), ``write_quorum``,
``shared_memory`` (true), ``lease_ms`` (10000: the pin ``batch_exists``
takes on the pages it found, for the load that follows), ``retry_after_s``
(1), ``namespace`` ("").

Keys. Each page is stored as the parts SGLang's own pool describes
(``get_page_buffer_meta``: K and V for an MHA ``page_first`` pool, one
latent buffer for MLA, one per layer and K/V for ``layer_first``), each part
under ``{namespace}@sglang@{model}@{shard}@{layout}@{page hash}/{part}``:

- ``shard``: ``tp{rank}/{size}@pp{rank}/{size}`` (and ``@cp{rank}/{size}``
  with attention context parallelism); MLA pages are the same on every TP
  rank, so their shard names no TP rank (``mla@pp...``) and only SGLang's
  storage writer rank stores them, as SGLang's own backends do;
- ``layout``: the pool's class, memory layout, dtype, page size and
  geometry (``MHATokenToKVPoolHost/page_first/bfloat16/p64/l32h8d128``), so
  two deployments whose pages differ in any of these never read each
  other's bytes;
- a part larger than the node's largest block (``kvplane node
  --max-block``) is stored in pieces (``/{part}.{piece}of{n}``).

A page counts only with every part: ``batch_exists`` is one MATCH_PREFIX of
the pages' parts in order (pinned ``lease_ms``), answering the leading whole
pages; ``batch_get_v1`` answers True for a page whose every part was read
with its full length. ``batch_set_v1`` asks EXISTS first and sends only the
pages the node lacks, as SGLang's Mooncake and file backends do.

Failures are misses: a node that cannot be reached, an error from it, or
anything else that goes wrong in a call answers ``0`` / ``False`` (SGLang
recomputes those pages) and never raises into SGLang; each is logged with
its reason (at most once per reason every ``LOG_EVERY_S``, the rest at
debug) and counted (`KVPlaneHiCacheStorage.stats`). What cannot work at all
(no endpoint, a layout without page metadata, a pool not in host memory)
is refused when SGLang attaches the backend, naming the setting.

Without ``interface_v1`` SGLang copies each page through a flat tensor
(``get`` / ``set``): those pages are stored whole, under ``/flat``, and do
not share keys with the page interface.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

import kvplane
from kvplane._failures import LOG_EVERY_S, Failures
from kvplane._reconnecting import ReconnectingClient
from kvplane._settings import _SETTINGS, Settings, _check, _Source

if TYPE_CHECKING:
    from kvplane import _HostPages as HostPages  # the stub's name for it
else:
    from kvplane._native import HostPages

logger = logging.getLogger(__name__)

__all__ = ["KVPlaneHiCacheStorage", "LOG_EVERY_S"]

# How the extra config is named in errors: the server flag that carries it.
EXTRA_CONFIG = "--hicache-storage-backend-extra-config"


class KVPlaneHiCacheStorage(HiCacheStorage):
    """SGLang's HiCache storage interface over a kvplane node or cluster (see
    the module documentation)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        extra = storage_config.extra_config
        if extra is None:
            raise ValueError(f"{EXTRA_CONFIG}: the kvplane backend needs its settings there (at least endpoint)")
        if storage_config.should_split_heads:
            raise ValueError(
                "kvplane: SGLang asked for split heads (prefill and decode with different TP sizes); "
                "the kvplane backend stores each rank's own heads only"
            )
        self.settings: Settings = _check(extra, _Source(EXTRA_CONFIG, text=False, known=_SETTINGS))
        self.storage_config = storage_config
        self.v1 = bool(extra.get("interface_v1", 0))
        self._node = ReconnectingClient(self.settings, log=logger)
        self._shard = _shard(storage_config)
        self._model = "-".join((storage_config.model_name or "").split("/"))
        # Only one rank stores pages that every TP rank holds alike (MLA).
        self._writer = storage_config.is_storage_writer
        self._pool: Any = None
        self._prefix = ""
        self._pages: _Pages | None = None
        # The pool as pages of node blocks (made with _pages): the page keys,
        # and for the page interface where each page slot's blocks lie.
        self._host: HostPages | None = None
        self._lock = threading.Lock()
        # Counters and failures (logged at most once per kind every LOG_EVERY_S).
        self._failures = Failures(logger, "answered as a miss")
        self._metrics = storage_config.enable_storage_metrics
        self._prefetch: list[tuple[int, float]] = []
        self._backup: list[tuple[int, float]] = []
        logger.info(
            "kvplane: HiCache storage on %s (%s interface, keys %s@sglang@%s@%s@...)",
            self.settings.endpoint,
            "page (v1)" if self.v1 else "flat-page",
            self.settings.namespace,
            self._model,
            self._shard,
        )

    # --- set-up ----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Takes the host pool the pages live in: its layout names the keys,
        and its memory is what the pages are read into and sent from."""
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            raise ValueError(
                f"kvplane: host pool {type(mem_pool_host).__name__} has no kv_buffer (a hybrid anchor pool); "
                "the kvplane backend stores KV pages of one host pool"
            )
        buffers = _pool_buffers(mem_pool_host)
        for t in buffers:
            if t.device.type != "cpu":
                raise ValueError(f"kvplane: host pool {type(mem_pool_host).__name__} is on {t.device}, not in host memory")
        self._pool = mem_pool_host
        self._regions = _Regions(buffers)
        self._prefix = f"{self.settings.namespace}@sglang@{self._model}@{self._shard}@{_layout_name(mem_pool_host)}@"
        if self.v1:
            # The parts of one page as the pool lays them out; checked now so
            # a layout without page metadata fails the attach, not each call.
            ptrs, sizes = _page_meta(mem_pool_host, torch.arange(mem_pool_host.page_size, dtype=torch.int64))
            self._part_sizes = list(sizes)
            for p, n in zip(ptrs, sizes):
                self._regions.view(p, n)
        else:
            self._part_sizes = [mem_pool_host.get_dummy_flat_data_page().nbytes]
        logger.info(
            "kvplane: host pool %s, %d part(s) per page (%s bytes), keys %s<page hash>/<part>",
            type(mem_pool_host).__name__,
            len(self._part_sizes),
            "+".join(str(s) for s in self._part_sizes),
            self._prefix,
        )

    def _layout(self, client: kvplane.Client) -> _Pages:
        """How a page maps onto node blocks, fixed once a node said its
        largest block."""
        if self._pages is not None:
            return self._pages
        with self._lock:
            if self._pages is None:
                pages = _Pages(self._part_sizes, client.max_block_bytes, "flat" if not self.v1 else None)
                # The flat interface moves tensors SGLang hands it, not the
                # pool's memory: its HostPages builds keys only.
                self._host = HostPages(
                    self._regions.buffers if self.v1 else [],
                    prefix=self._prefix,
                    suffixes=pages.suffixes,
                    block_sizes=pages.sizes,
                    page_tokens=self._pool.page_size,
                    tokens=self._pool.size,
                )
                self._pages = pages
                if pages.per_page > len(self._part_sizes):
                    logger.info(
                        "kvplane: page parts of %s bytes are stored in %d pieces of at most %d bytes (the node's largest block)",
                        "+".join(str(s) for s in self._part_sizes),
                        pages.per_page,
                        client.max_block_bytes,
                    )
            return self._pages

    def _keys(self, hashes: List[str]) -> list[str]:
        """The node keys of pages `hashes`, block by block (built natively:
        ``{prefix}{hash}/{part}``, see the module documentation)."""
        assert self._host is not None, "made with the layout"
        return self._host.keys(hashes)

    def _describe(self, starts: list[int]) -> tuple[list[int], list[int]]:
        """Where the blocks of the page slots from host indices `starts` lie
        (`HostPages` asks once per slot): SGLang's own page metadata, each
        part split as the node's blocks are."""
        assert self._pages is not None, "made with the layout"
        page_size = self._pool.page_size
        indices = torch.cat([torch.arange(s, s + page_size, dtype=torch.int64) for s in starts])
        ptrs, sizes = _page_meta(self._pool, indices)
        if len(ptrs) != len(starts) * len(self._part_sizes):
            raise _Refused("indices", f"the pool described {len(ptrs)} parts for {len(starts)} pages")
        return self._pages.spans(ptrs, sizes)

    # --- the page interface (interface_v1) -------------------------------------------

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """The number of leading pages stored (one MATCH_PREFIX of their
        parts), pinned ``lease_ms`` for the load that follows."""
        if not keys:
            return 0
        found = self._run("exists", 0, lambda c, pages: c.match_prefix(self._keys(keys), self.settings.lease_ms)[0] // pages.per_page)
        self._count("exists_pages", len(keys), "exists_pages_found", found)
        return found

    def batch_get_v1(
        self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> List[bool]:
        """Reads each page straight into the host pool at its indices; True
        for a page read whole."""
        if not keys:
            return []
        start = time.perf_counter() if self._metrics else 0.0
        got = self._run("get", [False] * len(keys), lambda c, pages: self._get_pages(c, pages, keys, host_indices))
        # Pages asked and read are counted by HostPages (see stats).
        if self._metrics and any(got):
            self._prefetch.append((sum(got), time.perf_counter() - start))
        return got

    def _get_pages(self, client: kvplane.Client, pages: _Pages, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        assert self._host is not None, "made with the layout"
        # One native call, which reads the indices from the tensor's memory.
        whole, partial = client.get_pages(self._host, keys, host_indices, self._describe)
        if partial:
            # Some parts of a page there and not others, or a part of
            # another length: evicted in part, or not this layout's bytes.
            self._failure("get", "incomplete-page", f"{len(partial)} page(s) only partly stored, e.g. {self._prefix}{keys[partial[0]]}")
        return whole

    def batch_set_v1(
        self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> List[bool]:
        """Sends the pages the node lacks straight from the host pool."""
        if not keys:
            return []
        if not self._writer:
            return [True] * len(keys)
        start = time.perf_counter()
        done = self._run("set", [False] * len(keys), lambda c, pages: self._set_pages(c, pages, keys, host_indices))
        if self._metrics and all(done):
            self._backup.append((len(keys), time.perf_counter() - start))
        return done

    def _set_pages(self, client: kvplane.Client, pages: _Pages, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        assert self._host is not None, "made with the layout"
        client.put_pages(self._host, keys, host_indices, self._describe)
        return [True] * len(keys)

    # --- the flat-page interface (without interface_v1) ------------------------------

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> List[torch.Tensor | None]:
        if not keys or target_locations is None:
            return [None] * len(keys)
        tensors = list(target_locations)

        def read(client: kvplane.Client, pages: _Pages) -> List[torch.Tensor | None]:
            views = pages.pieces([_tensor_bytes(t) for t in tensors])
            ok = pages.whole(client.get_into(self._keys(keys), views))
            return [t if w else None for t, w in zip(tensors, ok)]

        return self._run("get", [None] * len(keys), read)

    def set(
        self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        if not keys or values is None:
            return False
        if not self._writer:
            return True
        tensors = [v.contiguous() for v in values]

        def write(client: kvplane.Client, pages: _Pages) -> bool:
            client.put_from(self._keys(keys), pages.pieces([_tensor_bytes(t) for t in tensors]))
            return True

        return self._run("set", False, write)

    def exists(self, key: str) -> bool:
        return self._run("exists", False, lambda c, pages: all(c.exists(self._keys([key]))))

    # --- the rest of SGLang's interface ----------------------------------------------

    def clear(self) -> None:
        # A node does not enumerate keys, and its blocks may be another
        # deployment's: nothing is removed.
        logger.warning("kvplane: clear() removes nothing (a kvplane node does not list its keys; its blocks age out)")

    def get_stats(self) -> Any:
        """SGLang's storage metrics (with ``--enable-cache-report`` storage
        metrics on): pages moved and their bandwidth since the last call."""
        if not self._metrics or self._pool is None:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        page_gb = sum(self._part_sizes) / (1 << 30)
        metrics = StorageMetrics()
        for target, runs in ((metrics.prefetch_pgs, self._prefetch), (metrics.backup_pgs, self._backup)):
            target.extend(n for n, _ in runs)
        metrics.prefetch_bandwidth.extend(n * page_gb / max(s, 1e-9) for n, s in self._prefetch)
        metrics.backup_bandwidth.extend(n * page_gb / max(s, 1e-9) for n, s in self._backup)
        self._prefetch.clear()
        self._backup.clear()
        return metrics

    def stats(self) -> dict[str, int]:
        """This backend's counters: pages asked for and found (``exists_*``),
        asked of the node and read (``get_*``), stored and already present
        (``set_*``), and ``failed_{op}_{reason}`` for every failure answered
        as a miss."""
        counts = self._failures.snapshot()
        if self._host is not None:
            counts.update(self._host.counts())
        return counts

    def close(self) -> None:
        self._node.close()

    # --- failures are misses ---------------------------------------------------------

    def _run(self, op: str, miss: Any, call: Any) -> Any:
        """`call(client, pages)`, or `miss` when the node is down or the call
        fails in any way (logged and counted; never raised into SGLang)."""
        if self._pool is None:
            self._failure(op, "no-host-pool", "SGLang has not registered its host memory pool yet")
            return miss
        client = self._node.get()
        if client is None:
            # ReconnectingClient said why when it took the node to be down.
            self._failure(op, "node-down", f"{self.settings.endpoint} is taken to be down", log=False)
            return miss
        try:
            return call(client, self._layout(client))
        except kvplane.Error as e:
            if isinstance(e, (kvplane.Unavailable, kvplane.Timeout)):
                self._node.failed(client, e)
            self._failure(op, type(e).__name__, str(e))
        except _Refused as e:
            self._failure(op, e.reason, str(e))
        except Exception as e:  # noqa: BLE001 -- a bug here must not fail SGLang's request either
            logger.exception("kvplane: %s failed unexpectedly; answering a miss", op)
            self._failure(op, type(e).__name__, str(e), log=False)
        return miss

    def _failure(self, op: str, reason: str, detail: str, *, log: bool = True) -> None:
        self._failures.failure(op, reason, detail, log=log)

    def _count(self, name: str, n: int, name2: str, n2: int) -> None:
        self._failures.count((name, n), (name2, n2))


class _Refused(Exception):
    """A call that cannot be made as asked (`reason` names the kind)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Pages:
    """How pages map onto node blocks: each page part is ``counts[j]``
    pieces (one unless the part is larger than the node's largest block),
    ``per_page`` blocks in all, under ``{prefix}{hash}/{suffix}`` (the keys
    are built by `HostPages`)."""

    def __init__(self, part_sizes: list[int], max_block: int | None, name: str | None) -> None:
        self.counts = [1 if not max_block or s <= max_block else -(-s // max_block) for s in part_sizes]
        # Per part: its pieces as (offset, bytes) within it.
        self.cuts: list[list[tuple[int, int]]] = []
        suffixes: list[str] = []
        for j, (size, n) in enumerate(zip(part_sizes, self.counts)):
            piece = -(-size // n)
            self.cuts.append([(s * piece, min(piece, size - s * piece)) for s in range(n)])
            base = name or str(j)
            suffixes.extend(base if n == 1 else f"{base}.{s}of{n}" for s in range(n))
        self.sizes = [n for cuts in self.cuts for _, n in cuts]  # bytes of each block of a page, in order
        self.per_page = len(self.sizes)
        self.suffixes = ["/" + s for s in suffixes]

    def pieces(self, parts: list[memoryview]) -> list[memoryview]:
        """The page parts' memory split as the blocks are (the parts
        themselves when none is split)."""
        if self.per_page == len(self.counts):
            return parts
        return [part[o : o + n] for i, part in enumerate(parts) for o, n in self.cuts[i % len(self.cuts)]]

    def spans(self, ptrs: list[int], sizes: list[int]) -> tuple[list[int], list[int]]:
        """The blocks of page parts at `ptrs` (of `sizes` bytes), as the
        addresses and sizes of their pieces."""
        if self.per_page == len(self.counts):
            return ptrs, sizes
        cuts = [(p + o, n) for i, p in enumerate(ptrs) for o, n in self.cuts[i % len(self.cuts)]]
        return [p for p, _ in cuts], [n for _, n in cuts]

    def whole(self, lengths: list[int | None]) -> list[bool]:
        """Per page: every block read at its full length."""
        k, sizes = self.per_page, self.sizes
        pages = len(lengths) // k
        if lengths == sizes * pages:
            # Every page whole, the common case: one list comparison in C
            # instead of a slice per page (~3 us per 32 pages).
            return [True] * pages
        return [lengths[i : i + k] == sizes for i in range(0, len(lengths), k)]


class _Regions:
    """The pool's buffers as byte memoryviews, to turn SGLang's page
    pointers into slices of the pool's own memory."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        regions = sorted(((t.data_ptr(), t.nbytes, _tensor_bytes(t)) for t in buffers), key=lambda r: r[0])
        self._bases = [r[0] for r in regions]
        self._regions = regions
        # What HostPages exports (and checks every page block against).
        self.buffers = [mv for _, _, mv in regions]

    def view(self, ptr: int, size: int) -> memoryview:
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            base, nbytes, mv = self._regions[i]
            if ptr + size <= base + nbytes:
                return mv[ptr - base : ptr - base + size]
        raise _Refused("outside-pool", f"a page part at {ptr:#x} ({size} bytes) lies outside the host pool's buffers")


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as a flat byte memoryview (no copy)."""
    if not t.is_contiguous():
        raise _Refused("non-contiguous", f"a tensor of shape {tuple(t.shape)} is not contiguous")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _pool_buffers(pool: Any) -> list[torch.Tensor]:
    """The host tensors page parts live in: the pool's own list where it has
    one (SGLang's ``get_hybrid_pool_buffer``), else its ``kv_buffer``."""
    getter = getattr(pool, "get_hybrid_pool_buffer", None)
    buffers = [b for b in (getter() if getter else [pool.kv_buffer]) if b is not None]
    contiguous = [b for b in buffers if b.is_contiguous()]
    if len(contiguous) < len(buffers):
        if pool.kv_buffer.is_contiguous():
            return [pool.kv_buffer]
        raise ValueError(f"kvplane: host pool {type(pool).__name__}'s buffers are not contiguous")
    return contiguous


def _page_meta(pool: Any, indices: torch.Tensor) -> tuple[list[int], list[int]]:
    """SGLang's own description of the pages at `indices`: a pointer and a
    size per part."""
    try:
        ptrs, sizes = pool.get_page_buffer_meta(indices)
    except (ValueError, AssertionError, AttributeError) as e:
        raise ValueError(
            f"kvplane: host pool {type(pool).__name__} (layout {getattr(pool, 'layout', '?')}) gives no page metadata "
            f"for the page interface ({e}); use --hicache-mem-layout page_first, or drop interface_v1"
        ) from e
    if ptrs and not isinstance(ptrs[0], int):
        ptrs = [p for group in ptrs for p in group]
        sizes = [s for group in sizes for s in group]
    return ptrs, sizes


def _layout_name(pool: Any) -> str:
    """What a page's bytes depend on, for the key."""
    dtype = str(getattr(pool, "dtype", "?")).removeprefix("torch.")
    geometry = "".join(
        f"{tag}{getattr(pool, name)}"
        for tag, name in (("l", "layer_num"), ("h", "head_num"), ("d", "head_dim"), ("v", "v_head_dim"), ("r", "kv_lora_rank"))
        if getattr(pool, name, None) is not None
    )
    return f"{type(pool).__name__}/{getattr(pool, 'layout', '?')}/{dtype}/p{pool.page_size}/{geometry}"


def _shard(c: HiCacheStorageConfig) -> str:
    """Which rank's share of a page this is."""
    rank = "mla" if c.is_mla_model else f"tp{c.tp_rank}/{c.tp_size}"
    shard = f"{rank}@pp{c.pp_rank}/{c.pp_size}"
    if c.attn_cp_size > 1:
        shard += f"@cp{c.attn_cp_rank}/{c.attn_cp_size}"
    if c.dcp_size > 1:
        shard += f"@dcp{c.dcp_rank}/{c.dcp_size}/tp{c.tp_size}/lp{c.logical_page_size}"
    return shard
