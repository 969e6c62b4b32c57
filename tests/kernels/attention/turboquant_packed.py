# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Packed TurboQuant KV slots for the decode tests and the decode benchmark.

Packs random indices, norms, scales and zeros into slots on shuffled pages (or
lets the store kernel fill them from random K/V), decodes packed slots back in
float64, computes float64 softmax attention over them, and calls the split-KV
decode with a preset's arguments.
"""

import math

import torch

from tests.kernels.attention.turboquant_store_args import store_kwargs
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.model_executor.layers.quantization.turboquant.config import (
    TurboQuantConfig,
)
from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
from vllm.v1.attention.ops import turboquant_decode as tq_decode
from vllm.v1.attention.ops.turboquant_pair_code import pair_codebook

# vLLM 0.20.2's presets, each a slot layout and key code of its own (the
# pair code's preset has 3bit_nc's layout: ``pairs=True`` tests its code).
PRESETS = [
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
]
PAGE = 16
# Relative to the largest output magnitude: fp32 rounding with room for the
# GPU's split-TF32 dots; dropping one TF32 tail term exceeds it on a GPU.
TOL = 2e-5


def tables(cfg: TurboQuantConfig, head_dim: int, device: str):
    centroids, _ = get_centroids(head_dim, cfg.centroid_bits).float().sort()
    midpoints = (centroids[:-1] + centroids[1:]) / 2
    g = torch.Generator().manual_seed(head_dim)
    pit = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g))[0]
    return centroids.to(device), midpoints.to(device), pit.contiguous().to(device)


def key_values(idx: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Float64 values of [..., D] key indices: their levels, or for a pair
    codebook each pair's point (indices 2i and 2i + 1 its low and high 3 bits)."""
    table = centroids.cpu().double()
    if table.dim() == 1:
        return table[idx]
    points = table[idx[..., 0::2] + 8 * idx[..., 1::2]]
    return points.flatten(-2)


def pack_bits(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """LSB-first bit packing: bit j of element d is bit d * bits + j of the field."""
    planes = (idx[..., None] >> torch.arange(bits)) & 1
    flat = planes.reshape(*idx.shape[:-1], -1)
    flat = torch.nn.functional.pad(flat, (0, -flat.shape[-1] % 8))
    weights = 1 << torch.arange(8)
    return (flat.reshape(*flat.shape[:-1], -1, 8) * weights).sum(-1).to(torch.uint8)


def fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).view(torch.uint8).reshape(*x.shape, 2)


def shuffled_block_table(seq_lens, num_blocks):
    """Rows on shuffled pages; entries past a row's pages are -1 (unmapped)."""
    pages = [math.ceil(n / PAGE) for n in seq_lens]
    order = torch.randperm(num_blocks)[: sum(pages)].to(torch.int32)
    table = torch.full((len(seq_lens), max(pages) + 1), -1, dtype=torch.int32)
    used = 0
    for row, n in enumerate(pages):
        table[row, :n] = order[used : used + n]
        used += n
    return table


def packed_cache(cfg, seq_lens, num_kv_heads, head_dim, device, pad_bytes=0):
    """Random packed slots on shuffled pages; returns what was packed too.

    ``pad_bytes`` > 0 gives a strided cache whose pages end in padding (0xFF),
    as hybrid models get when page sizes are unified by padding (patch 0004);
    an odd page size puts slots at odd addresses.
    """
    num_blocks = sum(math.ceil(n / PAGE) for n in seq_lens) + 2
    shape = (num_blocks, PAGE, num_kv_heads)
    if cfg.key_fp8:
        k_vals = (torch.randn(*shape, head_dim) * 2).to(torch.float8_e4m3fn)
        key = k_vals.view(torch.uint8)
        k_idx, norms = k_vals.double(), None
    else:
        k_idx = torch.randint(0, 2**cfg.key_mse_bits, (*shape, head_dim))
        norms = torch.rand(shape) * 3 + 0.5
        key = torch.cat([pack_bits(k_idx, cfg.key_mse_bits), fp16_bytes(norms)], -1)
    vq = cfg.effective_value_quant_bits
    v_idx = torch.randint(0, 2**vq, (*shape, head_dim))
    scales, zeros = torch.rand(shape) * 0.3 + 0.01, torch.randn(shape)
    value = torch.cat([pack_bits(v_idx, vq), fp16_bytes(scales), fp16_bytes(zeros)], -1)
    cache = torch.full((*shape, cfg.slot_size_aligned), 0xFF, dtype=torch.uint8)
    cache[..., : cfg.key_packed_size] = key
    cache[..., cfg.key_packed_size : cfg.slot_size] = value
    if pad_bytes:
        page = cache[0].numel() + pad_bytes
        flat = torch.full((num_blocks * page,), 0xFF, dtype=torch.uint8).to(device)
        padded = torch.as_strided(flat, cache.shape, (page, *cache.stride()[1:]))
        padded.copy_(cache)
        cache = padded
    cache = cache.to(device)
    table = shuffled_block_table(seq_lens, num_blocks).to(device)
    return cache, table, (k_idx, v_idx, scales, zeros, norms)


def unpack_bits(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    b = torch.nn.functional.pad(packed.long(), (0, 1))
    bit = torch.arange(dim) * bits
    word = b[..., bit // 8] | (b[..., bit // 8 + 1] << 8)
    return (word >> (bit % 8)) & ((1 << bits) - 1)


def fp16_values(two_bytes: torch.Tensor) -> torch.Tensor:
    b = two_bytes.long()
    u = (b[..., 0] | (b[..., 1] << 8)).to(torch.int32)
    return u.to(torch.int16).view(torch.float16).double()


def dequantize(slots: torch.Tensor, cfg: TurboQuantConfig, centroids, dim: int):
    """Float64 K (rotated space for MSE keys) and V from packed slots [..., slot]."""
    slots = slots.cpu()
    if cfg.key_fp8:
        k = slots[..., :dim].contiguous().view(torch.float8_e4m3fn).double()
    else:
        mse_bytes = math.ceil(dim * cfg.key_mse_bits / 8)
        c = key_values(
            unpack_bits(slots[..., :mse_bytes], cfg.key_mse_bits, dim), centroids
        )
        if cfg.norm_correction:
            c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16)
        k = fp16_values(slots[..., mse_bytes : mse_bytes + 2])[..., None] * c
    vq = cfg.effective_value_quant_bits
    vbytes = math.ceil(dim * vq / 8)
    vfield = slots[..., cfg.key_packed_size :]
    v = unpack_bits(vfield[..., :vbytes], vq, dim).double()
    v = v * fp16_values(vfield[..., vbytes : vbytes + 2])[..., None]
    v = v + fp16_values(vfield[..., vbytes + 2 : vbytes + 4])[..., None]
    return k, v


def reference_attention(
    query, cache, block_table, seq_lens, cfg, centroids, pit, scale
):
    """Float64 attention over the slots in context; a row of length 0 gives 0."""
    B, Hq, D = query.shape
    Hk = cache.shape[2]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    q = query.cpu().double()
    if not cfg.key_fp8:
        q = q @ pit.cpu().double()
    table = block_table.cpu()
    for row, n in enumerate(seq_lens):
        if n == 0:
            continue
        pos = torch.arange(n)
        blocks = table[row, pos // PAGE].long().to(cache.device)
        slots = cache[blocks, (pos % PAGE).to(cache.device)]
        k, v = dequantize(slots, cfg, centroids, D)
        for h in range(Hq):
            kv = h // (Hq // Hk)
            p = torch.softmax((k[:, kv] @ q[row, h]) * scale, dim=0)
            out[row, h] = p @ v[:, kv]
    return out


def poisoned(shape, device, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def packed_case(
    preset, head_dim, seq_lens, num_kv_heads, device, pad_bytes=0, pairs=False
):
    """``pairs``: the keys' indices code pairs (``pair_codebook``)."""
    torch.manual_seed(1000 * head_dim + 7 * len(seq_lens) + PRESETS.index(preset))
    cfg = TurboQuantConfig.from_cache_dtype(preset, head_dim)
    centroids, _, pit = tables(cfg, head_dim, device)
    if pairs:
        centroids = pair_codebook(head_dim).to(device)
    cache, table, packed = packed_cache(
        cfg, seq_lens, num_kv_heads, head_dim, device, pad_bytes
    )
    # The reference reads back exactly what was packed.
    k_ref, v_ref = dequantize(cache, cfg, centroids, head_dim)
    k_idx, v_idx, scales, zeros, norms = packed
    if cfg.key_fp8:
        assert torch.equal(k_ref, k_idx)
    else:
        c = key_values(k_idx, centroids)
        if cfg.norm_correction:
            c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16)
        assert torch.equal(k_ref, norms.half().double()[..., None] * c)
    v_expect = v_idx * scales.half().double()[..., None]
    assert torch.equal(v_ref, v_expect + zeros.half().double()[..., None])
    return cfg, centroids, pit, cache, table


def decode(query, cache, table, seq_t, cfg, centroids, pit, scale=None, **kwargs):
    """``decode_attention`` with the preset's arguments from ``cfg``; the
    softmax scale defaults to head_dim ** -0.5 (the benchmark calls this too)."""
    D = query.shape[-1]
    return tq_decode.decode_attention(
        query,
        cache,
        table,
        seq_t,
        None if cfg.key_fp8 else pit,
        centroids,
        D**-0.5 if scale is None else scale,
        cfg.key_mse_bits,
        cfg.key_packed_size,
        cfg.effective_value_quant_bits,
        key_fp8=cfg.key_fp8,
        norm_correction=cfg.norm_correction,
        **kwargs,
    )


def stored_cache(cfg, seq_lens, num_kv_heads, head_dim, device, pit, midpoints):
    """Cache filled by 0.20.2's store from random K/V, on shuffled pages."""
    from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

    num_blocks = sum(math.ceil(n / PAGE) for n in seq_lens) + 2
    cache = torch.zeros(
        num_blocks, PAGE, num_kv_heads, cfg.slot_size_aligned, dtype=torch.uint8
    ).to(device)
    table = shuffled_block_table(seq_lens, num_blocks).to(device)
    for row, n in enumerate(seq_lens):
        pos = torch.arange(n, device=device)
        slots = table[row, pos // PAGE].long() * PAGE + pos % PAGE
        triton_turboquant_store(
            (torch.randn(n, num_kv_heads, head_dim) * 0.7 + 0.3).to(device),
            torch.randn(n, num_kv_heads, head_dim).to(device),
            cache,
            slots.to(torch.int32),
            pit,
            midpoints,
            **store_kwargs(cfg),
        )
    return cache, table


def check_decode(
    device,
    preset,
    head_dim,
    gqa,
    seq_lens,
    num_kv_heads=2,
    splits=None,
    pad_bytes=0,
    min_split_tokens=16,
    table=None,
    hadamard=False,
    edit=None,
    pairs=False,
):
    cfg, centroids, pit, cache, own_table = packed_case(
        preset, head_dim, seq_lens, num_kv_heads, device, pad_bytes, pairs
    )
    if edit is not None:  # edit(cfg, cache, block_table): rewrite packed fields
        edit(cfg, cache, own_table)
    if hadamard:
        # The backend's own rotation: rotated in registers, not by a GEMM.
        pit = _build_hadamard(head_dim, device)
    table = own_table if table is None else table(own_table)
    B, Hq = len(seq_lens), gqa * num_kv_heads
    query = torch.randn(B, Hq, head_dim).to(device) * 1.5
    scale = head_dim**-0.5
    out = decode(
        query,
        cache,
        table,
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cfg,
        centroids,
        pit,
        mid_o_buf=poisoned((B + 1, Hq, 8, head_dim + 1), device),
        output_buf=poisoned((B + 1, Hq, head_dim), device),
        num_splits=splits,
        min_split_tokens=min_split_tokens,
        hadamard_query=hadamard,
    )
    ref = reference_attention(query, cache, table, seq_lens, cfg, centroids, pit, scale)
    got = out.double().cpu()
    assert out.shape == (B, Hq, head_dim)
    assert not got.isnan().any(), "kernel left poisoned (NaN) outputs"
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL, f"max error {err:.3g} relative to max |out|"
    return out
