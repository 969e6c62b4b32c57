# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One cell of the KV-quality harness: one vLLM engine, four measurements.

Run by the harness as ``benchmark_kv_quality.py --child ARGS.json`` in its
own process (own session, CUDA_VISIBLE_DEVICES set, in-process engine core:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). ARGS.json names the checkpoint, the
engine keyword arguments, the inputs file the parent built and where the
result goes. The phases run cheapest first (perplexity, agreement, needles, the
needles' answers scored under teacher forcing)
and the result file is rewritten (tmp + rename) after each, so a cell killed
by its timeout still hands over what it measured. Exit status: 0 every phase
measured; 3 the engine or a phase raised (the result names which, the log
has the traceback). The process ends with ``os._exit`` after flushing:
engine teardown has hung before, and nothing after the last write matters.
"""

import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import kvq_measures as measures

NEEDLE_NEW_TOKENS = 12
AGREEMENT_NEW_TOKENS = 64
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def _say(msg: str) -> None:
    print(f"[kv-quality] {msg}", flush=True)


def _exc_line(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:300]


def _write_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


# ---------------------------------------------------------------- engine facts


def _probe_worker(worker: Any) -> dict:
    """Runs on the worker (in this process): what each attention layer runs."""
    runner = worker.model_runner
    layers = {}
    for name, module in runner.compilation_config.static_forward_context.items():
        if not hasattr(module, "kv_cache_dtype"):
            continue
        backend = getattr(module, "attn_backend", None)
        info: dict[str, Any] = {
            "kv_cache_dtype": str(module.kv_cache_dtype),
            "backend": backend.get_name() if backend is not None else None,
            "impl": type(getattr(module, "impl", None)).__name__,
            "sliding_window": getattr(module, "sliding_window", None),
            "head_size": getattr(module, "head_size", None),
            "head_size_v": getattr(module, "head_size_v", None),
            "num_kv_heads": getattr(module, "num_kv_heads", None),
        }
        cache = getattr(module, "kv_cache", None)
        if isinstance(cache, (list, tuple)):
            cache = cache[0] if cache else None
        if hasattr(cache, "dtype") and hasattr(cache, "shape"):
            info["cache_tensor"] = f"{cache.dtype} {list(cache.shape)}"
        layers[name] = info
    groups = []
    config = getattr(runner, "kv_cache_config", None)
    for group in getattr(config, "kv_cache_groups", None) or []:
        spec = group.kv_cache_spec
        # A group of one type with several page shapes keeps each layer's.
        per_layer = getattr(spec, "kv_cache_specs", None) or {}
        for name in group.layer_names:
            own = per_layer.get(name, spec)
            if name in layers and getattr(own, "block_size", None):
                layers[name]["bytes_per_token"] = own.page_size_bytes / own.block_size
        groups.append(
            {
                "spec": type(spec).__name__,
                "layers": len(group.layer_names),
                "block_size": getattr(spec, "block_size", None),
                "dtype": str(getattr(spec, "dtype", None)),
                "sliding_window": getattr(spec, "sliding_window", None),
            }
        )
    return {
        "layers": layers,
        "kv_cache_groups": groups,
        "num_blocks": getattr(config, "num_blocks", None),
    }


def _bits_inputs(info: dict) -> dict:
    heads, size = info.get("num_kv_heads"), info.get("head_size")
    size_v = info.get("head_size_v") or size
    return {
        "kv_cache_dtype": info["kv_cache_dtype"],
        "bytes_per_token": info.get("bytes_per_token"),
        "elements_per_token": heads * (size + size_v) if heads and size else None,
        "sliding_window": info.get("sliding_window"),
    }


def engine_facts(llm: Any) -> dict:
    """Per-layer KV dtype and backend as the engine runs them; never raises."""
    facts: dict[str, Any] = {}
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        facts["num_gpu_blocks"] = cache.num_gpu_blocks
        facts["block_size"] = cache.block_size
        facts["skip_layers_resolved"] = list(cache.kv_cache_dtype_skip_layers or [])
    except Exception as e:  # evidence only: record why, go on
        facts["cache_config"] = f"unknown: {_exc_line(e)}"
    try:
        probe = llm.collective_rpc(_probe_worker)[0]
    except Exception as e:
        facts["layers"] = f"unknown: {_exc_line(e)}"
        return facts
    facts.update(probe)
    by_dtype: dict[str, list] = {}
    for name, info in probe["layers"].items():
        m = _LAYER_INDEX.search(name)
        label = f"{info['kv_cache_dtype']} ({info['backend']})"
        by_dtype.setdefault(label, []).append(int(m.group(1)) if m else name)
    facts["layers_by_dtype"] = by_dtype
    try:
        context = llm.llm_engine.vllm_config.model_config.max_model_len
        facts["kv_bits"] = measures.kv_bits_per_element(
            [_bits_inputs(info) for info in probe["layers"].values()], context
        )
        facts["kv_bits"]["context"] = context
    except Exception as e:
        facts["kv_bits"] = f"unknown: {_exc_line(e)}"
    quantized = [i for i in probe["layers"].values() if i["kv_cache_dtype"] != "auto"]
    facts["quantized_layers"] = len(quantized)
    facts["attention_layers"] = len(probe["layers"])
    return facts


# ---------------------------------------------------------------- phases


def _as_prompts(ids: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in ids]


def run_ppl(llm: Any, sp: Any, prompts: list[list[int]]) -> dict:
    # One output token; prompt_logprobs=0 returns each prompt token's own
    # logprob (no alternatives). No detokenizing: only numbers are wanted.
    params = sp(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate(_as_prompts(prompts), params, use_tqdm=False)
    windows = [measures.window_nll(p, o.prompt_logprobs) for p, o in zip(prompts, outs)]
    return measures.perplexity_summary(windows)


def run_agreement(llm: Any, sp: Any, prompts: list[list[int]]) -> dict:
    # ignore_eos: every output has the same length, so the comparison with
    # auto is over the same 16 x 64 positions in every cell.
    params = sp(
        max_tokens=AGREEMENT_NEW_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
    )
    outs = llm.generate(_as_prompts(prompts), params, use_tqdm=False)
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs]}


def run_needle(llm: Any, sp: Any, prompts: list[list[int]], cases: list) -> dict:
    params = sp(max_tokens=NEEDLE_NEW_TOKENS, temperature=0.0)
    outs = llm.generate(_as_prompts(prompts), params, use_tqdm=False)
    answers = []
    for case, o in zip(cases, outs):
        text = o.outputs[0].text
        answers.append(
            {
                "hit": measures.needle_hit(case["number"], text),
                "text": text,
                "token_ids": list(o.outputs[0].token_ids),
            }
        )
    summary = measures.recall_summary(cases, [a["hit"] for a in answers])
    summary["answers"] = answers
    return summary


def run_answer(llm: Any, sp: Any, prompts: list[list[int]], cases: list) -> dict:
    # Each needle prompt followed by its answer, scored as perplexity is:
    # a continuous measure of retrieval beside the hits, which flip on
    # cases at the boundary.
    scored = [p + c["answer"] for p, c in zip(prompts, cases)]
    params = sp(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate(_as_prompts(scored), params, use_tqdm=False)
    return measures.answer_summary(
        [
            measures.window_nll(ids, o.prompt_logprobs, start=len(p))
            for ids, p, o in zip(scored, prompts, outs)
        ]
    )


# ---------------------------------------------------------------- main


def _summary(phase: str, result: dict) -> str:
    """One line of a phase's figures for the log (the result has them all)."""
    got = result.get(phase)
    if phase in result["errors"]:
        return f"; FAILED: {result['errors'][phase]}"
    if not isinstance(got, dict):
        return ""
    if phase == "ppl":
        return f"; perplexity {got['ppl']} over {got['tokens']} tokens"
    if phase == "needle":
        return f"; recall {got['recall_pct']} %, per length {got['per_length']}"
    if phase == "agreement":
        return f"; {len(got['outputs'])} outputs"
    if phase == "answer":
        return f"; mean answer NLL {got['mean_nll']}"
    return ""


def main(args_path: str) -> None:
    start = time.perf_counter()
    args = json.loads(Path(args_path).read_text())
    out = Path(args["result"])
    result: dict[str, Any] = {"key": args["key"], "timings": {}, "errors": {}}

    def phase_done(name: str, t0: float) -> None:
        result["timings"][f"{name}_s"] = round(time.perf_counter() - t0, 2)
        _write_atomic(out, result)
        _say(f"{name}: {result['timings'][f'{name}_s']} s{_summary(name, result)}")

    def finish() -> None:
        result["timings"]["total_s"] = round(time.perf_counter() - start, 2)
        _write_atomic(out, result)
        errors = result["errors"] or "none"
        _say(f"done in {result['timings']['total_s']} s; errors: {errors}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3 if result["errors"] else 0)

    inputs = json.loads(Path(args["inputs"]).read_text())
    prompts = inputs["prompts"]
    _say(f"cell {args['key']}: engine {json.dumps(args['engine'])}")
    t0 = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams

        phase_done("import", t0)
        t0 = time.perf_counter()
        llm = LLM(model=args["model_dir"], **args["engine"])
    except BaseException as e:  # SystemExit too: vLLM exits on some faults
        traceback.print_exc()
        result["errors"]["engine"] = _exc_line(e)
        finish()
    phase_done("engine_init", t0)

    t0 = time.perf_counter()
    result["facts"] = engine_facts(llm)
    phase_done("probe", t0)
    _say(f"KV dtype per layer: {result['facts'].get('layers_by_dtype')}")

    phases = {
        "ppl": lambda: run_ppl(llm, SamplingParams, prompts["ppl"]),
        "agreement": lambda: run_agreement(llm, SamplingParams, prompts["agreement"]),
        "needle": lambda: run_needle(
            llm, SamplingParams, prompts["needle"], inputs["meta"]["needle"]["cases"]
        ),
        "answer": lambda: run_answer(
            llm, SamplingParams, prompts["needle"], inputs["meta"]["needle"]["cases"]
        ),
    }
    for name in args["phases"]:
        t0 = time.perf_counter()
        try:
            result[name] = phases[name]()
        except BaseException as e:
            traceback.print_exc()
            result["errors"][name] = _exc_line(e)
        phase_done(name, t0)
    finish()
