# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A decode row's most recent tokens read at the model dtype, as one more
split of the TurboQuant split-KV decode.

With a raw window of ``W`` (``turboquant.raw_window``) a decode row of
sequence length ``L`` attends to positions ``[0, L - W)`` through the packed
cache and to ``[L - W, L)`` through the layer's raw twin: a model-dtype
sliding-window cache that holds each token as the quantizer sees it (key
shifted, scaled and rotated, value rotated; ``raw_window.twin_kv``). Its
scores are therefore in the stage 1's units: ``q_in . k`` with the query
stage 1 reads, and the same key-offset shift on every key. This kernel writes
the window's normalized partial output and log2-sum-exp into one split slot
of the decode's scratch, so the existing merge weighs it against the packed
splits, and rotates the sum back where values are stored rotated.

One program per (row, KV head) reads the ``W`` keys and values once for all
of the head's query heads.
"""

from dataclasses import dataclass

import torch

from vllm.triton_utils import tl, triton
from vllm.triton_utils.compiled_launch import launcher

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class RawWindow:
    """Where a layer's raw window lives for one decode call.

    ``key_cache`` / ``value_cache``: [num_blocks, block_size, Hk, D] views
    of the twin's cache (any strides, last dimension contiguous);
    ``block_table``: the twin group's [num_reqs, max_blocks] rows, row ``i``
    the decode row ``i``'s; ``size``: the window ``W``.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    size: int

    def write_partial(self, q_in, seq_lens, mid, split, scale) -> None:
        """``decode_attention``'s hook: ``raw_window_partial`` of this window."""
        raw_window_partial(q_in, self, seq_lens, mid, split, scale)


@triton.jit
def _tq_raw_window_partial(
    Q_ptr,  # [B, Hq, D], the query stage 1 reads
    K_ptr,  # twin keys [blocks, block_size, Hk, D]
    V_ptr,  # twin values, same shape
    BT_ptr,  # [reqs, max_blocks] int32
    Seq_lens_ptr,  # [B] int32
    Mid_ptr,  # [B, Hq, >= split + 1, D + 1] fp32
    split,
    block_size,
    sm_scale_log2,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_btb,
    stride_mb,
    stride_mh,
    stride_ms,
    WINDOW: tl.constexpr,
    WINDOW_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(Seq_lens_ptr + row)
    offs_w = tl.arange(0, WINDOW_PAD)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    pos = seq_len - WINDOW + offs_w
    live = (offs_w < WINDOW) & (pos >= 0)
    pos = tl.where(live, pos, 0)
    block = tl.load(BT_ptr + row * stride_btb + pos // block_size, mask=live, other=0)
    within = pos % block_size
    k_rows = K_ptr + block.to(tl.int64) * stride_kb + within * stride_kt
    v_rows = V_ptr + block.to(tl.int64) * stride_vb + within * stride_vt
    k = tl.load(
        k_rows[:, None] + kv_head * stride_kh + offs_d[None, :],
        mask=live[:, None],
        other=0.0,
    ).to(tl.float32)
    v = tl.load(
        v_rows[:, None] + kv_head * stride_vh + offs_d[None, :],
        mask=live[:, None],
        other=0.0,
    ).to(tl.float32)
    heads = kv_head * GROUP + offs_g
    head_live = offs_g < GROUP
    q = tl.load(
        Q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=head_live[:, None],
        other=0.0,
    ).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale_log2
    s = tl.where(live[None, :], s, float("-inf"))
    m = tl.max(s, axis=1)
    # A row with no live position (CUDA-graph padding) stores lse = -inf,
    # which the merge weighs 0.
    ref = tl.where(m > float("-inf"), m, 0.0)
    p = tl.where(live[None, :], tl.exp2(s - ref[:, None]), 0.0)
    den = tl.sum(p, axis=1)
    out = tl.dot(p, v, input_precision="ieee") / tl.where(den > 0.0, den, 1.0)[:, None]
    lse = tl.where(den > 0.0, ref + tl.log2(den), float("-inf"))
    mid = Mid_ptr + row * stride_mb + heads * stride_mh + split * stride_ms
    tl.store(mid[:, None] + offs_d[None, :], out, mask=head_live[:, None])
    tl.store(mid + HEAD_DIM, lse, mask=head_live)


def raw_window_partial(
    q_in: torch.Tensor,
    window: RawWindow,
    seq_lens: torch.Tensor,
    mid: torch.Tensor,
    split: int,
    scale: float,
) -> None:
    """Write the window's partial result of every (row, query head) into
    ``mid[:, :, split]``: the output over positions ``[L - W, L)`` and its
    log2-sum-exp in units of ``scale * log2(e)``, as stage 1 writes a split."""
    B, Hq, D = q_in.shape
    k, v = window.key_cache, window.value_cache
    Hk = k.shape[2]
    if k.shape[3] != D or v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(
            f"the raw window's key and value caches must be [blocks, block_size, "
            f"{Hk}, {D}] with the last dimension contiguous, got "
            f"{tuple(k.shape)} / {tuple(v.shape)}"
        )
    if B == 0:
        return
    group = Hq // Hk
    launcher(_tq_raw_window_partial)[(B, Hk)](
        q_in,
        k,
        v,
        window.block_table,
        seq_lens,
        mid,
        split,
        k.shape[1],
        scale * _LOG2E,
        q_in.stride(0),
        q_in.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        window.block_table.stride(0),
        mid.stride(0),
        mid.stride(1),
        mid.stride(2),
        WINDOW=window.size,
        WINDOW_PAD=max(16, triton.next_power_of_2(window.size)),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=D,
        num_warps=4 if D <= 128 else 8,
    )
