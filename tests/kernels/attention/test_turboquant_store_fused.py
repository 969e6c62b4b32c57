# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The one-launch TurboQuant store writes what 0.20.2's store writes.

Reference: a float64 PyTorch quantizer (norm, normalize, Hadamard rotation,
bucketize) and 0.20.2's own store (``triton_turboquant_store``, external
GEMM). Value bytes must equal 0.20.2's byte for byte, and so must whole
slots whose key has no coordinate near a midpoint; key indices must equal
the float64 reference except for coordinates within ``NEAR`` of a bucket
midpoint (both stores round the rotation in fp32, in different orders); the
fp16 norm must be float64's norm rounded to fp16 except near a rounding tie.
Keys and values are strided views of one ``qkv`` row, the cache has padded
pages of an odd size, and some slots are -1. Runs under the Triton CPU
interpreter (``HYBRIDKV_TRITON_INTERPRET=1``, fp32) and natively on a GPU
(bf16 inputs there too). FP8 keys (k8v4): the strided kernel's bytes equal
0.20.2's exactly. A pair codebook (``turboquant_pair_code``): each pair of
rotated coordinates is its float64 nearest point but near a tie, and its
search table (``pair_search_table``) gives the codes the search over all 64
points gives.
"""

import functools
import math

import pytest
import torch

from tests.kernels.attention.turboquant_store_args import store_kwargs
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store
from vllm.v1.attention.ops.triton_turboquant_store_fused import (
    _num_warps,
    turboquant_store,
    turboquant_store_hadamard,
)
from vllm.v1.attention.ops.turboquant_pair_code import (
    PAIR_CELLS,
    PAIR_POINTS,
    pair_codebook,
    pair_search_candidates,
    pair_search_table,
)

MSE_PRESETS = ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
BLOCK_SIZE, NUM_BLOCKS, NUM_TOKENS, NUM_Q_HEADS, NUM_KV_HEADS = 16, 3, 24, 4, 2
SENTINEL = 0xA5
# fp32 rotation error bound for unit vectors (a few ulps of the coordinate
# sums); the float64 reference decides every coordinate farther than this.
NEAR = 1e-6


def _hadamard(d: int) -> torch.Tensor:
    h = torch.tensor([[1.0]])
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def _qkv(d: int, dtype, device, seed: int):
    """Keys/values as the model hands them in: views into one qkv row."""
    g = torch.Generator().manual_seed(seed)
    width = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * d
    qkv = torch.randn(NUM_TOKENS, width, generator=g).to(dtype).to(device)
    q_end, k_end = NUM_Q_HEADS * d, (NUM_Q_HEADS + NUM_KV_HEADS) * d
    k = qkv[:, q_end:k_end].view(NUM_TOKENS, NUM_KV_HEADS, d)
    v = qkv[:, k_end:].view(NUM_TOKENS, NUM_KV_HEADS, d)
    return k, v


def _padded_cache(slot: int, device: str, pad: int):
    """[blocks, block_size, heads, slot] view of pages of an odd byte size."""
    real = BLOCK_SIZE * NUM_KV_HEADS * slot
    page = real + pad
    flat = torch.full((NUM_BLOCKS * page,), SENTINEL, dtype=torch.uint8, device=device)
    cache = torch.as_strided(
        flat,
        (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, slot),
        (page, NUM_KV_HEADS * slot, slot, 1),
    )
    return flat, cache, real, page


def _slots(device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:NUM_TOKENS]
    slots[::7] = -1  # padded batch rows: nothing stored
    return slots.to(torch.int64).to(device)


def _unpack_indices(cache_rows: torch.Tensor, d: int, bits: int) -> torch.Tensor:
    """[..., mse_bytes] uint8 -> [..., d] int64 indices."""
    b = cache_rows.to(torch.int64)
    if bits == 4:
        return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    words = b.view(*b.shape[:-1], d // 8, 3)
    word = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16)
    shifts = torch.arange(8) * 3
    return ((word[..., None] >> shifts) & 7).flatten(-2)


def _reference(k: torch.Tensor, midpoints: torch.Tensor):
    """float64 rotation, indices, distance to the nearest midpoint, norms."""
    k64 = k.double().cpu()
    norm = k64.norm(dim=-1, keepdim=True)
    y = (k64 / (norm + 1e-8)) @ _hadamard(k.shape[-1]).double()
    mids = midpoints.double().cpu()
    idx = torch.bucketize(y, mids, right=True)
    gap = (y[..., None] - mids).abs().min(dim=-1).values
    return idx, gap, norm.squeeze(-1)


def _stored(flat, cache, slots, d, cfg):
    """Per (token, head) the slot bytes; rows of skipped tokens dropped."""
    keep = slots.cpu() >= 0
    s = slots.cpu()[keep]
    rows = cache.cpu()[s // BLOCK_SIZE, s % BLOCK_SIZE]  # [n, heads, slot]
    mse_bytes = math.ceil(d * cfg.key_mse_bits / 8)
    idx = _unpack_indices(rows[..., :mse_bytes], d, cfg.key_mse_bits)
    norm_bits = rows[..., mse_bytes].to(torch.int32) | (
        rows[..., mse_bytes + 1].to(torch.int32) << 8
    )
    norm = norm_bits.to(torch.int16).view(torch.float16).double()
    return keep, rows, idx, norm


def _store_both(preset, d, dtype, device, seed, num_warps=None):
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    k, v = _qkv(d, dtype, device, seed)
    slots = _slots(device, seed)
    centroids, _ = get_centroids(d, cfg.centroid_bits).float().sort()
    midpoints = ((centroids[:-1] + centroids[1:]) / 2).to(device)
    pit = _hadamard(d).to(device)
    out = {}
    new = turboquant_store
    if num_warps is not None:
        kwargs = {a: b for a, b in store_kwargs(cfg).items() if a != "key_fp8"}
        new = functools.partial(turboquant_store_hadamard, num_warps=num_warps)
    for name, fn in (("old", triton_turboquant_store), ("new", new)):
        flat, cache, real, page = _padded_cache(cfg.slot_size_aligned, device, pad=37)
        fn(
            k,
            v,
            cache,
            slots,
            pit,
            midpoints,
            **(store_kwargs(cfg) if name == "old" or num_warps is None else kwargs),
        )
        out[name] = (flat, cache, real, page)
    return cfg, k, slots, midpoints, out


def _check_keys(name, idx, norm, ref_idx, gap, ref_norm):
    wrong = idx != ref_idx
    assert not (wrong & (gap > NEAR)).any(), (
        f"{name}: {int((wrong & (gap > NEAR)).sum())} key indices differ from the "
        f"float64 reference farther than {NEAR} from a midpoint "
        f"(max gap {gap[wrong].max().item():.3g})"
    )
    ulp = torch.finfo(torch.float16).eps * 2.0 ** torch.floor(torch.log2(ref_norm))
    err = (norm - ref_norm).abs() / ulp
    assert (err <= 0.5 + 1e-3).all(), (
        f"{name}: fp16 norm off by up to {err.max().item():.3f} ulp from float64"
    )
    return int(wrong.sum())


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("preset", MSE_PRESETS)
def test_fused_store_matches_0202_and_float64(preset, head_dim, triton_device):
    _check_store_against_0202_and_float64(preset, head_dim, triton_device)


@pytest.mark.parametrize("num_warps", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [256, 512])
@pytest.mark.parametrize("preset", MSE_PRESETS)
def test_every_warp_count_stores_what_0202_and_float64_store(
    preset, head_dim, num_warps, triton_device
):
    """The store spreads a program over 1, 2 or 4 warps by the grid's size
    (``_num_warps``); the sums and the transform then take other orders and
    paths, and the codes must not change beyond near-ties at any of them."""
    if triton_device != "cuda" and num_warps != 1:
        pytest.skip("the interpreter runs a program's warps as one")
    _check_store_against_0202_and_float64(preset, head_dim, triton_device, num_warps)


def test_a_program_has_one_warp_unless_the_grid_is_small():
    # Measured (benchmarks/NOTES.md, "Store"): at 8,192 tokens one warp takes
    # 0.61-0.75x the time of one per 128 dimensions at head_dim 256 and 512;
    # a decode step's few programs end sooner spread over more.
    assert [_num_warps(128, p) for p in (1, 64 * 8, 8192 * 8)] == [1, 1, 1]
    assert [_num_warps(256, p) for p in (64 * 4, 512 * 4, 8192 * 4)] == [2, 1, 1]
    assert [_num_warps(512, p) for p in (64 * 4, 256 * 4, 8192 * 4)] == [4, 2, 1]
    assert _num_warps(512, 0) == 4


def _check_store_against_0202_and_float64(preset, head_dim, device, num_warps=None):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    flips = {}
    for seed in range(2):
        cfg, k, slots, midpoints, out = _store_both(
            preset, head_dim, dtype, device, seed, num_warps
        )
        keep = slots.cpu() >= 0
        ref_idx, gap, ref_norm = _reference(k[keep.to(k.device)], midpoints)
        rows = {}
        for name, (flat, cache, real, page) in out.items():
            pages = flat.cpu().view(NUM_BLOCKS, page)
            assert (pages[:, real:] == SENTINEL).all(), f"{name} wrote into padding"
            _, rows[name], idx, norm = _stored(flat, cache, slots, head_dim, cfg)
            flips[name] = flips.get(name, 0) + _check_keys(
                name, idx, norm, ref_idx, gap, ref_norm
            )
        # Values: 0.20.2's routine on the same fp32 inputs, byte for byte.
        kps = cfg.key_packed_size
        assert torch.equal(rows["new"][..., kps:], rows["old"][..., kps:])
        # Keys away from ties (no coordinate within NEAR of a midpoint, norm
        # not at an fp16 rounding tie): byte for byte too.
        ulp = torch.finfo(torch.float16).eps * 2.0 ** torch.floor(torch.log2(ref_norm))
        frac = torch.frac(ref_norm / ulp)
        clear = (gap > NEAR).all(dim=-1) & ((frac - 0.5).abs() > 1e-3)
        assert clear.float().mean() > 0.5, "too few tie-free rows to compare"
        assert torch.equal(rows["new"][clear], rows["old"][clear])
        # Untouched slots (skipped tokens, other positions) stay as they were.
        written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
        written[slots.cpu()[keep]] = True
        for name, (flat, cache, real, page) in out.items():
            untouched = cache.cpu().reshape(NUM_BLOCKS * BLOCK_SIZE, -1)[~written]
            assert (untouched == SENTINEL).all(), f"{name} wrote an unmapped slot"
    # Near-tie flips are rare: at most a few per mille of the coordinates.
    total = 2 * int(keep.sum()) * NUM_KV_HEADS * head_dim
    assert flips["new"] <= max(2, total // 500), flips


def test_fused_store_refuses_shapes_it_cannot_rotate():
    k = torch.zeros(1, 1, 96)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        turboquant_store_hadamard(
            k,
            k,
            torch.zeros(1, 16, 1, 64, dtype=torch.uint8),
            torch.zeros(1),
            k,
            k,
            mse_bits=4,
            key_packed_size=50,
            value_quant_bits=4,
        )


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_keys_from_strided_views_equal_0202_bytes(head_dim, triton_device):
    """k8v4: the strided kernel writes 0.20.2's bytes without copying the views."""
    device = triton_device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    _, _, _, _, out = _store_both("turboquant_k8v4", head_dim, dtype, device, seed=5)
    (old, _, real, page), (new, _, _, _) = out["old"], out["new"]
    assert torch.equal(new, old)
    assert (old.view(NUM_BLOCKS, page)[:, :real] != SENTINEL).any()


def _pair_reference(k: torch.Tensor, points: torch.Tensor):
    """float64: each pair of rotated coordinates' nearest point, and by how
    much (squared distance) the second nearest is farther."""
    k64 = k.double().cpu()
    unit = k64 / (k64.norm(dim=-1, keepdim=True) + 1e-8)
    y = unit @ _hadamard(k.shape[-1]).double()
    pairs = y.reshape(*y.shape[:-1], -1, 1, 2)
    dist = ((pairs - points.double().cpu()) ** 2).sum(-1)
    two = dist.topk(2, dim=-1, largest=False)
    return two.indices[..., 0], two.values[..., 1] - two.values[..., 0]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_pair_code_stores_each_pair_s_nearest_point(head_dim, triton_device):
    """A pair codebook: each pair of rotated coordinates is stored as its
    nearest point's two 3-bit fields (low at the first coordinate); the norm
    and the values are the scalar code's bytes."""
    device = triton_device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_3bit_nc", head_dim)
    k, v = _qkv(head_dim, dtype, device, seed=11)
    slots = _slots(device, seed=11)
    keep = slots.cpu() >= 0
    points = pair_codebook(head_dim).to(device)
    centroids, _ = get_centroids(head_dim, 3).float().sort()
    rows, idx = {}, {}
    for name, table in (
        ("pairs", points),
        ("scalar", ((centroids[:-1] + centroids[1:]) / 2).to(device)),
    ):
        flat, cache, real, page = _padded_cache(cfg.slot_size_aligned, device, pad=37)
        turboquant_store(
            k, v, cache, slots, _hadamard(head_dim).to(device), table,
            **store_kwargs(cfg),
        )  # fmt: skip
        assert (flat.cpu().view(NUM_BLOCKS, page)[:, real:] == SENTINEL).all()
        _, rows[name], idx[name], _ = _stored(flat, cache, slots, head_dim, cfg)
    code = idx["pairs"][..., 0::2] + 8 * idx["pairs"][..., 1::2]
    ref, margin = _pair_reference(k[keep.to(k.device)], points)
    wrong = code != ref
    assert not (wrong & (margin > NEAR)).any(), (
        f"{int((wrong & (margin > NEAR)).sum())} of {code.numel()} pairs are not "
        "their nearest point"
    )
    assert int(wrong.sum()) <= max(2, code.numel() // 500)
    # Not the scalar code's indices, but its norm and value bytes.
    mse = cfg.key_packed_size - 2
    assert not torch.equal(rows["pairs"][..., :mse], rows["scalar"][..., :mse])
    assert torch.equal(rows["pairs"][..., mse:], rows["scalar"][..., mse:])


def _cell_bounds(table: torch.Tensor) -> torch.Tensor:
    """A ``pair_search_table``'s [7, 2] cell bounds (x, y)."""
    return table[PAIR_POINTS : PAIR_POINTS + PAIR_CELLS - 1]


def _cell_lists(table: torch.Tensor) -> torch.Tensor:
    """A ``pair_search_table``'s [cells, K] candidate point numbers."""
    k = pair_search_candidates(table, 3)
    return table[PAIR_POINTS + PAIR_CELLS :, 0].long().view(-1, k)


def _cell_candidates(table: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """[n, 2] pairs -> [n, K] their cells' candidates, the cell found as the
    store finds it (how many bounds each coordinate reaches)."""
    bounds = _cell_bounds(table)
    x = (pairs[:, None, 0] >= bounds[:, 0]).sum(-1)
    y = (pairs[:, None, 1] >= bounds[:, 1]).sum(-1)
    return _cell_lists(table)[PAIR_CELLS * x + y]


def _test_pairs(points: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """fp32 pairs where a search could go wrong, and typical ones: rotated
    coordinates of unit keys, every point and every midpoint of two points
    (ties) nudged by a few ulps, the table's bounds, and the whole square
    [-1, 1]^2 that unit keys' coordinates lie in."""
    g = torch.Generator().manual_seed(3)
    d = round(2.5 / points.abs().max().item()) ** 2  # the head size, roughly
    typical = torch.randn(20000, 2, generator=g) / math.sqrt(d)
    mids = ((points[:, None] + points[None]) / 2).reshape(-1, 2)
    bounds = _cell_bounds(table)
    across = torch.cartesian_prod(bounds[:, 0], bounds[:, 1])
    anywhere = torch.rand(20000, 2, generator=g) * 2 - 1
    base = torch.cat([typical, points, mids, across, anywhere])
    ulp = torch.finfo(torch.float32).eps * base.abs().clamp_min(1e-30)
    nudges = [base + k * ulp for k in (-3, -1, 0, 1, 3)]
    return torch.cat(nudges).float()


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_a_search_cell_lists_every_point_that_can_be_nearest_there(head_dim):
    """The store compares a pair with its cell's candidates only: the point
    the search over all 64 finds (fp32, first of equals) is among them, at
    ties and at the cell bounds too, and a cell lists at most 7 points."""
    points = pair_codebook(head_dim)
    table = pair_search_table(points)
    assert pair_search_candidates(table, 3) <= 7
    listed = _cell_lists(table)
    assert (listed[:, 1:] >= listed[:, :-1]).all(), "candidates not ascending"
    assert torch.equal(table[:PAIR_POINTS], points)
    pairs = _test_pairs(points, table)
    dx = pairs[:, None, 0] - points[:, 0]
    dy = pairs[:, None, 1] - points[:, 1]
    nearest = (dx * dx + dy * dy).argmin(-1)
    missed = ~(_cell_candidates(table, pairs) == nearest[:, None]).any(-1)
    assert not missed.any(), (
        f"{int(missed.sum())} of {len(pairs)} pairs' nearest point is not a "
        f"candidate of their cell, e.g. {pairs[missed][:3].tolist()}"
    )


@pytest.mark.parametrize("head_dim", [64, 512])
def test_the_search_table_stores_the_codes_of_the_search_over_all_points(
    head_dim, triton_device
):
    """The store with ``pair_search_table(points)`` writes the bytes it
    writes with the points alone, for random keys and for keys whose rotated
    coordinates reach the outer cells (a coordinate near 1)."""
    device = triton_device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = TurboQuantConfig.from_cache_dtype("turboquant_3bit_nc", head_dim)
    k, v = _qkv(head_dim, dtype, device, seed=13)
    h = _hadamard(head_dim)
    # Rotated, these keys are one or two of the basis vectors.
    for t, rows in enumerate(([0], [1, 2], [3], [head_dim - 1, 5]), start=1):
        k[t, 0] = h[rows].sum(0).to(dtype).to(device)
    slots = _slots(device, seed=13)
    points = pair_codebook(head_dim).to(device)
    stored = {}
    for name, table in (("points", points), ("table", pair_search_table(points))):
        flat, cache, real, page = _padded_cache(cfg.slot_size_aligned, device, pad=37)
        turboquant_store(
            k, v, cache, slots, h.to(device), table, **store_kwargs(cfg)
        )  # fmt: skip
        stored[name] = flat.cpu()
    assert torch.equal(stored["table"], stored["points"])


def test_the_store_refuses_a_table_that_is_not_a_pair_search_table():
    table = pair_search_table(pair_codebook(64))
    with pytest.raises(ValueError, match="pair_search_table\\(points\\)"):
        pair_search_candidates(table[:-3], 3)
    with pytest.raises(ValueError, match="for 4-bit keys"):
        pair_search_candidates(table, 4)


def test_a_pair_codebook_needs_the_fused_store():
    k = torch.zeros(1, 1, 96)
    with pytest.raises(ValueError, match="a pair codebook needs the fused MSE store"):
        turboquant_store(
            k, k, torch.zeros(1, 16, 1, 78, dtype=torch.uint8), torch.zeros(1),
            torch.eye(96), pair_codebook(96), mse_bits=3, key_packed_size=38,
            value_quant_bits=3,
        )  # fmt: skip
    k = torch.zeros(1, 1, 64)
    with pytest.raises(ValueError, match="contiguous \\[64, 2\\] float32"):
        turboquant_store(
            k, k, torch.zeros(1, 16, 1, 70, dtype=torch.uint8), torch.zeros(1),
            _hadamard(64), pair_codebook(64), mse_bits=4, key_packed_size=34,
            value_quant_bits=4,
        )  # fmt: skip
