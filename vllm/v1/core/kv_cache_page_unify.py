# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Give every KV-cache layer one page size: scale block_size first, pad the rest.

The hybrid KV-cache manager hands out pages of one size to every layer
(``_get_kv_cache_groups_uniform_page_size``). Layers store different amounts
per page: Mamba/GDN state is fixed per request, attention pages grow with
block_size and differ with heads, head_dim and KV dtype (TurboQuant's packed
slot, a skipped layer's bf16, a draft model's heads).

Upstream 0.20.2 could only multiply block_size by an exact ratio, so a Mamba
spec (whose page does not depend on block_size) or a non-divisible attention
page aborted start-up. Padding every smaller page to the largest one (what
later upstream releases do) boots, but throws away most of what a compressed
KV dtype saved: a 4-bit TurboQuant page next to a bf16 page is mostly padding.

Here each smaller attention page first grows by the largest whole multiple of
its block_size that still fits, so it stays a multiple of the original block
(prefix-cache hashing and the scheduler's LCM block size are unchanged), and
only the remainder -- less than one original page -- is padding. Mamba pages
are padded. Padded attention pages require that the attention kernel uses the
whole block (``check_padded_kernel_block_size``) because a kernel block split
inside a padded page would run into the padding.
"""

from collections.abc import Mapping
from dataclasses import dataclass, replace

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_planning_errors import (
    KVCachePageSizeError,
    check_scaled_page_size,
    describe_layers,
    page_size_not_divisible,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
)

logger = init_logger(__name__)

# Padding (share of KV-cache memory) at which a larger common page stops
# being worth it, and how many times the largest page the search goes up to.
TARGET_PADDING_FRACTION = 0.005
MAX_PAGE_MULTIPLE = 8


# The one model of page padding; the hybrid page planner and the capacity
# planner (vllm kv-capacity) count padding with these functions too.


def unpadded_page_size_bytes(spec: KVCacheSpec) -> int:
    """The bytes a page of ``spec`` really stores (padding excluded)."""
    if getattr(spec, "page_size_padded", None) is None:
        return spec.page_size_bytes
    return replace(spec, page_size_padded=None).page_size_bytes


def bytes_per_token(spec: AttentionSpec) -> int:
    """What one token of an attention layer stores (its page at block_size 1)."""
    return unpadded_page_size_bytes(replace(spec, block_size=1))


def scaled_page_padding(page: int, layer_page: int) -> int:
    """Padding left in ``page`` once a layer's ``layer_page`` is scaled by the
    largest whole multiple that fits (0 when it divides ``page``)."""
    return page % layer_page


def can_pad_page(spec: KVCacheSpec) -> bool:
    """Whether the runner can lay out ``spec`` with a padded page.

    MLA backends and per-token-head quantized caches carve extra tensors out
    of the page at fixed offsets; they are left to exact scaling.
    """
    if isinstance(spec, MambaSpec):
        return True
    if not isinstance(spec, AttentionSpec) or isinstance(spec, MLAAttentionSpec):
        return False
    return not spec.kv_quant_mode.is_per_token_head


@dataclass(frozen=True)
class PagePadding:
    """How much of the unified pages is padding."""

    page_size_bytes: int
    num_layers: int
    padded_layers: int
    scaled_layers: int
    padding_bytes_per_page_set: int

    @property
    def fraction(self) -> float:
        """Padding as a fraction of all KV-cache memory (every layer gets the
        same number of pages of the same size)."""
        total = self.page_size_bytes * self.num_layers
        return self.padding_bytes_per_page_set / total if total else 0.0


def page_padding(kv_cache_spec: Mapping[str, KVCacheSpec]) -> PagePadding:
    """Padding summary of specs whose pages were unified."""
    page = max((s.page_size_bytes for s in kv_cache_spec.values()), default=0)
    padding = [
        s.page_size_bytes - unpadded_page_size_bytes(s) for s in kv_cache_spec.values()
    ]
    return PagePadding(
        page_size_bytes=page,
        num_layers=len(kv_cache_spec),
        padded_layers=sum(1 for p in padding if p > 0),
        scaled_layers=0,
        padding_bytes_per_page_set=sum(padding),
    )


def _fit_attention_page(
    layer_name: str,
    spec: AttentionSpec,
    max_page_size: int,
    kv_cache_spec: Mapping[str, KVCacheSpec],
) -> KVCacheSpec:
    base = replace(spec, page_size_padded=None)
    ratio = max_page_size // base.page_size_bytes
    scaled = replace(base, block_size=base.block_size * ratio) if ratio > 1 else base
    if scaled.page_size_bytes == max_page_size:
        check_scaled_page_size(layer_name, spec, scaled, max_page_size, kv_cache_spec)
        return scaled
    if not can_pad_page(spec):
        raise page_size_not_divisible(layer_name, spec, max_page_size, kv_cache_spec)
    return replace(scaled, page_size_padded=max_page_size)


def _padding_for_page(
    kv_cache_spec: Mapping[str, KVCacheSpec], page: int
) -> int | None:
    """Total padding if every layer gets ``page`` (None: some layer can't)."""
    waste = 0
    for spec in kv_cache_spec.values():
        real = unpadded_page_size_bytes(spec)
        if isinstance(spec, MambaSpec):
            fitted = real
        elif isinstance(spec, AttentionSpec):
            fitted = page - scaled_page_padding(page, real)
        else:
            fitted = page if page == spec.page_size_bytes else 0
        if fitted == 0 or (fitted != page and not can_pad_page(spec)):
            return None
        waste += page - fitted
    return waste


def choose_page_size(kv_cache_spec: Mapping[str, KVCacheSpec]) -> int:
    """The common page size: the largest page, unless a whole multiple of it
    (or the next multiple of a smaller attention page above it) brings the
    padding under ``TARGET_PADDING_FRACTION`` of KV memory. Larger pages only
    mean larger blocks, so the smallest page meeting the target wins; if none
    does, the least padding does."""
    largest = max(spec.page_size_bytes for spec in kv_cache_spec.values())
    reals = {
        unpadded_page_size_bytes(s)
        for s in kv_cache_spec.values()
        if isinstance(s, AttentionSpec) and can_pad_page(s)
    }
    candidates = {largest}
    for m in range(1, MAX_PAGE_MULTIPLE + 1):
        candidates.add(m * largest)
        candidates.update(-(-m * largest // r) * r for r in reals)
    best: tuple[float, int] | None = None
    n = len(kv_cache_spec)
    for page in sorted(candidates):
        waste = _padding_for_page(kv_cache_spec, page)
        if waste is None:
            continue
        fraction = waste / (page * n)
        if fraction <= TARGET_PADDING_FRACTION:
            return page
        if best is None or fraction < best[0]:
            best = (fraction, page)
    return best[1] if best is not None else largest


def unify_page_sizes(
    kv_cache_spec: dict[str, KVCacheSpec],
) -> dict[str, KVCacheSpec]:
    """Return specs that all have one page size (see ``choose_page_size``).

    Attention layers are scaled by the largest whole multiple of their
    block_size that fits, then padded; Mamba layers are padded. Raises
    :class:`KVCachePageSizeError` (naming the layers) when a spec can be
    neither scaled exactly nor padded.
    """
    page_sizes = {spec.page_size_bytes for spec in kv_cache_spec.values()}
    if len(page_sizes) <= 1:
        return kv_cache_spec

    max_page_size = choose_page_size(kv_cache_spec)
    unified: dict[str, KVCacheSpec] = {}
    scaled = 0
    for layer_name, spec in kv_cache_spec.items():
        if spec.page_size_bytes == max_page_size:
            unified[layer_name] = spec
        elif isinstance(spec, MambaSpec):
            # A Mamba page holds one request's state whatever the block_size.
            unified[layer_name] = replace(spec, page_size_padded=max_page_size)
        elif isinstance(spec, AttentionSpec):
            new_spec = _fit_attention_page(
                layer_name, spec, max_page_size, kv_cache_spec
            )
            scaled += new_spec.block_size != spec.block_size
            unified[layer_name] = new_spec
        else:
            raise page_size_not_divisible(
                layer_name, spec, max_page_size, kv_cache_spec
            )

    summary = replace(page_padding(unified), scaled_layers=scaled)
    if summary.padded_layers:
        logger.info(
            "KV cache pages unified to %d B: block_size scaled on %d layer(s), "
            "padding on %d of %d layer(s) wastes %.2f%% of KV cache memory.",
            summary.page_size_bytes,
            summary.scaled_layers,
            summary.padded_layers,
            summary.num_layers,
            100 * summary.fraction,
        )
    return unified


def check_padded_kernel_block_size(
    group_id: int,
    spec: KVCacheSpec,
    layer_names: list[str],
    kernel_block_size: int,
    backend_names: list[str],
) -> None:
    """A padded page must be one kernel block: kernel blocks are addressed by
    ``page_index * blocks_per_page + i`` with a fixed stride, which would run
    into the padding of the page before."""
    padded = getattr(spec, "page_size_padded", None)
    if padded is None or kernel_block_size == spec.block_size:
        return
    raise KVCachePageSizeError(
        f"KV cache group {group_id} has padded pages ({padded} B, block_size "
        f"{spec.block_size}) but attention backend(s) {', '.join(backend_names)} "
        f"would split each block into kernel blocks of {kernel_block_size} tokens, "
        "and a kernel block must not cross a page's padding.\n"
        f"Layers:\n{describe_layers({n: spec for n in layer_names})}\n"
        "To try: choose an attention backend that accepts any multiple of 16 as "
        "its kernel block size (FLASH_ATTN, TRITON_ATTN, TURBOQUANT), or use one "
        "--kv-cache-dtype for every attention layer so no page needs padding."
    )
