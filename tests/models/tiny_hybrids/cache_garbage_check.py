# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU: the same request gives the same numbers in a fresh engine and later,
whatever bytes the KV cache held before it.

Two ways attention can make a request's result depend on something other than
its tokens: reading KV-cache bytes no token wrote (a whole tile or the padding
of a page, masked by weight, ``p * v`` with ``p = 0``, instead of by load:
``0 * NaN``), and state that is not ready in an engine's first steps. Each
engine here runs the same prompts (chunked prefill, so later chunks read the
cache) four times, first in the fresh engine, then after filling every
KV-cache tensor with 0xFF (NaN in fp16 and fp8), 0x7F (NaN in fp8 e4m3) and
0x00, and records the greedy tokens and the prompt log-probabilities. Every
run must give the first run's numbers.

On release 28 (one H200) the tiny Gemma 3 (sliding-window layers at bf16,
full-attention layers 5 and 11 on TurboQuant, head_dim 256) fails it: the
first run's first prompt differs from runs 2-4, which agree with each other
whatever the fill; the dense Qwen3 and ``auto`` pass.

    python -m tests.models.tiny_hybrids.cache_garbage_check OUTDIR [--only S]

Prints one line per engine and writes OUTDIR/garbage.json. Exit status 0
when every engine's runs agree, 1 when one does not or an engine failed, 2
for bad arguments.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

FILLS = (0x00, 0xFF, 0x7F, 0x00)
KV_DTYPES = ("auto", "turboquant_4bit_nc", "turboquant_k8v4")


def gemma3_text(path: Path) -> Path:
    """A tiny random Gemma 3 text model: sliding window 64 on 10 of 12
    layers, full attention on layers 5 and 11, head_dim 256, one KV head."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
             for i in range(12)]  # fmt: skip
    config = Gemma3TextConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=512,
        num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, sliding_window=64, layer_types=types,
        query_pre_attn_scalar=256, max_position_embeddings=4096,
        tie_word_embeddings=True, torch_dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def prompts(n: int = 4, length: int = 1000) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(10, 2000) for _ in range(length)] for _ in range(n)]


def _fill(worker, byte: int) -> int:
    import torch

    caches = worker.model_runner.kv_caches
    for t in caches:
        t.view(torch.uint8).fill_(byte)
    torch.accelerator.synchronize()
    return len(caches)


def child(args: dict) -> dict:
    from vllm import LLM, SamplingParams

    skip = (
        {"kv_cache_dtype_skip_layers": ["boundary:0"]} if args["kv"] != "auto" else {}
    )
    llm = LLM(
        model=args["model"], kv_cache_dtype=args["kv"], skip_tokenizer_init=True,
        max_model_len=2048, kv_cache_memory_bytes=256 * 2**20,
        gpu_memory_utilization=0.05, enforce_eager=True,
        enable_chunked_prefill=True, max_num_batched_tokens=256,
        enable_prefix_caching=False, seed=0, **skip,
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=0,
        detokenize=False,
    )  # fmt: skip
    runs = []
    for byte in FILLS:
        tensors = llm.collective_rpc(_fill, args=(byte,))[0]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False
        )
        runs.append({
            "fill": byte,
            "tensors": tensors,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "prompt_logprob_sums": [
                sum(next(iter(d.values())).logprob for d in o.prompt_logprobs[1:])
                for o in outs
            ],
        })  # fmt: skip
    return {"runs": runs}


def verdict(runs: list[dict]) -> tuple[bool, str]:
    first = runs[0]
    bad = []
    for r in runs[1:]:
        same_tokens = r["tokens"] == first["tokens"]
        sums = zip(r["prompt_logprob_sums"], first["prompt_logprob_sums"])
        same_lp = all(
            not math.isnan(a) and abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in sums
        )
        if not (same_tokens and same_lp):
            tokens = "same" if same_tokens else "DIFFER"
            got = [round(x, 2) for x in r["prompt_logprob_sums"]]
            want = [round(x, 2) for x in first["prompt_logprob_sums"]]
            bad.append(
                f"fill 0x{r['fill']:02X}: tokens {tokens}, "
                f"prompt logprob sums {got} vs {want}"
            )
    return not bad, "; ".join(bad) or "every fill agrees"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.models.tiny_hybrids.cache_garbage_check"
    )
    p.add_argument("outdir", type=Path)
    p.add_argument("--only", default="", help="cells whose name contains this")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        result = child(json.loads(Path(a.child).read_text()))
        Path(a.child).with_suffix(".out.json").write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)
    from .checkpoints import build_all

    a.outdir.mkdir(parents=True, exist_ok=True)
    models = {"gemma3_text": str(gemma3_text(a.outdir / "gemma3_text"))}
    models["qwen3_dense"] = str(
        build_all(a.outdir / "ckpt", ["qwen3_dense"])["qwen3_dense"]
    )
    cells = [(m, kv) for m in models for kv in KV_DTYPES if a.only in f"{m}.{kv}"]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    repo = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(x for x in (repo, env.get("PYTHONPATH")) if x)
    procs = []
    for m, kv in cells:
        args = a.outdir / f"{m}.{kv}.json"
        args.write_text(json.dumps({"model": models[m], "kv": kv}))
        with open(a.outdir / f"{m}.{kv}.log", "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.models.tiny_hybrids.cache_garbage_check",
                 str(a.outdir), "--child", str(args)],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        procs.append((m, kv, args, time.time(), proc))
    results, ok = {}, True
    for m, kv, args, t0, proc in procs:
        try:
            proc.wait(timeout=max(1.0, a.timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
        out = args.with_suffix(".out.json")
        if out.exists():
            good, why = verdict(json.loads(out.read_text())["runs"])
        else:
            good, why = False, f"engine failed (rc {proc.returncode}; log {m}.{kv}.log)"
        ok &= good
        results[f"{m}.{kv}"] = {"ok": good, "why": why}
        print(f"{m:12s} {kv:20s} {'ok' if good else 'FAILED'}  {why}", flush=True)
    (a.outdir / "garbage.json").write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
