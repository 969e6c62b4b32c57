# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which prefill path a TurboQuant layer takes, and the SDPA varlen path itself.

FlashAttention 2/3 have kernels up to head_dim 256 (FA4 to 512); TurboQuant
runs use FA2. The full TurboQuant layer at head_dim 512 is exercised under the
Triton interpreter in tests/kernels/attention/test_turboquant_head_dim_512.py.
"""

import pytest
import torch

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.attention.backends import turboquant_attn
from vllm.v1.attention.ops.turboquant_prefill import (
    flash_attn_supports,
    sdpa_varlen_causal,
)

pytestmark = pytest.mark.cpu_test


@pytest.mark.parametrize(
    ("head_size", "fa_version", "uses_fa"),
    [(128, 2, True), (256, 3, True), (512, 2, False), (512, 3, False), (512, 4, True)],
)
def test_prefill_path_is_chosen_per_layer(monkeypatch, head_size, fa_version, uses_fa):
    monkeypatch.setattr(
        turboquant_attn, "get_flash_attn_version", lambda **kw: fa_version
    )
    with set_current_vllm_config(VllmConfig()):
        impl = turboquant_attn.TurboQuantAttentionImpl(
            8, head_size, head_size**-0.5, 2, kv_cache_dtype="turboquant_4bit_nc"
        )
    assert flash_attn_supports(head_size, fa_version) == uses_fa
    # FlashAttention: the class's method; otherwise the layer's own SDPA path.
    method = getattr(impl._flash_attn_varlen, "__func__", None)
    flash = turboquant_attn.TurboQuantAttentionImpl._flash_attn_varlen
    assert (method is flash) == uses_fa


def test_sdpa_varlen_matches_float64_reference():
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 1, 512
    # Request 0: a first chunk (q == k); request 1: a continuation (k > q).
    q_lens, k_lens = [5, 3], [5, 9]
    cu_q = torch.tensor([0, 5, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 14], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, dim)
    k = torch.randn(sum(k_lens), kv_heads, dim)
    v = torch.randn(sum(k_lens), kv_heads, dim)
    scale = dim**-0.5

    out = sdpa_varlen_causal(q, k, v, cu_q, cu_k, scale)

    for i in range(2):
        qi = q[cu_q[i] : cu_q[i + 1]].double()
        ki = k[cu_k[i] : cu_k[i + 1]].double().repeat_interleave(heads, 1)
        vi = v[cu_k[i] : cu_k[i + 1]].double().repeat_interleave(heads, 1)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        offset = k_lens[i] - q_lens[i]
        keep = (
            torch.arange(k_lens[i])[None] <= torch.arange(q_lens[i])[:, None] + offset
        )
        ref = torch.einsum(
            "hqk,khd->qhd", scores.masked_fill(~keep, float("-inf")).softmax(-1), vi
        )
        torch.testing.assert_close(
            out[cu_q[i] : cu_q[i + 1]].double(), ref, rtol=1e-4, atol=1e-5
        )


def test_sdpa_varlen_writes_into_out():
    """With ``out`` (rows of a layer's output), the result lands there, as
    FlashAttention's ``out=`` does, and equals a call without it."""
    torch.manual_seed(0)
    q, k, v = torch.randn(7, 4, 64), torch.randn(7, 2, 64), torch.randn(7, 2, 64)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    layer_out = torch.full((9, 4 * 64), float("nan"))
    rows = layer_out[1:8].view(7, 4, 64)

    got = sdpa_varlen_causal(q, k, v, cu, cu, 0.125, out=rows)

    assert got.data_ptr() == rows.data_ptr()
    torch.testing.assert_close(rows, sdpa_varlen_causal(q, k, v, cu, cu, 0.125))
    assert layer_out[0].isnan().all() and layer_out[8].isnan().all()
