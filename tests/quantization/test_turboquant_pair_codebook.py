# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``turboquant_3bit_pair_nc``: 3bit_nc's bytes, keys coded by pairs.

Its layers hold the pair code's 64 points as their codebook, the store
compares pairs of rotated coordinates with them, and the planner counts the
bytes of ``turboquant_3bit_nc``. The points code pairs of Gaussian
coordinates with less error than the 3-bit levels code each one, and are the
centres of the pairs they code (Lloyd's condition). A layer the one-launch
store and the split-KV decode do not serve is refused: 0.20.2's kernels would
read each pair's fields as levels.
"""

import math

import pytest
import torch

from tests.quantization.test_turboquant_fp16_centroids import _layer
from tests.v1.core.test_kv_cache_capacity import QWEN36, models, plan  # noqa: F401
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
from vllm.model_executor.layers.quantization.turboquant.key_codebook import (
    store_codebook,
)
from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionImpl
from vllm.v1.attention.ops.turboquant_pair_code import (
    pair_codebook,
    pair_search_table,
)

PRESET = "turboquant_3bit_pair_nc"


def _nearest(x: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    return torch.cat(
        [((c[:, None] - points) ** 2).sum(-1).argmin(1) for c in x.split(1 << 14)]
    )


def test_the_points_code_gaussian_pairs_better_than_the_levels():
    d = 128
    x = torch.randn(200_000, 2, generator=torch.Generator().manual_seed(1))
    x = x.double() / math.sqrt(d)
    points = pair_codebook(d).double()
    near = _nearest(x, points)
    pair_mse = (x - points[near]).pow(2).mean().item() * d
    levels = get_centroids(d, 3).double().sort().values
    scalar = levels[torch.bucketize(x, (levels[:-1] + levels[1:]) / 2)]
    scalar_mse = (x - scalar).pow(2).mean().item() * d
    # 0.0297 and 0.0344 of a coordinate's variance on 10**6 pairs.
    assert pair_mse < 0.88 * scalar_mse, (pair_mse, scalar_mse)
    # Lloyd's condition: each point is the mean of the pairs it codes (within
    # a tenth of a coordinate's deviation: the fewest pairs fall in outer cells).
    counts = torch.bincount(near, minlength=64)
    assert (counts > 500).all()
    means = torch.zeros_like(points).index_add_(0, near, x) / counts[:, None]
    assert (means - points).norm(dim=1).max().item() * math.sqrt(d) < 0.1


@pytest.mark.parametrize("head_size", [64, 128, 256, 512])
def test_the_points_are_fp16_values_scaled_to_the_head(head_size):
    points = pair_codebook(head_size)
    assert points.shape == (64, 2) and points.dtype == torch.float32
    assert torch.equal(points.half().float(), points)
    assert len(set(map(tuple, points.tolist()))) == 64
    unit = pair_codebook(1)
    torch.testing.assert_close(points * math.sqrt(head_size), unit, rtol=1e-3, atol=0)


@pytest.mark.parametrize("head_size", [64, 128, 256, 512])
def test_the_preset_has_the_bytes_of_3bit_nc(head_size):
    pairs = TurboQuantConfig.from_cache_dtype(PRESET, head_size)
    scalar = TurboQuantConfig.from_cache_dtype("turboquant_3bit_nc", head_size)
    assert pairs.key_pairs and not scalar.key_pairs
    # What vLLM's own test_turboquant.py expects of 3bit_nc (its table lists
    # 0.20.2's presets only, so those cases of this preset are deselected).
    for field in (
        "key_fp8",
        "key_quant_bits",
        "key_mse_bits",
        "value_quant_bits",
        "mse_bits",
        "centroid_bits",
        "norm_correction",
        "key_packed_size",
        "value_packed_size",
        "slot_size",
        "slot_size_aligned",
    ):
        assert getattr(pairs, field) == getattr(scalar, field), field


def test_the_planner_counts_3bit_nc_s_tokens(models):  # noqa: F811
    pairs = plan(models["Qwen3.6-27B"], kv_cache_dtype=PRESET, **QWEN36)
    scalar = plan(models["Qwen3.6-27B"], kv_cache_dtype="turboquant_3bit_nc", **QWEN36)
    assert pairs.error is None, pairs.error
    assert pairs.layer_dtypes == {PRESET: 16}
    assert pairs.kv_tokens == scalar.kv_tokens


def test_a_layer_holds_its_preset_s_codebook():
    layer = _layer(PRESET, 128)
    assert torch.equal(layer._tq_centroids, pair_codebook(128))
    assert "attn._tq_centroids" not in layer.state_dict()
    assert torch.equal(
        store_codebook(layer._tq_centroids), pair_search_table(pair_codebook(128))
    )
    levels = _layer("turboquant_3bit_nc", 128)._tq_centroids
    assert levels.shape == (8,)
    assert torch.equal(store_codebook(levels), (levels[:-1] + levels[1:]) / 2)


@pytest.mark.parametrize(
    "head_size, num_heads, legacy", [(96, 4, False), (128, 20, False), (128, 4, True)]
)
def test_a_layer_the_kernels_do_not_serve_is_refused(
    head_size, num_heads, legacy, monkeypatch
):
    if legacy:
        monkeypatch.setenv("VLLM_TURBOQUANT_DECODE", "legacy")
    with (
        set_current_vllm_config(VllmConfig()),
        pytest.raises(ValueError, match="codes keys by pairs.*turboquant_3bit_nc"),
    ):
        TurboQuantAttentionImpl(num_heads, head_size, 1.0, 2, kv_cache_dtype=PRESET)
    with set_current_vllm_config(VllmConfig()):
        TurboQuantAttentionImpl(
            num_heads, head_size, 1.0, 2, kv_cache_dtype="turboquant_3bit_nc"
        )
