# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Page-size unification: scale block_size first, pad the remainder (patch 0004).

Pristine 0.20.2 raises a bare ``AssertionError`` (Mamba page smaller than the
largest) or ``NotImplementedError`` (non-divisible attention pages) for the
mixes below.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.utils.math_utils import cdiv, round_up
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_groups,
    get_uniform_page_size,
    unify_kv_cache_spec_page_size,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    TQFullAttentionSpec,
)

pytestmark = pytest.mark.cpu_test

BF16, FP8, U8 = torch.bfloat16, torch.float8_e4m3fn, torch.uint8


def _real(spec):
    from dataclasses import replace

    return replace(spec, page_size_padded=None).page_size_bytes


def test_gemma4_tp4_turboquant_pages_unify_with_little_padding():
    """Gemma-4-31B at TP=4: sliding bf16 (4 x 256) next to TurboQuant full
    layers (1 x 512, 518 B slot): 65536 vs 8288 B pages, not divisible."""
    specs = {}
    for i in range(60):
        name = f"model.layers.{i}.self_attn.attn"
        if i % 6 == 5:
            specs[name] = TQFullAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=512, dtype=U8, tq_slot_size=518
            )
        else:
            specs[name] = SlidingWindowSpec(
                block_size=16,
                num_kv_heads=4,
                head_size=256,
                dtype=BF16,
                sliding_window=1024,
            )
    unified = unify_kv_cache_spec_page_size(specs)
    pages = {s.page_size_bytes for s in unified.values()}
    assert len(pages) == 1
    padding = sum(s.page_size_bytes - _real(s) for s in unified.values())
    assert padding / (pages.pop() * len(unified)) <= 0.01


def _mamba(spec_tokens: int = 0) -> MambaSpec:
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, 2, 2, 32, 32, 4, spec_tokens
    )
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(BF16, "auto", "auto")
    return MambaSpec(block_size=16, shapes=shapes, dtypes=dtypes)


SPEC_KINDS = st.sampled_from(["full", "sliding", "tq", "mamba", "draft", "mla"])


@st.composite
def spec_mixes(draw):
    block = 16 * draw(st.integers(1, 8))
    specs = {}
    kinds = draw(st.lists(SPEC_KINDS, min_size=2, max_size=6))
    for i, kind in enumerate(kinds):
        heads = draw(st.sampled_from([1, 2, 4, 8]))
        head = draw(st.sampled_from([64, 128, 256, 512]))
        name = f"{'draft_model.' if kind == 'draft' else ''}model.layers.{i}"
        if kind == "mamba":
            specs[f"{name}.linear_attn"] = _mamba(draw(st.integers(0, 3)))
        elif kind == "sliding":
            specs[f"{name}.self_attn.attn"] = SlidingWindowSpec(
                block_size=block,
                num_kv_heads=heads,
                head_size=head,
                dtype=BF16,
                sliding_window=128,
            )
        elif kind == "tq":
            slot = draw(st.sampled_from([262, 198, 134, 518, 388]))
            specs[f"{name}.self_attn.attn"] = TQFullAttentionSpec(
                block_size=block,
                num_kv_heads=heads,
                head_size=head,
                dtype=U8,
                tq_slot_size=slot,
            )
        elif kind == "mla":
            specs[f"{name}.self_attn.attn"] = MLAAttentionSpec(
                block_size=block, num_kv_heads=1, head_size=head + 64, dtype=BF16
            )
        else:
            specs[f"{name}.self_attn.attn"] = FullAttentionSpec(
                block_size=block,
                num_kv_heads=heads,
                head_size=head,
                dtype=FP8 if kind == "draft" else BF16,
            )
    return specs


@settings(max_examples=300, deadline=None)
@given(spec_mixes())
def test_unified_pages_are_equal_and_hold_what_each_layer_stores(specs):
    from vllm.v1.core.kv_cache_page_unify import page_padding
    from vllm.v1.core.kv_cache_planning_errors import KVCacheSpecError

    try:
        unified = unify_kv_cache_spec_page_size(dict(specs))
    except KVCacheSpecError as e:
        # Only unpaddable (MLA) pages may be refused, and by name.
        assert any(isinstance(s, MLAAttentionSpec) for s in specs.values())
        assert "MLAAttentionSpec" in str(e)
        return
    assert set(unified) == set(specs)
    pages = {s.page_size_bytes for s in unified.values()}
    assert len(pages) == 1
    page = pages.pop()
    for name, spec in unified.items():
        before = specs[name]
        assert spec.page_size_bytes >= _real(spec)  # never smaller than what it stores
        assert spec.block_size % before.block_size == 0  # blocks stay multiples
        if not isinstance(spec, MambaSpec) and spec.block_size > before.block_size:
            # scaled as far as it fits: one more block multiple would overflow
            per_block = _real(before)
            assert page - _real(spec) < per_block
    summary = page_padding(unified)
    assert summary.padding_bytes_per_page_set == sum(
        page - _real(s) for s in unified.values()
    )
    assert 0 <= summary.fraction < 1


# Qwen3-Coder-Next-80B-A3B: 48 layers, full attention every 4th; attention
# 2 KV heads x 256, GDN 16 K heads / 32 V heads of 128, conv kernel 4.
# LocoOperator-4B (Qwen3-4B geometry): 36 layers, 8 KV heads x 128.
MAIN_LAYERS, MAIN_KV_HEADS, MAIN_HEAD = 48, 2, 256
DRAFT_LAYERS, DRAFT_KV_HEADS, DRAFT_HEAD = 36, 8, 128


def hybrid_main_with_dense_draft() -> dict:
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, 16, 32, 128, 128, 4
    )
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        torch.bfloat16, "auto", "auto"
    )
    mamba_page = MambaSpec(block_size=1, shapes=shapes, dtypes=dtypes).page_size_bytes
    # As the platform's hybrid alignment does: the smallest 16-token multiple
    # whose main-model attention page covers the GDN state, Mamba padded to it.
    attn_per_token = 2 * MAIN_KV_HEADS * MAIN_HEAD * 1  # K+V, fp8
    block_size = round_up(cdiv(mamba_page, attn_per_token), 16)
    specs: dict = {}
    for i in range(MAIN_LAYERS):
        if i % 4 == 3:
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=block_size,
                num_kv_heads=MAIN_KV_HEADS,
                head_size=MAIN_HEAD,
                dtype=FP8,
            )
        else:
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                block_size=block_size,
                shapes=shapes,
                dtypes=dtypes,
                page_size_padded=block_size * attn_per_token,
            )
    for i in range(DRAFT_LAYERS):
        specs[f"draft_model.model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=DRAFT_KV_HEADS,
            head_size=DRAFT_HEAD,
            dtype=FP8,
        )
    return specs


def test_dense_draft_beside_hybrid_main_plans():
    """The seed's shapes: pristine 0.20.2 dies on a bare AssertionError; with
    the series the draft's larger page is met by padding the Mamba page."""
    specs = hybrid_main_with_dense_draft()
    mamba_page = specs["model.layers.0.linear_attn"].page_size_bytes
    draft_page = specs["draft_model.model.layers.0.self_attn.attn"].page_size_bytes
    assert (
        draft_page == 2 * mamba_page
    )  # the seed's shape: draft page twice the state page

    groups = get_kv_cache_groups(VllmConfig(), specs)
    assert get_uniform_page_size([g.kv_cache_spec for g in groups]) >= draft_page
