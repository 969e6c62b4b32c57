# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant layers with a key offset store each key the shorter way and
score every key with the same shift.

``turboquant.key_offset`` gives layers with 3- and 4-bit MSE keys a
per-KV-head offset ``mu``. The store keeps a key as ``k - mu`` or, where that
is longer, as ``k`` with its norm's sign bit set; the decodes subtract
``q . mu`` from marked keys only; continuations add ``mu`` back to shifted
keys and undo the sign of marked ones. Checked against stores without an
offset, a float64 decode reference that reads the marks, and the backend's
mixed step fed shifted keys. Keys here cluster around ``mu`` with every
fifth one (a "sink") near the origin, so both kinds are present. Runs under
the Triton CPU interpreter (``HYBRIDKV_TRITON_INTERPRET=1``; the Gluon stage
1 on NumPy) and natively on a GPU.
"""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from tests.kernels.attention.test_turboquant_decode_gluon import (
    gluon_decode,
    gluon_on_numpy,  # noqa: F401 (fixture)
)
from tests.kernels.attention.test_turboquant_key_scale import _gemma_like_multiplier
from tests.kernels.attention.test_turboquant_prefill_batch import (
    HK,
    Q_LENS,
    SEQ_LENS,
    D,
    _builder,
    _run,
    _step,
    flash,  # noqa: F401 (fixture)
)
from tests.kernels.attention.turboquant_packed import PAGE, TOL, decode, dequantize
from tests.kernels.attention.turboquant_store_args import store_kwargs
from vllm import forward_context
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
from vllm.model_executor.layers.quantization.turboquant.key_scale import (
    key_channel_scale,
)
from vllm.v1.attention.backends.turboquant_attn import (
    TurboQuantAttentionImpl,
    _build_hadamard,
)
from vllm.v1.attention.backends.turboquant_prefill_batch import (
    _dequantize_cached,
    aligned_block_row,
)
from vllm.v1.attention.ops import turboquant_decode as tq_decode
from vllm.v1.attention.ops.triton_turboquant_store_fused import turboquant_store
from vllm.v1.attention.ops.turboquant_slot_layout import slot_layout

OFFSET_PRESETS = ["turboquant_3bit_nc", "turboquant_k3v4_nc", "turboquant_4bit_nc"]


def _keys(n: int, hk: int, d: int, seed: int):
    """Keys around a per-head mean, every fifth near the origin; values."""
    g = torch.Generator().manual_seed(seed)
    mu = 3.0 * torch.randn(hk, d, generator=g)
    k = mu + 0.8 * torch.randn(n, hk, d, generator=g)
    k[::5] = 0.4 * torch.randn(k[::5].shape, generator=g)
    return k, torch.randn(n, hk, d, generator=g), mu


def _store(cfg, k, v, cache, slots, key_scale=None, key_offset=None, positions=None):
    d = k.shape[-1]
    c, _ = get_centroids(d, cfg.centroid_bits).float().sort()
    turboquant_store(
        k, v, cache, slots, _build_hadamard(d, str(k.device)),
        ((c[:-1] + c[1:]) / 2).to(k.device), **store_kwargs(cfg),
        key_scale=key_scale, key_offset=key_offset, positions=positions,
    )  # fmt: skip


def _cache(cfg, tokens: int, hk: int, device):
    blocks = math.ceil(tokens / PAGE) + 1
    shape = (blocks, PAGE, hk, cfg.slot_size_aligned)
    return torch.zeros(shape, dtype=torch.uint8, device=device)


def _marked(cfg, cache, d: int) -> torch.Tensor:
    """[blocks, page, heads] bool: the norm's sign bit."""
    norm = slot_layout(d, False, cfg.key_mse_bits, 4).key_index_bytes
    return cache[..., norm + 1].cpu() >= 0x80


# ----------------------------------------------------------------- the store


# Two sequences' first tokens: a sink (0) and a key nearer the mean (21),
# besides sinks at later positions (5, 10, ...).
FIRST_POSITIONS = torch.cat([torch.arange(21), torch.arange(19)])


# Each preset, scale and rule twice, not every combination (interpreter time).
@pytest.mark.parametrize(
    "preset, scaled, positions",
    [
        ("turboquant_3bit_nc", False, False),
        ("turboquant_3bit_nc", True, True),
        ("turboquant_k3v4_nc", True, False),
        ("turboquant_k3v4_nc", False, True),
        ("turboquant_4bit_nc", True, True),
    ],
)
def test_store_keeps_each_key_the_shorter_way(preset, scaled, positions, triton_device):
    """Every key may be kept unshifted, or with ``positions`` only a
    sequence's first."""
    d, n, hk = 128, 40, 2
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    k, v, mu = (t.to(triton_device) for t in _keys(n, hk, d, seed=1))
    s = key_channel_scale(_gemma_like_multiplier(d), d, True) if scaled else None
    s = None if s is None else s.to(triton_device)
    slots = torch.arange(n, device=triton_device)
    got = _cache(cfg, n, hk, triton_device)
    pos = FIRST_POSITIONS.to(triton_device) if positions else None
    _store(
        cfg, k, v, got, slots, key_scale=s, key_offset=mu.contiguous(), positions=pos
    )
    plain, shifted = (_cache(cfg, n, hk, triton_device) for _ in range(2))
    _store(cfg, k, v, plain, slots, key_scale=s)
    _store(cfg, k - mu, v, shifted, slots, key_scale=s)

    div = 1.0 if s is None else s
    keep = (k / div).norm(dim=-1) < ((k - mu) / div).norm(dim=-1)  # [n, hk]
    assert keep[::5].all() and not keep[1::5].any(), "the data has both kinds"
    if positions:
        keep &= (FIRST_POSITIONS == 0).to(keep.device)[:, None]
        assert keep.sum() == hk, "only token 0 is a sequence's first and a sink"
    want = torch.where(
        keep.cpu()[..., None], plain.cpu().view(-1, hk, got.shape[-1])[:n],
        shifted.cpu().view(-1, hk, got.shape[-1])[:n],
    ).clone()  # fmt: skip
    norm_hi = slot_layout(d, False, cfg.key_mse_bits, 4).key_index_bytes + 1
    want[..., norm_hi] |= keep.cpu().to(torch.uint8) << 7
    assert torch.equal(got.cpu().view(-1, hk, got.shape[-1])[:n], want)


def test_a_zero_offset_stores_what_no_offset_stores(triton_device):
    d, n, hk = 128, 24, 2
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_3bit_nc", d)
    k, v, _ = (t.to(triton_device) for t in _keys(n, hk, d, seed=2))
    slots = torch.arange(n, device=triton_device)
    caches = [_cache(cfg, n, hk, triton_device) for _ in range(2)]
    _store(cfg, k, v, caches[0], slots, key_offset=torch.zeros_like(k[0]))
    _store(cfg, k, v, caches[1], slots)
    assert torch.equal(caches[0].cpu(), caches[1].cpu())


def test_the_store_refuses_an_offset_it_cannot_read(triton_device):
    d, n, hk = 128, 4, 2
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_3bit_nc", d)
    k, v, mu = (t.to(triton_device) for t in _keys(n, hk, d, seed=3))
    cache = _cache(cfg, n, hk, triton_device)
    slots = torch.arange(n, device=triton_device)
    with pytest.raises(ValueError, match=r"key_offset must be a contiguous \[2, 128\]"):
        _store(cfg, k, v, cache, slots, key_offset=mu[0])
    fp8 = TurboQuantConfig.from_cache_dtype("turboquant_k8v4", d)
    with pytest.raises(ValueError, match="key_offset needs the fused MSE store"):
        _store(fp8, k, v, _cache(fp8, n, hk, triton_device), slots, key_offset=mu)


# ---------------------------------------------------------------- the decode


def _reference(query, cache, table, seq_lens, cfg, mu, key_scale, scale):
    """Float64 decode over the slots: a marked key scores q . k - q . mu,
    a shifted one q . (k - mu)."""
    B, Hq, d = query.shape
    hk = cache.shape[2]
    pit = _build_hadamard(d, "cpu").double()
    centroids = get_centroids(d, cfg.centroid_bits)
    q = query.cpu().double()
    q_rot = (q if key_scale is None else q * key_scale.cpu().double()) @ pit
    out = torch.zeros(B, Hq, d, dtype=torch.float64)
    for row, n in enumerate(seq_lens):
        pos = torch.arange(n)
        blocks = table[row, pos // PAGE].long().cpu()
        slots = cache.cpu()[blocks, pos % PAGE]
        k, v = dequantize(slots, cfg, centroids, d)  # the sign kept
        marked = _marked(cfg, cache, d)[blocks, pos % PAGE]  # [n, hk]
        for h in range(Hq):
            kv = h // (Hq // hk)
            dots = k[:, kv] @ q_rot[row, h]
            qmu = q[row, h] @ mu[kv].double()
            scores = torch.where(marked[:, kv], -dots - qmu, dots)
            out[row, h] = torch.softmax(scores * scale, dim=0) @ v[:, kv]
    return out


def _decode_case(preset, device, scaled, seed=4, d=128):
    hk, gqa, blocks = 2, 2, 8
    seq_lens = [45, 17, 1]
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    k, v, mu = (t.to(device) for t in _keys(blocks * PAGE, hk, d, seed=seed))
    s = key_channel_scale(_gemma_like_multiplier(d), d, True) if scaled else None
    s = None if s is None else s.to(device)
    cache = torch.zeros(blocks, PAGE, hk, cfg.slot_size_aligned, dtype=torch.uint8)
    cache = cache.to(device)
    slots = torch.arange(blocks * PAGE, device=device)
    _store(cfg, k, v, cache, slots, key_scale=s, key_offset=mu.contiguous())
    table = torch.tensor([[5, 0, 3], [2, 6, 7], [1, 4, 4]], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    query = (1.5 * torch.randn(len(seq_lens), gqa * hk, d, generator=g)).to(device)
    return cfg, cache, table.to(device), seq_lens, query, mu.to(device), s


@pytest.mark.parametrize(
    "preset, scaled, hadamard",
    [
        ("turboquant_3bit_nc", True, True),
        ("turboquant_3bit_nc", False, False),
        ("turboquant_k3v4_nc", True, False),
        ("turboquant_k3v4_nc", False, True),
        ("turboquant_4bit_nc", True, True),
    ],
)
def test_triton_decode_shifts_marked_scores(preset, scaled, hadamard, triton_device):
    cfg, cache, table, seq_lens, query, mu, s = _decode_case(
        preset, triton_device, scaled
    )
    d = query.shape[-1]
    out = decode(
        query, cache, table,
        torch.tensor(seq_lens, dtype=torch.int32, device=triton_device), cfg,
        get_centroids(d, cfg.centroid_bits).to(triton_device),
        _build_hadamard(d, triton_device), key_scale=s, key_offset=mu,
        hadamard_query=hadamard, stage="triton", num_splits=2,
    )  # fmt: skip
    ref = _reference(query, cache, table, seq_lens, cfg, mu.cpu(), s, d**-0.5)
    err = (out.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL, err


@pytest.mark.parametrize("preset", OFFSET_PRESETS)
def test_gluon_decode_shifts_marked_scores(
    preset,
    triton_interpret,
    gluon_on_numpy,  # noqa: F811 (the fixture imported above)
):
    cfg, cache, table, seq_lens, query, mu, s = _decode_case(
        preset, triton_interpret, scaled=True
    )
    d = query.shape[-1]
    out = decode(
        query, cache, table, torch.tensor(seq_lens, dtype=torch.int32), cfg,
        get_centroids(d, cfg.centroid_bits), _build_hadamard(d, "cpu"),
        key_scale=s, key_offset=mu, hadamard_query=True, stage="gluon",
        num_splits=2,
    )  # fmt: skip
    assert gluon_on_numpy, "decode_attention did not take the Gluon stage 1"
    ref = _reference(query, cache, table, seq_lens, cfg, mu, s, d**-0.5)
    err = (out.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL, err


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("preset", OFFSET_PRESETS)
def test_gluon_decode_shifts_marked_scores_on_the_gpu(preset, d, triton_device):
    """Natively, at both head sizes where 4bit_nc reads 32-bit words."""
    if triton_device != "cuda" or tq_decode.gluon_stage1(torch.device("cuda")) is None:
        pytest.skip("the Gluon stage 1 runs on sm_89+ GPUs")
    cfg, cache, table, seq_lens, query, mu, s = _decode_case(
        preset, "cuda", scaled=True, d=d
    )
    grids = []
    launch = gluon_decode._launch

    def counted(kernel, grid, args, constexprs):
        grids.append(grid)
        launch(kernel, grid, args, constexprs)

    gluon_decode._launch = counted
    try:
        out = decode(
            query, cache, table, torch.tensor(seq_lens, dtype=torch.int32).cuda(),
            cfg, get_centroids(d, cfg.centroid_bits).cuda(),
            _build_hadamard(d, "cuda"), key_scale=s, key_offset=mu,
            hadamard_query=True, stage="gluon", num_splits=2,
        )  # fmt: skip
    finally:
        gluon_decode._launch = launch
    assert grids, "decode_attention did not take the Gluon stage 1"
    ref = _reference(query, cache, table, seq_lens, cfg, mu.cpu(), s, d**-0.5)
    err = (out.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL, err


def test_the_legacy_decode_is_refused(triton_device, monkeypatch):
    cfg, cache, table, seq_lens, query, mu, _ = _decode_case(
        "turboquant_3bit_nc", triton_device, scaled=False
    )
    monkeypatch.setattr(tq_decode.envs, "VLLM_TURBOQUANT_DECODE", "legacy")
    d = query.shape[-1]
    # 3- and 4-bit keys take an offset: the way out is FP8 keys.
    with pytest.raises(
        ValueError,
        match="key offset.*Unset VLLM_TURBOQUANT_DECODE=legacy.*turboquant_k8v4",
    ):
        tq_decode.maybe_decode_attention(
            query, cache, table, torch.tensor(seq_lens, dtype=torch.int32),
            _build_hadamard(d, triton_device),
            get_centroids(d, cfg.centroid_bits).to(triton_device), d**-0.5,
            **{k: v for k, v in store_kwargs(cfg).items() if k != "key_fp8"},
            norm_correction=True, key_offset=mu,
        )  # fmt: skip


# ---------------------------------------------------------- the continuations


def test_continuations_add_the_offset_back(triton_device):
    """The dequantized keys are the shifted keys' plus mu and the marked
    keys' as stored: those of two stores without an offset, combined."""
    cfg, cache, table, seq_lens, _, mu, s = _decode_case(
        "turboquant_3bit_nc", triton_device, scaled=True
    )
    d, hk, n = 128, cache.shape[2], seq_lens[0]
    k, v, _ = (t.to(triton_device) for t in _keys(cache.shape[0] * PAGE, hk, d, 4))
    impl = type("Impl", (), {"head_size": d, "tq_config": cfg})()
    pit = _build_hadamard(d, triton_device)
    centroids = get_centroids(d, cfg.centroid_bits).to(triton_device)
    row = aligned_block_row(table, 0)
    got, _ = _dequantize_cached(
        impl, cache, row, n, pit, centroids, torch.float32, s, mu
    )
    slots = torch.arange(cache.shape[0] * PAGE, device=triton_device)
    parts = []
    for keys in (k, k - mu):
        plain = torch.zeros_like(cache)
        _store(cfg, keys, v, plain, slots, key_scale=s)
        parts.append(
            _dequantize_cached(impl, plain, row, n, pit, centroids, torch.float32, s)[0]
        )
    pos = torch.arange(n, device=triton_device)
    marked = _marked(cfg, cache, d)[
        table[0, pos // PAGE].long().cpu(), pos.cpu() % PAGE
    ]
    want = torch.where(marked.to(triton_device)[..., None], parts[0], parts[1] + mu)
    assert marked.any() and not marked.all()
    # fp16 dequantized keys, rounded before (want) or after (got) adding mu.
    torch.testing.assert_close(got, want.half().float(), rtol=2e-3, atol=4e-3)


# ------------------------------------------------------ a mixed forward step


def _shifted_kv(mu, marked_all: bool):
    """K/V whose keys all take one side: far from the origin and near mu
    (all shifted), or near the origin and far from mu (all marked)."""

    def make(n, device):
        g = torch.Generator().manual_seed(n)
        noise = 0.5 * torch.randn(n, HK, D, generator=g)
        k = noise if marked_all else mu + noise
        return k.to(device), torch.randn(n, HK, D, generator=g).to(device)

    return make


@pytest.mark.parametrize(
    "preset, marked_all",
    [
        ("turboquant_3bit_nc", False),
        ("turboquant_k3v4_nc", True),
        ("turboquant_4bit_nc", False),
    ],
    ids=["3bit_nc-shifted", "k3v4_nc-marked", "4bit_nc-shifted"],
)
def test_a_mixed_step_scores_keys_with_one_shift(
    preset,
    marked_all,
    triton_device,
    flash,  # noqa: F811 (the fixture imported above)
    monkeypatch,
):
    """A decode row, two first chunks and a continuation with an offset give
    the output of the same layer without one, fed the keys as stored
    (shifted: ``k - mu``; marked: ``k``): softmax ignores the shift."""
    mu = 4.0 * torch.randn(HK, D, generator=torch.Generator().manual_seed(9))
    make = _shifted_kv(mu, marked_all)

    def as_stored(n, device):
        k, v = make(n, device)
        return (k if marked_all else k - mu.to(device)), v

    got = _run(preset, triton_device, monkeypatch, make_kv=make, key_offset=mu)
    plain = _run(preset, triton_device, monkeypatch, make_kv=as_stored)
    stored = sum(len(k) for k, _ in got.seqs) * HK
    marked = _marked(got.impl.tq_config, got.cache, D).sum().item()
    assert marked == (stored if marked_all else 0)
    ref = plain.out.double()
    err = ((got.out.double() - ref).abs().max() / ref.abs().max()).item()
    # fp16 dequantized keys, shifted back (got) or not (plain) before rounding.
    assert err < 2e-3, err


def test_the_backend_keeps_only_a_sequences_first_key_unshifted(
    triton_device, monkeypatch
):
    """Through the builder and the KV update, under a forward context: the
    runner's positions reach the store, and of keys that are all shorter
    unshifted only those at position 0 are kept so."""
    preset = "turboquant_3bit_nc"
    with set_current_vllm_config(VllmConfig()):
        impl = TurboQuantAttentionImpl(4, D, D**-0.5, HK, kv_cache_dtype=preset)
    cfg = impl.tq_config
    layer = torch.nn.Module()
    layer.layer_name = "model.layers.0.self_attn.attn"
    layer._tq_centroids = get_centroids(D, cfg.centroid_bits).to(triton_device)
    mu = 4.0 * torch.randn(HK, D, generator=torch.Generator().manual_seed(9))
    layer._tq_key_offset = mu.to(triton_device).contiguous()
    pages = sum(math.ceil(s / PAGE) for s in SEQ_LENS) + 1
    table = torch.arange(1, pages, dtype=torch.int32)
    rows, start = [], 0
    for s in SEQ_LENS:
        n = math.ceil(s / PAGE)
        rows.append(torch.nn.functional.pad(table[start : start + n], (0, 4 - n)))
        start += n
    table = torch.stack(rows).to(triton_device)
    step = _step(table, triton_device)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(Q_LENS, SEQ_LENS)])
    step = dataclasses.replace(step, positions=positions.to(triton_device))
    meta = _builder(64).build(0, step)
    assert meta.positions is step.positions
    n = sum(Q_LENS)
    # Near the origin, far from mu: every key is shorter unshifted.
    g = torch.Generator().manual_seed(3)
    k = (0.5 * torch.randn(n, HK, D, generator=g)).to(triton_device)
    v = torch.randn(n, HK, D, generator=g).to(triton_device)
    cache = torch.zeros(pages, PAGE, HK, cfg.slot_size_aligned, dtype=torch.uint8)
    cache = cache.to(triton_device)
    context = SimpleNamespace(attn_metadata={layer.layer_name: meta})
    monkeypatch.setattr(forward_context, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(forward_context, "get_forward_context", lambda: context)
    impl.do_kv_cache_update(layer, k, v, cache, step.slot_mapping)
    slots = step.slot_mapping.cpu().long()
    marked = _marked(cfg, cache, D).view(-1, HK)[slots]
    want = (positions == 0)[:, None].expand(n, HK)
    assert want.sum() == 2 * HK and torch.equal(marked, want)
