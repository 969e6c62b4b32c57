# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU: tiny GDN hybrids with every TurboQuant preset, with and without MTP,
on saved random checkpoints (checkpoints.py), checked against references.

Each configuration boots in its own process (vLLM's engine owns the GPU for
the life of an ``LLM``) with a fixed KV-cache budget, so the KV-cache token
counts of ``auto`` and each preset are directly comparable with the capacity
planner's prediction. Each generates 64 greedy tokens for the matrix prompts
(``checkpoints.bigram_prompts``), and a row fails unless:

* it boots, every prompt gets 64 tokens with >= MIN_DISTINCT distinct ones
  (on ``load_format="dummy"`` the models emit one token over and over: the
  old version of this check only counted tokens and could not fail);
* ``auto`` without speculation equals transformers' fp32 greedy decode of
  the same checkpoint on the CPU, token for token, on every prompt
  (``vs hf-fp32``: GDN, attention, MoE and MTP weights as transformers runs
  them; the prompts are screened for top-1/top-2 gaps >= checkpoints.MIN_GAP
  so bf16 rounding cannot flip a token);
* with MTP (or a draft model): equals the same model and preset without
  speculation, token for token (``vs <preset> no-spec``), or every prompt
  that differs first differs where the reference's top-1/top-2 logprob gap
  is a near-tie (``spec_decode_matrix.near_tie``: under 1 % of its median
  gap; a verify row and a decode step may round two nearly equal logits
  differently);
* a TurboQuant preset without speculation agrees with ``auto`` on at least
  AGREE_MIN[preset] of all tokens (``vs auto``): quantized K/V moves the
  logits a little; a cache read that is wrong moves them a lot (the random
  checkpoints gave 8 % agreement between auto and a broken read on GPU).

    python -m tests.models.tiny_hybrids.turboquant_matrix OUT.json [--jobs N]
        [--only NAME_SUBSTRING]
"""

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import checkpoints as ck
from .ports import child_port_env
from .scheduling import NOT_RUN, run_grouped
from .spec_decode_matrix import near_tie

PRESETS = (
    "auto",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
)
# Smallest share of tokens a preset's greedy output shares with auto's. On
# an H100 (release 28) k8v4, 4bit_nc and k3v4_nc all read 0.941 on qwen3_5
# and 0.866 on qwen3_next (the same prompts leave auto's trajectory at the
# same near-ties), 3bit_nc 0.842 and 0.688; a cache read that is wrong reads
# about 0.08. A failing row prints the share it got.
AGREE_MIN = {
    "turboquant_k8v4": 0.8,
    "turboquant_4bit_nc": 0.8,
    "turboquant_k3v4_nc": 0.6,
    "turboquant_3bit_nc": 0.4,
    "turboquant_3bit_pair_nc": 0.4,
}
MIN_DISTINCT = 16
MODELS = ("qwen3_5", "qwen3_next")
KV_CACHE_MEMORY_BYTES = 256 * 2**20
MAX_MODEL_LEN = 1024
NEW_TOKENS = 64
_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")

# Checkpoint variants for the padded-page configurations.
VARIANTS: dict[str, tuple[str, ck.TinyModel]] = {
    # 16 layers: attention at 3, 7, 11, 15; boundary:1 keeps 3 and 15 at bf16.
    # Its own bigram_gain: each attention layer (+ MLP) adds ~0.04 RMS of
    # context to the residual stream, so 16 layers end at RMS 0.21 against
    # 8 layers' 0.12, and at qwen3_5's 0.0575 the chain drowns (CPU fp32,
    # matrix prompts x 64: 6 distinct tokens on prompt 7, 38 % of tokens
    # context-decided, min top-1/top-2 gap 6e-5 logits; on the H100 auto
    # had 6 distinct and left hf-fp32 at (9, 50)). Same greedy_stats sweep
    # as checkpoints.MODELS: 0.08 -> gap 0.0002 and an fp16 kernel-order
    # flip, 0.084 -> 0.012, 0.0845 -> 0.0245 (qwen3_5: 0.027), 64 distinct
    # everywhere, 6 of 768 tokens context-decided, bigram_follow 0.992, no
    # fp16 flip or departure from fp32; 0.085 -> 0.011, 0.09 -> 7e-5, 0.1
    # -> 0.04 but nothing context-decided (blind to context).
    "qwen3_5_16": (
        "qwen3_5",
        dataclasses.replace(
            ck.MODELS["qwen3_5"],
            bigram_gain=0.0845,
            builder_kwargs={"mtp_layers": 1, "num_layers": 16},
        ),
    ),
    # 6 KV heads x 128 = 3072 B/token at bf16 vs the hybrid's 2048: the main
    # model's attention pages get padded. Shares qwen3_next's chain, so its
    # drafts get accepted.
    "draft_padded": (
        "qwen3_dense_draft",
        dataclasses.replace(
            ck.MODELS["qwen3_dense_draft"],
            builder_kwargs={
                **ck.MODELS["qwen3_dense_draft"].builder_kwargs,
                "num_layers": 2,
                "num_attention_heads": 12,
                "num_kv_heads": 6,
                "head_dim": 128,
            },
        ),
    ),
}


@dataclasses.dataclass(frozen=True)
class Config:
    model: str  # key of checkpoints.MODELS or VARIANTS
    kv: str
    spec: str = "none"  # none | mtp | draft
    skip: tuple[str, ...] = ()  # kv_cache_dtype_skip_layers

    @property
    def name(self) -> str:
        skip = "+" + ",".join(self.skip) if self.skip else ""
        return f"{self.model}.{self.kv}{skip}.{self.spec}"

    def no_spec(self) -> "Config":
        return dataclasses.replace(self, spec="none")

    def auto(self) -> "Config":
        return Config(self.model, "auto")


def configs() -> list[Config]:
    grid = [
        Config(m, kv, spec)
        for m in MODELS
        for spec in ("none", "mtp")
        for kv in PRESETS
    ]
    padded = [
        Config("qwen3_5_16", "auto"),
        Config("qwen3_5_16", "turboquant_4bit_nc", "none", ("boundary:1",)),
        Config("qwen3_5_16", "turboquant_4bit_nc", "mtp", ("boundary:1",)),
        # One attention layer with its own preset: its pages differ from the
        # other quantized layers', so the runner must shape each from its own.
        *(
            Config(
                "qwen3_5_16",
                "turboquant_3bit_nc",
                spec,
                ("boundary:0", "7=turboquant_4bit_nc"),
            )
            for spec in ("none", "mtp")
        ),
        # Recent tokens read raw from a bf16 sliding-window twin per layer
        # (recent:W): its pages beside GDN and packed pages, its rows per
        # verify token.
        *(
            Config(
                "qwen3_5_16", "turboquant_3bit_nc", spec, ("boundary:0", "recent:16")
            )
            for spec in ("none", "mtp")
        ),
        Config("qwen3_next", "auto", "draft"),
        Config("qwen3_next", "turboquant_4bit_nc", "draft"),
        # 3bit_nc's bytes with keys coded by pairs: its own decode path,
        # verify rows included.
        *(
            Config("qwen3_5", "turboquant_3bit_pair_nc", spec)
            for spec in ("none", "mtp")
        ),
    ]
    return grid + padded


def build_checkpoints(root: Path) -> dict[str, str]:
    paths = {
        k: str(v) for k, v in ck.build_all(root, ["qwen3_5", "qwen3_next"]).items()
    }
    for name, (base, spec) in VARIANTS.items():
        share = paths[spec.shares_head_with] if spec.shares_head_with else None
        paths[name] = str(
            ck.build_checkpoint(base, root / name, spec=spec, share_from=share)
        )
    return paths


def engine_kwargs(cfg: Config, ckpts: dict[str, str]) -> dict[str, Any]:
    base = VARIANTS[cfg.model][1] if cfg.model in VARIANTS else ck.MODELS[cfg.model]
    kwargs: dict[str, Any] = dict(
        model=ckpts[cfg.model],
        skip_tokenizer_init=True,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES,
        gpu_memory_utilization=0.1,
        enforce_eager=True,
        kv_cache_dtype=cfg.kv,
        # checkpoints.MATRIX_DTYPE (float16): rounding cannot flip a token
        # on the screened prompts, so auto can equal transformers' fp32.
        dtype=ck.MATRIX_DTYPE,
        seed=0,
        **base.engine_kwargs,
    )
    if cfg.spec == "mtp":
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 1}
    elif cfg.spec == "draft":
        kwargs["speculative_config"] = {
            "method": "draft_model",
            "model": ckpts["draft_padded"],
            "num_speculative_tokens": 2,
        }
    if cfg.skip:
        kwargs["kv_cache_dtype_skip_layers"] = list(cfg.skip)
    return kwargs


def boot_and_generate(
    kwargs: dict, prompts: list[list[int]], logprobs: bool = False
) -> dict[str, list]:
    """Run in the child: boot, generate greedily, return the token ids and,
    with ``logprobs``, each token's top-1/top-2 logprob gap."""
    from vllm import LLM, SamplingParams

    llm = LLM(**kwargs)
    params = SamplingParams(
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        logprobs=2 if logprobs else None,
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    result: dict[str, list] = {
        "outputs": [list(o.outputs[0].token_ids) for o in outputs]
    }
    if logprobs:
        result["gaps"] = [
            [
                top[0] - top[1] if len(top) > 1 else None
                for top in (
                    sorted((v.logprob for v in lp.values()), reverse=True)
                    for lp in o.outputs[0].logprobs or []
                )
            ]
            for o in outputs
        ]
    return result


# The child ends without the engine's teardown once its outputs are printed:
# on the H100 an MTP engine's exit hung after the work was done until the
# gate's deadline killed it (as spec_decode_matrix's children end, too).
_CHILD = (
    "import json,os,sys;"
    "from tests.models.tiny_hybrids.turboquant_matrix import boot_and_generate;"
    "a=json.load(open(sys.argv[1]));"
    "r=boot_and_generate(a['engine'],a['prompts'],a['logprobs']);"
    "print('OUTPUTS', json.dumps(r['outputs']), flush=True);"
    "print('GAPS', json.dumps(r.get('gaps')), flush=True);"
    "sys.stderr.flush();"
    "os._exit(0)"
)


def run_one(
    cfg: Config,
    kwargs: dict,
    prompts: list,
    workdir: Path,
    deadline: float | None = None,
) -> dict:
    """One engine in a child process; ``deadline`` (a ``time.time()``) bounds
    when it may start and how long it may run."""
    timeout = 600.0
    if deadline is not None:
        timeout = min(timeout, deadline - time.time())
        if timeout < 20:
            return {"name": cfg.name, "rc": "not run", "seconds": 0,
                    "log_tail": NOT_RUN}  # fmt: skip
    args_file = workdir / f"{cfg.name}.args.json"
    # The references of speculative rows log their logprob gaps (check()).
    args = {"engine": kwargs, "prompts": prompts, "logprobs": cfg.spec == "none"}
    args_file.write_text(json.dumps(args))
    start = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(args_file)],
            capture_output=True,
            text=True,
            timeout=timeout,
            # Engine core in the child's own process, so that its exit
            # (_CHILD) leaves no engine process behind on the GPU.
            env=dict(
                os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **child_port_env()
            ),
        )
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log, rc = f"{e.stdout or ''}{e.stderr or ''}\nTIMEOUT", "timeout"
    tokens = _KV_TOKENS.findall(log)
    outs = re.findall(r"^OUTPUTS (\[.*\])$", log, re.M)
    gaps = re.findall(r"^GAPS (.*)$", log, re.M)
    return {
        "name": cfg.name,
        "rc": rc,
        "seconds": round(time.time() - start, 1),
        "kv_tokens": int(tokens[-1].replace(",", "")) if tokens else None,
        "outputs": json.loads(outs[-1]) if outs else None,
        "gaps": json.loads(gaps[-1]) if gaps else None,
        "log_tail": "\n".join(log.splitlines()[-25:]) if rc else "",
        "planner_lines": [
            line
            for line in log.splitlines()
            if "block size" in line
            or "mamba page" in line
            or "KV cache pages unified" in line
        ][:6],
    }


def hf_reference(path: str, prompts: list[list[int]]) -> list[list[int]]:
    import torch

    torch.set_num_threads(4)
    model = ck.load_for_cpu(path)
    model.generation_config.eos_token_id = None
    return [ck.trajectory(model, p, NEW_TOKENS)[0] for p in prompts]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for u, v in zip(a, b) for x, y in zip(u, v)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def first_diffs(a: list[list[int]], b: list[list[int]]) -> list[tuple[int, int]]:
    """(prompt, token) of each prompt's first difference, a length too."""
    out = []
    for i, (u, v) in enumerate(zip(a, b)):
        t = next((t for t, (x, y) in enumerate(zip(u, v)) if x != y), None)
        if t is not None or len(u) != len(v):
            out.append((i, t if t is not None else min(len(u), len(v))))
    return out


def first_diff(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    return next(iter(first_diffs(a, b)), None)


def check(
    cfg: Config,
    rec: dict,
    records: dict[str, dict],
    hf: dict[str, list[list[int]]],
) -> dict:
    """Verdict of one row: ``ok``, what it was compared against, why not."""
    row = {k: v for k, v in rec.items() if k not in ("outputs", "gaps")}
    row["config"] = dataclasses.asdict(cfg)
    outs = rec.get("outputs")
    if rec["rc"] != 0 or outs is None:
        return {**row, "ok": False, "against": "-", "why": f"rc={rec['rc']}"}
    why = []
    if any(len(o) != NEW_TOKENS for o in outs):
        why.append(f"lengths {sorted({len(o) for o in outs})}")
    distinct = min(len(set(o)) for o in outs)
    row["distinct_min"] = distinct
    if distinct < MIN_DISTINCT:
        why.append(f"{distinct} distinct tokens < {MIN_DISTINCT} (blind)")
    if not rec.get("kv_tokens"):
        why.append("no KV-cache size in the log")
    if cfg.spec != "none":
        ref_name = cfg.no_spec().name
        against = f"{cfg.kv} no-spec"
        ref = records.get(ref_name, {})
        if ref.get("outputs") is None:
            why.append(f"no reference ({ref_name})")
        else:
            diffs = first_diffs(ref["outputs"], outs)
            ties = [near_tie(ref.get("gaps"), p, t) for p, t in diffs]
            wrong = [d for d, (tie, _) in zip(diffs, ties) if not tie]
            if wrong:
                why.append(f"first difference (prompt, token) {wrong[0]}")
            elif diffs:
                gaps = ", ".join(f"{g:.2g}" for _, g in ties)
                row["tie"] = f"differs at near-ties {diffs} (top-1/top-2 gaps {gaps})"
    elif cfg.kv == "auto":
        against = "hf-fp32"
        ref = hf.get(cfg.model)
        diff = first_diff(ref, outs) if ref else ("no reference", cfg.model)
        if diff:
            why.append(f"first difference (prompt, token) {diff}")
    else:
        against = "auto"
        ref = records.get(cfg.auto().name, {}).get("outputs")
        share = agreement(ref, outs) if ref else 0.0
        row["agree_auto"] = round(share, 3)
        if share < AGREE_MIN[cfg.kv]:
            why.append(f"agrees with auto on {share:.1%} < {AGREE_MIN[cfg.kv]:.0%}")
    return {**row, "ok": not why, "against": against, "why": "; ".join(why)}


def run_matrix(
    cfgs: list[Config],
    jobs: int,
    workdir: Path | None = None,
    deadline: float | None = None,
) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        ckpts = build_checkpoints(work / "ckpt")
        prompts = ck.bigram_prompts(12)
        needed = {c.no_spec() for c in cfgs if c.spec != "none"}
        needed |= {c.auto() for c in cfgs if c.spec == "none" and c.kv != "auto"}
        todo = list(dict.fromkeys([*cfgs, *needed]))
        with ThreadPoolExecutor(1) as side:
            # Each checkpoint and KV dtype's first engine compiles its kernels
            # before the others of that pair start (scheduling.py).
            engines = side.submit(
                run_grouped,
                todo,
                lambda c: (c.model, c.kv),
                lambda c: run_one(c, engine_kwargs(c, ckpts), prompts, work, deadline),
                jobs,
            )
            # transformers' reference on the CPU while the engines run.
            hf = {
                m: hf_reference(ckpts[m], prompts)
                for m in {c.model for c in cfgs if c.kv == "auto" and c.spec == "none"}
            }
            records = {c.name: r for c, r in zip(todo, engines.result())}
    return [check(c, records[c.name], records, hf) for c in cfgs]


def format_rows(rows: list[dict]) -> str:
    out = []
    for r in rows:
        status = "ok  " if r["ok"] else "FAIL"
        agree = f" agree={r['agree_auto']:.1%}" if "agree_auto" in r else ""
        out.append(
            f"{status} {r['name']:<44} vs {r['against']:<28} "
            f"kv_tokens={r.get('kv_tokens')} distinct={r.get('distinct_min')}"
            f"{agree} {r['seconds']}s {r['why'] or r.get('tie', '')}"
        )
    out.append(f"{sum(r['ok'] for r in rows)}/{len(rows)} rows ok")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--only", help="rows whose name contains this")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds for the whole run: engines that cannot start before it "
        "are recorded NOT RUN, running ones are stopped at it",
    )
    args = parser.parse_args(argv)
    cfgs = [c for c in configs() if not args.only or args.only in c.name]
    deadline = time.time() + args.deadline if args.deadline else None
    rows = run_matrix(cfgs, args.jobs, args.workdir, deadline)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(format_rows(rows))
    for r in rows:
        if not r["ok"] and r.get("log_tail"):
            print(f"--- {r['name']}\n{r['log_tail']}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
