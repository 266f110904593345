"""One vLLM engine (the offline `vllm.LLM` API) in a process of its own, for
the end-to-end test: started by test_vllm_e2e.py, driven by JSON lines on
stdin, answering JSON lines on the file descriptor named by
$KVPLANE_E2E_REPLY_FD (stdout and stderr are vLLM's log).

    python vllm_engine.py MODEL_DIR KV_TRANSFER_CONFIG_JSON

Requests, one JSON object a line:

- ``{"op": "generate", "prompts": [[token ids], ...], "max_tokens": N}``:
  greedy generation, answered ``{"outputs": [{"tokens", "logprobs",
  "cached"}, ...]}``: the sampled tokens, each step's top logprobs as
  ``[[token, logprob], ...]`` (floats round-trip exactly through JSON), and
  how many prompt tokens the engine did not compute (its own prefix cache
  plus what the KV connector loaded).
- ``{"op": "keys", "prompts": [...]}``: the kvplane keys of each prompt's
  full blocks, as the connector names them (vLLM's block hashes, computed
  by vLLM's own functions with this engine's configuration).
- ``{"op": "reset"}``: vLLM's ``reset_prefix_cache()``, so that the next
  generate finds nothing locally and must load from kvplane again.
- ``{"op": "quit"}``: shuts the engine down and exits.

The first line written is ``{"ready": ..., "start_s": ..., "block_size": ...}``
once the engine serves. A separate process per engine because a fresh
engine must know nothing of the last one, and vLLM's engine (its worker
process, OpenMP threads, signal handlers) is not something to host inside
pytest.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    model, transfer = sys.argv[1], json.loads(sys.argv[2])
    reply = os.fdopen(int(os.environ["KVPLANE_E2E_REPLY_FD"]), "w", buffering=1)
    started = time.monotonic()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        tokenizer=model,
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=4,
        seed=0,
        enable_prefix_caching=True,
        # No graph capture or compilation: the model is tiny, and a start
        # that compiles takes a minute more on 2 cores.
        enforce_eager=True,
        kv_transfer_config=KVTransferConfig(**transfer),
    )
    config = llm.llm_engine.vllm_config
    block_size = config.cache_config.block_size
    reply.write(json.dumps({"ready": True, "start_s": time.monotonic() - started, "block_size": block_size}) + "\n")

    def keys(prompts: list[list[int]]) -> list[list[str]]:
        from vllm.sampling_params import SamplingParams as SP
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        from kvplane.vllm_connector import _key_prefix

        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(block_size, hash_fn)
        name = config.model_config.served_model_name or config.model_config.model
        if isinstance(name, list):
            name = name[0]
        namespace = (transfer.get("kv_connector_extra_config") or {}).get("namespace", "")
        prefix = _key_prefix(namespace, str(name), (0, 1), (0, 1), 0)
        out = []
        for i, tokens in enumerate(prompts):
            request = Request(
                request_id=f"keys-{i}",
                prompt_token_ids=tokens,
                sampling_params=SP(max_tokens=1),
                pooling_params=None,
                block_hasher=hasher,
            )
            out.append([prefix + bytes(h).hex() for h in request.block_hashes])
        return out

    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "generate":
            params = SamplingParams(
                temperature=0.0, max_tokens=request["max_tokens"], logprobs=2, ignore_eos=True, detokenize=False
            )
            results = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], params, use_tqdm=False
            )
            outputs = []
            for result in results:
                completion = result.outputs[0]
                outputs.append(
                    {
                        "tokens": list(completion.token_ids),
                        "logprobs": [
                            sorted([t, lp.logprob] for t, lp in step.items()) for step in completion.logprobs or []
                        ],
                        "cached": result.num_cached_tokens or 0,
                    }
                )
            reply.write(json.dumps({"outputs": outputs}) + "\n")
        elif op == "keys":
            reply.write(json.dumps({"keys": keys(request["prompts"])}) + "\n")
        elif op == "reset":
            reply.write(json.dumps({"reset": bool(llm.reset_prefix_cache())}) + "\n")
        elif op == "quit":
            break
        else:
            reply.write(json.dumps({"error": f"unknown op {op!r}"}) + "\n")
    del llm
    reply.write(json.dumps({"bye": True}) + "\n")


if __name__ == "__main__":
    main()
