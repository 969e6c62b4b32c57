# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``recent:W`` gives a TurboQuant ``Attention`` a model-dtype sliding-window
twin (``turboquant.raw_window``), and the twin holds each token as the
layer's quantizer sees it, so the decode's query scores it in its own units.
"""

import pytest
import torch

from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.quantization.turboquant.raw_window import twin_kv
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backends.turboquant_attn import (
    TurboQuantAttentionImpl,
    _build_hadamard,
)

D = 128
NAME = "model.layers.3.self_attn.attn"


def _layer(cache_dtype: str, *skip: str) -> tuple[Attention, VllmConfig]:
    config = VllmConfig(
        cache_config=CacheConfig(
            cache_dtype=cache_dtype, kv_cache_dtype_skip_layers=list(skip)
        )
    )
    # set_default_torch_dtype does not restore the dtype when the body raises.
    default = torch.get_default_dtype()
    try:
        with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
            layer = Attention(
                num_heads=4,
                head_size=D,
                scale=D**-0.5,
                num_kv_heads=2,
                cache_config=config.cache_config,
                prefix=NAME,
            )
    finally:
        torch.set_default_dtype(default)
    return layer, config


def test_a_turboquant_layer_gets_its_twin():
    layer, config = _layer("turboquant_3bit_nc", "recent:16")
    twin = layer.raw_window
    assert isinstance(twin, Attention)
    assert (twin.sliding_window, twin.kv_cache_dtype) == (16, "auto")
    assert twin.recent_tokens == 16
    assert twin.layer_name == f"{NAME}.raw_window"
    forward_context = config.compilation_config.static_forward_context
    assert forward_context[twin.layer_name] is twin
    # A child module: moved with the model and reached by its walks.
    assert dict(layer.named_modules())["raw_window"] is twin


@pytest.mark.parametrize(
    "cache_dtype, skip", [("turboquant_3bit_nc", ()), ("turboquant_4bit_nc", ("3",))]
)
def test_no_entry_or_a_bf16_layer_gets_none(cache_dtype, skip):
    layer, _ = _layer(cache_dtype, *skip)
    assert not hasattr(layer, "raw_window")


def test_without_turboquant_the_entry_is_refused():
    with pytest.raises(ValueError, match="recent:16 keeps a TurboQuant layer's"):
        _layer("auto", "recent:16")


@pytest.mark.parametrize("rotated", [False, True])
def test_the_twin_scores_as_the_decode_does(rotated):
    """Rotated query ``(q * s) H`` against the twin's key: ``q . (k - mu)``,
    the score every shifted packed key carries; values rotated back by
    ``H`` give the values."""
    g = torch.Generator().manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        impl = TurboQuantAttentionImpl(
            4, D, D**-0.5, 2, kv_cache_dtype="turboquant_3bit_nc"
        )
    impl._tq_rotates_values = rotated
    layer = torch.nn.Module()
    H = torch.ones(1, 1)
    while H.shape[0] < D:  # Sylvester's construction, scaled: what the backend uses
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)])
    H = H / D**0.5
    torch.testing.assert_close(H, _build_hadamard(D, "cpu").float(), atol=4e-3, rtol=0)
    layer._tq_PiT = H
    layer._tq_key_offset = torch.randn(2, D, generator=g)
    layer._tq_key_scale = torch.rand(D, generator=g) + 0.5
    key = torch.randn(5, 2, D, generator=g)
    value = torch.randn(5, 2, D, generator=g)
    q = torch.randn(2, D, generator=g)
    k_t, v_t = twin_kv(impl, layer, key, value)
    q_in = (q * layer._tq_key_scale) @ H
    scores = torch.einsum("hd,nhd->nh", q_in, k_t)
    expect = torch.einsum("hd,nhd->nh", q, key - layer._tq_key_offset)
    torch.testing.assert_close(scores, expect, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v_t @ H if rotated else v_t, value, rtol=1e-5, atol=1e-5)
