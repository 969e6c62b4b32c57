# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``load_format="dummy"`` must not overwrite TurboQuant's centroids.

The centroids are the Lloyd-Max levels the KV cache is quantized to, computed
at layer construction; no checkpoint holds them. As a persistent buffer they
were part of ``state_dict()``, which ``initialize_dummy_weights`` fills with
uniform noise: a dummy-weight engine (benchmarks, memory and boot checks)
quantized its cache to 16 random levels and no longer ran the decode a real
checkpoint runs (the Gluon stage 1 needs symmetric levels). The buffer was
``get_centroids``' cached tensor itself, so the noise reached every later
layer and engine of the process too.
"""

import pytest
import torch

from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.model_executor.model_loader.weight_utils import initialize_dummy_weights
from vllm.utils.torch_utils import set_default_torch_dtype


@pytest.mark.parametrize("cache_dtype", ["turboquant_4bit_nc", "turboquant_k3v4_nc"])
def test_dummy_weights_keep_turboquant_centroids(cache_dtype):
    config = VllmConfig(cache_config=CacheConfig(cache_dtype=cache_dtype))
    # bf16: the TurboQuant backend (picked on CUDA) takes no fp32 models.
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        model = torch.nn.ModuleDict(
            {
                "attn": Attention(
                    num_heads=4,
                    head_size=128,
                    scale=128**-0.5,
                    num_kv_heads=2,
                    cache_config=config.cache_config,
                    prefix="model.layers.0.self_attn.attn",
                )
            }
        )
    bits = model["attn"]._tq_config.centroid_bits
    solved = get_centroids(128, bits).clone()
    levels = model["attn"]._tq_centroids.clone()
    assert torch.allclose(levels, solved, rtol=1e-3, atol=0)

    initialize_dummy_weights(model, config.model_config)

    assert torch.equal(model["attn"]._tq_centroids, levels), (
        "initialize_dummy_weights overwrote the TurboQuant centroids: they must "
        "stay out of the state dict (a non-persistent buffer)"
    )
    # The layer's buffer was get_centroids()'s cached tensor itself, so the
    # noise also reached every later layer and engine in the process.
    assert torch.equal(get_centroids(128, bits), solved)
    # Still a buffer, so model.to(device) moves it with the layer.
    assert "attn._tq_centroids" in dict(model.named_buffers())
