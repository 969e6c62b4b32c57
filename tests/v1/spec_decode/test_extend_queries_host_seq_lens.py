# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``extend_all_queries_by_N`` keeps the host copies of seq_lens in step.

A draft model's first pass extends every request's query by its extra slot
(``DraftModelProposer``; parallel drafting by k). 0.20.2 added N to the
device ``seq_lens`` and to the host ``query_start_loc_cpu`` but left
``seq_lens_cpu_upper_bound`` and ``_seq_lens_cpu`` as they were: a builder
that plans from the host copies (no device sync) saw every context N tokens
short of the device's, and N more query tokens than context minus cache.
"""

import pytest
import torch

from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.utils import extend_all_queries_by_N

Q_LENS, SEQ_LENS = [4, 4, 1, 0], [20, 37, 9, 0]  # the last row: CUDA-graph padding


def _target(with_host_seq_lens: bool) -> CommonAttentionMetadata:
    cu = torch.tensor([0, *Q_LENS]).cumsum(0).to(torch.int32)
    seq = torch.tensor(SEQ_LENS, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=cu.clone(),
        query_start_loc_cpu=cu,
        seq_lens=seq.clone(),
        num_reqs=len(Q_LENS),
        num_actual_tokens=sum(Q_LENS),
        max_query_len=max(Q_LENS),
        max_seq_len=max(SEQ_LENS),
        block_table_tensor=torch.zeros(len(Q_LENS), 4, dtype=torch.int32),
        slot_mapping=torch.zeros(sum(Q_LENS), dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq.clone() if with_host_seq_lens else None,
        _seq_lens_cpu=seq.clone() if with_host_seq_lens else None,
        _num_computed_tokens_cpu=(seq - (cu[1:] - cu[:-1]))
        if with_host_seq_lens
        else None,
    )


@pytest.mark.parametrize("n", [1, 3])
def test_host_seq_lens_follow_the_extended_queries(n):
    target = _target(with_host_seq_lens=True)
    computed = target._num_computed_tokens_cpu.clone()
    extended = extend_all_queries_by_N(
        target,
        N=n,
        arange=torch.arange(len(Q_LENS) + 1, dtype=torch.int32),
        new_slot_mapping=torch.zeros(sum(Q_LENS) + n * len(Q_LENS)),
    )
    want = torch.tensor(SEQ_LENS, dtype=torch.int32) + n
    assert torch.equal(extended.seq_lens, want)
    assert torch.equal(extended.seq_lens_cpu_upper_bound, want)
    assert torch.equal(extended._seq_lens_cpu, want)
    # Context and query both grew by N: the cached part is the same.
    host_q = extended.query_start_loc_cpu.diff()
    assert torch.equal(extended.seq_lens_cpu_upper_bound - host_q, computed)
    assert torch.equal(extended._num_computed_tokens_cpu, computed)
    # The target's own metadata is left as it was.
    assert torch.equal(target.seq_lens_cpu_upper_bound, want - n)


def test_absent_host_seq_lens_stay_absent():
    extended = extend_all_queries_by_N(
        _target(with_host_seq_lens=False),
        N=1,
        arange=torch.arange(len(Q_LENS) + 1, dtype=torch.int32),
        new_slot_mapping=torch.zeros(sum(Q_LENS) + len(Q_LENS)),
    )
    assert extended.seq_lens_cpu_upper_bound is None
    assert extended._seq_lens_cpu is None
