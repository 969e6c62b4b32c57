# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant attends to a step's prefill chunks in one call, without host syncs.

In 0.20.2 one request that continues its prompt (a later chunk of a chunked
prefill, a prefix-cache hit) sends every prefill request of the step through
a per-request loop after ``.tolist()`` reads, and a mixed decode/prefill step
reads the prefill lengths with one more ``.tolist()`` per layer. These tests
drive the real metadata builder and ``forward`` on such a step: a decode row,
two first chunks and a continuation. FlashAttention is a float64 stand-in
that counts its calls.

The cache is written by the real store from K/V that k8v4 holds exactly (FP8
keys; values on a 1/8 grid whose ends are each head's minimum and maximum),
so every path, quantized or raw, must match float64 attention over the
original K/V to fp32 rounding. 4bit_nc's keys are lossy: its continuation
must match 0.20.2's per-request continuation path. Runs under the Triton CPU
interpreter (``HYBRIDKV_TRITON_INTERPRET=1``) and natively on a GPU.
"""

import contextlib
import inspect
import math
from types import SimpleNamespace

import pytest
import torch

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends import turboquant_attn
from vllm.v1.attention.backends.turboquant_attn import (
    TurboQuantAttentionImpl,
    TurboQuantMetadataBuilder,
)

HQ, HK, D, PAGE = 4, 2, 64, 16
# A decode row, a first chunk, a continuation of 5 tokens after 32 cached
# ones, and another first chunk.
Q_LENS, SEQ_LENS = [1, 6, 5, 3], [20, 6, 37, 3]
TOL = 2e-5  # relative to max |out|: fp32 rounding


class FlashStandIn:
    """``flash_attn_varlen_func(..., causal=True)`` in float64, counted; into
    ``out`` when given, as the real one.

    Reads its lengths with ``numpy()``, which the host-sync guard allows: the
    real kernel reads them on the device."""

    def __init__(self):
        self.calls = 0
        self.outs: list[torch.Tensor | None] = []

    def __call__(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw
    ):
        self.calls += 1
        qs, ks = cu_seqlens_q.cpu().numpy(), cu_seqlens_k.cpu().numpy()
        out = kw.get("out")
        self.outs.append(out)
        if out is None:
            out = torch.empty_like(q)
        for i in range(len(qs) - 1):
            a, b, c, d = int(qs[i]), int(qs[i + 1]), int(ks[i]), int(ks[i + 1])
            out[a:b] = _attention(q[a:b], k[c:d], v[c:d], kw["softmax_scale"])
        return out


def _attention(q, k, v, scale):
    """float64 causal attention, bottom-right aligned, GQA by repetition."""
    dtype = q.dtype
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    q_len, k_len = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    seen = torch.arange(k_len, device=q.device)[None, :] <= (
        torch.arange(q_len, device=q.device)[:, None] + k_len - q_len
    )
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(dtype)


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    def refuse(self, *a, **k):
        raise AssertionError("host sync (.tolist()/.item()) in TurboQuant forward")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", refuse)
        m.setattr(torch.Tensor, "item", refuse)
        yield


@pytest.fixture
def flash(monkeypatch):
    stand_in = FlashStandIn()
    monkeypatch.setattr(turboquant_attn, "_HAS_FLASH_ATTN", True)
    monkeypatch.setattr(
        turboquant_attn, "flash_attn_varlen_func", stand_in, raising=False
    )
    monkeypatch.setattr(turboquant_attn, "get_flash_attn_version", lambda **kw: 2)
    return stand_in


def _builder(group_tokens: int):
    config = SimpleNamespace(
        speculative_config=None,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        scheduler_config=SimpleNamespace(
            max_num_seqs=8, max_num_batched_tokens=group_tokens
        ),
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=4),
    )
    return TurboQuantMetadataBuilder(
        kv_cache_spec=None,
        layer_names=["model.layers.0.self_attn.attn"],
        vllm_config=config,
        device=torch.device("cpu"),
    )


def _slots(table, starts, ends):
    slots = []
    for row, (a, b) in enumerate(zip(starts, ends)):
        pos = torch.arange(a, b, device=table.device)
        slots.append(table[row, pos // PAGE].long() * PAGE + pos % PAGE)
    return torch.cat(slots)


def _step(table, device, q_lens=Q_LENS, seq_lens=SEQ_LENS):
    """The runner's metadata for the step, host copies included."""
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    starts = [s - q for q, s in zip(q_lens, seq_lens)]
    return CommonAttentionMetadata(
        query_start_loc=cu.to(device),
        query_start_loc_cpu=cu,
        seq_lens=seq.to(device),
        num_reqs=len(q_lens),
        num_actual_tokens=sum(q_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table,
        slot_mapping=_slots(table, starts, seq_lens),
        seq_lens_cpu_upper_bound=seq,
    )


def _drafter_step(table, device, q_lens, seq_lens):
    """A draft model's first pass over a verify step: the target's metadata
    (``q_lens`` minus one, ``seq_lens`` minus one) with every query extended
    by the drafter's extra slot, as ``DraftModelProposer`` builds it."""
    from vllm.v1.spec_decode.utils import extend_all_queries_by_N

    target = _step(table, device, [q - 1 for q in q_lens], [s - 1 for s in seq_lens])
    return extend_all_queries_by_N(
        target,
        N=1,
        arange=torch.arange(len(q_lens) + 1, dtype=torch.int32, device=device),
        new_slot_mapping=_step(table, device, q_lens, seq_lens).slot_mapping,
    )


def _exact_kv(n, device):
    """K in FP8 exactly; V on a 1/8 grid from -1 to 7/8 per head, both ends
    present, so k8v4's store and dequantization are lossless."""
    k = torch.randint(-8, 9, (n, HK, D)).float() / 4
    idx = torch.randint(0, 16, (n, HK, D))
    idx[..., 0], idx[..., 1] = 0, 15
    return k.to(device), (idx.float() / 8 - 1).to(device)


def _run(
    preset,
    device,
    monkeypatch,
    group_tokens=64,
    dtype=torch.float32,
    q_lens=Q_LENS,
    seq_lens=SEQ_LENS,
    step=_step,
    make_kv=_exact_kv,
    key_scale=None,
    query_scale=None,
    key_offset=None,
    shared=None,
    codebook=None,
):
    """One step (by default a mixed one) through the builder and forward;
    returns the inputs and the output [tokens, HQ, D]. ``dtype``: the
    model's (bf16 holds the K/V exactly). ``step`` makes the step's metadata
    from the block table; ``make_kv(n, device)`` a sequence's K and V.
    ``key_scale`` is the layer's (``_tq_key_scale``), ``key_offset`` its
    ``_tq_key_offset``; the query is multiplied by ``query_scale``.
    ``shared=(tokens, rows)``: those requests hold one prefix of ``tokens``
    tokens on the same pages, as prefix-cache hits do. ``codebook``: the
    layer's ``_tq_centroids`` (default: the preset's levels)."""
    torch.manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        impl = TurboQuantAttentionImpl(HQ, D, D**-0.5, HK, kv_cache_dtype=preset)
    cfg = impl.tq_config
    layer = torch.nn.Module()
    if codebook is None:
        codebook = get_centroids(D, cfg.centroid_bits)
    layer._tq_centroids = codebook.to(device)
    if key_scale is not None:
        layer._tq_key_scale = key_scale.to(device)
    if key_offset is not None:
        layer._tq_key_offset = key_offset.to(device).contiguous()
    pages = [math.ceil(s / PAGE) for s in seq_lens]
    cache = torch.zeros(
        sum(pages) + 1, PAGE, HK, cfg.slot_size_aligned, dtype=torch.uint8
    ).to(device)
    # Each request on its own pages, in reverse order.
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    free = list(range(sum(pages), 0, -1))
    for row, n in enumerate(pages):
        table[row, :n] = torch.tensor(free[:n], dtype=torch.int32)
        free = free[n:]
    if shared is not None:
        first, *others = shared[1]
        table[others, : shared[0] // PAGE] = table[first, : shared[0] // PAGE]
    table = table.to(device)

    # Every request's whole sequence, stored as the earlier steps and this
    # step's cache update would have.
    seqs = [tuple(t.to(dtype) for t in make_kv(s, device)) for s in seq_lens]
    if shared is not None:
        n, (first, *others) = shared
        for r in others:
            seqs[r] = tuple(
                torch.cat([a[:n], b[n:]]) for a, b in zip(seqs[first], seqs[r])
            )
    k_all = torch.cat([k for k, _ in seqs])
    v_all = torch.cat([v for _, v in seqs])
    impl._ensure_on_device(layer, torch.device(device))
    impl.do_kv_cache_update(
        layer, k_all, v_all, cache, _slots(table, [0] * len(seq_lens), seq_lens)
    )

    meta = _builder(group_tokens).build(0, step(table, device, q_lens, seq_lens))
    k_new = torch.cat([k[s - q :] for (k, _), q, s in zip(seqs, q_lens, seq_lens)])
    v_new = torch.cat([v[s - q :] for (_, v), q, s in zip(seqs, q_lens, seq_lens)])
    q = torch.randn(sum(q_lens), HQ, D, device=device).to(dtype)
    if query_scale is not None:
        q = q * query_scale.to(device)
    with no_host_sync(monkeypatch):
        out = impl.forward(
            layer,
            q.view(-1, HQ * D),
            k_new.view(-1, HK * D),
            v_new.view(-1, HK * D),
            cache,
            meta,
            output=torch.full(
                (sum(q_lens), HQ * D), float("nan"), device=device, dtype=dtype
            ),
        )
    return SimpleNamespace(
        impl=impl, layer=layer, cache=cache, table=table, seqs=seqs, q=q,
        k_new=k_new, v_new=v_new, out=out.view(-1, HQ, D), q_lens=q_lens,
    )  # fmt: skip


def _error(run) -> float:
    """max |out - float64 attention over the original K/V| / max |ref|."""
    refs, start = [], 0
    for (k, v), q_len in zip(run.seqs, run.q_lens):
        refs.append(_attention(run.q[start : start + q_len], k, v, D**-0.5))
        start += q_len
    ref = torch.cat(refs).double()
    return ((run.out.double() - ref).abs().max() / ref.abs().max()).item()


def test_a_step_with_a_continuation_is_one_attention_call(
    triton_device, flash, monkeypatch
):
    run = _run("turboquant_k8v4", triton_device, monkeypatch)
    assert flash.calls == 1, f"{flash.calls} FlashAttention calls for 3 prefills"
    assert _error(run) < TOL


def test_groups_bound_the_packed_kv(triton_device, flash, monkeypatch):
    """A token budget smaller than any request: one call per request, the
    same result."""
    run = _run("turboquant_k8v4", triton_device, monkeypatch, group_tokens=2)
    assert flash.calls == 3
    assert _error(run) < TOL


@pytest.mark.parametrize(
    "fault", ["chunk rows one row late", "cached tokens not dequantized"]
)
def test_a_misplaced_row_turns_the_check_red(fault, triton_device, flash, monkeypatch):
    from vllm.v1.attention.backends import turboquant_prefill_batch as batch

    plan = batch.plan_prefill_batch

    def faulty(*args):
        planned = plan(*args)
        for g in planned.groups:
            if g.packed is not None and fault == "chunk rows one row late":
                rows = g.packed.chunk_rows
                g.packed.chunk_rows = torch.minimum(rows + 1, rows.max())
        return planned

    monkeypatch.setattr(turboquant_attn, "plan_prefill_batch", faulty)
    if fault == "cached tokens not dequantized":
        monkeypatch.setattr(
            batch,
            "cached_kv_into",
            lambda impl, kv, row, cached, pi, c, k_out, v_out, *a: (
                k_out.zero_(),
                v_out.zero_(),
            ),
        )
    # Rows the fault leaves unwritten hold whatever the allocator had: NaN
    # counts as red.
    err = _error(_run("turboquant_k8v4", triton_device, monkeypatch))
    assert math.isnan(err) or err > 100 * TOL, err


# Requests A, E, B, D, C: A, E and C continue one 48-token prefix on the
# same pages; B is a first chunk and D a continuation of its own. A budget of
# 54 tokens makes the groups A | E | B + D | C, so B's raw rows overwrite the
# packed rows A's and E's prefix was read back into before C reads it.
SHARED_Q, SHARED_SEQ, SHARED = [5, 6, 20, 4, 6], [53, 54, 20, 20, 54], (48, [0, 1, 4])


def _shared_step(preset, device, monkeypatch, spy=None):
    from vllm.v1.attention.backends import turboquant_prefill_batch as batch

    if spy is not None:
        monkeypatch.setattr(batch, "unpack_cached", spy(batch.unpack_cached))
    return _run(
        preset, device, monkeypatch, group_tokens=54, q_lens=SHARED_Q,
        seq_lens=SHARED_SEQ, shared=SHARED,
    )  # fmt: skip


def test_continuations_on_one_prefix_read_its_tiles_once(
    triton_device, flash, monkeypatch
):
    """E's prefix tiles are still in the packed rows from A's read-back: the
    cache is garbled while E reads it back, and E's rows stay right. C comes
    after B's raw rows overwrote them, and reads its tiles again. (k8v4, for
    float64; the MSE flags' held tiles: test_turboquant_unpack_cached.py.)"""
    preset = "turboquant_k8v4"
    from vllm.v1.attention.backends import turboquant_prefill_batch as batch

    reads = []

    def spy(unpack):
        def read_back(kv_cache, block_row, cached, *args):
            if cached == 1:  # the first forward's warm-up
                return unpack(kv_cache, block_row, cached, *args)
            reads.append(args[-2] is not None)  # held
            if len(reads) == 2:  # E: every tile of its prefix garbled
                prefix = block_row[0, : SHARED[0] // PAGE].long()
                kept = kv_cache[prefix].clone()
                kv_cache[prefix] = 0x5A
                unpack(kv_cache, block_row, cached, *args)
                kv_cache[prefix] = kept
                return
            unpack(kv_cache, block_row, cached, *args)

        return read_back

    run = _shared_step(preset, triton_device, monkeypatch, spy)
    assert flash.calls == 4
    assert reads == [True] * 4, reads

    monkeypatch.setattr(batch, "_keeps_held_tiles", lambda *a: False)
    apart = _shared_step(preset, triton_device, monkeypatch)
    torch.testing.assert_close(run.out, apart.out, rtol=0, atol=0)
    assert _error(run) < TOL


def test_rows_a_chunk_overwrote_are_read_again(triton_device, flash, monkeypatch):
    """The check above turns red when the chunks' rows are not marked: C
    then takes B's raw K/V for its prefix."""
    from vllm.v1.attention.backends import turboquant_prefill_batch as batch

    plan = batch.plan_prefill_batch

    def unmarked(*args):
        planned = plan(*args)
        for g in planned.groups:
            if g.packed is not None:
                g.packed.chunk_tiles = g.packed.chunk_tiles[:0]
        return planned

    monkeypatch.setattr(turboquant_attn, "plan_prefill_batch", unmarked)
    err = _error(_shared_step("turboquant_k8v4", triton_device, monkeypatch))
    assert err > 100 * TOL, err


def test_a_draft_models_first_pass_reads_its_whole_context(
    triton_device, flash, monkeypatch
):
    """A draft model's first pass after a verify step: every request's
    verified tokens plus the drafter's extra slot, all of them continuing a
    cached context (q = 1 + k + 1 = 5 > the decode threshold). The plan
    reads the host copy of seq_lens; ``extend_all_queries_by_N`` left it one
    token short of the device's, so the chunk rows ran past the packed K/V
    (index_copy_ out of bounds: the device-side assert that crashed draft
    speculation with TurboQuant under CUDA graphs)."""
    run = _run(
        "turboquant_k8v4",
        triton_device,
        monkeypatch,
        group_tokens=128,
        q_lens=[5, 5, 5],
        seq_lens=[21, 38, 10],
        step=_drafter_step,
    )
    assert flash.calls == 1
    assert _error(run) < TOL


def test_mse_continuation_matches_the_per_request_path(
    triton_device, flash, monkeypatch
):
    """4bit_nc: the batched continuation equals 0.20.2's per-request
    dequantize + FlashAttention path (keys rotated back by a GEMM there, by
    the in-register Hadamard transform here; fp16 rounding of the rotated
    keys may differ by one ulp)."""
    run = _run("turboquant_4bit_nc", triton_device, monkeypatch)
    assert flash.calls == 1
    cont = 2
    start = sum(Q_LENS[:cont])
    q_len, seq = Q_LENS[cont], SEQ_LENS[cont]
    k, v = run.seqs[cont]
    ref = run.impl._continuation_prefill(
        run.layer,
        run.q[start : start + q_len],
        k[seq - q_len :],
        v[seq - q_len :],
        run.cache,
        run.table[cont : cont + 1],
        seq - q_len,
        seq,
        run.layer._tq_Pi,
        run.layer._tq_centroids,
    )
    got = run.out[start : start + q_len]
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 2e-3
    # First chunks attend to their raw K/V: exact.
    first = run.out[1:7].double()
    want = _attention(run.q[1:7], *run.seqs[1], D**-0.5).double()
    assert ((first - want).abs().max() / want.abs().max()).item() < TOL


def test_prefill_rows_are_written_where_the_caller_says(
    triton_device, flash, monkeypatch
):
    """Given ``out`` (a layer output's rows), each group's FlashAttention call
    writes its rows there: no per-call result, no concatenation."""
    real, calls = turboquant_attn.prefill_attention, []

    def into_rows(impl, query, *args, out=None, **kw):  # its own rows, not the caller's
        buf = torch.full(
            (query.shape[0] + 2, *query.shape[1:]), float("nan"), device=query.device
        )
        rows = buf[1:-1]
        got = real(impl, query, *args, out=rows, **kw)
        assert got.data_ptr() == rows.data_ptr()
        assert buf[0].isnan().all() and buf[-1].isnan().all()
        calls.append(rows)
        return got

    monkeypatch.setattr(turboquant_attn, "prefill_attention", into_rows)
    run = _run("turboquant_k8v4", triton_device, monkeypatch, group_tokens=2)
    assert len(calls) == 1 and flash.calls == 3
    starts = [o.data_ptr() for o in flash.outs]
    row_bytes = HQ * D * calls[0].element_size()
    # The groups' rows in order: request 1 (6 tokens), 2 (5), 3 (3).
    assert starts == [calls[0].data_ptr() + n * row_bytes for n in (0, 6, 11)]
    assert _error(run) < TOL


def test_the_plan_names_a_batch_that_is_not_decodes_first():
    from vllm.v1.attention.backends.turboquant_prefill_batch import plan_prefill_batch

    cam = _step(torch.zeros(4, 3, dtype=torch.int32), "cpu")
    with pytest.raises(ValueError, match="must follow the 2 decode tokens"):
        plan_prefill_batch(cam, num_decodes=1, num_decode_tokens=2, group_tokens=64)
    with pytest.raises(ValueError, match="positive token budget"):
        plan_prefill_batch(cam, num_decodes=1, num_decode_tokens=1, group_tokens=0)


def test_the_first_forward_compiles_the_continuation_kernels_once(
    triton_device, flash, monkeypatch
):
    """The engine's warm-up runs meet only decode and first-chunk batches; the
    continuation's kernels are compiled there, not at the first request that
    continues its prompt. A cache off the GPU has nothing to compile."""
    from vllm.v1.attention.backends import turboquant_prefill_batch as batch

    read_back, calls = batch.cached_kv_into, []
    signature = inspect.signature(read_back)

    def recorded(*args, **kwargs):
        # The block row, the cached length and, for a read into a map of
        # held tiles, its first packed row.
        a = signature.bind(*args, **kwargs).arguments
        held_row0 = a.get("row0", 0) if a.get("held") is not None else None
        calls.append((a["block_row"].cpu().numpy().tolist(), a["cached"], held_row0))
        return read_back(*args, **kwargs)

    monkeypatch.setattr(batch, "cached_kv_into", recorded)
    run = _run("turboquant_4bit_nc", triton_device, monkeypatch)
    continuation = SEQ_LENS[2] - Q_LENS[2]
    if triton_device != "cuda":
        assert [c[1:] for c in calls] == [(continuation, None)]
        assert not getattr(run.layer, "_tq_continuation_warm", False)
        return
    # The step's continuation, after one token of the null block read back
    # alone and into a map of held tiles, on the tile grid and off it.
    assert [c[1:] for c in calls] == [(1, None), (1, 0), (1, 1), (continuation, None)]
    assert calls[0][0] == [[0] * 4]  # the table width (3) rounded up to 4
    assert run.layer._tq_continuation_warm
