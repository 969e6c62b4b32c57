# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant layers with a key scale store ``k / s`` and score ``q * s``.

``turboquant.key_scale`` gives a layer whose keys pass through a per-head
``k_norm`` a per-channel scale ``s``. Every path that reads the keys must
apply it so that scores are those of the unscaled keys: the store (divides),
the query rotation of decode rows and short continuations (multiplies), and
the dequantization of long continuations (multiplies back). Checked here
against the same layer without a scale fed ``k / s`` and ``q * s``: the
stored bytes are identical, the decode rows equal to fp32 rounding, and a mixed step (a
decode row, two first chunks, a continuation) agrees to the dequantized
keys' fp16 rounding. A path that forgot ``s`` would be off by the scale's
spread (here up to 30x). Runs under the Triton CPU interpreter
(``HYBRIDKV_TRITON_INTERPRET=1``) and natively on a GPU.
"""

import pytest
import torch

from tests.kernels.attention.test_turboquant_prefill_batch import (
    HK,
    HQ,
    D,
    _exact_kv,
    _run,
    flash,  # noqa: F401 (fixture)
)
from tests.kernels.attention.test_turboquant_store_fused import (
    _hadamard,
    _padded_cache,
    _qkv,
    _slots,
)
from tests.kernels.attention.turboquant_packed import decode
from tests.kernels.attention.turboquant_store_args import store_kwargs
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
from vllm.model_executor.layers.quantization.turboquant.key_scale import (
    MIN_RELATIVE_SCALE,
    key_channel_scale,
    norm_multiplier,
)
from vllm.v1.attention.ops.triton_turboquant_store_fused import turboquant_store

MSE_PRESETS = ["turboquant_4bit_nc", "turboquant_3bit_nc"]


def _gemma_like_multiplier(d: int) -> torch.Tensor:
    """A k_norm multiplier with a few huge channels, as Gemma-3-270M's
    full-attention layers have (|1 + w| up to 30, median about 1)."""
    g = torch.Generator().manual_seed(7)
    m = 1.0 + 0.3 * torch.randn(d, generator=g)
    m[[3, 17, d // 2 + 5]] = torch.tensor([30.0, -12.0, 20.0])
    return m


# ----------------------------------------------------------------- the scale


def test_neox_pairs_share_the_rms_of_their_weights():
    m = torch.tensor([1.0, 3.0, 2.0, 5.0, 7.0, 0.5])
    s = key_channel_scale(m, rotary_dim=4, is_neox_style=True)
    pair = torch.tensor([(1 + 4) / 2, (9 + 25) / 2]).sqrt()
    raw = torch.cat([pair, pair, torch.tensor([7.0, 0.5])])
    torch.testing.assert_close(s, raw / raw.pow(2).mean().sqrt())
    assert s.pow(2).mean().item() == pytest.approx(1.0, rel=1e-6)


def test_gptj_pairs_are_adjacent():
    m = torch.tensor([1.0, 3.0, 2.0, -5.0])
    s = key_channel_scale(m, rotary_dim=4, is_neox_style=False)
    assert s[0] == s[1] and s[2] == s[3]
    assert s[0] < s[2]


def test_channels_with_no_weight_are_floored():
    m = torch.tensor([0.0, 0.0, 4.0, 4.0])
    s = key_channel_scale(m, rotary_dim=0, is_neox_style=True)
    assert s[0].item() == pytest.approx(MIN_RELATIVE_SCALE)


def test_rotary_dim_must_fit_the_head():
    with pytest.raises(ValueError, match="rotary_dim 5 is not an even number"):
        key_channel_scale(torch.ones(8), rotary_dim=5, is_neox_style=True)
    with pytest.raises(ValueError, match="within head_dim 8"):
        key_channel_scale(torch.ones(8), rotary_dim=10, is_neox_style=True)


def test_norm_multipliers():
    with set_current_vllm_config(VllmConfig()):
        gemma, plain = GemmaRMSNorm(4), RMSNorm(4)
        weightless = RMSNorm(4, has_weight=False)
    gemma.weight.data = torch.tensor([0.0, 1.0, -2.0, 29.0])
    torch.testing.assert_close(
        norm_multiplier(gemma), torch.tensor([1.0, 2.0, -1.0, 30.0])
    )
    plain.weight.data = torch.tensor([0.5, 1.0, 2.0, 3.0])
    torch.testing.assert_close(norm_multiplier(plain), plain.weight.data)
    assert norm_multiplier(weightless) is None


# --------------------------------------------------------------- the kernels


@pytest.mark.parametrize("preset", MSE_PRESETS)
def test_store_writes_the_keys_divided_by_the_scale(preset, triton_device):
    d = 128
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    k, v = _qkv(d, torch.float32, triton_device, seed=3)
    s = key_channel_scale(_gemma_like_multiplier(d), d, True).to(triton_device)
    slots = _slots(triton_device, seed=3)
    c, _ = get_centroids(d, cfg.centroid_bits).float().sort()
    midpoints = ((c[:-1] + c[1:]) / 2).to(triton_device)
    pit = _hadamard(d).to(triton_device)
    stored = []
    for keys, scale in ((k, s), (k / s, None)):
        flat, cache, _, _ = _padded_cache(cfg.slot_size_aligned, triton_device, 37)
        turboquant_store(
            keys, v, cache, slots, pit, midpoints, **store_kwargs(cfg), key_scale=scale
        )
        stored.append(flat.cpu())
    assert torch.equal(stored[0], stored[1])


def test_store_refuses_a_scale_it_cannot_use(triton_device):
    d = 64
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", d)
    k, v = _qkv(d, torch.float32, triton_device, seed=1)
    _, cache, _, _ = _padded_cache(cfg.slot_size_aligned, triton_device, 0)
    args = (k, v, cache, _slots(triton_device, 1), _hadamard(d).to(triton_device))
    mids = torch.zeros(15, device=triton_device)
    with pytest.raises(ValueError, match=r"key_scale must be a contiguous \[64\]"):
        turboquant_store(
            *args, mids, **store_kwargs(cfg), key_scale=torch.ones(32).to(k.device)
        )
    fp8 = TurboQuantConfig.from_cache_dtype("turboquant_k8v4", d)
    with pytest.raises(ValueError, match="FP8 keys are stored per element"):
        turboquant_store(
            *args, mids, **store_kwargs(fp8), key_scale=torch.ones(d).to(k.device)
        )


@pytest.mark.parametrize("preset", MSE_PRESETS)
def test_decode_rotates_the_query_times_the_scale(preset, triton_device):
    d, blocks, page = 128, 6, 16
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, blocks * page, HK, d, generator=g).to(triton_device)
    s = key_channel_scale(_gemma_like_multiplier(d), d, True).to(triton_device)
    pit = _hadamard(d).to(triton_device)
    centroids = get_centroids(d, cfg.centroid_bits).to(triton_device)
    c, _ = centroids.sort()
    cache = torch.zeros(blocks, page, HK, cfg.slot_size_aligned, dtype=torch.uint8).to(
        triton_device
    )
    slots = torch.arange(blocks * page, device=triton_device)
    turboquant_store(
        k * s, v, cache, slots, pit, (c[:-1] + c[1:]) / 2, **store_kwargs(cfg),
        key_scale=s,
    )  # fmt: skip
    table = torch.arange(blocks, dtype=torch.int32).view(2, 3).to(triton_device)
    seq_lens = torch.tensor([40, 17], dtype=torch.int32, device=triton_device)
    q = torch.randn(2, HQ, d, generator=g).to(triton_device)
    args = (cache, table, seq_lens, cfg, centroids, pit)
    kw = dict(hadamard_query=True, stage="triton")
    outs = [
        decode(query, *args, key_scale=scale, **kw)
        for query, scale in ((q, s), (q * s, None))
    ]
    # Equal under the interpreter; on a GPU the kernel may fuse the multiply
    # into the Hadamard's first stage (FMA): fp32 rounding of the scores.
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=2e-6)


# ------------------------------------------------------ a mixed forward step


@pytest.mark.parametrize("preset", MSE_PRESETS)
def test_a_mixed_step_scores_the_unscaled_keys(
    preset,
    triton_device,
    flash,  # noqa: F811 (the fixture imported above)
    monkeypatch,
):
    s = key_channel_scale(_gemma_like_multiplier(D), D, True)

    def wide_kv(n, device):
        k, v = _exact_kv(n, device)
        return k * s.to(device), v

    def divided_kv(n, device):
        k, v = wide_kv(n, device)
        return k / s.to(device), v

    scaled = _run(preset, triton_device, monkeypatch, make_kv=wide_kv, key_scale=s)
    plain = _run(preset, triton_device, monkeypatch, make_kv=divided_kv, query_scale=s)
    assert torch.equal(scaled.cache.cpu(), plain.cache.cpu())
    ref = plain.out.double()
    err = ((scaled.out.double() - ref).abs().max() / ref.abs().max()).item()
    # fp16 dequantized keys, rounded after (scaled) or before (plain) the
    # multiplication by s.
    assert err < 2e-3, err
