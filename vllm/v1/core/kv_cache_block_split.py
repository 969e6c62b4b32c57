# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shorten the KV-cache tensors that only attention layers share.

A hybrid model's KV-cache groups share tensors: tensor ``i`` holds layer ``i``
of every group, one page per block id. When the attention groups have more
layers than the Mamba groups (an MTP layer joins the main model's attention
type: 17 attention layers beside GDN groups of 16), the last tensors hold
attention layers only, and each block a Mamba group holds leaves a page of
them empty: 4-6 % of the KV memory on the Qwen3.6-27B shape.

The split gives those tensors ``A`` pages instead of ``num_blocks``. Attention
groups take their block ids below ``A`` (``split_block_pool``), Mamba groups
take ids from ``A`` up first and below ``A`` only when those run out. ``A``
holds the attention share of a cache full of ``max_model_len`` requests, and
the bytes the short tensors give up become block ids for every tensor.

The config carries the split as the short tensors' size: the scheduler reads
``A`` back from it (``split_point``), and every worker's reshape already sizes
each layer's view from its own tensor.
"""

import math
from collections.abc import Sequence
from typing import Any

from vllm import envs
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)

logger = init_logger(__name__)


def mamba_group_ids(groups: Sequence[KVCacheGroupSpec]) -> frozenset[int]:
    return frozenset(
        i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)
    )


def _page_size(config: KVCacheConfig) -> int | None:
    pages = {g.kv_cache_spec.page_size_bytes for g in config.kv_cache_groups}
    return pages.pop() if len(pages) == 1 else None


def attention_only_tensors(config: KVCacheConfig) -> tuple[list[int], int] | None:
    """(indices of the tensors that no Mamba layer shares, their page size),
    on a config laid out as one tensor per layer slot over Mamba and attention
    groups; None elsewhere."""
    groups = config.kv_cache_groups
    mamba = mamba_group_ids(groups)
    if not mamba or len(mamba) == len(groups):
        return None
    mamba_layers = {name for i in mamba for name in groups[i].layer_names}
    short = [
        i
        for i, tensor in enumerate(config.kv_cache_tensors)
        if not mamba_layers.intersection(tensor.shared_by)
    ]
    # The specs' page sizes are read only where a tensor could be short.
    if not short or any(
        isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in groups
    ):
        return None
    page = _page_size(config)
    return None if page is None else (short, page)


def _shortened_to(config: KVCacheConfig, short: list[int], page: int) -> int | None:
    """The pages of the shortest of ``short``, where fewer than num_blocks."""
    shortest = min(config.kv_cache_tensors[i].size for i in short) // page
    return shortest if shortest < config.num_blocks else None


def split_point(config: KVCacheConfig) -> int | None:
    """The block id below which attention groups allocate, read from the
    short tensors' size; None where every tensor has ``num_blocks`` pages."""
    found = attention_only_tensors(config)
    return None if found is None else _shortened_to(config, *found)


def blocks_per_request(vllm_config: Any, group: KVCacheGroupSpec) -> int:
    """Blocks a ``max_model_len`` request holds in ``group`` while it decodes.

    Attention groups count as vLLM's concurrency figure counts them. Mamba
    groups keep one running state plus one per draft token, and align and all
    modes one more for the state copied from the last step: in all mode the
    other cached states sit in the free queue, evictable, and a prefill's extra
    blocks fall back below the split like any other Mamba block.
    """
    spec = group.kv_cache_spec
    if isinstance(spec, MambaSpec):
        kept = 2 if vllm_config.cache_config.mamba_cache_mode != "none" else 1
        return kept + spec.num_speculative_blocks
    return cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes)


def attention_share(vllm_config: Any, config: KVCacheConfig) -> tuple[int, int]:
    """(attention blocks, all blocks) a ``max_model_len`` request holds."""
    mamba = mamba_group_ids(config.kv_cache_groups)
    held = [blocks_per_request(vllm_config, g) for g in config.kv_cache_groups]
    attention = sum(n for i, n in enumerate(held) if i not in mamba)
    return attention, sum(held)


def why_not_split(vllm_config: Any) -> str | None:
    """What keeps the split off, where an option assumes every tensor holds
    ``num_blocks`` pages."""
    if vllm_config.kv_transfer_config is not None:
        return "a KV connector or KV offloading is configured"
    if envs.VLLM_USE_V2_MODEL_RUNNER:
        return "the V2 model runner is on"
    if vllm_config.cache_config.num_gpu_blocks_override is not None:
        return "num_gpu_blocks_override fixes the block count"
    return None


def sized_split(
    num_blocks: int, num_tensors: int, num_short: int, attention: int, total: int
) -> tuple[int, int] | None:
    """(num_blocks, A) for the same memory as ``num_tensors`` x ``num_blocks``
    pages, with ``num_short`` tensors of A pages; None where it gains nothing.

    vLLM's concurrency figure divides all ``num_blocks`` by a request's blocks
    over every group; A holds the attention share ``attention / total`` of as
    many, past the null block, so the ids below A bind no sooner.
    """
    budget = num_tensors * num_blocks
    share = attention / total
    n = math.floor(budget / (num_tensors - num_short + num_short * share))
    while n > num_blocks:
        a = math.ceil(share * n) + 1
        if (num_tensors - num_short) * n + num_short * a <= budget:
            return n, a
        n -= 1
    return None


def split_attention_only_tensors(vllm_config: Any, config: KVCacheConfig) -> None:
    """Shorten ``config``'s attention-only tensors to A pages and spend what
    they free on more block ids, in place; called once every worker's config
    has the common ``num_blocks``."""
    found = attention_only_tensors(config)
    if found is None or _shortened_to(config, *found) is not None:
        return
    short, page = found
    if reason := why_not_split(vllm_config):
        logger.info_once(
            "KV cache: %d tensor(s) hold attention layers only; not shortened "
            "because %s.",
            len(short),
            reason,
        )
        return
    attention, total = attention_share(vllm_config, config)
    sized = sized_split(
        config.num_blocks, len(config.kv_cache_tensors), len(short), attention, total
    )
    if sized is None:
        return
    num_blocks, split = sized
    logger.info_once(
        "KV cache: %d tensor(s) hold attention layers only; they keep %d of "
        "%d pages, for attention's block ids, and the other tensors grow from "
        "%d to %d blocks.",
        len(short),
        split,
        num_blocks,
        config.num_blocks,
        num_blocks,
    )
    config.num_blocks = num_blocks
    for i, tensor in enumerate(config.kv_cache_tensors):
        tensor.size = page * (split if i in short else num_blocks)


def cap_concurrency(
    vllm_config: Any, config: KVCacheConfig, concurrency: float
) -> float:
    """vLLM's max concurrency, also bounded by the ids below the split."""
    split = split_point(config)
    if split is None:
        return concurrency
    attention, _ = attention_share(vllm_config, config)
    return min(concurrency, (split - 1) / attention) if attention else concurrency
