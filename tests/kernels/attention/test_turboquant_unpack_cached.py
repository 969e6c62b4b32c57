# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A continuation's cached K/V rebuilt in one launch
(``triton_turboquant_unpack_cached``): against float64 from the packed
bytes, and against the per-pass path it replaces (``_dequantize_cached``),
for every preset with the key scale, key offset and value rotation the
backend's layers store with. CPU under the Triton interpreter at fp32;
natively on a GPU."""

import pytest
import torch

from tests.kernels.attention.turboquant_packed import PAGE, dequantize
from tests.kernels.attention.turboquant_store_args import store_kwargs
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
from vllm.v1.attention.backends.turboquant_prefill_batch import (
    _dequantize_cached,
    aligned_block_row,
)
from vllm.v1.attention.ops.triton_turboquant_store_fused import turboquant_store
from vllm.v1.attention.ops.triton_turboquant_unpack_cached import unpack_cached
from vllm.v1.attention.ops.turboquant_pair_code import pair_codebook

HK = 2
CACHED = 37  # two whole pages and a part
CASES = [
    # preset, key scale, key offset, values rotated
    ("turboquant_k8v4", False, False, False),
    ("turboquant_4bit_nc", True, True, True),
    ("turboquant_4bit_nc", False, False, False),
    ("turboquant_k3v4_nc", True, True, True),
    ("turboquant_3bit_nc", False, True, True),
]
# The served head sizes launch with their own warps (``_warps``); natively
# only, the interpreter takes 64.
HEAD_DIMS = [64, *(pytest.param(d, marks=pytest.mark.gpu) for d in (128, 256, 512))]


def _case(preset, scaled, offset, rotated, device, D, page=PAGE, pairs=False):
    """``pairs``: keys coded by ``pair_codebook`` instead of the levels."""
    cfg = TurboQuantConfig.from_cache_dtype(preset, D)
    g = torch.Generator().manual_seed(7)
    blocks = -(-CACHED // page) + 2
    n = blocks * page
    mu = 2.0 * torch.randn(HK, D, generator=g) if offset else None
    k = torch.randn(n, HK, D, generator=g) + (mu if offset else 0.0)
    # Every fifth token a sequence's first (the store's positions below),
    # near the origin: kept unshifted and marked.
    k[::5] = 0.3 * torch.randn(k[::5].shape, generator=g)
    v = torch.randn(n, HK, D, generator=g)
    scale = 0.5 + torch.rand(D, generator=g) if scaled else None
    cache = torch.zeros(blocks, page, HK, cfg.slot_size_aligned, dtype=torch.uint8)
    cache, k, v = cache.to(device), k.to(device), v.to(device)
    pit = _build_hadamard(D, str(device))
    c, _ = get_centroids(D, cfg.centroid_bits).float().sort()
    extra = {}
    if not cfg.key_fp8:
        extra = dict(
            key_scale=None if scale is None else scale.to(device),
            key_offset=None if mu is None else mu.to(device),
            positions=torch.arange(n, device=device) % 5 if offset else None,
            value_rotation=rotated,
        )
    table = pair_codebook(D) if pairs else (c[:-1] + c[1:]) / 2
    turboquant_store(
        k, v, cache, torch.arange(n, device=device), pit, table.to(device),
        **store_kwargs(cfg), **extra,
    )  # fmt: skip
    # Pages out of order, page 0 unused (vLLM's null block).
    table = torch.tensor([[3, 1, 2, 0]][:1], dtype=torch.int32)[:, : -(-CACHED // page)]
    return cfg, cache, table.to(device), pit, scale, mu


def _reference(cfg, cache, table, pit, scale, mu, rotated, D, pairs=False):
    """Float64 K/V of the first CACHED tokens, from the packed bytes."""
    pos = torch.arange(CACHED)
    slots = cache.cpu()[table[0, pos // PAGE].long().cpu(), pos % PAGE]
    c = pair_codebook(D) if pairs else get_centroids(D, cfg.centroid_bits)
    k, v = dequantize(slots, cfg, c, D)  # k in the stored space, signed norm
    h = pit.cpu().double()
    if not cfg.key_fp8:
        k = k @ h
        if scale is not None:
            k = k * scale.double()
        if mu is not None:
            norm_byte = -(-D * cfg.key_mse_bits // 8) + 1
            marked = (slots[..., norm_byte] >= 0x80)[..., None]
            assert marked.any() and not marked.all()
            k = torch.where(marked, -k, k + mu.double())
    if rotated:
        v = v @ h
    return k, v


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("preset, scaled, offset, rotated", CASES)
def test_cached_kv_is_the_model_s_kv(triton_device, preset, scaled, offset, rotated, D):
    cfg, cache, table, pit, scale, mu = _case(
        preset, scaled, offset, rotated, triton_device, D
    )
    centroids = get_centroids(D, cfg.centroid_bits).to(triton_device)
    row = aligned_block_row(table, 0)
    # Rows past the continuation's are the chunk's own: left as they are.
    k_out = torch.full((CACHED + 3, HK, D), 7.0, device=triton_device)
    v_out = torch.full_like(k_out, 7.0)
    unpack_cached(
        cache, row, CACHED, centroids, pit, k_out, v_out, cfg.key_mse_bits,
        cfg.effective_value_quant_bits, cfg.key_fp8, cfg.norm_correction,
        key_scale=None if scale is None else scale.to(triton_device),
        key_offset=None if mu is None else mu.to(triton_device),
        value_rotation=rotated,
    )  # fmt: skip
    k_ref, v_ref = _reference(cfg, cache, table, pit, scale, mu, rotated, D)
    for got, ref in ((k_out[:CACHED], k_ref), (v_out[:CACHED], v_ref)):
        err = (got.double().cpu() - ref).abs().max() / ref.abs().max()
        assert err < 2e-6, err
    assert (k_out[CACHED:] == 7.0).all() and (v_out[CACHED:] == 7.0).all()

    # The per-pass path it replaces, which rounds K and V to fp16 on the way.
    impl = type("Impl", (), {"head_size": D, "tq_config": cfg})()
    k_old, v_old = _dequantize_cached(
        impl, cache, row, CACHED, pit, centroids, torch.float32,
        None if scale is None else scale.to(triton_device),
        None if mu is None else mu.to(triton_device), rotated,
    )  # fmt: skip
    torch.testing.assert_close(k_out[:CACHED], k_old, rtol=2e-3, atol=4e-3)
    torch.testing.assert_close(v_out[:CACHED], v_old, rtol=2e-3, atol=4e-3)


@pytest.mark.parametrize("D", HEAD_DIMS)
def test_cached_pair_coded_keys_are_the_model_s_keys(triton_device, D):
    """Keys coded by pairs (``pair_codebook``), with 3bit_nc's key scale,
    offset and rotated values; the per-pass path cannot read them."""
    cfg, cache, table, pit, scale, mu = _case(
        "turboquant_3bit_nc", True, True, True, triton_device, D, pairs=True
    )
    points = pair_codebook(D).to(triton_device)
    row = aligned_block_row(table, 0)
    k_out = torch.full((CACHED, HK, D), 7.0, device=triton_device)
    v_out = torch.full_like(k_out, 7.0)
    scale, mu = scale.to(triton_device), mu.to(triton_device)
    unpack_cached(
        cache, row, CACHED, points, pit, k_out, v_out, 3, 3, False, True,
        key_scale=scale, key_offset=mu, value_rotation=True,
    )  # fmt: skip
    k_ref, v_ref = _reference(
        cfg, cache, table, pit, scale.cpu(), mu.cpu(), True, D, pairs=True
    )
    for got, ref in ((k_out, k_ref), (v_out, v_ref)):
        err = (got.double().cpu() - ref).abs().max() / ref.abs().max()
        assert err < 2e-6, err
    impl = type("Impl", (), {"head_size": D, "tq_config": cfg})()
    with pytest.raises(ValueError, match="coded by pairs.*unpack_cached"):
        _dequantize_cached(
            impl, cache, row, CACHED, pit, points, torch.float32, scale, mu, True
        )


def test_a_head_size_it_cannot_rotate_is_refused(triton_device):
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", 64)
    out = torch.empty(4, HK, 48, device=triton_device)
    with pytest.raises(ValueError, match="power-of-two head_dim >= 16, got 48"):
        unpack_cached(
            torch.zeros(2, PAGE, HK, 64, dtype=torch.uint8, device=triton_device),
            torch.zeros(1, 4, dtype=torch.int32, device=triton_device), 4,
            torch.zeros(16, device=triton_device), torch.eye(48, device=triton_device),
            out, out, cfg.key_mse_bits, 4, False, True,
        )  # fmt: skip


@pytest.mark.parametrize("page", [PAGE, 2 * PAGE])
@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
def test_a_tile_the_packed_rows_hold_is_not_read_again(triton_device, preset, page):
    """With ``held``, the whole tiles written are recorded by cache tile
    (block x page / 16 + place in the block / 16) and a second read-back of
    the same blocks into the same rows leaves them: it sees a garbled cache
    and the rows stay right. Rows off the tile grid record nothing whole."""
    D = 64
    mse = preset != "turboquant_k8v4"
    cfg, cache, table, pit, scale, mu = _case(
        preset, mse, mse, mse, triton_device, D, page
    )
    centroids = get_centroids(D, cfg.centroid_bits).to(triton_device)
    row = aligned_block_row(table, 0)

    def read_back(kv, k_out, v_out, cached=CACHED, **held):
        unpack_cached(
            kv, row, cached, centroids, pit, k_out, v_out, cfg.key_mse_bits,
            cfg.effective_value_quant_bits, cfg.key_fp8, cfg.norm_correction,
            key_scale=None if scale is None else scale.to(triton_device),
            key_offset=None if mu is None else mu.to(triton_device),
            value_rotation=mse, **held,
        )  # fmt: skip

    want = [torch.empty(CACHED, HK, D, device=triton_device) for _ in range(2)]
    read_back(cache, *want)
    rows = [torch.full((64, HK, D), 7.0, device=triton_device) for _ in range(2)]
    held = torch.full((5, HK), -1, dtype=torch.int32, device=triton_device)
    read_back(cache, *rows, held=held, row0=0)
    tiles = [
        int(table[0, t * 16 // page]) * (page // 16) + t * 16 % page // 16
        for t in range(CACHED // 16)
    ]
    assert held.cpu().tolist() == [[t] * HK for t in tiles] + [[-1] * HK] * 3
    garbled = cache.clone()
    garbled[table[0, : CACHED // page].long()] = 0x5A  # the whole tiles' blocks
    read_back(garbled, *rows, held=held, row0=0)
    for got, ref in zip(rows, want):
        torch.testing.assert_close(got[:CACHED], ref, rtol=0, atol=0)

    read_back(cache, rows[0][5:], rows[1][5:], cached=20, held=held, row0=5)
    assert (held.cpu() == -1).all()


def test_held_tiles_need_whole_tiles_in_a_page(triton_device):
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", 64)
    out = torch.empty(4, HK, 64, device=triton_device)
    for page, held, match in (
        (8, torch.full((2, HK), -1, dtype=torch.int32), "8-token page"),
        (16, torch.full((2, HK), -1), "torch.int64"),
        (16, torch.full((1, HK), -1, dtype=torch.int32), ">= 2 rows"),
    ):
        with pytest.raises(ValueError, match=match):
            unpack_cached(
                torch.zeros(2, page, HK, cfg.slot_size_aligned, dtype=torch.uint8,
                            device=triton_device),
                torch.zeros(1, 4, dtype=torch.int32, device=triton_device), 4,
                torch.zeros(16, device=triton_device),
                torch.eye(64, device=triton_device), out, out, cfg.key_mse_bits, 4,
                False, True, held=held.to(triton_device), row0=0,
            )  # fmt: skip
