"""kvplane's HiCache storage backend inside stock SGLang 0.5 (PyPI).

Everything SGLang-side is SGLang's own: the backend is made by its
`StorageBackendFactory` from the ``dynamic`` extra config of
examples/sglang/README.md (only the node's address changed), pages live in
its host memory pool (`MHATokenToKVPoolHost` over an `MHATokenToKVPool` on
the CPU, as SGLang's own storage unit tests build them), the calls are the
ones its cache controller makes (``batch_exists``, then ``batch_get_v1`` /
``batch_set_v1`` with host indices of the pool), and faults come from its
own injector (``SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE`` / ``_DELAY``).
Every node is a real `kvplane node` process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvplane
from conftest import Node

# Without SGLang every test here fails, naming why (a collection error
# would stop the whole run, the other engines' tests with it).
try:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        HiCacheStorageFailureInjector,
    )
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvplane.sglang_backend import KVPlaneHiCacheStorage

    MISSING = None
except ImportError as e:
    MISSING = e


@pytest.fixture(autouse=True)
def sglang_installed() -> None:
    if MISSING is not None:
        pytest.fail(f"SGLang does not import in this environment ({MISSING}); scripts/prereqs engines installs it")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "sglang" / "README.md"
PAGE = 16  # tokens per page
LAYERS, HEADS, HEAD_DIM = 2, 2, 64
DEADLINE_S = 30.0


def example_extra_config() -> dict:
    """The extra config examples/sglang/README.md gives the server."""
    m = re.search(r"--hicache-storage-backend-extra-config '(\{.*?\})'", EXAMPLE.read_text(), re.S)
    assert m, f"{EXAMPLE} shows no --hicache-storage-backend-extra-config '...'"
    return json.loads(m.group(1))


def host_pool(layout: str = "page_first", page: int = PAGE, dtype: torch.dtype = torch.bfloat16) -> MHATokenToKVPoolHost:
    """SGLang's own host pool on the CPU, with room for 32 pages."""
    device = MHATokenToKVPool(
        16 * page, page, dtype, HEADS, HEAD_DIM, LAYERS, "cpu", False, v_head_dim=HEAD_DIM, start_layer=0, end_layer=LAYERS - 1
    )
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        page,
        layout,
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
    )


def mla_host_pool() -> MLATokenToKVPoolHost:
    """SGLang's MLA host pool on the CPU (latent 64 + rope 16), 32 pages."""
    device = MLATokenToKVPool(16 * PAGE, PAGE, torch.bfloat16, 64, 16, LAYERS, "cpu", False)
    return MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        PAGE,
        "page_first",
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        target_layer_num=LAYERS,
    )


def storage_config(
    extra: dict, *, tp_rank: int = 0, tp_size: int = 1, model: str = "org/tiny-model", mla: bool = False
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=True,
        model_name=model,
        extra_config=extra,
    )


def backend(endpoint: str, pool: MHATokenToKVPoolHost, **config) -> HiCacheStorage:
    """What SGLang's cache controller does when it attaches a storage
    backend: the factory, then the host pool."""
    extra = {**example_extra_config(), "endpoint": endpoint, "retry_after_s": 0.2}
    extra.update(config.pop("extra", {}))
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **config), pool)
    b.register_mem_pool_host(pool)
    return b


def inner(b: HiCacheStorage) -> KVPlaneHiCacheStorage:
    """The kvplane backend, also when SGLang wrapped it in its injector."""
    if isinstance(b, HiCacheStorageFailureInjector):
        b = b._backend
    assert isinstance(b, KVPlaneHiCacheStorage), b
    return b


def fill(pool: MHATokenToKVPoolHost, n: int, seed: int) -> torch.Tensor:
    """`n` pages of the pool filled with random bytes; their host indices."""
    idx = pool.alloc(n * pool.page_size)
    assert idx is not None
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        page = pool.get_data_page(idx[i * pool.page_size].item(), flat=False)
        page.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, page.shape, dtype=torch.int16, generator=g))
    return idx


def page_bytes(pool: MHATokenToKVPoolHost, idx: torch.Tensor, i: int) -> bytes:
    return pool.get_data_page(idx[i * pool.page_size].item()).view(torch.int16).numpy().tobytes()


def hashes(tag: str, n: int) -> list[str]:
    return [f"{tag}{time.monotonic_ns()}-{i:04d}" for i in range(n)]


@pytest.fixture
def pool() -> MHATokenToKVPoolHost:
    return host_pool()


@pytest.fixture
def store(node: Node, pool: MHATokenToKVPoolHost) -> Iterator[HiCacheStorage]:
    b = backend(node.endpoint, pool)
    try:
        yield b
    finally:
        b.close()


def test_the_example_loads_the_backend_through_sglangs_dynamic_factory(store: HiCacheStorage) -> None:
    extra = example_extra_config()
    assert extra["backend_name"] == "kvplane" and extra["interface_v1"] == 1
    # SGLang's controller picks the zero-copy page functions exactly when
    # the dynamic backend's extra config says interface_v1.
    assert isinstance(store, KVPlaneHiCacheStorage) and store.v1


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_pages_round_trip_byte_identical_through_the_v1_interface(node: Node, layout: str) -> None:
    pool = host_pool(layout)
    b = backend(node.endpoint, pool)
    keys = hashes(layout, 5)
    idx = fill(pool, 5, seed=1)
    assert b.batch_exists(keys, HiCacheStorageExtraInfo()) == 0
    assert b.batch_set_v1(keys, idx) == [True] * 5
    assert b.batch_exists(keys) == 5

    into = pool.alloc(5 * PAGE)
    assert b.batch_get_v1(keys, into) == [True] * 5
    for i in range(5):
        assert page_bytes(pool, into, i) == page_bytes(pool, idx, i), f"page {i} ({layout})"
    parts = {"page_first": 2, "layer_first": 2 * LAYERS, "page_first_direct": 2, "page_head": 2}[layout]
    assert len(inner(b)._part_sizes) == parts
    # Storing what is there already sends nothing.
    assert b.batch_set_v1(keys, idx) == [True] * 5
    assert inner(b).stats()["set_pages_present"] == 5
    b.close()


def test_a_page_counts_only_whole_and_batch_exists_pins_the_match(node: Node, store: HiCacheStorage, pool, client) -> None:
    keys = hashes("whole", 4)
    idx = fill(pool, 4, seed=2)
    assert store.batch_set_v1(keys, idx) == [True] * 4
    # Drop page 2's V part behind SGLang's back (the key layout of the
    # module documentation): the leading pages end at page 2.
    prefix = inner(store)._prefix
    assert client.delete([f"{prefix}{keys[2]}/1"]) == [True]
    pinned = client.stats()["pinned"]
    assert store.batch_exists(keys) == 2
    assert client.stats()["pinned"] >= pinned + 4, "the 2 whole pages' 4 blocks are pinned for the load"
    into = pool.alloc(4 * PAGE)
    assert store.batch_get_v1(keys, into) == [True, True, False, True]
    assert inner(store).stats()["failed_get_incomplete-page"] == 1


def test_page_keys_are_built_natively_as_the_module_documents(store: HiCacheStorage, pool, client) -> None:
    b = inner(store)
    keys = hashes("native-keys", 3)
    idx = fill(pool, 3, seed=11)
    assert store.batch_set_v1(keys, idx) == [True] * 3
    # {namespace}@sglang@{model}@{shard}@{layout}@{page hash}/{part}
    documented = [f"@sglang@org-tiny-model@tp0/1@pp0/1@MHATokenToKVPoolHost/page_first/bfloat16/p{PAGE}/l{LAYERS}h{HEADS}d{HEAD_DIM}v{HEAD_DIM}@{h}/{j}" for h in keys for j in (0, 1)]
    assert b._keys(keys) == documented
    assert client.exists(documented) == [True] * 6, "the pages are stored under the documented keys"


def test_a_page_whose_host_indices_are_not_a_page_of_the_pool_is_a_named_miss(store: HiCacheStorage, pool, caplog) -> None:
    b = inner(store)
    keys = hashes("outside", 2)
    idx = fill(pool, 2, seed=12)
    assert store.batch_set_v1(keys, idx) == [True] * 2
    beyond = torch.arange(pool.size, pool.size + 2 * PAGE, dtype=torch.int64)
    assert store.batch_get_v1(keys, beyond) == [False, False]
    assert b.stats()["failed_get_Invalid"] == 1
    assert f"host_indices[0] = {pool.size}: page 0 of {PAGE} slots from there lies outside the host pool's {pool.size} slots" in caplog.text
    assert store.batch_set_v1(keys, beyond) == [False, False]
    assert b.stats()["failed_set_Invalid"] == 1
    # A page whose slots are not one run is refused the same way.
    shuffled = idx.clone()
    shuffled[[1, 2]] = shuffled[[2, 1]]
    assert store.batch_get_v1(keys, shuffled) == [False, False]
    assert b.stats()["failed_get_Invalid"] == 2
    # The same pages at their own slots still load.
    assert store.batch_get_v1(keys, pool.alloc(2 * PAGE)) == [True, True]


def test_host_indices_are_read_from_sglangs_tensor_itself(store: HiCacheStorage, pool) -> None:
    b = inner(store)
    keys = hashes("tensor", 2)
    idx = fill(pool, 2, seed=13)
    assert store.batch_set_v1(keys, idx) == [True] * 2
    client, host = b._node.get(), b._host
    into = pool.alloc(2 * PAGE)
    assert client.get_pages(host, keys, into.to(torch.int32), b._describe) == ([True, True], [])
    for i in range(2):
        assert page_bytes(pool, into, i) == page_bytes(pool, idx, i)
    with pytest.raises(kvplane.Invalid, match=r"host_indices: a Tensor of torch.float32 is not of int64 or int32"):
        client.get_pages(host, keys, into.to(torch.float32), b._describe)
    with pytest.raises(kvplane.Invalid, match=r"host_indices: a Tensor is not contiguous"):
        client.get_pages(host, keys, torch.stack([into, into], 1)[:, 0], b._describe)
    assert b.stats()["get_pages"] == 2 and b.stats()["get_pages_read"] == 2


def test_two_deployments_never_read_each_others_pages(node: Node) -> None:
    pool = host_pool()
    ours = backend(node.endpoint, pool)
    keys = hashes("mix", 3)
    assert ours.batch_set_v1(keys, fill(pool, 3, seed=3)) == [True] * 3
    others = {
        "tp rank": backend(node.endpoint, host_pool(), tp_rank=1, tp_size=2),
        "model": backend(node.endpoint, host_pool(), model="org/other-model"),
        "page size": backend(node.endpoint, host_pool(page=2 * PAGE)),
        "dtype": backend(node.endpoint, host_pool(dtype=torch.float16)),
        "layout": backend(node.endpoint, host_pool("layer_first")),
        "namespace": backend(node.endpoint, host_pool(), extra={"namespace": "tenant-b"}),
    }
    assert ours.batch_exists(keys) == 3
    for what, b in others.items():
        assert b.batch_exists(keys) == 0, f"a deployment differing in {what} found our pages"
        b.close()
    ours.close()


def test_mla_pages_are_one_copy_for_all_tp_ranks_written_by_one(node: Node, client) -> None:
    rank0_pool, rank1_pool = mla_host_pool(), mla_host_pool()
    rank0 = backend(node.endpoint, rank0_pool, tp_rank=0, tp_size=2, mla=True)
    rank1 = backend(node.endpoint, rank1_pool, tp_rank=1, tp_size=2, mla=True)
    keys = hashes("mla", 3)
    before = client.stats()["keys_put"]
    # The rank that is not SGLang's storage writer sends nothing.
    assert rank1.batch_set_v1(keys, fill(rank1_pool, 3, seed=12)) == [True] * 3
    assert client.stats()["keys_put"] == before and rank1.batch_exists(keys) == 0
    idx = fill(rank0_pool, 3, seed=13)
    assert rank0.batch_set_v1(keys, idx) == [True] * 3
    assert client.stats()["keys_put"] == before + 3, "one block per MLA page"
    # Rank 1 reads what rank 0 stored: the same latent pages.
    assert rank1.batch_exists(keys) == 3
    into = rank1_pool.alloc(3 * PAGE)
    assert rank1.batch_get_v1(keys, into) == [True] * 3
    for i in range(3):
        mine = rank1_pool.get_data_page(into[i * PAGE].item()).view(torch.int16).numpy().tobytes()
        assert mine == rank0_pool.get_data_page(idx[i * PAGE].item()).view(torch.int16).numpy().tobytes()
    rank0.close()
    rank1.close()


def test_a_part_larger_than_the_nodes_largest_block_is_stored_in_pieces(tmp_path) -> None:
    n = Node("--max-block", "4KiB")
    try:
        pool = host_pool()  # parts of 16 tokens x 2 layers x 2 heads x 64 x 2 bytes = 8 KiB
        b = backend(n.endpoint, pool)
        keys = hashes("pieces", 3)
        idx = fill(pool, 3, seed=4)
        assert b.batch_set_v1(keys, idx) == [True] * 3
        assert inner(b)._pages is not None and inner(b)._pages.per_page == 4
        into = pool.alloc(3 * PAGE)
        assert b.batch_exists(keys) == 3
        assert b.batch_get_v1(keys, into) == [True] * 3
        assert all(page_bytes(pool, into, i) == page_bytes(pool, idx, i) for i in range(3))
        b.close()
    finally:
        n.stop()


def test_over_the_unix_socket_page_bytes_move_through_shared_memory(tmp_path) -> None:
    sock = tmp_path / "node.sock"
    n = Node("--unix", str(sock))
    try:
        pool = host_pool()
        b = backend(f"unix://{sock}", pool)
        keys = hashes("shm", 8)
        idx = fill(pool, 8, seed=5)
        page = sum(inner(b)._part_sizes)
        watcher = kvplane.Client(f"unix://{sock}", shared_memory=False)
        before = watcher.stats()
        assert b.batch_set_v1(keys, idx) == [True] * 8
        into = pool.alloc(8 * PAGE)
        assert b.batch_get_v1(keys, into) == [True] * 8
        after = watcher.stats()
        assert all(page_bytes(pool, into, i) == page_bytes(pool, idx, i) for i in range(8))
        moved = 16 * page
        assert after["bytes_received"] - before["bytes_received"] < moved / 10, "page bytes came over the socket"
        assert after["bytes_sent"] - before["bytes_sent"] < moved / 10, "page bytes went over the socket"
        watcher.close()
        b.close()
    finally:
        n.stop()


def test_sglangs_fault_injector_makes_failures_misses(node: Node, monkeypatch) -> None:
    pool = host_pool()
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "1.0")
    always = backend(node.endpoint, pool)
    assert isinstance(always, HiCacheStorageFailureInjector)
    keys = hashes("inject", 4)
    idx = fill(pool, 4, seed=6)
    assert always.batch_set_v1(keys, idx) == [False] * 4
    assert always.batch_exists(keys) == 0
    assert always.batch_get_v1(keys, pool.alloc(4 * PAGE)) == [False] * 4

    # Half of the calls fail after a random delay: whatever does succeed is
    # byte-identical, and nothing raises.
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
    flaky = backend(node.endpoint, pool)
    outcomes = set()
    for round_ in range(16):
        ks = hashes(f"flaky{round_}-", 2)
        src = fill(pool, 2, seed=100 + round_)
        stored = all(flaky.batch_set_v1(ks, src))
        into = pool.alloc(2 * PAGE)
        got = flaky.batch_get_v1(ks, into)
        outcomes.add((stored, tuple(got)))
        for i, ok in enumerate(got):
            if ok:
                assert page_bytes(pool, into, i) == page_bytes(pool, src, i)
        pool.free(src)
        pool.free(into)
    assert (True, (True, True)) in outcomes and any(not all(g) for _, g in outcomes), outcomes


def bytes_waiting_at(port: int) -> int:
    """Bytes sent to loopback port `port` that its process has not read
    (the rx queues of its established TCP sockets, /proc/net/tcp)."""
    waiting = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, queues = fields[1], fields[3], fields[4]
        if state == "01" and int(local.split(":")[1], 16) == port:
            waiting += int(queues.split(":")[1], 16)
    return waiting


def test_a_node_killed_mid_batch_gives_misses_and_nothing_raises(pool) -> None:
    n = Node(memory="512MiB")
    b = backend(n.endpoint, pool)
    keys = hashes("kill", 16)
    idx = fill(pool, 16, seed=7)
    assert b.batch_set_v1(keys, idx) == [True] * 16
    into = pool.alloc(16 * PAGE)
    assert b.batch_get_v1(keys, into) == [True] * 16
    port = int(n.endpoint.rsplit(":", 1)[1])
    assert bytes_waiting_at(port) == 0

    # Freeze the node, send it a batch (SGLang's prefetch thread), and once
    # the batch's request sits unread at the node, kill the node under it.
    os.kill(n.proc.pid, signal.SIGSTOP)
    outcome: dict[str, object] = {}

    def prefetch() -> None:
        try:
            outcome["got"] = b.batch_get_v1(keys, into)
        except BaseException as e:  # noqa: BLE001 -- what the test is about
            outcome["raised"] = e

    t = threading.Thread(target=prefetch)
    t.start()
    deadline = time.monotonic() + DEADLINE_S
    while bytes_waiting_at(port) == 0 and time.monotonic() < deadline:
        time.sleep(0.002)
    assert bytes_waiting_at(port) > 0 and t.is_alive(), "the batch never reached the frozen node"
    os.kill(n.proc.pid, signal.SIGKILL)
    n.proc.wait()
    t.join(DEADLINE_S)
    assert "raised" not in outcome, f"an exception reached SGLang: {outcome['raised']!r}"
    assert outcome["got"] == [False] * 16
    failures = {k: v for k, v in inner(b).stats().items() if k.startswith("failed_")}
    assert failures == {"failed_get_Unavailable": 1}, failures
    # And later calls are misses too, without raising.
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, into) == [False] * 16
    assert b.batch_set_v1(keys, idx) == [False] * 16
    b.close()


def test_after_a_node_restarts_the_backend_stores_and_loads_again(tmp_path, pool) -> None:
    sock = tmp_path / "node.sock"
    n = Node("--unix", str(sock))
    b = backend(f"unix://{sock}", pool)  # retry_after_s 0.2
    keys = hashes("restart", 3)
    idx = fill(pool, 3, seed=11)
    assert b.batch_set_v1(keys, idx) == [True] * 3
    n.stop()
    assert b.batch_exists(keys) == 0  # down: a miss, SGLang recomputes
    n = Node("--unix", str(sock))  # a new node on the same socket, empty
    try:
        deadline = time.monotonic() + DEADLINE_S
        while b.batch_set_v1(keys, idx) != [True] * 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.batch_exists(keys) == 3
        into = pool.alloc(3 * PAGE)
        assert b.batch_get_v1(keys, into) == [True] * 3
        assert all(page_bytes(pool, into, i) == page_bytes(pool, idx, i) for i in range(3))
    finally:
        b.close()
        n.stop()


def test_a_node_that_cannot_be_reached_is_a_miss_from_the_start(pool) -> None:
    n = Node()
    endpoint = n.endpoint
    n.stop()
    b = backend(endpoint, pool)
    keys = hashes("down", 2)
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, fill(pool, 2, seed=8)) == [False] * 2
    assert b.batch_get_v1(keys, pool.alloc(2 * PAGE)) == [False] * 2
    assert sum(v for k, v in inner(b).stats().items() if k.startswith("failed_")) == 3


def test_without_interface_v1_flat_pages_round_trip(node: Node, pool) -> None:
    b = backend(node.endpoint, pool, extra={"interface_v1": 0})
    assert not inner(b).v1
    keys = hashes("flat", 3)
    idx = fill(pool, 3, seed=9)
    values = [pool.get_data_page(idx[i * PAGE].item(), flat=True) for i in range(3)]
    assert b.batch_set(keys, values)
    assert b.batch_exists(keys) == 3 and b.exists(keys[0])
    into = [pool.get_dummy_flat_data_page() for _ in keys]
    got = b.batch_get(keys, into)
    assert all(g is not None and torch.equal(g.view(torch.int16), v.view(torch.int16)) for g, v in zip(got, values))


def test_settings_are_checked_and_named_as_sglang_users_write_them(node: Node, pool) -> None:
    extra = {**example_extra_config()}
    extra.pop("endpoint")
    with pytest.raises(ValueError, match=r"--hicache-storage-backend-extra-config\.endpoint"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    extra = {**example_extra_config(), "endpoint": node.endpoint, "timeout_s": "soon"}
    with pytest.raises(ValueError, match=r"--hicache-storage-backend-extra-config\.timeout_s: expected a number"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)


def test_storage_metrics_reach_sglang(store: HiCacheStorage, pool) -> None:
    keys = hashes("metrics", 2)
    idx = fill(pool, 2, seed=10)
    assert store.batch_set_v1(keys, idx) == [True, True]
    assert store.batch_get_v1(keys, pool.alloc(2 * PAGE)) == [True, True]
    m = store.get_stats()
    assert m.backup_pgs == [2] and m.prefetch_pgs == [2]
    assert m.prefetch_bandwidth[0] > 0 and m.backup_bandwidth[0] > 0
    assert store.get_stats().prefetch_pgs == []
