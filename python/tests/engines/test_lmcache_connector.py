"""kvplane's ``kvplane://`` remote connector inside stock LMCache 0.5 (PyPI).

LMCache's own `RemoteBackend` drives the connector: it is built from
examples/lmcache/kvplane.yaml (only the node's address changed), finds the
connector through `remote_storage_plugins`, allocates chunks from its own
CPU backend and calls the connector as it would under vLLM. Every node is a
real `kvplane node` process.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

import kvplane
from conftest import Node
from kvplane.lmcache_connector import KVPlaneRemoteConnector, parse_url

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "lmcache" / "kvplane.yaml"
CHUNK = 16  # tokens per chunk (the example's 256, made small)
# (layers, K/V, tokens, kv heads, head size)
KV_SHAPE = (2, 2, CHUNK, 2, 8)
DEADLINE_S = 30.0


class Lmcache:
    """LMCache's remote backend for one worker, configured by the example
    file, on an event loop of its own as LMCache runs it."""

    def __init__(self, url: str, tmp_path: Path, kv_shape: tuple[int, ...] = KV_SHAPE) -> None:
        self.kv_shape = kv_shape
        settings = yaml.safe_load(EXAMPLE.read_text())
        settings["extra_config"]["remote_storage_plugin.kvplane.url"] = url
        settings.update(chunk_size=CHUNK, max_local_cpu_size=0.05, blocking_timeout_secs=10)
        path = tmp_path / "lmcache.yaml"
        path.write_text(yaml.safe_dump(settings))
        self.config = LMCacheEngineConfig.from_file(str(path))
        self.metadata = LMCacheMetadata(
            model_name="tiny",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.float16,
            kv_shape=kv_shape,
            chunk_size=CHUNK,
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cpu = LocalCPUBackend(self.config, self.metadata, dst_device="cpu")
        self.remote = RemoteBackend(self.config, self.metadata, self.loop, self.cpu, "cpu", plugin_name="kvplane")
        # LMCache wraps each connector in its instrumentation.
        assert isinstance(self.remote.connection._connector, KVPlaneRemoteConnector), self.remote.connection

    def key(self, chunk_hash: int) -> CacheEngineKey:
        return CacheEngineKey("tiny", 1, 0, chunk_hash, torch.float16)

    def chunk(self, seed: int, tokens: int = CHUNK) -> MemoryObj:
        shape = torch.Size([2, self.kv_shape[0], tokens, self.kv_shape[3] * self.kv_shape[4]])
        obj = self.cpu.allocate(shape, torch.float16, MemoryFormat.KV_2LTD)
        assert obj is not None
        g = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.rand(shape, generator=g).to(torch.float16))
        return obj

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(DEADLINE_S)

    def close(self) -> None:
        self.remote.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(DEADLINE_S)


@pytest.fixture
def lmcache(node: Node, tmp_path: Path) -> Iterator[Lmcache]:
    lm = Lmcache(f"kvplane://{node.endpoint}", tmp_path)
    try:
        yield lm
    finally:
        lm.close()


def eventually(what: str, check) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.01)


def test_lmcache_stores_and_reads_chunks_through_kvplane(lmcache: Lmcache, node: Node) -> None:
    base = time.monotonic_ns()
    keys = [lmcache.key(base + i) for i in range(3)]
    # Two full chunks and a last, shorter one (10 tokens), as LMCache saves a prompt.
    chunks = [lmcache.chunk(1), lmcache.chunk(2), lmcache.chunk(3, tokens=10)]
    expected = [bytes(c.byte_array) for c in chunks]
    lmcache.remote.batched_submit_put_task(keys, chunks)
    eventually("the three chunks are stored", lambda: all(lmcache.remote.contains(k) for k in keys))
    # The bytes are in the node, under LMCache's key strings.
    with kvplane.Client(node.endpoint) as kv:
        assert kv.get([keys[0].to_string()])[0] == expected[0]

    got = lmcache.remote.batched_get_blocking(keys)
    assert [bytes(g.byte_array) for g in got] == expected
    assert got[2].meta.shape[2] == 10, "the short chunk comes back with its own token count"
    for g in got:
        g.ref_count_down()
    one = lmcache.remote.get_blocking(keys[1])
    assert one is not None and bytes(one.byte_array) == expected[1]
    one.ref_count_down()


def test_lookups_are_prefix_matches_and_non_blocking_gets_return_the_prefix(lmcache: Lmcache) -> None:
    base = time.monotonic_ns()
    keys = [lmcache.key(base + i) for i in range(4)]
    stored = [keys[0], keys[1], keys[3]]  # keys[2] is missing
    lmcache.remote.batched_submit_put_task(stored, [lmcache.chunk(i) for i in range(3)])
    eventually("stored", lambda: all(lmcache.remote.contains(k) for k in stored))

    assert lmcache.run(lmcache.remote.batched_async_contains("lookup-1", keys, pin=True)) == 2
    assert lmcache.remote.batched_contains(keys) == 2
    prefix = lmcache.run(lmcache.remote.batched_get_non_blocking("lookup-1", keys))
    assert len(prefix) == 2, "reads stop at the first missing chunk"
    for p in prefix:
        p.ref_count_down()

    assert lmcache.remote.remove(keys[0]) is True
    assert not lmcache.remote.contains(keys[0])
    assert lmcache.remote.batched_contains(keys) == 0


def test_chunks_larger_than_the_nodes_largest_block_are_stored_in_parts(tmp_path: Path) -> None:
    """LMCache's 36 MiB chunks were refused by a node whose largest block is
    16 MiB (``invalid: `` and nothing cached); scaled down: 64 KiB chunks
    against --max-block 16KiB are stored in four parts, read back whole, and
    a chunk missing one part is a miss, not a torn read."""
    small = Node("--max-block", "16KiB", memory="16MiB")
    # (layers, K/V, tokens, kv heads, head size): 2*2*16*8*64 fp16 = 64 KiB a chunk.
    lm = Lmcache(f"kvplane://{small.endpoint}", tmp_path, kv_shape=(2, 2, CHUNK, 8, 64))
    try:
        base = time.monotonic_ns()
        keys = [lm.key(base + i) for i in range(3)]
        chunks = [lm.chunk(1), lm.chunk(2), lm.chunk(3, tokens=5)]
        expected = [bytes(c.byte_array) for c in chunks]
        assert len(expected[0]) == 64 << 10
        lm.remote.batched_submit_put_task(keys, chunks)
        eventually("the chunks are stored", lambda: lm.remote.batched_contains(keys) == 3)
        with kvplane.Client(small.endpoint) as kv:
            assert kv.max_block_bytes == 16 << 10
            parts = [f"{keys[0].to_string()}#part{j}of4" for j in range(4)]
            assert b"".join(kv.get(parts)) == expected[0], "the parts are the chunk's bytes in order"
        got = lm.remote.batched_get_blocking(keys)
        assert [bytes(g.byte_array) for g in got] == expected
        assert got[2].meta.shape[2] == 5, "the short chunk comes back with its own token count"
        for g in got:
            g.ref_count_down()
        # One part gone: the chunk is a miss everywhere.
        with kvplane.Client(small.endpoint) as kv:
            assert kv.delete([f"{keys[1].to_string()}#part2of4"]) == [True]
        assert lm.remote.batched_contains(keys) == 1
        assert lm.remote.get_blocking(keys[1]) is None
    finally:
        lm.close()
        small.stop()


def test_a_node_that_is_down_makes_misses_not_errors(tmp_path: Path) -> None:
    gone = Node()
    url = f"kvplane://{gone.endpoint}?retry_after_s=0"
    gone.stop()
    lm = Lmcache(url, tmp_path)
    try:
        key = lm.key(7)
        lm.remote.batched_submit_put_task([key], [lm.chunk(1)])  # a no-op, logged
        assert lm.remote.contains(key) is False
        assert lm.remote.get_blocking(key) is None
        assert lm.remote.batched_get_blocking([key, lm.key(8)]) == [None, None]
        assert lm.run(lm.remote.batched_async_contains("x", [key], pin=True)) == 0
    finally:
        lm.close()


@pytest.mark.parametrize(
    "url, message",
    [
        ("redis://h:1", "starts with kvplane://"),
        ("kvplane://host", "is not HOST:PORT"),
        ("kvplane://h:1?lease=5", "unknown parameter(s) lease"),
        ("kvplane://h:1?timeout_s=soon", "timeout_s: expected a number >= 0, got 'soon'"),
        ("kvplane://h:1?lease_ms=-1", "lease_ms: expected a whole number >= 0, got '-1'"),
        ("kvplane://h:1?write_quorum=2", "write_quorum: applies to a cluster only (cluster=true)"),
        ("kvplane://h:1?shared_memory=maybe", "shared_memory: expected true or false (or 1, 0), got 'maybe'"),
        ("kvplane://", "no HOST:PORT and no socket path"),
    ],
)
def test_a_bad_url_is_refused_naming_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_url(url)
    assert message in str(e.value)


def test_urls_name_a_node_a_socket_or_a_cluster() -> None:
    assert parse_url("kvplane://127.0.0.1:9600").endpoint == "127.0.0.1:9600"
    assert parse_url("kvplane:///run/kvplane/node.sock").endpoint == "unix:///run/kvplane/node.sock"
    seeds = parse_url("kvplane://a:1,b:2?lease_ms=500&token=t")
    assert (seeds.endpoint, seeds.cluster, seeds.lease_ms, seeds.token) == (("a:1", "b:2"), True, 500, "t")
    one_seed = parse_url("kvplane://a:1?cluster=true&write_quorum=1&shared_memory=false")
    assert (one_seed.endpoint, one_seed.cluster, one_seed.write_quorum, one_seed.shared_memory) == ("a:1", True, 1, False)


def test_the_url_sets_every_client_option(node: Node, tmp_path: Path) -> None:
    lm = Lmcache(f"kvplane://{node.endpoint}?connections=1&timeout_s=2&shared_memory=false&retry_after_s=0", tmp_path)
    try:
        connector = lm.remote.connection._connector
        expected = {
            "cluster": False,
            "connections": 1,
            "token": None,
            "timeout": 2.0,
            "write_quorum": None,
            "shared_memory": False,
        }
        # That the settings hold every option of kvplane.Client is
        # test_settings.py's to check; here, that the URL reaches both the
        # coroutines' client (kvplane.aio) and the synchronous calls' one.
        options = connector._node._options
        assert {k: options.get(k) for k in expected} == expected
        assert connector._aio._options == options
        key = lm.key(time.monotonic_ns())
        chunk = lm.chunk(5)
        expected = bytes(chunk.byte_array)
        lm.remote.batched_submit_put_task([key], [chunk])
        eventually("the chunk is stored", lambda: lm.remote.contains(key))
        got = lm.remote.get_blocking(key)
        assert got is not None and bytes(got.byte_array) == expected
        got.ref_count_down()
    finally:
        lm.close()
