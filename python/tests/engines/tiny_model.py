"""Writes a small Llama checkpoint that vLLM's CPU build serves: a config, a
byte-level BPE tokenizer and random N(0, sigma) weights as safetensors.

Nothing is fetched from a model hub; the end-to-end test writes one into its
temporary folder. Why these choices:

- head_dim 64: vLLM's CPU attention backend needs head_dim >= 32 (the
  tiny-llama config beside this file has 16, fine for the scheduler-only
  tests, refused by a real CPU engine).
- Two KV heads of four query heads: grouped-query attention, as in the
  models the connector is meant for.
- Real random weights, not vLLM's `--load-format dummy`: dummy weights make
  every output nearly uniform, so a token comparison with them proves
  nothing (zeroing every loaded KV byte changed no token). With N(0, sigma)
  weights and sigma large enough the attention is sharp, and a changed
  block of KV changes the tokens that follow; the test checks that it does.
- The tokenizer is trained on a few lines (`tokenizers`), then filled up
  with added tokens to exactly the model's vocabulary, so that every token
  id the model can produce detokenizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN = 256
INTERMEDIATE = 512
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
VOCAB = 1024
MAX_POSITIONS = 4096
# The weights' standard deviation. Tried with test_vllm_e2e.py's altered
# block: at 0.001 (the scale of vLLM's dummy weights) it changed logprobs
# but no token, and the test failed; at 0.02 (the usual initialisation) and
# here it changed the tokens. 0.15 keeps a margin: attention this sharp
# lets the KV of earlier tokens decide the greedy tokens.
SIGMA = 0.15
SEED = 20

CORPUS = [
    "kvplane keeps the KV cache of a prompt so that the next engine need not compute it again.",
    "A block is sixteen or a hundred and twenty-eight tokens of keys and values, layer after layer.",
    "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.",
    "Engines ask the node which leading blocks of a prompt it holds, then read them into their cache.",
    "0123456789 +-*/=<>()[]{} ,.;:!? \"'` ~@#$%^&_|\\",
]


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    # A few lines give far fewer merges than VOCAB: the rest are added
    # tokens, so that every id below VOCAB is a token.
    missing = VOCAB - len(fast)
    if missing > 0:
        fast.add_tokens([f"<t{i}>" for i in range(missing)])
    assert len(fast) == VOCAB, (len(fast), VOCAB)
    fast.save_pretrained(str(directory))


def write_model(
    directory: Path,
    *,
    sigma: float = SIGMA,
    seed: int = SEED,
    hidden: int = HIDDEN,
    intermediate: int = INTERMEDIATE,
    layers: int = LAYERS,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    max_positions: int = MAX_POSITIONS,
) -> Path:
    """Writes the checkpoint into `directory` (made if missing) and answers it.

    The sizes default to the end-to-end test's model; scripts/bench-serving
    asks for a larger one (more layers, longer positions) whose long
    prefills take seconds. head_dim is hidden // heads."""
    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory)
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": VOCAB,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * sigma).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(VOCAB, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = normal(intermediate, hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(intermediate, hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden, intermediate)
        tensors[p + "input_layernorm.weight"] = ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = ones(hidden)
    tensors["model.norm.weight"] = ones(hidden)
    tensors["lm_head.weight"] = normal(VOCAB, hidden)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


if __name__ == "__main__":
    import sys

    print(write_model(Path(sys.argv[1])))
