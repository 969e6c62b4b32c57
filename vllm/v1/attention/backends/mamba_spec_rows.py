# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which rows the GDN and Mamba2 builders run on the speculative path.

After a speculative step accepts ``n`` tokens of a request, its valid conv
history sits at offset ``n - 1`` of the conv state and its valid SSM state in
column ``n - 1`` of the request's state blocks. Only the speculative kernels
(``causal_conv1d_update`` / ``fused_sigmoid_gating_delta_rule_update`` /
``selective_state_update`` with ``num_accepted_tokens``) read that offset; the
non-speculative decode and prefill kernels read offset and column 0.

So, whenever speculative decoding is configured, a row is a *speculative row*
when it is a decode row whose query is exactly its last sampled token plus its
drafts (``num_scheduled == 1 + num_drafts``), including a decode row that got
no drafts this step (ngram found no match: ``num_scheduled == 1``). Those rows
get the previous step's accepted count on every step, whether or not any row
of the batch drafted. Every other row is a prefill-type row (-1):

* a chunked-prefill chunk, including a one-token tail (``num_computed <
  num_prompt``): the previous step ran it on the prefill path, which left its
  state at offset 0, and a prefill row's accepted count is 1;
* a recompute chunk of a preempted request that has passed its prompt
  (``num_computed >= num_prompt``, more than one token, no drafts): the
  speculative kernels keep one state per query token and the next step would
  read the state after the first token (its accepted count is 1), so it must
  run on the prefill path. A one-token final recompute chunk is a speculative
  row with accepted count 1 (offset 0 is where the previous recompute chunk
  left the state).

The speculative rows lead the batch: the GDN speculative kernels index the
gating inputs with the speculative rows' own token offsets, and the Mamba2
builder splits decodes from prefills at the first prefill-type row.
"""

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_input_batch import InputBatch

NOT_SPEC_ROW = -1


def spec_row_draft_counts(
    num_scheduled_tokens: np.ndarray,
    num_draft_tokens: np.ndarray,
    num_computed_tokens: np.ndarray,
    num_prompt_tokens: np.ndarray,
) -> np.ndarray:
    """Drafts each speculative row verifies (0 for a zero-draft decode row),
    ``NOT_SPEC_ROW`` for prefill-type rows."""
    done_prefilling = num_computed_tokens >= num_prompt_tokens
    spec_row = done_prefilling & (num_scheduled_tokens == 1 + num_draft_tokens)
    return np.where(spec_row, num_draft_tokens, NOT_SPEC_ROW).astype(np.int32)


def _scheduled_draft_counts(
    input_batch: "InputBatch", scheduler_output: "SchedulerOutput", num_reqs: int
) -> np.ndarray:
    drafts = scheduler_output.scheduled_spec_decode_tokens
    return np.array(
        [len(drafts.get(req_id, ())) for req_id in input_batch.req_ids[:num_reqs]],
        dtype=np.int32,
    )


def _batch_draft_counts(
    input_batch: "InputBatch",
    scheduler_output: "SchedulerOutput",
    num_scheduled_tokens: np.ndarray,
) -> np.ndarray:
    num_reqs = num_scheduled_tokens.shape[0]
    return spec_row_draft_counts(
        num_scheduled_tokens,
        _scheduled_draft_counts(input_batch, scheduler_output, num_reqs),
        input_batch.num_computed_tokens_cpu[:num_reqs],
        input_batch.num_prompt_tokens[:num_reqs],
    )


def reset_spec_row_buffers(decode_draft_tokens, num_accepted_tokens) -> None:
    """Start the runner's buffers at "no speculative row, accepted count 1".

    Dummy runs (profiling, warm-up before graph capture, idle data-parallel
    ranks) hand these buffers to the builders without filling them first;
    zeros would make every dummy row a speculative row with accepted count 0,
    whose kernels read state offset -1."""
    for buffer, value in (
        (decode_draft_tokens, NOT_SPEC_ROW),
        (num_accepted_tokens, 1),
    ):
        buffer.cpu.fill_(value)
        buffer.gpu.fill_(value)


def fill_decode_draft_tokens(
    decode_draft_tokens,
    input_batch: "InputBatch",
    scheduler_output: "SchedulerOutput",
    num_scheduled_tokens: np.ndarray,
) -> None:
    """Write this step's per-row draft counts (``-1`` for prefill-type and
    padded rows) into the runner's ``num_decode_draft_tokens`` buffer. Runs on
    every step of a speculative run, not only on steps that carry drafts."""
    num_reqs = num_scheduled_tokens.shape[0]
    decode_draft_tokens.np[:num_reqs] = _batch_draft_counts(
        input_batch, scheduler_output, num_scheduled_tokens
    )
    decode_draft_tokens.np[num_reqs:].fill(NOT_SPEC_ROW)
    decode_draft_tokens.copy_to_gpu()


def move_spec_rows_first(
    input_batch: "InputBatch",
    scheduler_output: "SchedulerOutput",
    decode_threshold: int,
) -> None:
    """Within the decode region left by
    ``reorder_batch_to_split_decodes_and_prefills`` (rows with context, done
    with their prompt, at most ``decode_threshold`` tokens), put speculative
    rows before the multi-token recompute chunks of resumed requests."""
    num_reqs = len(input_batch.req_ids)
    if num_reqs == 0:
        return
    num_scheduled_tokens = np.array(
        [scheduler_output.num_scheduled_tokens[r] for r in input_batch.req_ids],
        dtype=np.int32,
    )
    num_computed = input_batch.num_computed_tokens_cpu[:num_reqs]
    in_decode_region = (
        (num_computed > 0)
        & (num_computed >= input_batch.num_prompt_tokens[:num_reqs])
        & (num_scheduled_tokens <= decode_threshold)
    )
    num_in_region = int(in_decode_region.sum())
    spec_row = (
        _batch_draft_counts(input_batch, scheduler_output, num_scheduled_tokens)
        != NOT_SPEC_ROW
    )[:num_in_region]
    # Two-pointer partition; order among rows of one kind does not matter.
    front, back = 0, num_in_region - 1
    while True:
        while front < back and spec_row[front]:
            front += 1
        while front < back and not spec_row[back]:
            back -= 1
        if front >= back:
            return
        input_batch.swap_states(front, back)
        spec_row[front], spec_row[back] = True, False


def mark_non_spec_rows_prefilling(
    common_attn_metadata: "CommonAttentionMetadata",
    num_decode_draft_tokens_cpu: torch.Tensor | None,
) -> "CommonAttentionMetadata":
    """For the Mamba2 builder, which sends every short non-prefilling row to
    its speculative decode kernels: mark prefill-type rows (``-1`` with a
    non-empty query) as prefilling so they take the prefill path."""
    is_prefilling = common_attn_metadata.is_prefilling
    if num_decode_draft_tokens_cpu is None or is_prefilling is None:
        return common_attn_metadata
    num_reqs = common_attn_metadata.num_reqs
    query_start_loc_cpu = common_attn_metadata.query_start_loc_cpu
    query_lens = query_start_loc_cpu[1 : num_reqs + 1] - query_start_loc_cpu[:num_reqs]
    prefill_type = (num_decode_draft_tokens_cpu[:num_reqs] == NOT_SPEC_ROW) & (
        query_lens > 0
    )
    if not bool((prefill_type & ~is_prefilling[:num_reqs]).any()):
        return common_attn_metadata
    return replace(
        common_attn_metadata, is_prefilling=is_prefilling[:num_reqs] | prefill_type
    )
