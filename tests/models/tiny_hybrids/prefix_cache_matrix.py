# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU: prefix caching on the tiny hybrids with TurboQuant and speculation,
measured before anything is changed (issue 47, "First measure").

vLLM 0.20.2 leaves prefix caching off by default on hybrid (GDN/Mamba +
attention) models; ``enable_prefix_caching=True`` turns it on with a Mamba
cache mode (``mamba_cache_mode``: ``all`` or ``align``). Each cell is one
engine with prefix caching on, one model (the saved tiny checkpoints of
checkpoints.py, rebuilt with ``max_position_embeddings`` 16384 so that an 8K
prefix fits; same weights), KV dtype, speculation and Mamba cache mode; the
dense Qwen3 is the control (no Mamba cache mode). Per cell:

* boot, or the first root cause in the engine log (spec_decode_matrix's
  ``first_root_cause``);
* what the engine chose, read in-process (engine core in the child's own
  process): ``cache_config`` (block size, ``mamba_block_size``, the Mamba
  cache mode after vLLM's own fallbacks, ``mamba_page_size_padded``) and
  the scheduler's KV-cache groups (spec type, block size, page bytes; the
  GDN state bytes unpadded);
* prefix-cache hits: four groups of requests, each a warm-up request and
  then ``--hits`` requests in one batch that share its prefix (2K or 8K
  tokens) with other suffixes (the screened matrix prompts). In the ``2K`` /
  ``8K`` groups the warm-up request is the prefix plus a message of its own
  (``--warm-suffix``, 512 tokens: the first user of a shared system
  prompt); in ``2K-pre`` / ``8K-pre`` it is the prefix alone. Hit rate of
  the hit requests from the engine's ``vllm:prefix_cache_hits`` /
  ``vllm:prefix_cache_queries`` counters (``LLM.get_metrics()``, stats on)
  and per request (``num_cached_tokens``),
  beside the block-granular ideal (the prefix rounded down to whole blocks)
  and what a reading of 0.20.2's align-mode scheduler predicts
  (``predicted_cached``);
* greedy outputs (``--new-tokens``) of every request against the same
  request in a fresh engine of the same model, KV dtype and speculation with
  prefix caching OFF (the ``cold`` engine, one per model/KV/speculation, the
  same requests in the same batches): ``hit vs cold`` over the hit requests,
  ``warm vs cold`` over the warm-up ones (served with caching on but no
  hit). ``auto`` must be token-exact; a TurboQuant cell that is not is
  compared with TurboQuant's own spread, the share of tokens its cold engine
  shares with the ``auto`` cold engine on the same requests. A first
  difference at a near-tie of the cold engine's top-1/top-2 logprobs is
  marked ``tie`` (spec_decode_matrix's ``compare``). ``ctx``: tokens of the
  cold outputs that are not the bigram successor of the token before (where
  attention/GDN decided; a wrong cached state can only show there);
* KV tokens: the engine's "GPU KV cache size" line at a fixed KV budget
  (``KV_CACHE_MEMORY_BYTES``) and ``num_gpu_blocks``; beside them what the
  CPU plan (prefix_cache_plan.py, the capacity planner driven with prefix
  caching on) predicts for the same configuration, run alongside on the CPU.

    python -m tests.models.tiny_hybrids.prefix_cache_matrix OUTDIR [--jobs N]
        [--deadline S] [--only SUBSTR] [--workdir DIR] [--hits N]
        [--new-tokens N] [--cg NONE|FULL_AND_PIECEWISE] [--no-plan]
        [--preempt [--preempt-sim JSON]] [--trained NAME=DIR ...]
    python -m tests.models.tiny_hybrids.prefix_cache_matrix --table OUTDIR/matrix.json

``--preempt`` serves each prefix-caching cell from the KV budget at which
vLLM's scheduler, serving the same phases on CPU (preemption_sim.py, run
first), preempts it; the cold engines keep the fixed budget. A batch of hit
requests then outgrows the cache, the scheduler preempts
(``vllm:num_preemptions``, the ``preempted`` column, with the simulation's
counts beside it) and recomputes, and hit vs cold says whether a preempted
request, served from cached blocks again, still gives the cold engine's
tokens.

``--trained NAME=DIR`` adds the cells of a trained checkpoint (the
real-weights issue's SmolLM2-135M and Gemma-3-270M, as
``tests.models.real_weights.checkpoints`` converts them): a dense or
sliding-window model, served in bf16, ``auto`` and TurboQuant, without
speculation and with ngram, on text prompts of its own tokens
(``prefix_prompts``, built here and handed to its engines). Its outputs are
not a bigram chain, so its ``ctx`` column is empty. Its engines keep their
top raw logits: an ``auto`` hit that differs from cold passes where every
changed token is a rounding flip (``logit_flips``; ``hit drift ulps``), and a
TurboQuant hit is judged against TurboQuant's own spread, as on the tiny
models, with TurboQuant's own drift from ``auto`` beside it (``TQ drift
ulps``). Its engines take the matrix's ``max_model_len`` or the model's own
where shorter, which ``--prefix-lens`` must fit (SmolLM2: 8,192 positions,
e.g. ``2048,7168``).

``--only`` keeps the cells whose name (``model.kv.spec.mode``) contains the
substring, or one of several separated by commas; the cold engines they need
come along. Engines start in compile groups (scheduling.py: one per
checkpoint and KV dtype), cold engines first, then ``align`` cells, the
dense control, and the ``all`` cells last (vLLM 0.20.2 turns ``all`` into
``align`` for these models, see PREFIX_CACHING.md), so a ``--deadline``
(510 s by default) marks the least informative cells NOT RUN. Writes
OUTDIR/matrix.json, OUTDIR/matrix.md, OUTDIR/logs.tar.gz; checkpoints and
compile caches go to ``--workdir`` (default OUTDIR/work).
"""

import argparse
import dataclasses
import json
import math
import random
import re
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from . import logit_flips
from . import spec_decode_matrix as sdm

MODULE = "tests.models.tiny_hybrids.prefix_cache_matrix"

KV_DTYPES = ("auto", "turboquant_4bit_nc")
# Speculation: the spec-decode matrix's k=3 settings.
SPECS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "mtp": sdm.SPECS["mtp3"],
    "ngram": sdm.SPECS["ngram3"],
}
# Key of checkpoints.MODELS -> the speculation it has (the dense control has
# no MTP head: vLLM refuses "mtp" on it at config time).
MODELS: dict[str, tuple[str, ...]] = {
    "qwen3_next": ("none", "mtp", "ngram"),
    "qwen3_5": ("none", "mtp", "ngram"),
    # With MTP its fourth KV-cache tensor holds attention layers only: the
    # split block pool's cells (without MTP it plans as qwen3_5 does).
    "qwen3_5_split": ("mtp",),
    "qwen3_dense": ("none", "ngram"),
}
HYBRIDS = ("qwen3_next", "qwen3_5", "qwen3_5_split")
# A trained checkpoint's speculation (--trained: no MTP head) and dtype (the
# quality harness's).
TRAINED_SPECS = ("none", "ngram")
TRAINED_DTYPE = "bfloat16"
MODES = ("align", "all")
# The dense control's mode: none passed (vLLM ignores it without Mamba layers).
DENSE_MODE = "-"
COLD = "cold"

PREFIX_LENS = (2048, 8192)
HITS = 4
# The first request's own message after the shared prefix: longer than any
# attention block of the tiny models (<= 416 tokens), as a real one would be.
WARM_SUFFIX_LEN = 512
NEW_TOKENS = 64
MAX_POSITION = 16384
# 8K prefix + the longest suffix + new tokens + drafts, with room.
MAX_MODEL_LEN = 9216
MAX_NUM_SEQS = 16
# What `vllm serve` schedules per step on an H200 (its default for GPUs of
# >= 70 GiB): an 8K prefix plus a suffix takes two prefill steps.
MAX_NUM_BATCHED_TOKENS = 8192
# Fixed, so engines can share a GPU and the planner's figure is comparable.
KV_CACHE_MEMORY_BYTES = 512 * 2**20
GPU_MEMORY_UTILIZATION = 0.08
DEADLINE = 510
TIMEOUT = 300
PREFIX_SEED = 4700
_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


@dataclasses.dataclass(frozen=True)
class Cell:
    model: str  # key of checkpoints.MODELS
    kv: str
    spec: str  # key of SPECS
    mode: str  # "align" | "all" | DENSE_MODE | COLD (prefix caching off)

    @property
    def name(self) -> str:
        return f"{self.model}.{self.kv}.{self.spec}.{self.mode}"

    @property
    def prefix_caching(self) -> bool:
        return self.mode != COLD

    def cold(self) -> "Cell":
        return dataclasses.replace(self, mode=COLD)

    def auto_cold(self) -> "Cell":
        return Cell(self.model, "auto", self.spec, COLD)


def cells(trained: tuple[str, ...] = ()) -> list[Cell]:
    """Every prefix-caching cell, in the order they are listed; then those
    of the ``trained`` checkpoints (``--trained``)."""
    out = []
    for model, specs in {**MODELS, **dict.fromkeys(trained, TRAINED_SPECS)}.items():
        modes = MODES if model in HYBRIDS else (DENSE_MODE,)
        out += [
            Cell(model, kv, spec, mode)
            for kv in KV_DTYPES
            for spec in specs
            for mode in modes
        ]
    return out


def select(all_cells: list[Cell], only: str | None) -> list[Cell]:
    """The cells whose name contains one of ``only``'s comma-separated
    substrings (every cell without ``only``)."""
    wanted = only.split(",") if only else []
    chosen = [c for c in all_cells if not wanted or any(w in c.name for w in wanted)]
    if not chosen:
        names = ", ".join(c.name for c in all_cells[:4])
        raise SystemExit(
            f"--only {only!r}: no cell name contains any of it (names are "
            f"model.kv.spec.mode, e.g. {names}, ...)"
        )
    return chosen


def _run_order(cell: Cell) -> int:
    return {COLD: 0, "align": 1, DENSE_MODE: 2, "all": 3}[cell.mode]


def engine_plan(chosen: list[Cell]) -> list[Cell]:
    """The engines ``chosen`` needs, in queue order: the cold engine of every
    cell (and of ``auto`` beside a TurboQuant cell, for its spread), then the
    cells (align, dense, all)."""
    needed: list[Cell] = []
    for c in chosen:
        needed.append(c.cold())
        if c.kv != "auto":
            needed.append(c.auto_cold())
    engines = list(dict.fromkeys([*needed, *chosen]))
    return sorted(engines, key=_run_order)


def compile_group(cell: Cell) -> tuple[str, str]:
    return (cell.model, cell.kv)


# --------------------------------------------------------------------------
# Requests.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    group: str  # "2K", "8K", "2K-pre", "8K-pre"
    role: str  # "warm" | "hit"
    prefix_len: int
    tokens: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{self.group}.{self.role}"


def group_name(prefix_len: int, prewarm: bool) -> str:
    size = f"{prefix_len // 1024}K" if prefix_len % 1024 == 0 else str(prefix_len)
    return f"{size}-pre" if prewarm else size


def prefix_tokens(length: int, seed: int) -> list[int]:
    """``length`` seeded token ids of the tiny vocabulary, special ids left
    out (byte tokens and the rest of the vocabulary, as a long document)."""
    from .tokenizer import SPECIAL_TOKENS, TINY_VOCAB_SIZE

    special = set(SPECIAL_TOKENS.values())
    ids = [i for i in range(TINY_VOCAB_SIZE) if i not in special]
    rng = random.Random(seed)
    return [rng.choice(ids) for _ in range(length)]


def build_phases(
    prefix_lens: tuple[int, ...] = PREFIX_LENS,
    hits: int = HITS,
    suffixes: list[list[int]] | None = None,
    warm_suffix_len: int = WARM_SUFFIX_LEN,
    text: Any = None,
) -> list[list[Request]]:
    """One ``generate`` call per phase: per prefix length, a group whose
    warm-up request carries a user message of its own (``warm_suffix_len``
    tokens, longer than any block of the tiny models, ending in the first
    suffix), then a group whose warm-up request is the prefix alone
    (``-pre``); each warm-up phase is followed by a phase of ``hits``
    requests with that prefix and the next suffixes. Every group has its own
    prefix (its own seed), so no group hits another's. ``suffixes`` default:
    the screened matrix prompts (bigram_prompts). ``text`` (a trained
    checkpoint's ``prefix_prompts.CorpusPrompts``): the prefixes are its
    documents and the messages its passages instead."""
    document = passage = prefix_tokens
    if text is not None:
        document, passage = text.document, text.passage
        suffixes = text.messages(1 + hits, PREFIX_SEED + 100)
    elif suffixes is None:
        from .checkpoints import bigram_prompts

        suffixes = bigram_prompts(1 + hits)
    if len(suffixes) < 1 + hits:
        raise ValueError(f"need {1 + hits} suffixes, got {len(suffixes)}")
    filler = max(0, warm_suffix_len - len(suffixes[0]))
    warm_suffix = passage(filler, PREFIX_SEED - 1) + list(suffixes[0])
    phases: list[list[Request]] = []
    index = 0
    for prewarm in (False, True):
        for length in prefix_lens:
            group = group_name(length, prewarm)
            prefix = document(length, PREFIX_SEED + index)
            index += 1
            warm = prefix if prewarm else prefix + warm_suffix
            phases.append([Request(group, "warm", length, tuple(warm))])
            phases.append(
                [
                    Request(group, "hit", length, tuple(prefix + list(s)))
                    for s in suffixes[1 : 1 + hits]
                ]
            )
    return phases


def flat(phases: list[list[Request]]) -> list[Request]:
    return [r for phase in phases for r in phase]


def ideal_cached(request: Request, block_size: int) -> int:
    """Tokens a block-granular prefix cache can serve for a hit request: the
    shared prefix in whole blocks (never the last prompt token)."""
    shared = min(request.prefix_len, len(request.tokens) - 1)
    return shared // block_size * block_size


def aligned_state_positions(
    length: int, block: int, budget: int, eagle: bool = False
) -> list[int]:
    """Where an ``align``-mode engine keeps a GDN state of a prompt of
    ``length`` tokens prefilled alone: at the end of each prefill step that
    ends on a block boundary. As read in 0.20.2's
    ``Scheduler._mamba_block_aligned_split``: a step stops at a multiple of
    the block size, the step that would pass the last block boundary
    (one block earlier under EAGLE/MTP) stops on it, the rest of the prompt
    follows; ``budget`` is max_num_batched_tokens. A reading of the code, not
    a measurement: the GPU run checks it."""
    last = length - length % block
    if eagle:
        last = max(last - block, 0)
    done, positions = 0, []
    while done < length:
        new = min(length - done, budget)
        if done + new < last:
            new = new // block * block
        elif done < last < done + new:
            new = last - done
        if new <= 0:
            break
        done += new
        if done % block == 0 and done <= last:
            positions.append(done)
    return positions


def predicted_cached(
    warm: tuple[int, ...],
    hit: tuple[int, ...],
    block: int,
    budget: int,
    *,
    mamba: bool,
    eagle: bool = False,
) -> int:
    """Tokens a hit request should find cached after ``warm`` was served
    alone: attention matches whole blocks of the common prefix (never the
    last prompt token); on a hybrid in ``align`` mode only a block boundary
    where ``warm``'s GDN state was kept (``aligned_state_positions``) can end
    the hit. Under EAGLE/MTP a dense model's attention drops its last
    matching block (read in 0.20.2, not measured: no dense model has MTP
    here); on the hybrids the H200 run found hits up to the kept state with
    no block dropped (e.g. 2,016 tokens at B = 288), so there the state's
    move back by a block (``aligned_state_positions``) is the whole MTP
    effect."""
    common = next(
        (i for i, (a, b) in enumerate(zip(warm, hit)) if a != b),
        min(len(warm), len(hit)),
    )
    attention = min(common, len(hit) - 1) // block * block
    if not mamba:
        return max(attention - block, 0) if eagle else attention
    states = aligned_state_positions(len(warm), block, budget, eagle)
    return max((p for p in states if p <= attention), default=0)


def predicted_hits(
    phases: list[list[Request]],
    block: int,
    budget: int = MAX_NUM_BATCHED_TOKENS,
    *,
    mamba: bool,
    eagle: bool = False,
) -> dict[str, list[int]]:
    """Per request group, what each hit request should find cached: the
    most that any request of its group served before it left behind
    (``predicted_cached``), its warm-up and the hit requests ahead of it in
    the batch. The H200 run showed the second hit request of a 2K group
    reusing the state the first one kept inside the prefix (2,000 of 2,048
    tokens at B = 80), which the warm-up request alone does not give."""
    out: dict[str, list[int]] = {}
    served: list[Request] = []
    for phase in phases:
        for r in phase:
            if r.role == "warm":
                served = [r]
                continue
            if not served or served[0].group != r.group:
                continue
            out.setdefault(r.group, []).append(
                max(
                    predicted_cached(
                        s.tokens, r.tokens, block, budget, mamba=mamba, eagle=eagle
                    )
                    for s in served
                )
            )
            served.append(r)
    return out


# --------------------------------------------------------------------------
# Engines.
# --------------------------------------------------------------------------


def checkpoint_spec(name: str):
    """checkpoints.MODELS[name] with room for an 8K prefix (RoPE has no
    weights: the same weights, chain and gains)."""
    from . import checkpoints as ck

    base = ck.MODELS[name]
    kwargs = {**base.builder_kwargs, "max_position_embeddings": MAX_POSITION}
    return dataclasses.replace(base, builder_kwargs=kwargs)


def build_checkpoints(root: Path, names: list[str]) -> dict[str, str]:
    from . import checkpoints as ck

    return {
        n: str(ck.build_checkpoint(n, root / n, spec=checkpoint_spec(n))) for n in names
    }


def model_max_len(path: str) -> int:
    """The ``max_model_len`` a trained checkpoint's engines take: the
    matrix's, or the model's positions where fewer (its config.json, or its
    text config's)."""
    config = json.loads((Path(path) / "config.json").read_text())
    positions = config.get("max_position_embeddings") or (
        config.get("text_config") or {}
    ).get("max_position_embeddings")
    return min(MAX_MODEL_LEN, positions or MAX_MODEL_LEN)


def longest_request(prefix_lens: list[int], warm_suffix: int, new_tokens: int) -> int:
    """Positions the longest request of a run takes, drafts included."""
    return max(prefix_lens) + max(warm_suffix, 64) + new_tokens + 8


def engine_kwargs(
    cell: Cell,
    ckpts: dict[str, str],
    cg: str = "NONE",
    kv_bytes: int = KV_CACHE_MEMORY_BYTES,
) -> dict:
    from . import checkpoints as ck

    tiny = ck.MODELS.get(cell.model)  # None: a trained checkpoint (--trained)
    kwargs: dict[str, Any] = dict(
        model=ckpts[cell.model],
        skip_tokenizer_init=True,
        max_model_len=MAX_MODEL_LEN if tiny else model_max_len(ckpts[cell.model]),
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        kv_cache_memory_bytes=kv_bytes,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        kv_cache_dtype=cell.kv,
        dtype=ck.MATRIX_DTYPE if tiny else TRAINED_DTYPE,
        seed=0,
        # The child reads the prefix-cache counters (LLM.get_metrics).
        disable_log_stats=False,
        enable_prefix_caching=cell.prefix_caching,
        **(tiny.engine_kwargs if tiny else {"logprobs_mode": "raw_logits"}),
    )
    if cell.mode in MODES:
        kwargs["mamba_cache_mode"] = cell.mode
    spec = SPECS[cell.spec]
    if spec is not None:
        kwargs["speculative_config"] = dict(spec)
    if cg == "NONE":
        kwargs["enforce_eager"] = True
    else:
        kwargs["compilation_config"] = {
            "cudagraph_mode": cg,
            "max_cudagraph_capture_size": MAX_NUM_SEQS * 4,
        }
    return kwargs


def counter_total(metrics: list, name: str) -> float:
    """Counter ``name`` of ``LLM.get_metrics()``, summed over its label sets
    (with or without the ``_total`` suffix)."""
    return sum(
        (
            m.value
            for m in metrics
            if m.name.removesuffix("_total") == name and hasattr(m, "value")
        ),
        0.0,
    )


def preemptions(metrics: list) -> int:
    """Requests the scheduler preempted (``vllm:num_preemptions``)."""
    return int(counter_total(metrics, "vllm:num_preemptions"))


def prefix_counters(metrics: list) -> dict[str, float]:
    """``queries`` and ``hits`` (tokens) of the engine's prefix cache, summed
    over label sets (``vllm:prefix_cache_queries`` / ``_hits``)."""
    return {
        "queries": counter_total(metrics, "vllm:prefix_cache_queries"),
        "hits": counter_total(metrics, "vllm:prefix_cache_hits"),
    }


def engine_facts(llm: Any) -> dict[str, Any]:
    """What the engine chose: its cache config and KV-cache groups."""
    facts: dict[str, Any] = {}
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    config = getattr(core, "vllm_config", None) or llm.llm_engine.vllm_config
    cc = config.cache_config
    for attr in (
        "block_size",
        "mamba_block_size",
        "mamba_cache_mode",
        "mamba_page_size_padded",
        "enable_prefix_caching",
        "num_gpu_blocks",
    ):
        facts[attr] = getattr(cc, attr, None)
    facts["max_num_batched_tokens"] = config.scheduler_config.max_num_batched_tokens
    kv_config = getattr(getattr(core, "scheduler", None), "kv_cache_config", None)
    if kv_config is None:
        facts["groups_error"] = "no scheduler.kv_cache_config on the engine core"
        return facts
    facts["num_blocks"] = kv_config.num_blocks
    groups = []
    for g in kv_config.kv_cache_groups:
        spec = g.kv_cache_spec
        row = {
            "type": type(spec).__name__,
            "layers": len(g.layer_names),
            "first_layer": g.layer_names[0] if g.layer_names else None,
            "block_size": spec.block_size,
            "page_size_bytes": spec.page_size_bytes,
        }
        if getattr(spec, "page_size_padded", None) is not None:
            unpadded = dataclasses.replace(spec, page_size_padded=None)
            row["unpadded_page_bytes"] = unpadded.page_size_bytes
        groups.append(row)
    facts["groups"] = groups
    return facts


def run_child(args: dict[str, Any]) -> dict[str, Any]:
    """One engine: boot, read its choices, serve the phases in order."""
    from vllm import LLM, SamplingParams

    llm = LLM(**args["engine"])
    try:
        facts = engine_facts(llm)
    except Exception as e:  # an attribute moved: keep measuring the rest
        facts = {"facts_error": f"{type(e).__name__}: {e}"[:200]}
    params = SamplingParams(
        max_tokens=args["new_tokens"],
        temperature=0.0,
        ignore_eos=True,
        logprobs=logit_flips.TOP_LOGITS if args.get("logprobs") else None,
    )
    phases = args.get("phases") or [
        [list(r.tokens) for r in phase]
        for phase in build_phases(
            tuple(args["prefix_lens"]),
            args["hits"],
            warm_suffix_len=args["warm_suffix"],
        )
    ]
    outputs, cached, gaps, top_logits, counts = [], [], [], [], []
    start = time.perf_counter()
    for phase in phases:
        before = prefix_counters(llm.get_metrics())
        outs = llm.generate(
            [{"prompt_token_ids": tokens} for tokens in phase],
            params,
            use_tqdm=False,
        )
        after = prefix_counters(llm.get_metrics())
        counts.append({k: after[k] - before[k] for k in after})
        for o in outs:
            outputs.append(list(o.outputs[0].token_ids))
            cached.append(o.num_cached_tokens)
            if args.get("logprobs"):
                row, pairs = [], []
                for lp in o.outputs[0].logprobs or []:
                    top = sorted(lp.items(), key=lambda kv: -kv[1].logprob)
                    row.append(
                        top[0][1].logprob - top[1][1].logprob if len(top) > 1 else None
                    )
                    pairs.append([[t, v.logprob] for t, v in top])
                gaps.append(row)
                top_logits.append(pairs)
    result: dict[str, Any] = {
        "engine": facts,
        "outputs": outputs,
        "cached": cached,
        "phase_counts": counts,
        "seconds": round(time.perf_counter() - start, 2),
        "metrics": sdm.spec_metrics(llm.get_metrics()),
        "preemptions": preemptions(llm.get_metrics()),
    }
    if args.get("logprobs"):
        result["gaps"] = gaps
        result["top_logits"] = top_logits
    return result


def child_args(cell: Cell, ckpts: dict[str, str], args: argparse.Namespace) -> dict:
    kv_bytes = getattr(args, "kv_budgets", {}).get(cell.name, KV_CACHE_MEMORY_BYTES)
    return {
        "engine": engine_kwargs(cell, ckpts, args.cg, kv_bytes),
        "prefix_lens": list(args.prefix_lens),
        "hits": args.hits,
        "warm_suffix": args.warm_suffix,
        "new_tokens": args.new_tokens,
        # Cold engines are the references: their top-1/top-2 gaps mark ties.
        # A trained checkpoint's engines all keep their top logits
        # (logit_flips: how far a hit moved them).
        "logprobs": not cell.prefix_caching or cell.model not in MODELS,
        "phases": getattr(args, "text_phases", {}).get(cell.model),
    }


# --------------------------------------------------------------------------
# Rows: hits, hit vs cold, the table.
# --------------------------------------------------------------------------


def _indices(requests: list[Request], **match: Any) -> list[int]:
    return [
        i
        for i, r in enumerate(requests)
        if all(getattr(r, k) == v for k, v in match.items())
    ]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for u, v in zip(a, b) for x, y in zip(u, v)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def compare_role(
    cold: dict[str, Any], run: dict[str, Any], requests: list[Request], role: str
) -> dict[str, Any]:
    """``run``'s outputs of the ``role`` requests against ``cold``'s, with
    spec_decode_matrix's ``compare`` (exact count, first differences, tie
    flags) and the share of equal tokens."""
    idx = _indices(requests, role=role)
    ref = {"outputs": [cold["outputs"][i] for i in idx]}
    if cold.get("gaps"):
        ref["gaps"] = [cold["gaps"][i] for i in idx]
    got = {"outputs": [run["outputs"][i] for i in idx]}
    row = sdm.compare(ref, got)
    row["agree"] = round(agreement(ref["outputs"], got["outputs"]), 4)
    row["labels"] = [requests[i].label for i in idx]
    for key in ("histogram", "mean_accept_len"):
        row.pop(key, None)
    return row


def hit_block(engine: dict[str, Any]) -> int | None:
    """The granularity of a prefix-cache hit: the LCM of the KV-cache groups'
    block sizes (0.20.2's HybridKVCacheCoordinator), else the block size."""
    sizes = [g["block_size"] for g in engine.get("groups") or []]
    return math.lcm(*sizes) if sizes else engine.get("block_size")


def cell_predictions(
    cell: Cell, block: int | None, phases: list[list[Request]], hybrid: bool
) -> dict[str, list[int]]:
    if not block:
        return {}
    return predicted_hits(phases, block, mamba=hybrid, eagle=cell.spec == "mtp")


def hit_stats(
    cell: Cell, rec: dict[str, Any], phases: list[list[Request]]
) -> dict[str, dict[str, Any]]:
    """Per request group: the hit requests' token hit rate (their cached
    tokens over their prompt tokens, from each request's num_cached_tokens),
    the same rate from the engine's counters where they counted (``counter_rate``:
    on the H200 run the counters stayed at 0 in every engine with asynchronous
    scheduling, while num_cached_tokens showed the hits), their cached tokens,
    what a reading of 0.20.2 predicts for them (``predicted``) and the
    block-granular ideal, at the engine's hit granularity."""
    block = hit_block(rec.get("engine") or {})
    predicted = cell_predictions(cell, block, phases, cell.model in HYBRIDS)
    out: dict[str, dict[str, Any]] = {}
    start = 0
    for phase, counts in zip(phases, rec.get("phase_counts", [])):
        end = start + len(phase)
        if phase[0].role == "hit":
            group = phase[0].group
            cached = rec["cached"][start:end]
            prompt = sum(len(r.tokens) for r in phase)
            entry = {
                "queries": counts["queries"],
                "hits": counts["hits"],
                "rate": sum(cached) / prompt if prompt else None,
                "counter_rate": counts["hits"] / counts["queries"]
                if counts["queries"]
                else None,
                "cached": cached,
                "prompt_tokens": prompt,
            }
            if block:
                ideal = sum(ideal_cached(r, block) for r in phase)
                entry["ideal_rate"] = ideal / prompt
                entry["predicted"] = predicted.get(group)
            out[group] = entry
        start = end
    return out


def ctx_positions(cold: dict[str, Any], requests: list[Request]) -> int:
    idx = _indices(requests, role="hit")
    return sdm.context_positions(
        [list(requests[i].tokens) for i in idx], [cold["outputs"][i] for i in idx]
    )


def verdict(cell: Cell, row: dict[str, Any]) -> str:
    if row.get("boot") != "ok":
        return {"NOT RUN": "NOT RUN", "timeout": "TIMEOUT"}.get(
            row["boot"], "BOOT FAIL"
        )
    if row.get("cold_error"):
        return "NO COLD REF"
    hit, warm = row["hit_vs_cold"], row["warm_vs_cold"]
    if hit.get("status") == "exact" and warm.get("status") == "exact":
        verdict_ = "exact"
    elif cell.kv == "auto" and all(
        (row.get(f"{role}_flips") or {}).get("rounding") for role in ("hit", "warm")
    ):
        verdict_ = "rounding flips"
    elif cell.kv == "auto" or row.get("tq_spread") is None:
        bad = hit if hit.get("status") != "exact" else warm
        which = "hit" if bad is hit else "warm"
        verdict_ = f"{which} {bad.get('status')}"
    else:
        worst = min(hit["agree"], warm["agree"])
        verdict_ = (
            "within TQ spread" if worst >= row["tq_spread"] else "OUTSIDE TQ spread"
        )
    if not any(
        sum(h.get("cached") or []) > 0 for h in row.get("hit_rates", {}).values()
    ):
        verdict_ += " (no hits)"
    if row.get("kv_budget") is not None and not row.get("preemptions"):
        verdict_ += " (no preemption)"
    return verdict_


def cell_row(
    cell: Cell,
    records: dict[str, dict[str, Any]],
    phases: list[list[Request]],
    plans: dict[str, dict[str, Any]] | None = None,
    budgets: dict[str, int] | None = None,
) -> dict[str, Any]:
    """``budgets``: the KV bytes of cells run with less than the matrix's
    (``--preempt``); the plan at the matrix's budget is not theirs."""
    requests = flat(phases)
    rec = records.get(cell.name, {"crash": "NOT RUN (not scheduled)"})
    row: dict[str, Any] = {**dataclasses.asdict(cell), "name": cell.name}
    row["wall"] = rec.get("wall")
    row["kv_tokens_log"] = rec.get("kv_tokens_log")
    row["preemptions"] = rec.get("preemptions")
    row["kv_budget"] = (budgets or {}).get(cell.name)
    row["preempt_predicted"] = rec.get("preempt_predicted")
    plan = (plans or {}).get(cell.name)
    if plan is not None and row["kv_budget"] is None:
        row["plan"] = {
            k: plan.get(k)
            for k in ("error", "block_size", "kv_tokens", "mode_effective")
        }
    if "crash" in rec:
        not_run = rec["crash"].startswith("NOT RUN")
        # An engine stopped by its time limit is not a boot failure: it may
        # have booted and been serving (the KV-tokens line says so).
        timeout = rec["crash"].startswith("TIMEOUT")
        row["boot"] = "NOT RUN" if not_run else "timeout" if timeout else "failed"
        row["root_cause"] = rec.get("root_cause", rec["crash"])
        row["verdict"] = verdict(cell, row)
        return row
    row["boot"] = "ok"
    row["engine"] = rec.get("engine", {})
    row["hit_rates"] = hit_stats(cell, rec, phases)
    row["seconds"] = rec.get("seconds")
    cold = records.get(cell.cold().name, {"crash": "not run"})
    if "crash" in cold:
        row["cold_error"] = cold.get("root_cause", cold["crash"])
    else:
        row["hit_vs_cold"] = compare_role(cold, rec, requests, "hit")
        row["warm_vs_cold"] = compare_role(cold, rec, requests, "warm")
        if cell.model in MODELS:  # a bigram chain: see ctx_positions
            row["ctx"] = ctx_positions(cold, requests)
        if "top_logits" in cold and "top_logits" in rec:  # trained checkpoints
            for role in ("hit", "warm"):
                row[f"{role}_flips"] = logit_flips.flips(
                    cold, rec, _indices(requests, role=role)
                )
        auto = records.get(cell.auto_cold().name, {})
        if cell.kv != "auto" and "outputs" in auto:
            hits = _indices(requests, role="hit")
            row["tq_spread"] = round(
                agreement(
                    [auto["outputs"][i] for i in hits],
                    [cold["outputs"][i] for i in hits],
                ),
                4,
            )
            if "top_logits" in auto and "top_logits" in cold:
                # How far TurboQuant itself moves the logits, beside the hit's.
                row["tq_flips"] = logit_flips.flips(auto, cold, hits)
    row["verdict"] = verdict(cell, row)
    return row


def _kv(kv: str) -> str:
    return kv.removeprefix("turboquant_")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _mean(values: list[int] | None) -> int | None:
    return sum(values) // len(values) if values else None


def _hit_cell(entry: dict[str, Any] | None) -> str:
    """Hit rate (counters), mean cached tokens per hit request, predicted."""
    if not entry:
        return "-"
    mean, pred = _mean(entry.get("cached")), _mean(entry.get("predicted"))
    return f"{_pct(entry.get('rate'))} ({mean}, pred {pred})"


def _blocks(engine: dict[str, Any]) -> str:
    groups = engine.get("groups") or []
    attn = sorted({g["block_size"] for g in groups if "Mamba" not in g["type"]})
    return "/".join(map(str, attn)) or str(engine.get("block_size", "-"))


def _pages(engine: dict[str, Any]) -> str:
    groups = engine.get("groups") or []
    pages = sorted({g["page_size_bytes"] for g in groups})
    mamba = [g for g in groups if "Mamba" in g["type"]]
    state = (
        mamba[0].get("unpadded_page_bytes", mamba[0]["page_size_bytes"])
        if mamba
        else None
    )
    text = "/".join(str(p) for p in pages) or "-"
    return f"{text} (GDN {state})" if state else text


HIT_GROUPS = ("2K", "8K", "2K-pre", "8K-pre")


def hit_groups(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """The request groups of a run's rows (its prefix lengths), in order."""
    found = [g for r in rows for g in r.get("hit_rates") or {}]
    return tuple(dict.fromkeys(found)) or HIT_GROUPS


def table_columns(groups: tuple[str, ...] = HIT_GROUPS) -> tuple[str, ...]:
    return (
        "model",
        "kv",
        "spec",
        "mode",
        "boot",
        "mode eff",
        "attn block",
        "page B",
        "KV tokens",
        "plan",
        "preempted",
        *(f"hit {g}" for g in groups),
        "hit vs cold",
        "warm vs cold",
        "ctx",
        "hit drift ulps",
        "TQ spread",
        "TQ drift ulps",
        "verdict",
        "s",
    )


def table_lines(rows: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    groups = hit_groups(rows)
    lines = []
    for r in rows:
        engine = r.get("engine", {})
        hits = r.get("hit_rates", {})
        hit, warm = r.get("hit_vs_cold", {}), r.get("warm_vs_cold", {})
        plan = r.get("plan") or {}
        kv_tokens = r.get("kv_tokens_log")
        if plan.get("error"):
            plan_text = "plan error"
        elif plan.get("block_size") is None:
            plan_text = "-"
        else:
            same = (
                plan["block_size"] == engine.get("block_size")
                and plan.get("kv_tokens") == kv_tokens
            )
            plan_text = (
                "equal"
                if same
                else f"block {plan['block_size']}, {plan.get('kv_tokens')} tok"
            )
        boot = r["boot"] if r["boot"] != "failed" else f"FAIL: {r['root_cause']}"
        lines.append(
            (
                r["model"],
                _kv(r["kv"]),
                r["spec"],
                r["mode"],
                boot[:90],
                str(engine.get("mamba_cache_mode", "-")),
                _blocks(engine) if engine else "-",
                _pages(engine) if engine else "-",
                f"{kv_tokens:,}" if kv_tokens else "-",
                plan_text if engine else "-",
                _preempted(r),
                *(_hit_cell(hits.get(g)) for g in groups),
                _cmp(hit),
                _cmp(warm),
                str(r.get("ctx", "-")),
                logit_flips.describe(r.get("hit_flips")),
                _pct(r.get("tq_spread")) if r.get("tq_spread") is not None else "-",
                logit_flips.describe(r.get("tq_flips")),
                r["verdict"],
                str(r.get("wall") or "-"),
            )
        )
    return lines


def _preempted(r: dict[str, Any]) -> str:
    """The engine's preemptions, and preemption_sim's per seed beside them."""
    got = str(r["preemptions"]) if r.get("preemptions") is not None else "-"
    sim = r.get("preempt_predicted")
    return f"{got} (sim {'/'.join(map(str, sim))})" if sim else got


def _cmp(c: dict[str, Any]) -> str:
    if not c:
        return "-"
    if c.get("status") == "exact":
        return f"exact {c['prompts_exact']}"
    return f"{c.get('status')} ({c.get('prompts_exact')}, {_pct(c.get('agree'))})"


def format_table(rows: list[dict[str, Any]]) -> str:
    out = sdm.aligned(table_columns(hit_groups(rows)), table_lines(rows))
    exact = sum(r["verdict"].startswith("exact") for r in rows)
    out.append(f"{exact}/{len(rows)} cells exact (hit and warm requests vs cold)")
    return "\n".join(out)


def format_markdown(rows: list[dict[str, Any]], header: str = "") -> str:
    columns = table_columns(hit_groups(rows))
    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = [
        "| " + " | ".join(x.replace("|", "/") for x in line) + " |"
        for line in table_lines(rows)
    ]
    return "\n".join(([header, ""] if header else []) + [head, rule, *body]) + "\n"


# --------------------------------------------------------------------------
# Driver.
# --------------------------------------------------------------------------


def _tar_logs(outdir: Path) -> None:
    (outdir / "logs").mkdir(parents=True, exist_ok=True)
    with tarfile.open(outdir / "logs.tar.gz", "w:gz") as tar:
        tar.add(outdir / "logs", arcname="logs")


def run_cpu_tool(
    module: str,
    argv: list[str],
    out: Path,
    outdir: Path,
    workdir: Path,
    deadline: float | None,
) -> Any:
    """``python -m tests.models.tiny_hybrids.MODULE ARGV`` on the CPU, in its
    own process (logs/MODULE.log), and the JSON it wrote to ``out``; None
    when it wrote none or ran past the deadline."""
    cmd = [sys.executable, "-m", f"tests.models.tiny_hybrids.{module}", *argv]
    timeout = max(10.0, deadline - time.time()) if deadline else 600.0
    env = sdm.child_env(workdir, None, 0)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    with open(outdir / "logs" / f"{module}.log", "w") as log:
        try:
            subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return None
    return json.loads(out.read_text()) if out.exists() else None


def run_plans(
    outdir: Path, workdir: Path, only: str | None, deadline: float | None
) -> dict[str, dict[str, Any]]:
    """prefix_cache_plan's CPU plan of every tiny cell (and cold engine), in
    its own process; {} when it fails or runs past the deadline."""
    out = outdir / "plan.json"
    argv = ["--json", str(out), "--tiny-only", "--with-cold", "--no-probe"]
    if only:
        argv += ["--only", only]
    data = run_cpu_tool("prefix_cache_plan", argv, out, outdir, workdir, deadline)
    return {r["name"]: r for r in data["rows"]} if data else {}


def run_settings(
    hits: int, new_tokens: int, warm_suffix: int, prefix_lens: list[int]
) -> dict[str, Any]:
    """The requests a run serves and the engine configuration it plans: what
    a run's JSON records and what preemption_sim's budgets hold for."""
    return {
        "hits": hits,
        "new_tokens": new_tokens,
        "warm_suffix": warm_suffix,
        "prefix_lens": list(prefix_lens),
        "max_model_len": MAX_MODEL_LEN,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "kv_cache_memory_bytes": KV_CACHE_MEMORY_BYTES,
    }


def read_preemption_sim(
    path: Path, args: argparse.Namespace, chosen: list[Cell]
) -> dict[str, Any]:
    """preemption_sim's cells from ``path``, refused (exit 2) when it
    simulated other settings than this run's or misses one of ``chosen``."""
    want = run_settings(args.hits, args.new_tokens, args.warm_suffix, args.prefix_lens)
    try:
        data = json.loads(path.read_text())
        got, cells_ = data["settings"], data["cells"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"--preempt-sim {path}: not preemption_sim's output ({e})")
        raise SystemExit(2) from None
    differ = [k for k in want if got.get(k) != want[k]]
    if differ:
        print(
            f"--preempt-sim {path}: simulated with other settings ("
            + ", ".join(f"{k} {got.get(k)} here {want[k]}" for k in differ)
            + "); run preemption_sim with this run's settings, or drop "
            "--preempt-sim to simulate first"
        )
        raise SystemExit(2)
    missing = [c.name for c in chosen if c.prefix_caching and c.name not in cells_]
    if missing:
        print(
            f"--preempt-sim {path}: no budget for {', '.join(missing)}; "
            "simulate those cells too (preemption_sim --only)"
        )
        raise SystemExit(2)
    return cells_


def run_preemption_sim(
    outdir: Path, args: argparse.Namespace, deadline: float | None
) -> dict[str, dict[str, Any]]:
    """preemption_sim's budget for every prefix-caching cell chosen (the
    matrix's phases at ``args``' settings), in its own process; {} when it
    fails or runs past the deadline (the cells keep the matrix's budget)."""
    out = outdir / "preemption_sim.json"
    argv = [str(out), "--hits", str(args.hits), "--new-tokens", str(args.new_tokens)]
    argv += ["--warm-suffix", str(args.warm_suffix), "--jobs", str(args.jobs)]
    argv += ["--prefix-lens", ",".join(map(str, args.prefix_lens))]
    if args.only:
        argv += ["--only", args.only]
    data = run_cpu_tool("preemption_sim", argv, out, outdir, args.workdir, deadline)
    return data["cells"] if data else {}


def run_engines(
    engines: list[Cell],
    ckpts: dict[str, str],
    args: argparse.Namespace,
    outdir: Path,
    t0: float,
) -> dict[str, dict[str, Any]]:
    from .scheduling import NOT_RUN, run_grouped

    deadline = t0 + args.deadline if args.deadline else None
    done = [0]
    lock = threading.Lock()

    def one(cell: Cell) -> tuple[str, dict[str, Any]]:
        timeout = args.timeout
        if deadline is not None:
            left = deadline - time.time()
            if left < 20:
                return cell.name, {
                    "rc": "skipped",
                    "wall": 0,
                    "crash": NOT_RUN,
                }
            timeout = min(timeout, left)
        num_spec = (SPECS[cell.spec] or {}).get("num_speculative_tokens", 0)
        env = sdm.child_env(args.workdir, args.cache, num_spec)
        rec = sdm.spawn(cell.name, child_args(cell, ckpts, args), outdir, timeout, env)
        log = outdir / "logs" / f"{cell.name}.log"
        if log.exists():
            found = _KV_TOKENS.findall(log.read_text(errors="replace"))
            rec["kv_tokens_log"] = int(found[-1].replace(",", "")) if found else None
        status = rec.get("crash", "ok")[:100]
        with lock:
            done[0] += 1
            print(
                f"  [{done[0]}/{len(engines)}] {cell.name}: {status} "
                f"({rec.get('wall')}s) at {time.time() - t0:.0f}s",
                flush=True,
            )
        return cell.name, rec

    # Every engine runs through this module's child (run_child).
    saved, sdm.MODULE = sdm.MODULE, MODULE
    try:
        group = compile_group if args.warm_order else (lambda cell: cell.name)
        return dict(run_grouped(engines, group, one, args.jobs))
    finally:
        sdm.MODULE = saved


def cold_row(cell: Cell, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What a cold engine (prefix caching off) chose, or why it did not boot."""
    rec = records.get(cell.name, {"crash": "NOT RUN"})
    boot = "ok" if "crash" not in rec else rec.get("root_cause", rec["crash"])
    return {
        "name": cell.name,
        "boot": boot,
        "engine": rec.get("engine"),
        "kv_tokens_log": rec.get("kv_tokens_log"),
        "wall": rec.get("wall"),
    }


def run_matrix(args: argparse.Namespace) -> int:
    outdir = Path(args.outdir)
    (outdir / "logs").mkdir(parents=True, exist_ok=True)
    args.workdir = Path(args.workdir or outdir / "work")
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    chosen = select(cells(tuple(args.trained)), args.only)
    engines = engine_plan(chosen)
    plans: dict[str, dict[str, Any]] = {}
    planner = None
    args.kv_budgets, predicted = {}, {}
    if args.preempt:
        # The budgets come from the simulation: it runs first.
        deadline = t0 + args.deadline if args.deadline else None
        if args.preempt_sim:
            sim = read_preemption_sim(args.preempt_sim, args, chosen)
        else:
            sim = run_preemption_sim(outdir, args, deadline)
            if not sim:
                print(
                    "preemption_sim wrote no budgets (logs/preemption_sim.log): "
                    "the cells keep the matrix's budget",
                    flush=True,
                )
        for name, chosen_budget in sim.items():
            args.kv_budgets[name] = chosen_budget["kv_bytes"]
            predicted[name] = chosen_budget["preemptions"]
        print(f"preemption budgets (KV bytes): {args.kv_budgets}", flush=True)
    if args.plan:
        deadline = t0 + args.deadline if args.deadline else None
        planner = threading.Thread(
            target=lambda: plans.update(
                run_plans(outdir, args.workdir, args.only, deadline)
            )
        )
        planner.start()
    tiny = sorted({c.model for c in engines} - set(args.trained))
    ckpts = {**build_checkpoints(args.workdir / "ckpt", tiny), **args.trained}
    print(
        f"{len(chosen)} cells, {len(engines)} engines, {args.jobs} at a time, "
        f"deadline {args.deadline}s; checkpoints built at {time.time() - t0:.0f}s",
        flush=True,
    )
    text_phases = trained_phases(args, {c.model for c in engines})
    args.text_phases = {
        name: [[list(r.tokens) for r in phase] for phase in phases]
        for name, phases in text_phases.items()
    }
    records = run_engines(engines, ckpts, args, outdir, t0)
    for name, counts in predicted.items():
        records.get(name, {})["preempt_predicted"] = counts
    if planner is not None:
        planner.join(timeout=30)
    phases = build_phases(
        tuple(args.prefix_lens), args.hits, warm_suffix_len=args.warm_suffix
    )
    rows = [
        cell_row(c, records, text_phases.get(c.model, phases), plans, args.kv_budgets)
        for c in chosen
    ]
    cold_rows = [cold_row(c, records) for c in engines if c.mode == COLD]
    result = {
        "rows": rows,
        "cold": cold_rows,
        "records": records,
        "plans": plans,
        "settings": {
            **run_settings(
                args.hits, args.new_tokens, args.warm_suffix, args.prefix_lens
            ),
            "cg": args.cg,
            "kv_budgets": args.kv_budgets,
            "text_phases": {n: phases_json(p) for n, p in text_phases.items()},
            "labels": [r.label for r in flat(phases)],
            "prompt_lengths": [len(r.tokens) for r in flat(phases)],
        },
        "seconds": round(time.time() - t0, 1),
    }
    (outdir / "matrix.json").write_text(json.dumps(result))
    header = (
        f"prefix_cache_matrix: {len(chosen)} cells, {len(engines)} engines, "
        f"{result['seconds']}s, cudagraph mode {args.cg}"
    )
    (outdir / "matrix.md").write_text(format_markdown(rows, header))
    _tar_logs(outdir)
    print(format_table(rows))
    for r in cold_rows:
        if r["boot"] != "ok":
            print(f"  cold engine {r['name']}: {r['boot']}")
    print(f"{time.time() - t0:.0f}s; {outdir / 'matrix.json'}, {outdir / 'matrix.md'}")
    passed = ("exact", "within", "rounding")
    return 0 if all(r["verdict"].startswith(passed) for r in rows) else 1


def trained_phases(
    args: argparse.Namespace, models: set[str]
) -> dict[str, list[list[Request]]]:
    """The phases of each trained checkpoint among ``models``: the tiny
    checkpoints' layout, in corpus text of its own tokens (prefix_prompts)."""
    from tests.models.real_weights.prefix_prompts import CorpusPrompts

    return {
        name: build_phases(
            tuple(args.prefix_lens),
            args.hits,
            warm_suffix_len=args.warm_suffix,
            text=CorpusPrompts.from_checkpoint(path),
        )
        for name, path in args.trained.items()
        if name in models
    }


def phases_json(phases: list[list[Request]]) -> list[list[dict[str, Any]]]:
    return [[dataclasses.asdict(r) for r in phase] for phase in phases]


def phases_from_json(data: list[list[dict[str, Any]]]) -> list[list[Request]]:
    return [
        [Request(**{**r, "tokens": tuple(r["tokens"])}) for r in phase]
        for phase in data
    ]


def table_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A run's rows, re-derived from its engines' records with this module's
    reading of them (a run's JSON keeps what the engines reported)."""
    settings = data.get("settings")
    if not (settings and data.get("records")):
        return data["rows"]
    phases = build_phases(
        tuple(settings["prefix_lens"]),
        settings["hits"],
        warm_suffix_len=settings["warm_suffix"],
    )
    text = {
        name: phases_from_json(recorded)
        for name, recorded in (settings.get("text_phases") or {}).items()
    }
    names = [r["name"] for r in data["rows"]]
    by_name = {c.name: c for c in cells(tuple(text))}
    budgets = settings.get("kv_budgets")
    return [
        cell_row(
            by_name[n],
            data["records"],
            text.get(by_name[n].model, phases),
            data.get("plans"),
            budgets,
        )
        for n in names
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=f"python -m {MODULE}",
        description="prefix caching on tiny hybrids: boot, block sizes, hit "
        "rates, hit vs cold outputs, KV tokens (issue 47)",
    )
    p.add_argument("outdir", nargs="?")
    p.add_argument("--jobs", type=int, default=12, help="engines at a time")
    p.add_argument(
        "--deadline",
        type=float,
        default=DEADLINE,
        help="seconds for the whole run (0: none); engines that cannot start "
        "before it are recorded NOT RUN",
    )
    p.add_argument(
        "--only",
        help="cells whose name (model.kv.spec.mode) contains this, or one of "
        "these comma-separated substrings",
    )
    p.add_argument("--workdir", default=None, help="checkpoints (default OUTDIR/work)")
    p.add_argument("--cache", type=Path, default=None, help="TRITON/VLLM cache root")
    p.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per engine")
    p.add_argument(
        "--no-warm-order",
        dest="warm_order",
        action="store_false",
        help="start every engine at once instead of one per (model, kv) first, "
        "which warms the compile cache for the others; for a deadline shorter "
        "than a cold engine plus a cell",
    )
    p.add_argument("--hits", type=int, default=HITS, help="hit requests per prefix")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument(
        "--warm-suffix",
        type=int,
        default=WARM_SUFFIX_LEN,
        help="tokens of the first request's own message after the prefix",
    )
    p.add_argument(
        "--prefix-lens",
        default=",".join(map(str, PREFIX_LENS)),
        help="shared prefix lengths in tokens, comma-separated",
    )
    p.add_argument(
        "--cg",
        choices=("NONE", "PIECEWISE", "FULL_AND_PIECEWISE"),
        default="NONE",
        help="cudagraph mode (NONE: eager engines)",
    )
    p.add_argument(
        "--preempt",
        action="store_true",
        help="prefix-caching engines get the KV budget at which vLLM's "
        "scheduler preempts them, serving the same requests on CPU "
        "(preemption_sim.py, run first); cold engines keep the matrix's budget",
    )
    p.add_argument(
        "--preempt-sim",
        type=Path,
        metavar="JSON",
        help="with --preempt: the budgets of an earlier preemption_sim run of "
        "the same settings, instead of simulating first",
    )
    p.add_argument(
        "--no-plan",
        dest="plan",
        action="store_false",
        help="skip the CPU plan run alongside the engines",
    )
    p.add_argument(
        "--trained",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also the cells of a trained checkpoint directory (converted by "
        "tests.models.real_weights.checkpoints), named NAME",
    )
    p.add_argument("--table", metavar="JSON", help="print the table of an earlier run")
    p.add_argument("--markdown", action="store_true", help="with --table: Markdown")
    p.add_argument(
        "--child", nargs=2, metavar=("ARGS", "RESULT"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    if not (args.outdir or args.table or args.child):
        p.error("OUTDIR is required")
    try:
        args.prefix_lens = [int(x) for x in args.prefix_lens.split(",")]
    except ValueError:
        p.error(f"--prefix-lens: expected integers, got {args.prefix_lens!r}")
    longest = longest_request(args.prefix_lens, args.warm_suffix, args.new_tokens)
    if longest > MAX_MODEL_LEN or min(args.prefix_lens) < 1:
        p.error(
            f"--prefix-lens: each must be >= 1 and leave room for a suffix and "
            f"{args.new_tokens} new tokens within max_model_len {MAX_MODEL_LEN}"
        )
    if args.hits < 1:
        p.error("--hits: at least 1")
    if args.preempt_sim and not args.preempt:
        p.error("--preempt-sim: only with --preempt (it holds preemption budgets)")
    args.trained = trained_checkpoints(p, args.trained, longest)
    if args.trained and args.preempt:
        p.error(
            "--trained with --preempt: preemption budgets are simulated for the "
            "tiny checkpoints only; run the trained cells without --preempt"
        )
    if args.deadline == 0:
        args.deadline = None
    return args


def trained_checkpoints(
    p: argparse.ArgumentParser, given: list[str], longest: int
) -> dict[str, str]:
    """``--trained NAME=DIR`` as {NAME: DIR}; an error naming the entry where
    NAME is a tiny model's or given twice, DIR holds no config.json, or the
    run's longest request does not fit the model's positions."""
    from . import checkpoints as ck

    out: dict[str, str] = {}
    for entry in given:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            p.error(f"--trained {entry!r}: expected NAME=DIR")
        if name in ck.MODELS or name in out:
            p.error(
                f"--trained {entry!r}: {name!r} names a tiny checkpoint or an "
                "earlier --trained; give each trained checkpoint a name of its own"
            )
        if not (Path(path) / "config.json").is_file():
            p.error(
                f"--trained {entry!r}: {path} holds no config.json; pass a "
                "directory tests.models.real_weights.checkpoints converted"
            )
        limit = model_max_len(path)
        if longest > limit:
            p.error(
                f"--trained {entry!r}: the longest request takes {longest} "
                f"positions and {name} serves {limit}; pass shorter --prefix-lens "
                "(its longest prefix plus the warm-up message, the new tokens "
                "and 8 must fit)"
            )
        out[name] = path
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        sdm.child_main(args.child, run=run_child)
    if args.table:
        rows = table_rows(json.loads(Path(args.table).read_text()))
        print(
            format_markdown(rows, args.table) if args.markdown else format_table(rows)
        )
        return 0
    return run_matrix(args)


if __name__ == "__main__":
    sys.exit(main())
