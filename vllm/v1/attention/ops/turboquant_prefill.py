# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant prefill attention for head sizes FlashAttention cannot run.

TurboQuant prefills (first chunks, and continuations after dequantizing the
cache) go through ``flash_attn_varlen_func`` whenever FlashAttention is
installed. FA2 and FA3 only have kernels up to head_dim 256, and TurboQuant
runs use FA2 by default, so Gemma 4's full-attention layers (head_dim 512)
fail at their first prefill. Whether FlashAttention can serve a layer is a
property of the layer (its head size and the FA version that will run), so it
is decided per layer here, once, when the implementation is built; layers FA
cannot serve use PyTorch's ``scaled_dot_product_attention`` (its
memory-efficient kernel has no head-size ceiling), one sequence at a time,
with the same variable-length, causal, bottom-right-aligned semantics.
"""

from typing import Any

import torch
import torch.nn.functional as F

from vllm.logger import init_logger

logger = init_logger(__name__)

# FA2/FA3 kernels exist up to this head size; FA4 goes to 512.
FA_MAX_HEAD_SIZE = 256


def flash_attn_supports(head_size: int, fa_version: int | None) -> bool:
    """Whether the FlashAttention version that will run has this head size."""
    if head_size % 8 != 0:
        return False
    return head_size <= FA_MAX_HEAD_SIZE or fa_version == 4


def sdpa_varlen_causal(
    q: torch.Tensor,  # (total_q, Hq, D)
    k: torch.Tensor,  # (total_k, Hk, D)
    v: torch.Tensor,  # (total_k, Hk, D)
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``flash_attn_varlen_func(..., causal=True)`` on SDPA, into ``out``
    (shaped like ``q``) when given.

    Causal masking is aligned to the bottom right, as FlashAttention does when
    a sequence has more keys than queries (a continuation chunk): query ``i``
    of a chunk of ``q_len`` sees keys ``0 .. k_len - q_len + i``.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    groups = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    qs = cu_seqlens_q.tolist()
    ks = cu_seqlens_k.tolist()
    for i in range(len(qs) - 1):
        q_start, q_end, k_start, k_end = qs[i], qs[i + 1], ks[i], ks[i + 1]
        q_len, k_len = q_end - q_start, k_end - k_start
        if q_len <= 0:
            continue
        q_i = q[q_start:q_end].transpose(0, 1).unsqueeze(0)  # (1, Hq, q_len, D)
        k_i = k[k_start:k_end].transpose(0, 1)
        v_i = v[k_start:k_end].transpose(0, 1)
        if groups > 1:
            # Explicit repeat: enable_gqa would rule out the memory-efficient
            # kernel, the only fused one without a head-size ceiling.
            k_i = k_i.repeat_interleave(groups, dim=0)
            v_i = v_i.repeat_interleave(groups, dim=0)
        k_i, v_i = k_i.unsqueeze(0), v_i.unsqueeze(0)
        if q_len == k_len:
            o = F.scaled_dot_product_attention(
                q_i, k_i, v_i, is_causal=True, scale=scale
            )
        else:
            q_pos = torch.arange(q_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(k_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos + (k_len - q_len)
            o = F.scaled_dot_product_attention(
                q_i, k_i, v_i, attn_mask=mask, scale=scale
            )
        out[q_start:q_end] = o[0].transpose(0, 1).to(out.dtype)
    return out


def sdpa_prefill(impl: Any):
    """``sdpa_varlen_causal`` with ``impl._flash_attn_varlen``'s signature."""

    def prefill(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out=None
    ):
        return sdpa_varlen_causal(
            q, k, v, cu_seqlens_q, cu_seqlens_k, impl.scale, out=out
        )

    return prefill


def select_prefill_attention(impl: Any, head_size: int):
    """The varlen prefill callable for a TurboQuant layer.

    ``impl._flash_attn_varlen`` where FlashAttention runs this head size, an
    SDPA equivalent with the same signature otherwise.
    """
    if flash_attn_supports(head_size, impl.fa_version):
        return impl._flash_attn_varlen
    logger.info_once(
        "TurboQuant prefill for head_size=%d uses SDPA: FlashAttention %s has "
        "no kernel for it.",
        head_size,
        impl.fa_version,
    )
    return sdpa_prefill(impl)
