# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV-cache planning failures name the layers, spec types and sizes (no bare asserts).

Seed: a dense draft (LocoOperator-4B, Qwen3-4B geometry) beside a hybrid main
(Qwen3-Coder-Next-80B-A3B, Gated DeltaNet + attention) with fp8 KV died at
engine start with a bare ``AssertionError`` in ``unify_kv_cache_spec_page_size``
(vllm-project/vllm#43626). Planning that pairing is patch 0004's (its test is
in test_kv_cache_page_unify.py); here, the failures that remain are named.
"""

import pytest
import torch

from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_configs,
    get_kv_cache_groups,
    get_uniform_page_size,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
)

pytestmark = pytest.mark.cpu_test

FP8 = torch.float8_e4m3fn


@pytest.fixture
def vllm_config() -> VllmConfig:
    return VllmConfig()


def test_unpaddable_non_divisible_pages_name_both_layers(vllm_config):
    """MLA pages cannot be padded; a page that neither divides nor can be
    padded is named with both layers and sizes."""
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, 2, 2, 16, 16, 4)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        torch.float32, "auto", "auto"
    )
    specs = {
        "model.layers.0.linear_attn": MambaSpec(
            block_size=16, shapes=shapes, dtypes=dtypes
        ),
        "model.layers.1.self_attn.attn": MLAAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=24, dtype=torch.float32
        ),
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
        FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32
        ),
        FullAttentionSpec(
            block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32
        ),
    ]
    with pytest.raises(
        AssertionError, match=r"must have one page size.*\[16384, 32768\]"
    ):
        get_uniform_page_size(specs)


def test_workers_disagreeing_on_a_layer_name_it(vllm_config):
    a = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32
    )
    b = FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float32
    )
    with pytest.raises(
        AssertionError, match=r"Layer 'layer1' has different KV cache specs"
    ):
        get_kv_cache_configs(vllm_config, [{"layer1": a}, {"layer1": b}], [1 << 20] * 2)
