"""kvplane as the L2 cache of stock aibrix_kvcache 0.8 (PyPI).

AIBrix picks its L2 connector from a fixed list, so kvplane is added by
`kvplane.aibrix.install()`, which changes a class of AIBrix's for the whole
process: each case runs in a fresh interpreter (a subprocess), as an engine
would, configured through the environment AIBrix and the connector read.
AIBrix's own classes do the work: `Connector.create`, its `L2Cache`, its
tensor pool allocator's memory regions, its key builder. Every node is a
real `kvplane node` process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import Node

# Without aibrix_kvcache every test here fails, naming why, before any
# subprocess (a collection error would stop the other engines' tests too).
try:
    import aibrix_kvcache  # noqa: F401

    MISSING = None
except ImportError as e:
    MISSING = e


@pytest.fixture(autouse=True)
def aibrix_installed() -> None:
    if MISSING is not None:
        pytest.fail(f"aibrix_kvcache does not import in this environment ({MISSING}); scripts/prereqs engines installs it")

TIMEOUT_S = 120

# Builds AIBrix's L2 cache for the environment's backend, as its cache
# manager does (direct mode, no meta service), and four blocks from its own
# allocator.
PRELUDE = """
import asyncio, json, os, sys
from concurrent.futures import ThreadPoolExecutor
import torch
from aibrix_kvcache import envs
from aibrix_kvcache.cache_hashable import TokenListView
from aibrix_kvcache.l2 import L2Cache
from aibrix_kvcache.memory.allocator import TensorPoolAllocator
from aibrix_kvcache.spec import KVCacheBlockLayout, KVCacheBlockSpec, KVCacheTensorSpec

SPEC = KVCacheBlockSpec(
    block_ntokens=16,
    block_dtype=torch.bfloat16,
    block_layout=KVCacheBlockLayout.NCLD,
    tensor_spec=KVCacheTensorSpec(heads=[0, 1], layers=[0, 1], head_size=64),
)
ALLOCATOR = TensorPoolAllocator.create(capacity_nbytes=16 << 20)

def l2():
    cache = L2Cache(
        backend_name=envs.AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND,
        placement_policy="SIMPLE",
        namespace="kvtest",
        block_spec=SPEC,
        executor=ThreadPoolExecutor(4),
    )
    status = cache.open()
    assert status.is_ok(), status
    return cache

def blocks(n, seed=None):
    mrs = ALLOCATOR.alloc([SPEC.block_nbytes] * n).get()
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    for mr in mrs:
        mr.block_nbytes = SPEC.block_nbytes
        if g is not None:
            mr.to_tensor().copy_(torch.randint(0, 256, (SPEC.block_nbytes,), dtype=torch.uint8, generator=g))
    return mrs

TOKENS = TokenListView(list(range(1000, 1064)))  # four blocks of 16 tokens
"""


def run(script: str, node: Node | None, **env: str) -> dict:
    """Runs PRELUDE + `script` in a fresh interpreter; its last stdout line
    is JSON."""
    environ = {**os.environ, "AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND": "kvplane", **env}
    if node is not None:
        environ.setdefault("AIBRIX_KV_CACHE_OL_KVPLANE_ENDPOINT", node.endpoint)
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_without_the_hook_aibrix_knows_no_kvplane_backend(node: Node) -> None:
    out = run(
        """
        try:
            l2()
            print(json.dumps({"made": True}))
        except ValueError as e:
            print(json.dumps({"made": False, "error": str(e)}))
        """,
        node,
    )
    assert out == {"made": False, "error": "Unknown connector type: KVPLANE"}


def test_aibrixs_l2_cache_round_trips_blocks_through_a_node(node: Node) -> None:
    out = run(
        """
        import kvplane.aibrix
        kvplane.aibrix.install()
        cache = l2()
        src = blocks(4, seed=1)
        async def main():
            missing = await cache.exists(None, TOKENS)
            put = await cache.put(None, TOKENS, src)
            found = await cache.exists(None, TOKENS)
            into = blocks(4)
            got = await cache.get(None, TOKENS, into)
            return {
                "backend": repr(cache),
                "missing": missing.is_not_found(),
                "put": put.get(),
                "found": found.get(),
                "got": got.get(),
                "same": [a.tobytes() == b.tobytes() for a, b in zip(src, into)],
                "stats": cache._backend.stats(),
                "bytes": [b.tobytes().hex() for b in src],
            }
        print(json.dumps(asyncio.run(main())))
        """,
        node,
    )
    assert out["backend"] == "L2Cache(backend=kvplane)"
    assert out["missing"] and out["put"] == 4 and out["found"] == 4 and out["got"] == 4
    assert out["same"] == [True] * 4
    assert out["stats"]["put_stored"] == 4 and out["stats"]["get_found"] == 4

    # A second engine (another interpreter, the same deployment) reads them.
    again = run(
        """
        import kvplane.aibrix
        kvplane.aibrix.install()
        cache = l2()
        async def main():
            into = blocks(4)
            got = await cache.get(None, TOKENS, into)
            return {"got": got.get(), "bytes": [b.tobytes().hex() for b in into]}
        print(json.dumps(asyncio.run(main())))
        """,
        node,
    )
    assert again["got"] == 4 and again["bytes"] == out["bytes"]


def test_the_connector_interface_as_aibrix_defines_it(node: Node) -> None:
    out = run(
        """
        import kvplane.aibrix
        from aibrix_kvcache.l2.connectors import Connector, ConnectorConfig
        from aibrix_kvcache.l2.connectors.mock import MockConnector
        from aibrix_kvcache.status import StatusCodes
        kvplane.aibrix.install()
        kvplane.aibrix.install()  # twice is once

        class NoThreads(ThreadPoolExecutor):
            # The connector awaits kvplane.aio: AIBrix's executor stays idle.
            def submit(self, *args, **kwargs):
                raise AssertionError("the kvplane connector used AIBrix's executor")

        ex = NoThreads(1)
        config = ConnectorConfig(backend_name="KVPLANE", namespace="ns", partition_id="p0", executor=ex, block_spec_signature="sig")
        conn = Connector.create(config)
        mock = Connector.create(ConnectorConfig(backend_name="MOCK", namespace="ns", partition_id="p0", executor=ex))
        assert conn.open().is_ok()
        src = blocks(3, seed=2)
        keys = [b"k0", b"k1", b"k2"]
        async def main():
            return {
                "type": type(conn).__name__,
                "conn_id": conn.conn_id,
                "mput_mget": conn.feature.mput_mget,
                "other_backends": type(mock).__name__,
                "absent": (await conn.exists(b"k0")).error_code.name,
                "mput": [s.is_ok() for s in await conn.mput(keys, src)],
                "exists": (await conn.exists(b"k1")).is_ok(),
                "mget": [s.error_code.name for s in await conn.mget(keys + [b"nope"], blocks(4))],
                "batches": [len(b) for b in conn.get_batches(keys, src, 2)],
                "put_one": (await conn.put(b"k9", src[0])).is_ok(),
                # L2Cache passes block hashes (BlockHashes queries) as str.
                "str_key": (await conn.put("h9", src[0])).is_ok() and (await conn.exists("h9")).is_ok(),
                "delete": (await conn.delete(b"k1")).is_ok(),
                "after_delete": (await conn.exists(b"k1")).error_code.name,
            }
        out = asyncio.run(main())
        into = blocks(1)
        out["get_one"] = asyncio.run(conn.get(b"k2", into[0])).is_ok() and into[0].tobytes() == src[2].tobytes()
        kvplane.aibrix.uninstall()
        try:
            Connector.create(config)
            out["after_uninstall"] = "made"
        except ValueError as e:
            out["after_uninstall"] = str(e)
        out["closed"] = conn.close().is_ok()
        print(json.dumps(out))
        """,
        node,
    )
    assert out["type"] == "KVPlaneConnector" and out["mput_mget"] is True
    assert out["conn_id"] == "ns_p0_sig", "the id AIBrix's own create gives its connectors"
    assert out["other_backends"] == "MockConnector"
    assert out["absent"] == "NOT_FOUND"
    assert out["mput"] == [True] * 3 and out["exists"] is True
    assert out["mget"] == ["OK", "OK", "OK", "NOT_FOUND"]
    assert out["batches"] == [2, 1]
    assert out["put_one"] and out["str_key"] and out["delete"] and out["after_delete"] == "NOT_FOUND"
    assert out["get_one"] is True
    assert out["after_uninstall"] == "Unknown connector type: KVPLANE"
    assert out["closed"]


def test_a_node_that_is_down_answers_statuses_never_exceptions() -> None:
    n = Node()
    endpoint = n.endpoint
    n.stop()
    out = run(
        """
        import kvplane.aibrix
        kvplane.aibrix.install()
        cache = l2()  # open succeeds: a node that is down is every lookup a miss
        async def main():
            return {
                "exists": (await cache.exists(None, TOKENS)).error_code.name,
                "put": (await cache.put(None, TOKENS, blocks(4, seed=3))).error_code.name,
                "get": (await cache.get(None, TOKENS, blocks(4))).error_code.name,
                "failures": sum(v for k, v in cache._backend.stats().items() if k.startswith("failed_")),
            }
        print(json.dumps(asyncio.run(main())))
        """,
        None,
        AIBRIX_KV_CACHE_OL_KVPLANE_ENDPOINT=endpoint,
        AIBRIX_KV_CACHE_OL_KVPLANE_RETRY_AFTER_S="0",
    )
    assert out["exists"] == "NOT_FOUND" and out["get"] == "NOT_FOUND"
    assert out["put"] == "ERROR"
    assert out["failures"] >= 3


def test_settings_are_read_from_the_environment_and_named(node: Node) -> None:
    out = run(
        """
        import kvplane.aibrix
        kvplane.aibrix.install()
        errors = {}
        for var, value in [("AIBRIX_KV_CACHE_OL_KVPLANE_TIMEOUT_S", "soon"), ("AIBRIX_KV_CACHE_OL_KVPLANE_ENDPOINT", "")]:
            old = os.environ.get(var)
            os.environ[var] = value
            try:
                l2()
                errors[var] = None
            except ValueError as e:
                errors[var] = str(e)
            os.environ[var] = old or ""
        print(json.dumps(errors))
        """,
        node,
    )
    assert out["AIBRIX_KV_CACHE_OL_KVPLANE_TIMEOUT_S"].startswith("AIBRIX_KV_CACHE_OL_KVPLANE_TIMEOUT_S: expected a number")
    assert out["AIBRIX_KV_CACHE_OL_KVPLANE_ENDPOINT"].startswith("AIBRIX_KV_CACHE_OL_KVPLANE_ENDPOINT: the kvplane node")
