# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The codebook a TurboQuant layer codes its MSE keys with.

Every MSE preset of vLLM 0.20.2 codes each rotated coordinate of a unit key
as the nearest of ``2**bits`` Lloyd-Max levels (``fp16_centroids``).
``turboquant_3bit_pair_nc`` codes each pair of neighbouring coordinates as
the nearest of 64 points of the plane (``turboquant_pair_code``) in the
bytes of ``turboquant_3bit_nc``: the same slot, norm and values, 13.8 % less
mean squared error on Gaussian coordinates.

A layer keeps its codebook as its ``_tq_centroids`` buffer, which the
decodes and the continuations' read-back take as they are; the store takes
``store_codebook`` of it. The kernels tell a pair codebook by its shape, so
no other argument changes between the two codes.
"""

import torch

from vllm.model_executor.layers.quantization.turboquant.fp16_centroids import (
    fp16_centroids,
)
from vllm.model_executor.layers.quantization.turboquant.key_offset import (
    fused_kernels_serve,
)
from vllm.v1.attention.ops.turboquant_pair_code import (
    is_pair_codebook,
    pair_codebook,
    pair_search_table,
)


def key_codebook(cfg, head_dim: int) -> torch.Tensor:
    """The codebook of a ``TurboQuantConfig``'s keys at ``head_dim``: the
    pair code's [64, 2] points where it codes keys by pairs, else the
    levels (FP8-key presets keep levels too: 0.20.2's kernels take them)."""
    if cfg.key_pairs:
        return pair_codebook(head_dim)
    return fp16_centroids(head_dim, cfg.centroid_bits)


def store_codebook(codebook: torch.Tensor) -> torch.Tensor:
    """What the store compares rotated coordinates with: a pair codebook's
    points with the cells that bound each pair's search, or the midpoints of
    the sorted levels."""
    if is_pair_codebook(codebook):
        return pair_search_table(codebook)
    levels = codebook.sort().values
    return (levels[:-1] + levels[1:]) / 2


def check_key_code_served(impl) -> None:
    """Refuse a ``TurboQuantAttentionImpl`` whose keys are coded by pairs
    where the one-launch store and the split-KV decode do not serve it:
    0.20.2's kernels would read each pair's fields as levels."""
    if impl.tq_config.key_pairs and not fused_kernels_serve(impl):
        raise ValueError(
            f"{impl.kv_cache_dtype} codes keys by pairs, which only the one-launch "
            "store and the split-KV decode read: they need a power-of-two head_dim "
            f"from 64 to 512 and at most 8 query heads per KV head (this layer: "
            f"head_dim {impl.head_size}, {impl.num_heads} query / "
            f"{impl.num_kv_heads} KV heads), and VLLM_TURBOQUANT_DECODE unset or "
            "not 'legacy'. Serve this layer with turboquant_3bit_nc (the same "
            "bytes) or give it its own preset in --kv-cache-dtype-skip-layers"
        )
