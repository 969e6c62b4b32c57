# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mamba align mode keeps a request whose step holds fewer draft tokens.

With prefix caching on, hybrid models run their Mamba/GDN layers in
``mamba_cache_mode="align"``, where ``MambaManager.allocate_new_blocks``
sizes a request's blocks from the tokens the main model runs this step,
draft tokens included. Methods whose draft count varies from step to step
(ngram, suffix) can need fewer blocks than the step before: 13 computed
tokens + 1 + 3 drafts reach into block 1; all drafts rejected, the next
step's 14 + 1 tokens fit in block 0. vLLM 0.20.2 asserts there
(``num_required_blocks 1 < len(req_blocks) 2``) and the engine dies: on a
GPU, the prefix-cache matrix under preemption lost both Qwen3-Next
TurboQuant ngram cells that way (``--preempt --only
qwen3_next.turboquant_4bit_nc --hits 14 --new-tokens 480``).

The runner already handles the smaller step: it places the running state by
position (``mamba_utils.preprocess_mamba`` copies it from the previous
step's block) and keeps the request's longer block-table row, so the block
allocated one step early is simply used when the request reaches it.
"""

import pytest
import torch

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.single_type_kv_cache_manager import MambaManager
from vllm.v1.kv_cache_interface import MambaSpec

BLOCK = 16


def _manager(num_speculative_blocks: int) -> MambaManager:
    spec = MambaSpec(
        block_size=BLOCK,
        shapes=((4,),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
        num_speculative_blocks=num_speculative_blocks,
    )
    pool = BlockPool(num_gpu_blocks=32, enable_caching=True, hash_block_size=BLOCK)
    return MambaManager(spec, pool, enable_caching=True, kv_cache_group_id=0)


def _step(manager: MambaManager, tokens: int) -> list:
    """Allocate for a step that ends at ``tokens`` (drafts included)."""
    need = manager.get_num_blocks_to_allocate("r", tokens, [], 0, tokens)
    assert need <= manager.block_pool.get_num_free_blocks()
    return manager.allocate_new_blocks("r", tokens, tokens)


@pytest.mark.parametrize("num_speculative_blocks", [0, 3])
def test_a_step_with_fewer_drafts_keeps_its_blocks(num_speculative_blocks):
    manager = _manager(num_speculative_blocks)
    _step(manager, 10)  # the prompt
    _step(manager, 13)  # decode, no drafts
    _step(manager, 13 + 1 + 3)  # three drafts reach into block 1
    held = list(manager.req_to_blocks["r"])
    # Every draft rejected (14 computed), the next step has none.
    assert _step(manager, 14 + 1) == []
    assert manager.req_to_blocks["r"] == held
    # Growing again uses the block allocated one step early.
    assert _step(manager, 17) == []
    assert manager.req_to_blocks["r"] == held
    assert len(_step(manager, 2 * BLOCK + 1)) == 1
