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


def test_the_v2_runner_shapes_each_layer_from_its_own_preset():
    """``VLLM_USE_V2_MODEL_RUNNER=1``'s ``init_kv_cache`` took the run's KV
    dtype for every layer, as the V1 runner did before release 44."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.worker.gpu.attn_utils import init_kv_cache

    presets = {
        "model.layers.0.self_attn.attn": "turboquant_3bit_nc",
        "model.layers.1.self_attn.attn": "turboquant_4bit_nc",
    }
    specs = {name: _spec(p) for name, p in presets.items()}
    config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[
            KVCacheTensor(size=4 * spec.page_size_bytes, shared_by=[name])
            for name, spec in specs.items()
        ],
        kv_cache_groups=[
            KVCacheGroupSpec([name], spec) for name, spec in specs.items()
        ],
    )
    layers = {
        name: SimpleNamespace(kv_cache_dtype=preset) for name, preset in presets.items()
    }
    with set_current_vllm_config(VllmConfig()):
        caches = init_kv_cache(
            [],
            layers,
            config,
            dict.fromkeys(presets, TurboQuantAttentionBackend),
            torch.device("cpu"),
            "turboquant_3bit_nc",
        )
    for name, preset in presets.items():
        want = TurboQuantConfig.from_cache_dtype(preset, 128).slot_size_aligned
        assert caches[name].shape == (4, 16, 2, want), name
