# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU: tiny GDN hybrids with every TurboQuant preset, with and without MTP.

Each configuration boots in its own process (vLLM's engine owns the GPU for
the life of an ``LLM``) with a fixed KV-cache budget, so the KV-cache token
counts of ``auto`` and each preset are directly comparable and can be checked
against the capacity planner's prediction for the same budget.

    python -m tests.models.tiny_hybrids.turboquant_matrix OUT.json [--jobs N] [MODEL ...]
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PRESETS = ("auto", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
MODELS = ("qwen3_5_text", "qwen3_next")
KV_CACHE_MEMORY_BYTES = 256 * 2**20
MAX_MODEL_LEN = 1024
NUM_SPECULATIVE_TOKENS = 1
_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


def write_model(name: str, path: Path, mtp: bool, num_layers: int = 8) -> Path:
    from .builders import qwen3_5_text, qwen3_dense, qwen3_next

    if name == "draft":
        # 6 KV heads x 128 = 3072 B/token at bf16 vs the hybrids' 2048: the
        # main model's attention pages get padded, in FlashAttention's layout.
        return qwen3_dense(path, num_layers=2, num_attention_heads=12, num_kv_heads=6)
    builder = {"qwen3_5_text": qwen3_5_text, "qwen3_next": qwen3_next}[name]
    return builder(path, mtp_layers=1 if mtp else 0, num_layers=num_layers)


# Configurations whose pages are padded: mixed TurboQuant/bf16 layers
# (boundary:1) and a dense draft beside a hybrid main. (model, dtype, mtp, extra)
PADDED = (
    # 16 layers: attention at 3, 7, 11, 15; boundary:1 keeps 3 and 15 at bf16.
    ("qwen3_5_text", "turboquant_4bit_nc", False, {"kv_cache_dtype_skip_layers": ["boundary:1"], "num_layers": 16}),
    ("qwen3_5_text", "turboquant_4bit_nc", True, {"kv_cache_dtype_skip_layers": ["boundary:1"], "num_layers": 16}),
    ("qwen3_next", "auto", False, {"draft": True}),
    ("qwen3_next", "turboquant_4bit_nc", False, {"draft": True}),
)


def engine_kwargs(name: str, model: Path, kv_cache_dtype: str, mtp: bool, extra: dict | None = None, draft: Path | None = None) -> dict:
    kwargs = dict(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES,
        gpu_memory_utilization=0.2,
        enforce_eager=True,
        kv_cache_dtype=kv_cache_dtype,
        seed=0,
    )
    if name == "qwen3_5_text":
        kwargs["language_model_only"] = True
    if mtp:
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    if draft is not None:
        kwargs["speculative_config"] = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    kwargs.update(extra or {})
    return kwargs


def boot_and_generate(kwargs: dict) -> list[int]:
    """Run in the child: boot, generate greedily, return generated lengths."""
    from vllm import LLM, SamplingParams

    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(10 + i, 42 + i))} for i in range(4)]
    outputs = llm.generate(prompts, params)
    return [len(o.outputs[0].token_ids) for o in outputs]


def run_one(name: str, kv_cache_dtype: str, mtp: bool, workdir: Path, extra: dict | None = None) -> dict:
    extra = dict(extra or {})
    model = write_model(name, workdir / f"{name}-mtp{int(mtp)}", mtp, extra.pop("num_layers", 8))
    draft = write_model("draft", workdir / "draft", False) if extra.pop("draft", False) else None
    kwargs = engine_kwargs(name, model, kv_cache_dtype, mtp, extra, draft)
    code = (
        "import json,sys;from tests.models.tiny_hybrids.turboquant_matrix import boot_and_generate;"
        "print('LENGTHS', json.dumps(boot_and_generate(json.loads(sys.argv[1]))))"
    )
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(kwargs)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    tokens = _KV_TOKENS.findall(log)
    lengths = re.findall(r"LENGTHS (\[.*\])", log)
    result = {
        "model": name,
        "mtp": mtp,
        "extra": {k: v for k, v in kwargs.items() if k in ("kv_cache_dtype_skip_layers", "speculative_config")},
        "kv_cache_dtype": kv_cache_dtype,
        "rc": proc.returncode,
        "seconds": round(time.time() - start, 1),
        "kv_tokens": int(tokens[-1].replace(",", "")) if tokens else None,
        "lengths": json.loads(lengths[-1]) if lengths else None,
        "log_tail": "\n".join(log.splitlines()[-25:]) if proc.returncode else "",
        "planner_lines": [l for l in log.splitlines() if "block size" in l or "mamba page" in l or "KV cache pages unified" in l][:6],
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--padded", action="store_true", help="the PADDED configurations instead")
    args = parser.parse_args(argv)
    if args.padded:
        configs = list(PADDED)
    else:
        configs = [(m, d, mtp, None) for m in args.models for mtp in (False, True) for d in PRESETS]
    results = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = [
            pool.submit(run_one, m, d, mtp, Path(tmp) / str(i), extra)
            for i, (m, d, mtp, extra) in enumerate(configs)
        ]
        for f in futures:
            r = f.result()
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "log_tail"}), flush=True)
            if r["rc"]:
                print(r["log_tail"], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
