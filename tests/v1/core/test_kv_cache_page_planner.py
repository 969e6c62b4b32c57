# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The hybrid page planner (patch 0004) sizes attention pages from what each
layer stores. Pristine 0.20.2 used ``2 x heads x head_dim x dtype`` with the
global KV dtype: 2048 B/token for Qwen3.6-27B under TurboQuant, whose layers
store a 1048 B/token slot, so the TurboQuant page came out about half the
Mamba page and unification failed."""

import pytest
import torch

from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_page_planner import plan_hybrid_page
from vllm.v1.kv_cache_interface import MambaSpec

pytestmark = pytest.mark.cpu_test

# Qwen3.6-27B at TP=1: GDN 16 key / 48 value heads of 128, conv 4; 4 KV heads of 256.
SHAPES = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 16, 48, 128, 128, 4)
MAMBA_PAGE = MambaSpec(
    block_size=1,
    shapes=SHAPES,
    dtypes=MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        torch.bfloat16, "auto", "auto"
    ),
).page_size_bytes
TQ_4BIT, BF16 = 4 * 262, 4 * 2 * 256 * 2


def test_single_kind_matches_upstream_formula_with_the_real_size():
    plan = plan_hybrid_page(MAMBA_PAGE, {TQ_4BIT: 16}, 16, num_mamba_layers=48)
    assert plan.block_size == 16 * cdiv(MAMBA_PAGE, 16 * TQ_4BIT)
    assert plan.page_size_bytes == plan.block_size * TQ_4BIT >= MAMBA_PAGE
    assert plan.padding_fraction < 0.01


def test_mixed_kinds_pad_less_than_sizing_for_the_largest_alone():
    per_token = {TQ_4BIT: 12, BF16: 4}  # boundary:2 on Qwen3.6-27B
    plan = plan_hybrid_page(MAMBA_PAGE, per_token, 16, num_mamba_layers=48)
    # Upstream-style: block for the largest layers, everything padded to that page.
    block = 16 * cdiv(MAMBA_PAGE, 16 * BF16)
    page = block * BF16
    naive = 48 * (page - MAMBA_PAGE) + 12 * (
        page - (page // (block * TQ_4BIT)) * block * TQ_4BIT
    )
    assert plan.padding_fraction < naive / (page * 64)
    assert plan.block_size % 16 == 0 and plan.block_size * BF16 >= MAMBA_PAGE


def test_user_block_size_is_kept_when_large_enough():
    block = 16 * cdiv(MAMBA_PAGE, 16 * TQ_4BIT) + 64
    plan = plan_hybrid_page(MAMBA_PAGE, {TQ_4BIT: 16}, 16, min_block_size=block)
    assert plan.block_size == block


def test_no_attention_layers_is_an_error():
    with pytest.raises(ValueError, match="at least one attention layer"):
        plan_hybrid_page(MAMBA_PAGE, {}, 16)
