# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A mixed decode/prefill step cuts its TurboQuant metadata in two once.

0.20.2's forward builds the decode half and the prefill half of a mixed
step's metadata in every layer (eight slices, a subtraction on the device,
two metadata objects), identical across the step's layers. The builder now
makes them once; every layer reads them. These tests drive the real builder
and ``forward`` on test_turboquant_prefill_batch's step (a decode row, two
first chunks, a continuation) under the Triton CPU interpreter
(``HYBRIDKV_TRITON_INTERPRET=1``) and natively on a GPU.
"""

import dataclasses

import pytest
import torch

from tests.kernels.attention.test_turboquant_prefill_batch import (
    Q_LENS,
    SEQ_LENS,
    TOL,
    _builder,
    _error,
    _run,
    _step,
    flash,  # noqa: F401 (a fixture)
)
from vllm.v1.attention.backends import turboquant_attn
from vllm.v1.attention.backends.turboquant_attn import TurboQuantMetadata
from vllm.v1.attention.backends.turboquant_mixed_batch import mixed_batch_parts


def _table(device):
    pages = [(s + 15) // 16 for s in SEQ_LENS]
    table = torch.zeros(len(SEQ_LENS), max(pages), dtype=torch.int32)
    first = 1
    for row, n in enumerate(pages):
        table[row, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    return table.to(device)


def test_the_builder_cuts_a_mixed_step_once():
    table = _table("cpu")
    meta = _builder(64).build(0, _step(table, "cpu"))
    decode, prefill = meta.mixed_parts
    assert type(decode) is TurboQuantMetadata and type(prefill) is TurboQuantMetadata
    # One decode row, then three prefill requests of 6, 5 and 3 tokens.
    assert (decode.num_actual_tokens, decode.max_query_len) == (1, 1)
    assert not decode.is_prefill and decode.prefill_batch is None
    assert decode.seq_lens.tolist() == SEQ_LENS[:1]
    assert torch.equal(decode.block_table, table[:1])
    assert torch.equal(decode.slot_mapping, meta.slot_mapping[:1])
    assert decode.query_start_loc.tolist() == [0, 1]
    assert decode.max_seq_len == meta.max_seq_len
    assert prefill.is_prefill and prefill.prefill_batch is meta.prefill_batch
    assert prefill.num_actual_tokens == sum(Q_LENS) - 1
    assert prefill.seq_lens.tolist() == SEQ_LENS[1:]
    assert torch.equal(prefill.block_table, table[1:])
    assert torch.equal(prefill.slot_mapping, meta.slot_mapping[1:])
    assert prefill.query_start_loc.tolist() == [0, 6, 11, 14]
    assert prefill.max_seq_len == max(SEQ_LENS[1:])
    # Views of the step's tensors: an in-place update reaches the halves.
    assert decode.seq_lens.data_ptr() == meta.seq_lens.data_ptr()


@pytest.mark.parametrize(
    "q_lens,seq_lens", [([1, 1], [20, 9]), ([6, 3], [6, 3])], ids=["decode", "prefill"]
)
def test_steps_that_are_not_mixed_have_no_halves(q_lens, seq_lens):
    table = torch.arange(1, 5, dtype=torch.int32).view(2, 2)
    meta = _builder(64).build(0, _step(table, "cpu", q_lens, seq_lens))
    assert meta.mixed_parts is None


def test_metadata_built_elsewhere_is_cut_on_the_spot():
    """Metadata a caller built itself (no halves) is cut as the builder
    cuts it; its prefill half reads its longest context from the device."""
    table = _table("cpu")
    meta = _builder(64).build(0, _step(table, "cpu"))
    bare = dataclasses.replace(meta, mixed_parts=None, prefill_batch=None)
    for built, cut in zip(meta.mixed_parts, mixed_batch_parts(bare)):
        for field in ("seq_lens", "slot_mapping", "block_table", "query_start_loc"):
            assert torch.equal(getattr(built, field), getattr(cut, field)), field
        assert built.max_seq_len == cut.max_seq_len
        assert built.num_actual_tokens == cut.num_actual_tokens


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
def test_a_mixed_forward_makes_no_metadata(preset, triton_device, flash, monkeypatch):  # noqa: F811
    """The layers of a mixed step make no metadata of their own (0.20.2's
    made two per layer), and the step's output is what it was: k8v4 holds
    these K/V exactly, so it matches float64 attention to fp32 rounding."""
    made = []
    init = TurboQuantMetadata.__init__
    forward = turboquant_attn.TurboQuantAttentionImpl.forward
    inside = []

    def counting_init(self, *args, **kwargs):
        if inside:
            made.append(kwargs.get("num_actual_tokens"))
        init(self, *args, **kwargs)

    def watched_forward(self, *args, **kwargs):
        inside.append(True)
        try:
            return forward(self, *args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(TurboQuantMetadata, "__init__", counting_init)
    monkeypatch.setattr(
        turboquant_attn.TurboQuantAttentionImpl, "forward", watched_forward
    )
    run = _run(preset, triton_device, monkeypatch)
    assert made == []
    if preset == "turboquant_k8v4":
        assert _error(run) < TOL
    # Metadata without its halves gives the same output, bit for bit.
    meta = _builder(64).build(0, _step(run.table, triton_device))
    bare = dataclasses.replace(meta, mixed_parts=None)
    out = run.impl.forward(
        run.layer,
        run.q.view(-1, run.q.shape[1] * run.q.shape[2]),
        run.k_new.reshape(run.k_new.shape[0], -1),
        run.v_new.reshape(run.v_new.shape[0], -1),
        run.cache,
        bare,
        output=torch.full_like(run.out.view(run.out.shape[0], -1), float("nan")),
    )
    assert torch.equal(out.view_as(run.out), run.out)
    assert made == [1, sum(Q_LENS) - 1]  # cut on the spot, as 0.20.2 cuts it
