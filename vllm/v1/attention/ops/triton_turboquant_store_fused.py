# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant MSE-key store in one kernel launch.

0.20.2's MSE store runs six PyTorch ops before its kernel (``key.float()``,
the norm, ``+ 1e-8``, the division, an fp32 ``x_hat @ PiT`` GEMM and
``value.float()``), each a launch and an fp32 temporary. A decode step of 64
tokens is then dominated by launches: ~30x bf16's single store kernel in an
eager timing, and seven kernels per layer inside a CUDA graph.

The backend's rotation is the Sylvester Hadamard matrix scaled by
``1/sqrt(D)`` (``turboquant_attn._build_hadamard``), so here the rotation is a
fast Walsh-Hadamard transform in registers (``log2(D)`` add/subtract stages,
no ``D x D`` matrix read) and everything else happens in the same program:
norm, normalization, rotation, bucketize, packing, norm and value store. Keys
and values are read in the model dtype through their strides (the ``qkv``
split hands in views).

Numerics follow 0.20.2's order: fp32 norm (IEEE square root), ``x / (norm +
1e-8)`` with an IEEE division, then the rotation, whose entries are the
scaled matrix's own fp32 value ``PiT[0, 0]``. The rotation's summation order
differs from cuBLAS's (which 0.20.2 itself does not fix), so a key
coordinate within a few fp32 ulps of a bucket midpoint may land in the
neighbouring bucket; everything else (indices elsewhere, the fp16 norm up to
its own rounding, value bytes through 0.20.2's own value routine) is what
0.20.2 stores. A layer that stores its values rotated
(``turboquant.value_rotation``) rotates each value by the same transform and
codes it from registers with 0.20.2's arithmetic and layout
(``_store_value_codes``).

FP8 keys (k8v4) were one kernel already, but 0.20.2 copies the strided
``qkv`` views first; ``_tq_store_fp8_strided`` is the same per-element cast
and value routine reading the views in place (bytes equal to 0.20.2's).
"""

import torch

from vllm.triton_utils import tl, triton
from vllm.triton_utils.compiled_launch import launcher
from vllm.utils.math_utils import next_power_of_2
from vllm.v1.attention.ops.triton_turboquant_decode import _use_fp8_e4b15
from vllm.v1.attention.ops.triton_turboquant_store import (
    _store_quantized_value,
    triton_turboquant_store,
)
from vllm.v1.attention.ops.turboquant_hadamard import (
    _hadamard_rows,
    rotates_in_registers,
)
from vllm.v1.attention.ops.turboquant_pair_code import (
    _nearest_pair_fields,
    is_pair_codebook,
    pair_search_candidates,
)
from vllm.v1.attention.ops.turboquant_slot_layout import (
    check_cache_slots,
    check_key_offset,
    slot_layout,
)


@triton.jit
def _tq_store_mse_hadamard(
    Key_ptr,
    Value_ptr,
    PiT_ptr,  # only PiT[0, 0] is read: the scaled Hadamard entry
    KeyScale_ptr,  # [D] fp32, keys are divided by it (HAS_KEY_SCALE)
    KeyOffset_ptr,  # [H, D] fp32, subtracted first where shorter (HAS_KEY_OFFSET)
    Positions_ptr,  # [N] token positions: only position 0 may go unshifted
    Midpoints_ptr,  # sorted level midpoints, or a pair code's points or search table
    KV_cache_ptr,
    Slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_pos,
    stride_cache_head,
    D: tl.constexpr,
    LOG2_D: tl.constexpr,
    H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MSE_BITS: tl.constexpr,
    MSE_BYTES: tl.constexpr,
    KPS: tl.constexpr,
    VQB: tl.constexpr,
    VAL_DATA_BYTES: tl.constexpr,
    BLOCK_VAL: tl.constexpr,
    BLOCK_GRP: tl.constexpr,
    HAS_KEY_SCALE: tl.constexpr,
    HAS_KEY_OFFSET: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    ROTATE_VALUE: tl.constexpr,  # store H v (turboquant.value_rotation)
    PAIR_CODE: tl.constexpr,  # keys coded by pairs (turboquant_pair_code)
    PAIR_CANDIDATES: tl.constexpr,  # per search-table cell; 0: all 64 points
):
    pid = tl.program_id(0)
    token = pid // H
    head = pid % H
    token64 = token.to(tl.int64)
    d = tl.arange(0, D)
    # The loads are issued before the slot's branch and the first store,
    # which the compiler moves no load across: a program waits for memory
    # once, not three times (the slot, then the key, then the value after
    # the key's stores). A decode step's store is one wave of programs, each
    # as long as its chain of waits. (An unrotated value is loaded by
    # 0.20.2's value routine, after the key's stores.)
    k = tl.load(Key_ptr + token64 * stride_kt + head * stride_kh + d).to(tl.float32)
    if HAS_KEY_SCALE:
        scale = tl.load(KeyScale_ptr + d)
    if HAS_KEY_OFFSET:
        offset = tl.load(KeyOffset_ptr + head * D + d)
    if HAS_POSITIONS:
        first = tl.load(Positions_ptr + token) == 0
    if ROTATE_VALUE:
        v = tl.load(Value_ptr + token64 * stride_vt + head * stride_vh + d)
    h = tl.load(PiT_ptr)
    slot = tl.load(Slot_mapping_ptr + token)
    if slot < 0:
        return
    slot_base = (
        (slot // BLOCK_SIZE).to(tl.int64) * stride_cache_block
        + (slot % BLOCK_SIZE).to(tl.int64) * stride_cache_pos
        + head.to(tl.int64) * stride_cache_head
    )

    if HAS_KEY_OFFSET:
        # The key is stored shifted (k - mu) or as it is, whichever is the
        # shorter vector: the quantizer's error scales with the length.
        shifted = k - offset
        if HAS_KEY_SCALE:
            shifted = tl.div_rn(shifted, scale)
    if HAS_KEY_SCALE:
        k = tl.div_rn(k, scale)
    norm = tl.sqrt_rn(tl.sum(k * k, axis=0))
    if HAS_KEY_OFFSET:
        shifted_norm = tl.sqrt_rn(tl.sum(shifted * shifted, axis=0))
        # Ties (a zero offset) and a zero key go shifted: unmarked.
        keep = (norm < shifted_norm) & (norm > 0.0)
        if HAS_POSITIONS:
            keep = keep & first
        k = tl.where(keep, k, shifted)
        norm = tl.where(keep, norm, shifted_norm)
    x = tl.div_rn(k, tl.zeros([D], tl.float32) + (norm + 1e-8))
    y = _hadamard_rows(x, D, LOG2_D) * h

    if PAIR_CODE:
        idx = _nearest_pair_fields(y, Midpoints_ptr, D, PAIR_CANDIDATES)
    else:
        # Bucket = number of (sorted) midpoints <= y: the insertion point
        # 0.20.2's binary search finds, from uniform scalar loads instead of
        # MSE_BITS gathers per coordinate.
        idx = tl.zeros([D], tl.int32)
        for j in tl.static_range(2**MSE_BITS - 1):
            idx += (y >= tl.load(Midpoints_ptr + j)).to(tl.int32)

    _store_codes(KV_cache_ptr + slot_base, idx, D, MSE_BITS)

    bits = _f16_bits(norm)
    if HAS_KEY_OFFSET:
        # A key stored unshifted carries the norm's sign bit, which a norm
        # never sets: its score lacks the -q.mu every shifted key's has.
        bits = bits | (keep.to(tl.int32) << 15)
    _store_u16(KV_cache_ptr + slot_base + MSE_BYTES, bits)

    if ROTATE_VALUE:
        v = _hadamard_rows(v.to(tl.float32), D, LOG2_D) * h
        _store_value_codes(KV_cache_ptr + slot_base + KPS, v, D, VQB, VAL_DATA_BYTES)
    else:
        _store_quantized_value(
            Value_ptr,
            KV_cache_ptr,
            token64 * stride_vt + head * stride_vh,
            slot_base,
            d,
            d < D,
            D=D,
            KPS=KPS,
            VQB=VQB,
            VAL_DATA_BYTES=VAL_DATA_BYTES,
            BLOCK_D=D,
            BLOCK_VAL=BLOCK_VAL,
            BLOCK_GRP=BLOCK_GRP,
        )


@triton.jit
def _store_codes(ptr, idx, D: tl.constexpr, BITS: tl.constexpr):
    """Pack a [D] vector of BITS-bit codes at ``ptr``: 4 bits two per byte
    (the lower index in the low nibble), 3 bits eight per 24-bit little-endian
    word (0.20.2's layouts for keys and values alike)."""
    if BITS == 4:
        lo, hi = tl.split(tl.reshape(idx, [D // 2, 2]))
        tl.store(ptr + tl.arange(0, D // 2), (lo | (hi << 4)).to(tl.uint8))
    else:
        groups = tl.reshape(idx, [D // 8, 8])
        word = tl.sum(groups << (tl.arange(0, 8) * 3)[None, :], axis=1)
        g = tl.arange(0, D // 8) * 3
        for byte in tl.static_range(3):
            tl.store(ptr + g + byte, ((word >> (8 * byte)) & 0xFF).to(tl.uint8))


@triton.jit
def _store_u16(ptr, bits):
    """Two bytes, little endian: fp16 fields may start at odd addresses."""
    two = tl.arange(0, 2)
    tl.store(ptr + two, ((bits >> (two * 8)) & 0xFF).to(tl.uint8))


@triton.jit
def _store_value_codes(
    ptr, v, D: tl.constexpr, VQB: tl.constexpr, VAL_DATA_BYTES: tl.constexpr
):
    """A [D] fp32 value in 0.20.2's value field at ``ptr``: VQB-bit codes of
    the uniform grid from its minimum to its maximum, then the grid's step
    and minimum as fp16. The arithmetic is 0.20.2's value store's, applied
    to a vector already in registers."""
    top: tl.constexpr = (1 << VQB) - 1
    v_min = tl.min(v, axis=0)
    step = (tl.max(v, axis=0) - v_min) / top
    step = tl.where(step > 1e-8, step, 1e-8)
    idx = tl.minimum(tl.maximum(((v - v_min) / step + 0.5).to(tl.int32), 0), top)
    _store_codes(ptr, idx, D, VQB)
    _store_u16(ptr + VAL_DATA_BYTES, _f16_bits(step))
    _store_u16(ptr + VAL_DATA_BYTES + 2, _f16_bits(v_min))


@triton.jit
def _f16_bits(x):
    return x.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)


@triton.jit
def _tq_store_fp8_strided(
    Key_ptr,
    Value_ptr,
    KV_cache_ptr,
    Slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_pos,
    stride_cache_head,
    D: tl.constexpr,
    H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KPS: tl.constexpr,
    VQB: tl.constexpr,
    VAL_DATA_BYTES: tl.constexpr,
    BLOCK_VAL: tl.constexpr,
    BLOCK_GRP: tl.constexpr,
    FP8_E4B15: tl.constexpr,
):
    """FP8 keys: 0.20.2's per-element cast, from strided rows (no copies)."""
    pid = tl.program_id(0)
    token = pid // H
    head = pid % H
    slot = tl.load(Slot_mapping_ptr + token)
    if slot < 0:
        return
    slot_base = (
        (slot // BLOCK_SIZE).to(tl.int64) * stride_cache_block
        + (slot % BLOCK_SIZE).to(tl.int64) * stride_cache_pos
        + head.to(tl.int64) * stride_cache_head
    )
    token64 = token.to(tl.int64)
    d = tl.arange(0, D)
    k = tl.load(Key_ptr + token64 * stride_kt + head * stride_kh + d)
    k8 = k.to(tl.float8e4b15) if FP8_E4B15 else k.to(tl.float8e4nv)
    tl.store(KV_cache_ptr + slot_base + d, k8.to(tl.uint8, bitcast=True))
    _store_quantized_value(
        Value_ptr,
        KV_cache_ptr,
        token64 * stride_vt + head * stride_vh,
        slot_base,
        d,
        d < D,
        D=D,
        KPS=KPS,
        VQB=VQB,
        VAL_DATA_BYTES=VAL_DATA_BYTES,
        BLOCK_D=D,
        BLOCK_VAL=BLOCK_VAL,
        BLOCK_GRP=BLOCK_GRP,
    )


# Warps of a grid that leaves no SM idle for want of programs (H100/H200: 132
# SMs); the measured crossover in benchmarks/NOTES.md, "Store".
_GRID_WARPS = 2048


def _num_warps(head_dim: int, programs: int) -> int:
    # One program per (token, head). Within one warp a program's Walsh-Hadamard
    # stages and norms are shuffles; over 2 or 4 warps they go through shared
    # memory with barriers, twice where the value is rotated too. One warp is
    # fastest once the grid has programs enough; a smaller grid (a decode
    # step's) ends sooner with a program spread over up to a warp per 128
    # dimensions, and never over more than 4 (8 was slower at every size).
    return max(1, min(4, head_dim // 128, _GRID_WARPS // max(programs, 1)))


def turboquant_store_hadamard(
    key: torch.Tensor,  # [N, H, D] model dtype; last dim contiguous
    value: torch.Tensor,  # [N, H, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, H, slot] uint8, strided
    slot_mapping: torch.Tensor,  # [N] int32/int64, -1 = skip
    PiT: torch.Tensor,  # [D, D] Sylvester Hadamard / sqrt(D), float32
    midpoints: torch.Tensor,  # [2**mse_bits - 1] float32, sorted; or [64, 2]
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    num_warps: int | None = None,
    key_scale: torch.Tensor | None = None,  # [D] fp32
    key_offset: torch.Tensor | None = None,  # [H, D] fp32
    positions: torch.Tensor | None = None,  # [N] int
    value_rotation: bool = False,
) -> None:
    """Store MSE-quantized keys and uniform-quantized values in one launch.

    ``PiT`` must be the scaled Sylvester Hadamard matrix the TurboQuant
    backend builds; only its [0, 0] entry is read (on the device). With
    ``key_scale`` the keys stored are ``key / key_scale`` (the layer's
    per-channel key scale, ``turboquant.key_scale``). With ``key_offset``
    (the layer's per-KV-head key offset, ``turboquant.key_offset``) each key
    is stored as ``(key - key_offset[h]) / key_scale`` or ``key / key_scale``,
    whichever is shorter, the latter with its norm's sign bit set; with
    ``positions`` (the tokens' positions in their sequences) only a
    sequence's first key may be stored the latter way. With
    ``value_rotation`` the values stored are ``PiT @ value``, coded as 0.20.2
    codes values (``turboquant.value_rotation``). Where ``midpoints`` is a
    pair codebook (``turboquant_pair_code``: its points, or for speed its
    ``pair_search_table``) each pair of rotated coordinates is coded as its
    nearest point instead.
    """
    N, H, D = key.shape
    if not rotates_in_registers(D) or mse_bits not in (3, 4):
        raise ValueError(
            "the fused TurboQuant store needs a power-of-two head_dim >= 16 and "
            f"3- or 4-bit MSE keys, got head_dim={D}, mse_bits={mse_bits}; "
            "use triton_turboquant_store for other shapes"
        )
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if key_scale is not None:
        _check_key_scale(key_scale, D)
    if key_offset is not None:
        check_key_offset(key_offset, H, D)
    pairs = is_pair_codebook(midpoints)
    candidates = pair_search_candidates(midpoints, mse_bits) if pairs else 0
    layout = slot_layout(D, False, mse_bits, value_quant_bits)
    launcher(_tq_store_mse_hadamard)[(N * H,)](
        key,
        value,
        PiT,
        PiT if key_scale is None else key_scale,
        PiT if key_offset is None else key_offset,
        slot_mapping if positions is None else positions,
        midpoints,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        D=D,
        LOG2_D=D.bit_length() - 1,
        H=H,
        BLOCK_SIZE=kv_cache.shape[1],
        MSE_BITS=mse_bits,
        MSE_BYTES=layout.key_index_bytes,
        KPS=key_packed_size,
        VQB=value_quant_bits,
        VAL_DATA_BYTES=layout.value_index_bytes,
        BLOCK_VAL=next_power_of_2(layout.value_index_bytes),
        BLOCK_GRP=D // 8,
        HAS_KEY_SCALE=key_scale is not None,
        HAS_KEY_OFFSET=key_offset is not None,
        HAS_POSITIONS=key_offset is not None and positions is not None,
        ROTATE_VALUE=value_rotation,
        PAIR_CODE=pairs,
        PAIR_CANDIDATES=candidates,
        num_warps=num_warps or _num_warps(D, N * H),
        num_stages=1,
    )


def _check_key_scale(key_scale: torch.Tensor, head_dim: int) -> None:
    if (
        key_scale.dtype != torch.float32
        or key_scale.shape != (head_dim,)
        or key_scale.stride(0) != 1
    ):
        raise ValueError(
            f"key_scale must be a contiguous [{head_dim}] float32 vector, got "
            f"{key_scale.dtype} {tuple(key_scale.shape)}; build it with "
            "turboquant.key_scale.key_channel_scale"
        )


def turboquant_store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    PiT: torch.Tensor,
    midpoints: torch.Tensor,
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    key_fp8: bool = False,
    key_scale: torch.Tensor | None = None,
    key_offset: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    value_rotation: bool = False,
) -> None:
    """The backend's store: ``triton_turboquant_store``'s arguments, with
    ``PiT`` the backend's scaled Hadamard matrix. MSE keys take the fused
    kernel, FP8 keys a strided copy of 0.20.2's kernel (the ``qkv`` views
    are not copied first); other shapes take 0.20.2's launcher.
    ``key_scale`` ([D] fp32, MSE keys only): store ``key / key_scale``.
    ``key_offset`` ([H, D] fp32) and ``positions`` ([N]): see
    ``turboquant_store_hadamard``, which alone stores an offset (0.20.2's
    kernels have no sign bit to read), rotated values (``value_rotation``)
    and pair codes (``midpoints`` a pair codebook)."""
    N, H, D = key.shape
    fused = not key_fp8 and rotates_in_registers(D) and mse_bits in (3, 4)
    for name, wanted, fix in (
        ("key_offset", key_offset is not None, "bind no offset"),
        ("value_rotation", value_rotation, "store its values unrotated"),
        ("a pair codebook", is_pair_codebook(midpoints), "code keys per coordinate"),
    ):
        if wanted and not fused:
            keys = "FP8 keys" if key_fp8 else f"{mse_bits}-bit keys"
            raise ValueError(
                f"{name} needs the fused MSE store (power-of-two head_dim >= 16, "
                f"3- or 4-bit MSE keys), got head_dim={D}, {keys}; {fix} for "
                "this layer"
            )
    if key_scale is not None and key_fp8:
        raise ValueError(
            "key_scale applies to MSE keys; FP8 keys are stored per element and "
            "take none"
        )
    check_cache_slots(kv_cache, slot_layout(D, key_fp8, mse_bits, value_quant_bits))
    pow2 = rotates_in_registers(D)
    if key_fp8 and pow2 and key.stride(-1) == 1 and value.stride(-1) == 1:
        val_bytes = slot_layout(D, True, 0, value_quant_bits).value_index_bytes
        launcher(_tq_store_fp8_strided)[(N * H,)](
            key,
            value,
            kv_cache,
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            D=D,
            H=H,
            BLOCK_SIZE=kv_cache.shape[1],
            KPS=key_packed_size,
            VQB=value_quant_bits,
            VAL_DATA_BYTES=val_bytes,
            BLOCK_VAL=next_power_of_2(val_bytes),
            BLOCK_GRP=D // 8,
            FP8_E4B15=_use_fp8_e4b15(key.device.index or 0),
            num_warps=4,
            num_stages=1,
        )
        return
    if key_fp8 or not pow2 or mse_bits not in (3, 4):
        if key_scale is not None:
            _check_key_scale(key_scale, D)
            key = key.float() / key_scale
        triton_turboquant_store(
            key,
            value,
            kv_cache,
            slot_mapping,
            PiT,
            midpoints,
            mse_bits=mse_bits,
            key_packed_size=key_packed_size,
            value_quant_bits=value_quant_bits,
            key_fp8=key_fp8,
        )
        return
    turboquant_store_hadamard(
        key,
        value,
        kv_cache,
        slot_mapping,
        PiT,
        midpoints,
        mse_bits=mse_bits,
        key_packed_size=key_packed_size,
        value_quant_bits=value_quant_bits,
        key_scale=key_scale,
        key_offset=key_offset,
        positions=positions,
        value_rotation=value_rotation,
    )
