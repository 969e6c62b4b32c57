# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""After the weights load, TurboQuant layers with 3- or 4-bit MSE keys hold a
zero key offset (``turboquant.key_offset``) for the engine's calibration to
fill.

Any such layer takes one, with or without ``k_norm``; FP8 keys,
non-TurboQuant layers and an engine that runs 0.20.2's decode
(``VLLM_TURBOQUANT_DECODE=legacy``, which cannot read the mark) get none.
"""

import pytest
import torch

from tests.model_executor.model_loader.test_turboquant_key_scale_binding import (
    MODEL_CONFIG,
    _model,
)
from vllm.model_executor.layers.quantization.turboquant.key_offset import (
    layer_key_offset,
)
from vllm.model_executor.model_loader.utils import process_weights_after_loading


@pytest.mark.parametrize(
    "preset", ["turboquant_3bit_nc", "turboquant_k3v4_nc", "turboquant_4bit_nc"]
)
def test_mse_layers_take_a_zero_offset(preset):
    model = _model(preset)
    process_weights_after_loading(model, MODEL_CONFIG, torch.device("cpu"))
    for block in ("0", "1"):
        offset = layer_key_offset(model[block].attn)
        assert offset is not None and offset.shape == (2, 128)
        assert offset.dtype == torch.float32 and not offset.any()


@pytest.mark.parametrize("cache_dtype", ["turboquant_k8v4", "auto"])
def test_other_layers_take_none(cache_dtype):
    model = _model(cache_dtype)
    process_weights_after_loading(model, MODEL_CONFIG, torch.device("cpu"))
    assert layer_key_offset(model["0"].attn) is None


@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "turboquant_4bit_nc"])
def test_the_legacy_decode_takes_none(preset, monkeypatch):
    monkeypatch.setenv("VLLM_TURBOQUANT_DECODE", "legacy")
    model = _model(preset)
    process_weights_after_loading(model, MODEL_CONFIG, torch.device("cpu"))
    assert layer_key_offset(model["0"].attn) is None


def test_loading_again_zeroes_the_offset_in_place():
    """A weight reload binds again: CUDA graphs captured the tensor, so it
    is zeroed where it is, not replaced by a new one."""
    model = _model("turboquant_3bit_nc")
    process_weights_after_loading(model, MODEL_CONFIG, torch.device("cpu"))
    offset = layer_key_offset(model["0"].attn)
    offset.fill_(3.0)  # as the calibration leaves it
    process_weights_after_loading(model, MODEL_CONFIG, torch.device("cpu"))
    assert layer_key_offset(model["0"].attn) is offset and not offset.any()
