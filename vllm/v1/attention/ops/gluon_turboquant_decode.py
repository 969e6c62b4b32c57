# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stage 1 of the split-KV TurboQuant decode in Gluon (sm_89 and newer).

The Triton stage 1 (``triton_turboquant_decode_splitkv``) is bound by
shared-memory traffic, not by the bytes it reads: Triton moves every
dequantized fp32 dot operand into the tensor-core layout through shared
memory, every tile. Gluon states layouts explicitly, so here no dequantized
value crosses threads:

- Program = (split, KV head, row) with W = head_dim / 128 warps; warp w owns
  head dimensions [128 w, 128 w + 128): those bytes of every key and value,
  its part of each score (summed across warps) and that slice of the output.
  Tensors carry the warp as dimension 0 (batched ``mma_v2``).
- Packed slots go global (coalesced words) -> shared memory (still packed) ->
  registers, each thread loading exactly the words its mma operand elements
  come from. Within a warp's slice the head dimension is permuted so that a
  thread's elements are contiguous in the slot; the query is loaded with the
  same permutation and the output stored through its inverse.
- fp16 m16n8k16 dots with fp32 accumulation. A-operand rows 0-7 carry
  fp16(x) and rows 8-15 fp16(x - fp16(x)) (22 significant bits together), for
  the query and for ``p * scale``; the two row halves add up at the end.
- FP8 keys convert with ``cvt.rn.f16x2.e4m3x2`` (exact). MSE keys look
  their centroids up in registers: the centroids are symmetric (c[n] =
  -c[15 - n]), so a nibble is a sign and one of 8 magnitudes, and ``prmt``
  picks 4 bytes of 8 at once. ``key_table`` holds the magnitudes' fp16 heads
  and tails as byte planes and their squares in 22-bit fixed point (norm
  correction, summed exactly by ``dp4a``). A 256-entry table in global
  memory, gathered per key byte, kept L1 at ~80 % of its peak.
  Centroids that are fp16 values (a TurboQuant layer's are: see
  ``fp16_centroids``) have zero tails; their lookup and dot are skipped.
  3-bit MSE keys (``turboquant_k3v4_nc``) are spread to those 4-bit words
  as they go to shared memory: code n becomes nibble n + 4, so their 8
  symmetric centroids are magnitudes 0-3 of the same lookup.
  Keys coded by pairs of coordinates (``turboquant_pair_code``) have no
  such symmetry: a pair's 6-bit index gathers its point, one f16x2 word,
  from a 64-word table in global memory (L1).
  4-bit values are ``(n | 0x6400) - 1024`` in f16x2 (exact).
- The score tile's accumulator layout is the fp16 A-operand layout, so ``p``
  stays in registers between the two dots. The online softmax moves a row's
  running max only where its scores outgrow it by more than 2**8, so most
  tiles skip rescaling the output sums.

It writes the same partial results as the Triton stage 1 (``Out`` with one
split, else ``Mid`` and the log-sum-exp), so the same merge kernel follows.

``turboquant_decode`` takes it wherever it serves (``VLLM_TURBOQUANT_DECODE=triton``
keeps the Triton stage 1). On an H100 its stage 1 ran in half the Triton
stage 1's time at 16 x 8K (benchmarks/NOTES.md).
"""

import functools
import math
import weakref
from collections.abc import Mapping
from types import MappingProxyType

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from vllm.logger import init_logger
from vllm.triton_utils.compiled_launch import ByIdentity, launcher
from vllm.v1.attention.ops.turboquant_device import programmatic_launch
from vllm.v1.attention.ops.turboquant_pair_code import PAIR_POINTS, is_pair_codebook
from vllm.v1.attention.ops.turboquant_slot_layout import (
    slot_layout,
    stage1_strides,
    words_aligned,
)

logger = init_logger(__name__)

# Head dimensions per warp.
SLICE = 128
# Tokens per step of the loop; pages must hold a multiple of it.
TILE = 16
# The same, and shared-memory layouts, as the kernel reads them.
_SLICE = gl.constexpr(SLICE)
_SMEM3 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
_SMEM4 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))


def serves(
    head_dim: int,
    group: int,
    page: int,
    key_fp8: bool,
    mse_bits: int,
    value_quant_bits: int,
) -> bool:
    """Whether this stage 1 serves the layout (the device is checked apart)."""
    return (
        head_dim % SLICE == 0
        and head_dim // SLICE in (1, 2, 4)
        and 1 <= group <= 8
        and page % TILE == 0
        and value_quant_bits in (3, 4)
        and (key_fp8 or mse_bits in (3, 4))
    )


# Registers a thread of this stage 1 may use (ptxas's maxnreg; every launch
# and static compile passes it). An SM's 4 schedulers each hold their warps'
# registers in their own 16,384 of its 65,536, allocated 8 a thread at a
# time: 168 keeps 3 warps per scheduler, 12 per SM, and anything from 169 to
# 255 keeps 2, 8 per SM. Uncapped, ptxas chose 166-168 at head_dim 128 but
# 186-224 for the MSE presets at 256 and 512, so splits sized for more than
# 8 warps ran in waves the split count did not model; capped, those spill
# 0-14 bytes and ran 2-10 % faster (H100; benchmarks/NOTES.md).
MAX_REGISTERS = 168
SCHEDULERS_PER_SM = 4
REGISTERS_PER_SCHEDULER = 16384
REGISTER_UNIT = 8


def resident_warps(registers: int = MAX_REGISTERS) -> int:
    """Warps one SM keeps resident at ``registers`` per thread (sm_80 to
    sm_120: 4 schedulers of 16,384 registers each; shared memory does not
    bind this stage 1)."""
    allocated = -(-registers // REGISTER_UNIT) * REGISTER_UNIT
    return SCHEDULERS_PER_SM * (REGISTERS_PER_SCHEDULER // (allocated * 32))


def _log2(x: int) -> int:
    return x.bit_length() - 1


def _warp_bases(warps: int, rank: int) -> list[list[int]]:
    return [[1 << i] + [0] * (rank - 1) for i in range(_log2(warps))]


def launch_config(
    head_dim: int,
    key_fp8: bool,
    word32: bool,
    mse_bits: int = 4,
    value_bits: int = 4,
) -> dict:
    """The layouts and sizes ``_stage1`` takes as constexpr arguments."""
    W = head_dim // SLICE
    mma = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8]
    )
    mse3 = not key_fp8 and mse_bits == 3
    v3 = value_bits == 3
    if (mse3 or v3) and word32:
        raise ValueError(
            "3-bit keys and values take the 16-bit word path: their slots are "
            "2 bytes longer than a multiple of 4, so word32 must be False"
        )
    kw16 = head_dim // 2 if key_fp8 else head_dim // 4  # u16 words of the key
    vw16 = head_dim * value_bits // 16  # u16 words of the values
    unit = 2 if word32 else 1
    lanes_k = min(32, kw16 // unit)
    lanes_v = min(32, head_dim // 4 // unit)  # 4-bit values (3-bit: ld3)
    # Global loads: lanes along the words of a slot.
    ldk = gl.BlockedLayout([1, 1], [32 // lanes_k, lanes_k], [W, 1], [1, 0])
    ldv = gl.BlockedLayout([1, 1], [32 // lanes_v, lanes_v], [W, 1], [1, 0])
    # 3-bit fields, [16 n, 4 W groups, 8]: a thread loads the 6 u16 words (96
    # bits) of the 32 codes it converts to the 4-bit words of those
    # dimensions; words 6 and 7 are masked.
    ld3 = gl.BlockedLayout([1, 1, 8], [8, 4, 1], [1, W, 1], [2, 1, 0])
    if mse3:
        ldk = ld3
    if v3:
        ldv = ld3
    ptw = SLICE // 16 if key_fp8 else SLICE // 32  # key words per thread, token
    cw = 4 if key_fp8 else 1  # of them per score chunk
    qc = 64 if key_fp8 else 32  # dimensions per score chunk
    # [W, 16 n, 4 t, cw] key words of one chunk: thread (t, n % 8).
    kreg = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1 << i] for i in range(_log2(cw))] + [[0, 8, 0, 0]],
        lane_bases=[
            [0, 0, 1, 0],
            [0, 0, 2, 0],
            [0, 1, 0, 0],
            [0, 2, 0, 0],
            [0, 4, 0, 0],
        ],
        warp_bases=_warp_bases(W, 4),
        block_bases=[],
        shape=[W, 16, 4, cw],
    )
    # [W, 16 k, 16 words]: word 2 g + wd of the slice; thread (t, g) holds
    # tokens 2t, 2t + 1, 2t + 8, 2t + 9.
    vreg = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 1, 0], [0, 8, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 2], [0, 0, 4], [0, 0, 8]],
        warp_bases=_warp_bases(W, 3),
        block_bases=[],
        shape=[W, 16, 16],
    )
    # [W, 16, 16] partial sums of the warps' slices (scores, key Gram), read
    # back from shared memory by every warp with the W partials in its own
    # registers: the mma accumulator's layout, the warp axis moved into
    # registers and the warps broadcast. Summed over W it is the score
    # tile's layout, so no further exchange.
    red = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 8, 0], [0, 0, 8]]
        + [[1 << i, 0, 0] for i in range(_log2(W))],
        lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[0, 0, 0]] * _log2(W),
        block_bases=[],
        shape=[W, 16, 16],
    )
    # The query chunk as ldmatrix reads it: rows of QC fp16 (64 or 128 bytes)
    # with 16-byte pieces XOR-swizzled by row, so the 8 rows of one 8 x 8
    # matrix fall in distinct banks. Unswizzled, those rows shared banks
    # (8-way at 128-byte rows): ncu counted ~70 % of the loop's shared
    # wavefronts as bank conflicts, and L1 at 78-82 % of its peak.
    rows_per_phase = max(1, 128 // (qc * 2))
    q_smem = gl.SwizzledSharedLayout(8, rows_per_phase, 8 // rows_per_phase, [2, 1, 0])
    return dict(
        W=W,
        MMA=mma,
        Q_SMEM=q_smem,
        A_OP=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        B_OP=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
        KW16=kw16,
        PTW=ptw,
        CW=cw,
        QC=qc,
        LDK=ldk,
        LDV=ldv,
        KREG=kreg,
        VREG=vreg,
        RED=red,
        WORD32=word32,
        MSE3=mse3,
        V3=v3,
        VW16=vw16,
    )


# Key tables by centroid tensor address: the tensor (weakly), the table, and
# whether it has tails (key_tails). A lookup also checks the tensor is the
# one the table was built from: a freed tensor's address can hold other
# centroids later (another engine in the same process, or another device's
# tensor). Not its version counter: the backend's centroids are constants,
# and inference tensors have none.
_Entry = tuple[weakref.ref, torch.Tensor | None, bool]
_tables: dict[int, _Entry] = {}

# How far (log2) a row's running max may lag its scores: p <= 2**8 (as in
# FlashAttention 4's conditional rescale), fine in fp32, and p * scale
# stays below fp16's 65504 for value scales up to 255 (larger ones rescale
# every tile, as before).
STALE_LOG2 = 8
_STALE_LOG2 = gl.constexpr(float(STALE_LOG2))
_STALE_SCALE_MAX = gl.constexpr(65504.0 / 2**STALE_LOG2)

# Words of key_table(); the kernel loads them once per program.
TABLE_WORDS = 16
_TABLE_WORDS = gl.constexpr(TABLE_WORDS)
# Fixed-point bits of the squared magnitudes: a warp sums 128 of them per
# token, 4 warps 512, below 2**31.
SQUARE_BITS = 22


def _byte_planes(values: torch.Tensor) -> list[torch.Tensor]:
    """8 values of up to 32 bits -> per byte, two words holding that byte of
    values 0-3 and 4-7 (``prmt``'s two sources)."""
    v = values.to(torch.int64) & 0xFFFFFFFF
    planes = []
    for byte in range(4):
        b = (v >> (8 * byte)) & 0xFF
        for half in (b[:4], b[4:]):
            planes.append((half << torch.arange(0, 32, 8)).sum())
    return planes


def _f32_bits(x: float) -> torch.Tensor:
    return torch.tensor([x], dtype=torch.float32).view(torch.int32).long()[0]


def _pair_table(points: torch.Tensor) -> torch.Tensor | None:
    """[PAIR_POINTS] int32: point n's two coordinates as fp16 in the low and high half
    of word n (the f16x2 register of the key operand that holds dimensions
    2i and 2i + 1), unscaled: the pair code's stage 1 takes its norms from
    the key Gram matrix, where a scale cancels, or none. None where a
    coordinate is not an fp16 value (the scores would be rounded)."""
    half = points.half()
    if points.shape != (PAIR_POINTS, 2) or not torch.equal(
        half.float(), points.float()
    ):
        return None
    bits = half.view(torch.int16).long() & 0xFFFF
    words = bits[:, 0] | (bits[:, 1] << 16)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def key_table(centroids: torch.Tensor) -> torch.Tensor | None:
    """For a pair codebook ([64, 2] points, ``turboquant_pair_code``), the
    points as 64 f16x2 words (``_pair_table``). Otherwise:
    [32, TABLE_WORDS] int32, one row per lane, for 16 symmetric centroids
    (c[n] = -c[15 - n]), by magnitude j (nibble 8 + j, its negation 7 - j):

    - words 0-3: the low and high byte planes of fp16 heads of the
      magnitudes, scaled by a power of two to [0.5, 1),
    - words 4-7: the same of the fp16 tails (scaled magnitude - head),
    - words 8-13: the three low byte planes of round(c**2 * 2**e) for the
      largest e keeping them below 2**SQUARE_BITS,
    - word 14: 2**-e as fp32 bits; word 15: the factor (a power of two)
      the heads and tails are scaled by, inverted, as fp32 bits.

    The tails are all zero where the centroids are fp16 values (see
    ``key_tails``).

    None where the centroids are neither 16 and symmetric nor pair points
    that are fp16 values (the caller then runs
    the Triton stage 1), and while a CUDA graph is captured if not built
    before: building allocates and copies, which a capture must not record.
    """
    key = centroids.data_ptr()
    hit = _tables.get(key)
    if hit is None or hit[0]() is not centroids:
        if centroids.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        c = centroids.float().cpu()
        table = None
        tails = True
        n = c.shape[0] if c.dim() == 1 else 0
        if is_pair_codebook(c):
            table = _pair_table(c)
            tails = False
            if table is not None:
                table = table.to(centroids.device)
        elif n in (8, 16) and torch.equal(c, -c.flip(0)):
            # Heads and tails of the centroids scaled to a largest magnitude
            # in [0.5, 1): unscaled, head_dim 512's smallest tails were fp16
            # subnormals, and head + tail held 21 bits instead of 22.
            top = c.abs().max().item()
            shift = 0 if top == 0 else -math.frexp(top)[1]
            # 3-bit keys use magnitudes 0-3 only (_MSE3_SPREAD); 4-7 are 0.
            mags = torch.cat([c[n // 2 :].double(), torch.zeros(8 - n // 2)])
            m = mags * 2.0**shift
            head = m.half()
            tail = (m - head.double()).half()
            tails = bool(tail.any())
            square = mags**2
            top_sq = square.max().item()
            e = 0 if top_sq == 0 else math.frexp((2**SQUARE_BITS - 1) / top_sq)[1] - 1
            fixed = torch.round(square * 2.0**e)
            words = (
                _byte_planes(head.view(torch.int16).int() & 0xFFFF)[:4]
                + _byte_planes(tail.view(torch.int16).int() & 0xFFFF)[:4]
                + _byte_planes(fixed.long())[:6]
                + [_f32_bits(2.0**-e), _f32_bits(2.0**-shift)]
            )
            v = torch.stack(words).to(torch.int64)
            v = torch.where(v >= 2**31, v - 2**32, v)  # the same 32 bits
            # One copy per lane (see _stage1).
            table = v.to(torch.int32).repeat(32, 1).to(centroids.device)
        if table is None:
            logger.info_once(
                "TurboQuant decode: the Gluon stage 1 reads 8 or 16 centroids "
                "symmetric about 0 (c[n] == -c[N - 1 - n]), or 64 pair points "
                "that are fp16 values; these are neither (shape %s), so the "
                "Triton stage 1 serves them (same results, slower).",
                tuple(c.shape),
            )
        hit = _tables[key] = (weakref.ref(centroids), table, tails)
    return hit[1]


def key_tails(centroids: torch.Tensor) -> bool:
    """Whether ``key_table(centroids)`` (built first) has nonzero tails. Where
    every centroid is an fp16 value the heads are exact, and the stage 1
    skips the tails' lookup and dot: 123 of 1,121 instructions a tile for
    turboquant_4bit_nc (head_dim 128)."""
    hit = _tables.get(centroids.data_ptr())
    return True if hit is None or hit[0]() is not centroids else hit[2]


@gluon.jit
def _e4m3x4_to_f16(w):
    return gl.inline_asm_elementwise(
        """
        {
        .reg .b16 lo, hi;
        .reg .b32 a, b;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 a, lo;
        cvt.rn.f16x2.e4m3x2 b, hi;
        mov.b32 {$0, $1}, a;
        mov.b32 {$2, $3}, b;
        }
        """,
        "=h,=h,=h,=h,r",
        [w],
        dtype=(gl.float16,) * 4,
        is_pure=True,
        pack=1,
    )


# Two tokens' value words (a, b) -> per nibble i the f16x2 (a_i, b_i): the
# pairing the value dot's B operand holds (two tokens of one dimension). A
# ``prmt`` puts two bytes of each token side by side; (n | 0x6400) is 1024 +
# n in fp16 for the low nibble of a byte, and 1024 + 16 n for the high one,
# which one exact ``fma`` (x / 16 - 64) brings to n. Converted a token at a
# time (a word's nibbles side by side), the dot's operand took a ``prmt``
# per register to pair them again: 34 of a tile's 516-821 instructions.
def _pairs_asm() -> str:
    """The PTX of ``_u4x8_pairs_to_f16``: per byte pair (x0: bytes 0-1 of
    both tokens, x1: bytes 2-3; s0, s1 the same shifted by a byte) its low
    nibbles, then its high ones."""
    lines = [
        ".reg .b32 x0, x1, s0, s1, t, m, k, c;",
        "mov.b32 m, 0x64006400;",  # 1024 in both halves
        "mov.b32 k, 0x2C002C00;",  # 1 / 16
        "mov.b32 c, 0xD400D400;",  # -64
        "prmt.b32 x0, $16, $17, 0x5410;",
        "prmt.b32 x1, $16, $17, 0x7632;",
        "shr.b32 s0, x0, 8;",
        "shr.b32 s1, x1, 8;",
    ]
    low = ("0x000F000F", "sub.f16x2 t, t, m;")
    high = ("0x00F000F0", "fma.rn.f16x2 t, t, k, c;")
    for i, x in enumerate(("x0", "s0", "x1", "s1")):
        for j, (mask, to_n) in enumerate((low, high)):
            o = 4 * i + 2 * j
            lines += [
                f"lop3.b32 t, {x}, {mask}, m, 0xEA;",
                to_n,
                f"mov.b32 {{${o}, ${o + 1}}}, t;",
            ]
    return "{\n" + "\n".join(lines) + "\n}"


_PAIRS_ASM = gl.constexpr(_pairs_asm())


@gluon.jit
def _u4x8_pairs_to_f16(a, b):
    return gl.inline_asm_elementwise(
        _PAIRS_ASM,
        "=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        [a, b],
        dtype=(gl.float16,) * 16,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _value_operand(vr, W: gl.constexpr):
    """[W, 16 k, 16 words] value words (``VREG``) -> [W, 16 k, _SLICE] fp16,
    slice-local logical n = g + 8 (8 wd + nibble) for word 2 g + wd."""
    v = gl.permute(gl.reshape(vr, [W, 8, 2, 8, 2]), [0, 1, 3, 4, 2])  # w kh g wd kl
    a, b = gl.split(v)  # the tokens 2 kh and 2 kh + 1 of one thread
    n = _u4x8_pairs_to_f16(a, b)
    pairs = (
        gl.join(n[0], n[1]), gl.join(n[2], n[3]),
        gl.join(n[4], n[5]), gl.join(n[6], n[7]),
        gl.join(n[8], n[9]), gl.join(n[10], n[11]),
        gl.join(n[12], n[13]), gl.join(n[14], n[15]),
    )  # fmt: skip
    vv = _join_nibbles(pairs)  # w kh g wd kl b0 b1 b2
    vv = gl.permute(vv, [0, 1, 4, 3, 7, 6, 5, 2])  # w kh kl wd b2 b1 b0 g
    return gl.reshape(vv, [W, 16, _SLICE])


@gluon.jit
def _lane_id():
    return gl.inline_asm_elementwise(
        "mov.u32 $0, %laneid;", "=r", [], dtype=gl.int32, is_pure=True, pack=1
    )


# MSE key words: 8 nibbles n, nibble i in bits 4i .. 4i+3. A nibble with
# bit 3 set is magnitude j = n & 7, else the negation of j = 7 - n.
@gluon.jit
def _mse_select(w):
    """(the 8 magnitudes j as nibbles, and per nibble of bits 0-15 / 16-31 a
    byte of 0xFF where the centroid is positive)."""
    return gl.inline_asm_elementwise(
        """
        {
        .reg .b32 b, w4;
        shr.b32 b, $3, 3;
        and.b32 b, b, 0x11111111;
        mul.lo.u32 b, b, 7;
        lop3.b32 $0, $3, b, 0x77777777, 0x82;
        shl.b32 w4, $3, 4;
        prmt.b32 $1, $3, w4, 0x9D8C;
        prmt.b32 $2, $3, w4, 0xBFAE;
        }
        """,
        "=r,=r,=r,r",
        [w],
        dtype=(gl.int32,) * 3,
        is_pure=True,
        pack=1,
    )


# The 3-bit codes of 32 dimensions (96 bits in 3 words, code i at bit 3 i)
# -> four words of 8 nibbles. A word's 24-bit field spreads in three
# halvings (12 -> 16, 6 -> 8, 3 -> 4 bits), then $BIAS is added to every
# nibble: 4 for keys, so that codes 4-7 get bit 3 (the positive half of 8
# symmetric centroids, c[n] = -c[7 - n]) and magnitude n - 4, codes 0-3 the
# negation of magnitude 3 - n, as _mse_select reads 4-bit nibbles (no nibble
# carries into the next: 11 at most); 0 for values, read as 4-bit values.
_SPREAD = """
    shl.b32 s, f, 4;
    and.b32 t, f, 0x00000FFF;
    lop3.b32 t, s, 0x0FFF0000, t, 0xEA;
    shl.b32 s, t, 2;
    and.b32 u, t, 0x003F003F;
    lop3.b32 t, s, 0x3F003F00, u, 0xEA;
    shl.b32 s, t, 1;
    and.b32 u, t, 0x07070707;
    lop3.b32 t, s, 0x70707070, u, 0xEA;
    add.u32 $OUT, t, $BIAS;
"""
# Where each output word's 24-bit field starts: codes 0-7, 8-15 (across
# words 0 and 1), 16-23 (across 1 and 2), 24-31.
_FIELDS = [
    "mov.b32 f, $4;",
    "shf.r.clamp.b32 f, $4, $5, 24;",
    "shf.r.clamp.b32 f, $5, $6, 16;",
    "shr.b32 f, $6, 8;",
]


def _spread3_asm(bias: int) -> str:
    body = "".join(
        f + _SPREAD.replace("$OUT", f"${i}").replace("$BIAS", hex(bias))
        for i, f in enumerate(_FIELDS)
    )
    return "{ .reg .b32 f, s, t, u;\n" + body + "}"


_MSE3_SPREAD = gl.constexpr(_spread3_asm(0x44444444))
_U3_SPREAD = gl.constexpr(_spread3_asm(0))


@gluon.jit
def _spread3(w0, w1, w2, ASM: gl.constexpr):
    """``_MSE3_SPREAD`` (keys) or ``_U3_SPREAD`` (values) on three words."""
    return gl.inline_asm_elementwise(
        ASM,
        "=r,=r,=r,=r,r,r,r",
        [w0, w1, w2],
        dtype=(gl.int32,) * 4,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _nibbles3(kw, G: gl.constexpr, KEYS: gl.constexpr):
    """[16 n, G, 8] u16 words (a group's 6, then 2 zeros) -> [16 n, G, 4]
    4-bit key or value words of the same dimensions (``_spread3``)."""
    lo, hi = gl.split(gl.reshape(kw, [16, G, 4, 2]))
    w = (hi.to(gl.int32) << 16) | (lo.to(gl.int32) & 0xFFFF)
    even, odd = gl.split(gl.reshape(w, [16, G, 2, 2]))
    w0, w2 = gl.split(even)
    w1, w3 = gl.split(odd)
    if KEYS:
        n0, n1, n2, n3 = _spread3(w0, w1, w2, _MSE3_SPREAD)
    else:
        n0, n1, n2, n3 = _spread3(w0, w1, w2, _U3_SPREAD)
    return gl.reshape(gl.join(gl.join(n0, n2), gl.join(n1, n3)), [16, G, 4])


@gluon.jit
def _mse_centroids(sel, pos0, pos1, lo0, lo1, hi0, hi1):
    """The 8 nibbles' fp16 heads, or tails, from that field's two byte
    planes: ``prmt`` picks a plane's bytes by magnitude, the sign bit is set
    in the high byte of negative ones, and two more ``prmt`` interleave the
    low and high bytes into f16x2 pairs (nibbles 2m, 2m + 1)."""
    return gl.inline_asm_elementwise(
        """
        {
        .reg .b32 s, lo, hi, a, b;
        prmt.b32 lo, $11, $12, $8;
        prmt.b32 hi, $13, $14, $8;
        lop3.b32 hi, hi, $9, 0x80808080, 0xD2;
        prmt.b32 a, lo, hi, 0x5140;
        prmt.b32 b, lo, hi, 0x7362;
        mov.b32 {$0, $1}, a;
        mov.b32 {$2, $3}, b;
        shr.b32 s, $8, 16;
        prmt.b32 lo, $11, $12, s;
        prmt.b32 hi, $13, $14, s;
        lop3.b32 hi, hi, $10, 0x80808080, 0xD2;
        prmt.b32 a, lo, hi, 0x5140;
        prmt.b32 b, lo, hi, 0x7362;
        mov.b32 {$4, $5}, a;
        mov.b32 {$6, $7}, b;
        }
        """,
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,r",
        [sel, pos0, pos1, lo0, lo1, hi0, hi1],
        dtype=(gl.float16,) * 8,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _f16x2_halves(w):
    return gl.inline_asm_elementwise(
        "mov.b32 {$0, $1}, $2;",
        "=h,=h,r",
        [w],
        dtype=(gl.float16, gl.float16),
        is_pure=True,
        pack=1,
    )


# Pair-coded key words (``_U3_SPREAD``'s 3-bit fields as nibbles): byte m
# holds the fields of dimensions 2m (bits 0-2, index % 8) and 2m + 1 (bits
# 4-6, index // 8) of the word's 8.
@gluon.jit
def _pair_points(w, Table_ptr):
    """The word's 8 key coordinates, as ``_mse_centroids`` gives them: each
    byte's 6-bit point index gathers that point's f16x2 word (``_pair_table``),
    whose halves are the byte's two dimensions."""
    idx = (w & 0x07070707) | ((w >> 1) & 0x38383838)
    x0, y0 = _f16x2_halves(gl.load(Table_ptr + (idx & 0xFF)))
    x1, y1 = _f16x2_halves(gl.load(Table_ptr + ((idx >> 8) & 0xFF)))
    x2, y2 = _f16x2_halves(gl.load(Table_ptr + ((idx >> 16) & 0xFF)))
    x3, y3 = _f16x2_halves(gl.load(Table_ptr + ((idx >> 24) & 0xFF)))
    return x0, y0, x1, y1, x2, y2, x3, y3


@gluon.jit
def _join_nibbles(n):
    """A word's 8 per-nibble tensors as one, the nibble index i = i0 + 2 i1 +
    4 i2 in three new trailing dims (i0, i1, i2)."""
    return gl.join(
        gl.join(gl.join(n[0], n[1]), gl.join(n[2], n[3])),
        gl.join(gl.join(n[4], n[5]), gl.join(n[6], n[7])),
    )


@gluon.jit
def _key_operand(n, W: gl.constexpr, QC: gl.constexpr):
    """A key chunk's 8 nibble values per word as [W, QC, 16 tokens]: joined
    they are dims w n t cw i0 i1 i2 (nibble i = r0 + 2 r1 + 4 jb), and
    logical k = r0 + 2 t + 8 r1 + 16 jb."""
    k = _join_nibbles(n)
    return gl.reshape(gl.permute(k, [0, 3, 6, 5, 2, 4, 1]), [W, QC, 16])


@gluon.jit
def _mse_squares(sel, p00, p01, p10, p11, p20, p21):
    """The sum of the 8 nibbles' squared centroids in fixed point: each byte
    plane's 8 bytes summed by ``dp4a``, the planes weighted 1, 2**8, 2**16."""
    return gl.inline_asm_elementwise(
        """
        {
        .reg .b32 s, x, z, one, a0, a1, a2;
        mov.b32 z, 0;
        mov.b32 one, 0x01010101;
        shr.b32 s, $1, 16;
        prmt.b32 x, $2, $3, $1;
        dp4a.u32.u32 a0, x, one, z;
        prmt.b32 x, $2, $3, s;
        dp4a.u32.u32 a0, x, one, a0;
        prmt.b32 x, $4, $5, $1;
        dp4a.u32.u32 a1, x, one, z;
        prmt.b32 x, $4, $5, s;
        dp4a.u32.u32 a1, x, one, a1;
        prmt.b32 x, $6, $7, $1;
        dp4a.u32.u32 a2, x, one, z;
        prmt.b32 x, $6, $7, s;
        dp4a.u32.u32 a2, x, one, a2;
        mad.lo.u32 a0, a1, 256, a0;
        mad.lo.u32 $0, a2, 65536, a0;
        }
        """,
        "=r,r,r,r,r,r,r,r",
        [sel, p00, p01, p10, p11, p20, p21],
        dtype=gl.int32,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _f16_parts(x):
    """fp32 ``x`` as an fp16 head and the fp16 remainder (22 significant bits
    together): a dot operand's rows 0-7 and 8-15."""
    hi = x.to(gl.float16)
    return hi, (x - hi.to(gl.float32)).to(gl.float16)


@gluon.jit
def _split16(x, rows_lo):
    hi, lo = _f16_parts(x)
    return gl.where(rows_lo, hi, lo)


@gluon.jit
def _f16_of_u16(x):
    return x.to(gl.uint16, bitcast=True).to(gl.float16, bitcast=True).to(gl.float32)


@gluon.jit
def _field_offsets(
    LD: gl.constexpr, WORDS: gl.constexpr, W: gl.constexpr, BITS3: gl.constexpr,
    stride_cp, base,
):  # fmt: skip
    """Load offsets and word mask of a slot field (keys or values) that starts
    ``base`` load units into the slot: [16, WORDS] words for 4- and 8-bit
    fields; for 3-bit ones [16, 4 W groups, 8], a group's 6 u16 words (32
    codes) and 2 masked ones. The mask is only read for 3 bits."""
    if BITS3:
        n = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, LD)))
        g = gl.arange(0, 4 * W, layout=gl.SliceLayout(0, gl.SliceLayout(2, LD)))
        i = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LD)))
        off = n[:, None, None] * stride_cp + base + 6 * g[None, :, None]
        off = off + i[None, None, :]
        inside = (i < 6)[None, None, :]
    else:
        n = gl.arange(0, 16, layout=gl.SliceLayout(1, LD))
        w = gl.arange(0, WORDS, layout=gl.SliceLayout(0, LD))
        off = n[:, None] * stride_cp + base + w[None, :]
        inside = n
    return off, inside


# A tile's key and value words are loaded whether or not its tokens are
# live: the page holds all 16 (PAGE % 16 == 0), a tile at or past the end
# reads page 0, and a dead token's score is -inf and its value scale and
# zero 0 (those stay masked), so whatever its words hold adds 0. A mask per
# token cost an add and a compare per word load (32 a tile).
@gluon.jit
def _load_field(tb, off, inside, BITS3: gl.constexpr):
    """A tile's words of one field (``_field_offsets``); for 3 bits the
    masked words read 0."""
    if BITS3:
        return gl.load(tb + off, mask=inside, other=0)
    return gl.load(tb + off)


@gluon.jit
def _page(bt_row, tile, end, PAGE: gl.constexpr):
    """The block holding a tile (PAGE % 16 == 0 and tiles start at multiples
    of 16: one page a tile); block 0 for a tile at or past ``end``."""
    return gl.load(bt_row + tile // PAGE, mask=tile < end, other=0).to(gl.int64)


@gluon.jit
def _tile_words(
    KV_ptr, blk, tile, end, stride_cb, stride_cp, head_off, par,
    offk, kin, offv, vin, ns,
    PAGE: gl.constexpr, KEY_FP8: gl.constexpr, NORM16: gl.constexpr,
    VOFF16: gl.constexpr, VW16: gl.constexpr, WORD32: gl.constexpr,
    MSE3: gl.constexpr, V3: gl.constexpr, SHIFTED: gl.constexpr,
):  # fmt: skip
    """One tile's packed words from its block ``blk`` (``_page``): keys,
    values, and per token the value scale and zero (both in ``w0`` when
    WORD32) and the key norm (``w2``); SHIFTED: the three words holding
    the norm, the scale and the zero (read in ``_stage1``). A tile at or
    past ``end`` loads nothing."""
    tb = KV_ptr + (blk * stride_cb + (tile % PAGE) * stride_cp + head_off)
    kw = _load_field(tb, offk, kin, MSE3)
    # SHIFTED: word offsets from the key field's first word (_stage1). Its own
    # branch, so that the other paths keep their statement order (and SASS:
    # the order of these loads moved their registers at head_dim 256).
    if SHIFTED:
        live = (tile + ns) < end
        tok = tb + ns * stride_cp
        vw = gl.load(tb + par + offv)
        w0 = gl.load(tok + NORM16 // 2, mask=live, other=0)
        w1 = gl.load(tok + (VOFF16 + VW16 - 1) // 2, mask=live, other=0)
        w2 = gl.load(tok + (VOFF16 + VW16 + 1) // 2, mask=live, other=0)
        return kw, vw, w0, w1, w2
    vw = _load_field(tb, offv, vin, V3)
    live = (tile + ns) < end
    tok = tb + ns * stride_cp
    if WORD32:
        w0 = gl.load(tok + (VOFF16 + VW16) // 2, mask=live, other=0)
        w1 = w0
    else:
        w0 = gl.load(tok + VOFF16 + VW16, mask=live, other=0)
        w1 = gl.load(tok + VOFF16 + VW16 + 1, mask=live, other=0)
    w2 = w0 if KEY_FP8 else gl.load(tok + NORM16, mask=live, other=0)
    return kw, vw, w0, w1, w2


@gluon.jit
def _funnel(lo, hi, shift):
    """Bits ``shift`` .. ``shift`` + 15 (``shift`` 0 to 32) of the 64-bit
    word (hi, lo), as int16."""
    w = gl.inline_asm_elementwise(
        "shf.r.clamp.b32 $0, $1, $2, $3;",
        "=r,r,r,r",
        [lo, hi, shift],
        dtype=gl.int32,
        is_pure=True,
        pack=1,
    )
    return w.to(gl.int16)


# The split count and the scratch strides that scale with it are launch
# arguments, not specialized: batch sizes outside the captured CUDA graphs
# (mixed prefill/decode steps) pick split counts of their own, and a compile
# per count stalled such a step for about a second.
@gluon.jit(do_not_specialize=["num_splits", "stride_mb", "stride_mh"])
def _stage1(
    Q_ptr,  # [B, Hq, D]: rotated query (MSE keys) or the query (FP8 keys)
    KV_ptr,  # the cache as int32 words (WORD32), else int16 words
    Block_table_ptr,
    Seq_lens_ptr,
    Table_ptr,  # key_table() (MSE keys; pair points with PAIRS)
    Out_ptr,  # [B, Hq, D] written when not SPLIT
    Mid_ptr,  # [>=B, >=Hq, >=num_splits, D + 1] fp32 when SPLIT or WINDOW
    QMu_ptr,  # [B, Hq] fp32: q . key offset (KEY_OFFSET)
    qk_scale,  # softmax scale * log2(e)
    num_splits,
    stride_qb,
    stride_qh,
    stride_cb,  # cache strides in load units
    stride_cp,  # not read: STRIDE_CP
    stride_ch,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_mb,
    stride_mh,
    stride_ms,
    SPLIT: gl.constexpr,  # num_splits > 1: partial results go to Mid
    # stride_cp as a constant (it is fixed per layer): a tile's word offsets
    # become immediates of its loads. Unspecialized, every load computed its
    # own 64-bit address (~60 instructions a tile).
    STRIDE_CP: gl.constexpr,
    MIN_TOKENS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    PAGE: gl.constexpr,
    GROUP: gl.constexpr,
    KEY_FP8: gl.constexpr,
    TAILS: gl.constexpr,  # MSE keys whose centroids are not all fp16 values
    # The norm correction's squared key norms (MSE keys): from the table's
    # fixed-point squares (SQUARES, where centroids have tails), else from
    # the heads' Gram matrix on the tensor cores (GRAM).
    SQUARES: gl.constexpr,
    GRAM: gl.constexpr,
    NORM16: gl.constexpr,  # u16 offset of the key norm (MSE keys)
    VOFF16: gl.constexpr,  # u16 offset of the value field
    W: gl.constexpr,
    MMA: gl.constexpr,
    Q_SMEM: gl.constexpr,
    A_OP: gl.constexpr,
    B_OP: gl.constexpr,
    KW16: gl.constexpr,
    PTW: gl.constexpr,
    CW: gl.constexpr,
    QC: gl.constexpr,
    LDK: gl.constexpr,
    LDV: gl.constexpr,
    KREG: gl.constexpr,
    VREG: gl.constexpr,
    RED: gl.constexpr,
    WORD32: gl.constexpr,
    # Slots 2 bytes longer than a multiple of 4 (4-bit keys and values), read
    # as int32 words all the same: see ``shifted_slots``. The cache comes as
    # int16 words; stride_cb and STRIDE_CP in int32 words, stride_ch in int16.
    SHIFTED: gl.constexpr,
    MSE3: gl.constexpr,  # 3-bit MSE keys, converted to 4-bit words on load
    PAIRS: gl.constexpr,  # 3-bit MSE keys coded by pairs (``_pair_points``)
    V3: gl.constexpr,  # 3-bit values, the same
    VW16: gl.constexpr,  # u16 words of a slot's values
    PAGE_AHEAD: gl.constexpr,  # a tile's block number read a tile ahead
    PDL: gl.constexpr,  # launched programmatically, before the kernel ahead ends
    # Keys stored shifted by a per-KV-head offset, those stored unshifted
    # marked by their norm's sign bit (``turboquant.key_offset``).
    KEY_OFFSET: gl.constexpr,
    # One split and a raw window's partial result in split slot 1 of Mid
    # (``triton_turboquant_raw_window``): weighed in here, not by a merge.
    WINDOW: gl.constexpr,
):
    if PDL:
        # Launched programmatically (programmatic_launch): this grid is
        # placed while the kernel before it drains, and the merge's grid
        # while this one runs. Nothing is read or written before the wait.
        gdc_launch_dependents()
        gdc_wait()
    # Splits are the grid's slowest axis (see stage1's launch).
    kv_head = gl.program_id(0)
    row = gl.program_id(1)
    split = gl.program_id(2)
    D: gl.constexpr = HEAD_DIM
    U: gl.constexpr = 2 if WORD32 else 1  # u16 words per load unit
    # SHIFTED: 1 where this KV head's slot starts 2 bytes past a word (the
    # page and token strides are whole words: stage1 checks).
    par = (kv_head * stride_ch) & 1 if SHIFTED else 0
    S2: gl.constexpr = gl.SliceLayout(0, MMA)  # [16, 16] scores, in every warp
    COL: gl.constexpr = gl.SliceLayout(0, S2)  # per token
    ROW: gl.constexpr = gl.SliceLayout(1, S2)  # per dot row

    # Tokens per split: at least MIN_TOKENS, whole tiles; splits past the end
    # of a short row stay empty.
    seq_len = gl.load(Seq_lens_ptr + row)
    per = gl.maximum(gl.cdiv(seq_len, num_splits), MIN_TOKENS)
    per = gl.cdiv(per, 16) * 16
    start = split * per
    end = gl.minimum(start + per, seq_len)
    if SPLIT:  # noqa: SIM102 - a compile-time test, kept apart from the runtime one
        # A split past the end of a short row holds no token: it stores the
        # lse = -inf the merge skips and stops, before the query, table and
        # first-tile loads. Those made 7,200 empty programs (150 rows of 640
        # tokens at 9 splits) cost 80 of stage 1's 207 us (ncu, H100).
        if start >= seq_len:
            g16 = gl.arange(0, 16, layout=COL)
            mid = Mid_ptr + row * stride_mb + (kv_head * GROUP + g16) * stride_mh
            empty = gl.full([16], float("-inf"), gl.float32, COL)
            gl.store(mid + split * stride_ms + D, empty, mask=g16 < GROUP)
            return

    # Three loads wait on each other before a tile is computed: the row's
    # length, its first page's block, that page's words. The query and the
    # key table wait on nothing and go out beside the block, and the query
    # is read once: rows 0-7 of its A operand are fp16(q), rows 8-15 the
    # remainder. Loaded by chunk in the operand's layout, every chunk after
    # the first waited on the one before it: an MSE program at head_dim 256
    # spent 10 us before its first tile and 99 in its tiles (H100, 16 x 8K).
    bt_row = Block_table_ptr + row * stride_btb
    blk = _page(bt_row, start, end, PAGE)
    # The query in A-operand order, QC dimensions per chunk, kept in shared
    # memory. Slice-local logical k = r0 + 2 t + 8 r1 + 16 j is physical
    # dimension 32 t + r0 + 2 r1 + 4 j: a thread's B elements are contiguous.
    NCH: gl.constexpr = _SLICE // QC
    QL: gl.constexpr = gl.BlockedLayout(
        [NCH, 1, 1, QC // 4], [1, 1, 8, 4], [1, W, 1, 1], [3, 2, 1, 0]
    )
    q_smem = gl.allocate_shared_memory(gl.float16, [NCH, W, 16, QC], Q_SMEM)
    cq = gl.arange(
        0, NCH, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, QL)))
    )
    wq = gl.arange(
        0, W, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, QL)))
    )
    rq = gl.arange(
        0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, QL)))
    )
    kq = gl.arange(
        0, QC, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, QL)))
    )
    kq = cq[:, None, None, None] * QC + kq[None, None, None, :]
    pq = 32 * ((kq >> 1) & 3) + (kq & 1) + 2 * ((kq >> 3) & 1) + 4 * (kq >> 4)
    q_at = (
        Q_ptr
        + row * stride_qb
        + (kv_head * GROUP + rq)[None, None, :, None] * stride_qh
    )
    if SHIFTED:
        # The keys of odd KV heads start 2 bytes past a word: their last 4
        # dimensions sit in their first word (``shifted_slots``), so the
        # key at position P is dimension (P - 4) mod D.
        q_at = q_at + (wq[None, :, None, None] * _SLICE + pq + (D - 4 * par)) % D
    else:
        q_at = q_at + wq[None, :, None, None] * _SLICE + pq
    q = gl.load(q_at, mask=(rq < GROUP)[None, None, :, None], other=0.0)
    q = q.to(gl.float32)

    m_i = gl.full([16], float("-inf"), gl.float32, ROW)
    l_i = gl.full([16], 0.0, gl.float32, ROW)
    z_i = gl.full([16], 0.0, gl.float32, ROW)  # sum_n p_n * zero_n
    acc = gl.full([W, 16, _SLICE], 0.0, gl.float32, MMA)
    if KEY_OFFSET:
        # Shifted keys score q . (k - mu): a marked key's q . k gets the same
        # -q . mu, in log2 units. Score row r is query head r % 8 of the group.
        h16 = gl.arange(0, 16, layout=ROW) % 8
        qmu = gl.load(
            QMu_ptr + row * (gl.num_programs(0) * GROUP) + kv_head * GROUP + h16,
            mask=h16 < GROUP,
            other=0.0,
        )
        qmu = qmu * qk_scale

    if SHIFTED:
        # Keys and values side by side (16 words a token and slice each), so
        # that the shifted field's first words are one view of the two.
        kv = gl.allocate_shared_memory(gl.int32, [2, W, 16, 4, PTW], _SMEM4)
        k_smem = kv.index(0)
        v_smem = kv.index(1)._reinterpret(gl.int32, [W, 16, 16], _SMEM3)
        # Per token, the low half of that field's first word: [1, 1, 16].
        patch_smem = (
            kv._reinterpret(gl.int16, [2, W, 16, 32], _SMEM3)
            .index(1 - par)
            .slice(0, 1, dim=0)
            .slice(0, 1, dim=2)
            .permute([0, 2, 1])
        )
    elif WORD32:
        k_smem = gl.allocate_shared_memory(gl.int32, [W, 16, 4, PTW], _SMEM4)
        v_smem = gl.allocate_shared_memory(gl.int32, [W, 16, 16], _SMEM3)
    else:
        k16 = gl.allocate_shared_memory(gl.int16, [W, 16, 4, 2 * PTW], _SMEM4)
        v16 = gl.allocate_shared_memory(gl.int16, [W, 16, 32], _SMEM3)
        k_smem = k16._reinterpret(gl.int32, [W, 16, 4, PTW], _SMEM4)
        v_smem = v16._reinterpret(gl.int32, [W, 16, 16], _SMEM3)

    if SHIFTED:
        # The key field's first word (at or before its start); the value
        # field's is (VOFF16 - 1) / 2 + par words on (VOFF16 is odd).
        KV_ptr = KV_ptr.to(gl.pointer_type(gl.int32))
        head_off = (kv_head.to(gl.int64) * stride_ch) >> 1
    else:
        head_off = kv_head.to(gl.int64) * stride_ch
    offk, kin = _field_offsets(LDK, KW16 // U, W, MSE3, STRIDE_CP, 0)
    offv, vin = _field_offsets(LDV, VW16 // U, W, V3, STRIDE_CP, VOFF16 // U)
    ns = gl.arange(0, 16, layout=COL)
    rows_lo = (gl.arange(0, 16, layout=ROW) < 8)[:, None]
    zeros_p = gl.full([W, 16, 16], 0.0, gl.float16, MMA)

    if not KEY_FP8 and not PAIRS:  # key_table(): byte planes, read once
        # One copy of the table per lane: words loaded from one address are
        # uniform, which ptxas keeps in uniform registers and copies to
        # vector registers before every ``prmt`` that reads them (~110
        # moves per tile).
        Table_ptr += _lane_id() * _TABLE_WORDS
        t0 = gl.load(Table_ptr + 0)
        t1 = gl.load(Table_ptr + 1)
        t2 = gl.load(Table_ptr + 2)
        t3 = gl.load(Table_ptr + 3)
        t4 = gl.load(Table_ptr + 4)
        t5 = gl.load(Table_ptr + 5)
        t6 = gl.load(Table_ptr + 6)
        t7 = gl.load(Table_ptr + 7)
        if SQUARES:
            t8 = gl.load(Table_ptr + 8)
            t9 = gl.load(Table_ptr + 9)
            t10 = gl.load(Table_ptr + 10)
            t11 = gl.load(Table_ptr + 11)
            t12 = gl.load(Table_ptr + 12)
            t13 = gl.load(Table_ptr + 13)
            sq_scale = gl.load(Table_ptr + 14).to(gl.float32, bitcast=True)
        if not GRAM:
            # Scores from scaled heads, scaled back. The Gram norms are of
            # the same scaled heads, so there the scale cancels.
            qk_scale = qk_scale * gl.load(Table_ptr + 15).to(gl.float32, bitcast=True)

    if GRAM:  # the diagonal of a tile's key Gram matrix
        eye = gl.arange(0, 16, layout=ROW)[:, None] == ns[None, :]
        zeros_g = gl.full([W, 16, 16], 0.0, gl.float32, MMA)
    if W > 1:
        # The warps' partial scores (and Gram matrices) meet here once a
        # tile. Summed by gl.sum over the warp axis they went through shared
        # memory twice (partials, then the broadcast sum), 51 instructions
        # and 2 barriers a warp and tile at head_dim 256 for the scores
        # alone, 82 and 5 with the Gram's diagonal.
        x_smem = gl.allocate_shared_memory(gl.float32, [W, 16, 16], _SMEM3)
        if GRAM:
            g_smem = gl.allocate_shared_memory(gl.float32, [W, 16, 16], _SMEM3)

    # The next tile's words are loaded before this one is computed (a
    # register double buffer), so DRAM latency overlaps the dots.
    kw, vw, w0, w1, w2 = _tile_words(
        KV_ptr, blk, start, end, stride_cb, STRIDE_CP, head_off, par,
        offk, kin, offv, vin, ns,
        PAGE, KEY_FP8, NORM16, VOFF16, VW16, WORD32, MSE3, V3, SHIFTED,
    )  # fmt: skip
    if PAGE_AHEAD:
        blk = _page(bt_row, start + 16, end, PAGE)
    q_hi, q_lo = _f16_parts(q)
    q16 = gl.permute(gl.join(q_hi, q_lo), [0, 1, 4, 2, 3])
    # The chunks' buffers as one [NCH * W, 16, QC] (Q_SMEM swizzles within
    # each [16, QC] matrix).
    q_all = q_smem._reinterpret(gl.float16, [NCH * W, 16, QC], Q_SMEM)
    q_all.store(gl.reshape(q16, [NCH * W, 16, QC]))
    for tile in range(start, end, 16):
        live = (tile + ns) < end
        if SHIFTED:
            # Half-words, low | high. Odd heads: w0 = last key | norm, w1 =
            # two values, w2 = scale | zero; even heads: w0 = norm | first
            # value, w1 = last value | scale, w2 = zero | next slot.
            sh = 16 * par
            v_scale = _f16_of_u16(_funnel(w1, w2, 16 + sh))
            v_zero = _f16_of_u16(_funnel(w2, w2, sh))
            factor = _f16_of_u16(_funnel(w0, w0, sh)) * qk_scale
            patch = _funnel(w1, w0, 2 * sh)  # last key (odd) or value (even)
        elif WORD32:
            v_scale = _f16_of_u16((w0 & 0xFFFF).to(gl.int16))
            v_zero = _f16_of_u16((w0 >> 16).to(gl.int16))
        else:
            v_scale = _f16_of_u16(w0)
            v_zero = _f16_of_u16(w1)
        if KEY_FP8:
            factor = gl.full([16], 1.0, gl.float32, COL) * qk_scale
        elif not SHIFTED:
            factor = _f16_of_u16(w2) * qk_scale
        gl.thread_barrier()
        if WORD32:
            k_smem.store(gl.permute(gl.reshape(kw, [16, W, 4, PTW]), [1, 0, 2, 3]))
            v_smem.store(gl.permute(gl.reshape(vw, [16, W, 16]), [1, 0, 2]))
        else:
            if MSE3:
                k4 = _nibbles3(kw, 4 * W, not PAIRS)
                k_smem.store(gl.permute(gl.reshape(k4, [16, W, 4, PTW]), [1, 0, 2, 3]))
            else:
                k16.store(gl.permute(gl.reshape(kw, [16, W, 4, 2 * PTW]), [1, 0, 2, 3]))
            if V3:
                v4 = _nibbles3(vw, 4 * W, False)
                v_smem.store(gl.permute(gl.reshape(v4, [16, W, 16]), [1, 0, 2]))
            else:
                v16.store(gl.permute(gl.reshape(vw, [16, W, 32]), [1, 0, 2]))
        gl.thread_barrier()
        if not PAGE_AHEAD:
            blk = _page(bt_row, tile + 16, end, PAGE)
        kw, vw, w0, w1, w2 = _tile_words(
            KV_ptr, blk, tile + 16, end, stride_cb, STRIDE_CP, head_off, par,
            offk, kin, offv, vin, ns,
            PAGE, KEY_FP8, NORM16, VOFF16, VW16, WORD32, MSE3, V3, SHIFTED,
        )  # fmt: skip
        if PAGE_AHEAD:
            blk = _page(bt_row, tile + 32, end, PAGE)
        if SHIFTED:
            # The shifted field's first word: its last half-word replaces
            # the other field's half read with it. Its whole word was stored
            # above by another thread, hence the barriers around.
            patch_smem.store(gl.expand_dims(gl.expand_dims(patch, 0), 0))
            gl.thread_barrier()

        # ---- scores: each warp over its slice, QC dimensions per chunk ----
        raw = gl.full([W, 16, 16], 0.0, gl.float32, MMA)
        if GRAM:
            gram = zeros_g
        for c in gl.static_range(NCH):
            qc = q_smem.index(c).load(A_OP)
            kr = k_smem.slice(c * CW, CW, dim=3).load(KREG)
            if KEY_FP8:
                f0, f1, f2, f3 = _e4m3x4_to_f16(kr)
                kf = gl.join(gl.join(f0, f1), gl.join(f2, f3))  # w n t j r0 r1
                kf = gl.reshape(gl.permute(kf, [0, 3, 5, 2, 4, 1]), [W, QC, 16])
                kf = gl.convert_layout(kf, B_OP, assert_trivial=True)
                raw = mma_v2(qc, kf, raw)
            else:
                if PAIRS:
                    heads = _pair_points(kr, Table_ptr)
                else:
                    sel, pos0, pos1 = _mse_select(kr)
                    heads = _mse_centroids(sel, pos0, pos1, t0, t1, t2, t3)
                ch = _key_operand(heads, W, QC)
                kb = gl.convert_layout(ch, B_OP, assert_trivial=True)
                raw = mma_v2(qc, kb, raw)
                if GRAM:
                    # The B operand of 16 tokens is, register for register,
                    # the A operand of its transpose: K^T K on the tensor
                    # cores, whose diagonal holds the squared norms.
                    ka = gl.convert_layout(
                        gl.permute(kb, [0, 2, 1]), A_OP, assert_trivial=True
                    )
                    gram = mma_v2(ka, kb, gram)
                if TAILS:
                    cl = _key_operand(
                        _mse_centroids(sel, pos0, pos1, t4, t5, t6, t7), W, QC
                    )
                    raw = mma_v2(
                        qc, gl.convert_layout(cl, B_OP, assert_trivial=True), raw
                    )
                if SQUARES:
                    sq = _mse_squares(sel, t8, t9, t10, t11, t12, t13)
                    if c == 0:
                        csq = sq
                    else:
                        csq += sq
        if SQUARES:  # exact integer sums
            csq_t = gl.sum(gl.sum(gl.sum(csq, axis=3), axis=2), axis=0)
            csq_t = gl.convert_layout(csq_t, COL).to(gl.float32) * sq_scale
            factor = factor / gl.sqrt(csq_t + 1e-16)
        # Across the warps' slices. Each warp reads the others' partials
        # after one barrier; the next tile writes them again only after the
        # barrier at its top, which every warp passes after these reads.
        if W > 1:
            x_smem.store(raw)
            if GRAM:
                g_smem.store(gram)
            gl.thread_barrier()
            s = gl.sum(x_smem.load(RED), axis=0)
            if GRAM:
                gram_t = gl.sum(g_smem.load(RED), axis=0)
        else:
            s = gl.sum(raw, axis=0)
            if GRAM:
                gram_t = gl.sum(gram, axis=0)
        s = gl.convert_layout(s, S2, assert_trivial=True)
        if GRAM:  # products exact, sums in fp32
            gram_t = gl.convert_layout(gram_t, S2, assert_trivial=True)
            dsq = gl.sum(gl.where(eye, gram_t, 0.0), axis=0)
            factor = factor * gl.rsqrt(gl.convert_layout(dsq, COL) + 1e-30)
        s8 = gl.sum(gl.reshape(s, [2, 8, 16]), axis=0)  # head + tail rows
        s = gl.reshape(gl.permute(gl.join(s8, s8), [2, 0, 1]), [16, 16])
        s = gl.convert_layout(s, S2, assert_trivial=True)
        if KEY_OFFSET:
            marked = factor < 0.0
            factor = gl.abs(factor)
        s = gl.where(live[None, :], s * factor[None, :], float("-inf"))
        if KEY_OFFSET:
            s = s - gl.where(marked[None, :], qmu[:, None], 0.0)

        # ---- online softmax (every warp holds the whole score tile) ----
        # The running max m_i moves only when a row's max outgrows it by more
        # than 2**_STALE_LOG2 (or a scale could overflow p * scale in fp16):
        # m cancels in (acc + z) / l, so the result is the same, and the
        # rescale of acc (64 FMUL a warp per tile, 11 % of k8v4's loop) runs
        # on the few tiles where the max moves, not on every one.
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        grow = gl.max(m_new - m_i, axis=0)
        if (grow > _STALE_LOG2) | (gl.max(v_scale, axis=0) > _STALE_SCALE_MAX):
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha
            z_i = z_i * alpha
            a3 = gl.convert_layout(
                alpha, gl.SliceLayout(0, gl.SliceLayout(2, MMA)), assert_trivial=True
            )
            acc = acc * gl.expand_dims(gl.expand_dims(a3, 0), 2)
            m_i = m_new
        p = gl.exp2(s - m_i[:, None])
        l_i = l_i + gl.sum(p, axis=1)
        z_i = z_i + gl.sum(p * v_zero[None, :], axis=1)
        p2 = gl.expand_dims(_split16(p * v_scale[None, :], rows_lo), 0) + zeros_p
        p2 = gl.convert_layout(p2, A_OP, assert_trivial=True)

        # ---- values: [W, 16 k, 16 words] -> B operand [W, 16 k, _SLICE] ----
        vv = _value_operand(v_smem.load(VREG), W)
        vv = gl.convert_layout(vv, B_OP, assert_trivial=True)
        acc = mma_v2(p2, vv, acc)

    # Rows r and r + 8 carry the fp16 head and tail of p * scale; m, l, z are
    # equal in both.
    O3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 4, 8], [W, 1, 1], [2, 1, 0])
    H8: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, O3))
    out = gl.convert_layout(gl.sum(gl.reshape(acc, [W, 2, 8, _SLICE]), axis=1), O3)
    l8 = gl.convert_layout(gl.max(gl.reshape(l_i, [2, 8]), axis=0), H8)
    m8 = gl.convert_layout(gl.max(gl.reshape(m_i, [2, 8]), axis=0), H8)
    z8 = gl.convert_layout(gl.max(gl.reshape(z_i, [2, 8]), axis=0), H8)
    safe_l = gl.where(l8 > 0.0, l8, 1.0)
    out = (out + z8[None, :, None]) / safe_l[None, :, None]
    ow = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, O3)))
    o8 = gl.arange(0, 8, layout=H8)
    oc = gl.arange(0, _SLICE, layout=gl.SliceLayout(0, gl.SliceLayout(1, O3)))
    # Slice-local logical column n = g + 8 jn is physical dimension 16 g + jn.
    phys = ow[:, None, None] * _SLICE + (16 * (oc % 8) + oc // 8)[None, None, :]
    if SHIFTED:  # the values of even KV heads, as the keys of odd ones
        phys = (phys + (D - 4 * (1 - par))) % D
    h8 = kv_head * GROUP + o8
    omask = (o8 < GROUP)[None, :, None]
    if WINDOW and not SPLIT:
        win = Mid_ptr + row * stride_mb + h8 * stride_mh + num_splits * stride_ms
        part = gl.load(win[None, :, None] + phys, mask=omask, other=0.0)
        lse_w = gl.load(win + D, mask=o8 < GROUP, other=float("-inf"))
        lse = gl.where(l8 > 0.0, m8 + gl.log2(safe_l), float("-inf"))
        top = gl.maximum(lse, lse_w)
        ref = gl.where(top > float("-inf"), top, 0.0)
        w = gl.where(lse > float("-inf"), gl.exp2(lse - ref), 0.0)
        w_w = gl.where(lse_w > float("-inf"), gl.exp2(lse_w - ref), 0.0)
        total = gl.where(w + w_w > 0.0, w + w_w, 1.0)
        out = (out * w[None, :, None] + part * w_w[None, :, None]) / total[
            None, :, None
        ]
    if not SPLIT:
        o_ptrs = Out_ptr + row * stride_ob + h8[None, :, None] * stride_oh + phys
        gl.store(o_ptrs, out.to(Out_ptr.dtype.element_ty), mask=omask)
    else:
        # An empty split stores zeros and lse = -inf; the merge skips it.
        mid = Mid_ptr + row * stride_mb + h8 * stride_mh + split * stride_ms
        gl.store(mid[None, :, None] + phys, out, mask=omask)
        lse = gl.where(l8 > 0.0, m8 + gl.log2(safe_l), float("-inf"))
        gl.store(mid + D, lse, mask=o8 < GROUP)


# Layouts are Python objects built per launch config; building them took
# ~90 µs of host time per call, which eager (mixed prefill/decode) steps pay
# for every layer.
@functools.cache
def _constexprs(
    head_dim: int,
    group: int,
    page: int,
    key_fp8: bool,
    mse_bits: int,
    key_packed_size: int,
    norm_correction: bool,
    word32: bool,
    split: bool,
    min_split_tokens: int,
    value_bits: int,
    tails: bool,
    stride_cp: int,
    pdl: bool,
    shifted: bool = False,
    key_offset: bool = False,
    window: bool = False,
    pairs: bool = False,
) -> Mapping[str, object]:
    mse = not key_fp8
    correct = mse and bool(norm_correction)
    layout = slot_layout(head_dim, key_fp8, mse_bits, value_bits)
    if pairs and (key_fp8 or mse_bits != 3):
        raise ValueError(
            f"keys coded by pairs are 3-bit MSE keys; got "
            f"{'FP8' if key_fp8 else f'{mse_bits}-bit MSE'} keys: pass pairs=False"
        )
    if shifted and key_packed_size % 4 != 2:
        # _stage1 finds the norm, scale and zero by the value field's start
        # being 2 bytes past the key field's (mod 4).
        raise ValueError(
            f"shifted slots need a key field (its norm included) 2 bytes longer "
            f"than a multiple of 4; got {key_packed_size} bytes: read this "
            "cache with shifted=False"
        )
    return MappingProxyType(
        dict(
            SPLIT=split,
            STRIDE_CP=stride_cp,
            MIN_TOKENS=min_split_tokens,
            HEAD_DIM=head_dim,
            PAGE=page,
            GROUP=group,
            KEY_FP8=bool(key_fp8),
            TAILS=mse and bool(tails),
            SQUARES=correct and bool(tails),
            GRAM=correct and not tails,
            NORM16=layout.key_index_bytes // 2,
            VOFF16=key_packed_size // 2,
            # 3-bit values: the next tile's block number is read a tile
            # ahead. Read beside the words, ptxas put turboquant_3bit_nc's
            # word loads after the softmax (~170 instructions later) once
            # the query was read in one piece, and head_dim 128 ran 1-6 %
            # slower than before; a tile ahead, 2-8 % faster except at
            # 64 x 32K (+2.5 %). The other presets ran up to 3.5 % slower
            # that way (H100; benchmarks/NOTES.md).
            PAGE_AHEAD=value_bits == 3,
            PDL=pdl,
            SHIFTED=shifted,
            KEY_OFFSET=key_offset,
            WINDOW=window and not split,
            PAIRS=pairs,
            **launch_config(head_dim, key_fp8, word32 or shifted, mse_bits, value_bits),
        )
    )


def _unit_bytes(word32: bool) -> int:
    """Bytes per cache load unit: 32-bit words (FP8-key slots, 4-byte
    aligned), else 16-bit ones."""
    return 4 if word32 else 2


def _shiftable(head_dim: int, key_fp8: bool, mse_bits: int, value_bits: int) -> bool:
    """4-bit MSE keys and 4-bit values (slots of head_dim + 6 bytes), at
    head_dim 128 or 256. At 512 the shifted tile spilled 40 bytes (12 local
    loads and stores a tile) and ran 0.2 % faster (H200; benchmarks/NOTES.md):
    the 16-bit path stays there."""
    return not key_fp8 and mse_bits == 4 and value_bits == 4 and head_dim <= 256


def shifted_slots(
    kv_cache: torch.Tensor,
    head_dim: int,
    key_fp8: bool,
    mse_bits: int,
    value_bits: int,
) -> bool:
    """Whether stage 1 reads this cache's slots as 32-bit words although
    they are 2 bytes longer than a multiple of 4 (``SHIFTED``).

    A ``turboquant_4bit_nc`` slot is D / 2 key bytes, the key norm, D / 2
    value bytes, the value scale and zero: D + 6 bytes. With 16-bit loads its
    tile cost 769 SASS instructions against k8v4's 477 (head_dim 128; 754
    read this way, and 6-7 % less time: benchmarks/NOTES.md). Where the page
    and token strides are whole words (an even number of KV heads), a slot
    starts 0 or 2 bytes past a word, the same for every token of a KV head,
    and its value field starts 2 bytes off from its key field. Each field is
    read from the word at or before its start, D / 8 words: the one that
    starts 2 bytes past a word misses its last half-word, and its first
    word's low half holds a foreign one (the key norm, or the previous
    slot's zero). Stage 1 stores that last half-word there, read with the
    norm or the scale, and reads the field rotated by 4 dimensions. 3-bit
    fields keep the 16-bit path."""
    return (
        _shiftable(head_dim, key_fp8, mse_bits, value_bits)
        and words_aligned(kv_cache, 2)
        and kv_cache.data_ptr() % 4 == 0
        and kv_cache.stride(0) % 4 == 0
        and kv_cache.stride(1) % 4 == 0
    )


def stage1(
    q_in: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    table: torch.Tensor | None,
    out: torch.Tensor,
    mid: torch.Tensor,
    qk_scale: float,
    num_splits: int,
    min_split_tokens: int,
    group: int,
    key_packed_size: int,
    mse_bits: int,
    key_fp8: bool,
    norm_correction: bool,
    value_bits: int = 4,
    key_tails: bool = True,
    qmu: torch.Tensor | None = None,
    window: bool = False,
    key_pairs: bool = False,
) -> None:
    """Launch stage 1: partial results of ``num_splits`` context splits per
    (row, KV head) into ``mid``, or with one split the output into ``out``;
    ``triton_turboquant_decode_splitkv.merge`` combines them. ``qmu``
    ([B, Hq] fp32, contiguous): ``q . key_offset`` of a layer whose keys were
    stored with an offset (``rotate_query_with_offset``). ``window``: ``mid``'s
    split slot ``num_splits`` holds a raw window's partial result; with one
    split stage 1 weighs it into the output. ``key_pairs``: 3-bit keys coded
    by pairs, ``table`` their points (``key_table`` of a pair codebook)."""
    B, Hk, D = seq_lens.shape[0], kv_cache.shape[2], q_in.shape[-1]
    # The 32-bit path needs 4-byte aligned fields: FP8-key slots only (the
    # MSE presets' slots are 2 bytes longer than a multiple of 4; the 4-bit
    # ones are read as 32-bit words shifted by their start, shifted_slots).
    word32 = key_fp8 and words_aligned(kv_cache, 4)
    shifted = shifted_slots(kv_cache, D, key_fp8, mse_bits, value_bits)
    unit = _unit_bytes(word32 or shifted)
    words = kv_cache.view(torch.int32 if word32 else torch.int16)
    qb, qh, cb, cp, ch, *rest = stage1_strides(
        q_in, kv_cache, unit, block_table, out, mid
    )
    if shifted:  # the head stride in int16 words: its parity is read (_stage1)
        ch = kv_cache.stride(2) // 2
    args = (
        q_in,
        words,
        block_table,
        seq_lens,
        table if table is not None else seq_lens,  # not read for FP8 keys
        out,
        mid,
        mid if qmu is None else qmu,
        qk_scale,
        num_splits,
        qb,
        qh,
        cb,
        cp,
        ch,
        *rest,
    )
    constexprs = _constexprs(
        D,
        group,
        kv_cache.shape[1],
        key_fp8,
        mse_bits,
        key_packed_size,
        norm_correction,
        word32,
        num_splits > 1,
        min_split_tokens,
        value_bits,
        key_tails,
        kv_cache.stride(1) // unit,
        programmatic_launch(q_in.device),
        shifted,
        qmu is not None,
        window,
        key_pairs,
    )
    # A GPU hands out blocks x first, so with the splits last every (KV head,
    # row)'s first split goes out before any second one. In a batch of short
    # rows the live splits are the first few: sent first, they run while the
    # empty ones behind them drain, instead of waiting among them. 150 rows
    # of 640 tokens at 9 splits (3 live): 121 -> 100 us (k8v4), 169 -> 131
    # (4bit_nc) on an H100 (benchmarks/NOTES.md).
    _launch(_stage1, (Hk, B, num_splits), args, constexprs)


# id(constexprs) -> (constexprs, its launch options, their launch key).
_options: dict[int, tuple[Mapping[str, object], Mapping[str, object], ByIdentity]] = {}


def _launch(
    kernel, grid: tuple[int, ...], args: tuple, constexprs: Mapping[str, object]
):
    # The mappings come from _constexprs, kept for the process's life, so
    # their launch options are built once and passed as one mapping.
    hit = _options.get(id(constexprs))
    if hit is None or hit[0] is not constexprs:
        options = MappingProxyType(
            dict(
                constexprs,
                num_warps=constexprs["W"],
                maxnreg=MAX_REGISTERS,
                launch_pdl=constexprs["PDL"],
            )
        )
        hit = _options[id(constexprs)] = (constexprs, options, ByIdentity(options))
    launcher(kernel).launch_with(grid, args, hit[1], hit[2])
