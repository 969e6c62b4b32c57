# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant decode attention: which stage 1 runs, split into how many
parts, with which scratch.

Decode attention over a packed TurboQuant cache runs in two launches (three
with the query rotation of MSE keys): a stage 1 in which one program owns a
(context split, KV head, row) and reads each packed slot once for all query
heads of its group, and a merge of the splits by log-sum-exp (at one split
stage 1 writes the output; values stored rotated are then rotated back by a
pass of their own instead of the merge). Two stage 1 kernels write the same
partial results:

- ``gluon_turboquant_decode``: Gluon, NVIDIA sm_89+, where it serves the
  layout (head_dim 128/256/512, pages of whole 16-token tiles, symmetric
  centroids) and the split count fills the GPU;
- ``triton_turboquant_decode_splitkv``: Triton, everywhere else it serves
  (head_dim 64-512, up to 8 query heads per KV head); it also holds the merge.

0.20.2's entry point ``triton_turboquant_decode_attention`` calls
``maybe_decode_attention`` first and runs its own kernel when that returns
None. ``VLLM_TURBOQUANT_DECODE`` (``vllm/envs.py``) picks the stage 1 for
A/B runs: ``gluon`` (the default) as above, ``triton`` the Triton stage 1
only, ``legacy`` 0.20.2's kernel.

The split count depends on the batch shape and the device only, never on
sequence lengths, so a CUDA graph captured for a batch size replays for any
lengths; it is a launch argument of both stages, so every batch size shares
one compiled kernel.
"""

import functools
from fractions import Fraction

import torch

import vllm.envs as envs
from vllm.triton_utils.compiled_launch import LaunchPlan, recorded_launches
from vllm.v1.attention.ops import triton_turboquant_decode_splitkv as triton_stage1
from vllm.v1.attention.ops.triton_turboquant_decode_splitkv import supports
from vllm.v1.attention.ops.triton_turboquant_rotate_query import (
    rotate_query,
    rotate_query_with_offset,
)
from vllm.v1.attention.ops.turboquant_device import num_sms, nvidia_capability
from vllm.v1.attention.ops.turboquant_hadamard import is_backend_hadamard
from vllm.v1.attention.ops.turboquant_pair_code import is_pair_codebook
from vllm.v1.attention.ops.turboquant_slot_layout import (
    check_key_offset,
    slot_layout,
    words_aligned,
)

# Largest split count x head_dim of a Gluon decode: past it the merge's reads
# of the partials cost more than the splits gain. On an H100, 1 x 32K
# Qwen3-4B took 51 us at 128 splits and 128 us at 256.
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
# wave model chose (k8v4 / 4bit_nc, H100; benchmarks/NOTES.md).
# Below it rows can be long and the idle part of the last wave large: 160 x
# 8192 (1.2 waves) took 1,189 us at one split and 879 at 9.
GLUON_ONE_SPLIT_WAVES = Fraction(3, 2)
# Below this many warps per SM at the largest split count, the Triton stage 1
# (its 4-warp programs fill the SMs with fewer splits). 1 x 32K Qwen3-4B on an
# H100: 32 splits (1.9 warps/SM) 86 / 144 us (k8v4 / 4bit_nc) vs Triton's
# 122 / 144; 16 splits (1 warp/SM) 148 / 243 us.
GLUON_MIN_WARPS_PER_SM = 1.5

# Programs per SM the Triton stage 1's split count aims for when the batch is
# small.
PROGRAMS_PER_SM = 8
# A split covers at least this many tokens (applied on the device).
MIN_SPLIT_TOKENS = 256

_LOG2E = 1.4426950408889634


@functools.cache
def gluon_stage1(device: torch.device):
    """``gluon_turboquant_decode`` where it can run on ``device``, else None.

    It needs Gluon (Triton >= 3.5) and an NVIDIA sm_89+ GPU (e4m3
    conversions, mma_v2, inline PTX).
    """
    if nvidia_capability(device) < (8, 9):
        return None
    try:
        from vllm.v1.attention.ops import gluon_turboquant_decode
    except ImportError:
        return None
    return gluon_turboquant_decode


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


def decode_attention(
    query: torch.Tensor,  # [B, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, Hk, slot] uint8
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    PiT: torch.Tensor | None,  # [D, D] fp32 (q_rot = q @ PiT); None for FP8 keys
    centroids: torch.Tensor,  # [2**mse_bits] fp32, or a pair codebook [64, 2]
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
    stage: str | None = None,
    key_scale: torch.Tensor | None = None,
    key_offset: torch.Tensor | None = None,
    value_rotation: bool = False,
    raw_window=None,
) -> torch.Tensor:
    """Decode attention over a packed TurboQuant cache: [B, Hq, D].

    ``hadamard_query``: ``PiT`` is the backend's scaled Hadamard matrix
    (``is_backend_hadamard``), so the query is rotated by ``rotate_query``
    instead of an fp32 GEMM. ``key_scale`` ([D] fp32, MSE keys only): the
    keys were stored divided by it, so the query is multiplied by it before
    the rotation and every score is the one of the unscaled keys.
    ``key_offset`` ([Hk, D] fp32, MSE keys only): the keys were stored
    shifted by it, those stored unshifted marked (``turboquant_store``), so
    ``q . key_offset`` is computed beside the rotation and subtracted from
    the marked keys' scores: every score then carries the same shift.
    ``value_rotation`` (MSE keys only): the values were stored rotated by
    ``PiT``, the backend's scaled Hadamard matrix (``turboquant_store``), so
    the output is rotated back: by the merge where the decode splits, by
    ``rotate_output_back`` at one split.
    ``raw_window`` (``triton_turboquant_raw_window.RawWindow``): the row's
    last ``size`` positions are read from the layer's model-dtype twin
    instead. Its ``rotate_and_attend`` (the query rotated in the same launch)
    or ``attend`` writes the window as one more split, weighed in by the
    merge (at one split by stage 1), and returns the packed splits' lengths,
    ``size`` tokens shorter.

    The output has the query's dtype unless ``out_dtype`` says otherwise.
    ``mid_o_buf`` ([>=B, >=Hq, S, D + 1] fp32, preallocated for CUDA graphs)
    caps the Triton stage 1's split count at S (and ``max_num_kv_splits``);
    the Gluon stage 1 also splits into the rows past B of a contiguous one
    (``scratch_splits``). Without it, scratch is allocated per call.
    ``output_buf`` is used when it has the output dtype. ``stage`` (``gluon``
    or ``triton``; default ``VLLM_TURBOQUANT_DECODE``), ``num_splits``,
    ``geometry`` (the Triton stage 1's, see ``default_geometry``; it implies
    that stage) and ``min_split_tokens`` override the defaults (A/B runs).

    A call whose launches all went out directly (``compiled_launch``) and
    whose every tensor is an argument, the Gluon key table or written by one
    of them leaves a ``LaunchPlan`` under ``_plan_key`` of its arguments:
    everything a choice, a check or a compiled kernel reads, with the
    addresses of the tensors that stay put (cache, scratch, rotation,
    centroids, key scale and offset). The next call with that key sends the
    plan's launches with its own query, block table, sequence lengths and
    output (none of which it reads but for their layout), skipping every
    check and choice: the same launches, for ~11 of the decode's ~38 µs of
    Python on a CPU host (benchmarks/NOTES.md). Raw windows are not planned.
    """
    stage = stage or envs.VLLM_TURBOQUANT_DECODE
    settings = (
        scale,
        mse_bits,
        key_packed_size,
        value_quant_bits,
        key_fp8,
        norm_correction,
        max_num_kv_splits,
        num_splits,
        geometry,
        out_dtype,
        min_split_tokens,
        hadamard_query,
        stage,
        value_rotation,
    )
    key = None
    if raw_window is None:
        key = _plan_key(
            (query, block_table, seq_lens, output_buf),
            (kv_cache, mid_o_buf, PiT, centroids, key_scale, key_offset),
            settings,
        )
        hit = _plans.get(key)
        if hit is not None:
            tensors = hit[0].launch(query, block_table, seq_lens, output_buf)
            if tensors is not None:
                out = tensors[hit[1]]
                if out is output_buf:
                    B, Hq, D = query.shape
                    return out[:B, :Hq, :D]
                return out
    with recorded_launches() as records:
        out, fresh, table = _decode(
            query, kv_cache, block_table, seq_lens, PiT, centroids, scale,
            mse_bits, key_packed_size, value_quant_bits, key_fp8, norm_correction,
            mid_o_buf, output_buf, max_num_kv_splits, num_splits, geometry,
            out_dtype, min_split_tokens, hadamard_query, stage, key_scale,
            key_offset, value_rotation, raw_window,
        )  # fmt: skip
    if (
        key is not None
        and MAX_PLANS
        and not (query.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        fixed = (kv_cache, mid_o_buf, PiT, centroids, key_scale, key_offset)
        _remember(
            key, records, query, block_table, seq_lens, output_buf, out, fresh, fixed,
            table,
        )  # fmt: skip
    return out


# Plans of decode calls seen before (decode_attention), by _plan_key: a few
# tuples each, one per layer and batch shape an engine runs outside full
# CUDA graphs. Past this many the map starts again.
MAX_PLANS = 16384
_plans: dict[tuple, tuple[LaunchPlan, int]] = {}


def _layout(t: torch.Tensor | None, address_bits: int = -1):
    """A tensor as a plan key sees it: shape, strides, dtype and address
    (of which only the low 4 bits, the alignment a compiled kernel may
    depend on, for ``address_bits=15``)."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.data_ptr() & address_bits


def _plan_key(bound: tuple, fixed: tuple, settings: tuple) -> tuple:
    """What a decode's launches depend on: the layouts of the tensors bound
    per call (their alignment, not their addresses), the layouts and
    addresses of those that stay put, and every other argument."""
    return (
        *[_layout(t, 15) for t in bound],
        *[_layout(t) for t in fixed],
        settings,
    )


def _remember(
    key, records, query, block_table, seq_lens, output_buf, out, fresh, fixed, table
) -> None:
    """Keep the plan of a call that made one, under ``key``."""
    bound = (query, block_table, seq_lens, output_buf)
    if any(out is t for t in fresh):
        result = len(bound) + next(i for i, t in enumerate(fresh) if out is t)
    elif output_buf is not None and out.data_ptr() == output_buf.data_ptr():
        result = 3
    else:
        return
    plan = LaunchPlan.build(records, bound, tuple(fresh), fixed, (table,))
    if plan is None:
        return
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[key] = (plan, result)


def _decode(
    query,
    kv_cache,
    block_table,
    seq_lens,
    PiT,
    centroids,
    scale,
    mse_bits,
    key_packed_size,
    value_quant_bits,
    key_fp8,
    norm_correction,
    mid_o_buf,
    output_buf,
    max_num_kv_splits,
    num_splits,
    geometry,
    out_dtype,
    min_split_tokens,
    hadamard_query,
    stage,
    key_scale,
    key_offset,
    value_rotation,
    raw_window,
):
    """``decode_attention``'s checks, choices and launches. Returns the
    output, the tensors it allocated for its launches to write (their
    outputs, the rotated query and ``q . key_offset``, a scratch) and the
    Gluon key table it read, if any."""
    fresh = []
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
            f"split-KV TurboQuant decode serves head_dim "
            f"{sorted(triton_stage1.GEOMETRY)} and up to {triton_stage1.MAX_GROUP} "
            f"query heads per KV head, got head_dim {D}, {Hq} query / {Hk} KV "
            "heads; call supports() first and use "
            "triton_turboquant_decode_attention otherwise"
        )
    layout = slot_layout(D, key_fp8, mse_bits, value_quant_bits)
    if key_packed_size != layout.key_bytes:
        raise ValueError(
            f"key_packed_size {key_packed_size} is not the key field of a "
            f"head_dim-{D} slot with {'FP8' if key_fp8 else f'{mse_bits}-bit MSE'} "
            f"keys ({layout.key_bytes} bytes); pass the layer's "
            "TurboQuantConfig.key_packed_size"
        )

    if key_fp8 and (key_scale is not None or key_offset is not None or value_rotation):
        raise ValueError(
            "key_scale, key_offset and value_rotation apply to MSE keys; FP8 "
            "keys and their values are stored as they are"
        )
    if key_offset is not None and not key_fp8:
        check_key_offset(key_offset, Hk, D)

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
        fresh.append(out)

    # The Gluon stage 1 where it serves this layout and, for MSE keys, its
    # key table exists (none is built during a CUDA graph capture).
    gluon = None
    if stage == "gluon" and geometry is None:
        gluon = gluon_stage1(device)
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
    if raw_window is not None:
        held = max(held - 1, 0)  # one slot of the scratch is the window's
    sms = num_sms(device)
    if gluon is not None and num_splits is None:
        # Split counts beyond the backend's 32 per row come from the spare
        # rows of its scratch: 1 x 32K on Qwen3-4B fills the SMs at 128.
        warps = D // gluon.SLICE
        cap = min(GLUON_MAX_SPLIT_DIMS // D, held or GLUON_MAX_SPLIT_DIMS)
        if B * Hk * cap * warps < GLUON_MIN_WARPS_PER_SM * sms:
            gluon = None
            table = None
        else:
            resident = gluon.resident_warps()
            num_splits = gluon_num_splits(B, Hk, warps, sms, cap, resident)
    if num_splits is None:
        cap = min(max_num_kv_splits, held) if held else max_num_kv_splits
        num_splits = num_kv_splits(B, Hk, cap, sms)
    # A window's partial result is split ``num_splits`` of the scratch: the
    # merge weighs it in, or at one split stage 1 itself (forcing two splits
    # and a merge made 512 x 640 1.17-1.23x slower, benchmarks/NOTES.md).
    slots = num_splits + (raw_window is not None)
    if slots > 1:
        if held >= num_splits:
            mid = scratch_view(mid_o_buf, B, Hq, slots, D)
        else:
            mid = torch.empty(B, Hq, slots, D + 1, dtype=torch.float32, device=device)
            fresh.append(mid)
    else:
        mid = out  # not read: stage 1 writes the output

    # The query stage 1 reads; with a raw window, the window's partial result
    # in the split after stage 1's and the packed splits' lengths, from the
    # rotation's launch where the query is rotated.
    if raw_window is not None and hadamard_query and not key_fp8:
        q_in, qmu, seq_lens = raw_window.rotate_and_attend(
            query, PiT, key_scale, key_offset, seq_lens, mid, num_splits, scale
        )
    else:
        qmu = None
        if key_fp8:
            q_in = query if query.stride(-1) == 1 else query.contiguous()
        elif hadamard_query:
            if key_offset is None:
                q_in = rotate_query(query, PiT, key_scale)
                fresh.append(q_in)
            else:
                q_in, qmu = rotate_query_with_offset(query, PiT, key_scale, key_offset)
                fresh += (q_in, qmu)
        else:
            q_f = query.float() if key_scale is None else query.float() * key_scale
            q_in = q_f @ PiT
            if key_offset is not None:
                qmu = (query.float().view(B, Hk, group, D) * key_offset[:, None]).sum(
                    -1
                )
                qmu = qmu.view(B, Hq)
        if raw_window is not None:
            seq_lens = raw_window.attend(q_in, seq_lens, mid, num_splits, scale)

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
            qmu=qmu,
            window=raw_window is not None,
            key_pairs=not key_fp8 and is_pair_codebook(centroids),
        )
    else:
        triton_stage1.stage1(
            q_in,
            kv_cache,
            block_table,
            seq_lens,
            centroids,
            out,
            mid,
            scale * _LOG2E,
            num_splits,
            min_split_tokens,
            group,
            layout,
            norm_correction,
            geometry,
            qmu=qmu,
            window=raw_window is not None,
        )
    if num_splits > 1:
        out = triton_stage1.merge(mid, out, slots, PiT if value_rotation else None)
    elif value_rotation:
        out = triton_stage1.rotate_output_back(out, PiT)
    return out, fresh, table


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
    key_scale: torch.Tensor | None = None,
    key_offset: torch.Tensor | None = None,
    value_rotation: bool = False,
    raw_window=None,
) -> torch.Tensor | None:
    """``triton_turboquant_decode_attention``'s call, served here.

    None when ``VLLM_TURBOQUANT_DECODE=legacy`` or the kernels do not serve
    the layout; the caller then runs 0.20.2's kernel. The backend's decode
    rows (plain and speculative verify rows) and its short continuation
    chunks all arrive through that entry point. Its ``output_buf`` is
    written in place where ``decode_attention`` can. ``key_scale``: the
    layer's per-channel key scale (``turboquant.key_scale``) when its keys
    are stored divided by it; a caller that runs 0.20.2's kernel instead
    multiplies its query by it first. ``key_offset``: the layer's key offset
    (``turboquant.key_offset``); 0.20.2's kernel cannot read the keys stored
    with one, so a layout it would take is refused; the same for
    ``value_rotation`` (values stored rotated, ``turboquant.value_rotation``),
    ``raw_window`` (``decode_attention``'s) and keys coded by pairs
    (``centroids`` a pair codebook, ``turboquant_pair_code``).
    """
    B, Hq, D = query.shape
    stage = envs.VLLM_TURBOQUANT_DECODE
    if stage == "legacy" or not supports(
        D, Hq, kv_cache.shape[2], mse_bits, value_quant_bits, key_fp8
    ):
        pairs = not key_fp8 and is_pair_codebook(centroids)
        if key_offset is not None or value_rotation or raw_window is not None or pairs:
            if pairs:
                what = "keys are coded by pairs of coordinates"
                other = "serve it with turboquant_3bit_nc"
            elif raw_window is not None:
                what = "recent tokens are read from a raw window"
                other = "drop the recent:W entry from --kv-cache-dtype-skip-layers"
            elif key_offset is not None:
                what = "keys are stored with a key offset"
                other = "serve it with FP8 keys (turboquant_k8v4)"
            else:
                what = "values are stored rotated"
                other = "serve it with FP8 keys (turboquant_k8v4)"
            why = "is switched off" if stage == "legacy" else "does not serve it"
            raise ValueError(
                f"this layer's {what}, which only the split-KV decode reads; it "
                f"{why} here (VLLM_TURBOQUANT_DECODE={stage}, head_dim {D}, {Hq} "
                f"query / {kv_cache.shape[2]} KV heads). Unset "
                f"VLLM_TURBOQUANT_DECODE=legacy before the engine starts, or {other}"
            )
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
        stage=stage,
        key_scale=key_scale,
        key_offset=key_offset,
        value_rotation=value_rotation,
        raw_window=raw_window,
    )
