# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The TurboQuant store kernel writes into a padded (strided) KV cache.

When hybrid page sizes are unified by padding, a TurboQuant layer's cache is a
strided view: block ``i`` starts at ``i * page`` bytes and the tail of each
page is padding. Pristine 0.20.2 passes ``kv_cache.view(-1)`` to the kernel,
which raises on such a view. Runs under the Triton CPU interpreter in CI
(``HYBRIDKV_TRITON_INTERPRET=1``) and natively on a GPU.
"""

import pytest
import torch

from tests.kernels.attention.turboquant_store_args import store_kwargs
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

# Small shapes: the interpreter runs one program per (token, head).
HEAD_DIM, NUM_KV_HEADS, BLOCK_SIZE, NUM_BLOCKS, NUM_TOKENS = 64, 2, 16, 3, 20
SENTINEL = 0xA5


def _caches(slot: int, device: str, pad_bytes: int):
    real = BLOCK_SIZE * NUM_KV_HEADS * slot
    page = real + pad_bytes
    flat = torch.full((NUM_BLOCKS * page,), SENTINEL, dtype=torch.uint8, device=device)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, slot)
    padded = torch.as_strided(flat, shape, (page, NUM_KV_HEADS * slot, slot, 1))
    contiguous = torch.full(shape, SENTINEL, dtype=torch.uint8, device=device)
    return flat, padded, contiguous, real, page


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
def test_store_into_padded_cache_matches_contiguous(preset, triton_device):
    torch.manual_seed(0)
    cfg = TurboQuantConfig.from_cache_dtype(preset, HEAD_DIM)
    device = triton_device
    key = torch.randn(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM, device=device)
    value = torch.randn(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM, device=device)
    # Spread the tokens over all blocks, leaving some slots empty.
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device=device)[:NUM_TOKENS].to(
        torch.int32
    )
    pit = torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM))[0].to(device)
    centroids, _ = get_centroids(HEAD_DIM, cfg.key_mse_bits).float().sort()
    midpoints = ((centroids[:-1] + centroids[1:]) / 2).to(device)

    flat, padded, contiguous, real, page = _caches(
        cfg.slot_size_aligned, device, pad_bytes=96
    )
    for cache in (padded, contiguous):
        triton_turboquant_store(
            key,
            value,
            cache,
            slots,
            pit,
            midpoints,
            **store_kwargs(cfg),
        )
    assert torch.equal(padded, contiguous)
    assert (contiguous != SENTINEL).any()
    pages = flat.view(NUM_BLOCKS, page)
    assert (pages[:, real:] == SENTINEL).all(), "the store wrote into a page's padding"
