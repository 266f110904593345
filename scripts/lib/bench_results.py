"""Results of the benchmark scripts: one JSON object per line, each a run of
one client program against one target (`label`, `run`, `op`, `block_size`,
`gb_per_s`, ...).

As a library: `Results` answers medians over runs and ratios between two
labels, the median of each run's own ratio (the two sides of a ratio ran one
right after the other, so a load that comes and goes shifts both).

`timed` is the measuring loop of the client programs (any Python).

As a command, `merge --barrier DIR --target T --op OP --size BYTES --batch N
--clients N`: sums the JSON lines (`blocks`, `seconds`, `p50_us`, `p99_us`)
that the client processes of one run wrote to DIR/out.* into one result line
on stdout.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import time
from collections.abc import Callable


def human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


class Results:
    def __init__(self, path: str) -> None:
        with open(path) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.sizes = sorted({r["block_size"] for r in self.rows})

    def runs_of(self, label: str, op: str, size: int) -> dict[int, dict]:
        return {r["run"]: r for r in self.rows if r["label"] == label and r["op"] == op and r["block_size"] == size}

    def median(self, label: str, op: str, size: int) -> float | None:
        rs = self.runs_of(label, op, size)
        return statistics.median(r["gb_per_s"] for r in rs.values()) if rs else None

    def ratio(self, a: str, b: str, op: str, size: int) -> float | None:
        """Median over runs of a's rate / b's rate in the same run."""
        ra, rb = self.runs_of(a, op, size), self.runs_of(b, op, size)
        both = sorted(set(ra) & set(rb))
        return statistics.median(ra[i]["gb_per_s"] / rb[i]["gb_per_s"] for i in both) if both else None


def timed(chunks: list[list[str]], run: Callable[[list[str]], None], seconds: float) -> dict:
    """Calls `run` on each chunk of keys in turn, cyclically, for `seconds`;
    answers the blocks moved, the time taken and the median and 99th
    percentile of the calls' latencies."""
    started = time.perf_counter()
    end = started + seconds
    moved, lat, stop = 0, [], False
    while not stop:
        for c in chunks:
            t = time.perf_counter()
            run(c)
            now = time.perf_counter()
            lat.append(now - t)
            moved += len(c)
            if now >= end:
                stop = True
                break
    elapsed = time.perf_counter() - started
    # The 1st..99th percentiles; one call alone is every percentile.
    pct = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else lat * 99
    return {"blocks": moved, "seconds": elapsed, "p50_us": pct[49] * 1e6, "p99_us": pct[98] * 1e6}


def merge(barrier: str, target: str, op: str, size: str, batch: str, clients: str) -> dict:
    outs = [json.loads(open(f).read()) for f in sorted(glob.glob(barrier + "/out.*"))]
    blocks = sum(o["blocks"] for o in outs)
    seconds = max(o["seconds"] for o in outs)
    block = int(size)
    return {
        "target": target, "op": op, "block_size": block, "batch": int(batch), "clients": int(clients),
        "blocks": blocks, "bytes": blocks * block, "seconds": seconds, "gb_per_s": blocks * block / seconds / 1e9,
        "blocks_per_s": blocks / seconds, "p50_us": max(o["p50_us"] for o in outs),
        "p99_us": max(o["p99_us"] for o in outs), "misses": 0,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Merge one run's client results into one result line.")
    commands = parser.add_subparsers(dest="command", required=True)
    m = commands.add_parser("merge", help="sum BARRIER/out.* into one result line on stdout")
    m.add_argument("--barrier", required=True, help="the run's folder, holding out.* of each client")
    m.add_argument("--target", required=True)
    m.add_argument("--op", required=True, choices=["put", "get"])
    m.add_argument("--size", required=True, help="bytes per block")
    m.add_argument("--batch", required=True)
    m.add_argument("--clients", required=True)
    a = parser.parse_args()
    print(json.dumps(merge(a.barrier, a.target, a.op, a.size, a.batch, a.clients)))
