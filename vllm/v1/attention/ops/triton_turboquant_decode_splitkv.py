# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant decode attention that reads each packed K/V slot once.

Decode attention is memory-bound: a TurboQuant slot holds a token's packed key
and value for one KV head in 102-196 bytes (head_dim 128) instead of 512 for
bf16, so a decode kernel that streams those bytes at memory bandwidth beats
FlashAttention on bf16. The 0.20.2 kernel (``_tq_decode_stage1``) runs one
program per *query* head with 4 tokens per step and one warp, so every KV slot
is fetched once per query head of its group, and each dimension is a separate
byte load.

Here one program owns (KV head, context split, row). It loads ``BLOCK_N``
tokens' packed bytes for that KV head once, unpacks indices in registers and
scores all query heads of the group together with tensor-core dots:

- MSE keys: ``q . (norm * c[idx] / |c[idx]|)`` is computed as
  ``norm / |c[idx]| * (q . c[idx])``, so the dot operand is the raw centroid
  and the per-token factors apply to the ``[heads, tokens]`` score tile.
- values: ``sum_n p_n (idx_n * scale_n + zero_n)`` is
  ``(p * scale) . idx + sum_n p_n zero_n``; the 3/4-bit indices are exact in
  any float format, so values are never dequantized element by element.
- fp32 operands are split into a TF32 head and tail and multiplied as three
  (keys) or two (values) TF32 dots, which keeps fp32 accuracy at tensor-core
  speed. FP8 keys are exact in TF32/bf16, so their head alone suffices.

The context is split over ``num_splits`` programs per (row, KV head) when the
batch is too small to fill the GPU; a second small kernel merges the splits by
their log-sum-exp. The split count depends only on the batch shape and the
device, never on sequence lengths, so the launch is the same for every replay
of a CUDA graph, and scratch comes from the caller's ``mid_o_buf`` (sized
from static maxima at layer construction).

Each row is independent (its own ``seq_lens`` entry and block-table row), so
the same launch serves decode, speculative-verify rows (one row per query
token) and short continuation chunks.
"""

import os

import torch

from vllm.triton_utils import tl, triton

# Set HYBRIDKV_TQ_DECODE=legacy to run 0.20.2's kernel instead (A/B runs).
ENABLED = os.environ.get("HYBRIDKV_TQ_DECODE", "").strip().lower() != "legacy"

# Launch geometry per (head_dim, FP8 keys): (tokens per tile, warps, pipeline
# stages). Chosen from sm_90 compiles (ptxas registers and spills, shared
# memory per program; benchmarks/kernels/compile_report_turboquant_decode.py)
# to keep several programs resident per SM without spilling. MSE keys need
# more registers than FP8 keys (fp32 head/tail operands, centroid tiles).
GEOMETRY: dict[tuple[int, bool], tuple[int, int, int]] = {
    (64, True): (32, 2, 1),
    (64, False): (16, 2, 1),
    (128, True): (16, 2, 1),
    (128, False): (16, 2, 1),
    (256, True): (16, 2, 1),
    (256, False): (16, 4, 1),
    (512, True): (16, 4, 1),
    (512, False): (16, 4, 1),
}
# MSE key dimensions unpacked and scored per step (a multiple of 8).
MSE_KEY_CHUNK = 64
# Resident programs per SM the split heuristic aims for.
_PROGRAMS_PER_SM = 4

_LOG2E = 1.4426950408889634

_sm_counts: dict[int, int] = {}
_fp8_e4b15: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index or 0
    if index not in _sm_counts:
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(index)
            _sm_counts[index] = props.multi_processor_count
        else:
            # Triton interpreter (CPU tensors): any fixed figure will do.
            _sm_counts[index] = 8
    return _sm_counts[index]


def _use_fp8_e4b15(device: torch.device) -> int:
    # Ampere/Ada (SM < 8.9) have no e4m3 conversion instructions; the store
    # kernel picks the same format from the same rule.
    index = device.index or 0
    if index not in _fp8_e4b15:
        if device.type == "cuda" and torch.version.cuda is not None:
            _fp8_e4b15[index] = int(torch.cuda.get_device_capability(index) < (8, 9))
        else:
            _fp8_e4b15[index] = 0
    return _fp8_e4b15[index]


def _int16_view(kv_cache: torch.Tensor) -> torch.Tensor | None:
    """The cache as int16 words when every slot field starts at an even byte.

    Slots have even sizes and all field offsets are even, so this holds unless
    a padded page has an odd byte count; then the kernel loads bytes.
    """
    if (
        kv_cache.stride(-1) != 1
        or kv_cache.shape[-1] % 2
        or kv_cache.storage_offset() % 2
        or kv_cache.data_ptr() % 2
        or any(st % 2 for st in kv_cache.stride()[:-1])
    ):
        return None
    return kv_cache.view(torch.int16)


def num_kv_splits(batch: int, num_kv_heads: int, max_splits: int, sms: int) -> int:
    """Context splits per (row, KV head): enough programs to fill the GPU.

    Uses only shapes and the device, so a CUDA graph captured for a batch size
    replays correctly for any sequence lengths.
    """
    programs = batch * num_kv_heads
    want = (_PROGRAMS_PER_SM * sms) // max(programs, 1)
    return max(1, min(max_splits, want))


def supports(
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    mse_bits: int,
    value_quant_bits: int,
    key_fp8: bool,
) -> bool:
    """Whether this kernel handles the layout; otherwise 0.20.2's kernel runs."""
    if (head_dim, bool(key_fp8)) not in GEOMETRY:
        return False
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads != 0:
        return False
    if num_q_heads // num_kv_heads > 64:
        return False
    if value_quant_bits not in (3, 4):
        return False
    return key_fp8 or mse_bits in (3, 4)


@triton.jit
def _tf32_head(x):
    # Keep the 10 explicit mantissa bits TF32 multiplies; x - head is exact.
    bits = x.to(tl.uint32, bitcast=True) & 0xFFFFE000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_fp16(ptr, ptr16, offs, mask, WORD16: tl.constexpr):
    if WORD16:
        w = tl.load(ptr16 + offs // 2, mask=mask, other=0)
        return w.to(tl.float16, bitcast=True).to(tl.float32)
    lo = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + offs + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _unpack_indices(
    ptr,
    ptr16,  # the same bytes as int16 words (used when WORD16)
    base,  # [BLOCK_N] int64 byte offsets of the packed field (even if WORD16)
    n_mask,
    BITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORD16: tl.constexpr,
):
    """[BLOCK_N, HEAD_DIM] int32 indices packed LSB-first, BITS per element."""
    if WORD16:
        # 16 elements per BITS little-endian words; half the load
        # instructions of byte loads.
        grp = tl.arange(0, HEAD_DIM // 16)
        word = tl.zeros([BLOCK_N, HEAD_DIM // 16], dtype=tl.int64)
        for i in tl.static_range(BITS):
            w = tl.load(
                ptr16 + (base // 2)[:, None] + (grp * BITS + i)[None, :],
                mask=n_mask[:, None],
                other=0,
            )
            word = word | ((w.to(tl.int64) & 0xFFFF) << (16 * i))
        shifts = tl.arange(0, 16) * BITS
        idx3 = (word[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        idx = tl.reshape(idx3.to(tl.int32), [BLOCK_N, HEAD_DIM])
    elif BITS == 4:
        offs = tl.arange(0, HEAD_DIM // 2)
        raw = tl.load(
            ptr + base[:, None] + offs[None, :], mask=n_mask[:, None], other=0
        )
        raw = raw.to(tl.int32)
        idx = tl.interleave(raw & 0xF, raw >> 4)
    else:
        # 8 elements per BITS bytes; dimension 8 * g + j sits at bit BITS * j
        # of the little-endian word made of bytes BITS*g .. BITS*g + BITS-1.
        grp = tl.arange(0, HEAD_DIM // 8)
        word = tl.zeros([BLOCK_N, HEAD_DIM // 8], dtype=tl.int32)
        for i in tl.static_range(BITS):
            byte = tl.load(
                ptr + base[:, None] + (grp * BITS + i)[None, :],
                mask=n_mask[:, None],
                other=0,
            )
            word = word | (byte.to(tl.int32) << (8 * i))
        shifts = tl.arange(0, 8) * BITS
        idx3 = (word[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        idx = tl.reshape(idx3, [BLOCK_N, HEAD_DIM])
    return idx


@triton.jit
def _tq_splitkv_stage1(
    Q_ptr,  # [B, Hq, D]: rotated fp32 query (MSE keys) or the query (FP8 keys)
    KV_ptr,  # [num_blocks, block_size, Hk, slot] uint8
    KV16_ptr,  # the cache as int16 words (same memory), when WORD16
    Block_table_ptr,  # [B, max_blocks] int32
    Seq_lens_ptr,  # [B] int32
    Centroids_ptr,  # [2**MSE_BITS] float32
    Out_ptr,  # [B, Hq, D], written when num_splits == 1
    Mid_ptr,  # [>=B, >=Hq, >=num_splits, D + 1] float32, when num_splits > 1
    qk_scale,  # softmax scale * log2(e)
    num_splits,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cp,
    stride_ch,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_mb,
    stride_mh,
    stride_ms,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # query heads per KV head
    G_PAD: tl.constexpr,  # GROUP padded to a dot tile (>= 16)
    BLOCK_N: tl.constexpr,
    KEY_FP8: tl.constexpr,
    Q_LOWP: tl.constexpr,  # FP8 keys with a 16-bit query: one exact dot
    MSE_BITS: tl.constexpr,
    MSE_BYTES: tl.constexpr,
    KPS: tl.constexpr,  # packed key bytes (value field offset)
    VQB: tl.constexpr,
    VAL_DATA_BYTES: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    KEY_CHUNK: tl.constexpr,  # MSE key dimensions unpacked and scored at once
    WORD16: tl.constexpr,  # every field starts at an even address: int16 loads
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)

    seq_len = tl.load(Seq_lens_ptr + row)
    tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(tiles, num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    offs_d = tl.arange(0, HEAD_DIM)
    offs_g = tl.arange(0, G_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g

    q_rows = Q_ptr + row * stride_qb + heads[:, None] * stride_qh
    if KEY_FP8:
        q = tl.load(q_rows + offs_d[None, :], mask=g_mask[:, None], other=0.0)
        if not Q_LOWP:
            q = q.to(tl.float32)
            q_hi = _tf32_head(q)
            q_lo = q - q_hi

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    z_i = tl.zeros([G_PAD], dtype=tl.float32)  # sum_n p_n * zero_n
    acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)

    bt_row = Block_table_ptr + row * stride_btb
    head_off = kv_head.to(tl.int64) * stride_ch

    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        n_mask = pos < end
        blk = tl.load(bt_row + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        base = blk * stride_cb + (pos % PAGE).to(tl.int64) * stride_cp + head_off

        # ---- scores [G_PAD, BLOCK_N], in log2 units ----
        if KEY_FP8:
            if WORD16:
                offs_w = tl.arange(0, HEAD_DIM // 2)
                w = tl.load(
                    KV16_ptr + (base // 2)[:, None] + offs_w[None, :],
                    mask=n_mask[:, None],
                    other=0,
                ).to(tl.int32)
                kraw = tl.interleave(w & 0xFF, (w >> 8) & 0xFF).to(tl.uint8)
            else:
                kraw = tl.load(
                    KV_ptr + base[:, None] + offs_d[None, :],
                    mask=n_mask[:, None],
                    other=0,
                )
            if FP8_E4B15:
                k8 = kraw.to(tl.float8e4b15, bitcast=True)
            else:
                k8 = kraw.to(tl.float8e4nv, bitcast=True)
            if Q_LOWP:
                s = tl.dot(q, tl.trans(k8.to(q.dtype)))
            else:
                # e4m3 values are exact in TF32: only the query needs a tail.
                kt = tl.trans(k8.to(tl.float32))
                s = tl.dot(q_lo, kt, input_precision="tf32")
                s = tl.dot(q_hi, kt, s, input_precision="tf32")
            s = s * qk_scale
        else:
            # KEY_CHUNK dimensions at a time, the query chunk re-read from
            # L1/L2: holding the fp32 query head and tail and whole-width
            # centroid tiles in registers spills at head_dim >= 256.
            s = tl.zeros([G_PAD, BLOCK_N], dtype=tl.float32)
            c_sq = tl.zeros([BLOCK_N], dtype=tl.float32)
            offs_k = tl.arange(0, KEY_CHUNK)
            for ch in tl.static_range(HEAD_DIM // KEY_CHUNK):
                qc = tl.load(
                    q_rows + ch * KEY_CHUNK + offs_k[None, :],
                    mask=g_mask[:, None],
                    other=0.0,
                ).to(tl.float32)
                qc_hi = _tf32_head(qc)
                chunk_base = base + ch * (KEY_CHUNK * MSE_BITS // 8)
                idx = _unpack_indices(
                    KV_ptr,
                    KV16_ptr,
                    chunk_base,
                    n_mask,
                    MSE_BITS,
                    KEY_CHUNK,
                    BLOCK_N,
                    WORD16,
                )
                c = tl.load(Centroids_ptr + idx)
                c_hi = _tf32_head(c)
                c_hi_t = tl.trans(c_hi)
                s = tl.dot(qc - qc_hi, c_hi_t, s, input_precision="tf32")
                s = tl.dot(qc_hi, tl.trans(c - c_hi), s, input_precision="tf32")
                s = tl.dot(qc_hi, c_hi_t, s, input_precision="tf32")
                if NORM_CORRECTION:
                    c_sq += tl.sum(c * c, axis=1)
            tok = _load_fp16(KV_ptr, KV16_ptr, base + MSE_BYTES, n_mask, WORD16)
            tok = tok * qk_scale
            if NORM_CORRECTION:
                tok = tok / tl.sqrt(c_sq + 1e-16)
            s = s * tok[None, :]
        s = tl.where(n_mask[None, :], s, float("-inf"))

        # ---- online softmax ----
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        # ---- values: (p * scale) . idx + sum(p * zero) ----
        vbase = base + KPS
        sbase = vbase + VAL_DATA_BYTES
        v_scale = _load_fp16(KV_ptr, KV16_ptr, sbase, n_mask, WORD16)
        v_zero = _load_fp16(KV_ptr, KV16_ptr, sbase + 2, n_mask, WORD16)
        vi = _unpack_indices(
            KV_ptr, KV16_ptr, vbase, n_mask, VQB, HEAD_DIM, BLOCK_N, WORD16
        )
        vf = vi.to(tl.float32)
        ps = p * v_scale[None, :]
        ps_hi = _tf32_head(ps)
        acc = acc * alpha[:, None]
        acc = tl.dot(ps - ps_hi, vf, acc, input_precision="tf32")
        acc = tl.dot(ps_hi, vf, acc, input_precision="tf32")
        z_i = z_i * alpha + tl.sum(p * v_zero[None, :], axis=1)
        m_i = m_new

    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    out = (acc + z_i[:, None]) / safe_l[:, None]
    if num_splits == 1:
        o_ptrs = (
            Out_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        )
        tl.store(o_ptrs, out.to(Out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # An empty split stores lse = -inf; the merge gives it zero weight.
        lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
        mid = Mid_ptr + row * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(mid[:, None] + offs_d[None, :], out, mask=g_mask[:, None])
        tl.store(mid + HEAD_DIM, lse, mask=g_mask)


@triton.jit
def _tq_splitkv_stage2(
    Mid_ptr,
    Out_ptr,
    num_splits,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
):
    head = tl.program_id(0)
    row = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    mid = Mid_ptr + row * stride_mb + head * stride_mh
    m = float("-inf")
    w_sum = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for split in range(0, num_splits):
        lse = tl.load(mid + split * stride_ms + HEAD_DIM)
        if lse > float("-inf"):
            part = tl.load(mid + split * stride_ms + offs_d)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            acc = acc * alpha + w * part
            w_sum = w_sum * alpha + w
            m = m_new
    out = acc / tl.where(w_sum > 0.0, w_sum, 1.0)
    tl.store(
        Out_ptr + row * stride_ob + head * stride_oh + offs_d,
        out.to(Out_ptr.dtype.element_ty),
    )


def decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, Hk, slot] uint8
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    PiT: torch.Tensor | None,  # [D, D] float32; None for FP8 keys
    centroids: torch.Tensor,  # [2**mse_bits] float32
    scale: float,
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    key_fp8: bool = False,
    norm_correction: bool = False,
    mid_o_buf: torch.Tensor | None = None,
    output_buf: torch.Tensor | None = None,
    max_num_kv_splits: int = 32,
    num_splits: int | None = None,
    geometry: tuple[int, int, int] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Decode attention over a packed TurboQuant cache: [B, Hq, D].

    The output has the query's dtype unless ``out_dtype`` says otherwise.
    ``mid_o_buf`` ([>=B, >=Hq, S, D+1] fp32) bounds the split count by S and
    avoids an allocation; ``output_buf`` is used when it has the output dtype.
    ``num_splits``/``geometry`` override the heuristics (tests, benchmarks).
    """
    B, Hq, D = query.shape
    Hk = kv_cache.shape[2]
    group = Hq // Hk
    device = query.device
    if kv_cache.dtype != torch.uint8:
        raise TypeError(
            f"TurboQuant decode expects the packed uint8 cache, got {kv_cache.dtype}; "
            "this layer's cache was not allocated for a TurboQuant dtype"
        )

    if key_fp8:
        q_in = query if query.stride(-1) == 1 else query.contiguous()
        q_lowp = q_in.dtype in (torch.float16, torch.bfloat16)
    else:
        q_in = query.float() @ PiT
        q_lowp = False

    out_dtype = out_dtype or query.dtype
    if (
        output_buf is not None
        and output_buf.dtype == out_dtype
        and output_buf.shape[0] >= B
    ):
        out = output_buf[:B, :Hq, :D]
    else:
        out = torch.empty(B, Hq, D, dtype=out_dtype, device=device)

    if num_splits is None:
        cap = max_num_kv_splits
        if mid_o_buf is not None and mid_o_buf.shape[0] >= B:
            cap = min(cap, mid_o_buf.shape[2])
        num_splits = num_kv_splits(B, Hk, cap, _num_sms(device))

    if num_splits > 1:
        if (
            mid_o_buf is not None
            and mid_o_buf.shape[0] >= B
            and mid_o_buf.shape[1] >= Hq
            and mid_o_buf.shape[2] >= num_splits
            and mid_o_buf.shape[3] >= D + 1
        ):
            mid = mid_o_buf
        else:
            mid = torch.empty(
                B, Hq, num_splits, D + 1, dtype=torch.float32, device=device
            )
    else:
        mid = out  # unused by the kernel when num_splits == 1

    block_n, num_warps, num_stages = geometry or GEOMETRY[(D, bool(key_fp8))]
    kv16 = _int16_view(kv_cache)
    mse_bytes = 0 if key_fp8 else (D * mse_bits + 7) // 8
    grid = (Hk, num_splits, B)
    _tq_splitkv_stage1[grid](
        q_in,
        kv_cache,
        kv_cache if kv16 is None else kv16,
        block_table,
        seq_lens,
        centroids,
        out,
        mid,
        scale * _LOG2E,
        num_splits,
        q_in.stride(0),
        q_in.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        mid.stride(0),
        mid.stride(1),
        mid.stride(2) if num_splits > 1 else 0,
        HEAD_DIM=D,
        PAGE=kv_cache.shape[1],
        GROUP=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        KEY_FP8=key_fp8,
        Q_LOWP=q_lowp,
        MSE_BITS=0 if key_fp8 else mse_bits,
        MSE_BYTES=mse_bytes,
        KPS=key_packed_size,
        VQB=value_quant_bits,
        VAL_DATA_BYTES=(D * value_quant_bits + 7) // 8,
        NORM_CORRECTION=bool(norm_correction) and not key_fp8,
        FP8_E4B15=_use_fp8_e4b15(device) if key_fp8 else 0,
        KEY_CHUNK=min(D, MSE_KEY_CHUNK),
        WORD16=kv16 is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _tq_splitkv_stage2[(Hq, B)](
            mid,
            out,
            num_splits,
            mid.stride(0),
            mid.stride(1),
            mid.stride(2),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=D,
            num_warps=4 if D <= 256 else 8,
        )
    return out


def maybe_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    Pi: torch.Tensor,
    centroids: torch.Tensor,
    scale: float,
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    key_fp8: bool = False,
    norm_correction: bool = False,
    PiT: torch.Tensor | None = None,
    mid_o_buf: torch.Tensor | None = None,
    output_buf: torch.Tensor | None = None,
    max_num_kv_splits: int = 32,
) -> torch.Tensor | None:
    """``triton_turboquant_decode_attention``'s arguments; None = not handled."""
    B, Hq, D = query.shape
    if not ENABLED or not supports(
        D, Hq, kv_cache.shape[2], mse_bits, value_quant_bits, key_fp8
    ):
        return None
    if not key_fp8 and PiT is None:
        PiT = Pi.T.contiguous()
    return decode_attention(
        query,
        kv_cache,
        block_table,
        seq_lens,
        None if key_fp8 else PiT,
        centroids,
        scale,
        mse_bits,
        key_packed_size,
        value_quant_bits,
        key_fp8=key_fp8,
        norm_correction=norm_correction,
        mid_o_buf=mid_o_buf,
        output_buf=output_buf,
        max_num_kv_splits=max_num_kv_splits,
    )
