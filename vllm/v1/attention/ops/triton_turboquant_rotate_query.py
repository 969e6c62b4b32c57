# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The TurboQuant query rotation of a decode step, in one launch.

MSE keys are stored rotated (``k @ PiT``), so decode scores rotate the query
the same way. 0.20.2 runs ``query.float() @ PiT`` per layer and step: a float
copy and an fp32 GEMM on CUDA cores (~8 µs per layer on an H100 for a
64-row batch of a Qwen3-4B shape, 0.3 ms per step over 36 layers). The
backend's ``PiT`` is the scaled Sylvester Hadamard matrix, so the rotation is
the store kernel's in-register Walsh-Hadamard transform
(``turboquant_hadamard._hadamard_rows``), reading the query in its
own dtype: one small launch, no copy. It sums in another order than cuBLAS,
so the result agrees to fp32 rounding.
"""

import torch

from vllm.triton_utils import tl, triton
from vllm.triton_utils.compiled_launch import launcher
from vllm.v1.attention.ops.turboquant_hadamard import (
    _hadamard_rows,
    rotates_in_registers,
)


@triton.jit
def _rotated_query_row(
    Q_ptr,
    PiT_ptr,
    KeyScale_ptr,
    KeyOffset_ptr,
    QMu_ptr,
    row,
    head,
    stride_qb,
    stride_qh,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    LOG2_D: tl.constexpr,
    HAS_KEY_SCALE: tl.constexpr,
    HAS_KEY_OFFSET: tl.constexpr,
):
    """Query head ``head`` of ``row`` rotated (``_tq_rotate_query``'s
    arguments): [D] fp32; stores ``q . key_offset`` first (HAS_KEY_OFFSET)."""
    offs = tl.arange(0, D)
    x = tl.load(Q_ptr + row * stride_qb + head * stride_qh + offs).to(tl.float32)
    if HAS_KEY_OFFSET:
        mu = tl.load(KeyOffset_ptr + (head // GROUP) * D + offs)
        tl.store(QMu_ptr + row * HQ + head, tl.sum(x * mu, axis=0))
    if HAS_KEY_SCALE:
        x = x * tl.load(KeyScale_ptr + offs)
    return _hadamard_rows(x, D, LOG2_D) * tl.load(PiT_ptr)


@triton.jit
def _tq_rotate_query(
    Q_ptr,  # [B, Hq, D] model dtype, last dim contiguous
    PiT_ptr,  # the backend's scaled Hadamard matrix: only [0, 0] is read
    KeyScale_ptr,  # [D] fp32, multiplies the query first (HAS_KEY_SCALE)
    KeyOffset_ptr,  # [Hk, D] fp32 (HAS_KEY_OFFSET)
    Out_ptr,  # [B, Hq, D] fp32
    QMu_ptr,  # [B, Hq] fp32: q . key_offset[kv head] (HAS_KEY_OFFSET)
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    D: tl.constexpr,
    LOG2_D: tl.constexpr,
    HAS_KEY_SCALE: tl.constexpr,
    HAS_KEY_OFFSET: tl.constexpr,
):
    row = tl.program_id(0) // HQ
    head = tl.program_id(0) % HQ
    y = _rotated_query_row(
        Q_ptr, PiT_ptr, KeyScale_ptr, KeyOffset_ptr, QMu_ptr, row, head, stride_qb,
        stride_qh, HQ, GROUP, D, LOG2_D, HAS_KEY_SCALE, HAS_KEY_OFFSET,
    )  # fmt: skip
    tl.store(Out_ptr + row * stride_ob + head * stride_oh + tl.arange(0, D), y)


def rotate_query(
    query: torch.Tensor, PiT: torch.Tensor, key_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``query.float() @ PiT`` for the backend's scaled Hadamard ``PiT``;
    ``(query.float() * key_scale) @ PiT`` with the layer's key scale ([D]
    fp32), for keys stored divided by it.

    Returns [B, Hq, D] fp32; the query is read in its own dtype.
    """
    return _rotate(query, PiT, key_scale, None)[0]


def rotate_query_with_offset(
    query: torch.Tensor,
    PiT: torch.Tensor,
    key_scale: torch.Tensor | None,
    key_offset: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotate_query`` and, in the same launch, ``q . key_offset[h]`` for
    each query head's KV head ``h`` ([Hk, D] fp32; the query unscaled):
    returns ([B, Hq, D], [B, Hq]) fp32."""
    qmu = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    return _rotate(query, PiT, key_scale, (key_offset, qmu))


def _rotate(query, PiT, key_scale, offset):
    B, Hq, D = query.shape
    if not rotates_in_registers(D):
        raise ValueError(
            f"the Hadamard query rotation needs a power-of-two head_dim >= 16, got "
            f"{D}; rotate with query.float() @ PiT instead"
        )
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=query.device)
    key_offset, qmu = offset if offset is not None else (PiT, PiT)
    if B * Hq:
        launcher(_tq_rotate_query)[(B * Hq,)](
            query,
            PiT,
            PiT if key_scale is None else key_scale,
            key_offset,
            out,
            qmu,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            HQ=Hq,
            GROUP=Hq // key_offset.shape[0] if offset is not None else 1,
            D=D,
            LOG2_D=D.bit_length() - 1,
            HAS_KEY_SCALE=key_scale is not None,
            HAS_KEY_OFFSET=offset is not None,
            num_warps=1 if D <= 256 else 2,
        )
    return out, (qmu if offset is not None else None)
