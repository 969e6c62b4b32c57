# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The runner shapes each TurboQuant layer's cache from the layer's own KV
dtype (``Attention.kv_cache_dtype``), not the run's: a layer that stores
another preset (``--kv-cache-dtype-skip-layers 19=turboquant_4bit_nc``) has
slots of another width. Release 43 shaped every layer with the run's slot:
an unpadded cache failed to view, a padded one was silently read with the
wrong slot width."""

import pytest
import torch

from tests.v1.worker.test_kv_cache_padded_pages import _layout_runner
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.quantization.turboquant.config import (
    TurboQuantConfig,
)
from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend
from vllm.v1.kv_cache_interface import TQFullAttentionSpec

pytestmark = pytest.mark.cpu_test


def _spec(preset, page=None):
    return TQFullAttentionSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=128,
        head_size_v=128,
        dtype=torch.uint8,
        tq_slot_size=TurboQuantConfig.from_cache_dtype(preset, 128).slot_size_aligned,
        page_size_padded=page,
    )


@pytest.mark.parametrize("padded", [False, True])
def test_each_layer_is_shaped_from_its_own_preset(padded):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    presets = {"l3": "turboquant_3bit_nc", "l4": "turboquant_4bit_nc"}
    page = _spec("turboquant_4bit_nc").page_size_bytes + 64 if padded else None
    specs = {name: _spec(p, page) for name, p in presets.items()}
    runner = _layout_runner(
        [(name, spec, TurboQuantAttentionBackend) for name, spec in specs.items()],
        layer_dtypes=presets,
    )
    runner.cache_config.cache_dtype = "turboquant_3bit_nc"
    raw = {
        name: torch.zeros(4 * spec.page_size_bytes, dtype=torch.int8)
        for name, spec in specs.items()
    }
    with set_current_vllm_config(VllmConfig()):
        caches = GPUModelRunner._reshape_kv_cache_tensors(runner, raw, [16, 16])
    for name, preset in presets.items():
        want = TurboQuantConfig.from_cache_dtype(preset, 128).slot_size_aligned
        assert caches[name].shape == (4, 16, 2, want), name
