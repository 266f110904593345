"""One Python client program's run for scripts/bench-python.

    pyclient_bench.py --target TARGET --endpoint ENDPOINT --op OP --size SIZE \
        --batch BATCH --blocks BLOCKS --seconds SECONDS

TARGET: `kvplane` (the kvplane package with its defaults: put_from /
get_into, a pool of 4 connections over which a large batch is split),
`kvplane-aio` (the same calls of kvplane.aio.Client, each awaited in turn
on one asyncio event loop) or `redis` (redis-py, a pipeline of SET or GET per batch, no
transaction). OP: put or get (a GET run stores the keys first, untimed).
BLOCKS distinct keys are moved BATCH at a time, cyclically, for SECONDS;
every GET's length is checked. Prints one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from bench_results import timed  # scripts/lib, this file's folder


def main(target: str, endpoint: str, op: str, size: int, batch: int, blocks: int, seconds: float) -> None:
    area = bytearray(bytes(i * 31 % 251 for i in range(size)) * batch)
    view = memoryview(area)
    buffers = [view[j * size : (j + 1) * size] for j in range(batch)]
    keys = [f"bench/{i:08}" for i in range(blocks)]
    chunks = [keys[i : i + batch] for i in range(0, len(keys), batch)]

    if target == "kvplane":
        import kvplane

        client = kvplane.Client(endpoint)

        def put(ks: list[str]) -> None:
            client.put_from(ks, buffers[: len(ks)])

        def get(ks: list[str]) -> None:
            got = client.get_into(ks, buffers[: len(ks)])
            if got != [size] * len(ks):
                sys.exit(f"get_into answered {got[:3]}...")
    elif target == "kvplane-aio":
        import kvplane.aio

        return asyncio.run(main_aio(kvplane.aio.Client(endpoint), op, size, buffers, chunks, seconds))
    elif target == "redis":
        import redis

        host, port = endpoint.rsplit(":", 1)
        client = redis.Redis(host=host, port=int(port))

        def put(ks: list[str]) -> None:
            pipe = client.pipeline(transaction=False)
            for k, b in zip(ks, buffers):
                pipe.set(k, b)
            pipe.execute()

        def get(ks: list[str]) -> None:
            pipe = client.pipeline(transaction=False)
            for k in ks:
                pipe.get(k)
            got = pipe.execute()
            if any(v is None or len(v) != size for v in got):
                sys.exit("a GET came back missing or short")
    else:
        sys.exit(f"unknown target {target!r}")

    if op == "get":
        for c in chunks:
            put(c)
    report(target, op, size, batch, timed(chunks, get if op == "get" else put, seconds))


async def main_aio(client, op: str, size: int, buffers: list[memoryview], chunks: list[list[str]], seconds: float) -> None:
    """The kvplane-aio run: bench_results.timed's loop, each call awaited."""
    async def put(ks: list[str]) -> None:
        await client.put_from(ks, buffers[: len(ks)])

    async def get(ks: list[str]) -> None:
        got = await client.get_into(ks, buffers[: len(ks)])
        if got != [size] * len(ks):
            sys.exit(f"get_into answered {got[:3]}...")

    if op == "get":
        for c in chunks:
            await put(c)
    run = get if op == "get" else put
    started = time.perf_counter()
    end = started + seconds
    moved, lat, stop = 0, [], False
    while not stop:
        for c in chunks:
            t = time.perf_counter()
            await run(c)
            now = time.perf_counter()
            lat.append(now - t)
            moved += len(c)
            if now >= end:
                stop = True
                break
    elapsed = time.perf_counter() - started
    pct = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else lat * 99
    r = {"blocks": moved, "seconds": elapsed, "p50_us": pct[49] * 1e6, "p99_us": pct[98] * 1e6}
    report("kvplane-aio", op, size, len(buffers), r)


def report(target: str, op: str, size: int, batch: int, r: dict) -> None:
    print(json.dumps({
        "target": target, "op": op, "block_size": size, "batch": batch, "clients": 1, **r,
        "bytes": r["blocks"] * size, "gb_per_s": r["blocks"] * size / r["seconds"] / 1e9,
        "blocks_per_s": r["blocks"] / r["seconds"], "misses": 0,
    }), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, choices=["kvplane", "kvplane-aio", "redis"])
    parser.add_argument("--endpoint", required=True, help="the node's or redis-server's address")
    parser.add_argument("--op", required=True, choices=["put", "get"])
    parser.add_argument("--size", required=True, type=int, help="bytes per block")
    parser.add_argument("--batch", required=True, type=int, help="blocks per call")
    parser.add_argument("--blocks", required=True, type=int, help="distinct keys, moved BATCH at a time, cyclically")
    parser.add_argument("--seconds", required=True, type=float, help="how long to run")
    a = parser.parse_args()
    main(a.target, a.endpoint, a.op, a.size, a.batch, a.blocks, a.seconds)
