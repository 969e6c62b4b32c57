# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Host time of one attention layer in an eager step: TurboQuant's backend
against the calls FlashAttention makes for ``auto``.

A step that no full CUDA graph covers (prefill chunks beside decode rows)
runs each attention layer eagerly between the graph pieces. Where a layer's
host work (Python, argument binding, launches) takes longer than its kernels,
the GPU waits: the end-to-end profile's "gap" column. On high-load (500 x
512 -> 128), k8v4's kernels took 215 µs per output step less GPU time than
auto's, and its wall 8.5 ms more, all of it gap (H100, release 16's
in-process profile; benchmarks/NOTES.md, "End to end").

Per layer and step, on Qwen3-4B's attention shape (32/8 heads x 128), one
mixed step (decode rows beside first prefill chunks), one eager decode step
and one step of first chunks alone:

- ``host``: µs the host spends per call, measured while a sleeping kernel
  keeps the GPU busy, so no call waits on the GPU;
- ``gpu``: µs of GPU time per call, from events around the same calls (the
  GPU runs them back to back after the sleep);
- TurboQuant: the metadata build (once per step, shared by the layers), the
  cache update and the forward; auto: ``reshape_and_cache_flash`` and one
  ``flash_attn_varlen_func`` over the paged cache, as its backend calls them.

On a step with decode rows beside first chunks it also times the forward
against the same metadata without the builder's decode and prefill halves
(patch 0029), which every layer then cuts for itself: both in this process,
rounds interleaved (``paired_host_us``), because host time read in separate
processes differs by up to half on one machine.

A decode call seen before sends the launches its batch shape planned
(patch 0017's ``turboquant_decode``): the main table times that. For a
decode step it times the forward making its checks and choices at every
call against sending its plan (``plan_saving``), paired the same way; and,
without plans (as a batch shape's first call runs), every launch binding
its arguments again against launches found by their arguments' key (patch
0026, ``launch_keys_saving``) and the Gluon stage 1's options copied per
launch against one mapping (``launch_options_saving``).

It also takes three calls apart: one stage 1 launch; the cache update of a
decode step (the backend's Python, the store kernel's launch by part); and
the forward of a decode step (its Python and torch ops, with every launch
skipped, and its launches). ``--cprofile`` prints where the TurboQuant
forward's host time goes, in µs per forward: by function (cProfile), and by
torch op; for a decode step also with its launches skipped.

A decode step's forward with every launch skipped and no plans is also
taken apart by function (``forward_by_function``): for each function on the decode path
(``DECODE_CALLEES``), what the forward saves when that function returns
what it returned before at once, everything it calls included; paired
rounds in one process, host time only (with every launch skipped the host
never waits on the GPU). The layers carry the key offset an engine's
layers of their preset carry.

    python benchmarks/kernels/benchmark_turboquant_host.py
"""

import argparse
import contextlib
import cProfile
import dataclasses
import io
import itertools
import json
import math
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[2]
HQ, HK, D, PAGE = 32, 8, 128, 16
# Steps as the engine schedules them on high-load (500 x 512 -> 128,
# max_num_batched_tokens 8192): decode rows at ~576 tokens of context beside
# first chunks of 512-token prompts; and a decode batch outside the graphs.
STEPS = {
    "mixed": dict(decodes=448, context=576, prefills=15, prefill_len=512),
    "decode": dict(decodes=512, context=576, prefills=0, prefill_len=0),
    # The e2e harness's first-token step (decode-heavy's prefill): 32 first
    # chunks of 64 tokens. Its GPU time is auto's within 0.4 %, yet paired
    # TTFT and prefill read 1.06-1.09x on a host where auto's step took 37 ms
    # for 25 ms of kernels (H100, release 20's interleaved first-token run).
    "first-token": dict(decodes=0, context=0, prefills=32, prefill_len=64),
}
# GPU cycles the sleeping kernel spins (~240 ms on an H100 at 1.7 GHz): longer
# than the host takes to enqueue CALLS calls of any configuration here, also
# on a host busy with other work (a mixed step's 20 calls took 80 ms beside
# the GPU gate on an H200 host, past the 60 ms that 100M cycles gave).
SLEEP_CYCLES = 400_000_000
CALLS = 20
# Rounds of CALLS calls; the medians are reported (host time varies by
# +-15 % between rounds on a shared host).
ROUNDS = 7


def host_and_gpu_us(fn, calls: int = CALLS) -> tuple[float, float]:
    """Median (host µs, GPU µs) per call of ``fn`` over ROUNDS rounds; the
    first call is a warm-up."""
    fn()
    torch.cuda.synchronize()
    rounds = [_round(fn, calls) for _ in range(ROUNDS)]
    return (
        statistics.median(h for h, _ in rounds),
        statistics.median(g for _, g in rounds),
    )


def paired_host_us(fa, fb, rounds: int = 12, calls: int = CALLS, timer=None) -> dict:
    """Host µs per call of ``fa`` and ``fb`` timed in one process, their
    rounds alternating in order (AB, BA, AB, ...): each one's median and
    minimum over its rounds, and the median of the paired differences
    ``b - a``. On one H200 host the same call read up to half more in one
    process than in the next, so two versions' host times are compared only
    this way. ``timer(fn, calls)`` times a round (default: ``_round``, with
    the GPU kept busy)."""
    timer = timer or _round
    fa()
    fb()
    torch.cuda.synchronize()
    a, b = [], []
    for r in range(rounds):
        order = ((fa, a), (fb, b)) if r % 2 == 0 else ((fb, b), (fa, a))
        for fn, times in order:
            times.append(timer(fn, calls)[0])
    return dict(
        a=statistics.median(a),
        a_min=min(a),
        b=statistics.median(b),
        b_min=min(b),
        b_minus_a=statistics.median(y - x for x, y in zip(a, b)),
    )


def _round(fn, calls: int) -> tuple[float, float]:
    sleep_us = _sleep_us()
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    if host * 1e6 > 0.8 * sleep_us:
        # The GPU may have drained the queue and waited: its time is not
        # kernel time then.
        raise RuntimeError(
            f"{calls} calls took {host * 1e6:,.0f} µs of host time, more than the "
            f"{sleep_us:,.0f} µs sleep covers; raise SLEEP_CYCLES"
        )
    return host * 1e6 / calls, start.elapsed_time(end) * 1e3 / calls


_sleep_cache: list[float] = []


def _sleep_us() -> float:
    """µs the sleeping kernel keeps this GPU busy."""
    if not _sleep_cache:
        start, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        start.record()
        torch.cuda._sleep(SLEEP_CYCLES)
        end.record()
        torch.cuda.synchronize()
        _sleep_cache.append(start.elapsed_time(end) * 1e3)
    return _sleep_cache[0]


def _step_metadata(decodes, context, prefills, prefill_len, device):
    """Common metadata of a step: decode rows first, each request on its own
    pages; and the slot of every scheduled token."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q_lens = [1] * decodes + [prefill_len] * prefills
    seq_lens = [context] * decodes + [prefill_len] * prefills
    pages = [math.ceil(s / PAGE) for s in seq_lens]
    table = torch.zeros(len(q_lens), max(pages), dtype=torch.int32)
    first = 1  # page 0 is vLLM's null block
    for row, n in enumerate(pages):
        table[row, :n] = torch.arange(first, first + n, dtype=torch.int32)
        first += n
    slots = []
    for row, (q, s) in enumerate(zip(q_lens, seq_lens)):
        pos = torch.arange(s - q, s)
        slots.append(table[row, pos // PAGE].long() * PAGE + pos % PAGE)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=cu.to(device),
        query_start_loc_cpu=cu,
        seq_lens=seq.to(device),
        num_reqs=len(q_lens),
        num_actual_tokens=sum(q_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table.to(device),
        slot_mapping=torch.cat(slots).to(device),
        seq_lens_cpu_upper_bound=seq,
    )
    return cam, first


def _tq_layer(preset: str, num_pages: int, device):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.turboquant.fp16_centroids import (
        fp16_centroids,
    )
    from vllm.model_executor.layers.quantization.turboquant.key_offset import (
        takes_key_offset,
    )
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionImpl

    with set_current_vllm_config(VllmConfig()):
        impl = TurboQuantAttentionImpl(HQ, D, D**-0.5, HK, kv_cache_dtype=preset)
    cfg = impl.tq_config
    layer = torch.nn.Module()
    layer._tq_centroids = fp16_centroids(D, cfg.centroid_bits).to(device)
    # The engine's shared decode scratch (turboquant_verify_rows): 512 rows.
    layer._tq_mid_o_buf = torch.empty(
        512, HQ, impl.max_num_kv_splits, D + 1, device=device
    )
    layer._tq_output_buf = torch.empty(512, HQ, D, device=device)
    layer._tq_lse_buf = torch.empty(512, HQ, device=device)
    if takes_key_offset(impl):
        # The offset bind_key_offsets gives an engine's layer: its decode
        # computes q . mu beside the query rotation, its store marks keys.
        layer._tq_key_offset = torch.zeros(HK, D, dtype=torch.float32, device=device)
    impl._ensure_on_device(layer, device)
    cache = torch.zeros(
        num_pages, PAGE, HK, cfg.slot_size_aligned, dtype=torch.uint8, device=device
    )
    return impl, layer, cache


def _tq_builder(group_tokens: int, device):
    """The backend's metadata builder on the engine's figures (512 sequences,
    32 splits, the layer's device). The prefill-batch test's builder has the
    same shape on CPU figures; timed with it on an H100, the mixed step's
    forward waited out the whole sleep (a host sync; not traced)."""
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantMetadataBuilder

    config = SimpleNamespace(
        speculative_config=None,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        scheduler_config=SimpleNamespace(
            max_num_seqs=512, max_num_batched_tokens=group_tokens
        ),
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=32),
    )
    return TurboQuantMetadataBuilder(
        kv_cache_spec=None,
        layer_names=["model.layers.0.self_attn.attn"],
        vllm_config=config,
        device=device,
    )


def halves_saving(impl, layer, q, k, v, cache, meta, out) -> dict:
    """A mixed step's forward with the builder's decode and prefill halves
    (patch 0029) against the same metadata without them, which every layer
    then cuts for itself; and the cut alone (host µs)."""
    from vllm.v1.attention.backends.turboquant_mixed_batch import mixed_batch_parts

    bare = dataclasses.replace(meta, mixed_parts=None)
    ab = paired_host_us(
        lambda: impl.forward(layer, q, k, v, cache, meta, output=out),
        lambda: impl.forward(layer, q, k, v, cache, bare, output=out),
    )
    t0 = time.perf_counter()
    for _ in range(2000):
        mixed_batch_parts(meta)
    ab["cut"] = (time.perf_counter() - t0) / 2000 * 1e6
    return ab


def hot_spots(fn, calls: int, top: int = 25) -> str:
    """``fn``'s functions by own host time (cProfile), µs per call of ``fn``,
    and the torch ops it runs, by own host time (torch.profiler)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])
    lines = ["own µs | total µs | calls | function"]
    for (path, line, name), (_, n, own, total, _) in rows[:top]:
        where = f"{Path(path).name}:{line}({name})" if line else name
        lines.append(
            f"{own / calls * 1e6:6.1f} | {total / calls * 1e6:6.1f} "
            f"| {n / calls:4.1f} | {where}"
        )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    ops = sorted(tp.key_averages(), key=lambda e: -e.self_cpu_time_total)
    lines.append("torch op | own µs | calls")
    for e in ops[:15]:
        lines.append(
            f"{e.key} | {e.self_cpu_time_total / calls:.1f} | {e.count / calls:.1f}"
        )
    return "\n".join(lines) + "\n"


def measure_turboquant(preset, step, device, profile_out=None) -> dict:
    cam, num_pages = _step_metadata(**STEPS[step], device=device)
    impl, layer, cache = _tq_layer(preset, num_pages, device)
    builder = _tq_builder(8192, device)
    n = cam.num_actual_tokens
    q = torch.randn(n, HQ * D, device=device, dtype=torch.bfloat16)
    k = torch.randn(n, HK * D, device=device, dtype=torch.bfloat16)
    v = torch.randn(n, HK * D, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    meta = builder.build(0, cam)

    def update():
        impl.do_kv_cache_update(
            layer, k.view(n, HK, D), v.view(n, HK, D), cache, cam.slot_mapping
        )

    def forward():
        impl.forward(layer, q, k, v, cache, meta, output=out)

    row = dict(
        build=host_and_gpu_us(lambda: builder.build(0, cam)),
        update=host_and_gpu_us(update),
        forward=host_and_gpu_us(forward),
    )
    if meta.mixed_parts is not None:
        row["halves"] = halves_saving(impl, layer, q, k, v, cache, meta, out)
    if profile_out is not None:
        profile_out.write(
            f"\n## {preset} {step}: forward x {CALLS}\n{hot_spots(forward, CALLS)}"
        )
    return row


def measure_auto(step, device) -> dict:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    cam, num_pages = _step_metadata(**STEPS[step], device=device)
    n = cam.num_actual_tokens
    kv = torch.zeros(2, num_pages, PAGE, HK, D, device=device, dtype=torch.bfloat16)
    q = torch.randn(n, HQ, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(n, HK, D, device=device, dtype=torch.bfloat16)
    v = torch.randn(n, HK, D, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    one = torch.ones((), device=device)
    version = get_flash_attn_version()

    def update():
        ops.reshape_and_cache_flash(
            k, v, kv[0], kv[1], cam.slot_mapping, "auto", one, one
        )

    def forward():
        flash_attn_varlen_func(
            q=q,
            k=kv[0],
            v=kv[1],
            out=out,
            cu_seqlens_q=cam.query_start_loc,
            max_seqlen_q=cam.max_query_len,
            seqused_k=cam.seq_lens,
            max_seqlen_k=cam.max_seq_len,
            softmax_scale=D**-0.5,
            causal=True,
            block_table=cam.block_table_tensor,
            fa_version=version,
        )

    return dict(update=host_and_gpu_us(update), forward=host_and_gpu_us(forward))


def launch_breakdown(preset: str, device) -> dict:
    """Host µs of one Gluon stage 1 launch, by part: Triton's JIT launch, its
    argument binder, its cache key, and a launch of the compiled kernel that
    skips both (the arguments captured from a decode step of 16 rows)."""
    from vllm.v1.attention.ops import gluon_turboquant_decode as gluon

    captured = {}

    def runner(kernel, grid, args, constexprs):
        captured.update(kernel=kernel, grid=grid, args=args, constexprs=constexprs)
        kernel[grid](*args, **constexprs, num_warps=constexprs["W"])

    cam, num_pages = _step_metadata(16, 576, 0, 0, device)
    impl, layer, cache = _tq_layer(preset, num_pages, device)
    meta = _tq_builder(8192, device).build(0, cam)
    q = torch.randn(16, HQ * D, device=device, dtype=torch.bfloat16)
    old, gluon._launch = gluon._launch, runner
    try:
        impl.forward(layer, q, q, q, cache, meta, output=torch.empty_like(q))
    finally:
        gluon._launch = old
    torch.cuda.synchronize()
    kw = dict(captured["constexprs"])
    kw["num_warps"] = kw["W"]
    return launch_by_part(captured["kernel"], captured["grid"], captured["args"], kw)


def launch_by_part(kernel, grid, args, kw) -> dict:
    """Host µs of one launch of a JIT ``kernel`` with these arguments, by part:
    Triton's JIT launch, its argument binder, its cache key, and a launch of
    the compiled kernel that skips both."""
    from triton.runtime.jit import compute_cache_key

    _, key_cache, _, _, binder = kernel.device_caches[torch.cuda.current_device()]
    compiled = kernel[grid](*args, **kw)
    bound, spec, options = binder(*args, **kw)
    # A compiled kernel's launcher reads all three grid dimensions.
    direct = compiled[tuple(grid) + (1,) * (3 - len(grid))]
    values = list(bound.values())
    parts = dict(
        jit_launch=lambda: kernel[grid](*args, **kw),
        binder=lambda: binder(*args, **kw),
        cache_key=lambda: compute_cache_key(key_cache, spec, options),
        compiled_launch=lambda: direct(*values),
    )
    return {name: host_and_gpu_us(fn, 100)[0] for name, fn in parts.items()}


def captured_store_launch(update, run: bool) -> dict:
    """Call ``update`` (a TurboQuant cache update) with the fused store's
    launches captured: the kernel, grid and arguments of its launch, which
    runs only with ``run``."""
    from vllm.v1.attention.ops import triton_turboquant_store_fused as store

    captured: dict = {}

    class _Capture:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                captured.update(kernel=self.kernel, grid=grid, args=args, kw=kw)
                if run:
                    self.kernel[grid](*args, **kw)

            return launch

    old = store.launcher
    store.launcher = _Capture
    try:
        update()
    finally:
        store.launcher = old
    return captured


def decode_step_calls(preset: str, device):
    """The forward and the cache update of one TurboQuant layer in an eager
    decode step (512 rows), as calls to time."""
    cam, num_pages = _step_metadata(**STEPS["decode"], device=device)
    impl, layer, cache = _tq_layer(preset, num_pages, device)
    meta = _tq_builder(8192, device).build(0, cam)
    n = cam.num_actual_tokens
    q = torch.randn(n, HQ * D, device=device, dtype=torch.bfloat16)
    k = torch.randn(n, HK, D, device=device, dtype=torch.bfloat16)
    v = torch.randn(n, HK, D, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)

    def forward():
        impl.forward(layer, q, q, q, cache, meta, output=out)

    def update():
        impl.do_kv_cache_update(layer, k, v, cache, cam.slot_mapping)

    return forward, update


def store_breakdown(preset: str, device) -> dict:
    """Host µs of the cache update of an eager decode step (512 rows), by
    part: the backend's whole ``do_kv_cache_update``; the same with its one
    launch taking no time (the backend's Python alone); the store kernel's
    launch by part (``launch_by_part``, the arguments captured from that
    update)."""
    _, update = decode_step_calls(preset, device)
    c = captured_store_launch(update, run=True)
    python_only = host_and_gpu_us(
        lambda: captured_store_launch(update, run=False), 100
    )[0]
    torch.cuda.synchronize()
    whole = host_and_gpu_us(update, 100)[0]
    parts = launch_by_part(c["kernel"], c["grid"], c["args"], c["kw"])
    return dict(update=whole, python_only=python_only, **parts)


@contextlib.contextmanager
def launches_skipped():
    """Every kernel the backend launches through ``CompiledLaunch`` (patch
    0026: the store, the rotations, both stage 1s, the merge) returns at
    once, launching nothing, and so does every launch of a decode plan
    made before: what is left of a call is its Python and torch ops."""
    from triton.compiler import CompiledKernel

    from vllm.triton_utils.compiled_launch import CompiledLaunch

    # ``launch`` passes its keywords on to ``launch_with``, through which the
    # Gluon stage 1 launches directly. A plan calls each compiled kernel's
    # ``run``.
    old = CompiledLaunch.launch_with
    old_run = CompiledKernel.__dict__["run"]
    CompiledLaunch.launch_with = lambda self, grid, *args, **kwargs: None
    CompiledKernel.run = property(lambda self: _launch_nothing)
    try:
        yield
    finally:
        CompiledLaunch.launch_with = old
        CompiledKernel.run = old_run


def _launch_nothing(*args):
    return None


@contextlib.contextmanager
def plans_in(plans: dict, most: int):
    """Decode plans (patch 0017's ``turboquant_decode``) sent from and kept
    in ``plans``, at most ``most`` of them."""
    from vllm.v1.attention.ops import turboquant_decode

    with (
        replaced(turboquant_decode, "_plans", plans),
        replaced(turboquant_decode, "MAX_PLANS", most),
    ):
        yield


def plans_off():
    """No decode plan is sent or kept: every decode call makes its checks
    and choices, as a batch shape's first call does."""
    return plans_in({}, 0)


def plan_saving(preset: str, device) -> dict:
    """Host µs of an eager decode step's forward (512 rows) making its
    checks and choices at every call against sending its plan: paired
    rounds in one process (``paired_host_us``). Both sides replace the plan
    map inside every call, so each pays the same for that."""
    from vllm.v1.attention.ops import turboquant_decode

    forward, _ = decode_step_calls(preset, device)
    kept: dict = {}

    def planning(plans, most):
        def call():
            with plans_in(plans, most):
                forward()

        return call

    most = turboquant_decode.MAX_PLANS
    return {"forward": paired_host_us(planning({}, 0), planning(kept, most))}


def _refuse_launch_keys(args):
    raise TypeError("benchmark: bind every launch")


def launch_keys_saving(preset: str, device) -> dict:
    """Host µs of an eager decode step's forward and cache update (512
    rows) with every ``CompiledLaunch`` binding its arguments again, as
    before it kept launch keys (patch 0026), against launches found by
    their key: paired rounds in one process (``paired_host_us``). The A side
    refuses each key as an argument that cannot be hashed would; both sides
    pay the same wrapper."""
    from vllm.triton_utils.compiled_launch import CompiledLaunch

    forward, update = decode_step_calls(preset, device)
    keyed = CompiledLaunch.__dict__["_args_key"]
    refused = staticmethod(_refuse_launch_keys)

    def keys(fn, args_key):
        def call():
            CompiledLaunch._args_key = args_key
            fn()

        return call

    try:
        return {
            name: paired_host_us(keys(fn, refused), keys(fn, keyed))
            for name, fn in (("forward", forward), ("update", update))
        }
    finally:
        CompiledLaunch._args_key = keyed


def launch_copying_options():
    """The Gluon stage 1's launch with its constexprs and launch options
    copied into keyword arguments at every launch, as release 64 launched
    it: the A side of ``launch_options_saving``. Its imports are made here,
    once, so that the A side pays for the copy and nothing else."""
    from vllm.triton_utils.compiled_launch import ByIdentity, launcher
    from vllm.v1.attention.ops.gluon_turboquant_decode import MAX_REGISTERS

    def launch(kernel, grid, args, constexprs):
        launcher(kernel).launch(
            grid,
            *args,
            variant=ByIdentity(constexprs),
            **constexprs,
            num_warps=constexprs["W"],
            maxnreg=MAX_REGISTERS,
            launch_pdl=constexprs["PDL"],
        )

    return launch


def launch_options_saving(preset: str, device) -> dict:
    """Host µs of an eager decode step's forward (512 rows) with the Gluon
    stage 1's options copied into keyword arguments at every launch against
    one mapping built once per configuration (``launch_with``): paired
    rounds in one process (``paired_host_us``). Both sides replace the
    launch function inside every call, so each pays the same for that."""
    from vllm.v1.attention.ops import gluon_turboquant_decode as gluon

    forward, _ = decode_step_calls(preset, device)

    def launching(launch):
        def call():
            with replaced(gluon, "_launch", launch):
                forward()

        return call

    return {
        "forward": paired_host_us(
            launching(launch_copying_options()), launching(gluon._launch)
        )
    }


def forward_breakdown(preset: str, device, profile_out=None) -> dict:
    """Host µs of an eager decode step's forward (512 rows): the whole call,
    and the same with its launches skipped (``launches_skipped``); the
    difference is what its launches cost the host."""
    forward, _ = decode_step_calls(preset, device)
    whole = host_and_gpu_us(forward)[0]
    with launches_skipped():
        python_only = host_and_gpu_us(forward)[0]
        if profile_out is not None:
            profile_out.write(
                f"\n## {preset} decode: forward with its launches skipped x 200"
                f"\n{hot_spots(forward, 200)}"
            )
    return dict(forward=whole, python_only=python_only, launches=whole - python_only)


# What a decode step's forward calls between its launches, each named by the
# module whose global its caller reads (a function imported by name is
# replaced where it was imported to). Outer calls first: each one's cost
# includes the calls under it.
DECODE_CALLEES = (
    (
        "vllm.v1.attention.backends.turboquant_attn",
        "triton_turboquant_decode_attention",
    ),
    ("vllm.v1.attention.ops.turboquant_decode", "maybe_decode_attention"),
    ("vllm.v1.attention.ops.turboquant_decode", "decode_attention"),
    ("vllm.v1.attention.ops.turboquant_decode", "is_backend_hadamard"),
    ("vllm.v1.attention.ops.turboquant_decode", "supports"),
    ("vllm.v1.attention.ops.turboquant_decode", "slot_layout"),
    ("vllm.v1.attention.ops.turboquant_decode", "check_key_offset"),
    ("vllm.v1.attention.ops.turboquant_decode", "gluon_stage1"),
    ("vllm.v1.attention.ops.turboquant_decode", "words_aligned"),
    ("vllm.v1.attention.ops.turboquant_decode", "num_sms"),
    ("vllm.v1.attention.ops.turboquant_decode", "gluon_num_splits"),
    ("vllm.v1.attention.ops.turboquant_decode", "scratch_splits"),
    ("vllm.v1.attention.ops.turboquant_decode", "scratch_view"),
    ("vllm.v1.attention.ops.turboquant_decode", "rotate_query"),
    ("vllm.v1.attention.ops.turboquant_decode", "rotate_query_with_offset"),
    ("vllm.v1.attention.ops.gluon_turboquant_decode", "serves"),
    ("vllm.v1.attention.ops.gluon_turboquant_decode", "key_table"),
    ("vllm.v1.attention.ops.gluon_turboquant_decode", "key_tails"),
    ("vllm.v1.attention.ops.gluon_turboquant_decode", "resident_warps"),
    ("vllm.v1.attention.ops.gluon_turboquant_decode", "stage1"),
    ("vllm.v1.attention.ops.triton_turboquant_decode_splitkv", "stage1"),
    ("vllm.v1.attention.ops.triton_turboquant_decode_splitkv", "merge"),
    ("vllm.v1.attention.ops.triton_turboquant_decode_splitkv", "rotate_output_back"),
)


def host_round(fn, calls: int) -> tuple[float, None]:
    """Host µs per call of ``fn``, without keeping the GPU busy: for calls
    that enqueue no kernel (every launch skipped)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e6 / calls, None


@contextlib.contextmanager
def replaced(module, name: str, fn):
    old = getattr(module, name)
    setattr(module, name, fn)
    try:
        yield
    finally:
        setattr(module, name, old)


def recorded_returns(call, targets) -> dict:
    """What each target returned, in order, over one ``call``; every target
    records at once, so an inner call made by an outer one counts too."""
    import importlib

    seen: dict = {}
    with contextlib.ExitStack() as stack:
        for module_name, name in targets:
            module = importlib.import_module(module_name)
            real = getattr(module, name)
            values = seen[module_name, name] = []

            def recording(*args, _real=real, _values=values, **kwargs):
                result = _real(*args, **kwargs)
                _values.append(result)
                return result

            stack.enter_context(replaced(module, name, recording))
        call()
    return seen


def _replaying(values: list):
    """A stand-in that returns ``values`` in turn, whatever it is passed."""
    it = itertools.cycle(values)
    return lambda *args, **kwargs: next(it)


def function_costs(call, targets, pair=paired_host_us) -> dict:
    """Host µs ``call`` saves when one target at a time returns what it
    returned before (``recorded_returns``) without running: its own Python
    and torch ops with everything it calls. Paired rounds (``pair``) of the
    call as it is against the call with that target replayed; the
    replacement is made inside every call on both sides, so each pays the
    same for it. None for a target the call does not reach."""
    import importlib

    out = {}
    for (module_name, name), values in recorded_returns(call, targets).items():
        label = f"{module_name.rsplit('.', 1)[-1]}.{name}"
        if not values:
            out[label] = None
            continue
        module = importlib.import_module(module_name)
        real = getattr(module, name)

        def run(fn, _module=module, _name=name):
            def timed():
                with replaced(_module, _name, fn):
                    call()

            return timed

        out[label] = pair(run(real), run(_replaying(values)))
    return out


def forward_by_function(preset: str, device) -> dict:
    """A decode step's forward (512 rows) with every launch skipped, and what
    it saves when one of ``DECODE_CALLEES`` returns its earlier result at
    once: where the forward's host time goes besides its launches, measured
    on GPU tensors (a CPU host's probe of the same code reads a quarter of
    the GPU host's figure; benchmarks/NOTES.md, "Host time")."""
    forward, _ = decode_step_calls(preset, device)
    with launches_skipped():
        # Warm-up: on an H200 host the first pass over three presets read up
        # to 1.8x the second, a few seconds later in the same process.
        host_round(forward, 10 * CALLS)
        whole = statistics.median(host_round(forward, CALLS)[0] for _ in range(ROUNDS))
        costs = function_costs(
            forward,
            DECODE_CALLEES,
            pair=lambda fa, fb: paired_host_us(fa, fb, timer=host_round),
        )
    return dict(
        forward_launches_skipped=whole,
        saved={k: (None if v is None else -v["b_minus_a"]) for k, v in costs.items()},
    )


def _step_text(step: dict) -> str:
    """A step's decode rows and first chunks, whichever it has."""
    parts = []
    if step["decodes"]:
        parts.append(f"{step['decodes']} decode rows x {step['context']}")
    if step["prefills"]:
        parts.append(f"{step['prefills']} first chunks x {step['prefill_len']}")
    return " + ".join(parts)


def _parts_table(title: str, by_preset: dict) -> list[str]:
    """A "by part" table: a row of µs per preset, a column per part."""
    parts = list(next(iter(by_preset.values())))
    out = ["", title, "", "| KV | " + " | ".join(parts) + " |"]
    out.append("|---" * (1 + len(parts)) + "|")
    for preset, us in by_preset.items():
        out.append(
            f"| {preset} | " + " | ".join(f"{v:.1f}" for v in us.values()) + " |"
        )
    return out


def _ab_table(title: str, sides: tuple[str, str], by_preset: dict) -> list[str]:
    """A paired A/B table (``paired_host_us``): a row per preset and call."""
    out = ["", title, "", f"| KV | call | {sides[0]} | {sides[1]} | saving |"]
    out.append("|---|---|---|---|---|")
    for preset, calls in by_preset.items():
        for call, ab in calls.items():
            out.append(
                f"| {preset} | {call} | {ab['a']:,.0f} ({ab['a_min']:,.0f}) "
                f"| {ab['b']:,.0f} ({ab['b_min']:,.0f}) | {-ab['b_minus_a']:,.1f} |"
            )
    return out


def markdown(
    device_name: str,
    rows: list[dict],
    launch: dict | None = None,
    store: dict | None = None,
    forward: dict | None = None,
    keys: dict | None = None,
    by_function: dict | None = None,
    options: dict | None = None,
    plans: dict | None = None,
) -> str:
    out = [
        f"# Host time per attention layer, eager steps ({device_name})",
        "",
        f"µs per call, medians of {ROUNDS} rounds of {CALLS} calls; host measured "
        "while the GPU sleeps, GPU from events over the same calls. Qwen3-4B "
        f"attention (32/8 x 128), pages of {PAGE}. Steps: "
        + "; ".join(f"{name} = {_step_text(s)}" for name, s in STEPS.items()),
        "",
        "| KV | step | build host | update host / gpu | forward host / gpu "
        "| layer host - gpu |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        build = f"{r['build'][0]:,.0f}" if "build" in r else "-"
        uh, ug = r["update"]
        fh, fg = r["forward"]
        out.append(
            f"| {r['kv']} | {r['step']} | {build} | {uh:,.0f} / {ug:,.0f} "
            f"| {fh:,.0f} / {fg:,.0f} | {uh + fh - ug - fg:+,.0f} |"
        )
    halves = [r for r in rows if "halves" in r]
    if halves:
        out += [
            "",
            "Mixed step, one process, rounds interleaved: the forward with the "
            "builder's decode and prefill halves (patch 0029) against the same "
            "metadata cut in every layer, median (minimum) µs of host time; the "
            "saving is the median of paired rounds; the cut alone once:",
            "",
            "| KV | cut in every layer | halves from the builder | saving | cut |",
            "|---|---|---|---|---|",
        ]
        for r in halves:
            h = r["halves"]
            out.append(
                f"| {r['kv']} | {h['b']:,.0f} ({h['b_min']:,.0f}) "
                f"| {h['a']:,.0f} ({h['a_min']:,.0f}) | {h['b_minus_a']:,.0f} "
                f"| {h['cut']:.1f} |"
            )
    if launch:
        out += _parts_table(
            "Host µs of one stage 1 launch (16 decode rows), by part:", launch
        )
    if store:
        out += _parts_table(
            "Host µs of the cache update of a decode step (512 rows), by part: the "
            "whole update; the same with its launch taking no time (the backend's "
            "Python); the store kernel's launch by part:",
            store,
        )
    if plans:
        out += _ab_table(
            "Decode step (512 rows), one process, rounds interleaved: every decode "
            "call making its checks and choices against sending the launches its "
            "batch shape planned (patch 0017), median (minimum) µs of host time; "
            "the saving is the median of paired rounds:",
            ("no plans", "plans"),
            plans,
        )
    if keys:
        out += _ab_table(
            "Decode step (512 rows), no plans, one process, rounds interleaved: "
            "binding every "
            "launch's arguments against launches found by their key (patch 0026), "
            "median (minimum) µs of host time; the saving is the median of paired "
            "rounds:",
            ("binding every launch", "by key"),
            keys,
        )
    if options:
        out += _ab_table(
            "Decode step (512 rows), no plans, one process, rounds interleaved: the "
            "Gluon "
            "stage 1's constexprs copied into keyword arguments at every launch "
            "against one mapping built once (`launch_with`), median (minimum) µs "
            "of host time; the saving is the median of paired rounds:",
            ("copied per launch", "one mapping"),
            options,
        )
    if forward:
        out += _parts_table(
            "Host µs of the forward of a decode step (512 rows), by part: the "
            "whole forward; the same with every launch skipped (the backend's "
            "Python and torch ops); the difference, its launches:",
            forward,
        )
    if by_function:
        presets = list(by_function)
        out += [
            "",
            "Decode step (512 rows), every launch skipped, no plans, one process, "
            "rounds "
            "interleaved: host µs of the forward, and what it saves when one "
            "function returns its earlier result at once (with all it calls; "
            "`-`: not called for this preset):",
            "",
            "| function | " + " | ".join(presets) + " |",
            "|---|" + "---|" * len(presets),
            "| the forward | "
            + " | ".join(
                f"{by_function[p]['forward_launches_skipped']:,.1f}" for p in presets
            )
            + " |",
        ]
        for fn in by_function[presets[0]]["saved"]:
            cells = [by_function[p]["saved"].get(fn) for p in presets]
            out.append(
                f"| `{fn}` | "
                + " | ".join("-" if c is None else f"{c:,.1f}" for c in cells)
                + " |"
            )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from vllm.model_executor.layers.quantization.turboquant.config import TQ_PRESETS

    parser.add_argument(
        "--presets",
        nargs="+",
        default=["turboquant_k8v4", "turboquant_4bit_nc"],
        choices=list(TQ_PRESETS),
    )
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    parser.add_argument(
        "--cprofile", action="store_true", help="print the forward's hot spots"
    )
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmark_turboquant_host.py needs a CUDA GPU: it times CUDA "
            "launches, and torch.cuda.is_available() is False; run it on a GPU "
            "host",
            file=sys.stderr,
        )
        return 1
    device = torch.device("cuda")
    # vLLM's engine core freezes the heap it built at start-up, so a step's
    # garbage collections walk only what steps allocate. Unfrozen, this
    # process's ~680,000 objects from its imports made collections that the
    # calls allocating more paid for (an A/B of one dict a launch read 11-31
    # µs here, 4-8 with the heap frozen; H200, release 65).
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    out_dir = Path(args.out or REPO / "benchmarks" / "runs")  # git-ignored
    out_dir.mkdir(parents=True, exist_ok=True)
    prof = io.StringIO() if args.cprofile else None
    launch = {p: launch_breakdown(p, device) for p in args.presets}
    store = {p: store_breakdown(p, device) for p in args.presets}
    forward = {p: forward_breakdown(p, device, prof) for p in args.presets}
    plans = {p: plan_saving(p, device) for p in args.presets}
    with plans_off():
        keys = {p: launch_keys_saving(p, device) for p in args.presets}
        options = {p: launch_options_saving(p, device) for p in args.presets}
        by_function = {p: forward_by_function(p, device) for p in args.presets}
    rows = []
    for step in args.steps:
        rows.append(dict(kv="auto", step=step, **measure_auto(step, device)))
        for preset in args.presets:
            rows.append(
                dict(
                    kv=preset,
                    step=step,
                    **measure_turboquant(preset, step, device, prof),
                )
            )
    name = torch.cuda.get_device_name()
    md = markdown(name, rows, launch, store, forward, keys, by_function, options, plans)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    payload = json.dumps(
        dict(
            device=name,
            steps=STEPS,
            rows=rows,
            launch=launch,
            store=store,
            forward=forward,
            launch_keys=keys,
            forward_by_function=by_function,
            launch_options=options,
            plans=plans,
        ),
        indent=1,
    )
    text = md + (f"\n## cProfile\n```\n{prof.getvalue()}```\n" if prof else "")
    # As the e2e harness writes its results: each file whole or not at all.
    for suffix, content in ((".json", payload), (".md", text)):
        final = out_dir / f"host-{stamp}{suffix}"
        tmp = final.with_name(final.name + ".tmp")
        tmp.write_text(content)
        os.replace(tmp, final)
    print(md)
    if prof is not None:
        print(prof.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
