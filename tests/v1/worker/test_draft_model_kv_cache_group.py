# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A draft model proposer gets the metadata (block table, slot mapping) of the
KV-cache group that holds its layers.

Pristine 0.20.2 hands the drafter of KV-cache group ``kv_cache_gid`` only to
EAGLE and DFlash proposers; a draft model proposer got group 0's metadata.
With a dense main there is one group and that is right; beside a hybrid main
group 0 is the main model's (GDN or attention) group, so the draft model wrote
its K/V into the main model's blocks and greedy outputs with speculation
diverged from those without at the first verified token.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

pytestmark = pytest.mark.cpu_test


class _Buffer:
    def __init__(self, t: torch.Tensor):
        self.gpu = self.cpu = t
        self.np = t.numpy()


class _BlockTable:
    def __init__(self, table: torch.Tensor):
        self.table = table

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        return self.table[:num_reqs]


def _runner(num_groups: int, drafter) -> GPUModelRunner:
    runner = GPUModelRunner.__new__(GPUModelRunner)
    spec = SimpleNamespace()  # not an EncoderOnlyAttentionSpec
    runner.kv_cache_config = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=spec) for _ in range(num_groups)
        ],
        has_mamba_layers=False,
    )
    runner.attn_groups = [[] for _ in range(num_groups)]
    num_reqs, width = 2, 4
    runner.input_batch = SimpleNamespace(
        num_computed_tokens_cpu_tensor=torch.tensor([10, 20], dtype=torch.int32),
        num_prompt_tokens_cpu_tensor=torch.tensor([5, 5], dtype=torch.int32),
        # Group g's block table holds 100 * g + j.
        block_table=[
            _BlockTable(
                torch.arange(width, dtype=torch.int32).repeat(num_reqs, 1) + 100 * g
            )
            for g in range(num_groups)
        ],
    )
    runner.optimistic_seq_lens_cpu = torch.tensor([11, 21], dtype=torch.int32)
    runner.query_start_loc = _Buffer(torch.tensor([0, 1, 2], dtype=torch.int32))
    runner.seq_lens = torch.tensor([11, 21], dtype=torch.int32)
    runner.positions = torch.zeros(2, dtype=torch.int64)
    runner.routed_experts_initialized = False
    runner.use_async_spec_decode = False
    runner.dcp_world_size = 1
    runner.cache_config = SimpleNamespace(kv_sharing_fast_prefill=False)
    runner.max_model_len = 64
    runner.speculative_config = SimpleNamespace(num_speculative_tokens=3)
    runner.drafter = drafter
    runner.is_mm_prefix_lm = False
    runner._get_encoder_seq_lens = lambda *args, **kwargs: (None, None)
    return runner


def test_draft_model_gets_its_own_kv_cache_group():
    drafter = DraftModelProposer.__new__(DraftModelProposer)
    drafter.kv_cache_gid = 2  # main GDN group 0, main attention group 1
    runner = _runner(3, drafter)
    slot_mappings = {g: torch.full((2,), 1000 * g, dtype=torch.int64) for g in range(3)}
    _, spec_cam = GPUModelRunner._build_attention_metadata(
        runner,
        num_tokens=2,
        num_reqs=2,
        max_query_len=1,
        slot_mappings=slot_mappings,
    )
    assert spec_cam.block_table_tensor[0, 0].item() == 200
    assert spec_cam.slot_mapping.tolist() == [2000, 2000]
