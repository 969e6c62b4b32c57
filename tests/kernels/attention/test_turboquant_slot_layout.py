# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kernels' slot offsets agree with the sizes the cache is allocated by."""

import pytest
import torch

from vllm.model_executor.layers.quantization.turboquant.config import (
    TurboQuantConfig,
)
from vllm.v1.attention.ops.turboquant_slot_layout import (
    config_slot_layout,
    slot_layout,
    words_aligned,
)

PRESETS = [
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
]


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256, 512])
@pytest.mark.parametrize("preset", PRESETS)
def test_layout_matches_the_config_that_sizes_the_cache(preset, head_dim):
    cfg = TurboQuantConfig.from_cache_dtype(preset, head_dim)
    layout = config_slot_layout(cfg)
    assert layout.key_bytes == cfg.key_packed_size
    assert layout.value_bytes == cfg.value_packed_size
    assert layout.slot_bytes == cfg.slot_size
    # The backend's own offsets, which 0.20.2's kernels read by.
    if not cfg.key_fp8:
        assert layout.key_index_bytes == -(-head_dim * cfg.key_mse_bits // 8)
    assert layout.value_index_bytes == -(-head_dim * cfg.value_quant_bits // 8)
    # The launchers' arguments name the same layout: the config's mse_bits is
    # the value bits for FP8 keys, and is then not read.
    same = slot_layout(
        head_dim, cfg.key_fp8, cfg.mse_bits, cfg.effective_value_quant_bits
    )
    assert same == layout


def test_odd_strides_are_read_as_bytes():
    # Slot fields start at even offsets; a page padded to an odd size does not.
    cache = torch.zeros(4, 16, 2, 134, dtype=torch.uint8)
    assert words_aligned(cache)
    assert not words_aligned(cache, 4)
    padded = torch.zeros(4 * (16 * 2 * 134 + 1), dtype=torch.uint8)
    odd = padded.as_strided((4, 16, 2, 134), (16 * 2 * 134 + 1, 2 * 134, 134, 1))
    assert not words_aligned(odd)


@pytest.mark.parametrize("preset", PRESETS)
def test_the_store_refuses_a_cache_of_another_preset(preset):
    """A layer's store checks that the cache's slots are its preset's: a
    cache shaped for another preset (a model whose layers store different
    presets) would otherwise be written at the wrong slot width."""
    from vllm.v1.attention.ops.triton_turboquant_store_fused import turboquant_store

    cfg = TurboQuantConfig.from_cache_dtype(preset, 128)
    other = "turboquant_3bit_nc" if preset != "turboquant_3bit_nc" else PRESETS[0]
    wrong = TurboQuantConfig.from_cache_dtype(other, 128).slot_size_aligned
    key = torch.zeros(1, 2, 128)
    cache = torch.zeros(4, 16, 2, wrong, dtype=torch.uint8)
    with pytest.raises(
        ValueError,
        match=rf"slots are {wrong} bytes.*stores {cfg.slot_size_aligned}-byte slots",
    ):
        turboquant_store(
            key,
            key,
            cache,
            torch.zeros(1, dtype=torch.long),
            torch.eye(128),
            torch.zeros(15),
            mse_bits=cfg.mse_bits,
            key_packed_size=cfg.key_packed_size,
            value_quant_bits=cfg.effective_value_quant_bits,
            key_fp8=cfg.key_fp8,
        )
