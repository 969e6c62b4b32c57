# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A draft model's attention layers stay in one KV-cache group beside a hybrid
main, so the proposer (one attention metadata for all draft layers) can serve.

Pristine 0.20.2 splits every spec type into groups of the smallest type's
layer count; a 36-layer dense draft beside Qwen3-Coder-Next's 12 attention
layers lands in three groups and the engine stops at start-up with
``All drafting layers should belong to the same kv cache group``.
"""

import pytest
import torch

from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

pytestmark = pytest.mark.cpu_test


def _spec_types():
    # Equal pages everywhere (16 KiB): main full attention, main sliding window,
    # draft full attention (block 32).
    full = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32
    )
    sliding = SlidingWindowSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float32,
        sliding_window=128,
    )
    draft = FullAttentionSpec(
        block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32
    )
    return full, sliding, draft


def _specs(num_draft_layers: int) -> dict:
    # Main: 2 full + 6 sliding layers; the draft is a type of its own.
    full, sliding, draft = _spec_types()
    specs = {}
    for i in range(8):
        specs[f"model.layers.{i}.self_attn.attn"] = full if i % 4 == 3 else sliding
    for i in range(num_draft_layers):
        specs[f"draft_model.model.layers.{i}.self_attn.attn"] = draft
    return specs


def _groups_of(groups, prefix: str) -> set[int]:
    return {
        i
        for i, g in enumerate(groups)
        for name in g.layer_names
        if name.startswith(prefix)
    }


@pytest.mark.parametrize("num_draft_layers", [4, 6])
def test_draft_layers_share_one_group(num_draft_layers):
    groups = get_kv_cache_groups(VllmConfig(), _specs(num_draft_layers))
    assert len(_groups_of(groups, "draft_model.")) == 1
    # Every layer is grouped once; no group is larger than the draft's.
    names = [n for g in groups for n in g.layer_names]
    assert sorted(names) == sorted(_specs(num_draft_layers))
    assert max(len(g.layer_names) for g in groups) == num_draft_layers


def test_draft_that_fits_the_group_size_changes_nothing():
    groups = get_kv_cache_groups(VllmConfig(), _specs(2))
    assert [len(g.layer_names) for g in groups] == [2, 2, 2, 2, 2]
    assert len(_groups_of(groups, "draft_model.")) == 1


def test_one_mtp_layer_sharing_the_main_layers_spec_changes_nothing():
    """An MTP layer with the main attention's spec joins that type; a single
    drafter layer is always in one group, so the group size stays the smallest
    type's (2 sliding layers here) instead of growing to the 7-layer type."""
    full, sliding, _ = _spec_types()
    specs = {f"model.layers.{i}.self_attn.attn": full for i in range(6)}
    specs |= {f"model.layers.{i}.self_attn.attn": sliding for i in (6, 7)}
    specs["mtp.layers.0.self_attn.attn"] = full
    groups = get_kv_cache_groups(VllmConfig(), specs)
    assert max(len(g.layer_names) for g in groups) == 2
