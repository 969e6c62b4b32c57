# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A continuation's cached K/V in the model dtype, in one launch.

A prefill chunk that continues a prompt (a prefix-cache hit, a chunked
prompt's later chunk) attends to its cached tokens through FlashAttention
over packed K/V (``turboquant_prefill_batch``), so the cached part is read
back from the TurboQuant cache. Done as 0.20.2 does it, that is 0.20.2's
dequantization into fp16, the key rotation into an fp32 copy, the key scale,
the key offset and the value rotation as passes of their own, two casts and a
copy into the packed rows: about ten full passes over the request's cached
K/V per layer, for every request of the step, even where they share one
cached prefix.

Here one program reads a tile of ``BLOCK_N`` cached tokens of one KV head,
rebuilds keys and values in registers (the rotations back as the store's
in-register Walsh-Hadamard transform) and writes them once, in the model
dtype, into the packed rows the attention reads.

Requests that hit one cached prefix hold the same blocks. Their read-backs
into one buffer can share tiles: with a map of the cache tile each packed
tile holds (``held``), a program whose packed rows already hold its tile,
read back for an earlier request of the step, returns at once.
"""

import torch

from vllm.triton_utils import tl, triton
from vllm.triton_utils.compiled_launch import launcher
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.ops.triton_turboquant_decode_splitkv import (
    _fp16_word,
    _load_field,
    _load_words,
    _unpack,
)
from vllm.v1.attention.ops.turboquant_device import use_fp8_e4b15
from vllm.v1.attention.ops.turboquant_hadamard import (
    _hadamard_tile,
    rotates_in_registers,
)
from vllm.v1.attention.ops.turboquant_pair_code import (
    _pair_point_values,
    check_pair_codebook,
    is_pair_codebook,
)
from vllm.v1.attention.ops.turboquant_slot_layout import slot_layout

# Cached tokens per program: one page of the backend's caches.
BLOCK_N = 16


# One compile for every length and row: a request's cached length and its
# first packed row are launch arguments that Triton would otherwise
# specialize (a warm-up's 1 among them).
@triton.jit(do_not_specialize=["cached", "row0"])
def _tq_unpack_cached(
    KV_ptr,  # [num_blocks, page, Hk, slot] uint8
    Block_row_ptr,  # the request's block ids, int32
    Centroids_ptr,  # [2**MSE_BITS] fp32, or [64, 2] (PAIR_CODE)
    Rot_ptr,  # the backend's scaled Hadamard matrix: only [0, 0] is read
    KeyScale_ptr,  # [D] fp32 (KEY_SCALE)
    KeyOffset_ptr,  # [Hk, D] fp32 (KEY_OFFSET)
    K_out_ptr,  # [cached, Hk, D] rows, model dtype
    V_out_ptr,
    Held_ptr,  # [packed rows / BLOCK_N, Hk] int32 (SHARE): the tile each holds
    cached,
    row0,  # K_out_ptr's first row in the packed K/V (SHARE)
    stride_cb,  # cache strides in bytes
    stride_cp,
    stride_ch,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    D: tl.constexpr,
    LOG2_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KEY_FP8: tl.constexpr,
    MSE_BITS: tl.constexpr,
    NORM_WORDS: tl.constexpr,  # the key norm's offset in the slot, in words
    VAL_WORDS: tl.constexpr,  # the value field's
    SCALE_WORDS: tl.constexpr,  # the value scale's (the zero follows)
    VQB: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    KEY_SCALE: tl.constexpr,
    KEY_OFFSET: tl.constexpr,
    ROTATE_VALUES: tl.constexpr,
    SHARE: tl.constexpr,  # 0: no held map; 1: row0 on a tile; 2: row0 between
    PAIR_CODE: tl.constexpr,  # Centroids_ptr holds a pair code's [64, 2] points
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    hk = tl.num_programs(1)
    if SHARE == 1:
        # A whole tile is known by its block and its place there; the packed
        # rows may still hold it from an earlier request of the step.
        whole = (tile + 1) * BLOCK_N <= cached
        first = tl.load(Block_row_ptr + tile * BLOCK_N // PAGE)
        known = first * (PAGE // BLOCK_N) + tile * BLOCK_N % PAGE // BLOCK_N
        held = Held_ptr + (row0 // BLOCK_N + tile) * hk + head
        todo = (tl.load(held) != known) | (whole == 0)
    else:
        todo = True
    if todo:
        pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        live = pos < cached
        d = tl.arange(0, D)
        blk = tl.load(Block_row_ptr + pos // PAGE, mask=live, other=0).to(tl.int64)
        base = (
            blk * stride_cb
            + (pos % PAGE).to(tl.int64) * stride_cp
            + head.to(tl.int64) * stride_ch
        )

        if KEY_FP8:
            w0, w1, w2 = _load_field(KV_ptr, KV_ptr, base, live, 0, 8, D, False)
            bits = _unpack(w0, w1, w2, 8, D, BLOCK_N).to(tl.uint8)
            if FP8_E4B15:
                k = bits.to(tl.float8e4b15, bitcast=True).to(tl.float32)
            else:
                k = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            w0, w1, w2 = _load_field(KV_ptr, KV_ptr, base, live, 0, MSE_BITS, D, False)
            idx = _unpack(w0, w1, w2, MSE_BITS, D, BLOCK_N)
            if PAIR_CODE:
                c = _pair_point_values(idx, Centroids_ptr)
            else:
                c = tl.load(Centroids_ptr + idx)
            if NORM_CORRECTION:
                c = c / tl.sqrt(tl.sum(c * c, axis=1) + 1e-16)[:, None]
            norm = _load_words(KV_ptr, KV_ptr, base, NORM_WORDS, live, False)
            if KEY_OFFSET:
                # The store marks a key it kept unshifted by its norm's sign bit.
                marked = norm >= 0x8000
                norm = norm & 0x7FFF
            scale = _fp16_word(norm) * tl.load(Rot_ptr)

        w0, w1, w2 = _load_field(KV_ptr, KV_ptr, base, live, VAL_WORDS, VQB, D, False)
        v_scale = _fp16_word(
            _load_words(KV_ptr, KV_ptr, base, SCALE_WORDS, live, False)
        )
        v_zero = _fp16_word(
            _load_words(KV_ptr, KV_ptr, base, SCALE_WORDS + 1, live, False)
        )
        v = _unpack(w0, w1, w2, VQB, D, BLOCK_N).to(tl.float32)
        v = v * v_scale[:, None] + v_zero[:, None]

        # Keys and values rotate back as one [2 * BLOCK_N, D] tile: each stage's
        # exchange between threads is paid once for both.
        if KEY_FP8:
            if ROTATE_VALUES:
                v = _hadamard_tile(v, BLOCK_N, D, LOG2_D)
        elif ROTATE_VALUES:
            kv = tl.reshape(tl.permute(tl.join(c, v), (2, 0, 1)), [2 * BLOCK_N, D])
            kv = tl.reshape(_hadamard_tile(kv, 2 * BLOCK_N, D, LOG2_D), [2, BLOCK_N, D])
            k, v = tl.split(tl.permute(kv, (1, 2, 0)))
        else:
            k = _hadamard_tile(c, BLOCK_N, D, LOG2_D)
        if ROTATE_VALUES:
            v = v * tl.load(Rot_ptr)
        if not KEY_FP8:
            k = k * scale[:, None]
            if KEY_SCALE and KEY_OFFSET:
                # One [2, D] load for both: loaded apart, the second vector's
                # layout spreads back over the whole tile (~400 instructions a
                # thread more, sm_90).
                two = tl.arange(0, 2)[:, None]
                sm = tl.load(
                    tl.where(
                        two == 0,
                        KeyScale_ptr + d[None, :],
                        KeyOffset_ptr + head * D + d[None, :],
                    )
                )
                ks, mu = tl.split(tl.permute(sm, (1, 0)))
                k = k * ks[None, :] + tl.where(marked[:, None], 0.0, mu[None, :])
            elif KEY_SCALE:
                k = k * tl.load(KeyScale_ptr + d)[None, :]
            elif KEY_OFFSET:
                mu = tl.load(KeyOffset_ptr + head * D + d)
                k = tl.where(marked[:, None], k, k + mu[None, :])

        rows = pos.to(tl.int64)[:, None]
        store = live[:, None]
        k_ptrs = K_out_ptr + rows * stride_kt + head * stride_kh + d[None, :]
        tl.store(k_ptrs, k.to(K_out_ptr.dtype.element_ty), mask=store)
        v_ptrs = V_out_ptr + rows * stride_vt + head * stride_vh + d[None, :]
        tl.store(v_ptrs, v.to(V_out_ptr.dtype.element_ty), mask=store)
        if SHARE == 1:
            tl.store(held, tl.where(whole, known, -1))
    if SHARE == 2:
        # Rows off the tile grid: the two tiles they touch hold nothing whole.
        slot = (row0 + tile * BLOCK_N) // BLOCK_N
        tl.store(Held_ptr + slot * hk + head, -1)
        tl.store(Held_ptr + (slot + 1) * hk + head, -1)


def _warps(head_dim: int, key_fp8: bool) -> int:
    # The fastest of 2, 4 and 8 warps on an H200 at 2K and 8K cached tokens
    # (benchmarks/releases/release-61.md). For MSE keys the tile is an fp32
    # [2 * BLOCK_N, D] through the rotation; 2 warps at head_dim 256 and 4 at
    # 512 ran 23 % and 20 % faster than the next best count there.
    if key_fp8:
        return 4 if head_dim <= 256 else 8
    return 2 if head_dim == 256 else 4


def unpack_cached(
    kv_cache: torch.Tensor,  # [num_blocks, page, Hk, slot] uint8
    block_row: torch.Tensor,  # [1, >= cdiv(cached, page)] int32
    cached: int,
    centroids: torch.Tensor,  # [2**mse_bits] fp32, or a pair codebook
    rotation: torch.Tensor,  # the backend's scaled Hadamard matrix
    k_out: torch.Tensor,  # [cached, Hk, D], last dimension contiguous
    v_out: torch.Tensor,
    mse_bits: int,
    value_bits: int,
    key_fp8: bool,
    norm_correction: bool,
    key_scale: torch.Tensor | None = None,
    key_offset: torch.Tensor | None = None,
    value_rotation: bool = False,
    held: torch.Tensor | None = None,
    row0: int = 0,
) -> None:
    """Write the first ``cached`` tokens' keys and values into ``k_out`` and
    ``v_out`` as the model computed them: MSE keys rotated back by
    ``rotation`` (``is_backend_hadamard``), multiplied by ``key_scale``
    and shifted back by ``key_offset`` where the layer stores them so;
    values rotated back where ``value_rotation``. ``centroids`` may be a
    pair codebook (``turboquant_pair_code``).

    ``held`` ([packed rows / BLOCK_N + 1, Hk] int32) says which whole
    ``BLOCK_N``-token tile of the cache each tile of the packed rows holds
    (its block times page / BLOCK_N, plus its first token's place in the
    block over BLOCK_N), or -1; ``k_out`` and ``v_out`` start at packed row
    ``row0``. A tile the packed rows already hold at the same place is not
    read again, and the tiles written are recorded. A caller that writes the
    packed rows otherwise marks them -1."""
    num_blocks, page, hk, _ = kv_cache.shape
    D = k_out.shape[-1]
    if not rotates_in_registers(D):
        raise ValueError(
            f"unpack_cached rotates in registers and needs a power-of-two "
            f"head_dim >= 16, got {D}; dequantize with 0.20.2's kernel instead"
        )
    for name, t in (("k_out", k_out), ("v_out", v_out)):
        if t.shape[0] < cached or t.shape[1:] != (hk, D) or t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be [>= {cached}, {hk}, {D}] with its last dimension "
                f"contiguous, got {tuple(t.shape)} with strides {t.stride()}"
            )
    share = 0
    if held is not None:
        tiles = (row0 + cdiv(cached, BLOCK_N) * BLOCK_N) // BLOCK_N + 1
        if page % BLOCK_N or held.dtype != torch.int32 or held.shape[1:] != (hk,):
            raise ValueError(
                f"held must be int32 [tiles, {hk}] over a cache whose page is a "
                f"multiple of {BLOCK_N} tokens, got {held.dtype} "
                f"{tuple(held.shape)} and a {page}-token page; pass held=None"
            )
        if held.shape[0] < tiles or not held.is_contiguous():
            raise ValueError(
                f"held must be contiguous with >= {tiles} rows for {cached} tokens "
                f"from packed row {row0}, got {tuple(held.shape)}"
            )
        share = 1 if row0 % BLOCK_N == 0 else 2
    pairs = not key_fp8 and is_pair_codebook(centroids)
    if pairs:
        check_pair_codebook(centroids, mse_bits)
    if cached == 0:
        return
    layout = slot_layout(D, key_fp8, mse_bits, value_bits)
    launcher(_tq_unpack_cached)[(cdiv(cached, BLOCK_N), hk)](
        kv_cache,
        block_row,
        centroids,
        rotation,
        rotation if key_scale is None else key_scale,
        rotation if key_offset is None else key_offset,
        k_out,
        v_out,
        rotation if held is None else held,
        cached,
        row0,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        k_out.stride(0),
        k_out.stride(1),
        v_out.stride(0),
        v_out.stride(1),
        D=D,
        LOG2_D=D.bit_length() - 1,
        PAGE=page,
        BLOCK_N=BLOCK_N,
        KEY_FP8=bool(key_fp8),
        MSE_BITS=layout.key_bits,
        NORM_WORDS=layout.key_index_bytes // 2,
        VAL_WORDS=layout.key_bytes // 2,
        SCALE_WORDS=(layout.key_bytes + layout.value_index_bytes) // 2,
        VQB=value_bits,
        NORM_CORRECTION=bool(norm_correction) and not key_fp8,
        FP8_E4B15=use_fp8_e4b15(kv_cache.device),
        KEY_SCALE=key_scale is not None,
        KEY_OFFSET=key_offset is not None,
        ROTATE_VALUES=bool(value_rotation),
        SHARE=share,
        PAIR_CODE=pairs,
        num_warps=_warps(D, key_fp8),
    )
