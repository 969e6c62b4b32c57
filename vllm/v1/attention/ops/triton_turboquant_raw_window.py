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
of the decode's scratch, which the existing merge weighs against the packed
splits (at one packed split, stage 1 weighs it into its output); the sum is
rotated back where values are stored rotated.

Where the query is rotated by the backend's Hadamard matrix (the MSE-key
presets), the window is attended in the rotation's own launch, so the
window adds no launch; FP8 keys (k8v4) and other rotations take a launch of
their own. Either launch runs one program per (row, query head), each
summing its W products in fp32 (a program per KV head that shared one
fp32 ``tl.dot`` over its query heads ran a few programs on a few SMs: 1.34x
a Gemma 4 head_dim-512 4 x 8K k8v4 decode, benchmarks/NOTES.md), and
writes the packed splits' lengths, ``max(L - W, 0)``.
"""

from dataclasses import dataclass

import torch

from vllm.triton_utils import tl, triton
from vllm.triton_utils.compiled_launch import launcher
from vllm.utils.math_utils import next_power_of_2
from vllm.v1.attention.ops.triton_turboquant_rotate_query import _rotated_query_row

_LOG2E = 1.4426950408889634


@triton.jit
def _window_rows(
    BT_ptr, Req_ptr, row, seq_len, block_size, stride_btb, WINDOW, WINDOW_PAD, HAS_REQ
):
    """(live, block, position in block) of a row's last WINDOW positions; the
    row's block-table row is its request's (HAS_REQ: verify rows) or its own."""
    table_row = tl.load(Req_ptr + row) if HAS_REQ else row
    offs_w = tl.arange(0, WINDOW_PAD)
    pos = seq_len - WINDOW + offs_w
    live = (offs_w < WINDOW) & (pos >= 0)
    pos = tl.where(live, pos, 0)
    block = tl.load(
        BT_ptr + table_row * stride_btb + pos // block_size, mask=live, other=0
    )
    return live, block.to(tl.int64), pos % block_size


@triton.jit
def _window_into_split(
    y,  # [D] fp32: the query row in stage 1's units
    K_ptr,
    V_ptr,
    BT_ptr,
    Req_ptr,
    Seq_lens_ptr,
    Packed_lens_ptr,
    Mid_ptr,
    row,
    head,
    split,
    block_size,
    sm_scale_log2,
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
    GROUP: tl.constexpr,
    D: tl.constexpr,
    WINDOW: tl.constexpr,
    WINDOW_PAD: tl.constexpr,
    HAS_REQ: tl.constexpr,
):
    """One (row, query head)'s window: its normalized partial output and
    log2-sum-exp into split ``split`` of the scratch; head 0 also writes
    the row's packed length."""
    kv_head = head // GROUP
    offs = tl.arange(0, D)
    seq_len = tl.load(Seq_lens_ptr + row)
    if head == 0:
        tl.store(Packed_lens_ptr + row, tl.maximum(seq_len - WINDOW, 0))
    live, block, within = _window_rows(
        BT_ptr, Req_ptr, row, seq_len, block_size, stride_btb, WINDOW, WINDOW_PAD,
        HAS_REQ,
    )  # fmt: skip
    k = tl.load(
        (K_ptr + block * stride_kb + within * stride_kt + kv_head * stride_kh)[:, None]
        + offs[None, :],
        mask=live[:, None],
        other=0.0,
    ).to(tl.float32)
    s = tl.sum(k * y[None, :], axis=1) * sm_scale_log2
    s = tl.where(live, s, float("-inf"))
    m = tl.max(s, axis=0)
    # A row with no live position (CUDA-graph padding) stores lse = -inf,
    # which the merge weighs 0.
    ref = tl.where(m > float("-inf"), m, 0.0)
    p = tl.where(live, tl.exp2(s - ref), 0.0)
    den = tl.sum(p, axis=0)
    v = tl.load(
        (V_ptr + block * stride_vb + within * stride_vt + kv_head * stride_vh)[:, None]
        + offs[None, :],
        mask=live[:, None],
        other=0.0,
    ).to(tl.float32)
    out = tl.sum(p[:, None] * v, axis=0) / tl.where(den > 0.0, den, 1.0)
    mid = Mid_ptr + row * stride_mb + head * stride_mh + split * stride_ms
    tl.store(mid + offs, out)
    tl.store(mid + D, tl.where(den > 0.0, ref + tl.log2(den), float("-inf")))


@triton.jit
def _tq_rotate_and_window(
    Q_ptr,  # [B, Hq, D] model dtype, last dim contiguous
    PiT_ptr,  # the backend's scaled Hadamard matrix: only [0, 0] is read
    KeyScale_ptr,  # [D] fp32 (HAS_KEY_SCALE)
    KeyOffset_ptr,  # [Hk, D] fp32 (HAS_KEY_OFFSET)
    Qin_ptr,  # [B, Hq, D] fp32 out: the rotated query
    QMu_ptr,  # [B, Hq] fp32 out: q . key_offset (HAS_KEY_OFFSET)
    K_ptr,  # twin keys [blocks, block_size, Hk, D]
    V_ptr,  # twin values, same shape
    BT_ptr,  # [reqs, max_blocks] int32
    Req_ptr,  # [B] int32: each row's request (HAS_REQ)
    Seq_lens_ptr,  # [B] int32
    Packed_lens_ptr,  # [B] int32 out: max(L - WINDOW, 0)
    Mid_ptr,  # [B, Hq, >= split + 1, D + 1] fp32
    split,
    block_size,
    sm_scale_log2,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
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
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    LOG2_D: tl.constexpr,
    WINDOW: tl.constexpr,
    WINDOW_PAD: tl.constexpr,
    HAS_KEY_SCALE: tl.constexpr,
    HAS_KEY_OFFSET: tl.constexpr,
    HAS_REQ: tl.constexpr,
):
    row = tl.program_id(0) // HQ
    head = tl.program_id(0) % HQ
    y = _rotated_query_row(
        Q_ptr, PiT_ptr, KeyScale_ptr, KeyOffset_ptr, QMu_ptr, row, head, stride_qb,
        stride_qh, HQ, GROUP, D, LOG2_D, HAS_KEY_SCALE, HAS_KEY_OFFSET,
    )  # fmt: skip
    tl.store(Qin_ptr + row * stride_ob + head * stride_oh + tl.arange(0, D), y)
    _window_into_split(
        y, K_ptr, V_ptr, BT_ptr, Req_ptr, Seq_lens_ptr, Packed_lens_ptr, Mid_ptr, row,
        head, split, block_size, sm_scale_log2, stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh, stride_btb, stride_mb, stride_mh, stride_ms,
        GROUP, D, WINDOW, WINDOW_PAD, HAS_REQ,
    )  # fmt: skip


@triton.jit
def _tq_window(
    Q_ptr,  # [B, Hq, D], the query stage 1 reads, last dim contiguous
    K_ptr,  # twin keys [blocks, block_size, Hk, D]
    V_ptr,  # twin values, same shape
    BT_ptr,  # [reqs, max_blocks] int32
    Req_ptr,  # [B] int32: each row's request (HAS_REQ)
    Seq_lens_ptr,  # [B] int32
    Packed_lens_ptr,  # [B] int32 out: max(L - WINDOW, 0)
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
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    WINDOW: tl.constexpr,
    WINDOW_PAD: tl.constexpr,
    HAS_REQ: tl.constexpr,
):
    row = tl.program_id(0) // HQ
    head = tl.program_id(0) % HQ
    y = tl.load(Q_ptr + row * stride_qb + head * stride_qh + tl.arange(0, D))
    _window_into_split(
        y.to(tl.float32), K_ptr, V_ptr, BT_ptr, Req_ptr, Seq_lens_ptr,
        Packed_lens_ptr, Mid_ptr, row, head, split, block_size, sm_scale_log2,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_btb, stride_mb, stride_mh, stride_ms, GROUP, D, WINDOW, WINDOW_PAD,
        HAS_REQ,
    )  # fmt: skip


@dataclass(frozen=True)
class RawWindow:
    """A layer's raw window for one decode call: the hooks
    ``decode_attention`` calls.

    ``key_cache`` / ``value_cache``: [num_blocks, block_size, Hk, D] views
    of the twin's cache (any strides, last dimension contiguous);
    ``block_table``: the twin group's [num_reqs, max_blocks] rows;
    ``size``: the window ``W``; ``row_requests``: [B] int32, each decode
    row's request (speculative verify rows), or None when row ``i`` is
    request ``i``.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    size: int
    row_requests: torch.Tensor | None = None

    def _check(self, D: int) -> None:
        k, v = self.key_cache, self.value_cache
        if (
            k.shape[3] != D
            or v.shape != k.shape
            or k.stride(-1) != 1
            or v.stride(-1) != 1
        ):
            raise ValueError(
                f"the raw window's key and value caches must be [blocks, block_size, "
                f"{k.shape[2]}, {D}] with the last dimension contiguous, got "
                f"{tuple(k.shape)} / {tuple(v.shape)}"
            )

    def _args(self, seq_lens, mid, split, scale):
        k, v = self.key_cache, self.value_cache
        packed = torch.empty_like(seq_lens)
        reqs = self.row_requests
        return packed, (
            k, v, self.block_table, seq_lens if reqs is None else reqs, seq_lens,
            packed, mid, split, k.shape[1],
            scale * _LOG2E,
        ), (
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), self.block_table.stride(0), mid.stride(0), mid.stride(1),
            mid.stride(2),
        )  # fmt: skip

    def rotate_and_attend(
        self, query, PiT, key_scale, key_offset, seq_lens, mid, split, scale
    ):
        """``rotate_query`` (with ``key_offset``: ``rotate_query_with_offset``)
        and the window's partial result into ``mid[:, :, split]``, in one
        launch: returns (the rotated query, ``q . key_offset`` or None, the
        packed splits' lengths)."""
        B, Hq, D = query.shape
        self._check(D)
        if query.stride(-1) != 1:
            query = query.contiguous()
        q_in = torch.empty(B, Hq, D, dtype=torch.float32, device=query.device)
        qmu = None if key_offset is None else torch.empty(
            B, Hq, dtype=torch.float32, device=query.device
        )  # fmt: skip
        packed, args, strides = self._args(seq_lens, mid, split, scale)
        if B == 0:
            return q_in, qmu, packed
        Hk = self.key_cache.shape[2]
        launcher(_tq_rotate_and_window)[(B * Hq,)](
            query, PiT, PiT if key_scale is None else key_scale,
            PiT if key_offset is None else key_offset, q_in,
            q_in if qmu is None else qmu, *args,
            query.stride(0), query.stride(1), q_in.stride(0), q_in.stride(1),
            *strides,
            HQ=Hq, GROUP=Hq // Hk, D=D, LOG2_D=D.bit_length() - 1,
            WINDOW=self.size, WINDOW_PAD=next_power_of_2(self.size),
            HAS_KEY_SCALE=key_scale is not None,
            HAS_KEY_OFFSET=key_offset is not None,
            HAS_REQ=self.row_requests is not None,
            num_warps=1 if D <= 128 else (2 if D <= 256 else 4),
        )  # fmt: skip
        return q_in, qmu, packed

    def attend(self, q_in, seq_lens, mid, split, scale):
        """The window's partial result of every (row, query head) of the
        query stage 1 reads into ``mid[:, :, split]``: its output over
        positions ``[L - W, L)`` and log2-sum-exp in units of
        ``scale * log2(e)``, as stage 1 writes a split. Returns the packed
        splits' lengths."""
        B, Hq, D = q_in.shape
        self._check(D)
        packed, args, strides = self._args(seq_lens, mid, split, scale)
        if B == 0:
            return packed
        if q_in.stride(-1) != 1:
            q_in = q_in.contiguous()
        launcher(_tq_window)[(B * Hq,)](
            q_in, *args, q_in.stride(0), q_in.stride(1), *strides,
            HQ=Hq, GROUP=Hq // self.key_cache.shape[2], D=D, WINDOW=self.size,
            WINDOW_PAD=next_power_of_2(self.size),
            HAS_REQ=self.row_requests is not None,
            num_warps=1 if D <= 128 else (2 if D <= 256 else 4),
        )  # fmt: skip
        return packed
