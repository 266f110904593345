"""scripts/bench-sglang's program: SGLang's page loads through kvplane's
HiCache backend against the Python client's own get_into of the same bytes.

    sglang_bench.py --endpoint ENDPOINT --page TOKENS --layers L --heads H \
        --head-dim D --batch PAGES --runs RUNS --seconds SECONDS
    sglang_bench.py --kvplane-bin BIN [the shape options]

The second form starts a node (BIN; 1 GiB, on a Unix socket in a fresh
temporary folder and on a loopback port the kernel picks), runs the first
form against each endpoint, then stops the node by its PID.

Builds SGLang's own host pool on the CPU (bfloat16, page_first: two parts
of PAGE x L x H x D x 2 bytes per page), its backend through SGLang's
dynamic factory as examples/sglang/README.md configures it, stores BATCH
pages once, then RUNS runs of SECONDS each, in which the two below are
called in turn, batch by batch (so both meet the same load):

  v1       backend.batch_get_v1(hashes, host_indices): what SGLang's
           prefetch thread calls, pages read straight into the pool
  get_into client.get_into(keys, views) of the same keys into the same
           pool memory (keys and views made once, outside the timing):
           the client alone

Every answer is checked (all pages read, all lengths full). Prints one
JSON line: per run the GB/s of each, their medians, the ratio of the
medians and the median of the runs' own ratios (median_run_ratio: each run
meets one load, so that is the figure to judge by on a noisy machine)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

import kvplane


def paired(seconds: float, a, b, nbytes: int) -> tuple[float, float]:
    """GB/s of `a` and of `b` (each one batch of `nbytes`), called in turn
    for `seconds`: each call of one follows a call of the other, so both
    meet the same load of a noisy machine."""
    spent = [0.0, 0.0]
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for i, fn in enumerate((a, b) if n % 2 == 0 else (b, a)):
            start = time.perf_counter()
            fn()
            spent[i if n % 2 == 0 else 1 - i] += time.perf_counter() - start
        n += 1
    return n * nbytes / spent[0] / 1e9, n * nbytes / spent[1] / 1e9


def main(a: argparse.Namespace) -> None:
    device = MHATokenToKVPool(
        2 * a.batch * a.page, a.page, torch.bfloat16, a.heads, a.head_dim, a.layers, "cpu", False, v_head_dim=a.head_dim
    )
    pool = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        a.page,
        "page_first",
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
    )
    extra = {
        "backend_name": "kvplane",
        "module_path": "kvplane.sglang_backend",
        "class_name": "KVPlaneHiCacheStorage",
        "interface_v1": 1,
        "endpoint": a.endpoint,
    }
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench/model",
        extra_config=extra,
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    src = pool.alloc(a.batch * a.page)
    pool.kv_buffer.view(torch.int16).random_()
    hashes = [f"{i:064x}" for i in range(a.batch)]
    assert backend.batch_set_v1(hashes, src) == [True] * a.batch
    into = pool.alloc(a.batch * a.page)
    page_bytes = sum(backend._part_sizes)

    def v1() -> None:
        if backend.batch_get_v1(hashes, into) != [True] * a.batch:
            raise SystemExit(f"batch_get_v1 missed pages: {backend.stats()}")

    # The same keys into the same memory, made once (where the backend's
    # HostPages reads each page's blocks to: SGLang's page metadata).
    pages = backend._pages
    keys = backend._keys(hashes)
    ptrs, sizes = backend._describe(into[:: a.page].tolist())
    views = [backend._regions.view(p, n) for p, n in zip(ptrs, sizes)]
    client = kvplane.Client(a.endpoint)
    want = pages.sizes * a.batch

    def get_into() -> None:
        if client.get_into(keys, views) != want:
            raise SystemExit("get_into answered short or absent blocks")

    v1()
    get_into()
    runs = []
    for _ in range(a.runs):
        r_v1, r_client = paired(a.seconds, v1, get_into, page_bytes * a.batch)
        runs.append({"v1": r_v1, "get_into": r_client})
    med_v1 = statistics.median(r["v1"] for r in runs)
    med_client = statistics.median(r["get_into"] for r in runs)
    print(
        json.dumps(
            {
                "endpoint": a.endpoint,
                "page_bytes": page_bytes,
                "parts_per_page": pages.per_page,
                "batch_pages": a.batch,
                "runs": runs,
                "median_v1_gbps": med_v1,
                "median_get_into_gbps": med_client,
                "ratio": med_v1 / med_client,
                # Each run pairs the two on the same load: the figure to judge by.
                "median_run_ratio": statistics.median(r["v1"] / r["get_into"] for r in runs),
                "failures": {k: v for k, v in backend.stats().items() if k.startswith("failed_")},
            }
        )
    )
    client.close()
    backend.close()


def with_node(a: argparse.Namespace) -> None:
    """Starts a node, runs this program against its socket and its TCP
    port, stops it."""
    with tempfile.TemporaryDirectory() as tmp:
        sock = os.path.join(tmp, "node.sock")
        args = [a.kvplane_bin, "node", "--listen", "127.0.0.1:0", "--unix", sock, "--admin", "none", "--memory", "1GiB"]
        node = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            endpoint = None
            assert node.stderr is not None
            for line in node.stderr:
                m = re.search(r"kvplane node serving.*?tcp (\S+?)(?:,|\s|$)", line)
                if m:
                    endpoint = m.group(1)
                    break
            if endpoint is None:
                raise SystemExit(f"{a.kvplane_bin} node exited without serving (status {node.wait()})")
            shape = [f"--page={a.page}", f"--layers={a.layers}", f"--heads={a.heads}", f"--head-dim={a.head_dim}"]
            shape += [f"--batch={a.batch}", f"--runs={a.runs}", f"--seconds={a.seconds}"]
            for ep in (f"unix://{sock}", endpoint):
                subprocess.run([sys.executable, __file__, "--endpoint", ep, *shape], check=True)
        finally:
            os.kill(node.pid, signal.SIGTERM)
            node.wait(timeout=30)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoint")
    where.add_argument("--kvplane-bin")
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2.0)
    parsed = p.parse_args()
    (with_node if parsed.kvplane_bin else main)(parsed)
