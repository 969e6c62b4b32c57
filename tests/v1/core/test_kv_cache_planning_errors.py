# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV-cache planning failures name the layers, spec types and sizes (no bare asserts).

Seed: a dense draft (LocoOperator-4B, Qwen3-4B geometry) beside a hybrid main
(Qwen3-Coder-Next-80B-A3B, Gated DeltaNet + attention) with fp8 KV died at
engine start with a bare ``AssertionError`` in ``unify_kv_cache_spec_page_size``
(vllm-project/vllm#43626).
"""

import pytest
import torch

from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.utils.math_utils import cdiv, round_up
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_configs,
    get_kv_cache_groups,
    get_uniform_page_size,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

pytestmark = pytest.mark.cpu_test

FP8 = torch.float8_e4m3fn
# Qwen3-Coder-Next-80B-A3B: 48 layers, full attention every 4th; attention
# 2 KV heads x 256, GDN 16 K heads / 32 V heads of 128, conv kernel 4.
# LocoOperator-4B (Qwen3-4B geometry): 36 layers, 8 KV heads x 128.
MAIN_LAYERS, MAIN_KV_HEADS, MAIN_HEAD = 48, 2, 256
DRAFT_LAYERS, DRAFT_KV_HEADS, DRAFT_HEAD = 36, 8, 128


def hybrid_main_with_dense_draft() -> dict:
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 16, 32, 128, 128, 4)
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
                block_size=block_size, num_kv_heads=MAIN_KV_HEADS,
                head_size=MAIN_HEAD, dtype=FP8,
            )
        else:
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                block_size=block_size, shapes=shapes, dtypes=dtypes,
                page_size_padded=block_size * attn_per_token,
            )
    for i in range(DRAFT_LAYERS):
        specs[f"draft_model.model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
            block_size=block_size, num_kv_heads=DRAFT_KV_HEADS,
            head_size=DRAFT_HEAD, dtype=FP8,
        )
    return specs


@pytest.fixture
def vllm_config() -> VllmConfig:
    return VllmConfig()


def test_dense_draft_beside_hybrid_main_plans(vllm_config):
    """The seed's shapes: pristine 0.20.2 dies on a bare AssertionError; with
    the series the draft's larger page is met by padding the Mamba page."""
    specs = hybrid_main_with_dense_draft()
    mamba_page = specs["model.layers.0.linear_attn"].page_size_bytes
    draft_page = specs["draft_model.model.layers.0.self_attn.attn"].page_size_bytes
    assert draft_page == 2 * mamba_page  # the seed's shape: draft page twice the state page

    groups = get_kv_cache_groups(vllm_config, specs)
    assert get_uniform_page_size([g.kv_cache_spec for g in groups]) >= draft_page


def test_unpaddable_non_divisible_pages_name_both_layers(vllm_config):
    """MLA pages cannot be padded; a page that neither divides nor can be
    padded is named with both layers and sizes."""
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 2, 2, 16, 16, 4)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.float32, "auto", "auto")
    specs = {
        "model.layers.0.linear_attn": MambaSpec(block_size=16, shapes=shapes, dtypes=dtypes),
        "model.layers.1.self_attn.attn": MLAAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=24, dtype=torch.float32),
    }
    mamba_page = specs["model.layers.0.linear_attn"].page_size_bytes
    assert mamba_page % specs["model.layers.1.self_attn.attn"].page_size_bytes
    with pytest.raises(NotImplementedError) as exc:  # the type upstream tests expect
        get_kv_cache_groups(vllm_config, specs)
    msg = str(exc.value)
    assert "'model.layers.1.self_attn.attn' (MLAAttentionSpec) has a 1536 B page" in msg
    assert f"{mamba_page} B" in msg and "model.layers.0.linear_attn" in msg
    assert isinstance(exc.value, ValueError)


def test_groups_with_different_page_sizes_are_listed():
    specs = [
        FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32),
        FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32),
    ]
    with pytest.raises(AssertionError, match=r"must have one page size.*\[16384, 32768\]"):
        get_uniform_page_size(specs)


def test_workers_disagreeing_on_a_layer_name_it(vllm_config):
    a = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    b = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float32)
    with pytest.raises(AssertionError, match=r"Layer 'layer1' has different KV cache specs"):
        get_kv_cache_configs(vllm_config, [{"layer1": a}, {"layer1": b}], [1 << 20] * 2)
