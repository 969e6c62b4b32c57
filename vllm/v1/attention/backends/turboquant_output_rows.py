# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant attention written straight into the layer's output rows.

0.20.2's TurboQuant forward attends into tensors of its own and copies them
into the output buffer the attention layer hands in. A mixed decode/prefill
step zero-fills a temporary of every row, copies the decode and the prefill
results into it, then copies it into the output: on Qwen3-4B's 32 x 128
heads and an 8K-token step that is ~64 MB written four times per layer. A
prefill or decode step copies once. FlashAttention (``out=``), the split-KV
decode (``output_buf``) and the SDPA path all write where they are told, so
here the forward tells them the output's rows and copies only what a kernel
could not place there.
"""

import torch


def output_rows(
    output: torch.Tensor,
    num_tokens: int,
    num_heads: int,
    head_size: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """The first ``num_tokens`` rows of the layer's output, 2D or 3D, as
    [num_tokens, num_heads, head_size], where kernels computing in ``dtype``
    can write them; None otherwise (another dtype, rows not contiguous)."""
    rows = output[:num_tokens]
    if rows.dtype != dtype or not rows.is_contiguous():
        return None
    return rows.view(num_tokens, num_heads, head_size)


def place(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` (same elements, any shape and dtype) unless
    it is already there: a kernel that was handed ``dst`` returns it."""
    if src.data_ptr() == dst.data_ptr() and src.dtype == dst.dtype:
        return
    dst.copy_(src.reshape(dst.shape))
