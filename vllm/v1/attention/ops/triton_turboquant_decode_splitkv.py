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
  query's dtype; with one split the first kernel writes it directly.

Each row is independent (its own ``seq_lens`` entry and block-table row), so
one launch serves plain decode rows, speculative verify rows (one row per
query token of a request) and CUDA-graph padding rows (seq_len 0, output 0).

On sm_89+ GPUs the first kernel is, for the layouts it serves, the Gluon
stage 1 (``gluon_turboquant_decode``): the same inputs and partial results,
without the shared-memory round trips Triton puts around every dot.
"""

import functools
import os
from fractions import Fraction

import torch

from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton

# HYBRIDKV_TQ_DECODE (A/B runs): unset or "gluon", the Gluon stage 1
# (gluon_turboquant_decode: CUDA sm_89+) where it serves, else this module's
# Triton stage 1; "triton", the Triton stage 1 only; "legacy", 0.20.2's kernel.
DECODE_MODES = ("gluon", "triton", "legacy")


def decode_mode(value: str) -> str:
    """The stage-1 choice named by ``HYBRIDKV_TQ_DECODE``'s ``value``."""
    mode = value.strip().lower() or "gluon"
    if mode not in DECODE_MODES:
        raise ValueError(
            f"HYBRIDKV_TQ_DECODE={value!r} is not a TurboQuant decode kernel; "
            f"expected one of {', '.join(DECODE_MODES)} (or unset for gluon)"
        )
    return mode


_MODE = decode_mode(os.environ.get("HYBRIDKV_TQ_DECODE", ""))
ENABLED = _MODE != "legacy"
# Largest split count x head_dim of a Gluon decode: past it the merge's reads
# of the partials cost more than the splits gain. On an H100, 1 x 32K
# Qwen3-4B took 51 us at 128 splits and 128 us at 256 (release 10).
GLUON_MAX_SPLIT_DIMS = 128 * 128
# A Gluon program's cost apart from its tokens, as a share of one pass over
# the whole context. 16 x 8K on Qwen3-4B took 10 us longer at 32 splits (4
# waves) than at 16 (2 waves) on an H100, ~1/256 of a 1.2 ms pass per wave.
GLUON_PROGRAM_COST = Fraction(1, 256)
# From this many waves of one program per (row, KV head), the Gluon stage 1
# does not split. A batch that large holds short rows (the KV cache bounds
# rows x context), and there a split costs about what its tokens do: each
# program's prologue, its partial result and the merge. 500 x 576 on Qwen3-4B
# (3.8 waves) took 209 / 290 us at one split and 364 / 531 us at the 5 the
# wave model chose (k8v4 / 4bit_nc, H100; benchmarks/NOTES.md, "Release 17").
# Below it rows can be long and the idle part of the last wave large: 160 x
# 8192 (1.2 waves) took 1,189 us at one split and 879 at 9.
GLUON_ONE_SPLIT_WAVES = Fraction(3, 2)
# Below this many warps per SM at the largest split count, the Triton stage 1
# (its 4-warp programs fill the SMs with fewer splits). 1 x 32K Qwen3-4B on an
# H100: 32 splits (1.9 warps/SM) 86 / 144 us (k8v4 / 4bit_nc) vs Triton's
# 122 / 144; 16 splits (1 warp/SM) 148 / 243 us.
GLUON_MIN_WARPS_PER_SM = 1.5

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


# Programs per SM the split count aims for when the batch is small.
PROGRAMS_PER_SM = 8
# A split covers at least this many tokens (applied on the device).
MIN_SPLIT_TOKENS = 256
# Splits the merge reads per step (a [MERGE_BLOCK_SPLITS, head_dim] fp32
# tile): the backend's 32 per row in one step.
MERGE_BLOCK_SPLITS = 32
# Query heads per KV head this kernel serves (the head and tail halves of a
# 16-row dot operand).
MAX_GROUP = 8

_LOG2E = 1.4426950408889634

_sm_counts: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index or 0
    if index not in _sm_counts:
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(index)
            _sm_counts[index] = props.multi_processor_count
        else:
            # Triton interpreter (CPU tensors): any fixed figure will do.
            _sm_counts[index] = 4
    return _sm_counts[index]


def _use_fp8_e4b15(device: torch.device) -> int:
    # 0.20.2's rule (Ampere/Ada have no e4m3 conversions), which its store
    # kernels follow too; imported here because that module imports this one.
    # CPU tensors (the Triton interpreter) take e4m3.
    if device.type != "cuda":
        return 0
    from vllm.v1.attention.ops.triton_turboquant_decode import (
        _use_fp8_e4b15 as use_e4b15,
    )

    return use_e4b15(device.index or 0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def nvidia_capability(device: torch.device) -> tuple[int, int]:
    """``device``'s compute capability if it is an NVIDIA GPU, else (0, 0).

    ROCm reports its GPUs as ``"cuda"`` devices with a capability too
    (gfx90a 9.0, gfx942 9.4), and 0.20.2 lists TurboQuant among ROCm's
    backends; but the Gluon stage 1 (PTX inline assembly, mma_v2) and
    programmatic launches (``griddepcontrol``) exist on NVIDIA GPUs only."""
    if device.type != "cuda" or not current_platform.is_cuda():
        return (0, 0)
    return _capability(device.index or 0)


def programmatic_launch(device: torch.device) -> bool:
    """Whether the Gluon stage 1 and the merge launch programmatically on
    ``device`` (PDL, sm_90+): each is placed on the SMs as the kernel before
    it drains, and waits for it (``griddepcontrol.wait``) before it touches
    memory. Launched in order, a decode spent ~1.4 us between each two of
    its kernels; launched so, Qwen3-4B 1 x 32K took 3-7 % less time and
    16 x 8K 1-2 % (H100; benchmarks/NOTES.md, "Release 25").

    The query rotation lets stage 1 start only as it ends: letting it start
    at once (``launch_dependents`` on entry) made 512 rows of 640 tokens 2-3 %
    slower on the MSE presets."""
    return nvidia_capability(device) >= (9, 0)


# The Gluon stage-1 module per CUDA device index, or None where it cannot run.
_gluon_modules: dict[int, object] = {}


def _gluon_module(device: torch.device, enabled: bool = _MODE == "gluon"):
    """``gluon_turboquant_decode`` where it is enabled and can run on
    ``device``, else None.

    It needs Gluon (Triton >= 3.5) and sm_89+ (e4m3 conversions, mma_v2).
    """
    if not enabled or nvidia_capability(device) < (8, 9):
        return None
    index = device.index or 0
    if index not in _gluon_modules:
        try:
            from vllm.v1.attention.ops import gluon_turboquant_decode as module
        except ImportError:
            module = None
        _gluon_modules[index] = module
    return _gluon_modules[index]


# Tests that run the Gluon kernel's body off the GPU set these.
_gluon_for = _gluon_module
_gluon_runner = None


def words_aligned(kv_cache: torch.Tensor, width: int = 2) -> bool:
    """Whether every packed field of every slot starts at a multiple of
    ``width`` bytes, so the cache can be read as ``width``-byte words.

    Field offsets inside a slot are even (see ``TurboQuantConfig``); an odd
    page, token or head stride (a page padded to an odd size) or an odd base
    address breaks that, and the kernel must load bytes. Only FP8-key slots
    are also whole 4-byte words.
    """
    return (
        kv_cache.data_ptr() % width == 0
        and kv_cache.shape[-1] % width == 0
        and all(st % width == 0 for st in kv_cache.stride()[:-1])
    )


def num_kv_splits(batch: int, num_kv_heads: int, max_splits: int, sms: int) -> int:
    """Context splits per (row, KV head) for the Triton stage 1: enough
    programs to fill the GPU (``PROGRAMS_PER_SM``).

    Depends on shapes and the device only, so a CUDA graph captured for a
    batch size replays correctly for any sequence lengths.
    """
    want = -(-(PROGRAMS_PER_SM * sms) // max(batch * num_kv_heads, 1))
    return max(1, min(max_splits, want))


@functools.cache
def gluon_num_splits(
    batch: int,
    num_kv_heads: int,
    warps_per_program: int,
    sms: int,
    max_splits: int,
    warps_per_sm: int,
) -> int:
    """Context splits per (row, KV head) for the Gluon stage 1.

    Its programs run in waves of ``warps_per_sm`` resident warps per SM (the
    kernel's ``resident_warps``), and a partly filled wave takes as long as a
    full one: 16 x 8K on Qwen3-4B at 17 splits with 8 warps per SM is 2,176
    one-warp programs for 1,056 slots, three waves of 482 tokens where 16
    splits take two of 512 (205 vs 157 us on an H100). The
    count is the one with the least waves x (tokens per program + a fixed
    cost per program, ``GLUON_PROGRAM_COST``); among equals the fewest. One
    split from ``GLUON_ONE_SPLIT_WAVES`` waves of one program per row.
    Depends on shapes and the device only, as ``num_kv_splits``.
    """
    slots = max(sms * warps_per_sm // warps_per_program, 1)
    programs = max(batch * num_kv_heads, 1)
    if programs >= GLUON_ONE_SPLIT_WAVES * slots:
        return 1

    def cost(splits: int) -> Fraction:
        waves = -(-(programs * splits) // slots)
        return waves * (Fraction(1, splits) + GLUON_PROGRAM_COST)

    return min(range(1, max(max_splits, 1) + 1), key=lambda s: (cost(s), s))


def _holds(mid_o_buf: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether the scratch's own dimensions cover ``shape`` with unit-stride
    partials."""
    return mid_o_buf.stride(-1) == 1 and all(
        n >= m for n, m in zip(mid_o_buf.shape, shape)
    )


def scratch_splits(mid_o_buf: torch.Tensor | None, batch: int, heads: int, D: int):
    """Splits per (row, head) the scratch holds for ``batch`` rows: its own
    split dimension, or all of a contiguous buffer, whose rows past ``batch``
    are spare at that batch (the backend's is sized for the largest decode
    batch, and small batches need the most splits)."""
    if mid_o_buf is None or mid_o_buf.dtype != torch.float32:
        return 0
    if mid_o_buf.is_contiguous():
        return mid_o_buf.numel() // (batch * heads * (D + 1))
    return mid_o_buf.shape[2] if _holds(mid_o_buf, (batch, heads, 0, D + 1)) else 0


def scratch_view(
    mid_o_buf: torch.Tensor, batch: int, heads: int, splits: int, D: int
) -> torch.Tensor:
    """The scratch as [batch, heads, splits or more, D + 1], given
    ``scratch_splits(...) >= splits``: the buffer itself where its own
    dimensions are large enough, else the start of a contiguous one."""
    own = (batch, heads, splits, D + 1)
    if _holds(mid_o_buf, own):
        return mid_o_buf
    return mid_o_buf.view(-1)[: batch * heads * splits * (D + 1)].view(own)


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
    )


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
    Centroids_ptr,  # [2**MSE_BITS] fp32
    Out_ptr,  # [B, Hq, D] query dtype, written when not SPLIT
    Mid_ptr,  # [>=B, >=Hq, >=num_splits, D + 1] fp32, when SPLIT
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
            )
        if KEY_FP8:
            tok = tl.full([BLOCK_N], 1.0, dtype=tl.float32) * qk_scale
        else:
            tok = _fp16_word(ckn) * qk_scale
            if NORM_CORRECTION:
                tok = tok / tl.sqrt(c_sq + 1e-16)
        # Rows r and r ^ 8 hold q_head . k and q_tail . k: an exact fp32
        # "ieee" dot with the pairing matrix sums them into both rows (a
        # reshape here would pull the accumulator into a replicated layout).
        s = tl.dot(pair, raw, input_precision="ieee")
        s = s * tok[None, :]
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
    num_splits,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,  # launched programmatically: stage 1 may still run
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
    tl.store(
        Out_ptr + row * stride_ob + head * stride_oh + offs_d,
        out.to(Out_ptr.dtype.element_ty),
    )


# data_ptr of the backend's Hadamard matrix per (head_dim, device name).
_hadamard_ptrs: dict[tuple[int, str], int] = {}


def is_backend_hadamard(PiT: torch.Tensor | None) -> bool:
    """Whether ``PiT`` is the TurboQuant backend's own rotation matrix.

    The backend (and 0.20.2's tests) rotate with the cached scaled Sylvester
    Hadamard matrix of ``turboquant_attn._build_hadamard``; that object, and
    no other matrix, may be replaced by an in-register transform. Identity,
    not values: comparing values would sync with the GPU. Looking the matrix
    up may build it (a copy to the GPU), which a CUDA graph capture forbids:
    while capturing, only lookups made before count (vLLM's warm-up runs
    make them); otherwise the GEMM path runs, which is correct, only slower.
    """
    if PiT is None or PiT.dim() != 2 or PiT.shape[0] != PiT.shape[1]:
        return False
    D = PiT.shape[0]
    if D < 16 or D & (D - 1):
        return False
    capturing = PiT.is_cuda and torch.cuda.is_current_stream_capturing()
    for name in {str(PiT.device), PiT.device.type}:
        key = (D, name)
        if key not in _hadamard_ptrs:
            if capturing:
                continue
            from vllm.v1.attention.backends.turboquant_attn import _build_hadamard

            _hadamard_ptrs[key] = _build_hadamard(D, name).data_ptr()
        if PiT.data_ptr() == _hadamard_ptrs[key]:
            return True
    return False


def rotate_query(query: torch.Tensor, PiT: torch.Tensor) -> torch.Tensor:
    """``query.float() @ PiT`` for the backend's Hadamard ``PiT``, one launch."""
    # Imported here: that module imports the store's, which imports 0.20.2's
    # decode module, which imports this one.
    from vllm.v1.attention.ops import triton_turboquant_rotate_query

    return triton_turboquant_rotate_query.rotate_query(query, PiT)


def decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, Hk, slot] uint8
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    PiT: torch.Tensor | None,  # [D, D] fp32 (q_rot = q @ PiT); None for FP8 keys
    centroids: torch.Tensor,  # [2**mse_bits] fp32
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
    geometry: tuple[int, ...] | None = None,
    out_dtype: torch.dtype | None = None,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
    hadamard_query: bool = False,
) -> torch.Tensor:
    """Decode attention over a packed TurboQuant cache: [B, Hq, D].

    ``hadamard_query``: ``PiT`` is the backend's scaled Hadamard matrix
    (``is_backend_hadamard``), so the query is rotated by ``rotate_query``
    instead of an fp32 GEMM.

    The output has the query's dtype unless ``out_dtype`` says otherwise.
    ``mid_o_buf`` ([>=B, >=Hq, S, D + 1] fp32, preallocated for CUDA graphs)
    caps the Triton stage 1's split count at S (and ``max_num_kv_splits``);
    the Gluon stage 1 also splits into the rows past B of a contiguous one
    (``scratch_splits``). Without it, scratch is allocated per call.
    ``output_buf`` is used when it has the output dtype. ``num_splits``,
    ``geometry`` (see ``default_geometry``) and ``min_split_tokens`` override the
    defaults (tests, benchmarks).
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
    if kv_cache.stride(-1) != 1:
        raise ValueError(
            "TurboQuant decode expects slot bytes contiguous in the cache's last "
            f"dimension, got stride {kv_cache.stride(-1)}; pass a view whose last "
            "dimension is the slot"
        )
    if not supports(D, Hq, Hk, mse_bits, value_quant_bits, key_fp8):
        raise ValueError(
            f"split-KV TurboQuant decode serves head_dim {sorted(GEOMETRY)} and "
            f"up to {MAX_GROUP} query heads per KV head, got head_dim {D}, "
            f"{Hq} query / {Hk} KV heads; call supports() first and use "
            "triton_turboquant_decode_attention otherwise"
        )

    if key_fp8:
        q_in = query if query.stride(-1) == 1 else query.contiguous()
    else:
        q_in = rotate_query(query, PiT) if hadamard_query else query.float() @ PiT

    out_dtype = out_dtype or query.dtype
    if (
        output_buf is not None
        and output_buf.dtype == out_dtype
        and output_buf.shape[0] >= B
        and output_buf.stride(-1) == 1
    ):
        out = output_buf[:B, :Hq, :D]
    else:
        out = torch.empty(B, Hq, D, dtype=out_dtype, device=device)

    # The Gluon stage 1 where it serves this layout and, for MSE keys, its
    # key table exists (none is built during a CUDA graph capture).
    gluon = _gluon_for(device) if geometry is None else None
    table = None
    if gluon is not None and not (
        words_aligned(kv_cache)
        and gluon.serves(
            D, group, kv_cache.shape[1], key_fp8, mse_bits, value_quant_bits
        )
    ):
        gluon = None
    if gluon is not None and not key_fp8:
        table = gluon.key_table(centroids)
        if table is None:
            gluon = None
    held = scratch_splits(mid_o_buf, B, Hq, D)
    if gluon is not None and num_splits is None:
        # Split counts beyond the backend's 32 per row come from the spare
        # rows of its scratch: 1 x 32K on Qwen3-4B fills the SMs at 128.
        warps = D // gluon.SLICE
        cap = min(GLUON_MAX_SPLIT_DIMS // D, held or GLUON_MAX_SPLIT_DIMS)
        if B * Hk * cap * warps < GLUON_MIN_WARPS_PER_SM * _num_sms(device):
            gluon = None
            table = None
        else:
            resident = gluon.resident_warps()
            num_splits = gluon_num_splits(B, Hk, warps, _num_sms(device), cap, resident)
    if num_splits is None:
        cap = min(max_num_kv_splits, held) if held else max_num_kv_splits
        num_splits = num_kv_splits(B, Hk, cap, _num_sms(device))
    if num_splits > 1:
        if held >= num_splits:
            mid = scratch_view(mid_o_buf, B, Hq, num_splits, D)
        else:
            mid = torch.empty(
                B, Hq, num_splits, D + 1, dtype=torch.float32, device=device
            )
    else:
        mid = out  # not read when there is one split

    if gluon is not None:
        gluon.stage1(
            q_in,
            kv_cache,
            block_table,
            seq_lens,
            table,
            out,
            mid,
            scale * _LOG2E,
            num_splits,
            min_split_tokens,
            group,
            key_packed_size,
            mse_bits,
            key_fp8,
            norm_correction,
            value_quant_bits,
            key_tails=False if key_fp8 else gluon.key_tails(centroids),
            runner=_gluon_runner,
        )
        return _merge(mid, out, num_splits, D)

    block_n, num_warps, key_chunk, maxnreg = tuple(
        geometry or default_geometry(D, key_fp8)
    )
    # The register cap is a compile option of the CUDA backend only.
    launch_opts = {"maxnreg": maxnreg} if maxnreg and device.type == "cuda" else {}
    word16 = words_aligned(kv_cache)
    unit = 2 if word16 else 1
    mse_bytes = 0 if key_fp8 else D * mse_bits // 8
    _tq_decode_split_stage1[(Hk, B, num_splits)](
        q_in,
        kv_cache,
        kv_cache.view(torch.int16) if word16 else kv_cache,
        block_table,
        seq_lens,
        centroids,
        out,
        mid,
        scale * _LOG2E,
        num_splits,
        *stage1_strides(q_in, kv_cache, unit, block_table, out, mid),
        SPLIT=num_splits > 1,
        MIN_TOKENS=min_split_tokens,
        HEAD_DIM=D,
        PAGE=kv_cache.shape[1],
        GROUP=group,
        BLOCK_N=block_n,
        KEY_FP8=bool(key_fp8),
        KEY_CHUNK=max(min(D, key_chunk), D // 8),
        MSE_BITS=0 if key_fp8 else mse_bits,
        MSE_WORDS=mse_bytes // 2,
        KPS_WORDS=key_packed_size // 2,
        VQB=value_quant_bits,
        VAL_WORDS=D * value_quant_bits // 16,
        NORM_CORRECTION=bool(norm_correction) and not key_fp8,
        FP8_E4B15=_use_fp8_e4b15(device) if key_fp8 else 0,
        WORD16=word16,
        num_warps=num_warps,
        num_stages=1,
        **launch_opts,
    )
    return _merge(mid, out, num_splits, D)


def stage1_strides(
    q_in: torch.Tensor,
    kv_cache: torch.Tensor,
    unit: int,
    block_table: torch.Tensor,
    out: torch.Tensor,
    mid: torch.Tensor,
) -> tuple[int, ...]:
    """The strides both stage 1 kernels take, in their order: query, cache (in
    load units of ``unit`` bytes), block table, output, scratch (``mid`` is
    ``out`` when there is one split; its split stride is then unused)."""
    st = kv_cache.stride()
    return (
        q_in.stride(0),
        q_in.stride(1),
        st[0] // unit,
        st[1] // unit,
        st[2] // unit,
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        mid.stride(0),
        mid.stride(1),
        mid.stride(2) if mid.dim() == 4 else 0,
    )


def _merge(mid: torch.Tensor, out: torch.Tensor, num_splits: int, D: int):
    if num_splits > 1:
        B, Hq = out.shape[0], out.shape[1]
        pdl = programmatic_launch(out.device)
        _tq_decode_split_merge[(Hq, B)](
            mid,
            out,
            num_splits,
            mid.stride(0),
            mid.stride(1),
            mid.stride(2),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=D,
            BLOCK_S=MERGE_BLOCK_SPLITS,
            PDL=pdl,
            num_warps=4 if D <= 256 else 8,
            **({"launch_pdl": True} if pdl else {}),
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
    max_num_kv_splits: int = 32,
    output_buf: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``triton_turboquant_decode_attention``'s call, served here.

    None when the kernel is switched off (``HYBRIDKV_TQ_DECODE=legacy``) or
    does not serve the layout; the caller then runs 0.20.2's kernel. The
    backend's decode rows (plain and speculative verify rows) and its short
    continuation chunks all arrive through that entry point. Its
    ``output_buf`` is written in place where ``decode_attention`` can.
    """
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
        hadamard_query=not key_fp8 and is_backend_hadamard(PiT),
    )
