# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant decode/store kernels vs FlashAttention bf16 on a paged cache.

One command on a GPU host with the patched vLLM importable:

    python benchmarks/kernels/benchmark_turboquant_decode.py --quick

For every case (query/KV heads x head_dim, batch x context) and TurboQuant
preset it prints the bytes the decode kernel must read, the floor (bytes over
the copy bandwidth measured in the same run), the median GPU time (CUDA
events, L2 flushed before every timed call, the launch hidden behind a GPU
sleep; see ``Timer``) of FlashAttention bf16, of 0.20.2's kernel (``old``,
``triton_turboquant_decode_attention``) and of the split-KV kernel when patch
0017 is applied (``new``, ``turboquant_decode.decode_attention``
with the backend's shared scratch; which stage 1 it took, Gluon or Triton, and
its host launch time), the fraction of copy
bandwidth each reaches, the speed ratio to FA, and each kernel's error against
a float64 attention over the same packed cache (first and last batch row;
scratch and outputs poisoned with NaN before the checked call). Then
the store kernel (a decode step and a prefill chunk) against bf16's
``reshape_and_cache_flash``, and, with ``--sweep`` (default in --quick), the
new kernel's launch geometry (tile, warps, key dimensions per dot, split
count) on two cases and, with ``--splits`` (default in --quick), the default
stage 1 at other split counts on three. With ``--raw-window W`` (patch
0031), the decode as served is timed again with a W-token raw window (a
random bf16 twin) and its time and host time are put against the served
decode's. Caches hold real packed slots (the store kernel on random K/V,
tiled over the cache); pages are shuffled.

Writes kernels-<time>.json and .md to --out DIR, else $OUT, else
benchmarks/runs/ (git-ignored; release summaries go to benchmarks/releases/).
"""

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import platform
import sys
import time
import unittest.mock

import torch

# Run as a file, only the script's own folder is on sys.path; imported as
# benchmarks.kernels.benchmark_turboquant_decode (the tests), it is not.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_run import DEFAULT_OUT, check_iters, run_meta, write_run  # noqa: E402
from gpu_timer import Timer, copy_bandwidth  # noqa: E402
from turboquant_layer_setup import (  # noqa: E402
    LAYER_SHAPES,
    PAGE,
    PRESETS,
    add_presets_argument,
    codes_pairs,
    packed_slots,
    served_extras,
    store_kwargs,
    takes_key_offset,
    tq_config,
    tq_tables,
)

# (label, query heads, KV heads, head_dim, batch, context)
CASES = [
    ("Qwen3-4B", 32, 8, 128, 1, 32768),
    ("Qwen3-4B", 32, 8, 128, 16, 8192),
    ("Qwen3-4B", 32, 8, 128, 64, 32768),
    # A server under load: many rows, short contexts (the e2e high-load
    # scenario decodes ~500 rows at 512-640 tokens).
    ("Qwen3-4B", 32, 8, 128, 512, 640),
    ("Qwen3.6-27B", 24, 4, 256, 16, 8192),
    ("Qwen3.6-27B", 24, 4, 256, 64, 32768),
    ("Qwen3-Next", 16, 2, 256, 16, 8192),  # GQA 8
    ("Gemma4-31B-full", 32, 4, 512, 16, 8192),  # head_dim 512, GQA 8
]
QUICK_CASES = [CASES[0], CASES[1], CASES[4], ("Gemma4-31B-full", 32, 4, 512, 4, 8192)]
SWEEP_CASES = [CASES[1], CASES[4]]
# Split counts of the default stage 1 (0: its own count, from the wave
# model of gluon_num_splits), over the backend's scratch, whose spare rows
# hold counts past 32 at small batches. With a register cap for the Gluon
# stage 1 (0: its own, MAX_REGISTERS since release 19): 255 lifts it, as
# release 18 and earlier launched (186-224 registers for the MSE presets at
# head_dim 256 and 512, 8 resident warps per SM where the cap keeps 12).
SPLIT_CASES = [CASES[0], CASES[1], CASES[4], CASES[7]]
SPLIT_POINTS = [(0, 0), (4, 0), (8, 0), (16, 0), (32, 0), (64, 0), (128, 0)]
SPLIT_POINTS += [(0, 255)]
# Rows of the backend's decode scratch (max_num_seqs; vLLM's default on
# GPUs under 70 GB, 1,024 above), shared by all layers, and its splits per
# row (the backend's tq_max_kv_splits_for_cuda_graph default).
SCRATCH_ROWS = 256
SCRATCH_SPLITS = 32
SWEEP_PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc"]
# (BLOCK_N, warps, key dimensions per dot, register cap (0: none), splits
# (0: the kernel's own count from shapes + SMs)). The kernel's defaults
# (GEOMETRY) first, then tiles, warps, key chunks, caps and split counts.
SWEEP_POINTS = {
    128: [
        (32, 4, 64, 168, 0),
        (32, 4, 64, 0, 0),
        (16, 2, 64, 0, 0),
        (16, 4, 64, 168, 0),
        (32, 2, 64, 0, 0),
        (64, 4, 64, 0, 0),
        (32, 8, 64, 0, 0),
        (32, 4, 32, 168, 0),
        (32, 4, 64, 128, 0),
        (32, 4, 64, 168, 4),
        (32, 4, 64, 168, 16),
        (32, 4, 64, 168, 32),
    ],
    256: [
        (16, 4, 64, 168, 0),
        (16, 4, 64, 0, 0),
        (16, 2, 64, 0, 0),
        (32, 4, 64, 168, 0),
        (16, 8, 64, 128, 0),
        (16, 8, 64, 0, 0),
        (16, 4, 32, 168, 0),
        (16, 4, 64, 168, 8),
        (16, 4, 64, 168, 32),
    ],
}
STORE_TOKENS = [64, 8192]


def paged_layout(batch, context, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = math.ceil(context / PAGE)
    num_blocks = batch * pages + 1
    perm = torch.randperm(num_blocks, generator=g)[: batch * pages].to(torch.int32)
    block_table = perm.view(batch, pages).cuda()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return num_blocks, block_table, seq_lens


def fill_tq_cache(cache, cfg, hk, head_dim, pit, midpoints):
    """Real packed slots: store a pool of random tokens, tile it over the cache
    (0.20.2's store; the shipped one for pair codes, which only it writes)."""
    if codes_pairs(cfg):
        from vllm.v1.attention.ops.triton_turboquant_store_fused import (
            turboquant_store as store,
        )
    else:
        from vllm.v1.attention.ops.triton_turboquant_store import (
            triton_turboquant_store as store,
        )

    pool_tokens = 4096
    pool = torch.zeros(
        pool_tokens // PAGE, PAGE, hk, cache.shape[-1], dtype=torch.uint8, device="cuda"
    )
    k = torch.randn(pool_tokens, hk, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(pool_tokens, hk, head_dim, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(pool_tokens, dtype=torch.int32, device="cuda")
    store(
        k,
        v,
        pool,
        slots,
        pit,
        midpoints,
        **store_kwargs(cfg),
    )
    flat = cache.view(-1, hk * cache.shape[-1])
    src = pool.view(-1, hk * cache.shape[-1])
    for i in range(0, flat.shape[0], pool_tokens):
        n = min(pool_tokens, flat.shape[0] - i)
        flat[i : i + n] = src[:n]


def reference_error(out, q, cache, block_table, seq_lens, cfg, centroids, pit, rows):
    """max |out - float64 attention over the same packed cache| / max |ref|,
    over the given batch rows (NaN left in a poisoned output shows as nan)."""
    B, Hq, D = q.shape
    Hk = cache.shape[2]
    scale = D**-0.5
    err, peak = 0.0, 0.0
    for row in rows:
        n = int(seq_lens[row])
        pos = torch.arange(n, device=cache.device)
        slots = cache[block_table[row, pos // PAGE].long(), pos % PAGE].cpu()
        k, v = packed_slots().dequantize(slots, cfg, centroids, D)  # [n, Hk, D]
        qr = q[row].double().cpu()
        if not cfg.key_fp8:
            qr = qr @ pit.double().cpu()
        qg = qr.view(Hk, Hq // Hk, D)
        p = torch.softmax(torch.einsum("hgd,nhd->hgn", qg, k) * scale, dim=-1)
        ref = torch.einsum("hgn,nhd->hgd", p, v).reshape(Hq, D)
        got = out[row].double().cpu()
        if torch.isnan(got).any():
            return float("nan")
        err = max(err, (got - ref).abs().max().item())
        peak = max(peak, ref.abs().max().item())
    return err / peak


def fa_runner(q, k_cache, v_cache, block_table, seq_lens, context, scale):
    try:
        from vllm.v1.attention.backends.fa_utils import (
            flash_attn_varlen_func,
            get_flash_attn_version,
        )

        fa_version = get_flash_attn_version(head_size=q.shape[-1])
    except Exception as e:  # noqa: BLE001 - report, keep benchmarking
        return None, f"FA unavailable: {type(e).__name__}: {e}"
    B = q.shape[0]
    cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    # As vLLM's backends do: no fa_version argument when none was chosen.
    version = {} if fa_version is None else {"fa_version": fa_version}

    def run():
        flash_attn_varlen_func(
            q=q,
            k=k_cache,
            v=v_cache,
            max_seqlen_q=1,
            cu_seqlens_q=cu_q,
            max_seqlen_k=context,
            seqused_k=seq_lens,
            softmax_scale=scale,
            causal=True,
            block_table=block_table,
            out=out,
            **version,
        )

    try:
        run()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return None, f"FA failed: {type(e).__name__}: {str(e)[:120]}"
    return run, None


def backend_scratch(batch: int, heads: int, D: int) -> torch.Tensor:
    """The backend's shared decode scratch for a batch, NaN-poisoned: a call
    must write every partial result it reads."""
    shape = (max(batch, SCRATCH_ROWS), heads, SCRATCH_SPLITS, D + 1)
    return torch.full(shape, float("nan"), device="cuda")


def raw_window_of(
    batch: int, context: int, hk: int, D: int, size: int, device: str = "cuda"
):
    """A ``size``-token raw window over a random bf16 twin (pages of
    ``PAGE``): each row's consecutive pages map to pages of its own, enough
    for a window's span. None on a vLLM without patch 0031."""
    try:
        from vllm.v1.attention.ops.triton_turboquant_raw_window import RawWindow
    except ImportError:
        return None
    per_row = -(-size // PAGE) + 1
    twin = torch.randn(batch * per_row, PAGE, hk, D, device=device)
    twin = twin.to(torch.bfloat16)
    logical = torch.arange(-(-context // PAGE), device=device, dtype=torch.int32)
    rows = torch.arange(batch, device=device, dtype=torch.int32)[:, None]
    table = rows * per_row + logical[None, :] % per_row
    return RawWindow(twin, twin, table, size)


def tq_decode_runner(
    q, cache, block_table, seq_lens, cfg, centroids, pit, scale, new, **offset
):
    """0.20.2's entry point (old) or the split-KV kernel (new), as the backend
    calls them: the shared scratch of patch 0008 (``backend_scratch``);
    ``offset``: the new kernel's ``key_offset`` and ``value_rotation``."""
    from vllm.v1.attention.ops import triton_turboquant_decode as dec

    try:
        from vllm.v1.attention.ops import turboquant_decode as tq_decode
    except ImportError:
        tq_decode = None
    if new and tq_decode is None:
        return None
    if not new and codes_pairs(cfg):
        return None  # 0.20.2's kernel reads every field as a level
    B, Hq, D = q.shape
    S = SCRATCH_SPLITS
    # Poisoned: the first (checked) call must write every output it returns.
    mid = backend_scratch(B, Hq, D)
    out_buf = torch.full((B, Hq, D), float("nan"), device="cuda")
    lse = torch.full((B, Hq), float("nan"), device="cuda")

    if new:
        if not tq_decode.supports(
            D,
            Hq,
            cache.shape[2],
            cfg.key_mse_bits,
            cfg.effective_value_quant_bits,
            cfg.key_fp8,
        ):
            return None

        return splitkv_call(
            q,
            cache,
            block_table,
            seq_lens,
            cfg,
            centroids,
            pit,
            scale,
            mid_o_buf=mid,
            max_num_kv_splits=S,
            **offset,
        )

    def run():
        # Patch 0017 hooks this entry point; "old" is 0.20.2's kernel, which
        # the hook leaves to run under VLLM_TURBOQUANT_DECODE=legacy.
        saved = os.environ.get("VLLM_TURBOQUANT_DECODE")
        os.environ["VLLM_TURBOQUANT_DECODE"] = "legacy"
        try:
            return legacy()
        finally:
            if saved is None:
                del os.environ["VLLM_TURBOQUANT_DECODE"]
            else:
                os.environ["VLLM_TURBOQUANT_DECODE"] = saved

    def legacy():
        return dec.triton_turboquant_decode_attention(
            query=q,
            kv_cache=cache,
            block_table=block_table,
            seq_lens=seq_lens,
            Pi=pit,
            centroids=centroids,
            scale=scale,
            **store_kwargs(cfg),
            norm_correction=cfg.norm_correction,
            PiT=pit,
            mid_o_buf=mid,
            output_buf=out_buf,
            lse_buf=lse,
            max_num_kv_splits=S,
        )

    return run


def sweep_runner(q, cache, block_table, seq_lens, cfg, centroids, pit, scale, point):
    """The split-KV kernel at one sweep point (see SWEEP_POINTS)."""
    B, Hq, D = q.shape
    *geometry, splits = point
    mid = torch.empty(B, Hq, SCRATCH_SPLITS, D + 1, dtype=torch.float32, device="cuda")

    return splitkv_call(
        q,
        cache,
        block_table,
        seq_lens,
        cfg,
        centroids,
        pit,
        scale,
        mid_o_buf=mid,
        geometry=tuple(geometry),
        num_splits=splits or None,
    )


def splitkv_call(q, cache, block_table, seq_lens, cfg, centroids, pit, scale, **launch):
    """A no-argument call of the split-KV kernel as the backend makes it
    (``maybe_decode_attention``: the query rotated in one small kernel where
    ``pit`` is the backend's Hadamard matrix, as ``tq_tables`` returns);
    ``launch``: its scratch and launch overrides (mid_o_buf,
    max_num_kv_splits, geometry, num_splits)."""
    from vllm.v1.attention.ops.turboquant_hadamard import is_backend_hadamard

    hadamard = not cfg.key_fp8 and is_backend_hadamard(pit)
    call = packed_slots().decode
    return lambda: call(
        q, cache, block_table, seq_lens, cfg, centroids, pit, scale=scale,
        hadamard_query=hadamard, **launch,
    )  # fmt: skip


def stage1_of(run) -> str | None:
    """Which stage 1 the split-KV call ``run`` launches: "gluon" or "triton"
    (None without a call). The call runs with no remembered launch plans: a
    plan (patch 0026) replays its launches without calling ``stage1``, so a
    probe after the timed calls read every stage 1 as "triton"."""
    if run is None:
        return None
    try:
        from vllm.v1.attention.ops import gluon_turboquant_decode as gluon
    except ImportError:
        return "triton"
    from vllm.v1.attention.ops import turboquant_decode as tq_decode

    calls = []
    real = gluon.stage1
    gluon.stage1 = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        with unittest.mock.patch.dict(getattr(tq_decode, "_plans", {}), clear=True):
            run()
    finally:
        gluon.stage1 = real
    return "gluon" if calls else "triton"


def guarded(timer, log, what, run):
    """(first output as fp32, median µs), or (None, None) with the error logged."""
    if run is None:
        return None, None
    try:
        out = run().float()
        return out, timer(run)
    except Exception as e:  # noqa: BLE001 - one failing kernel must not end the run
        log(f"  {what}: FAILED {type(e).__name__}: {str(e)[:300]}")
        return None, None


def bench_decode(cases, presets, timer, bw, rows, log, raw_window: int = 0):
    for label, hq, hk, D, B, ctx in cases:
        num_blocks, bt, seq_lens = paged_layout(B, ctx)
        scale = D**-0.5
        q = torch.randn(B, hq, D, device="cuda", dtype=torch.bfloat16)
        bf16_bytes = B * ctx * hk * D * 2 * 2
        k_cache = torch.randn(
            num_blocks, PAGE, hk, D, device="cuda", dtype=torch.bfloat16
        )
        v_cache = torch.randn_like(k_cache)
        fa, fa_err = fa_runner(q, k_cache, v_cache, bt, seq_lens, ctx, scale)
        fa_us = timer(fa) if fa else None
        fa_host_us = timer.host_us if fa_us is not None else None
        if fa_err:
            log(f"  {label} {B}x{ctx}: {fa_err}")
        del k_cache, v_cache, fa  # the runner holds the bf16 caches
        rows.append(
            dict(
                kind="decode",
                case=label,
                heads=f"{hq}/{hk}x{D}",
                batch=B,
                context=ctx,
                kv="bf16 (FA)",
                bytes=bf16_bytes,
                floor_us=bf16_bytes / bw * 1e6,
                old_us=fa_us,
                new_us=None,
                fa_us=fa_us,
                fa_host_us=fa_host_us,
            )
        )
        max_slot = tq_config(PRESETS[0], D).slot_size_aligned
        store = torch.empty(
            num_blocks * PAGE * hk * max_slot, dtype=torch.uint8, device="cuda"
        )
        for preset in presets:
            cfg = tq_config(preset, D)
            slot = cfg.slot_size_aligned
            cache = store[: num_blocks * PAGE * hk * slot].view(
                num_blocks, PAGE, hk, slot
            )
            centroids, midpoints, pit = tq_tables(cfg, D)
            fill_tq_cache(cache, cfg, hk, D, pit, midpoints)
            nbytes = B * ctx * hk * slot
            t0 = time.time()
            old = tq_decode_runner(
                q, cache, bt, seq_lens, cfg, centroids, pit, scale, False
            )
            new = tq_decode_runner(
                q, cache, bt, seq_lens, cfg, centroids, pit, scale, True
            )
            old_out, old_us = guarded(timer, log, f"old {label} {preset}", old)
            new_out, new_us = guarded(timer, log, f"new {label} {preset}", new)
            new_host_us = timer.host_us if new_us is not None else None
            offset_us = None
            if new is not None and takes_key_offset(cfg):
                # As the backend calls it for a layer with a key offset
                # (patch 0027): random slots mark about half the keys.
                shifted = tq_decode_runner(
                    q, cache, bt, seq_lens, cfg, centroids, pit, scale, True,
                    key_offset=torch.randn(hk, D, device="cuda"),
                )  # fmt: skip
                _, offset_us = guarded(timer, log, f"offset {label} {preset}", shifted)
            served_us = served_host_us = None
            extras = served_extras(cfg, hq, hk, D)
            if new is not None and "value_rotation" in extras:
                # As the backend calls it: the key offset and rotated values
                # of the layers that take them (the output rotated back).
                served = tq_decode_runner(
                    q, cache, bt, seq_lens, cfg, centroids, pit, scale, True, **extras
                )
                _, served_us = guarded(timer, log, f"served {label} {preset}", served)
                served_host_us = timer.host_us if served_us is not None else None
            window_us = window_host_us = None
            window = raw_window_of(B, ctx, hk, D, raw_window) if raw_window else None
            if new is not None and window is not None:
                # As served, with the twin's last positions read raw.
                windowed = tq_decode_runner(
                    q, cache, bt, seq_lens, cfg, centroids, pit, scale, True,
                    raw_window=window, **extras,
                )  # fmt: skip
                w_out, window_us = guarded(
                    timer, log, f"window {label} {preset}", windowed
                )
                window_host_us = timer.host_us if window_us is not None else None
                if w_out is not None and not w_out.isfinite().all():
                    log(f"  window {label} {preset}: FAILED, non-finite output")
                    window_us = window_host_us = None
            check_rows = sorted({0, B - 1})
            errs = {
                name: None
                if o is None
                else reference_error(
                    o, q, cache, bt, seq_lens, cfg, centroids, pit, check_rows
                )
                for name, o in (("old", old_out), ("new", new_out))
            }
            diff = None
            if old_out is not None and new_out is not None:
                diff = (new_out - old_out).abs().max().item() / (
                    old_out.abs().max().item()
                )
            rows.append(
                dict(
                    kind="decode",
                    case=label,
                    heads=f"{hq}/{hk}x{D}",
                    batch=B,
                    context=ctx,
                    kv=preset.removeprefix("turboquant_"),
                    bytes=nbytes,
                    floor_us=nbytes / bw * 1e6,
                    old_us=old_us,
                    new_us=new_us,
                    new_host_us=new_host_us,
                    offset_us=offset_us,
                    served_us=served_us,
                    served_host_us=served_host_us,
                    window_us=window_us,
                    window_host_us=window_host_us,
                    # What the window is put against: the decode as served
                    # (k8v4 takes no extras: the plain decode).
                    window_base_us=served_us or new_us,
                    window_base_host_us=served_host_us or new_host_us,
                    stage1=stage1_of(new),
                    fa_us=fa_us,
                    fa_host_us=fa_host_us,
                    rel_diff_new_old=diff,
                    old_err=errs["old"],
                    new_err=errs["new"],
                    wall_s=round(time.time() - t0, 1),
                )
            )
            log(fmt_row(rows[-1], bw))
        del store


@dataclasses.dataclass
class FilledCache:
    """One case and preset: a random query and a packed cache of real slots."""

    label: str
    hq: int
    hk: int
    D: int
    B: int
    ctx: int
    preset: str
    bw: float
    bt: torch.Tensor
    seq_lens: torch.Tensor
    q: torch.Tensor
    cfg: object
    cache: torch.Tensor
    centroids: torch.Tensor
    pit: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.B * self.ctx * self.hk * self.cfg.slot_size_aligned

    def row(self, kind: str, **fields) -> dict:
        return dict(
            kind=kind,
            case=self.label,
            heads=f"{self.hq}/{self.hk}x{self.D}",
            batch=self.B,
            context=self.ctx,
            kv=self.preset.removeprefix("turboquant_"),
            bytes=self.nbytes,
            floor_us=self.nbytes / self.bw * 1e6,
            **fields,
        )


def filled_caches(cases, presets, bw):
    """A FilledCache per case and preset, one after another."""
    for label, hq, hk, D, B, ctx in cases:
        num_blocks, bt, seq_lens = paged_layout(B, ctx)
        q = torch.randn(B, hq, D, device="cuda", dtype=torch.bfloat16)
        for preset in presets:
            cfg = tq_config(preset, D)
            cache = torch.empty(
                num_blocks,
                PAGE,
                hk,
                cfg.slot_size_aligned,
                dtype=torch.uint8,
                device="cuda",
            )
            centroids, midpoints, pit = tq_tables(cfg, D)
            fill_tq_cache(cache, cfg, hk, D, pit, midpoints)
            yield FilledCache(
                label, hq, hk, D, B, ctx, preset, bw, bt, seq_lens, q, cfg, cache,
                centroids, pit,
            )  # fmt: skip


def bench_sweep(cases, presets, timer, bw, rows, log):
    try:
        from vllm.v1.attention.ops import turboquant_decode  # noqa: F401
    except ImportError:
        log("  sweep skipped: no split-KV kernel installed (patch 0017 not applied)")
        return
    for c in filled_caches(cases, presets, bw):
        for geom in SWEEP_POINTS.get(c.D, []):
            run = sweep_runner(
                c.q, c.cache, c.bt, c.seq_lens, c.cfg, c.centroids, c.pit,
                c.D**-0.5, geom,
            )  # fmt: skip
            try:
                us = timer(run)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                log(
                    f"  sweep {c.label} {c.preset} {geom}: "
                    f"{type(e).__name__}: {str(e)[:100]}"
                )
                continue
            rows.append(c.row("sweep", geometry=list(geom), new_us=us))
            log(
                f"  sweep {c.label} {c.B}x{c.ctx} {c.preset:20s} "
                f"BLOCK_N,warps,key_chunk,maxnreg,splits={geom}: "
                f"{us:8.1f} us  {c.nbytes / (us * 1e-6) / bw:5.1%}"
            )


@contextlib.contextmanager
def gluon_register_cap(maxnreg: int):
    """The Gluon stage 1 launched with a register cap inside the block (0:
    with its own, ``MAX_REGISTERS``)."""
    from vllm.v1.attention.ops import gluon_turboquant_decode as gluon

    if not maxnreg:
        yield
        return

    def launch(kernel, grid, args, constexprs):
        kernel[grid](*args, **constexprs, num_warps=constexprs["W"], maxnreg=maxnreg)

    with unittest.mock.patch.object(gluon, "_launch", launch):
        yield


def bench_splits(cases, presets, timer, bw, rows, log):
    """The default stage 1 (``stage1_of`` says which ran) at SPLIT_POINTS,
    each checked against float64 on the first row; register caps apply to
    the Gluon stage 1 only."""
    for c in filled_caches(cases, presets, bw):
        for splits, maxnreg in SPLIT_POINTS:
            with gluon_register_cap(maxnreg):
                mid = backend_scratch(c.B, c.hq, c.D)
                run = splitkv_call(
                    c.q, c.cache, c.bt, c.seq_lens, c.cfg, c.centroids, c.pit,
                    c.D**-0.5, mid_o_buf=mid, max_num_kv_splits=mid.shape[2],
                    num_splits=splits or None,
                )  # fmt: skip
                try:
                    stage1 = stage1_of(run)
                    if maxnreg and stage1 != "gluon":
                        continue
                    err = reference_error(
                        run().float(), c.q, c.cache, c.bt, c.seq_lens, c.cfg,
                        c.centroids, c.pit, [0],
                    )  # fmt: skip
                    us = timer(run)
                except Exception as e:  # noqa: BLE001 - keep the other points
                    log(
                        f"  splits {c.label} {c.preset} {splits}: "
                        f"{type(e).__name__}: {str(e)[:100]}"
                    )
                    continue
                rows.append(
                    c.row(
                        "splits",
                        splits=splits or "default",
                        maxnreg=maxnreg or None,
                        stage1=stage1,
                        new_us=us,
                        new_err=err,
                    )
                )
                log(
                    f"  splits {c.label} {c.B}x{c.ctx} {c.preset:20s} "
                    f"{splits or 'default'!s:>7s} {stage1:6s} "
                    f"maxnreg {maxnreg or '-'!s:>3s}: {us:8.1f} us  "
                    f"{c.nbytes / (us * 1e-6) / bw:5.1%}  f64 err {fmt_err(err)}"
                )


def bench_store(shapes, presets, timer, bw, rows, log):
    # The backend stores through the one-launch store (patch 0016); 0.20.2's
    # launcher is timed beside it, labelled, for comparison only.
    from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store
    from vllm.v1.attention.ops.triton_turboquant_store_fused import turboquant_store

    for label, hq, hk, D in shapes:
        for n in STORE_TOKENS:
            num_blocks = math.ceil(n / PAGE) * 2 + 1
            k = torch.randn(n, hk, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            slots = torch.randperm(num_blocks * PAGE, device="cuda")[:n].to(torch.int32)
            kc = torch.empty(
                num_blocks, PAGE, hk, D, device="cuda", dtype=torch.bfloat16
            )
            vc = torch.empty_like(kc)
            try:
                from vllm._custom_ops import reshape_and_cache_flash

                one = torch.ones((), device="cuda")
                slots64 = slots.long()
                bf16_us = timer(
                    functools.partial(
                        reshape_and_cache_flash, k, v, kc, vc, slots64, "auto", one, one
                    )
                )
            except Exception as e:  # noqa: BLE001
                log(f"  store bf16 unavailable: {type(e).__name__}: {str(e)[:100]}")
                bf16_us = None
            in_bytes = n * hk * D * 2 * 2
            rows.append(
                dict(
                    kind="store",
                    case=label,
                    heads=f"{hq}/{hk}x{D}",
                    tokens=n,
                    kv="bf16",
                    bytes=2 * in_bytes,
                    old_us=bf16_us,
                )
            )
            for preset in presets:
                cfg = tq_config(preset, D)
                cache = torch.empty(
                    num_blocks,
                    PAGE,
                    hk,
                    cfg.slot_size_aligned,
                    dtype=torch.uint8,
                    device="cuda",
                )
                _, midpoints, pit = tq_tables(cfg, D)
                # The backend adds a key offset (with the tokens' positions) and
                # rotated values where its rules say so (0027, 0028).
                extras = served_extras(cfg, hq, hk, D)
                if "key_offset" in extras:
                    extras["positions"] = torch.arange(n, device="cuda")
                timed = {"old": None}
                for name, fn, extra in (
                    ("new", turboquant_store, {}),
                    ("served", turboquant_store, extras),
                    ("old", triton_turboquant_store, {}),
                ):
                    if name == "old" and codes_pairs(cfg):
                        continue  # 0.20.2's store writes levels only
                    if name == "served" and not extras:
                        timed[name] = timed["new"]  # the same call
                        continue
                    run = functools.partial(
                        fn,
                        k,
                        v,
                        cache,
                        slots,
                        pit,
                        midpoints,
                        **store_kwargs(cfg),
                        **extra,
                    )
                    timed[name] = timer(run)
                nbytes = in_bytes + n * hk * cfg.slot_size_aligned
                rows.append(
                    dict(
                        kind="store",
                        case=label,
                        heads=f"{hq}/{hk}x{D}",
                        tokens=n,
                        kv=preset.removeprefix("turboquant_"),
                        bytes=nbytes,
                        new_us=timed["new"],
                        served_us=timed["served"],
                        old_us=timed["old"],
                        bf16_us=bf16_us,
                    )
                )
                log(
                    f"  store {label} {n:5d} tok {preset:20s} shipped "
                    f"{timed['new']:8.1f} us, as served {timed['served']:8.1f} us, "
                    f"0.20.2's {fmt_us(timed['old']):>8} us "
                    f"(bf16 {bf16_us and f'{bf16_us:.1f}'} us), shipped at "
                    f"{nbytes / (timed['new'] * 1e-6) / bw:5.1%} of copy bandwidth"
                )


def pct(nbytes, us, bw):
    return None if not us else nbytes / (us * 1e-6) / bw


def fmt_us(x):
    return "n/a" if x is None else f"{x:,.1f}"


def fmt_pct(x):
    return "n/a" if x is None else f"{x:.0%}"


def fmt_row(r, bw):
    fa = r.get("fa_us")
    new = r.get("new_us")
    old = r.get("old_us")
    ratio = f"{fa / new:.2f}x" if fa and new else "n/a"
    speedup = f"{old / new:.1f}x" if old and new else "n/a"
    return (
        f"  {r['case']:16s} {r['heads']:9s} {r['batch']:3d}x{r['context']:<6d} "
        f"{r['kv']:10s} {r['bytes'] / 1e6:9.1f} MB floor {fmt_us(r['floor_us']):>8s} | "
        f"old {fmt_us(old):>9s} ({fmt_pct(pct(r['bytes'], old, bw)):>4s}) | "
        f"new {fmt_us(new):>9s} ({fmt_pct(pct(r['bytes'], new, bw)):>4s}) "
        f"{r.get('stage1') or '':6s} host {fmt_us(r.get('new_host_us')):>6s} "
        f"({host_ratio(r)} FA's) | "
        f"FA {fmt_us(fa):>8s} | FA/new {ratio:>6s} | new vs old {speedup:>6s}"
        + (
            f" | diff {r['rel_diff_new_old']:.1e}"
            if r.get("rel_diff_new_old") is not None
            else ""
        )
        + f" | f64 err old {fmt_err(r.get('old_err'))} new {fmt_err(r.get('new_err'))}"
        + (
            f" | key offset {fmt_us(r['offset_us'])} ({r['offset_us'] / new:.3f}x)"
            if r.get("offset_us") and new
            else ""
        )
        + (
            f" | as served {fmt_us(r['served_us'])} ({r['served_us'] / new:.3f}x)"
            if r.get("served_us") and new
            else ""
        )
        + (
            f" | with a raw window {fmt_us(r['window_us'])} "
            f"({r['window_us'] / r['window_base_us']:.3f}x)"
            if r.get("window_us") and r.get("window_base_us")
            else ""
        )
    )


def host_ratio(r) -> str:
    """The decode call's host time over FlashAttention's call's, same case."""
    new, fa = r.get("new_host_us"), r.get("fa_host_us")
    return f"{new / fa:.1f}x" if new and fa else "n/a"


ERR_LIMIT = 1e-2  # bf16 output of an fp32-internal kernel: ~4e-3 at most


def fmt_err(x):
    if x is None:
        return "n/a"
    return f"{x:.1e}" + ("" if x <= ERR_LIMIT else " FAIL")  # nan fails too


def table_head(*columns: str) -> list[str]:
    """A Markdown table's header and separator lines."""
    return [f"| {' | '.join(columns)} |", "|---" * len(columns) + "|"]


def markdown(meta, rows, bw):
    out = [
        f"# TurboQuant kernel microbenchmark ({meta['time']})",
        "",
        (
            f"Device: {meta['device']}; torch {meta['torch']}, "
            f"triton {meta['triton']}, vLLM {meta['vllm']}; "
            f"copy bandwidth measured {bw / 1e9:,.0f} GB/s "
            "(read+write); medians of CUDA events, L2 flushed before each call, "
            "GPU kept busy while the host launches it (host µs: the launch "
            "call's own time)."
        ),
        "",
        "## Decode",
        "",
        *table_head(
            "case",
            "batch x context",
            "KV",
            "MB read",
            "floor µs",
            "FA bf16 µs",
            "old µs (% BW)",
            "new µs (% BW)",
            "new stage 1",
            "new host µs",
            "host new/FA",
            "FA/new",
            "FA/old",
            "new vs old",
            "rel. diff new-old",
            "f64 err old",
            "f64 err new",
        ),  # fmt: skip
    ]
    for r in rows:
        if r["kind"] != "decode" or r["kv"].startswith("bf16"):
            continue
        fa, new, old = r.get("fa_us"), r.get("new_us"), r.get("old_us")
        diff = r.get("rel_diff_new_old")
        out.append(
            f"| {r['case']} {r['heads']} | {r['batch']} x {r['context']} | {r['kv']} | "
            f"{r['bytes'] / 1e6:,.1f} | {fmt_us(r['floor_us'])} | {fmt_us(fa)} | "
            f"{fmt_us(old)} ({fmt_pct(pct(r['bytes'], old, bw))}) | "
            f"{fmt_us(new)} ({fmt_pct(pct(r['bytes'], new, bw))}) | "
            f"{r.get('stage1') or 'n/a'} | {fmt_us(r.get('new_host_us'))} | "
            f"{host_ratio(r)} | "
            f"{f'{fa / new:.2f}x' if fa and new else 'n/a'} | "
            f"{f'{fa / old:.2f}x' if fa and old else 'n/a'} | "
            f"{f'{old / new:.1f}x' if old and new else 'n/a'} | "
            f"{'n/a' if diff is None else f'{diff:.1e}'} | "
            f"{fmt_err(r.get('old_err'))} | {fmt_err(r.get('new_err'))} |"
        )
    offset_rows = [r for r in rows if r["kind"] == "decode" and r.get("offset_us")]
    if offset_rows:
        out += [
            "",
            "MSE keys with a key offset (patch 0027: marked keys' scores shifted),"
            " against the same decode without one:",
            "",
            *table_head("case", "batch x context", "KV", "new µs", "with offset µs",
                        "ratio"),
        ]  # fmt: skip
        for r in offset_rows:
            out.append(
                f"| {r['case']} {r['heads']} | {r['batch']} x {r['context']} | "
                f"{r['kv']} | {fmt_us(r['new_us'])} | {fmt_us(r['offset_us'])} | "
                f"{r['offset_us'] / r['new_us']:.3f}x |"
            )
    served_rows = [r for r in rows if r["kind"] == "decode" and r.get("served_us")]
    if served_rows:
        out += [
            "",
            "The decode as the backend calls it (0027's key offset on MSE keys,"
            " 0028's rotated values on MSE keys, the output rotated back by the"
            " merge, or in place at one split), against the plain decode above:",
            "",
            *table_head("case", "batch x context", "KV", "new µs", "as served µs",
                        "ratio", "% of copy bandwidth"),
        ]  # fmt: skip
        for r in served_rows:
            out.append(
                f"| {r['case']} {r['heads']} | {r['batch']} x {r['context']} | "
                f"{r['kv']} | {fmt_us(r['new_us'])} | {fmt_us(r['served_us'])} | "
                f"{r['served_us'] / r['new_us']:.3f}x | "
                f"{fmt_pct(pct(r['bytes'], r['served_us'], bw))} |"
            )
    window_rows = [r for r in rows if r["kind"] == "decode" and r.get("window_us")]
    if window_rows:
        out += [
            "",
            f"The decode as served with a raw window of {meta.get('raw_window')} tokens"
            " (patch 0031: the last positions read from a bf16 twin), against the"
            " same decode without one (k8v4: the plain decode):",
            "",
            *table_head("case", "batch x context", "KV", "without µs", "with µs",
                        "ratio", "host µs without", "host µs with"),
        ]  # fmt: skip
        for r in window_rows:
            base = r["window_base_us"]
            out.append(
                f"| {r['case']} {r['heads']} | {r['batch']} x {r['context']} | "
                f"{r['kv']} | {fmt_us(base)} | {fmt_us(r['window_us'])} | "
                f"{r['window_us'] / base:.3f}x | "
                f"{fmt_us(r.get('window_base_host_us'))} | "
                f"{fmt_us(r.get('window_host_us'))} |"
            )
    fa_rows = [r for r in rows if r["kind"] == "decode" and r["kv"].startswith("bf16")]
    out += ["", "FA bf16 (% of copy bandwidth on its own bytes):", ""]
    for r in fa_rows:
        out.append(
            f"- {r['case']} {r['heads']} {r['batch']} x {r['context']}: "
            f"{fmt_us(r['fa_us'])} µs ({fmt_pct(pct(r['bytes'], r['fa_us'], bw))})"
        )
    sweep = [r for r in rows if r["kind"] == "sweep"]
    if sweep:
        out += [
            "",
            "## New kernel launch points (BLOCK_N, warps, key dims, maxnreg, splits)",
            "",
            *table_head("case", "KV", "geometry", "µs", "% BW"),
        ]
        for r in sweep:
            out.append(
                f"| {r['case']} {r['batch']} x {r['context']} | {r['kv']} | "
                f"{tuple(r['geometry'])} | {fmt_us(r['new_us'])} | "
                f"{fmt_pct(pct(r['bytes'], r['new_us'], bw))} |"
            )
    splits = [r for r in rows if r["kind"] == "splits"]
    if splits:
        out += [
            "",
            "## Default stage 1 at other split counts",
            "",
            *table_head(
                "case",
                "KV",
                "splits",
                "stage 1",
                "register cap",
                "µs",
                "% BW",
                "f64 err (row 0)",
            ),  # fmt: skip
        ]
        for r in splits:
            out.append(
                f"| {r['case']} {r['batch']} x {r['context']} | {r['kv']} | "
                f"{r['splits']} | {r['stage1']} | {r.get('maxnreg') or '-'} | "
                f"{fmt_us(r['new_us'])} | "
                f"{fmt_pct(pct(r['bytes'], r['new_us'], bw))} | "
                f"{fmt_err(r.get('new_err'))} |"
            )
    store = [r for r in rows if r["kind"] == "store"]
    if store:
        out += [
            "",
            "## Store (K/V of N tokens into the cache)",
            "",
            "shipped = the one-launch store the backend runs (patch 0016); "
            "as served = the same store with the arguments the backend adds "
            "for the preset (a key offset with the tokens' positions, rotated "
            "values: 0027, 0028); 0.20.2's = upstream's "
            "`triton_turboquant_store`, for comparison.",
            "",
            *table_head(
                "shape",
                "tokens",
                "KV",
                "shipped µs",
                "shipped / bf16",
                "as served µs",
                "as served / bf16",
                "0.20.2's µs",
                "bf16 µs",
                "shipped % BW (read K/V + write slots)",
            ),  # fmt: skip
        ]
        for r in store:
            if r["kv"] == "bf16":
                continue
            bf16 = r.get("bf16_us")
            shipped, served = r.get("new_us"), r.get("served_us")
            ratio, served_ratio = (
                f"{us / bf16:.2f}x" if bf16 and us else "n/a"
                for us in (shipped, served)
            )
            out.append(
                f"| {r['case']} {r['heads']} | {r['tokens']} | {r['kv']} | "
                f"{fmt_us(shipped)} | {ratio} | "
                f"{fmt_us(served)} | {served_ratio} | {fmt_us(r['old_us'])} | "
                f"{fmt_us(bf16)} | {fmt_pct(pct(r['bytes'], r.get('new_us'), bw))} |"
            )
    return "\n".join(out) + "\n"


def run_all(args, timer, bw, rows, log):
    log(
        "decode: case, heads, batch x context, KV, bytes read, floor "
        "| old | new | FA | ratios"
    )
    bench_decode(
        QUICK_CASES if args.quick else CASES,
        args.presets,
        timer,
        bw,
        rows,
        log,
        args.raw_window,
    )
    for r in rows:
        if r["kv"].startswith("bf16"):
            log(
                f"  FA bf16 {r['case']} {r['batch']}x{r['context']}: "
                f"{fmt_us(r['fa_us'])} us "
                f"({fmt_pct(pct(r['bytes'], r['fa_us'], bw))} of copy bandwidth)"
            )
    if (args.quick or args.sweep) and not args.no_sweep:
        log("sweep: new kernel launch geometry")
        bench_sweep(SWEEP_CASES, SWEEP_PRESETS, timer, bw, rows, log)
    if (args.quick or args.splits) and not args.no_sweep:
        log("splits: the default stage 1 at other split counts")
        bench_splits(SPLIT_CASES, SWEEP_PRESETS, timer, bw, rows, log)
    if not args.no_store:
        log("store")
        # One layer shape per head size (128, 256, 512), as issue 44 asks.
        bench_store(LAYER_SHAPES, args.presets, timer, bw, rows, log)


def check_raw_window(ap: argparse.ArgumentParser, size: int) -> None:
    """``--raw-window``: 0 (off) or a window the engine would build."""
    if size == 0:
        return
    try:
        from vllm.model_executor.layers.quantization.turboquant.layer_policy import (
            MAX_RECENT_TOKENS,
        )
    except ImportError:
        ap.error(
            f"--raw-window {size}: this vLLM has no raw window (patch 0031); "
            "install the hybridkv wheel or leave the option out"
        )
    if not 1 <= size <= MAX_RECENT_TOKENS:
        ap.error(
            f"--raw-window {size}: a window is 1 to {MAX_RECENT_TOKENS} tokens, "
            "as --kv-cache-dtype-skip-layers recent:W takes; pass one in that "
            "range, or 0 for none"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="4 cases, all presets, small sweep (< 4 min on an H100)",
    )
    add_presets_argument(ap)
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="launch-geometry sweep (always on with --quick)",
    )
    ap.add_argument(
        "--splits",
        action="store_true",
        help="the default stage 1 at other split counts (always on with --quick)",
    )
    ap.add_argument("--no-store", action="store_true")
    ap.add_argument(
        "--no-sweep", action="store_true", help="skip the sweeps (both) in --quick"
    )
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument(
        "--raw-window",
        type=int,
        default=0,
        metavar="W",
        help="also time each decode as served with a W-token raw window (0031)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT") or str(DEFAULT_OUT))
    args = ap.parse_args()
    iters = check_iters(ap, args.iters, args.quick)
    check_raw_window(ap, args.raw_window)
    packed_slots()  # before the GPU check: a broken import shows on any host
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    start = time.time()
    timer = Timer(iters, warmup=2)
    bw = copy_bandwidth(timer)
    meta = run_meta(
        bw,
        sms=torch.cuda.get_device_properties(0).multi_processor_count,
        python=platform.python_version(),
        quick=args.quick,
        iters=iters,
        raw_window=args.raw_window,
    )
    print(
        f"{meta['device']}: copy bandwidth {bw / 1e9:,.0f} GB/s (read+write); "
        f"vLLM {meta['vllm']}",
        flush=True,
    )

    def log(s):
        print(s, flush=True)

    rows: list[dict] = []
    try:
        run_all(args, timer, bw, rows, log)
    except Exception as e:  # noqa: BLE001 - keep what was measured
        log(f"aborted: {type(e).__name__}: {e}")
        meta["aborted"] = f"{type(e).__name__}: {e}"
    meta["wall_s"] = round(time.time() - start, 1)
    write_run(args.out, "kernels", meta, rows, markdown(meta, rows, bw))


if __name__ == "__main__":
    main()
