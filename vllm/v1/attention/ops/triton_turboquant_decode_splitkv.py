# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant decode attention that reads each packed K/V slot once.

Decode attention is memory-bound: a TurboQuant slot holds one token's packed
key and value for one KV head in 102-196 bytes (head_dim 128) against 512 for
bf16, so a kernel that streams those bytes near memory bandwidth beats
FlashAttention on bf16. 0.20.2's kernel runs one single-warp program per
*query* head with 4 tokens per step: each slot is fetched once per query head
of its group, byte by byte, with almost nothing in flight per SM.

Here one program owns (context split, KV head, row):

- Bytes in flight. The packed words of the next tile, and the block-table
  entries of the tile after it, are loaded before the current tile is
  computed (a register double buffer carried by the loop), so DRAM latency
  overlaps the unpacking and the dots. The split count fills the GPU from the
  batch shape and the device alone; a minimum number of tokens per split is
  applied on the device, so short rows leave splits empty instead of
  producing tiny ones, and a CUDA graph replays for any sequence lengths.
- Alignment. Packed fields are loaded as 16-bit words only when the host
  sees every page, token and head stride and the base address even (all
  field offsets inside a slot are even); a page padded to an odd size gets
  byte loads assembled into the same words, so both paths share the rest.
- Tensor cores at fp32 accuracy. All query heads of the KV group (at most 8)
  are one 16-row dot operand: rows 0-7 hold the TF32 head of the query and
  rows 8-15 its tail, so one TF32 dot yields both partial products and the
  row halves add up to an fp32-accurate score. FP8 keys are exact in TF32
  (one dot); MSE keys score ``norm / |c| * (q . c[idx])`` with the centroid
  row split into a TF32 head and tail (two dots). Values use
  ``(p * scale) . idx + sum(p * zero)``: 3/4-bit indices are exact in TF32,
  and ``p * scale`` is split the same way across the two row halves.
- A small merge kernel combines the splits by log-sum-exp and writes the
  query's dtype; with one split the first kernel writes it directly. Values
  stored rotated (``turboquant.value_rotation``) give an output in the
  rotated basis: the merge rotates it back, and at one split
  ``rotate_output_back`` does, in place.

Each row is independent (its own ``seq_lens`` entry and block-table row), so
one launch serves plain decode rows, speculative verify rows (one row per
query token of a request) and CUDA-graph padding rows (seq_len 0, output 0).

``turboquant_decode`` picks this stage 1 or the Gluon one
(``gluon_turboquant_decode``), whose partial results the same merge reads.
"""

import torch

from vllm.triton_utils import tl, triton
from vllm.triton_utils.compiled_launch import launcher
from vllm.utils.math_utils import cdiv, next_power_of_2
from vllm.v1.attention.ops.turboquant_device import (
    programmatic_launch,
    use_fp8_e4b15,
)
from vllm.v1.attention.ops.turboquant_hadamard import _hadamard_rows, _hadamard_tile
from vllm.v1.attention.ops.turboquant_pair_code import (
    _pair_point_values_held,
    check_pair_codebook,
    is_pair_codebook,
)
from vllm.v1.attention.ops.turboquant_slot_layout import (
    SlotLayout,
    stage1_strides,
    words_aligned,
)

# Launch geometry per head_dim: (tokens per tile, warps, key dimensions per
# dot, register cap or 0). From sm_90 compiles (Triton + ptxas -v, no GPU;
# benchmarks/kernels/compile_report_turboquant_decode.py): the fewest loop
# instructions per token among tiles that keep >= 3 programs resident with
# few spills. Uncapped, stage 1 takes 200-255 registers at head_dim >= 128
# (the double buffer alone ~55); a cap of 168 costs 0-70 bytes of spills.
GEOMETRY: dict[int, tuple[int, int, int, int]] = {
    64: (32, 2, 64, 168),
    128: (32, 4, 64, 168),
    256: (16, 4, 64, 168),
    512: (16, 4, 64, 0),
}
# FP8 keys (k8v4) where the launch sweep on an H100 measured another point
# faster: at head_dim 256, 2 uncapped warps beat the MSE presets' geometry
# by 14-30 % (431 vs 500 µs and 396 vs 567 µs at 16 x 8K in two sessions).
GEOMETRY_FP8_KEYS: dict[int, tuple[int, int, int, int]] = {
    256: (16, 2, 64, 0),
}


def default_geometry(head_dim: int, key_fp8: bool) -> tuple[int, int, int, int]:
    if key_fp8 and head_dim in GEOMETRY_FP8_KEYS:
        return GEOMETRY_FP8_KEYS[head_dim]
    return GEOMETRY[head_dim]


# Splits the merge reads per step (a [MERGE_BLOCK_SPLITS, head_dim] fp32
# tile): the backend's 32 per row in one step.
MERGE_BLOCK_SPLITS = 32
# Query heads of one row that a program of the one-split rotation rotates
# back. The same pass over fp32 input, 512 rows x 32 heads x 128 on an H200:
# 6.6 us at 4 a program (4 warps), 6.9 at 8 or 16, 11-15 us at one; the
# merge at one split took 19 us there.
ROTATE_BACK_HEADS = 4
# Query heads per KV head this kernel serves (the head and tail halves of a
# 16-row dot operand).
MAX_GROUP = 8


def supports(
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    mse_bits: int,
    value_quant_bits: int,
    key_fp8: bool,
) -> bool:
    """Whether this kernel serves the layout; otherwise 0.20.2's kernel runs."""
    if head_dim not in GEOMETRY:
        return False
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads != 0:
        return False
    if num_q_heads // num_kv_heads > MAX_GROUP:
        return False
    if value_quant_bits not in (3, 4):
        return False
    return bool(key_fp8) or mse_bits in (3, 4)


@triton.jit
def _tf32_head(x):
    # The 10 explicit mantissa bits a TF32 multiply keeps; x - head is exact.
    bits = x.to(tl.uint32, bitcast=True) & 0xFFFFE000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_words(KV8, KV16, base, offs, mask, WORD16: tl.constexpr):
    """Little-endian 16-bit words at word offsets ``offs`` from ``base``.

    ``base`` counts words when WORD16, bytes otherwise; returns int32.
    """
    if WORD16:
        w = tl.load(KV16 + base + offs, mask=mask, other=0)
        return w.to(tl.int32) & 0xFFFF
    lo = tl.load(KV8 + base + 2 * offs, mask=mask, other=0)
    hi = tl.load(KV8 + base + 2 * offs + 1, mask=mask, other=0)
    return lo.to(tl.int32) | (hi.to(tl.int32) << 8)


@triton.jit
def _load_field(
    KV8,
    KV16,
    base,  # [BLOCK_N] slot start (words or bytes, see _load_words)
    mask,  # [BLOCK_N]
    OFF_WORDS: tl.constexpr,  # field offset inside the slot, in words
    BITS: tl.constexpr,
    DIM: tl.constexpr,
    WORD16: tl.constexpr,
):
    """Packed words of a BITS-per-element field: three tensors.

    4/8 bits: ``w0`` [BLOCK_N, DIM * BITS / 16], ``w1``/``w2`` unused.
    3 bits: word ``i`` of each 48-bit group of 16 elements in ``w_i``.
    """
    if BITS == 3:
        g = tl.arange(0, DIM // 16) * 3 + OFF_WORDS
        w0 = _load_words(KV8, KV16, base[:, None], g[None, :], mask[:, None], WORD16)
        w1 = _load_words(
            KV8, KV16, base[:, None], g[None, :] + 1, mask[:, None], WORD16
        )
        w2 = _load_words(
            KV8, KV16, base[:, None], g[None, :] + 2, mask[:, None], WORD16
        )
    else:
        offs = tl.arange(0, DIM * BITS // 16) + OFF_WORDS
        w0 = _load_words(KV8, KV16, base[:, None], offs[None, :], mask[:, None], WORD16)
        w1 = w0
        w2 = w0
    return w0, w1, w2


@triton.jit
def _unpack(w0, w1, w2, BITS: tl.constexpr, DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N, DIM] int32 elements packed LSB-first, BITS per element."""
    if BITS == 3:
        word = w0.to(tl.int64) | (w1.to(tl.int64) << 16) | (w2.to(tl.int64) << 32)
        shifts = tl.arange(0, 16) * 3
        e = (word[:, :, None] >> shifts[None, None, :]) & 7
        return tl.reshape(e.to(tl.int32), [BLOCK_N, DIM])
    else:
        PER: tl.constexpr = 16 // BITS
        shifts = tl.arange(0, PER) * BITS
        e = (w0[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        return tl.reshape(e, [BLOCK_N, DIM])


@triton.jit
def _fp16_word(w):
    return w.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _halves(w):
    """[N, W] words -> the first and the second W / 2 columns."""
    N: tl.constexpr = w.shape[0]
    W: tl.constexpr = w.shape[1]
    return tl.split(tl.permute(tl.reshape(w, [N, 2, W // 2]), [0, 2, 1]))


@triton.jit
def _score1(
    q_rows,  # [16, 1] query row pointers (fp32)
    g_mask,
    lower,
    Centroids_ptr,
    w0,
    w1,
    w2,
    raw,  # [16, BLOCK_N] accumulated: rows 0-7 q_head . k, 8-15 q_tail . k
    c_sq,  # [BLOCK_N] accumulated |c[idx]|^2 (MSE keys)
    D_OFF: tl.constexpr,
    CH: tl.constexpr,
    KEY_FP8: tl.constexpr,
    MSE_BITS: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    PAIR_CODE: tl.constexpr,
):
    """Key scores of dimensions D_OFF .. D_OFF + CH, packed in w0-w2."""
    BLOCK_N: tl.constexpr = w0.shape[0]
    offs = D_OFF + tl.arange(0, CH)
    # Loop-invariant: the compiler stages the split query once in shared
    # memory and reloads the dot operand per tile.
    q = tl.load(q_rows + offs[None, :], mask=g_mask[:, None], other=0.0)
    q = q.to(tl.float32)
    q_hi = _tf32_head(q)
    q2 = tl.where(lower[:, None], q_hi, q - q_hi)
    if KEY_FP8:
        kb = _unpack(w0, w1, w2, 8, CH, BLOCK_N).to(tl.uint8)
        if FP8_E4B15:
            kf = kb.to(tl.float8e4b15, bitcast=True).to(tl.float32)
        else:
            kf = kb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        # e4m3 values are exact in TF32: one dot gives head and tail.
        raw = tl.dot(q2, tl.trans(kf), raw, input_precision="tf32")
    else:
        idx = _unpack(w0, w1, w2, MSE_BITS, CH, BLOCK_N)
        if PAIR_CODE:
            c = _pair_point_values_held(idx, Centroids_ptr)
        else:
            # Centroids from a table gathered in-register/shared memory: a
            # global gather per element costs a 64-bit address each.
            NC: tl.constexpr = 1 << MSE_BITS
            table = tl.load(Centroids_ptr + tl.arange(0, NC))
            c = tl.gather(tl.broadcast_to(table[:, None], [NC, CH]), idx, 0)
        c_hi = _tf32_head(c)
        raw = tl.dot(q2, tl.trans(c - c_hi), raw, input_precision="tf32")
        raw = tl.dot(q2, tl.trans(c_hi), raw, input_precision="tf32")
        c_sq += tl.sum(c * c, axis=1)
    return raw, c_sq


@triton.jit
def _score2(
    q_rows,
    g_mask,
    lower,
    C,
    w0,
    w1,
    w2,
    raw,
    c_sq,
    D_OFF: tl.constexpr,
    CH: tl.constexpr,
    KEY_FP8: tl.constexpr,
    MSE_BITS: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    PAIR_CODE: tl.constexpr,
):
    a0, b0 = _halves(w0)
    a1, b1 = _halves(w1)
    a2, b2 = _halves(w2)
    H: tl.constexpr = CH // 2
    raw, c_sq = _score1(
        q_rows,
        g_mask,
        lower,
        C,
        a0,
        a1,
        a2,
        raw,
        c_sq,
        D_OFF,
        H,
        KEY_FP8,
        MSE_BITS,
        FP8_E4B15,
        PAIR_CODE,
    )
    return _score1(
        q_rows,
        g_mask,
        lower,
        C,
        b0,
        b1,
        b2,
        raw,
        c_sq,
        D_OFF + H,
        H,
        KEY_FP8,
        MSE_BITS,
        FP8_E4B15,
        PAIR_CODE,
    )


@triton.jit
def _score4(
    q_rows,
    g_mask,
    lower,
    C,
    w0,
    w1,
    w2,
    raw,
    c_sq,
    D_OFF: tl.constexpr,
    CH: tl.constexpr,
    KEY_FP8: tl.constexpr,
    MSE_BITS: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    PAIR_CODE: tl.constexpr,
):
    a0, b0 = _halves(w0)
    a1, b1 = _halves(w1)
    a2, b2 = _halves(w2)
    H: tl.constexpr = CH // 2
    raw, c_sq = _score2(
        q_rows,
        g_mask,
        lower,
        C,
        a0,
        a1,
        a2,
        raw,
        c_sq,
        D_OFF,
        H,
        KEY_FP8,
        MSE_BITS,
        FP8_E4B15,
        PAIR_CODE,
    )
    return _score2(
        q_rows,
        g_mask,
        lower,
        C,
        b0,
        b1,
        b2,
        raw,
        c_sq,
        D_OFF + H,
        H,
        KEY_FP8,
        MSE_BITS,
        FP8_E4B15,
        PAIR_CODE,
    )


@triton.jit
def _score8(
    q_rows,
    g_mask,
    lower,
    C,
    w0,
    w1,
    w2,
    raw,
    c_sq,
    D_OFF: tl.constexpr,
    CH: tl.constexpr,
    KEY_FP8: tl.constexpr,
    MSE_BITS: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    PAIR_CODE: tl.constexpr,
):
    a0, b0 = _halves(w0)
    a1, b1 = _halves(w1)
    a2, b2 = _halves(w2)
    H: tl.constexpr = CH // 2
    raw, c_sq = _score4(
        q_rows,
        g_mask,
        lower,
        C,
        a0,
        a1,
        a2,
        raw,
        c_sq,
        D_OFF,
        H,
        KEY_FP8,
        MSE_BITS,
        FP8_E4B15,
        PAIR_CODE,
    )
    return _score4(
        q_rows,
        g_mask,
        lower,
        C,
        b0,
        b1,
        b2,
        raw,
        c_sq,
        D_OFF + H,
        H,
        KEY_FP8,
        MSE_BITS,
        FP8_E4B15,
        PAIR_CODE,
    )


@triton.jit
def _fold_partial(out, lse, part, lse_w):
    """Two normalized partial results of the same rows ([rows, D]) and
    their log2-sum-exps ([rows], -inf where empty) weighed into one."""
    top = tl.maximum(lse, lse_w)
    ref = tl.where(top > float("-inf"), top, 0.0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - ref), 0.0)
    w_w = tl.where(lse_w > float("-inf"), tl.exp2(lse_w - ref), 0.0)
    total = tl.where(w + w_w > 0.0, w + w_w, 1.0)
    return (out * w[:, None] + part * w_w[:, None]) / total[:, None]


# The split count and the scratch strides that scale with it are launch
# arguments, not specialized (as the Gluon stage 1's): one compile serves
# every batch size.
@triton.jit(do_not_specialize=["num_splits", "stride_mb", "stride_mh"])
def _tq_decode_split_stage1(
    Q_ptr,  # [B, Hq, D] fp32: rotated query (MSE keys) or the query (FP8)
    KV8_ptr,  # [num_blocks, block_size, Hk, slot] uint8
    KV16_ptr,  # the same memory as int16 words (used when WORD16)
    Block_table_ptr,  # [B, max_blocks] int32
    Seq_lens_ptr,  # [B] int32
    Centroids_ptr,  # [2**MSE_BITS] fp32, or [64, 2] (PAIR_CODE)
    Out_ptr,  # [B, Hq, D] query dtype, written when not SPLIT
    Mid_ptr,  # [>=B, >=Hq, >=num_splits, D + 1] fp32, when SPLIT or WINDOW
    QMu_ptr,  # [B, Hq] fp32: q . key offset (KEY_OFFSET)
    qk_scale,  # softmax scale * log2(e)
    num_splits,
    stride_qb,
    stride_qh,
    stride_cb,  # cache strides in load units (words if WORD16, else bytes)
    stride_cp,
    stride_ch,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_mb,
    stride_mh,
    stride_ms,
    SPLIT: tl.constexpr,  # num_splits > 1: partial results go to Mid
    MIN_TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head (<= 8)
    BLOCK_N: tl.constexpr,
    KEY_FP8: tl.constexpr,
    KEY_CHUNK: tl.constexpr,  # key dimensions per dot (HEAD_DIM / 1, 2, 4, 8)
    MSE_BITS: tl.constexpr,
    MSE_WORDS: tl.constexpr,  # norm offset in words
    KPS_WORDS: tl.constexpr,  # value field offset in words
    VQB: tl.constexpr,
    VAL_WORDS: tl.constexpr,  # value data words (scale follows, then zero)
    NORM_CORRECTION: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    WORD16: tl.constexpr,
    # Keys stored shifted by a per-KV-head offset, those stored unshifted
    # marked by their norm's sign bit (``turboquant.key_offset``).
    KEY_OFFSET: tl.constexpr,
    # One split and a raw window's partial result in split slot 1 of Mid
    # (``triton_turboquant_raw_window``): weighed in here, not by a merge.
    WINDOW: tl.constexpr,
    # MSE keys coded by pairs: Centroids_ptr holds [64, 2] points
    # (``turboquant_pair_code``).
    PAIR_CODE: tl.constexpr,
):
    # Splits last in the grid, as the Gluon stage 1's (see its launch).
    kv_head = tl.program_id(0)
    row = tl.program_id(1)
    split = tl.program_id(2)

    # Tokens per split: a split count fixed per launch, at least MIN_TOKENS
    # per split, whole tiles; splits past the end of a short row stay empty.
    seq_len = tl.load(Seq_lens_ptr + row)
    per = tl.maximum(tl.cdiv(seq_len, num_splits), MIN_TOKENS)
    per = tl.cdiv(per, BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, seq_len)

    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    # 16 dot rows: rows r and r + 8 belong to query head kv_head * GROUP + r
    # (TF32 head and tail); rows r >= GROUP are padding.
    r16 = tl.arange(0, 16)
    r8 = r16 % 8
    lower = r16 < 8
    g_mask = r8 < GROUP
    heads = kv_head * GROUP + r8

    q_rows = Q_ptr + row * stride_qb + heads[:, None] * stride_qh
    if KEY_OFFSET:
        # Shifted keys score q . (k - mu): a marked key's q . k gets the same
        # -q . mu, in log2 units.
        hq = tl.num_programs(0) * GROUP
        qmu = tl.load(QMu_ptr + row * hq + heads, mask=g_mask, other=0.0) * qk_scale

    pair = ((r16[:, None] == r16[None, :]) | (r16[:, None] == (r16[None, :] ^ 8))).to(
        tl.float32
    )
    m_i = tl.full([16], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([16], dtype=tl.float32)
    z_i = tl.zeros([16], dtype=tl.float32)  # sum_n p_n * zero_n
    acc = tl.zeros([16, HEAD_DIM], dtype=tl.float32)

    bt_row = Block_table_ptr + row * stride_btb
    head_off = kv_head.to(tl.int64) * stride_ch

    # Prologue: tile 0's words and tile 1's block-table entries.
    pos = start + offs_n
    mask = pos < end
    blk = tl.load(bt_row + pos // PAGE, mask=mask, other=0).to(tl.int64)
    base = blk * stride_cb + (pos % PAGE).to(tl.int64) * stride_cp + head_off
    if KEY_FP8:
        k0, k1, k2 = _load_field(KV8_ptr, KV16_ptr, base, mask, 0, 8, HEAD_DIM, WORD16)
        kn = tl.zeros([BLOCK_N], dtype=tl.int32)
    else:
        k0, k1, k2 = _load_field(
            KV8_ptr, KV16_ptr, base, mask, 0, MSE_BITS, HEAD_DIM, WORD16
        )
        kn = _load_words(KV8_ptr, KV16_ptr, base, MSE_WORDS, mask, WORD16)
    v0, v1, v2 = _load_field(
        KV8_ptr, KV16_ptr, base, mask, KPS_WORDS, VQB, HEAD_DIM, WORD16
    )
    vs = _load_words(KV8_ptr, KV16_ptr, base, KPS_WORDS + VAL_WORDS, mask, WORD16)
    vz = _load_words(KV8_ptr, KV16_ptr, base, KPS_WORDS + VAL_WORDS + 1, mask, WORD16)
    npos = pos + BLOCK_N
    nblk = tl.load(bt_row + npos // PAGE, mask=npos < end, other=0).to(tl.int64)

    for tile_start in range(start, end, BLOCK_N):
        cur_mask = mask
        ck0, ck1, ck2, ckn = k0, k1, k2, kn
        cv0, cv1, cv2, cvs, cvz = v0, v1, v2, vs, vz

        # ---- issue the next tile's loads before computing this one ----
        pos = tile_start + BLOCK_N + offs_n
        mask = pos < end
        base = nblk * stride_cb + (pos % PAGE).to(tl.int64) * stride_cp + head_off
        if KEY_FP8:
            k0, k1, k2 = _load_field(
                KV8_ptr, KV16_ptr, base, mask, 0, 8, HEAD_DIM, WORD16
            )
        else:
            k0, k1, k2 = _load_field(
                KV8_ptr, KV16_ptr, base, mask, 0, MSE_BITS, HEAD_DIM, WORD16
            )
            kn = _load_words(KV8_ptr, KV16_ptr, base, MSE_WORDS, mask, WORD16)
        v0, v1, v2 = _load_field(
            KV8_ptr, KV16_ptr, base, mask, KPS_WORDS, VQB, HEAD_DIM, WORD16
        )
        vs = _load_words(KV8_ptr, KV16_ptr, base, KPS_WORDS + VAL_WORDS, mask, WORD16)
        vz = _load_words(
            KV8_ptr, KV16_ptr, base, KPS_WORDS + VAL_WORDS + 1, mask, WORD16
        )
        npos = pos + BLOCK_N
        nblk = tl.load(bt_row + npos // PAGE, mask=npos < end, other=0).to(tl.int64)

        # ---- scores [16, BLOCK_N], log2 units, both row halves equal ----
        # KEY_CHUNK dimensions per dot: a [16, HEAD_DIM] fp32 dot operand
        # costs every warp HEAD_DIM / 2 registers at once.
        raw = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        c_sq = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HEAD_DIM // KEY_CHUNK == 1:
            raw, c_sq = _score1(
                q_rows,
                g_mask,
                lower,
                Centroids_ptr,
                ck0,
                ck1,
                ck2,
                raw,
                c_sq,
                0,
                HEAD_DIM,
                KEY_FP8,
                MSE_BITS,
                FP8_E4B15,
                PAIR_CODE,
            )
        elif HEAD_DIM // KEY_CHUNK == 2:
            raw, c_sq = _score2(
                q_rows,
                g_mask,
                lower,
                Centroids_ptr,
                ck0,
                ck1,
                ck2,
                raw,
                c_sq,
                0,
                HEAD_DIM,
                KEY_FP8,
                MSE_BITS,
                FP8_E4B15,
                PAIR_CODE,
            )
        elif HEAD_DIM // KEY_CHUNK == 4:
            raw, c_sq = _score4(
                q_rows,
                g_mask,
                lower,
                Centroids_ptr,
                ck0,
                ck1,
                ck2,
                raw,
                c_sq,
                0,
                HEAD_DIM,
                KEY_FP8,
                MSE_BITS,
                FP8_E4B15,
                PAIR_CODE,
            )
        else:
            raw, c_sq = _score8(
                q_rows,
                g_mask,
                lower,
                Centroids_ptr,
                ck0,
                ck1,
                ck2,
                raw,
                c_sq,
                0,
                HEAD_DIM,
                KEY_FP8,
                MSE_BITS,
                FP8_E4B15,
                PAIR_CODE,
            )
        if KEY_FP8:
            tok = tl.full([BLOCK_N], 1.0, dtype=tl.float32) * qk_scale
        else:
            tok = _fp16_word(ckn) * qk_scale
            if NORM_CORRECTION:
                tok = tok / tl.sqrt(c_sq + 1e-16)
        if KEY_OFFSET:
            marked = tok < 0.0
            tok = tl.abs(tok)
        # Rows r and r ^ 8 hold q_head . k and q_tail . k: an exact fp32
        # "ieee" dot with the pairing matrix sums them into both rows (a
        # reshape here would pull the accumulator into a replicated layout).
        s = tl.dot(pair, raw, input_precision="ieee")
        s = s * tok[None, :]
        if KEY_OFFSET:
            s = s - tl.where(marked[None, :], qmu[:, None], 0.0)
        s = tl.where(cur_mask[None, :], s, float("-inf"))

        # ---- online softmax ----
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        # ---- values: (p * scale) . idx + sum(p * zero) ----
        v_scale = _fp16_word(cvs)
        v_zero = _fp16_word(cvz)
        vf = _unpack(cv0, cv1, cv2, VQB, HEAD_DIM, BLOCK_N).to(tl.float32)
        ps = p * v_scale[None, :]
        ps_hi = _tf32_head(ps)
        p2 = tl.where(lower[:, None], ps_hi, ps - ps_hi)
        acc = tl.dot(p2, vf, acc * alpha[:, None], input_precision="tf32")
        z_i = z_i * alpha + tl.sum(p * v_zero[None, :], axis=1)
        m_i = m_new

    # Row halves: acc adds up (head + tail); m, l, z are equal in both.
    acc8 = tl.sum(tl.reshape(acc, [2, 8, HEAD_DIM]), axis=0)
    l8 = tl.max(tl.reshape(l_i, [2, 8]), axis=0)
    m8 = tl.max(tl.reshape(m_i, [2, 8]), axis=0)
    z8 = tl.max(tl.reshape(z_i, [2, 8]), axis=0)
    o8 = tl.arange(0, 8)
    h8 = kv_head * GROUP + o8
    m8_mask = o8 < GROUP
    safe_l = tl.where(l8 > 0.0, l8, 1.0)
    out = (acc8 + z8[:, None]) / safe_l[:, None]
    if WINDOW and not SPLIT:
        win = Mid_ptr + row * stride_mb + h8 * stride_mh + num_splits * stride_ms
        part = tl.load(win[:, None] + offs_d[None, :], mask=m8_mask[:, None], other=0)
        lse_w = tl.load(win + HEAD_DIM, mask=m8_mask, other=float("-inf"))
        lse = tl.where(l8 > 0.0, m8 + tl.log2(safe_l), float("-inf"))
        out = _fold_partial(out, lse, part, lse_w)
    if not SPLIT:
        o_ptrs = Out_ptr + row * stride_ob + h8[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out_ptr.dtype.element_ty), mask=m8_mask[:, None])
    else:
        # An empty split stores zeros and lse = -inf; the merge skips it.
        lse = tl.where(l8 > 0.0, m8 + tl.log2(safe_l), float("-inf"))
        mid = Mid_ptr + row * stride_mb + h8 * stride_mh + split * stride_ms
        tl.store(mid[:, None] + offs_d[None, :], out, mask=m8_mask[:, None])
        tl.store(mid + HEAD_DIM, lse, mask=m8_mask)


# One compile for every split count: splits are merged BLOCK_S at a time
# with a running maximum, so the count is a launch argument.
@triton.jit(do_not_specialize=["num_splits", "stride_mb", "stride_mh"])
def _tq_decode_split_merge(
    Mid_ptr,
    Out_ptr,
    Rot_ptr,  # [D, D] fp32 scaled Hadamard matrix, [0, 0] read (ROTATE)
    num_splits,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,  # launched programmatically: stage 1 may still run
    ROTATE: tl.constexpr,  # values stored rotated: rotate the output back
    LOG2_D: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_wait()
    head = tl.program_id(0)
    row = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    base = Mid_ptr + row * stride_mb + head * stride_mh
    m = float("-inf")
    w_sum = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mid = base + offs_s * stride_ms
        lse = tl.load(mid + HEAD_DIM, mask=offs_s < num_splits, other=float("-inf"))
        # An empty split has lse = -inf and weight 0; m stays -inf until a
        # live split arrives, and 0 stands in for it in the exponents.
        live = lse > float("-inf")
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m - ref)
        w = tl.where(live, tl.exp2(lse - ref), 0.0)
        part = tl.load(mid[:, None] + offs_d[None, :], mask=live[:, None], other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * part, axis=0)
        w_sum = w_sum * alpha + tl.sum(w, axis=0)
        m = m_new
    out = acc / tl.where(w_sum > 0.0, w_sum, 1.0)
    if ROTATE:
        # H is symmetric and orthonormal: sum p (H v) = H (sum p v).
        out = _hadamard_rows(out, HEAD_DIM, LOG2_D) * tl.load(Rot_ptr)
    tl.store(
        Out_ptr + row * stride_ob + head * stride_oh + offs_d,
        out.to(Out_ptr.dtype.element_ty),
    )


# A one-split decode of values stored rotated: stage 1 wrote its output in
# the rotated basis, in the output's dtype; rotated back in place, HEADS
# query heads of one row a program.
@triton.jit
def _tq_rotate_output_back(
    Out_ptr,
    Rot_ptr,  # [D, D] fp32 scaled Hadamard matrix, [0, 0] read
    num_heads,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEADS: tl.constexpr,
    LOG2_D: tl.constexpr,
):
    heads = tl.program_id(0) * HEADS + tl.arange(0, HEADS)
    row = tl.program_id(1)
    live = (heads < num_heads)[:, None]
    ptrs = (
        Out_ptr
        + row * stride_ob
        + heads[:, None] * stride_oh
        + tl.arange(0, HEAD_DIM)[None, :]
    )
    x = tl.load(ptrs, mask=live, other=0.0).to(tl.float32)
    x = _hadamard_tile(x, HEADS, HEAD_DIM, LOG2_D) * tl.load(Rot_ptr)
    tl.store(ptrs, x.to(Out_ptr.dtype.element_ty), mask=live)


def rotate_output_back(out: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotate a one-split decode's output ([B, Hq, D], its last dimension
    contiguous) back by ``rotation``, the backend's scaled Hadamard matrix,
    in place: values stored rotated by it were read as they are stored.

    The merge does this for decodes that split; at one split it would read
    back a partial result stage 1 had to write in fp32 first, which made
    512 rows of 640 tokens 1.22-1.24x slower on an H200 (benchmarks/NOTES.md).
    Here stage 1 writes the output as for unrotated values and this pass
    reads and writes it once more (one more rounding to its dtype)."""
    B, Hq, D = out.shape
    if out.stride(-1) != 1:
        raise ValueError(
            f"rotate_output_back needs the output's last dimension contiguous, "
            f"got stride {out.stride(-1)}"
        )
    heads = min(ROTATE_BACK_HEADS, next_power_of_2(Hq))
    launcher(_tq_rotate_output_back)[(cdiv(Hq, heads), B)](
        out,
        rotation,
        Hq,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=D,
        HEADS=heads,
        LOG2_D=D.bit_length() - 1,
        num_warps=4,
    )
    return out


def stage1_constexprs(
    layout: SlotLayout,
    page: int,
    group: int,
    geometry: tuple[int, ...],
    split: bool,
    min_split_tokens: int,
    norm_correction: bool,
    fp8_e4b15: int,
    word16: bool,
    key_offset: bool = False,
    window: bool = False,
    pair_code: bool = False,
) -> dict[str, object]:
    """The compile-time arguments of ``_tq_decode_split_stage1`` for a slot
    layout, a page size, a GQA group and a launch geometry (see
    ``default_geometry``)."""
    D = layout.head_dim
    key_chunk = geometry[2]
    return dict(
        SPLIT=split,
        MIN_TOKENS=min_split_tokens,
        HEAD_DIM=D,
        PAGE=page,
        GROUP=group,
        BLOCK_N=geometry[0],
        KEY_FP8=layout.key_fp8,
        KEY_CHUNK=max(min(D, key_chunk), D // 8),
        MSE_BITS=layout.key_bits,
        MSE_WORDS=layout.key_index_bytes // 2,
        KPS_WORDS=layout.key_bytes // 2,
        VQB=layout.value_bits,
        VAL_WORDS=layout.value_index_bytes // 2,
        NORM_CORRECTION=bool(norm_correction) and not layout.key_fp8,
        FP8_E4B15=fp8_e4b15 if layout.key_fp8 else 0,
        WORD16=word16,
        KEY_OFFSET=key_offset,
        WINDOW=window and not split,
        PAIR_CODE=pair_code,
    )


def stage1(
    q_in: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    centroids: torch.Tensor,
    out: torch.Tensor,
    mid: torch.Tensor,
    qk_scale: float,
    num_splits: int,
    min_split_tokens: int,
    group: int,
    layout: SlotLayout,
    norm_correction: bool,
    geometry: tuple[int, ...] | None = None,
    qmu: torch.Tensor | None = None,
    window: bool = False,
) -> None:
    """Launch stage 1: partial results of ``num_splits`` context splits per
    (row, KV head) into ``mid``, or with one split the output into ``out``.
    ``qmu`` ([B, Hq] fp32, contiguous): ``q . key_offset`` of a layer whose
    keys were stored with an offset (``rotate_query_with_offset``).
    ``window``: ``mid``'s split slot ``num_splits`` holds a raw window's
    partial result; with one split stage 1 weighs it into the output.
    ``centroids``: the key levels, or a pair codebook
    (``turboquant_pair_code``)."""
    B, Hk, D = seq_lens.shape[0], kv_cache.shape[2], layout.head_dim
    pair_code = not layout.key_fp8 and is_pair_codebook(centroids)
    if pair_code:
        check_pair_codebook(centroids, layout.key_bits)
    device = q_in.device
    geometry = tuple(geometry or default_geometry(D, layout.key_fp8))
    num_warps, maxnreg = geometry[1], geometry[3]
    # The register cap is a compile option of the CUDA backend only.
    launch_opts = {"maxnreg": maxnreg} if maxnreg and device.type == "cuda" else {}
    word16 = words_aligned(kv_cache)
    unit = 2 if word16 else 1
    launcher(_tq_decode_split_stage1)[(Hk, B, num_splits)](
        q_in,
        kv_cache,
        kv_cache.view(torch.int16) if word16 else kv_cache,
        block_table,
        seq_lens,
        centroids,
        out,
        mid,
        mid if qmu is None else qmu,
        qk_scale,
        num_splits,
        *stage1_strides(q_in, kv_cache, unit, block_table, out, mid),
        **stage1_constexprs(
            layout,
            kv_cache.shape[1],
            group,
            geometry,
            num_splits > 1,
            min_split_tokens,
            norm_correction,
            use_fp8_e4b15(device) if layout.key_fp8 else 0,
            word16,
            qmu is not None,
            window,
            pair_code,
        ),
        num_warps=num_warps,
        num_stages=1,
        **launch_opts,
    )


def merge(
    mid: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
    rotation: torch.Tensor | None = None,
) -> torch.Tensor:
    """Combine the splits' partial results in ``mid`` into ``out`` (with
    one split stage 1 wrote ``out`` itself, and nothing is merged).
    ``rotation``: the backend's scaled Hadamard matrix, for values stored
    rotated by it (``turboquant.value_rotation``): the merged output is
    rotated back; at one split ``rotate_output_back`` does that."""
    if num_splits > 1:
        B, Hq, D = out.shape[0], out.shape[1], out.shape[2]
        pdl = programmatic_launch(out.device)
        launcher(_tq_decode_split_merge)[(Hq, B)](
            mid,
            out,
            mid if rotation is None else rotation,
            num_splits,
            mid.stride(0),
            mid.stride(1),
            mid.stride(2),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=D,
            BLOCK_S=MERGE_BLOCK_SPLITS,
            PDL=pdl,
            ROTATE=rotation is not None,
            LOG2_D=D.bit_length() - 1,
            num_warps=4 if D <= 256 else 8,
            **({"launch_pdl": True} if pdl else {}),
        )
    return out
