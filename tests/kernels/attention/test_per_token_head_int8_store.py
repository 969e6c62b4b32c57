# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``int8_per_token_head``'s store rounds each element to the nearest step.

The per-token-head store scales a (token, head) vector by its absmax / 127
and writes it to an int8 cache. A float stored to an integer pointer is
truncated toward zero, so vLLM 0.20.2 wrote every element up to a whole step
short of its value: twice the error of rounding, and every vector shrunk.
Runs under the Triton CPU interpreter in CI (``HYBRIDKV_TRITON_INTERPRET=1``)
and natively on a GPU.
"""

import pytest
import torch

from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
    triton_reshape_and_cache_flash_per_token_head_quant,
)

# Small shapes: the interpreter runs one program per (token, head).
NUM_TOKENS, NUM_KV_HEADS, BLOCK_SIZE, NUM_BLOCKS = 12, 2, 16, 2


def _store(key, value, device):
    head_size = key.shape[-1]
    key_cache = torch.zeros(
        NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_size, dtype=torch.int8, device=device
    )
    value_cache = torch.zeros_like(key_cache)
    k_scales = torch.zeros(
        NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, dtype=torch.float32, device=device
    )
    v_scales = torch.zeros_like(k_scales)
    # Slots spread over both blocks, not in token order.
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:NUM_TOKENS].to(device)
    triton_reshape_and_cache_flash_per_token_head_quant(
        key, value, key_cache, value_cache, k_scales, v_scales, slots
    )
    blk, off = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    return (
        (key_cache[blk, off], k_scales[blk, off]),
        (value_cache[blk, off], v_scales[blk, off]),
    )


@pytest.mark.parametrize("head_size", [64, 256])
def test_int8_store_rounds_to_nearest(head_size, triton_device):
    torch.manual_seed(0)
    # Channels of unequal spread, as real keys have.
    spread = torch.logspace(-1, 1, head_size)
    key = torch.randn(NUM_TOKENS, NUM_KV_HEADS, head_size) * spread
    value = torch.randn(NUM_TOKENS, NUM_KV_HEADS, head_size)
    stored = _store(key.to(triton_device), value.to(triton_device), triton_device)
    for x, (q, scale) in zip((key, value), stored):
        q, scale = q.cpu(), scale.cpu()
        want_scale = x.abs().amax(-1) / 127
        torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
        scaled = x / scale[..., None]
        # Ties are measure-zero for random data; the absmax element is 127.
        miss = (q.float() - scaled.round()).abs()
        assert miss.max() == 0, (
            f"{int((miss > 0).sum())} of {miss.numel()} elements stored a step "
            f"off the nearest; mean shift toward zero "
            f"{float((scaled.abs() - q.float().abs()).mean()):.3f} steps"
        )
        err = (q.float() * scale[..., None] - x).abs()
        assert (err <= scale[..., None] / 2 * (1 + 1e-5)).all()


def test_int8_store_keeps_vectors_unshrunk(triton_device):
    """Truncation's bias: every element moves toward zero, so the stored
    vectors are shorter; rounded, their lengths match the input's."""
    torch.manual_seed(1)
    key = torch.randn(NUM_TOKENS, NUM_KV_HEADS, 128)
    (q, scale), _ = _store(key.to(triton_device), key.to(triton_device), triton_device)
    stored = q.cpu().float() * scale.cpu()[..., None]
    ratio = stored.norm(dim=-1) / key.norm(dim=-1)
    assert (ratio - 1).abs().max() < 2e-3, ratio
