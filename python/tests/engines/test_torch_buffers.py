"""torch CPU tensors as the package's buffers (torch is in the engines'
environment): an engine's KV cache tensor, sliced per block, is written from
and read into in place, through `t.view(torch.uint8).numpy()` (a view of the
tensor's own memory, no copy), and the checks hold for tensors too."""

from __future__ import annotations

import pytest
import torch

import kvplane
from conftest import Node


def test_blocks_move_from_and_into_a_kv_cache_tensor_in_place(node: Node) -> None:
    # (blocks, K/V, block size, kv heads, head size), as vLLM lays a layer out.
    cache = torch.rand((8, 2, 16, 2, 16), dtype=torch.float16)
    keys = [f"torch/{i}" for i in range(8)]
    with kvplane.Client(node.endpoint) as kv:
        kv.put_from(keys, [cache[i].view(torch.uint8).numpy() for i in range(8)])
        back = torch.zeros_like(cache)
        views = [back[i].view(torch.uint8).numpy() for i in range(8)]
        assert views[0].ctypes.data == back[0].data_ptr(), "the numpy view is the tensor's own memory"
        assert kv.get_into(keys, views) == [cache[0].numel() * 2] * 8
        assert torch.equal(back, cache)


def test_a_strided_tensor_view_is_refused_before_any_io(node: Node) -> None:
    cache = torch.zeros((4, 64), dtype=torch.uint8)
    with kvplane.Client(node.endpoint) as kv:
        kv.put_from(["torch/strided"], [bytes(32)])
        with pytest.raises(kvplane.NonContiguousBuffer):
            kv.get_into(["torch/strided"], [cache[:, 0].numpy()])
        assert int(cache.sum()) == 0
