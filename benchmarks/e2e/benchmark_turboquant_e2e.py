# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End-to-end TurboQuant vs bf16/fp8 KV cache: throughput, TTFT, TPOT, KV tokens.

One command on a GPU host with the patched vLLM installed, from the repo root
(the model configs come from tests/models/tiny_hybrids/full_size):

    python benchmarks/e2e/benchmark_turboquant_e2e.py --quick      # ~4-5 min, one H100
    python benchmarks/e2e/benchmark_turboquant_e2e.py              # the full table
    python benchmarks/e2e/benchmark_turboquant_e2e.py --quick --profile # + profile

Each (model, KV dtype) configuration runs in its own process (an engine owns
the GPU for its lifetime) with dummy weights and no tokenizer: prompts are
random token ids, ``ignore_eos`` fixes every output length. Inside a process
every scenario runs ``--repeats`` times after one warm-up request; all its
prompts are submitted at once (offline throughput; TTFT includes queueing).
Per scenario: output tokens/s, TTFT and TPOT median and p90 over requests
(median over repeats), spread of tokens/s over repeats, and every figure's
ratio to ``auto`` from the same run; the engine's "GPU KV cache size" line
gives KV tokens. ``--profile`` adds, per configuration, one more process
whose engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so
``torch.profiler`` sees its kernels, CUDA-graph replays included) and runs
each scenario once more under the profiler: GPU time per output step by
kernel class (attention, KV store, GEMM, other) and the wall time per step,
so the gap to ``auto`` splits into kernels and host time (issue 10, item 3);
a profiled pass generates at most ``PROFILE_STEPS`` tokens per sequence.
``--lanes`` spreads the table over several GPUs of one host: one harness
process per lane, each on its own GPU with its own ``auto``, so every ratio
is taken on one GPU; their rows merge into one result. Runs made apart (the
full table in parts, one device call each) join into one table with
``combine_turboquant_e2e.py``, each ratio kept against its own run's ``auto``.
``--interleave`` keeps every KV dtype's engine resident at once (an equal
share of the memory each) and runs each repeat on all of them in turn, so a
drift over minutes meets every configuration alike; it adds a table of each
repeat's figure over auto's same repeat.
A KV dtype written ``KV+pc`` or ``KV+nopc`` runs with prefix caching on or
off (``--kv auto+nopc auto+pc turboquant_4bit_nc+nopc turboquant_4bit_nc+pc
--scenarios shared-prefix``: chat or agent requests that resend one long
prefix); each ``+pc`` row gets its ratio over the ``+nopc`` row of the same
KV dtype, in a table of its own (issue 47).
Results: e2e-<time>.json and .md in ``--out``, else $OUT, else
benchmarks/runs/ (git-ignored), with
device and versions; ``--keep-logs`` also writes each configuration's engine
log there (per-repeat tok/s, warnings). The JSON also keeps each scenario's
median time in the engine core's queue (``queue_median_s``, over auto as
``queue_median_s_vs_auto``), the part of TTFT that earlier requests' steps
make. Dummy weights make outputs meaningless
(and repetitive), which is fine for speed, not for quality.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRESETS = [
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
]
KV_DTYPES = ["auto", "fp8", *PRESETS]
# A KV dtype with one of these suffixes runs with prefix caching on or off
# (``auto+pc``, ``turboquant_4bit_nc+nopc``); without one, with the engine's
# default (on for dense models, off for hybrids in vLLM 0.20.2).
PREFIX_CACHING = {"+pc": True, "+nopc": False}
KV_CONFIGS = [*KV_DTYPES, *(kv + s for kv in KV_DTYPES for s in PREFIX_CACHING)]
MODELS = {
    # label: (full-size record in tests/models/tiny_hybrids/full_size, engine extras)
    "Qwen3-4B": ("Qwen3-4B", {}),
    "Qwen3.6-27B": ("Qwen3.6-27B", {"language_model_only": True}),
}
# name: (prompts, input tokens, output tokens)
SCENARIOS = {
    "short-decode": (64, 128, 512),
    "long-prefill": (16, 4096, 128),
    "mixed": (64, 512, 512),
    "high-load": (500, 512, 128),
    "very-long-prefill": (16, 8192, 64),
    "decode-heavy": (32, 64, 1024),
    "long-ctx-1": (1, 32768, 256),
    "long-ctx-16": (16, 32768, 256),
    "long-ctx-64": (64, 32768, 256),
    # 8,192 tokens every prompt shares (SHARED_PREFIX), then 512 of its own.
    "shared-prefix": (32, 8704, 128),
    # decode-heavy's prompts with one output token: its TTFT alone, one prefill
    # step of 32 x 64 tokens, cheap enough to repeat dozens of times. Single
    # steps spread 24-145 % between repeats (max - min over median, H100), so
    # decode-heavy's own 1-5 repeats read its TTFT anywhere in 0.91-1.56x of
    # auto for the same code.
    "first-token": (32, 64, 1),
}
# name: tokens every prompt of the scenario shares at its start (a system
# prompt and earlier turns of a chat or an agent). Drawn anew for each repeat,
# so a repeat starts cold: its first prompts compute the prefix and, with
# prefix caching on, the others read it from the cache.
SHARED_PREFIX = {"shared-prefix": 8192}
QUICK = dict(
    models=["Qwen3-4B"],
    kv=["auto", "turboquant_k8v4", "turboquant_4bit_nc"],
    scenarios=["short-decode", "decode-heavy", "long-ctx-1"],
    # One timed repeat after the warm-up: three engine starts (~1-1.5 min
    # each: dummy init, torch.compile, graph capture) are most of the time.
    repeats=1,
)
_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
# Kernel classes of the per-step profile, first match wins (the cache write
# kernels first: FlashAttention's is named reshape_and_cache_flash). 0.20.2's
# TurboQuant query rotation is a cuBLAS GEMM (GEMM time above auto's); the
# in-register one (_tq_rotate_query) counts as attention, as do the Gluon
# decode stage 1 (named _stage1) and the dequantization of cached K/V that a
# continuation chunk attends to (_tq_full_dequant_kv).
KERNEL_CLASSES = [
    (
        "kv_store",
        re.compile(r"reshape_and_cache|tq_store|tq_fused_store|concat_and_cache", re.I),
    ),
    (
        "attention",
        re.compile(
            r"tq_decode|tq_rotate|tq_full_dequant|^_stage1$|_fwd_kernel_stage|flash"
            r"|fmha|attn",
            re.I,
        ),
    ),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|sm90_|matmul", re.I)),
]
_RESULT = "HYBRIDKV_E2E_RESULT "
_PROFILE = "HYBRIDKV_E2E_PROFILE "
_REPLY = "HYBRIDKV_E2E_REPLY "
# Output steps of a profiled pass: enough to see the decode steps, few enough
# that the trace (~500 kernels per step on the Qwen3-4B shape) stays small.
PROFILE_STEPS = 64
PROFILE_TOP = 15
# Set (to anything) with --profile/--profile-only: one more pass per scenario
# under cProfile, printed to the engine's log (--keep-logs keeps it).
HOST_PROFILE_ENV = "HYBRIDKV_E2E_HOST_PROFILE"
# Per-repeat figures an --interleave run pairs with auto's same repeat.
PAIRED = ("output_tok_s", "ttft_median_s", "prefill_median_s")


def percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def kernel_class(name: str) -> str:
    for label, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return label
    return "other"


def step_profile(kernels, steps: int, wall_s: float) -> dict:
    """GPU time per output step by kernel class, from (name, microseconds).

    ``steps`` is the number of engine steps that produced output tokens (one
    per output token when the whole batch decodes together); "gap" is wall
    time per step the kernels do not cover (host work, launch gaps).
    """
    if steps <= 0:
        raise ValueError(f"a step profile needs at least one output step, got {steps}")
    per = {label: 0.0 for label, _ in KERNEL_CLASSES}
    per["other"] = 0.0
    for name, us in kernels:
        per[kernel_class(name)] += us
    out = {k: v / steps for k, v in per.items()}
    out["gpu"] = sum(per.values()) / steps
    out["wall"] = wall_s * 1e6 / steps
    out["gap"] = out["wall"] - out["gpu"]
    return out


def host_profile(run, lines: int = 40) -> str:
    """cProfile of ``run()``: the functions with the most own time, then the
    most cumulative time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(run)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)
    return text.getvalue()


# ---------------------------------------------------------------- child ----


def generate_from_full_queue(llm, batch, params) -> list:
    """``llm.generate(batch, params)`` with every request queued before the
    engine core's first step.

    The engine core steps as soon as a request reaches it, so under
    ``generate`` the first prefill step holds however many requests have
    arrived and the rest wait for it: TTFT then times that race (auto's
    decode-heavy median TTFT read 46, 53 and 72 ms in three sessions). A
    level-0 sleep pauses scheduling only; requests queue until the wake-up.
    """
    llm.sleep(level=0, mode="keep")
    try:
        llm.enqueue(batch, params, use_tqdm=False)
    finally:
        llm.wake_up(tags=["scheduling"])
    return llm.wait_for_completion(use_tqdm=False)


def request_times(outs) -> tuple[list[float], list[float], list[float]]:
    """Per request of a repeat: TTFT, prefill and TPOT in seconds.

    TTFT runs from the request's arrival in this process to its first
    token here, so it holds the queue and the hand-off to the engine core as
    well as the prefill. Prefill is vLLM's prefill_time, first scheduled to
    first token on the engine core's clock: the step(s) alone, which tells a
    slow step from a slow hand-off.
    """
    ttft, prefill, tpot = [], [], []
    for o in outs:
        m = o.metrics
        if m is None:
            continue
        if m.first_token_latency:
            ttft.append(m.first_token_latency)
        if m.first_token_ts > m.scheduled_ts > 0:
            prefill.append(m.first_token_ts - m.scheduled_ts)
        k = len(o.outputs[0].token_ids)
        if k > 1 and m.last_token_ts > m.first_token_ts:
            tpot.append((m.last_token_ts - m.first_token_ts) / (k - 1))
    return ttft, prefill, tpot


def queue_times(outs) -> list[float]:
    """Per request of a repeat: seconds from the engine core's queue to its
    first scheduling (vLLM's queued_time, on the engine core's clock). With
    ``request_times``' prefill it takes TTFT apart: TTFT = hand-off + queue
    + prefill, where the queue is the earlier requests' steps."""
    waits = []
    for o in outs:
        m = o.metrics
        queued = getattr(m, "queued_ts", 0.0) if m is not None else 0.0
        if queued > 0 and m.scheduled_ts >= queued:
            waits.append(m.scheduled_ts - queued)
    return waits


def gpu_state() -> dict:
    """The engine's GPU right after a repeat: SM clock (MHz), temperature (C)
    and power (W), read through NVML (no CUDA context in this process). A
    compute-bound prefill step would slow with the SM clock where decode
    steps, bound by memory, barely do: these tell a slowed GPU from a slow
    step (40 one-step repeats of one KV dtype read 35-98 ms in runs of slow
    and fast ones on an H100, the slowest at full clock)."""
    import torch

    try:
        return dict(
            sm_mhz=torch.cuda.clock_rate(0),
            temp_c=torch.cuda.temperature(0),
            power_w=torch.cuda.power_draw(0) / 1000,
        )
    except Exception as e:  # noqa: BLE001 - kept in the results instead
        return dict(gpu_state_error=f"{type(e).__name__}: {e}")


def default_max_num_seqs(submitted: int) -> int:
    """Sequences an engine runs at once unless --max-num-seqs says: the most a
    scenario submits (at least 16, at most 512, fewer CUDA graphs to capture
    than vLLM's default 1,024 on a large GPU), rounded up to vLLM's default
    capture grid (steps of 8 below 256 rows, 16 from there), so a decode step
    of every sequence replays a grid-sized FULL graph as at vLLM's default.
    Off the grid, vLLM 0.20.2 keeps FULL decode graphs only up to the grid's
    size below (500 sequences: 496) unless patch 0030 captures the width
    itself; --max-num-seqs 500 measures that case."""
    n = min(max(16, submitted), 512)
    step = 8 if n < 256 else 16
    return -(-n // step) * step


def kv_config(label: str) -> tuple[str, bool | None]:
    """(KV dtype, prefix caching on / off / the engine's default) of a
    configuration label such as ``turboquant_4bit_nc+pc``."""
    for suffix, on in PREFIX_CACHING.items():
        if label.endswith(suffix):
            return label.removesuffix(suffix), on
    return label, None


def prompt_maker(rng, vocab: int):
    """``prompts(n, length, shared=0)``: ``n`` prompts of random token ids,
    the first ``shared`` of them the same in every prompt of the call."""
    from vllm.inputs import TokensPrompt

    def tokens(length):
        return [rng.randrange(100, vocab - 100) for _ in range(length)]

    def prompts(n, length, shared=0):
        prefix = tokens(shared)
        return [
            TokensPrompt(prompt_token_ids=prefix + tokens(length - shared))
            for _ in range(n)
        ]

    return prompts


@contextlib.contextmanager
def engine(spec: dict):
    """The configuration's engine, warmed up, and a prompt maker of random
    token ids: ``(llm, prompts)``; shut down on the way out."""
    import random

    from vllm import LLM, SamplingParams

    sys.path.insert(0, str(REPO))
    from tests.models.tiny_hybrids.shapes import load_full_size, write_full_size_config

    if spec.get("profile"):
        # The engine in this process: the profiler sees its kernels.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    record, extras = MODELS[spec["model"]]
    cfg = load_full_size(record)
    vocab = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
    scenarios = {name: SCENARIOS[name] for name in spec["scenarios"]}
    max_len = max(i + o for _, i, o in scenarios.values()) + 16
    max_seqs = spec.get("max_num_seqs") or default_max_num_seqs(
        max(n for n, _, _ in scenarios.values())
    )
    kv, prefix_caching = kv_config(spec["kv"])
    if prefix_caching is not None:
        extras = {**extras, "enable_prefix_caching": prefix_caching}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_full_size_config(record, tmp)
        llm = LLM(
            model=str(model_dir),
            load_format="dummy",
            skip_tokenizer_init=True,
            kv_cache_dtype=kv,
            max_model_len=max_len,
            max_num_seqs=max_seqs,
            gpu_memory_utilization=spec["gpu_memory_utilization"],
            disable_log_stats=False,
            seed=0,
            **extras,
        )
        prompts = prompt_maker(random.Random(0), vocab)

        warm = SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False)
        llm.generate(prompts(2, 64), warm, use_tqdm=False)
        yield llm, prompts
        # Free the GPU before this process exits without teardown (main()).
        try:
            llm.llm_engine.engine_core.shutdown(timeout=60)
        except Exception as e:  # noqa: BLE001 - best effort
            print(f"engine shutdown: {type(e).__name__}: {e}", flush=True)


def scenario_params(out_len: int):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=out_len, ignore_eos=True, detokenize=False, temperature=0.0
    )


def timed_repeat(llm, batch, params) -> dict:
    """One repeat of a scenario: every prompt queued, then timed to the end."""
    t0 = time.perf_counter()
    outs = generate_from_full_queue(llm, batch, params)
    wall = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft, prefill, tpot = request_times(outs)
    return dict(
        wall_s=wall,
        output_tokens=gen,
        output_tok_s=gen / wall,
        ttft_median_s=percentile(ttft, 0.5),
        ttft_p90_s=percentile(ttft, 0.9),
        prefill_median_s=percentile(prefill, 0.5),
        queue_median_s=percentile(queue_times(outs), 0.5),
        tpot_median_s=percentile(tpot, 0.5),
        tpot_p90_s=percentile(tpot, 0.9),
        gpu=gpu_state(),
    )


def run_child(spec: dict) -> dict:
    """One engine, every scenario of the spec; returns per-scenario figures."""
    results = {}
    with engine(spec) as (llm, prompts):
        for name in spec["scenarios"]:
            n, in_len, out_len = SCENARIOS[name]
            shared = SHARED_PREFIX.get(name, 0)
            params = scenario_params(out_len)
            if spec.get("profile"):
                params.max_tokens = min(out_len, PROFILE_STEPS)
                # Prompts of its own for the profiled pass: the untimed
                # pass's would come from the prefix cache (a prompt of whole
                # blocks recomputes only its last token), hiding the prefill.
                results[name] = profile_scenario(
                    llm,
                    prompts(n, in_len, shared),
                    prompts(n, in_len, shared),
                    params,
                    prompts(n, in_len, shared)
                    if os.environ.get(HOST_PROFILE_ENV)
                    else None,
                )
                print(
                    _PROFILE + json.dumps(dict(scenario=name, **results[name][0])),
                    flush=True,
                )
                continue
            reps = [
                timed_repeat(llm, prompts(n, in_len, shared), params)
                for _ in range(spec["repeats"])
            ]
            results[name] = reps
            print(
                f"[{spec['model']} {spec['kv']}] {name}: "
                + ", ".join(f"{r['output_tok_s']:.0f} tok/s" for r in reps),
                flush=True,
            )
    return results


def serve_child(spec: dict) -> None:
    """One engine that runs one repeat of a scenario per request line on
    stdin (JSON ``{"scenario": name}``) and answers each on stdout; an empty
    line or EOF ends it. The parent alternates such engines (--interleave)."""
    with engine(spec) as (llm, prompts):
        _reply(ready=True)
        for line in sys.stdin:
            if not line.strip():
                break
            name = json.loads(line)["scenario"]
            n, in_len, out_len = SCENARIOS[name]
            batch = prompts(n, in_len, SHARED_PREFIX.get(name, 0))
            rep = timed_repeat(llm, batch, scenario_params(out_len))
            _reply(scenario=name, repeat=rep)


def _reply(**msg) -> None:
    print(_REPLY + json.dumps(msg), flush=True)


def profile_scenario(llm, untimed, profiled, params, host=None) -> list[dict]:
    """One untimed pass, then one under torch.profiler over other prompts of
    the same shape: a step profile, as a list of one (the shape of the timed
    runs' per-repeat results). With ``host`` prompts, one more pass under
    cProfile prints where the engine's host time goes (the step profile's
    "gap"): cProfile slows Python, so it gets a pass of its own."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    llm.generate(untimed, params, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(profiled, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    kernels = [
        (e.name, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]
    prof_row = step_profile(kernels, params.max_tokens, wall)
    if host is not None:
        print(host_profile(lambda: llm.generate(host, params, use_tqdm=False)))
    prof_row["kernels"] = len(kernels)
    # The longest kernels by total time, for the notes: enough to place the
    # small per-layer launches (merge, rotation, store) beside the GEMMs.
    totals = {}
    for name, us in kernels:
        totals[name] = totals.get(name, 0.0) + us
    prof_row["top"] = [
        [name[:80], round(us / params.max_tokens, 1)]
        for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:PROFILE_TOP]
    ]
    return [prof_row]


# --------------------------------------------------------------- parent ----


def spread(xs: list[float]) -> float | None:
    """(max - min) / median of a figure over repeats; None for one repeat."""
    return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else None


def summarize(reps: list[dict]) -> dict:
    def med(key):
        xs = [r[key] for r in reps if r.get(key) is not None]
        return statistics.median(xs) if xs else None

    toks = [r["output_tok_s"] for r in reps]
    # Each repeat's median TTFT is kept: a scenario whose TTFT is one
    # prefill step (decode-heavy's 32 x 64 tokens: ~40 ms) read 1.01x to
    # 1.56x of auto across runs of the same code.
    ttfts = [r["ttft_median_s"] for r in reps if r["ttft_median_s"] is not None]
    return dict(
        repeats=len(reps),
        output_tok_s=statistics.median(toks),
        output_tok_s_spread=spread(toks),
        output_tok_s_reps=toks,
        ttft_median_s_reps=ttfts,
        ttft_median_s_spread=spread(ttfts),
        prefill_median_s_reps=[r.get("prefill_median_s") for r in reps],
        queue_median_s_reps=[r.get("queue_median_s") for r in reps],
        gpu_reps=[r.get("gpu") for r in reps],
        ttft_median_s=med("ttft_median_s"),
        ttft_p90_s=med("ttft_p90_s"),
        prefill_median_s=med("prefill_median_s"),
        queue_median_s=med("queue_median_s"),
        tpot_median_s=med("tpot_median_s"),
        tpot_p90_s=med("tpot_p90_s"),
    )


def run_process_group(
    cmd: list[str], timeout: float, env: dict
) -> tuple[str, int | str]:
    """(log, return code or "timeout") of one configuration's process.

    It runs in a process group of its own, killed whole on timeout: its
    engine core is a process of its own, and left running it holds its GPU
    memory, so the next configuration's engine failed to start.
    """
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return out + err, proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return out + err, "timeout"
    except BaseException:
        # Ctrl-C reaches this process only: the group is out of the
        # terminal's, so it goes down with the harness here.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise


def child_env() -> dict:
    """A configuration process's environment: this one, with the repo
    appended to PYTHONPATH for the model configs under tests/. The repo's
    vllm/ has no __init__.py, so the installed vllm package still wins."""
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            p for p in (os.environ.get("PYTHONPATH", ""), str(REPO)) if p
        ),
    )


def run_config(model, kv, scenarios, args, profile=False) -> dict:
    spec = dict(
        model=model,
        kv=kv,
        scenarios=scenarios,
        repeats=args.repeats,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        profile=profile,
    )
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    t0 = time.time()
    env = child_env()
    log, rc = run_process_group(cmd, args.timeout, env)
    row = dict(model=model, kv=kv, rc=rc, wall_s=round(time.time() - t0, 1))
    if args.keep_logs:
        # Engine logs say what a figure cannot (JIT compiles, warnings).
        name = f"e2e-{model}-{kv}{'-profile' if profile else ''}.log"
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, name).write_text(log)
    m = _KV_TOKENS.findall(log)
    row["kv_tokens"] = int(m[-1].replace(",", "")) if m else None
    res = [line for line in log.splitlines() if line.startswith(_RESULT)]
    if res:
        found = json.loads(res[-1][len(_RESULT) :])
        row["device"] = found.pop("_device", None)
        if profile:
            row["profile"] = {name: reps[0] for name, reps in found.items()}
        else:
            row["scenarios"] = {name: summarize(reps) for name, reps in found.items()}
    else:
        row["error_tail"] = log[-3000:]
    return row


class EngineGone(Exception):
    """A served engine that ended, or ran out of time, before its reply;
    ``rc`` is its return code or "timeout". It has been killed."""

    def __init__(self, rc: int | str, message: str):
        super().__init__(message)
        self.rc = rc


class ServedConfig:
    """One configuration's process under --interleave: an engine that runs a
    scenario's repeat per request (serve_child). Its output is read on a
    thread, so a reply can be awaited with a time limit and the log is kept.
    The limit (--timeout) holds for each reply, the engine's start or one
    repeat, not for the process's life: the engines wait for each other."""

    def __init__(self, cmd: list[str], env: dict, timeout: float):
        self.timeout = timeout
        self.started = time.time()
        self.log: list[str] = []
        self._replies: queue.Queue = queue.Queue()
        # A process group of its own, as in run_process_group: the engine
        # core must go down with it.
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith(_REPLY):
                self._replies.put(json.loads(line[len(_REPLY) :]))
        self._replies.put(None)

    def reply(self) -> dict:
        """The next reply; EngineGone when the process ends or runs out of
        time first."""
        try:
            msg = self._replies.get(timeout=self.timeout)
        except queue.Empty:
            self.kill()
            raise EngineGone("timeout", "timeout") from None
        if msg is None:
            self.kill()  # its engine core may outlive it
            rc = self.proc.returncode
            raise EngineGone(rc, f"exited with rc {rc}")
        return msg

    def ask(self, scenario: str) -> dict:
        try:
            self.proc.stdin.write(json.dumps(dict(scenario=scenario)) + "\n")
            self.proc.stdin.flush()
        except OSError:  # it has gone: reply() says how
            pass
        return self.reply()["repeat"]

    def finish(self) -> dict:
        """Ends the engine; its last reply names the device."""
        with contextlib.suppress(OSError):
            self.proc.stdin.write("\n")
            self.proc.stdin.close()
        done = self.reply()
        try:
            self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired as e:
            self.kill()
            raise EngineGone(self.proc.returncode, str(e)) from None
        return done

    def kill(self):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def served_command(spec: dict) -> list[str]:
    return [sys.executable, __file__, "--serve", json.dumps(spec)]


def run_interleaved(model, kvs, scenarios, args) -> list[dict]:
    """Every KV dtype's engine resident at once, each with an equal share of
    --gpu-memory-utilization, started one after another (an engine sizes its
    KV cache from the memory free when it starts); then each repeat of a
    scenario runs once on every engine, in an order that rotates, before the
    next repeat. One-step TTFT drifted in runs of slow repeats over minutes
    (17-145 % spreads), which back-to-back configurations each met at other
    times; alternated repeats meet the same drift."""
    env = child_env()
    served, rows = {}, {}
    for kv in kvs:
        spec = dict(
            model=model,
            kv=kv,
            scenarios=scenarios,
            gpu_memory_utilization=args.gpu_memory_utilization / len(kvs),
            max_num_seqs=args.max_num_seqs,
        )
        cfg = ServedConfig(served_command(spec), env, args.timeout)
        rows[kv] = dict(model=model, kv=kv, rc=None, interleaved=True)
        try:
            cfg.reply()
            served[kv] = cfg
            print(f"{model} {kv}: engine ready", flush=True)
        except EngineGone as e:
            _close_row(rows[kv], cfg, args, e)
    reps = {kv: {name: [] for name in scenarios} for kv in served}
    for name in scenarios:
        for i in range(args.repeats):
            order = kvs[i % len(kvs) :] + kvs[: i % len(kvs)]
            for kv in order:
                if kv not in served:
                    continue
                try:
                    reps[kv][name].append(served[kv].ask(name))
                except EngineGone as e:
                    _close_row(rows[kv], served.pop(kv), args, e)
        for kv in served:
            toks = [r["output_tok_s"] for r in reps[kv][name]]
            print(
                f"[{model} {kv}] {name}: {statistics.median(toks):.0f} tok/s "
                f"(median of {len(toks)}, {min(toks):.0f}-{max(toks):.0f})",
                flush=True,
            )
    for kv, cfg in served.items():
        try:
            rows[kv]["device"] = cfg.finish().get("device")
            rows[kv]["scenarios"] = {n: summarize(r) for n, r in reps[kv].items()}
            _close_row(rows[kv], cfg, args, None)
        except EngineGone as e:
            _close_row(rows[kv], cfg, args, e)
    return [rows[kv] for kv in kvs]


def _close_row(row, cfg, args, error: EngineGone | None):
    """Fills a configuration's row from its ended (or failed) process."""
    row["rc"] = cfg.proc.returncode if error is None else error.rc
    row["wall_s"] = round(time.time() - cfg.started, 1)
    log = "".join(cfg.log)
    if args.keep_logs:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = f"e2e-{row['model']}-{row['kv']}-interleaved.log"
        Path(args.out, name).write_text(log)
    m = _KV_TOKENS.findall(log)
    row["kv_tokens"] = int(m[-1].replace(",", "")) if m else None
    if "scenarios" not in row:
        row["error_tail"] = (f"{error}\n" if error else "") + log[-3000:]


def auto_labels(kv: str) -> tuple[str, ...]:
    """The rows a ``kv`` row's ratios are taken against, first found first:
    auto with the same prefix caching suffix, else plain auto."""
    suffix = kv.removeprefix(kv_config(kv)[0])
    return ("auto" + suffix, "auto") if suffix else ("auto",)


def add_ratios(rows):
    # Per GPU where --lanes ran them: two cards of one model differ by a few
    # per cent under load, which a ratio across them would carry. Per run
    # where combine_turboquant_e2e.py joined several.
    def same_gpu(r):
        return r["model"], r.get("gpu"), r.get("run")

    done = [r for r in rows if "scenarios" in r]
    by_label = {(*same_gpu(r), r["kv"]): r for r in done}
    for r in done:
        kv, on = kv_config(r["kv"])
        if on:
            off = by_label.get((*same_gpu(r), kv + "+nopc"))
            for name, s in r["scenarios"].items():
                bs = (off or {}).get("scenarios", {}).get(name, {})
                for key in ("output_tok_s", "ttft_median_s", "prefill_median_s"):
                    if s.get(key) and bs.get(key):
                        s[key + "_vs_pc_off"] = s[key] / bs[key]
    for r in done:
        b = next(
            (
                by_label[key]
                for label in auto_labels(r["kv"])
                if (key := (*same_gpu(r), label)) in by_label
            ),
            None,
        )
        if not b:
            continue
        if b.get("kv_tokens") and r.get("kv_tokens"):
            r["kv_tokens_ratio"] = r["kv_tokens"] / b["kv_tokens"]
        for name, s in r["scenarios"].items():
            bs = b["scenarios"].get(name)
            if not bs:
                continue
            for key in (
                "output_tok_s",
                "ttft_median_s",
                "ttft_p90_s",
                "prefill_median_s",
                "queue_median_s",
                "tpot_median_s",
                "tpot_p90_s",
            ):
                if s.get(key) and bs.get(key):
                    s[key + "_vs_auto"] = s[key] / bs[key]
            if r.get("interleaved") and b.get("interleaved"):
                for key in PAIRED:
                    s[key + "_paired"] = paired_ratios(
                        s.get(key + "_reps"), bs.get(key + "_reps")
                    )


def paired_ratios(xs, base) -> dict | None:
    """Median and quartiles of repeat i's figure over auto's repeat i: with
    --interleave the two ran seconds apart, so drift that moves both cancels
    here where it does not in a ratio of medians."""
    ratios = [x / b for x, b in zip(xs or [], base or []) if x and b]
    if not ratios:
        return None
    return dict(
        n=len(ratios),
        median=percentile(ratios, 0.5),
        q25=percentile(ratios, 0.25),
        q75=percentile(ratios, 0.75),
    )


def fmt(x, spec=".2f", scale=1.0):
    return "n/a" if x is None else format(x * scale, spec)


def markdown(meta, rows):
    out = [
        f"# TurboQuant end-to-end ({meta['time']})",
        "",
        (
            f"Device: {meta['device']}; vLLM {meta['vllm']}, torch {meta['torch']}; "
            f"dummy weights, {meta['repeats']} repeat(s) per scenario, offline batch "
            "(every prompt queued before the first step; TTFT from that queue). "
            "Ratios are to `auto` in this run; spread = (max - min) / median over "
            "repeats, of tok/s and of the median TTFT; prefill = first scheduled "
            "to first token on the engine core's clock (TTFT without the queue "
            "and the hand-off), median of the repeats' medians."
            + (
                f" Engines ran at most {meta['max_num_seqs']} sequences at once "
                "(--max-num-seqs)."
                if meta.get("max_num_seqs")
                else ""
            )
        ),
        "",
        (
            "| model | KV | KV tokens (x auto) | scenario | out tok/s (x auto) "
            "| spread tok/s / TTFT | TTFT med / p90 ms (x auto) "
            "| prefill med ms (x auto) | TPOT med / p90 ms (x auto) |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if meta.get("lanes"):
        out[2] += (
            " Each lane ran on its own GPU with its own `auto`: ratios are to the "
            "`auto` on the same GPU (the model column names it)."
        )
    if meta.get("runs"):
        out[2] += (
            " The table joins several runs (combine_turboquant_e2e.py), each with "
            "its own `auto`: ratios are to the `auto` of the same run (the model "
            "column names it)."
        )
    for r in rows:
        model = r["model"] if r.get("gpu") is None else f"{r['model']} (GPU {r['gpu']})"
        kvt = f"{r['kv_tokens']:,}" if r.get("kv_tokens") else "n/a"
        if r.get("kv_tokens_ratio"):
            kvt += f" ({r['kv_tokens_ratio']:.2f}x)"
        if "scenarios" not in r:
            out.append(
                f"| {model} | {r['kv']} | {kvt} | FAILED (rc {r['rc']}) | | | | | |"
            )
            continue
        for name, s in r["scenarios"].items():
            tok = fmt(s["output_tok_s"], ",.0f")
            ttft = "{} / {}".format(
                fmt(s["ttft_median_s"], ",.0f", 1e3), fmt(s["ttft_p90_s"], ",.0f", 1e3)
            )
            tpot = "{} / {}".format(
                fmt(s["tpot_median_s"], ".2f", 1e3), fmt(s["tpot_p90_s"], ".2f", 1e3)
            )
            out.append(
                f"| {model} | {r['kv']} | {kvt} | {name} | "
                f"{tok} ({fmt(s.get('output_tok_s_vs_auto'))}x) | "
                f"{fmt(s['output_tok_s_spread'], '.1%')} / "
                f"{fmt(s.get('ttft_median_s_spread'), '.0%')} | "
                f"{ttft} ({fmt(s.get('ttft_median_s_vs_auto'))}x) | "
                f"{fmt(s.get('prefill_median_s'), ',.1f', 1e3)} "
                f"({fmt(s.get('prefill_median_s_vs_auto'))}x) | "
                f"{tpot} ({fmt(s.get('tpot_median_s_vs_auto'))}x) |"
            )
    cached = [
        (r, name, s)
        for r in rows
        for name, s in r.get("scenarios", {}).items()
        if s.get("output_tok_s_vs_pc_off")
    ]
    if cached:
        out += [
            "",
            "## Prefix caching on over off",
            "",
            (
                "Each `+pc` configuration over the same KV dtype's `+nopc` on the "
                "same GPU (`shared-prefix`: 32 prompts that share their first "
                f"{SHARED_PREFIX['shared-prefix']:,} tokens)."
            ),
            "",
            "| model | KV | scenario | out tok/s | TTFT median | prefill median |",
            "|---|---|---|---|---|---|",
        ]
        for r, name, s in cached:
            out.append(
                f"| {r['model']} | {kv_config(r['kv'])[0]} | {name} | "
                f"{fmt(s.get('output_tok_s_vs_pc_off'))}x | "
                f"{fmt(s.get('ttft_median_s_vs_pc_off'))}x | "
                f"{fmt(s.get('prefill_median_s_vs_pc_off'))}x |"
            )
    paired = [r for r in rows if r.get("interleaved") and r["kv"] != "auto"]
    if any("scenarios" in r for r in paired):
        out += [
            "",
            "## Interleaved repeats: each repeat over auto's same repeat",
            "",
            (
                "Every KV dtype's engine was resident at once (an equal share of "
                "the memory: KV tokens are not comparable to a run without "
                "--interleave) and each repeat ran on every engine in turn. "
                "Median of the per-repeat ratios, quartiles in brackets."
            ),
            "",
            "| model | KV | scenario | repeats | tok/s | TTFT | prefill |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in paired:
            for name, s in r.get("scenarios", {}).items():
                cells = []
                for key in PAIRED:
                    q = s.get(key + "_paired")
                    cells.append(
                        "n/a"
                        if q is None
                        else f"{q['median']:.2f}x ({q['q25']:.2f}-{q['q75']:.2f})"
                    )
                out.append(
                    f"| {r['model']} | {r['kv']} | {name} | {s['repeats']} | "
                    + " | ".join(cells)
                    + " |"
                )
    return "\n".join(out) + "\n"


def write_results(out, stamp, meta, rows, profiles, start):
    """JSON + Markdown of every configuration so far, each file replaced whole.

    Called after every configuration, so a run cut short by its time limit
    still leaves the finished configurations behind.
    """
    add_ratios(rows)
    meta["device"] = next(
        (r["device"] for r in rows + profiles if r.get("device")), "unknown"
    )
    meta["wall_s"] = round(time.time() - start, 1)
    md = markdown(meta, rows) if rows else f"# TurboQuant end-to-end ({meta['time']})\n"
    if profiles:
        md += "\n" + profile_markdown(meta, profiles)
    payload = json.dumps(dict(meta=meta, rows=rows, profiles=profiles), indent=1)
    write_whole(out / f"e2e-{stamp}", payload, md)


def write_whole(stem: Path, payload: str, md: str) -> None:
    """STEM.json and STEM.md, each replaced whole or not at all."""
    for suffix, text in ((".json", payload), (".md", md)):
        final = stem.with_name(stem.name + suffix)
        tmp = final.with_name(final.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, final)


def finish_results(out, stamp, meta, rows, profiles, start):
    """The last write of a run's results, and its table printed."""
    write_results(out, stamp, meta, rows, profiles, start)
    print((out / f"e2e-{stamp}.md").read_text())
    print(f"wrote {out}/e2e-{stamp}.json and .md in {meta['wall_s']} s", flush=True)


def profile_markdown(meta, profiles) -> str:
    """Per-step table: microseconds per output step, and the change vs auto."""
    cols = ["attention", "kv_store", "gemm", "other", "gpu", "gap", "wall"]
    out = [
        "## GPU time per output step (µs; in brackets: minus auto)",
        "",
        (
            f"Device: {meta['device']}. One profiled pass per scenario after one "
            "untimed pass, engine in-process, CUDA graphs as configured; kernel "
            "time / output tokens per sequence. gap = wall - kernels (host work, "
            "launch gaps)."
        ),
        "",
        "| model | KV | scenario | " + " | ".join(cols) + " |",
        "|---|---|---|" + "---|" * len(cols),
    ]
    base = {r["model"]: r.get("profile", {}) for r in profiles if r["kv"] == "auto"}
    for r in profiles:
        if "profile" not in r:
            out.append(f"| {r['model']} | {r['kv']} | FAILED (rc {r['rc']}) |")
            continue
        for name, p in r["profile"].items():
            b = base.get(r["model"], {}).get(name)
            cells = []
            for c in cols:
                cell = f"{p[c]:,.0f}"
                if b is not None and r["kv"] != "auto":
                    cell += f" ({p[c] - b[c]:+,.0f})"
                cells.append(cell)
            out.append(
                f"| {r['model']} | {r['kv']} | {name} | " + " | ".join(cells) + " |"
            )
    out.append("")
    out.append("Longest kernels (µs per step):")
    out.append("")
    for r in profiles:
        for name, p in r.get("profile", {}).items():
            top = "; ".join(f"{k} {v}" for k, v in p["top"])
            out.append(f"- {r['model']} {r['kv']} {name}: {top}")
    return "\n".join(out) + "\n"


def with_auto(kvs: list[str]) -> list[str]:
    """``kvs`` with ``auto`` first where no ``auto`` (with or without a prefix
    caching suffix) is there: every ratio needs one."""
    return kvs if any(kv_config(kv)[0] == "auto" for kv in kvs) else ["auto", *kvs]


def parse_lanes(specs: list[str], kvs: list[str]) -> list[dict]:
    """``MODEL[:SCENARIO,...[:KV,...]]`` per lane: its model, its scenarios
    (all when left empty) and its KV dtypes (``kvs`` when left empty; auto
    first, as every lane needs its own). ValueError names the lane at fault."""
    lanes, taken = [], {}
    for i, spec in enumerate(specs):
        fields = spec.split(":")
        where = f"--lanes {spec!r} (lane {i})"
        if len(fields) > 3:
            raise ValueError(
                f"{where}: expected MODEL[:SCENARIO,...[:KV,...]], found "
                f"{len(fields)} ':'-separated fields"
            )
        model, scen, kv = (fields + ["", ""])[:3]
        if model not in MODELS:
            raise ValueError(f"{where}: unknown model {model!r}; known: {list(MODELS)}")
        names = [n for n in scen.split(",") if n] or list(SCENARIOS)
        lane_kvs = [k for k in kv.split(",") if k] or list(kvs)
        for what, got, known in (
            ("scenario", names, SCENARIOS),
            ("KV dtype", lane_kvs, KV_CONFIGS),
        ):
            bad = [n for n in got if n not in known]
            if bad:
                raise ValueError(f"{where}: unknown {what} {bad}; known: {list(known)}")
        for n in names:
            if (model, n) in taken:
                raise ValueError(
                    f"{where}: {model} {n} is lane {taken[model, n]}'s already; "
                    "give each (model, scenario) to one lane, so that one auto "
                    "stands for its ratios"
                )
            taken[model, n] = i
        lanes.append(dict(model=model, scenarios=names, kv=with_auto(lane_kvs)))
    return lanes


def lane_command(lane: dict, args, out: Path) -> list[str]:
    """The harness itself, for one lane's model, scenarios and KV dtypes."""
    cmd = [sys.executable, __file__, "--models", lane["model"]]
    cmd += ["--scenarios", *lane["scenarios"], "--kv", *lane["kv"]]
    cmd += ["--repeats", str(args.repeats), "--timeout", str(args.timeout)]
    cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.max_num_seqs:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    return cmd + ["--out", str(out)] + (["--keep-logs"] if args.keep_logs else [])


def visible_devices() -> list[str]:
    """This process's CUDA_VISIBLE_DEVICES as a list ([] when unset): --gpus
    counts within it, as torch's device indices do."""
    return [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]


def run_lanes(lanes: list[dict], gpus: list[int], args, out: Path, stamp: str):
    """Every lane at once, lane i on GPU ``gpus[i]``; (rows tagged with their
    GPU, per-lane records). A lane's own output goes to lanes-STAMP/gpuN.log
    and its results to lanes-STAMP/gpuN/."""
    import vllm.envs as envs

    root = out / f"lanes-{stamp}"
    cache = envs.VLLM_CACHE_ROOT
    visible = visible_devices()
    procs = []
    for lane, gpu in zip(lanes, gpus):
        (root / f"gpu{gpu}").mkdir(parents=True, exist_ok=True)
        env = dict(
            child_env(),
            CUDA_VISIBLE_DEVICES=visible[gpu] if visible else str(gpu),
            # Lanes may compile one configuration at the same moment; each
            # keeps torch.compile's cache apart rather than share its files.
            VLLM_CACHE_ROOT=os.path.join(cache, f"gpu{gpu}"),
        )
        log = open(root / f"gpu{gpu}.log", "w")  # noqa: SIM115 (closed below)
        cmd = lane_command(lane, args, root / f"gpu{gpu}")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append((lane, gpu, log, proc))
        print(f"GPU {gpu}: {lane['model']} x {lane['kv']} x {lane['scenarios']}")
    rows, records = [], []
    try:
        for lane, gpu, _, proc in procs:
            rc = proc.wait()
            found = sorted((root / f"gpu{gpu}").glob("e2e-*.json"))
            lane_rows = json.loads(found[-1].read_text())["rows"] if found else []
            for r in lane_rows:
                r["gpu"] = gpu
            rows += lane_rows
            records.append(dict(gpu=gpu, rc=rc, **lane))
            print(f"GPU {gpu}: rc {rc}, {len(lane_rows)} configurations", flush=True)
    finally:
        for _, _, log, proc in procs:
            if proc.poll() is None:
                # SIGINT, not SIGKILL: the lane's harness then takes down its
                # configuration's process group, whose engine holds the GPU.
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            log.close()
    return rows, records


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help=f"subset: {QUICK}")
    ap.add_argument("--models", nargs="+", choices=list(MODELS))
    ap.add_argument(
        "--kv",
        nargs="+",
        choices=KV_CONFIGS,
        metavar="KV",
        help="KV dtypes (auto, fp8, the TurboQuant presets), each optionally "
        "with +pc or +nopc: prefix caching on or off instead of the engine's "
        "default",
    )
    ap.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS))
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        help="sequences an engine runs at once (default: the most a scenario "
        "submits, 16 to 512, rounded up to vLLM's capture grid); vLLM captures "
        "no FULL CUDA graph for more rows than this",
    )
    ap.add_argument(
        "--timeout",
        type=int,
        default=1800,
        help="seconds per process (--interleave: per engine start or repeat)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also profile each configuration: GPU time per step by kernel class",
    )
    ap.add_argument(
        "--profile-only",
        action="store_true",
        help="only the per-step profiles (no timed repeats)",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help=(
            "every KV dtype's engine resident at once, sharing "
            "--gpu-memory-utilization; repeats alternate between them"
        ),
    )
    ap.add_argument(
        "--lanes",
        nargs="+",
        metavar="MODEL[:SCENARIO,...[:KV,...]]",
        help=(
            "run lanes at once, one GPU each (lane i on GPU i, or --gpus); a "
            "lane's scenarios default to all, its KV dtypes to --kv; every lane "
            "runs its own auto"
        ),
    )
    ap.add_argument(
        "--gpus", nargs="+", type=int, help="the GPU of each --lanes lane, in order"
    )
    ap.add_argument(
        "--out", default=os.environ.get("OUT") or str(REPO / "benchmarks" / "runs")
    )
    ap.add_argument(
        "--keep-logs",
        action="store_true",
        help="write each configuration's engine log to --out",
    )
    args = ap.parse_args()
    counts = {
        "--repeats": (args.repeats, "timed repeats of each scenario"),
        "--max-num-seqs": (args.max_num_seqs, "sequences an engine runs at once"),
        "--timeout": (
            args.timeout,
            "seconds a configuration's process may run (--interleave: per "
            "engine start or repeat)",
        ),
    }
    for flag, (value, what) in counts.items():
        if value is not None and value < 1:
            ap.error(
                f"{flag} {value}: expected at least 1 ({what}); pass 1 or more, "
                "or leave it out"
            )
    if not 0 < args.gpu_memory_utilization <= 1:
        ap.error(
            f"--gpu-memory-utilization {args.gpu_memory_utilization}: expected the "
            "share of GPU memory each engine may take, above 0 and at most 1"
        )

    if args.child:
        results = run_child(json.loads(args.child))
        import torch

        results["_device"] = torch.cuda.get_device_name()
        print(_RESULT + json.dumps(results), flush=True)
        sys.stderr.flush()
        # Skip interpreter teardown (the engine core was shut down above): a
        # hang there would hold the parent until its timeout.
        os._exit(0)
    if args.serve:
        serve_child(json.loads(args.serve))
        import torch

        _reply(done=True, device=torch.cuda.get_device_name())
        sys.stderr.flush()
        os._exit(0)
    if args.interleave and (args.profile or args.profile_only):
        ap.error(
            "--interleave times repeats and does not profile: run --profile "
            "or --profile-only without it"
        )
    lanes = None
    if args.gpus is not None and not args.lanes:
        ap.error("--gpus places --lanes lanes on GPUs: pass --lanes with it")
    if args.lanes:
        clash = [
            flag
            for flag, on in (
                ("--models", args.models),
                ("--scenarios", args.scenarios),
                ("--quick", args.quick),
                ("--interleave", args.interleave),
                ("--profile", args.profile),
                ("--profile-only", args.profile_only),
            )
            if on
        ]
        if clash:
            ap.error(
                f"--lanes with {' '.join(clash)}: each lane names its model and "
                "scenarios and runs timed repeats only; drop those flags"
            )
        gpus = args.gpus if args.gpus is not None else list(range(len(args.lanes)))
        if len(gpus) != len(args.lanes) or len(set(gpus)) != len(gpus):
            ap.error(
                f"--gpus {gpus} for {len(args.lanes)} lane(s): expected one distinct "
                "GPU per lane (two lanes on one GPU would each take "
                "--gpu-memory-utilization of it)"
            )
        visible = visible_devices()
        if any(g < 0 or (visible and g >= len(visible)) for g in gpus):
            ap.error(
                f"--gpus {gpus}: expected indices of the GPUs this process sees "
                f"(CUDA_VISIBLE_DEVICES={','.join(visible) or 'unset'}), from 0"
            )
        try:
            lanes = parse_lanes(args.lanes, args.kv or KV_DTYPES)
        except ValueError as e:
            ap.error(str(e))

    base = (
        QUICK
        if args.quick
        else dict(
            models=list(MODELS), kv=KV_DTYPES, scenarios=list(SCENARIOS), repeats=3
        )
    )
    models = args.models or base["models"]
    kvs = with_auto(args.kv or base["kv"])
    scenarios = args.scenarios or base["scenarios"]
    if lanes is not None:
        models = list(dict.fromkeys(lane["model"] for lane in lanes))
        kvs = list(dict.fromkeys(kv for lane in lanes for kv in lane["kv"]))
        scenarios = list(dict.fromkeys(n for lane in lanes for n in lane["scenarios"]))
    if args.repeats is None:
        args.repeats = base["repeats"]

    # No CUDA in this process: its context would take GPU memory from the engines.
    import torch

    import vllm

    meta = dict(
        time=datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
        device=None,  # from the first engine process
        vllm=vllm.__version__,
        torch=torch.__version__,
        python=platform.python_version(),
        repeats=args.repeats,
        max_num_seqs=args.max_num_seqs,
        quick=args.quick,
        scenarios={s: SCENARIOS[s] for s in scenarios},
        tq_decode=os.environ.get("VLLM_TURBOQUANT_DECODE", "default"),
        # Result files without this key streamed requests into a running engine.
        queue="full",
        interleave=args.interleave,
    )
    print(
        f"vLLM {meta['vllm']}: {models} x {kvs} x {scenarios}",
        flush=True,
    )
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    if lanes is not None:
        rows, meta["lanes"] = run_lanes(lanes, gpus, args, out, stamp)
        finish_results(out, stamp, meta, rows, [], start)
        failed = [lane["gpu"] for lane in meta["lanes"] if lane["rc"] != 0]
        if failed:
            sys.exit(
                f"lane(s) on GPU {failed} failed: their logs are "
                f"{out}/lanes-{stamp}/gpuN.log"
            )
        return
    rows = []
    profiles = []
    for model in models:
        if args.interleave:
            rows += run_interleaved(model, kvs, scenarios, args)
            for row in rows[-len(kvs) :]:
                if "scenarios" not in row:
                    print(f"{model} {row['kv']}: FAILED rc={row['rc']}", flush=True)
                    print(row["error_tail"][-1500:], flush=True)
            write_results(out, stamp, meta, rows, profiles, start)
            continue
        for kv in kvs:
            if args.profile or args.profile_only:
                prow = run_config(model, kv, scenarios, args, profile=True)
                profiles.append(prow)
                print(
                    f"{model} {kv} profile: "
                    + ("ok" if "profile" in prow else f"FAILED rc={prow['rc']}"),
                    flush=True,
                )
                if "profile" not in prow:
                    print(prow["error_tail"][-1500:], flush=True)
                write_results(out, stamp, meta, rows, profiles, start)
            if args.profile_only:
                continue
            row = run_config(model, kv, scenarios, args)
            rows.append(row)
            status = "ok" if "scenarios" in row else f"FAILED rc={row['rc']}"
            print(
                f"{model} {kv}: {status}, KV tokens {row['kv_tokens']}, "
                f"{row['wall_s']} s",
                flush=True,
            )
            if "scenarios" not in row:
                print(row["error_tail"][-1500:], flush=True)
            write_results(out, stamp, meta, rows, profiles, start)
    finish_results(out, stamp, meta, rows, profiles, start)


if __name__ == "__main__":
    main()
