# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""After the weights load, TurboQuant layers with MSE keys under a per-head
``k_norm`` hold their key scale (``turboquant.key_scale``).

The loader's ``process_weights_after_loading`` gives the scale to the
block's ``attn`` layer from the block's ``k_norm`` and ``rotary_emb``, as
vLLM's Gemma 3/4, Qwen3 and Qwen3-Next blocks are built. Blocks without
``k_norm`` (Llama), FP8 keys (k8v4) and non-TurboQuant layers get none.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.quantization.turboquant.key_scale import (
    bind_key_scales,
    key_channel_scale,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionImpl

D = 128
# What process_weights_after_loading reads of the ModelConfig.
MODEL_CONFIG = SimpleNamespace(dtype=torch.bfloat16, quantization=None)
WEIGHT = torch.linspace(-1.0, 29.0, D, dtype=torch.float32)


def _model(cache_dtype: str) -> torch.nn.Module:
    config = VllmConfig(cache_config=CacheConfig(cache_dtype=cache_dtype))
    # bf16: the TurboQuant backend (picked on CUDA) takes no fp32 models.
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        model = torch.nn.ModuleDict()
        for i, with_norm in enumerate((True, False)):
            block = torch.nn.Module()
            if with_norm:
                block.k_norm = GemmaRMSNorm(D)
                block.k_norm.weight.data = WEIGHT.clone()
            block.rotary_emb = get_rope(D, max_position=64, is_neox_style=True)
            block.attn = Attention(
                num_heads=4,
                head_size=D,
                scale=D**-0.5,
                num_kv_heads=2,
                cache_config=config.cache_config,
                prefix=f"model.layers.{i}.self_attn.attn",
            )
            if cache_dtype.startswith("turboquant"):
                # The backend CUDA picks; the CPU platform picks its own.
                block.attn.impl = TurboQuantAttentionImpl(
                    4, D, D**-0.5, 2, kv_cache_dtype=cache_dtype
                )
            model[str(i)] = block
    return model


def test_mse_layers_under_k_norm_take_its_scale():
    model = _model("turboquant_4bit_nc")
    process_weights_after_loading(model, MODEL_CONFIG, torch.device("cpu"))
    expected = key_channel_scale(WEIGHT + 1.0, D, is_neox_style=True)
    torch.testing.assert_close(model["0"].attn._tq_key_scale, expected)
    assert not hasattr(model["1"].attn, "_tq_key_scale")


@pytest.mark.parametrize("cache_dtype", ["turboquant_k8v4", "auto"])
def test_other_layers_take_none(cache_dtype):
    model = _model(cache_dtype)
    process_weights_after_loading(model, MODEL_CONFIG, torch.device("cpu"))
    assert not hasattr(model["0"].attn, "_tq_key_scale")


def test_the_scale_goes_where_the_layer_runs():
    """With weights offloaded to the CPU the norm's weight is not where the
    cache is; the scale is placed on the loader's target device."""
    model = _model("turboquant_4bit_nc")
    assert bind_key_scales(model, torch.device("meta")) == 1
    assert model["0"].attn._tq_key_scale.device.type == "meta"
