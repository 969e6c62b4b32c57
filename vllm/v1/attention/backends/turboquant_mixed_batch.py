# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A mixed decode/prefill step's two halves of TurboQuant metadata, made once
per step.

TurboQuant's forward serves a step that holds decode rows and prefill chunks
by cutting the step's metadata in two: a decode half (the first
``num_decodes`` requests) and a prefill half (the rest, query offsets moved
to start at 0). The cut is eight tensor slices, one subtraction launched on
the device and two metadata objects, and it is the same for every layer of
the step. A mixed step never runs in a full CUDA graph, so each cut is host
time: 26-44 µs on an H200 host, which a layer that cuts for itself pays
before its first kernel (36 times a step on Qwen3-4B). The builder cuts once
per step (``mixed_batch_parts``) and the layers read the halves.
"""

from typing import Any


def mixed_batch_parts(meta: Any) -> tuple[Any, Any]:
    """The decode half and the prefill half of ``meta``, a
    ``TurboQuantMetadata`` of a step with decode rows first and at least one
    prefill request, as objects of its own class: views of its tensors, the
    prefill half's query offsets the one tensor computed.

    The prefill half's longest context is its prefill batch's (planned on the
    host) where the builder planned one; otherwise it is read from the
    device, a host sync that only metadata built outside the builder pays.
    """
    nd, ndt = meta.num_decodes, meta.num_decode_tokens
    n = meta.num_actual_tokens
    cls = type(meta)
    decode = cls(
        seq_lens=meta.seq_lens[:nd],
        slot_mapping=meta.slot_mapping[:ndt],
        block_table=meta.block_table[:nd],
        query_start_loc=meta.query_start_loc[: nd + 1],
        num_actual_tokens=ndt,
        max_query_len=1,
        # Every decode row's context fits the whole step's longest.
        max_seq_len=meta.max_seq_len,
        is_prefill=False,
        decode_seq_lens=meta.decode_seq_lens,
        decode_block_table=meta.decode_block_table,
    )
    batch = meta.prefill_batch
    prefill_seq_lens = meta.seq_lens[nd:]
    prefill = cls(
        seq_lens=prefill_seq_lens,
        slot_mapping=meta.slot_mapping[ndt:n],
        block_table=meta.block_table[nd:],
        query_start_loc=meta.query_start_loc[nd:] - ndt,
        num_actual_tokens=n - ndt,
        max_query_len=meta.max_query_len,
        # Decode rows' contexts would inflate it and keep FlashAttention
        # off its first-chunk path.
        max_seq_len=(
            batch.max_seq_len
            if batch is not None
            else int(prefill_seq_lens.max().item())
        ),
        is_prefill=True,
        prefill_batch=batch,
    )
    return decode, prefill
