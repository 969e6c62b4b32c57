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
