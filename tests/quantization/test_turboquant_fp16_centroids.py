# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant layers quantize to Lloyd-Max centroids that are fp16 values.

The decode's Gluon stage 1 reads centroids through fp16 tensor-core dots:
exact in one dot for fp16 values, in two (an fp16 head and tail) for the
solver's float32 ones. 0.20.2's layers hold the float32 ones; so every
MSE-key decode step paid the second lookup and dot (~11 % of its
instructions).
"""

import pytest
import torch

from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.utils.torch_utils import set_default_torch_dtype

MSE_PRESETS = ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]


def _layer(cache_dtype: str, head_size: int) -> Attention:
    config = VllmConfig(cache_config=CacheConfig(cache_dtype=cache_dtype))
    # bf16: the TurboQuant backend (picked on CUDA) takes no fp32 models.
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        return Attention(
            num_heads=4,
            head_size=head_size,
            scale=head_size**-0.5,
            num_kv_heads=2,
            cache_config=config.cache_config,
            prefix="model.layers.0.self_attn.attn",
        )


@pytest.mark.parametrize("head_size", [128, 256, 512])
@pytest.mark.parametrize("cache_dtype", MSE_PRESETS)
def test_layer_centroids_are_fp16_values(cache_dtype, head_size):
    layer = _layer(cache_dtype, head_size)
    levels = layer._tq_centroids
    assert levels.dtype == torch.float32
    assert torch.equal(levels.half().float(), levels), (
        f"{cache_dtype} layer centroids are not fp16 values (largest rounding "
        f"error {(levels.half().float() - levels).abs().max().item():.3g}): the "
        "decode needs a second fp16 dot per key chunk to be exact in them"
    )
    assert torch.equal(levels, -levels.flip(0))  # still symmetric
    gluon = pytest.importorskip("vllm.v1.attention.ops.gluon_turboquant_decode")
    assert gluon.key_table(levels) is not None
    assert gluon.key_tails(levels) is False


@pytest.mark.parametrize("head_dim", [128, 256, 512])
@pytest.mark.parametrize("bits", [3, 4])
def test_rounding_leaves_the_quantizer_as_good(head_dim, bits):
    """At most 4.1e-4 of each centroid; the mean squared error of quantizing
    N(0, 1/d) coordinates to the nearest one changes by under 1e-4 of itself
    (sampling noise included; 4 bits: ~0.0095 / d)."""
    from vllm.model_executor.layers.quantization.turboquant.fp16_centroids import (
        fp16_centroids,
    )

    solved = get_centroids(head_dim, bits).double()
    rounded = fp16_centroids(head_dim, bits).double()
    assert ((rounded - solved).abs() / solved.abs()).max() <= 4.1e-4
    assert get_centroids(head_dim, bits).dtype == torch.float32  # untouched
    g = torch.Generator().manual_seed(head_dim + bits)
    x = torch.randn(1 << 18, generator=g, dtype=torch.float64) / head_dim**0.5

    def mse(c):
        nearest = torch.bucketize(x, (c[:-1] + c[1:]) / 2)
        return ((x - c[nearest]) ** 2).mean().item()

    before, after = mse(solved), mse(rounded)
    assert abs(after - before) <= 1e-4 * before
