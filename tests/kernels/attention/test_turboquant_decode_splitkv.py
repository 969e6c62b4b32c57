# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant split-KV decode attention against a float64 reference.

Caches are packed from random indices, norms, scales and zeros by a small
PyTorch packer (fast under the interpreter, and every index pattern occurs),
or filled by the real store kernel from random K/V. The reference decodes the
packed bytes itself (bit-packed indices, fp16 norms/scales/zeros, FP8 keys),
checks that this decoding gives back what was packed or stored, and computes
softmax attention in float64. Outputs and scratch are poisoned with NaN
before each call, so a row or head the kernel skips shows up. Runs under the
Triton CPU interpreter (``HYBRIDKV_TRITON_INTERPRET=1``; fp32, small shapes)
and natively on a GPU; the ``gpu`` tests add real shapes, bf16 queries and a
CUDA-graph replay.
"""

import math

import pytest
import torch

from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.model_executor.layers.quantization.turboquant.config import (
    TQ_PRESETS,
    TurboQuantConfig,
)
from vllm.v1.attention.ops import triton_turboquant_decode_splitkv as splitkv
from vllm.v1.attention.ops.triton_turboquant_decode import (
    triton_turboquant_decode_attention,
)
from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

PRESETS = list(TQ_PRESETS)
PAGE = 16
# Relative to the largest output magnitude: fp32 rounding, with room for the
# GPU's split-TF32 dots; dropping a TF32 tail term alone exceeds it on GPU.
TOL = 2e-5


def _tables(cfg: TurboQuantConfig, head_dim: int, device: str):
    bits = cfg.key_mse_bits if not cfg.key_fp8 else cfg.centroid_bits
    centroids, _ = get_centroids(head_dim, bits).float().sort()
    midpoints = (centroids[:-1] + centroids[1:]) / 2
    g = torch.Generator().manual_seed(head_dim)
    pit = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g))[0]
    return centroids.to(device), midpoints.to(device), pit.contiguous().to(device)


def _filled_cache(cfg, seq_lens, num_kv_heads, head_dim, device, pit, midpoints):
    """Cache with each row's tokens stored on shuffled pages; returns K/V too."""
    pages = [math.ceil(n / PAGE) for n in seq_lens]
    num_blocks = sum(pages) + 2
    cache = torch.zeros(
        num_blocks, PAGE, num_kv_heads, cfg.slot_size_aligned, dtype=torch.uint8
    ).to(device)
    order = torch.randperm(num_blocks)[: sum(pages)].to(torch.int32)
    block_table = torch.full((len(seq_lens), max(pages) + 1), -1, dtype=torch.int32)
    keys, values, used = [], [], 0
    for row, n in enumerate(seq_lens):
        block_table[row, : pages[row]] = order[used : used + pages[row]]
        used += pages[row]
        k = torch.randn(n, num_kv_heads, head_dim) * 0.7 + 0.3
        v = torch.randn(n, num_kv_heads, head_dim)
        pos = torch.arange(n)
        slots = block_table[row, pos // PAGE].long() * PAGE + pos % PAGE
        triton_turboquant_store(
            k.to(device),
            v.to(device),
            cache,
            slots.to(torch.int32).to(device),
            pit,
            midpoints,
            mse_bits=cfg.key_mse_bits,
            key_packed_size=cfg.key_packed_size,
            value_quant_bits=cfg.effective_value_quant_bits,
            key_fp8=cfg.key_fp8,
        )
        keys.append(k)
        values.append(v)
    return cache, block_table.to(device), keys, values


def _pack(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """LSB-first bit packing: bit j of element d is bit d * bits + j of the field."""
    planes = (idx[..., None] >> torch.arange(bits)) & 1
    flat = planes.reshape(*idx.shape[:-1], -1)
    flat = torch.nn.functional.pad(flat, (0, -flat.shape[-1] % 8))
    weights = 1 << torch.arange(8)
    return (flat.reshape(*flat.shape[:-1], -1, 8) * weights).sum(-1).to(torch.uint8)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).view(torch.uint8).reshape(*x.shape, 2)


def _packed_cache(cfg, seq_lens, num_kv_heads, head_dim, device, pad_bytes=0):
    """Random packed slots on shuffled pages; returns what was packed too.

    ``pad_bytes`` > 0 gives a strided cache whose pages end in padding (0xFF
    bytes), as hybrid models get when page sizes are unified by padding.
    """
    pages = [math.ceil(n / PAGE) for n in seq_lens]
    num_blocks = sum(pages) + 2
    shape = (num_blocks, PAGE, num_kv_heads)
    if cfg.key_fp8:
        k_vals = (torch.randn(*shape, head_dim) * 2).to(torch.float8_e4m3fn)
        key = k_vals.view(torch.uint8)
        k_idx, norms = k_vals.double(), None
    else:
        k_idx = torch.randint(0, 2**cfg.key_mse_bits, (*shape, head_dim))
        norms = torch.rand(shape) * 3 + 0.5
        key = torch.cat([_pack(k_idx, cfg.key_mse_bits), _fp16_bytes(norms)], -1)
    vq = cfg.effective_value_quant_bits
    v_idx = torch.randint(0, 2**vq, (*shape, head_dim))
    scales, zeros = torch.rand(shape) * 0.3 + 0.01, torch.randn(shape)
    value = torch.cat([_pack(v_idx, vq), _fp16_bytes(scales), _fp16_bytes(zeros)], -1)
    cache = torch.zeros(*shape, cfg.slot_size_aligned, dtype=torch.uint8)
    cache[..., : cfg.key_packed_size] = key
    cache[..., cfg.key_packed_size : cfg.slot_size] = value
    if pad_bytes:
        page = cache[0].numel() + pad_bytes
        flat = torch.full((num_blocks * page,), 0xFF, dtype=torch.uint8).to(device)
        padded = torch.as_strided(flat, cache.shape, (page, *cache.stride()[1:]))
        padded.copy_(cache)
        cache = padded
    order = torch.randperm(num_blocks)[: sum(pages)].to(torch.int32)
    block_table = torch.full((len(seq_lens), max(pages) + 1), -1, dtype=torch.int32)
    used = 0
    for row in range(len(seq_lens)):
        block_table[row, : pages[row]] = order[used : used + pages[row]]
        used += pages[row]
    return (
        cache.to(device),
        block_table.to(device),
        (k_idx, v_idx, scales, zeros, norms),
    )


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    b = torch.nn.functional.pad(packed.long(), (0, 1))
    bit = torch.arange(dim) * bits
    word = b[..., bit // 8] | (b[..., bit // 8 + 1] << 8)
    return (word >> (bit % 8)) & ((1 << bits) - 1)


def _fp16(two_bytes: torch.Tensor) -> torch.Tensor:
    b = two_bytes.long()
    u = (b[..., 0] | (b[..., 1] << 8)).to(torch.int32)
    return u.to(torch.int16).view(torch.float16).double()


def _dequant(slots: torch.Tensor, cfg: TurboQuantConfig, centroids, dim: int):
    """Float64 K (rotated space for MSE keys) and V from packed slots [..., slot]."""
    slots = slots.cpu()
    if cfg.key_fp8:
        k = slots[..., :dim].contiguous().view(torch.float8_e4m3fn).double()
    else:
        mse_bytes = math.ceil(dim * cfg.key_mse_bits / 8)
        c = centroids.cpu().double()[
            _unpack(slots[..., :mse_bytes], cfg.key_mse_bits, dim)
        ]
        if cfg.norm_correction:
            c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16)
        k = _fp16(slots[..., mse_bytes : mse_bytes + 2])[..., None] * c
    vq = cfg.effective_value_quant_bits
    vbytes = math.ceil(dim * vq / 8)
    vfield = slots[..., cfg.key_packed_size :]
    v = _unpack(vfield[..., :vbytes], vq, dim).double()
    v = v * _fp16(vfield[..., vbytes : vbytes + 2])[..., None]
    v = v + _fp16(vfield[..., vbytes + 2 : vbytes + 4])[..., None]
    return k, v


def _gather(cache, block_table, row, n):
    pos = torch.arange(n, device=cache.device)
    return cache[block_table[row, pos // PAGE].long(), pos % PAGE]  # [n, Hk, slot]


def _reference(query, cache, block_table, seq_lens, cfg, centroids, pit, scale):
    B, Hq, D = query.shape
    Hk = cache.shape[2]
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    q = query.cpu().double()
    if not cfg.key_fp8:
        q = q @ pit.cpu().double()
    for row, n in enumerate(seq_lens):
        k, v = _dequant(_gather(cache, block_table, row, n), cfg, centroids, D)
        for h in range(Hq):
            kv = h // (Hq // Hk)
            p = torch.softmax((k[:, kv] @ q[row, h]) * scale, dim=0)
            out[row, h] = p @ v[:, kv]
    return out


def _check_round_trip(cache, block_table, seq_lens, cfg, centroids, pit, keys, values):
    """The reference's decoding of the bytes reproduces what was stored."""
    D = keys[0].shape[-1]
    for row, n in enumerate(seq_lens):
        k, v = _dequant(_gather(cache, block_table, row, n), cfg, centroids, D)
        v_in = values[row].double()
        span = v_in.amax(-1, keepdim=True) - v_in.amin(-1, keepdim=True)
        levels = 2**cfg.effective_value_quant_bits - 1
        assert ((v - v_in).abs() <= span / levels * 0.5 + 1e-2 * span).all()
        k_in = keys[row].double()
        if not cfg.key_fp8:
            k_in = k_in @ pit.cpu().double()
        cos = torch.nn.functional.cosine_similarity(k, k_in, dim=-1)
        assert cos.min() > (0.97 if cfg.key_fp8 or cfg.key_mse_bits == 4 else 0.9)


def _poisoned(shape, device, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _run_case(
    device, preset, head_dim, gqa, seq_lens, num_kv_heads=2, splits=None, pad_bytes=0
):
    torch.manual_seed(1000 * head_dim + 10 * gqa + PRESETS.index(preset))
    cfg = TurboQuantConfig.from_cache_dtype(preset, head_dim)
    centroids, _, pit = _tables(cfg, head_dim, device)
    cache, block_table, packed = _packed_cache(
        cfg, seq_lens, num_kv_heads, head_dim, device, pad_bytes
    )
    if pad_bytes:
        assert not cache.is_contiguous()
    # The reference reads back exactly what was packed.
    k_ref, v_ref = _dequant(cache, cfg, centroids, head_dim)
    k_idx, v_idx, scales, zeros, norms = packed
    if cfg.key_fp8:
        assert torch.equal(k_ref, k_idx)
    else:
        c = centroids.cpu().double()[k_idx]
        if cfg.norm_correction:
            c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16)
        assert torch.equal(k_ref, norms.half().double()[..., None] * c)
    v_expect = (
        v_idx * scales.half().double()[..., None] + zeros.half().double()[..., None]
    )
    assert torch.equal(v_ref, v_expect)
    B, Hq = len(seq_lens), gqa * num_kv_heads
    query = torch.randn(B, Hq, head_dim).to(device) * 1.5
    scale = head_dim**-0.5
    seq_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = splitkv.decode_attention(
        query,
        cache,
        block_table,
        seq_t,
        None if cfg.key_fp8 else pit,
        centroids,
        scale,
        cfg.key_mse_bits,
        cfg.key_packed_size,
        cfg.effective_value_quant_bits,
        key_fp8=cfg.key_fp8,
        norm_correction=cfg.norm_correction,
        mid_o_buf=_poisoned((B + 1, Hq, 8, head_dim + 1), device),
        output_buf=_poisoned((B + 1, Hq, head_dim), device),
        num_splits=splits,
    )
    ref = _reference(query, cache, block_table, seq_lens, cfg, centroids, pit, scale)
    got = out.double().cpu()
    assert not got.isnan().any(), "kernel left poisoned (NaN) outputs"
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL, f"max error {err:.3g} relative to max |out|"


# Rows: one token, a partial tile, several pages with a partial last tile.
SEQ_LENS = [1, 19, 45]


@pytest.mark.parametrize("gqa", [1, 4, 6])
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_head_dim_128(triton_device, preset, gqa):
    _run_case(triton_device, preset, 128, gqa, SEQ_LENS, splits=1)


@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_split_kv(triton_device, preset, splits):
    # More splits than a short row has tiles: empty splits must weigh nothing.
    _run_case(triton_device, preset, 128, 4, [70, 5], splits=splits)


@pytest.mark.parametrize("pad_bytes", [96, 97])
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_padded_pages(triton_device, preset, pad_bytes):
    # Hybrid models' TurboQuant caches are strided views with padded pages; an
    # odd page size leaves slots at odd addresses (byte loads instead of int16).
    _run_case(triton_device, preset, 128, 4, [19, 45], splits=2, pad_bytes=pad_bytes)


@pytest.mark.parametrize("head_dim", [64, 256, 512])
@pytest.mark.parametrize("preset", PRESETS)
def test_decode_other_head_dims(triton_device, preset, head_dim):
    # Several tiles per split (16-32 tokens per tile).
    splits = 1 if head_dim == 256 else 2
    _run_case(
        triton_device, preset, head_dim, 6, [3, 50], num_kv_heads=1, splits=splits
    )


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_hooked_entry_point_serves_verify_rows(triton_device, preset):
    """0.20.2's entry point dispatches here; rows as speculative verify builds them.

    One request's 1 + k query tokens arrive as k + 1 rows that share a block
    table row and see seq_len - k .. seq_len tokens.
    """
    torch.manual_seed(7)
    head_dim, num_kv_heads, gqa, seq_len, k = 128, 2, 6, 40, 3
    cfg = TurboQuantConfig.from_cache_dtype(preset, head_dim)
    centroids, midpoints, pit = _tables(cfg, head_dim, triton_device)
    cache, block_table, keys, values = _filled_cache(
        cfg, [seq_len], num_kv_heads, head_dim, triton_device, pit, midpoints
    )
    _check_round_trip(cache, block_table, [seq_len], cfg, centroids, pit, keys, values)
    rows = k + 1
    seq_lens = list(range(seq_len - k, seq_len + 1))
    bt = block_table[:1].expand(rows, -1)
    Hq = gqa * num_kv_heads
    query = torch.randn(rows, Hq, head_dim, device=triton_device)
    out = triton_turboquant_decode_attention(
        query=query,
        kv_cache=cache,
        block_table=bt,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=triton_device),
        Pi=pit.T.contiguous(),
        centroids=centroids,
        scale=head_dim**-0.5,
        mse_bits=cfg.key_mse_bits,
        key_packed_size=cfg.key_packed_size,
        value_quant_bits=cfg.effective_value_quant_bits,
        key_fp8=cfg.key_fp8,
        norm_correction=cfg.norm_correction,
        mid_o_buf=_poisoned((8, Hq, 32, head_dim + 1), triton_device),
        output_buf=_poisoned((8, Hq, head_dim), triton_device),
        max_num_kv_splits=32,
    )
    ref = _reference(query, cache, bt, seq_lens, cfg, centroids, pit, head_dim**-0.5)
    got = out.double().cpu()
    assert not got.isnan().any()
    assert (got - ref).abs().max().item() / ref.abs().max().item() < TOL


def test_split_count_ignores_sequence_lengths():
    # CUDA graphs replay one launch for every sequence length: the split count
    # may depend on the batch shape and device only.
    assert splitkv.num_kv_splits(1, 8, 32, 132) == 32
    assert splitkv.num_kv_splits(16, 8, 32, 132) == 4
    assert splitkv.num_kv_splits(64, 8, 32, 132) == 1
    assert splitkv.num_kv_splits(16, 4, 32, 132) == 8
    assert splitkv.num_kv_splits(512, 8, 32, 132) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize(
    "shape",
    [
        (32, 8, 128, [1, 700, 4100, 8192]),
        (24, 4, 256, [33, 3000, 8192]),
        (16, 2, 512, [5, 2100]),
    ],
    ids=["qwen3-4b", "qwen3.6-27b", "d512"],
)
def test_decode_real_shapes_gpu(preset, shape):
    """Real head counts and contexts, bf16 queries as the backend passes them."""
    Hq, Hk, D, seq_lens = shape
    device = "cuda"
    torch.manual_seed(3)
    cfg = TurboQuantConfig.from_cache_dtype(preset, D)
    centroids, midpoints, pit = _tables(cfg, D, device)
    cache, block_table, _, _ = _filled_cache(
        cfg, seq_lens, Hk, D, device, pit, midpoints
    )
    query = torch.randn(len(seq_lens), Hq, D, device=device).to(torch.bfloat16)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    # Poison the allocator's free blocks so an unwritten output shows as NaN.
    torch.full(
        (len(seq_lens), Hq, D), float("nan"), dtype=torch.bfloat16, device=device
    )
    mid = _poisoned((len(seq_lens), Hq, 32, D + 1), device)
    out = triton_turboquant_decode_attention(
        query=query,
        kv_cache=cache,
        block_table=block_table,
        seq_lens=seq_t,
        Pi=pit.T.contiguous(),
        centroids=centroids,
        scale=D**-0.5,
        mse_bits=cfg.key_mse_bits,
        key_packed_size=cfg.key_packed_size,
        value_quant_bits=cfg.effective_value_quant_bits,
        key_fp8=cfg.key_fp8,
        norm_correction=cfg.norm_correction,
        PiT=pit,
        mid_o_buf=mid,
        max_num_kv_splits=32,
    )
    torch.accelerator.synchronize()
    ref = _reference(
        query.float(), cache, block_table, seq_lens, cfg, centroids, pit, D**-0.5
    )
    got = out.double().cpu()
    assert out.dtype == torch.bfloat16 and not got.isnan().any()
    # bf16 output rounding (2**-9) bounds the error here, not the kernel.
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err < 4e-3, f"max error {err:.3g} relative to max |out|"
    # The same launch with an fp32 output holds the accumulators to fp32
    # rounding (split-TF32 dots; FP8 keys times a bf16 query are exact).
    out32 = splitkv.decode_attention(
        query,
        cache,
        block_table,
        seq_t,
        None if cfg.key_fp8 else pit,
        centroids,
        D**-0.5,
        cfg.key_mse_bits,
        cfg.key_packed_size,
        cfg.effective_value_quant_bits,
        key_fp8=cfg.key_fp8,
        norm_correction=cfg.norm_correction,
        output_buf=_poisoned((len(seq_lens), Hq, D), device),
        out_dtype=torch.float32,
    )
    torch.accelerator.synchronize()
    err32 = (out32.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err32 < TOL, f"fp32 output: max error {err32:.3g} relative to max |out|"


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_cuda_graph_replay_follows_new_lengths(preset):
    """A graph captured once serves other sequence lengths and queries.

    The split count is fixed at capture from the batch shape; every replay must
    follow the new lengths (checked against float64), not the captured ones.
    """
    Hq, Hk, D, B, ctx = 32, 8, 128, 4, 4096
    device = "cuda"
    torch.manual_seed(5)
    cfg = TurboQuantConfig.from_cache_dtype(preset, D)
    centroids, midpoints, pit = _tables(cfg, D, device)
    cache, block_table, _, _ = _filled_cache(
        cfg, [ctx] * B, Hk, D, device, pit, midpoints
    )
    query = torch.randn(B, Hq, D, device=device).to(torch.bfloat16)
    seq_t = torch.tensor([100, 2000, 5, ctx], dtype=torch.int32, device=device)
    mid = _poisoned((B, Hq, 32, D + 1), device)

    def call():
        return triton_turboquant_decode_attention(
            query=query,
            kv_cache=cache,
            block_table=block_table,
            seq_lens=seq_t,
            Pi=pit,
            centroids=centroids,
            scale=D**-0.5,
            mse_bits=cfg.key_mse_bits,
            key_packed_size=cfg.key_packed_size,
            value_quant_bits=cfg.effective_value_quant_bits,
            key_fp8=cfg.key_fp8,
            norm_correction=cfg.norm_correction,
            PiT=pit,
            mid_o_buf=mid,
            max_num_kv_splits=32,
        )

    call()  # compile outside the capture
    torch.accelerator.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = call()
    for lens in ([ctx, 1, 3000, 77], [7, ctx, 16, 1000]):
        seq_t.copy_(torch.tensor(lens, dtype=torch.int32))
        query.copy_(torch.randn(B, Hq, D, device=device))
        graph.replay()
        torch.accelerator.synchronize()
        replayed = graph_out.clone()
        # Same kernels and splits as eager; cuBLAS may pick another GEMM for the
        # query rotation under capture, so allow a bf16 rounding step.
        eager = call().float()
        assert (replayed.float() - eager).abs().max() <= 8e-3 * eager.abs().max()
        ref = _reference(
            query.float(), cache, block_table, lens, cfg, centroids, pit, D**-0.5
        )
        err = (
            replayed.double().cpu() - ref
        ).abs().max().item() / ref.abs().max().item()
        assert err < 4e-3, f"replay with lengths {lens}: max error {err:.3g}"


@pytest.mark.parametrize(
    "preset", ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc"]
)
def test_each_packed_byte_is_read_once(triton_interpret, monkeypatch, preset):
    """Every byte of every slot in context is loaded exactly once per call.

    Counts the interpreter's loads that land in the cache: a kernel that
    fetches a slot once per query head of a GQA group, or an MSE index byte
    once per element, loads bytes several times; one that skips tokens or
    reads past a row's length loads the wrong set.
    """
    import numpy as np
    from triton.runtime import interpreter

    head_dim, num_kv_heads, gqa, seq_lens = 128, 2, 4, [20, 37]
    cfg = TurboQuantConfig.from_cache_dtype(preset, head_dim)
    centroids, _, pit = _tables(cfg, head_dim, "cpu")
    cache, block_table, _ = _packed_cache(cfg, seq_lens, num_kv_heads, head_dim, "cpu")
    base, size = cache.data_ptr(), cache.numel()
    counts = np.zeros(size, dtype=np.int64)
    load = interpreter.InterpreterBuilder.create_masked_load

    def counting_load(self, ptrs, mask, *args, **kwargs):
        addr = ptrs.data.astype(np.int64).ravel()
        on = np.broadcast_to(mask.data, ptrs.data.shape).ravel()
        hit = on & (addr >= base) & (addr < base + size)
        for byte in range(ptrs.get_element_ty().primitive_bitwidth // 8):
            np.add.at(counts, addr[hit] - base + byte, 1)
        return load(self, ptrs, mask, *args, **kwargs)

    monkeypatch.setattr(
        interpreter.InterpreterBuilder, "create_masked_load", counting_load
    )
    Hq = gqa * num_kv_heads
    triton_turboquant_decode_attention(
        query=torch.randn(len(seq_lens), Hq, head_dim),
        kv_cache=cache,
        block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        Pi=pit.T.contiguous(),
        centroids=centroids,
        scale=head_dim**-0.5,
        mse_bits=cfg.key_mse_bits,
        key_packed_size=cfg.key_packed_size,
        value_quant_bits=cfg.effective_value_quant_bits,
        key_fp8=cfg.key_fp8,
        norm_correction=cfg.norm_correction,
        PiT=pit,
        mid_o_buf=_poisoned((2, Hq, 32, head_dim + 1), "cpu"),
        max_num_kv_splits=32,
    )
    expected = torch.zeros(cache.shape, dtype=torch.int64)
    for row, n in enumerate(seq_lens):
        pos = torch.arange(n)
        blocks = block_table[row, pos // PAGE].long()
        expected[blocks, pos % PAGE, :, : cfg.slot_size] = 1
    got = torch.from_numpy(counts).view(cache.shape)
    assert got.max().item() == 1, (
        f"slot bytes loaded up to {got.max().item()} times in one call "
        f"(GQA {gqa}); the packed cache should be read once"
    )
    assert torch.equal(got, expected), "loaded bytes differ from the slots in context"
