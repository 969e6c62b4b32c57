# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU: hybridkv's patches under vLLM's tensor parallelism (issue 12).

``--tp 2`` (one ``nvidia-h200-x2`` call, < 8 minutes): the tiny Qwen3-Next-like
and Qwen3.5-like checkpoints of checkpoints.py (random weights whose greedy
output depends on attention) with KV ``auto`` and ``turboquant_4bit_nc``,
without speculation and with MTP k=3, default CUDA graphs,
tensor_parallel_size=2: 8 engines. Per engine: it boots and generates; the
MTP engine equals its no-speculation engine token for token
(spec_decode_matrix's comparison: ``exact``, ``DIFF p@t [tie]``); the
engine's "GPU KV cache size: N tokens" equals ``vllm kv-capacity
--tensor-parallel-size 2 --kv-cache-memory-bytes ... --json`` for the same
configuration. Then the tiny Gemma 4 multimodal model with
``turboquant_4bit_nc`` at TP=2, text and image+text, through
``python -m tests.models.tiny_hybrids.gemma4_matrix OUT.json --tp 2``.

``--tp 4`` (``nvidia-h200-x4``, one call of up to 9 minutes): dummy weights at
full-size shapes (shapes.py): Gemma-4-31B with ``turboquant_4bit_nc`` at
max_model_len 262144 (per-layer backend map, KV tokens vs the planner, one
request with a prompt over 200,000 tokens: time to first token and decode
rate), and Qwen3-Coder-Next-80B-A3B with a LocoOperator-4B-shaped draft model
(k=3) at the draft's context, 40960 tokens.

    python -m tests.models.tiny_hybrids.tp_matrix OUTDIR [--tp 2] [--cache DIR]
    python -m tests.models.tiny_hybrids.tp_matrix OUTDIR --tp 4 [--cache DIR]
    python -m tests.models.tiny_hybrids.tp_matrix OUTDIR --check-configs [--tp N]
    python -m tests.models.tiny_hybrids.tp_matrix --table OUTDIR/tp_matrix.json

At TP=2 two engines run at a time by default (``--jobs``; one at TP=4):
each spans both GPUs, but has a fixed 256 MiB KV budget and tiny weights, so
two fit beside each other (and beside gemma4_matrix's eager engines) and the 8 cold
compiles fit the budget; ``--jobs 1`` runs them strictly one after another.
``--budget`` seconds bound the whole run: engines that would start after it
are reported as skipped, so the table always prints. Each engine runs in its
own subprocess (spec_decode_matrix.spawn) with the engine core and workers in
their own processes, as users run TP. Writes OUTDIR/tp_matrix.json,
OUTDIR/logs.tar.gz (engine, planner and Gemma logs) and prints the table last.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import tarfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import spec_decode_matrix as sdm

MODULE = "tests.models.tiny_hybrids.tp_matrix"
TP2_MODELS = ("qwen3_next", "qwen3_5")
TP2_KV = ("auto", "turboquant_4bit_nc")
TP2_SPECS = ("none", "mtp3")
TQ = "turboquant_4bit_nc"
GIB = 2**30
KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")

# Engine arguments the planner takes (as kv-capacity flags) and those that do
# not change the KV-cache plan. Anything else stops the run: the comparison
# would silently cover a different configuration.
_NOT_PLANNED = {
    "load_format",
    "skip_tokenizer_init",
    "max_num_seqs",
    "gpu_memory_utilization",
    "seed",
    "disable_log_stats",
    "enforce_eager",
    "compilation_config",
    "limit_mm_per_prompt",
    # The matrix runs float16 over bfloat16 checkpoints: the same 2 bytes per
    # KV element, so the plan (which reads the checkpoint's dtype) is unchanged.
    "dtype",
}
_PLANNED = {
    "model",
    "max_model_len",
    "kv_cache_dtype",
    "kv_cache_dtype_skip_layers",
    "tensor_parallel_size",
    "kv_cache_memory_bytes",
    "speculative_config",
    "block_size",
    # Sliding-window layers hold window + one step's tokens per request, so
    # the step budget changes the reported KV tokens.
    "max_num_batched_tokens",
    "language_model_only",
    "attention_backend",
}


@dataclasses.dataclass
class Engine:
    name: str
    kwargs: dict[str, Any]
    model: str
    kv: str
    spec: str
    # Name of the engine this one must equal token for token (spec engines).
    ref: str | None = None
    # Child payload beyond spec_decode_matrix's: prompts, max_tokens, ...
    child: dict[str, Any] = dataclasses.field(default_factory=dict)


# --------------------------------------------------------------------------
# Engines.
# --------------------------------------------------------------------------


def tp2_kwargs(
    model: str, kv: str, spec: str, ckpts: dict[str, str], tp: int = 2
) -> dict[str, Any]:
    """spec_decode_matrix's engine arguments for the cell, at ``tp`` ranks,
    with vLLM's default CUDA graph settings (no compilation_config)."""
    cell = sdm.Cell(model, kv, spec, "FULL_AND_PIECEWISE")
    kwargs = sdm.engine_kwargs(cell, ckpts)
    kwargs.pop("compilation_config", None)
    kwargs["tensor_parallel_size"] = tp
    return kwargs


def tp2_engines(ckpts: dict[str, str], tp: int = 2) -> list[Engine]:
    """Reference engines first, models interleaved: a model's second engine
    finds the first one's compile cache, and a broken model shows early."""
    engines = []
    for spec in TP2_SPECS:
        for kv in TP2_KV:
            for model in TP2_MODELS:
                ref = None if spec == "none" else f"{model}.{kv}.none.tp{tp}"
                engines.append(
                    Engine(
                        f"{model}.{kv}.{spec}.tp{tp}",
                        tp2_kwargs(model, kv, spec, ckpts, tp),
                        model,
                        kv,
                        spec,
                        ref,
                    )
                )
    return engines


def long_prompt(num_tokens: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 200000) for _ in range(num_tokens)]


LONG_PROMPT_TOKENS = 200_704
GEMMA_31B_MAX_LEN = 262_144


def tp4_engines(models: dict[str, str], tp: int = 4) -> list[Engine]:
    """Full-size shapes, dummy weights. ``models``: shapes.py name -> dir."""
    gemma = dict(
        model=models["Gemma-4-31B"],
        load_format="dummy",
        # A shape record has no processor: text only (the vision tower is
        # unsharded HF code; the tiny model covers image prompts).
        language_model_only=True,
        skip_tokenizer_init=True,
        kv_cache_dtype=TQ,
        max_model_len=GEMMA_31B_MAX_LEN,
        tensor_parallel_size=tp,
        kv_cache_memory_bytes=8 * GIB,
        gpu_memory_utilization=0.92,
        max_num_seqs=4,
        # Bounds each continuation chunk's SDPA (head_dim 512) over ~200k keys.
        max_num_batched_tokens=8192,
        seed=0,
        disable_log_stats=False,
    )
    coder = dict(
        model=models["Qwen3-Coder-Next-80B-A3B"],
        load_format="dummy",
        skip_tokenizer_init=True,
        kv_cache_dtype=TQ,
        # The draft's own limit: the longest context both models serve.
        max_model_len=40960,
        tensor_parallel_size=tp,
        kv_cache_memory_bytes=8 * GIB,
        gpu_memory_utilization=0.92,
        max_num_seqs=16,
        speculative_config={
            "method": "draft_model",
            "model": models["LocoOperator-4B"],
            "num_speculative_tokens": 3,
        },
        seed=0,
        disable_log_stats=False,
    )
    return [
        Engine(
            f"gemma_4_31b.tq4nc.none.tp{tp}",
            gemma,
            "Gemma-4-31B",
            TQ,
            "none",
            child={
                "long_prompt_tokens": LONG_PROMPT_TOKENS,
                "max_tokens": 64,
                "backend_map": True,
            },
        ),
        Engine(
            f"qwen3_coder_next.tq4nc.draft3.tp{tp}",
            coder,
            "Qwen3-Coder-Next-80B-A3B",
            TQ,
            "draft3",
            child={"random_prompts": [16, 512], "max_tokens": 64},
        ),
    ]


TP4_SHAPES = ("Gemma-4-31B", "Qwen3-Coder-Next-80B-A3B", "LocoOperator-4B")


def write_tp4_models(root: Path) -> dict[str, str]:
    from .shapes import write_full_size_config

    return {
        n: str(write_full_size_config(n, root / n.lower().replace(".", "_")))
        for n in TP4_SHAPES
    }


# --------------------------------------------------------------------------
# Planner.
# --------------------------------------------------------------------------


def planner_argv(kwargs: dict[str, Any]) -> list[str]:
    """``vllm kv-capacity`` arguments planning the same KV cache as an engine
    built from ``kwargs`` (an explicit kv_cache_memory_bytes: the planner then
    reproduces the engine's "GPU KV cache size" line)."""
    unknown = set(kwargs) - _PLANNED - _NOT_PLANNED
    if unknown:
        raise ValueError(
            f"engine arguments {sorted(unknown)} have no kv-capacity flag and "
            "are not known to leave the KV-cache plan alone; add them to "
            "tp_matrix._PLANNED (with a flag) or _NOT_PLANNED"
        )
    if not kwargs.get("kv_cache_memory_bytes"):
        raise ValueError(
            "the engine has no kv_cache_memory_bytes: its KV budget comes from "
            "profiling, which the planner cannot reproduce; set one"
        )
    argv = [
        str(kwargs["model"]),
        "--max-model-len",
        str(kwargs["max_model_len"]),
        "--kv-cache-dtype",
        str(kwargs.get("kv_cache_dtype", "auto")),
        "--tensor-parallel-size",
        str(kwargs.get("tensor_parallel_size", 1)),
        "--kv-cache-memory-bytes",
        str(kwargs["kv_cache_memory_bytes"]),
    ]
    skip = kwargs.get("kv_cache_dtype_skip_layers")
    if skip:
        argv += ["--kv-cache-dtype-skip-layers", *map(str, skip)]
    spec = kwargs.get("speculative_config")
    if spec:
        method = spec.get("method")
        if method == "draft_model":
            argv += ["--draft", str(spec["model"])]
        elif method != "mtp":
            raise ValueError(
                f"speculative method {method!r}: kv-capacity plans mtp and "
                "draft_model only"
            )
        argv += ["--num-speculative-tokens", str(spec["num_speculative_tokens"])]
    if kwargs.get("block_size"):
        argv += ["--block-size", str(kwargs["block_size"])]
    if kwargs.get("max_num_batched_tokens"):
        argv += ["--max-num-batched-tokens", str(kwargs["max_num_batched_tokens"])]
    if kwargs.get("language_model_only"):
        argv.append("--language-model-only")
    if kwargs.get("attention_backend"):
        argv += ["--attention-backend", str(kwargs["attention_backend"])]
    return argv + ["--json"]


def planner_command(kwargs: dict[str, Any]) -> list[str]:
    """``vllm kv-capacity ...`` run by this interpreter, so the planner is the
    vLLM the engines import (a ``vllm`` on PATH may be another install)."""
    cli = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    return [*cli, "kv-capacity", *planner_argv(kwargs)]


def run_planner(
    kwargs: dict[str, Any], log: Path, timeout: float = 300
) -> dict[str, Any]:
    """The planner's JSON report (``kv_tokens``, ``error``...), or
    ``{"error": ...}`` when it could not run."""
    cmd = planner_command(kwargs)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": f"planner TIMEOUT after {timeout:.0f}s", "cmd": cmd}
    log.write_text(" ".join(cmd) + "\n" + proc.stderr + "\n" + proc.stdout)
    try:
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        report = {"error": f"rc={proc.returncode}: {sdm.crash_text(proc.stderr)}"}
    report["cmd"] = cmd
    return report


def engine_kv_tokens(log: str) -> int | None:
    """The last "GPU KV cache size: N tokens" of an engine log (the engine
    core's, prefixed by its process name at TP > 1)."""
    found = KV_TOKENS.findall(log)
    return int(found[-1].replace(",", "")) if found else None


def kv_status(engine: int | None, plan: dict[str, Any] | None) -> str:
    if plan is None:
        return "no plan"
    if plan.get("error"):
        return "PLAN ERROR"
    if engine is None:
        return "no engine value"
    planned = plan.get("kv_tokens")
    if engine == planned:
        return "equal"
    return f"DIFF {engine - planned:+d}" if planned is not None else "no plan value"


# --------------------------------------------------------------------------
# Child (TP=4 engines; TP=2 engines use spec_decode_matrix's child).
# --------------------------------------------------------------------------


def _token_prompts_without_tokenizer(llm) -> None:
    """Gemma 4's processing info asks the tokenizer for a chat template when
    it builds the default tokenization parameters, so under vLLM 0.20.2 a
    skip_tokenizer_init engine refuses even token-id prompts ("You cannot
    pass text prompts"). Token-id prompts need no tokenizer: give the
    renderer the parameters every other model gets."""
    from vllm.multimodal.processing.context import BaseProcessingInfo

    mm = llm.renderer.mm_processor
    if mm is not None:
        params = BaseProcessingInfo.get_default_tok_params(mm.info)
        llm.renderer.__dict__["default_cmpl_tok_params"] = params


def timed_request(engine, prompt: list[int], params) -> dict[str, Any]:
    """One request through the engine's step loop: time to first token, then
    the decode rate over the remaining tokens (``LLM.generate`` gives neither)."""
    engine.add_request("timed-0", {"prompt_token_ids": prompt}, params)
    start = time.perf_counter()
    first = None
    token_ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            token_ids = list(out.outputs[0].token_ids)
            if first is None and token_ids:
                first = time.perf_counter() - start
    total = time.perf_counter() - start
    decoded = len(token_ids) - 1
    return {
        "token_ids": token_ids,
        "ttft_s": round(first, 3) if first is not None else None,
        "total_s": round(total, 3),
        "decode_tok_s": round(decoded / (total - first), 1)
        if first is not None and decoded > 0 and total > first
        else None,
    }


def run_child(args: dict[str, Any]) -> dict[str, Any]:
    if not (args.get("long_prompt_tokens") or args.get("random_prompts")):
        return sdm.run_child(args)
    from vllm import LLM, SamplingParams

    llm = LLM(**args["engine"])
    result: dict[str, Any] = {}
    if args.get("backend_map"):
        try:
            from .gemma4_matrix import backend_map

            result["backends"] = llm.apply_model(backend_map)[0]
        except Exception as e:  # a report, not a requirement
            result["backends"] = f"unavailable: {type(e).__name__}: {e}"
        print("BACKENDS", json.dumps(result["backends"]), flush=True)
    if args["engine"].get("skip_tokenizer_init"):
        _token_prompts_without_tokenizer(llm)
    params = SamplingParams(
        max_tokens=args.get("max_tokens", 8), temperature=0.0, ignore_eos=True
    )
    if args.get("long_prompt_tokens"):
        prompt = long_prompt(args["long_prompt_tokens"])
        timing = timed_request(llm.llm_engine, prompt, params)
        result["outputs"] = [timing.pop("token_ids")]
        result["prompt_tokens"] = [len(prompt)]
        result["timing"] = timing
        result["metrics"] = sdm.spec_metrics(llm.get_metrics())
        return result
    num, length = args["random_prompts"]
    prompts = [long_prompt(length, seed=i) for i in range(num)]
    start = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    result["seconds"] = time.perf_counter() - start
    result["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    result["prompt_tokens"] = [len(o.prompt_token_ids) for o in outs]
    result["metrics"] = sdm.spec_metrics(llm.get_metrics())
    return result


def spawn(
    name: str, args: dict[str, Any], outdir: Path, timeout: float, env: dict
) -> dict[str, Any]:
    """spec_decode_matrix.spawn with this module's child, which also ends the
    engine core and worker processes (run_matrix sets sdm.MODULE)."""
    return sdm.spawn(name, args, outdir, timeout, env)


def end_children(pid: int | None = None) -> None:
    """Kill this process's descendants: at TP > 1 the engine core and the
    workers outlive an ``os._exit`` of the front end and would hold the GPUs
    while the next engine boots."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def child_env(outdir: Path, cache: Path | None, num_spec: int) -> dict[str, str]:
    env = sdm.child_env(outdir, cache, num_spec, in_process=False)
    # Each rank compiles: keep Inductor's pools small beside the other engine.
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "4")
    # apply_model (backend map) ships a function to the worker processes.
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return env


# --------------------------------------------------------------------------
# Driver.
# --------------------------------------------------------------------------


def engine_row(
    eng: Engine,
    rec: dict[str, Any],
    records: dict[str, dict[str, Any]],
    plan: dict[str, Any] | None,
    prompts: list[list[int]] | None,
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "engine": eng.name,
        "model": eng.model,
        "kv": eng.kv,
        "spec": eng.spec,
        "wall": rec.get("wall"),
        "kv_engine": rec.get("kv_tokens"),
        "kv_plan": (plan or {}).get("kv_tokens"),
        "kv_status": kv_status(rec.get("kv_tokens"), plan),
    }
    if plan and plan.get("error"):
        row["plan_error"] = str(plan["error"])[:300]
    if "crash" in rec:
        # The run's own limits are not the engine's failure: name them.
        kind = rec["crash"].split(" ", 1)[0].rstrip(":")
        row["status"] = kind if kind in ("TIMEOUT", "SKIPPED") else "CRASH"
        row["crash"] = rec["crash"]
        return row
    outs = rec.get("outputs") or []
    row["dist"] = min((len(set(o)) for o in outs), default=0)
    row["generated"] = sum(len(o) for o in outs)
    if eng.ref is None:
        row["status"] = "ran" if row["generated"] else "NO OUTPUT"
    else:
        cmp = sdm.compare(records.get(eng.ref, {"crash": "not run"}), rec, prompts)
        row["status"] = cmp["status"]
        row["exact"] = cmp.get("prompts_exact")
        if cmp.get("crash"):
            row["crash"] = f"reference: {cmp['crash']}"
    m = rec.get("metrics") or {}
    row["histogram"] = m.get("histogram")
    row["mean_accept_len"] = m.get("mean_accept_len")
    for key in ("prompt_tokens", "backends", "timing"):
        if key in rec:
            row[key] = rec[key]
    return row


def row_ok(row: dict[str, Any]) -> bool:
    status = row.get("status", "")
    return (status == "ran" or sdm.same_or_tie(status)) and row.get(
        "kv_status"
    ) == "equal"


def gemma_rows(report: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Rows of gemma4_matrix's OUT.json (its format, read leniently)."""
    if report is None:
        return []
    if "error" in report and not report.get("engines"):
        return [{"case": "gemma4", "status": "CRASH", "crash": report["error"]}]
    rows = []
    for e in report.get("engines", []):
        ok = e.get("rc") == 0
        text, image = e.get("text_tokens"), e.get("image_tokens")
        rows.append(
            {
                "case": str(e.get("case", "?")),
                "status": "ran" if ok and text else "CRASH",
                "text": len(text) if text else 0,
                "image": len(image) if image else 0,
                "crash": None if ok else str(e.get("error") or e.get("rc")),
            }
        )
    return rows


def format_table(
    rows: list[dict[str, Any]], gemma: list[dict[str, Any]] | None = None
) -> str:
    cols = (
        "engine",
        "status",
        "exact",
        "dist",
        "accept",
        "kv engine",
        "kv plan",
        "kv",
        "wall",
    )
    lines = []
    for r in rows:
        acc = r.get("mean_accept_len")
        lines.append(
            (
                r["engine"],
                r.get("status", "?"),
                r.get("exact") or "-",
                str(r.get("dist", "-")),
                f"{acc:.2f}" if acc else "-",
                "-" if r.get("kv_engine") is None else f"{r['kv_engine']:,}",
                "-" if r.get("kv_plan") is None else f"{r['kv_plan']:,}",
                r.get("kv_status") or "-",
                "-" if r.get("wall") is None else f"{r['wall']:.0f}s",
            )
        )
    out = sdm.aligned(cols, lines)
    for r in rows:
        if r.get("crash"):
            out.append(f"  {r['engine']}: {r['crash']}")
        if r.get("plan_error"):
            out.append(f"  {r['engine']} planner: {r['plan_error']}")
        if isinstance(r.get("backends"), dict):
            # The per-layer map is in the JSON and the engine log (BACKENDS).
            counts = Counter(r["backends"].values())
            kinds = ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))
            out.append(f"  {r['engine']} layers: {kinds}")
        elif r.get("backends"):
            out.append(f"  {r['engine']} layers: {r['backends']}")
        if r.get("prompt_tokens"):
            out.append(
                f"  {r['engine']}: {len(r['prompt_tokens'])} prompts, longest "
                f"{max(r['prompt_tokens']):,} tokens, {r.get('generated')} generated"
            )
        if r.get("timing"):
            tm = r["timing"]
            out.append(
                f"  {r['engine']}: time to first token {tm['ttft_s']} s, decode "
                f"{tm['decode_tok_s']} tok/s, {tm['total_s']} s in all"
            )
    good = sum(row_ok(r) for r in rows)
    out.append(f"{good}/{len(rows)} engines ran, equal where compared, KV = plan")
    if gemma is not None:
        out.append("gemma4 (tiny, multimodal, TP via gemma4_matrix --tp):")
        for g in gemma:
            line = f"  {g['case']:<10} {g['status']:<6}"
            if g["status"] == "ran":
                line += f" text {g['text']} tokens, image+text {g['image']} tokens"
            elif g.get("crash"):
                line += f" {g['crash']}"
            out.append(line)
        ran = sum(1 for g in gemma if g["status"] == "ran" and g.get("image", 1))
        out.append(f"{ran}/{len(gemma)} gemma4 engines answered")
    return "\n".join(out)


def run_gemma(outdir: Path, tp: int, timeout: float, extra: list[str]) -> dict:
    """gemma4_matrix in its own process; its JSON report (or an error)."""
    out = outdir / "gemma4.json"
    cmd = [
        sys.executable,
        "-m",
        "tests.models.tiny_hybrids.gemma4_matrix",
        str(out),
        "--tp",
        str(tp),
        *extra,
    ]
    env = child_env(outdir, None, 0)
    (outdir / "logs").mkdir(parents=True, exist_ok=True)
    with open(outdir / "logs" / "gemma4_matrix.log", "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return {"error": f"gemma4_matrix TIMEOUT after {timeout:.0f}s"}
    if out.exists():
        return json.loads(out.read_text())
    text = (outdir / "logs" / "gemma4_matrix.log").read_text(errors="replace")
    return {"error": f"rc={rc}: {sdm.crash_text(text)}"}


def _tar_logs(outdir: Path) -> None:
    with tarfile.open(outdir / "logs.tar.gz", "w:gz") as tar:
        tar.add(outdir / "logs", arcname="logs")


def _run_engines(
    args: argparse.Namespace,
    engines: list[Engine],
    prompts: list[list[int]] | None,
    outdir: Path,
    t0: float,
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Engines ``args.jobs`` at a time within the budget; the planner for
    each engine alongside (CPU only)."""
    deadline = t0 + args.budget
    with ThreadPoolExecutor(4) as planners:
        plans = {
            e.name: planners.submit(
                run_planner, e.kwargs, outdir / "logs" / f"{e.name}.planner.log"
            )
            for e in engines
        }

        def one(eng: Engine) -> tuple[str, dict[str, Any]]:
            left = deadline - time.time()
            if left < args.min_engine_time:
                return eng.name, {"crash": f"SKIPPED: {left:.0f}s of budget left"}
            num_spec = (eng.kwargs.get("speculative_config") or {}).get(
                "num_speculative_tokens", 0
            )
            child = {"engine": eng.kwargs, **eng.child}
            if prompts is not None:
                child.update(prompts=prompts, logprobs=eng.spec == "none")
            rec = spawn(
                eng.name,
                child,
                outdir,
                min(args.timeout, left),
                child_env(outdir, args.cache, num_spec),
            )
            log = outdir / "logs" / f"{eng.name}.log"
            if log.exists():
                rec["kv_tokens"] = engine_kv_tokens(log.read_text(errors="replace"))
            status = rec.get("crash", "ok")[:100]
            print(
                f"  {eng.name}: {status} ({rec.get('wall')}s, KV "
                f"{rec.get('kv_tokens')}) at {time.time() - t0:.0f}s",
                flush=True,
            )
            return eng.name, rec

        with ThreadPoolExecutor(args.jobs) as pool:
            records = dict(pool.map(one, engines))
        plan_reports = {n: f.result() for n, f in plans.items()}
    return records, plan_reports


def run_matrix(args: argparse.Namespace) -> int:
    outdir = Path(args.outdir)
    (outdir / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    deadline = t0 + args.budget
    prompts: list[list[int]] | None = None
    if args.tp == 2:
        from .checkpoints import bigram_prompts, build_all

        ckpts = {
            k: str(v) for k, v in build_all(outdir / "ckpt", list(TP2_MODELS)).items()
        }
        prompts = bigram_prompts(args.prompts)
        engines = tp2_engines(ckpts, args.tp)
    else:
        engines = tp4_engines(write_tp4_models(outdir / "models"), args.tp)
    engines = [e for e in engines if not args.only or re.search(args.only, e.name)]
    print(
        f"{len(engines)} engines at TP={args.tp}, {args.jobs} at a time; "
        f"budget {args.budget:.0f}s",
        flush=True,
    )

    gemma_report: list[dict] = []
    gemma_thread = None
    if args.tp == 2 and args.gemma != "off":
        extra = args.gemma_args.split() if args.gemma_args else []

        def gemma_job():
            # Leave the tail of the budget for the table.
            gemma_report.append(
                run_gemma(outdir, args.tp, deadline - time.time(), extra)
            )

        gemma_thread = threading.Thread(target=gemma_job)
        if args.gemma == "parallel":
            gemma_thread.start()

    # Every engine runs through this module's child (run_child, end_children).
    saved_module, sdm.MODULE = sdm.MODULE, MODULE
    try:
        records, plan_reports = _run_engines(args, engines, prompts, outdir, t0)
    finally:
        sdm.MODULE = saved_module

    if gemma_thread is not None:
        if args.gemma == "serial":
            gemma_thread.start()
        gemma_thread.join()
    rows = [
        engine_row(e, records[e.name], records, plan_reports[e.name], prompts)
        for e in engines
    ]
    gemma = gemma_rows(gemma_report[0]) if gemma_report else None
    result = {
        "tp": args.tp,
        "rows": rows,
        "gemma": gemma,
        "gemma_report": gemma_report[0] if gemma_report else None,
        "plans": plan_reports,
        "records": records,
        "prompts": prompts,
        "seconds": round(time.time() - t0, 1),
    }
    (outdir / "tp_matrix.json").write_text(json.dumps(result))
    _tar_logs(outdir)
    print(
        f"{time.time() - t0:.0f}s; {outdir / 'tp_matrix.json'}, "
        f"{outdir / 'logs.tar.gz'}"
    )
    if args.tp != 2:
        print("TP=4: full-size shapes, dummy weights (outputs are not checked)")
    print(format_table(rows, gemma))
    ok = all(row_ok(r) for r in rows) and all(
        g["status"] == "ran" for g in (gemma or [])
    )
    return 0 if ok else 1


def draft_config_builds(vllm_config) -> None:
    """Build the draft model's VllmConfig as the draft-model proposer does when
    it loads (``DraftModelProposer._create_draft_vllm_config``): its
    validators run again there, on every worker, after the engine config was
    accepted."""
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    spec = vllm_config.speculative_config
    if spec is None or spec.method != "draft_model":
        return
    proposer = object.__new__(DraftModelProposer)
    proposer.vllm_config = vllm_config
    proposer.speculative_config = spec
    proposer._create_draft_vllm_config()


def check_configs(args: argparse.Namespace) -> int:
    """Build every engine's VllmConfig (and a draft model's, as its worker
    will) and plan it with the planner's own argument parser, without starting
    anything (no GPU needed)."""
    from vllm.v1.core.kv_cache_capacity import plan_capacity, use_planning_platform

    # First: vLLM modules bind the platform when imported, and a host without
    # a GPU resolves none that can build a config.
    use_planning_platform()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.kv_capacity import make_parser, request_from_args

    outdir = Path(args.outdir)
    if args.tp == 2:
        from .checkpoints import write_config

        ckpts = {n: str(write_config(n, outdir / "configs" / n)) for n in TP2_MODELS}
        engines = tp2_engines(ckpts, args.tp)
    else:
        engines = tp4_engines(write_tp4_models(outdir / "models"), args.tp)
    engines = [e for e in engines if not args.only or re.search(args.only, e.name)]
    failed = 0
    for eng in engines:
        try:
            draft_config_builds(EngineArgs(**eng.kwargs).create_engine_config())
            request = request_from_args(
                make_parser().parse_args(planner_argv(eng.kwargs))
            )
            report = plan_capacity(request)
            if report.error:
                raise RuntimeError(report.error)
            print(
                f"  {eng.name}: config builds; planner: {report.kv_tokens:,} KV "
                f"tokens, max concurrency {report.max_concurrency}"
            )
        except Exception as e:
            failed += 1
            # pydantic puts the reason on the lines after its header.
            print(f"  {eng.name}: {type(e).__name__}: {' '.join(str(e).split())[:400]}")
    print(f"{len(engines) - failed}/{len(engines)} engine configs build and plan")
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tests.models.tiny_hybrids.tp_matrix",
        description="hybridkv under tensor parallelism (issue 12)",
    )
    p.add_argument("outdir", nargs="?")
    p.add_argument("--tp", type=int, choices=(2, 4), default=2)
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="engines at a time (default 2 at TP=2; 1 at TP=4: full-size models)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the whole run (default 450 at TP=2, 540 at TP=4)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per engine (default 240 at TP=2; 330 at TP=4, where the "
        "80B MoE with its draft took longer than 221 s to boot with cold caches)",
    )
    p.add_argument(
        "--min-engine-time",
        type=float,
        default=40,
        help="do not start an engine with less budget left than this",
    )
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--cache", type=Path, default=None, help="TRITON/VLLM cache root")
    p.add_argument("--only", help="regex on engine names, e.g. 'qwen3_next'")
    p.add_argument(
        "--gemma",
        choices=("parallel", "serial", "off"),
        default="parallel",
        help="TP=2: gemma4_matrix beside the hybrid engines, after them, or not",
    )
    p.add_argument("--gemma-args", default="", help="extra gemma4_matrix arguments")
    p.add_argument("--check-configs", action="store_true", help="CPU: configs + plans")
    p.add_argument("--table", metavar="JSON", help="print the table of a run")
    p.add_argument(
        "--child", nargs=2, metavar=("ARGS", "RESULT"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    if not (args.outdir or args.table or args.child):
        p.error("OUTDIR is required")
    if args.budget is None:
        args.budget = 450 if args.tp == 2 else 540
    if args.jobs is None:
        args.jobs = 2 if args.tp == 2 else 1
    if args.timeout is None:
        args.timeout = 240 if args.tp == 2 else 330
    if args.jobs < 1:
        p.error("--jobs: at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        sdm.child_main(args.child, run=run_child, before_exit=end_children)
    if args.table:
        data = json.loads(Path(args.table).read_text())
        print(format_table(data["rows"], data.get("gemma")))
        return 0
    if args.check_configs:
        return check_configs(args)
    return run_matrix(args)


if __name__ == "__main__":
    sys.exit(main())
