# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Views of a KV-cache buffer whose attention pages are padded.

When page sizes are unified by padding (``kv_cache_page_unify.py``), block
``i`` of a layer starts at ``i * page_size_bytes`` and only the first
``real_page_size_bytes`` of it hold data. The backend's shape may put the
block index behind another dimension (FlashAttention's ``(2, num_blocks,
...)``); a plain ``view`` would then run K for block ``i+1`` into the padding
of block ``i``. The view built here keeps each block's data contiguous inside
its own page, whatever the block dimension's position.
"""

import math

import torch

from vllm.v1.core.kv_cache_planning_errors import KVCachePageSizeError


def padded_page_view(
    raw_tensor: torch.Tensor,
    shape: tuple[int, ...],
    block_dim: int,
    page_elems: int,
    layer_name: str = "",
) -> torch.Tensor:
    """``raw_tensor`` (1-D, element type of the cache) viewed as ``shape``
    with the block dimension ``block_dim`` strided by ``page_elems``.

    The remaining dimensions are contiguous, in ``shape``'s order, inside
    each page.
    """
    inner = [d for i, d in enumerate(shape) if i != block_dim]
    inner_numel = math.prod(inner)
    num_blocks = shape[block_dim]
    needed = (num_blocks - 1) * page_elems + inner_numel if num_blocks else 0
    if inner_numel > page_elems or needed > raw_tensor.numel():
        raise KVCachePageSizeError(
            f"KV cache layer {layer_name!r}: a block of shape {tuple(inner)} "
            f"({inner_numel} elements) with {num_blocks} blocks of "
            f"{page_elems} elements needs {needed} elements, but the buffer "
            f"has {raw_tensor.numel()}. The page size the planner chose does not "
            "fit this backend's cache layout; please report this with the "
            "'KV cache pages unified' log line."
        )
    strides: list[int] = []
    running = 1
    for d in reversed(inner):
        strides.append(running)
        running *= d
    strides.reverse()
    strides.insert(block_dim, page_elems)
    return torch.as_strided(raw_tensor, size=shape, stride=tuple(strides))


def attention_layouts_differ(groups, kernel_block_sizes, cache_dtype: str) -> bool:
    """Whether the runner must lay out every attention cache per block.

    Layers of different KV-cache groups share one buffer, and the block pool
    hands each block id to one group at a time, so block ``i`` must be the
    same bytes in every layer of the buffer. A backend whose block dimension
    comes first (TurboQuant, Triton), and any padded page
    (``padded_page_view``), keep block ``i`` inside page ``i``;
    FlashAttention's ``(2, num_blocks, ...)`` puts K of every block in the
    first half of the buffer, so its block ``i`` overlaps pages ``i // 2``
    and ``(num_blocks + i) // 2`` of the others. When both kinds are present
    (Gemma's sliding-window layers kept bf16 beside TurboQuant full-attention
    layers), the runner re-lays the K/V-first caches out per block, as it
    does beside Mamba layers.

    ``groups``: the runner's attention groups (``backend``, ``kv_cache_spec``,
    ``kv_cache_group_id``); groups without a kernel block size are skipped.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec

    per_block = set()
    for group in groups:
        spec = group.kv_cache_spec
        if group.kv_cache_group_id >= len(kernel_block_sizes) or not isinstance(
            spec, AttentionSpec
        ):
            continue
        block_dim = group.backend.get_kv_cache_block_dim(
            kernel_block_sizes[group.kv_cache_group_id],
            spec.num_kv_heads,
            spec.head_size,
            cache_dtype_str=cache_dtype,
        )
        per_block.add(block_dim == 0 or spec.page_size_padded is not None)
    return len(per_block) > 1
