# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant prefill chunks: one attention call per batch, no host syncs.

0.20.2's TurboQuant backend runs FlashAttention once over a prefill batch only
when no request in it has cached context. As soon as one request continues a
prompt (a chunked prefill's later chunk, a prefix-cache hit), every prefill
request of the step is computed on its own: a FlashAttention call per first
chunk, a decode-kernel call or a dequantize + GEMM + FlashAttention per
continuation, after ``.tolist()`` reads of the batch's lengths, and in mixed
decode/prefill batches one more ``.tolist()`` per layer. On a busy server
nearly every step is such a step: TTFT and the decode rows sharing the step
pay for the host round trips and launches, layer after layer.

Here the builder plans the prefill part once per step from the host copies
of the lengths the model runner already has. Each group of requests then
takes one FlashAttention call over packed K/V: a continuation's cached tokens
read back from the TurboQuant cache into the model dtype (``unpack_cached``,
one launch; 0.20.2's dequantization and a pass per step where it cannot),
followed by the chunk's own raw K/V, as 0.20.2's long continuation path
does per request. Groups keep the packed K/V near the size
of the scheduler's token budget, which the startup memory profile covers; a
single request longer than that is a group of its own.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.triton_utils.compiled_launch import launcher
from vllm.utils.math_utils import next_power_of_2
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.ops.triton_turboquant_decode import (
    _tq_full_dequant_kv,
    _use_fp8_e4b15,
)
from vllm.v1.attention.ops.triton_turboquant_rotate_query import rotate_query
from vllm.v1.attention.ops.triton_turboquant_unpack_cached import (
    BLOCK_N,
    unpack_cached,
)
from vllm.v1.attention.ops.turboquant_hadamard import (
    is_backend_hadamard,
    rotates_in_registers,
)
from vllm.v1.attention.ops.turboquant_pair_code import is_pair_codebook
from vllm.v1.attention.ops.turboquant_prefill import sdpa_prefill
from vllm.v1.attention.ops.turboquant_slot_layout import config_slot_layout


@dataclass(frozen=True)
class Continuation:
    """A request of a group whose first ``cached`` tokens are in the cache."""

    cached: int
    row: int  # its first row in the group's packed K/V
    block_row: torch.Tensor  # its block table row (aligned_block_row)


@dataclass
class PackedKV:
    """Where a group's K/V come from when a request has cached context."""

    continuations: tuple[Continuation, ...]
    tokens: int  # rows of the packed K/V: the group's summed seq_lens
    cu_seqlens_k: torch.Tensor  # [requests + 1] int32
    chunk_rows: torch.Tensor  # [group tokens] int64: packed row of each chunk token
    chunk_tiles: torch.Tensor  # [group tokens] int64: chunk_rows // BLOCK_N


@dataclass
class PrefillGroup:
    """Consecutive prefill requests attended to by one varlen call.

    Token offsets count from the batch's first prefill token.
    Without ``packed`` no request has cached context, and the chunk's own K/V
    are all the keys.
    """

    tok_start: int
    tok_end: int
    max_query_len: int
    max_seq_len: int
    cu_seqlens_q: torch.Tensor  # [requests + 1] int32, from 0
    packed: PackedKV | None = None


@dataclass
class PrefillBatch:
    groups: tuple[PrefillGroup, ...]
    max_seq_len: int  # over the prefill requests; exact
    # Two or more continuations may hold the same cached blocks (prefix-cache
    # hits on one prefix): the packed rows of every group are then one
    # buffer, and a tile read back for one is not read again for the next.
    shared_reads: bool = False
    packed_rows: int = 0  # the most packed rows of a group


def aligned_block_row(block_table: torch.Tensor, row: int) -> torch.Tensor:
    """A copy of one block table row, [1, W rounded up to 4] int32.

    Triton specializes a pointer argument on 16-byte alignment, and a row
    sliced out of the block table is aligned or not depending on its index:
    the dequantization kernel would compile a second variant at the first
    unaligned row, while serving. A fresh allocation is always aligned.
    """
    width = block_table.shape[1]
    out = block_table.new_zeros(1, -(-width // 4) * 4)
    out[:, :width] = block_table[row : row + 1]
    return out


def _host_seq_lens(cam: CommonAttentionMetadata) -> torch.Tensor:
    # The model runner hands builders a host copy of seq_lens whose upper
    # bound is exact for prefill rows, the only ones read here. A caller
    # that passed none pays for a copy.
    host = cam.seq_lens_cpu_upper_bound
    if host is None:
        host = cam.seq_lens.cpu()
    return host[: cam.num_reqs]


def plan_prefill_batch(
    cam: CommonAttentionMetadata,
    num_decodes: int,
    num_decode_tokens: int,
    group_tokens: int,
) -> PrefillBatch | None:
    """The prefill part of a batch (requests past ``num_decodes``), grouped so
    that each group's packed K/V holds at most ``group_tokens`` tokens (or one
    request). None when the batch has no prefill request."""
    num_reqs = cam.num_reqs
    if num_decodes >= num_reqs:
        return None
    if group_tokens <= 0:
        raise ValueError(
            f"TurboQuant prefill groups need a positive token budget, got "
            f"{group_tokens}; pass the scheduler's max_num_batched_tokens"
        )
    qsl = cam.query_start_loc_cpu[: num_reqs + 1].tolist()
    seq_lens = _host_seq_lens(cam).tolist()
    base_tok = qsl[num_decodes]
    if base_tok != num_decode_tokens:
        raise ValueError(
            f"TurboQuant prefill rows must follow the {num_decode_tokens} decode "
            f"tokens, but the first prefill request starts at token {base_tok}; "
            "the batch was not reordered decodes-first"
        )

    # Consecutive requests while their K/V fit the budget.
    bounds: list[tuple[int, int]] = []
    start, tokens = num_decodes, 0
    for i in range(num_decodes, num_reqs):
        if i > start and tokens + seq_lens[i] > group_tokens:
            bounds.append((start, i))
            start, tokens = i, 0
        tokens += seq_lens[i]
    bounds.append((start, num_reqs))

    groups = []
    for a, b in bounds:
        q_lens = [qsl[i + 1] - qsl[i] for i in range(a, b)]
        lens = seq_lens[a:b]
        cu_q = cam.query_start_loc[a : b + 1] - qsl[a]
        group = PrefillGroup(
            tok_start=qsl[a] - base_tok,
            tok_end=qsl[b] - base_tok,
            max_query_len=max(q_lens),
            max_seq_len=max(lens),
            cu_seqlens_q=cu_q,
        )
        if any(s > q for s, q in zip(lens, q_lens)):
            continuations, row = [], 0
            for i, (s, q) in enumerate(zip(lens, q_lens)):
                if s > q:
                    table_row = aligned_block_row(cam.block_table_tensor, a + i)
                    continuations.append(Continuation(s - q, row, table_row))
                row += s
            # Device-side: the packed rows of each chunk token are its query
            # offset shifted by its request's (cu_k - cu_q) at the request end.
            seq = cam.seq_lens[a:b].to(torch.int32)
            cu_k = torch.nn.functional.pad(seq.cumsum(0, dtype=torch.int32), (1, 0))
            shift = (cu_k[1:] - cu_q[1:]).to(torch.int64)
            n_tok = group.tok_end - group.tok_start
            q_len_dev = cu_q[1:] - cu_q[:-1]
            chunk_rows = torch.arange(n_tok, device=cu_q.device)
            chunk_rows += torch.repeat_interleave(shift, q_len_dev, output_size=n_tok)
            group.packed = PackedKV(
                continuations=tuple(continuations),
                tokens=row,
                cu_seqlens_k=cu_k,
                chunk_rows=chunk_rows,
                chunk_tiles=chunk_rows // BLOCK_N,
            )
        groups.append(group)
    packed = [g.packed for g in groups if g.packed is not None]
    return PrefillBatch(
        groups=tuple(groups),
        max_seq_len=max(seq_lens[num_decodes:num_reqs]),
        shared_reads=sum(len(p.continuations) for p in packed) > 1,
        packed_rows=max((p.tokens for p in packed), default=0),
    )


def _dequantize_cached(
    impl,
    kv_cache: torch.Tensor,  # [num_blocks, block_size, Hk, slot] uint8
    block_row: torch.Tensor,  # [1, max_blocks]
    cached: int,
    Pi: torch.Tensor,
    centroids: torch.Tensor,
    dtype: torch.dtype,
    key_scale: torch.Tensor | None = None,
    key_offset: torch.Tensor | None = None,
    value_rotation: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a request's first ``cached`` tokens: [cached, Hk, D] each.

    0.20.2's dequantization kernel (fp16 out), written token-major; MSE keys
    are rotated back to the model's space as 0.20.2 does (``k @ Pi``), then
    multiplied by the layer's ``key_scale`` when they were stored divided
    by it, and shifted back by its ``key_offset`` (``unshift_keys``). Values
    stored rotated (``value_rotation``) are rotated back the same way.
    """
    Hk, D = kv_cache.shape[2], impl.head_size
    cfg = impl.tq_config
    if not cfg.key_fp8 and is_pair_codebook(centroids):
        raise ValueError(
            "this layer's keys are coded by pairs of coordinates, which 0.20.2's "
            "dequantization reads as levels; unpack_cached reads them back (a "
            "power-of-two head_dim and the backend's Hadamard rotation)"
        )
    layout = config_slot_layout(cfg)
    k16 = torch.empty(cached, Hk, D, dtype=torch.float16, device=kv_cache.device)
    v16 = torch.empty_like(k16)
    launcher(_tq_full_dequant_kv)[(cached, Hk)](
        kv_cache,
        block_row,
        centroids,
        k16,
        v16,
        0,
        k16.stride(1),
        k16.stride(0),
        0,
        v16.stride(1),
        v16.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_row.stride(0),
        HEAD_DIM=D,
        BLOCK_SIZE=kv_cache.shape[1],
        NUM_KV_HEADS=Hk,
        MSE_BYTES=layout.key_index_bytes,
        KPS=layout.key_bytes,
        VQB=layout.value_bits,
        VAL_DATA_BYTES=layout.value_index_bytes,
        MSE_BITS=layout.key_bits,
        KEY_FP8=1 if layout.key_fp8 else 0,
        BLOCK_D=next_power_of_2(D),
        NORM_CORRECTION=1 if cfg.norm_correction else 0,
        FP8_E4B15=_use_fp8_e4b15(kv_cache.device.index or 0),
        num_warps=4,
    )
    if cfg.key_fp8:
        keys = k16
    else:
        if is_backend_hadamard(Pi):
            # The backend's Pi is its symmetric scaled Hadamard matrix, so
            # k @ Pi is the in-register transform of the query rotation.
            keys = rotate_query(k16, Pi)
        else:
            keys = (k16.reshape(-1, D).float() @ Pi).view_as(k16)
        if key_scale is not None:
            keys = keys * key_scale
        if key_offset is not None:
            keys = unshift_keys(
                keys, kv_cache, block_row, layout.key_index_bytes, key_offset
            )
        keys = keys.to(torch.float16)
    values = rotate_query(v16, Pi) if value_rotation else v16
    return keys.to(dtype), values.to(dtype)


def _reads_in_one_launch(impl, Pi: torch.Tensor) -> bool:
    """Whether ``unpack_cached`` reads this layer's cache back: ``Pi`` is
    the backend's Hadamard matrix or the keys are FP8."""
    return rotates_in_registers(impl.head_size) and (
        impl.tq_config.key_fp8 or is_backend_hadamard(Pi)
    )


def _keeps_held_tiles(impl, Pi: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether a step's read-backs can share tiles: one launch reads them
    back and each of its tiles lies in one page of the cache."""
    return kv_cache.shape[1] % BLOCK_N == 0 and _reads_in_one_launch(impl, Pi)


def cached_kv_into(
    impl,
    kv_cache: torch.Tensor,
    block_row: torch.Tensor,  # [1, max_blocks]
    cached: int,
    Pi: torch.Tensor,
    centroids: torch.Tensor,
    k_out: torch.Tensor,  # [cached, Hk, D] rows of the packed K/V
    v_out: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    key_offset: torch.Tensor | None = None,
    value_rotation: bool = False,
    held: torch.Tensor | None = None,
    row0: int = 0,
) -> None:
    """A request's first ``cached`` tokens' K and V written into ``k_out``
    and ``v_out``: in one launch (``unpack_cached``, which takes ``held``
    and ``row0``) where ``_reads_in_one_launch``, else through
    ``_dequantize_cached`` (``held`` must then be None)."""
    cfg = impl.tq_config
    if _reads_in_one_launch(impl, Pi):
        unpack_cached(
            kv_cache, block_row, cached, centroids, Pi, k_out, v_out,
            cfg.key_mse_bits, cfg.effective_value_quant_bits, cfg.key_fp8,
            cfg.norm_correction, key_scale, key_offset, value_rotation,
            held, row0,
        )  # fmt: skip
        return
    if held is not None:
        raise ValueError(
            "held tiles are kept by the one-launch read-back only; this layer "
            "reads its cache back through _dequantize_cached: pass held=None"
        )
    k, v = _dequantize_cached(
        impl, kv_cache, block_row, cached, Pi, centroids, k_out.dtype,
        key_scale, key_offset, value_rotation,
    )  # fmt: skip
    k_out[:cached] = k
    v_out[:cached] = v


def unshift_keys(
    keys: torch.Tensor,  # [cached, Hk, D] fp32, dequantized and unscaled
    kv_cache: torch.Tensor,
    block_row: torch.Tensor,  # [1, max_blocks]
    norm_offset: int,  # byte offset of the fp16 key norm in a slot
    key_offset: torch.Tensor,  # [Hk, D] fp32
) -> torch.Tensor:
    """The keys of a layer stored with a key offset: ``k + mu`` where the
    store shifted the key, ``-k`` where it kept it and set the norm's sign
    bit (0.20.2's dequantization multiplies by the signed norm)."""
    cached, page = keys.shape[0], kv_cache.shape[1]
    pos = torch.arange(cached, device=keys.device)
    blocks = block_row[0, pos // page].long()
    high = kv_cache[blocks, pos % page, :, norm_offset + 1]  # [cached, Hk]
    marked = (high >= 0x80)[..., None]
    return torch.where(marked, -keys, keys + key_offset)


def warm_continuation_kernels(
    impl,
    layer,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    Pi: torch.Tensor,
    centroids: torch.Tensor,
    dtype: torch.dtype,
    key_scale: torch.Tensor | None = None,
    key_offset: torch.Tensor | None = None,
    value_rotation: bool = False,
) -> None:
    """Compile the continuation path's kernels at a layer's first forward.

    The engine's warm-up runs (before CUDA graph capture) only see decode
    and first-chunk batches, so without this the first continuation a server
    meets compiles the dequantization while every request of the step waits.
    One token of block 0 (vLLM's reserved null block) is read back, with the
    layer's key scale, key offset and value rotation (``prefill_attention``'s)
    and the argument shapes, strides and alignments of serving.
    """
    if getattr(layer, "_tq_continuation_warm", False) or kv_cache.numel() == 0:
        return
    # Kernels compile for GPUs; a cache elsewhere has nothing to warm.
    if not kv_cache.is_cuda:
        return
    if kv_cache.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    row = torch.zeros_like(block_table[:1])
    out = torch.empty(
        2, 1, kv_cache.shape[2], impl.head_size, dtype=dtype, device=kv_cache.device
    )
    row = aligned_block_row(row, 0)
    args = (key_scale, key_offset, value_rotation)
    cached_kv_into(impl, kv_cache, row, 1, Pi, centroids, out[0], out[1], *args)
    if _keeps_held_tiles(impl, Pi, kv_cache):
        # Steps with several continuations keep a map of the tiles read back;
        # the variants for rows on and off the tile grid.
        held = torch.full(
            (3, kv_cache.shape[2]), -1, dtype=torch.int32, device=kv_cache.device
        )
        for row0 in (0, 1):
            cached_kv_into(
                impl, kv_cache, row, 1, Pi, centroids, out[0], out[1], *args,
                held, row0,
            )  # fmt: skip
    layer._tq_continuation_warm = True


def prefill_attention(
    impl,
    query: torch.Tensor,  # [prefill tokens, Hq, D]
    key: torch.Tensor,  # [prefill tokens, Hk, D]
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PrefillBatch,
    Pi: torch.Tensor,
    centroids: torch.Tensor,
    has_flash_attn: bool,
    out: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    key_offset: torch.Tensor | None = None,
    value_rotation: bool = False,
) -> torch.Tensor:
    """Causal attention of the batch's prefill tokens: [prefill tokens, Hq, D],
    written into ``out`` (shaped like ``query``) when given.

    ``impl`` is the layer's ``TurboQuantAttentionImpl``: its varlen
    FlashAttention call where FlashAttention is installed, else SDPA with the
    same bottom-right-aligned causal mask. ``key_scale``: the layer's, when
    its keys are stored divided by it (cached keys are multiplied back);
    ``key_offset`` the same for a layer whose keys are stored shifted,
    ``value_rotation`` for one whose values are stored rotated.

    With two or more continuations in the batch every group's packed K/V
    is one buffer, whose ``held`` map lets a continuation skip the tiles an
    earlier one read back into the same rows (the same prefix blocks from
    row 0, as prefix-cache hits that are groups of their own have them);
    each group's raw chunk rows are marked as holding no tile.
    """
    attend: Callable[..., torch.Tensor] = (
        impl._flash_attn_varlen if has_flash_attn else sdpa_prefill(impl)
    )
    if out is None:
        out = torch.empty_like(query)
    hk, d = key.shape[1], key.shape[2]
    held = None
    if batch.shared_reads and _keeps_held_tiles(impl, Pi, kv_cache):
        k_rows = key.new_empty(batch.packed_rows, hk, d)
        v_rows = value.new_empty(batch.packed_rows, hk, d)
        held = torch.full(
            (batch.packed_rows // BLOCK_N + 2, hk), -1, dtype=torch.int32,
            device=key.device,
        )  # fmt: skip
    for g in batch.groups:
        q = query[g.tok_start : g.tok_end]
        k = key[g.tok_start : g.tok_end]
        v = value[g.tok_start : g.tok_end]
        cu_k, max_k = g.cu_seqlens_q, g.max_query_len
        p = g.packed
        if p is not None:
            if held is None:
                k_all = k.new_empty(p.tokens, hk, d)
                v_all = v.new_empty(p.tokens, hk, d)
            else:
                k_all, v_all = k_rows[: p.tokens], v_rows[: p.tokens]
            for c in p.continuations:
                rows = slice(c.row, c.row + c.cached)
                cached_kv_into(
                    impl, kv_cache, c.block_row, c.cached, Pi, centroids,
                    k_all[rows], v_all[rows], key_scale, key_offset, value_rotation,
                    held, c.row,
                )  # fmt: skip
            k_all.index_copy_(0, p.chunk_rows, k)
            v_all.index_copy_(0, p.chunk_rows, v)
            if held is not None:
                held.index_fill_(0, p.chunk_tiles, -1)
            k, v, cu_k, max_k = k_all, v_all, p.cu_seqlens_k, g.max_seq_len
        attend(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=g.cu_seqlens_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=g.max_query_len,
            max_seqlen_k=max_k,
            out=out[g.tok_start : g.tok_end],
        )
    return out
