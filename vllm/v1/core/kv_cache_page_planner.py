# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Block size and Mamba page padding for hybrid (attention + Mamba/GDN) models.

All KV-cache pages of a hybrid model have one size (see
``kv_cache_page_unify.py``). A Mamba/GDN page holds one request's state and
cannot shrink; attention pages are ``block_size x bytes-per-token``. Upstream
0.20.2 picked the attention block size from one formula,
``2 x num_kv_heads x head_size x dtype`` with the model's global head size and
the *global* KV dtype, and padded the Mamba page to that attention page. That
is wrong whenever attention layers store different amounts per token:
TurboQuant's packed slot (1048 B/token for 4 KV heads of 256, not 2048), layers
TurboQuant skips (bf16, 4096 B/token), or a dense draft model with other heads.

This planner takes what each attention layer really stores per token and
chooses a block size ``b`` (a multiple of the kernel alignment, large enough
that the layers storing the most per token cover the Mamba page, as upstream)
and a page size ``X`` that minimise padding once ``unify_page_sizes`` has
scaled every other attention layer to the largest multiple of ``b`` fitting in
``X`` and padded the rest. The Mamba page is padded to ``X``, which makes
``X`` the largest page the unifier sees.
"""

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from math import lcm
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_page_unify import bytes_per_token, scaled_page_padding

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

# How far above the smallest workable block size the planner looks.
_SEARCH_SPAN = 4


@dataclass(frozen=True)
class HybridPagePlan:
    block_size: int
    """Attention block size before unification scales smaller pages."""
    page_size_bytes: int
    """The page every layer ends up with; the Mamba page is padded to it."""
    mamba_page_size_bytes: int
    padding_fraction: float
    """Padding as a fraction of KV-cache memory, for the layer counts given."""


def _padding_bytes(
    block_size: int,
    page: int,
    mamba_page: int,
    per_token: Mapping[int, int],
    num_mamba_layers: int,
) -> int:
    waste = num_mamba_layers * (page - mamba_page)
    for per_token_bytes, count in per_token.items():
        waste += count * scaled_page_padding(page, block_size * per_token_bytes)
    return waste


def plan_hybrid_page(
    mamba_page_size: int,
    attention_bytes_per_token: Mapping[int, int],
    alignment: int,
    num_mamba_layers: int = 1,
    min_block_size: int | None = None,
) -> HybridPagePlan:
    """Choose the attention block size and the common page size.

    Args:
        mamba_page_size: bytes of one Mamba/GDN page (unpadded).
        attention_bytes_per_token: bytes per token of each distinct attention
            layer kind -> number of such layers (main model and drafts).
        alignment: block sizes must be multiples of this (the kernel block
            alignment, or the Mamba chunk size with prefix caching "all").
        num_mamba_layers: how many layers hold Mamba pages (weights padding).
        min_block_size: a block size the user asked for; kept when large
            enough (upstream behaviour).
    """
    if not attention_bytes_per_token:
        raise ValueError("a hybrid page plan needs at least one attention layer")
    largest = max(attention_bytes_per_token)
    num_layers = num_mamba_layers + sum(attention_bytes_per_token.values())
    # As upstream: the layers storing the most per token keep the block size
    # (their page alone covers the Mamba page); the others are scaled up by
    # unification. Larger blocks are tried too, since with several kinds of
    # attention layer a slightly larger page can pack them all more tightly.
    lowest = alignment * cdiv(mamba_page_size, alignment * largest)
    if min_block_size is not None and min_block_size * largest >= mamba_page_size:
        candidates = [min_block_size]
    elif len(attention_bytes_per_token) == 1:
        candidates = [lowest]
    else:
        candidates = list(range(lowest, _SEARCH_SPAN * lowest + 1, alignment))

    best: tuple[float, int, int] | None = None
    for block_size in candidates:
        floor = max(mamba_page_size, block_size * largest)
        pages = {floor}
        for per_token_bytes in attention_bytes_per_token:
            layer_page = block_size * per_token_bytes
            pages.add(cdiv(floor, layer_page) * layer_page)
        for page in pages:
            waste = _padding_bytes(
                block_size,
                page,
                mamba_page_size,
                attention_bytes_per_token,
                num_mamba_layers,
            )
            key = (waste / (page * num_layers), page, block_size)
            if best is None or key < best:
                best = key
    assert best is not None
    fraction, page, block_size = best
    return HybridPagePlan(
        block_size=block_size,
        page_size_bytes=page,
        mamba_page_size_bytes=mamba_page_size,
        padding_fraction=fraction,
    )


def loaded_layer_pages(vllm_config: "VllmConfig") -> tuple[Counter[int], int]:
    """From the loaded layers (main model and drafter): what each attention
    layer stores per token, from its own KV-cache spec, and how many layers
    hold Mamba state."""
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.kv_cache_interface import AttentionSpec

    per_token: Counter[int] = Counter()
    num_mamba = 0
    layers = get_layers_from_vllm_config(
        vllm_config,
        AttentionLayerBase,  # type: ignore[type-abstract]
    )
    for layer in layers.values():
        if layer.get_attn_backend().is_ssm():
            num_mamba += 1
            continue
        if getattr(layer, "attn_type", AttentionType.DECODER) != AttentionType.DECODER:
            continue
        if getattr(layer, "kv_sharing_target_layer_name", None):
            continue
        spec = layer.get_kv_cache_spec(vllm_config)
        if isinstance(spec, AttentionSpec):
            per_token[bytes_per_token(spec)] += 1
    return per_token, num_mamba


def apply_hybrid_page_plan(
    vllm_config: "VllmConfig",
    mamba_page_size: int,
    fallback_bytes_per_token: int,
    kernel_block_alignment_size: int,
    mamba_block_size: int | None,
    per_token: Mapping[int, int] | None = None,
    num_mamba_layers: int | None = None,
) -> HybridPagePlan:
    """Set ``cache_config.block_size``, ``mamba_block_size`` and
    ``mamba_page_size_padded`` for a hybrid model.

    ``per_token`` / ``num_mamba_layers`` default to the loaded layers; the
    capacity planner passes them from configs. ``fallback_bytes_per_token``
    (upstream's global formula) is used when no attention layer is known.
    """
    cache_config = vllm_config.cache_config
    model_config = vllm_config.model_config
    if per_token is None or num_mamba_layers is None:
        loaded_per_token, loaded_mamba = loaded_layer_pages(vllm_config)
        per_token = loaded_per_token if per_token is None else per_token
        num_mamba_layers = (
            loaded_mamba if num_mamba_layers is None else num_mamba_layers
        )
    if not per_token:
        per_token = {fallback_bytes_per_token: 1}
    num_mamba_layers = max(1, num_mamba_layers)

    alignment = kernel_block_alignment_size
    if cache_config.mamba_cache_mode == "all":
        # Prefix caching of every Mamba chunk: blocks must hold whole chunks.
        base_chunk_size = mamba_block_size or model_config.get_mamba_chunk_size()
        assert base_chunk_size is not None
        alignment = lcm(base_chunk_size, kernel_block_alignment_size)

    plan = plan_hybrid_page(
        mamba_page_size,
        per_token,
        alignment,
        num_mamba_layers=num_mamba_layers,
        min_block_size=(
            cache_config.block_size if cache_config.user_specified_block_size else None
        ),
    )
    if cache_config.block_size != plan.block_size:
        logger.info(
            "Setting attention block size to %d tokens so that attention pages "
            "(%s B/token) fit the %d B mamba page with least padding.",
            plan.block_size,
            "/".join(str(b) for b in sorted(per_token)),
            mamba_page_size,
        )
    cache_config.block_size = plan.block_size
    if cache_config.mamba_cache_mode in ("all", "align"):
        cache_config.mamba_block_size = plan.block_size

    if plan.page_size_bytes != mamba_page_size:
        cache_config.mamba_page_size_padded = plan.page_size_bytes
        logger.info(
            "Padding mamba page size by %.2f%% to %d B; KV cache padding over "
            "all layers: %.2f%%.",
            100 * (plan.page_size_bytes - mamba_page_size) / mamba_page_size,
            plan.page_size_bytes,
            100 * plan.padding_fraction,
        )
    else:
        cache_config.mamba_page_size_padded = None
    return plan
