# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU: speculative decoding is token-exact against no speculation (issue 8).

For every cell (model, KV-cache dtype, speculation, cudagraph mode) one engine
runs WITHOUT speculation and one WITH it, same model, KV dtype and cudagraph
mode; greedy outputs are compared token for token over 64 tokens of each of a
dozen prompts. The models are saved tiny random checkpoints (checkpoints.py)
whose greedy output follows a bigram chain except where context decides
(0.4-2.6 % of tokens on CPU; the ``ctx`` column counts them per cell), so a
wrong attention/GDN result changes tokens while kernel-order rounding does
not, and drafts (MTP, ngram, draft model) are mostly accepted. ``--gain
CKPT=G`` lowers a checkpoint's chain weight if ``ctx`` is too small for a
fault to show (more context-decided tokens, smaller margins).

    python -m tests.models.tiny_hybrids.spec_decode_matrix OUTDIR [--quick]
        [--inject FAULT] [--jobs N] [--only model=...,kv=...,spec=...,cg=...]
        [--deadline S] [--dtype float16|bfloat16] [--cache DIR]
        [--refs DIR | --resume DIR]
    python -m tests.models.tiny_hybrids.spec_decode_matrix OUTDIR --verify-precision
    python -m tests.models.tiny_hybrids.spec_decode_matrix OUTDIR --speed
    python -m tests.models.tiny_hybrids.spec_decode_matrix --table RESULT.json ...
    python -m tests.models.tiny_hybrids.spec_decode_matrix OUTDIR --check-configs

The tiny-checkpoint engines run in float16 (checkpoints.MATRIX_DTYPE: bf16
rounding flipped near-tied tokens on the H100) on screened prompts
(checkpoints.SCREENED). The full matrix (132 engines) runs in one call:
compiled engines first, those of auto-KV cells (one per model/draft graph)
before the others, with one Inductor FX-graph cache for all engines
(``--no-shared-compile`` keeps vLLM's per-config AOT cache) and a
``--deadline`` (510 s by default for the full matrix) after which queued
engines are recorded NOT RUN. ``--verify-precision`` measures acceptance
with verify rows reading their own new K/V raw vs quantized (VARIANTS).

Each engine runs in its own subprocess (``--child``), in-process engine core
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so an injected fault (FAULTS below,
monkeypatched before the engine starts) reaches the model runner. Writes
OUTDIR/matrix.json (or speed.json), OUTDIR/logs.tar.gz, prints one table.

Per row: ``exact`` (12/12 prompts equal), else ``DIFF p@t`` (prompt p first
differs at token t), with ``tie`` when the reference's top-1/top-2 logprob
gap at that token is below 1 % of its median gap (rounding, not a wrong
kernel); distinct tokens per prompt (min); context-decided tokens in the
reference (``ctx``); accepted-token histogram
(drafts with 0..k tokens accepted) and mean acceptance length; crash text.
Under the strict count a second line counts the cells that are exact on
every prompt whose no-speculation output is the same in all cudagraph modes
(``unstable_prompts``: where eager vs compiled kernel order alone flips a
token, speculation cannot be judged), and names those prompts.
"""

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KV_DTYPES = ("auto", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc")
CG_MODES = ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE")
# spec name -> speculative_config (the draft model path is filled in later).
SPECS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "mtp1": {"method": "mtp", "num_speculative_tokens": 1},
    "mtp3": {"method": "mtp", "num_speculative_tokens": 3},
    "ngram3": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    },
    "draft3": {"method": "draft_model", "num_speculative_tokens": 3},
}


@dataclasses.dataclass(frozen=True)
class MatrixModel:
    checkpoint: str  # key of checkpoints.MODELS
    specs: tuple[str, ...]
    # Checkpoint of the draft for "draft3": another key, or "self" for an
    # identical-weights copy of the target (acceptance should be ~100 %).
    draft: str | None = None
    # vLLM dummy weights (load_format="dummy") on the checkpoint's config.
    dummy: bool = False
    # The CUDA graph modes its cells run in the release gate (GATE_CELLS).
    gate_cg: tuple[str, ...] = ("NONE", "FULL_AND_PIECEWISE")


MODELS: dict[str, MatrixModel] = {
    # ngram on the hybrid: chain prompts draft, random ones often do not, so
    # GDN rows without drafts follow rows with accepted drafts.
    "qwen3_next": MatrixModel("qwen3_next", ("mtp1", "mtp3", "ngram3")),
    "qwen3_5": MatrixModel("qwen3_5", ("mtp1", "mtp3")),
    "qwen3_5_split": MatrixModel(
        "qwen3_5_split", ("mtp3",), gate_cg=("FULL_AND_PIECEWISE",)
    ),
    "qwen3_dense": MatrixModel("qwen3_dense", ("ngram3", "draft3"), draft="self"),
    "hybrid_draft": MatrixModel("qwen3_next", ("draft3",), draft="qwen3_dense_draft"),
}
# Only in --verify-precision: dense Qwen3 config, dummy weights, a draft of
# the identical config.
PRECISION_MODELS: dict[str, MatrixModel] = {
    "dummy_dense": MatrixModel(
        "dummy_dense", ("draft3",), draft="dummy_dense_draft", dummy=True
    ),
}


def matrix_model(name: str) -> MatrixModel:
    return MODELS[name] if name in MODELS else PRECISION_MODELS[name]


@dataclasses.dataclass(frozen=True)
class Cell:
    model: str
    kv: str
    spec: str
    cg: str

    @property
    def key(self) -> str:
        return f"{self.model}.{self.kv}.{self.spec}.{self.cg}"

    def reference(self) -> "Cell":
        # hybrid_draft's target is qwen3_next: share its reference engine.
        return Cell(matrix_model(self.model).checkpoint, self.kv, "none", self.cg)


def full_cells() -> list[Cell]:
    return [
        Cell(m, kv, spec, cg)
        for m, mm in MODELS.items()
        for spec in mm.specs
        for kv in KV_DTYPES
        for cg in CG_MODES
    ]


QUICK_CELLS: tuple[Cell, ...] = (
    *(
        Cell("qwen3_next", kv, "mtp3", cg)
        for kv in ("auto", "turboquant_4bit_nc")
        for cg in ("NONE", "FULL_AND_PIECEWISE")
    ),
    Cell("qwen3_next", "turboquant_4bit_nc", "ngram3", "FULL_AND_PIECEWISE"),
    Cell("qwen3_5", "turboquant_4bit_nc", "mtp1", "FULL_AND_PIECEWISE"),
    Cell("qwen3_dense", "turboquant_4bit_nc", "ngram3", "FULL_AND_PIECEWISE"),
    Cell("qwen3_dense", "turboquant_4bit_nc", "draft3", "FULL_AND_PIECEWISE"),
    Cell("hybrid_draft", "turboquant_4bit_nc", "draft3", "FULL_AND_PIECEWISE"),
)


# The release gate's set (scripts/gpu-gate.sh): every model with every
# speculation method it has, auto and turboquant_4bit_nc, in its gate_cg modes
# (eager and under FULL CUDA graphs; the split block pool's qwen3_5_split under
# FULL graphs only); the other presets once each under FULL graphs with MTP.
GATE_CELLS: tuple[Cell, ...] = (
    *(
        Cell(m, kv, spec, cg)
        for m, mm in MODELS.items()
        for spec in mm.specs
        for kv in ("auto", "turboquant_4bit_nc")
        for cg in mm.gate_cg
    ),
    *(
        Cell("qwen3_next", kv, "mtp3", "FULL_AND_PIECEWISE")
        for kv in ("turboquant_k8v4", "turboquant_3bit_nc")
    ),
)


def chosen_cells(args: argparse.Namespace) -> list[Cell]:
    base = GATE_CELLS if args.gate else QUICK_CELLS if args.quick else full_cells()
    return select(list(base), args.only)


def select(cells: list[Cell], only: str | None) -> list[Cell]:
    """``only``: comma-separated ``field=v1|v2`` filters, e.g.
    ``model=qwen3_next,cg=NONE|PIECEWISE``."""
    if not only:
        return cells
    filters: dict[str, set[str]] = {}
    for part in only.split(","):
        name, _, values = part.partition("=")
        if name not in {f.name for f in dataclasses.fields(Cell)} or not values:
            raise SystemExit(
                f"--only: expected field=value[|value] with field in "
                f"model/kv/spec/cg, got {part!r}"
            )
        filters[name] = set(values.split("|"))
    for name, values in filters.items():
        there = sorted({getattr(c, name) for c in cells})
        unknown = sorted(values - set(there))
        if unknown:
            raise SystemExit(
                f"--only {name}={'|'.join(unknown)}: no cell of this matrix has "
                f"that {name}; its {name} values: {', '.join(there)}"
            )
    chosen = [c for c in cells if all(getattr(c, k) in v for k, v in filters.items())]
    if not chosen:
        raise SystemExit(
            f"--only {only}: no cell of this matrix matches all of these at once; "
            "drop or widen a filter"
        )
    return chosen


# --------------------------------------------------------------------------
# Injected faults: FAULTS[name] = [(module, class, attribute, wrap), ...]
# ``wrap(original) -> replacement``; applied in the child before the engine
# starts. A missing target is an error naming it (the hook point moved: fix
# the table, do not skip the fault).
# --------------------------------------------------------------------------

_TQ = "vllm.v1.attention.backends.turboquant_attn"
_GDN = "vllm.v1.attention.backends.gdn_attn"


def _max_verify_len() -> int:
    return 1 + int(os.environ.get("HYBRIDKV_MATRIX_NUM_SPEC", "0"))


def _plan_verify_rows(orig: Callable) -> Callable:
    """Record on the metadata which rows are verify rows (1 < len <= 1+k)."""

    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        md = orig(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
        cam = common_attn_metadata
        qsl = cam.query_start_loc_cpu[: cam.num_reqs + 1].tolist()
        lens = [b - a for a, b in zip(qsl, qsl[1:])]
        limit = _max_verify_len()
        rows = [(a, b) for a, b in zip(qsl, qsl[1:]) if 1 < b - a <= limit]
        if lens and len(set(lens)) == 1 and 1 < lens[0] <= limit:
            md._matrix_fault = ("uniform", lens[0])
        elif rows:
            md._matrix_fault = ("rows", rows)
        return md

    return build


def _plan_from(md: Any) -> tuple | None:
    """Verify rows read off the metadata itself, for builds that bypass the
    wrapped ``build`` (e.g. a capture-time builder): the leading
    ``num_decodes`` rows when they are uniform verify rows (verify rows
    batched as decodes)."""
    t = getattr(md, "max_query_len", 0)
    nd = getattr(md, "num_decodes", 0)
    if (
        1 < t <= _max_verify_len()
        and nd
        and getattr(md, "num_decode_tokens", 0) == nd * t
    ):
        return ("prefix", t, nd)
    return None


def _verify_new_tokens_only(orig: Callable) -> Callable:
    """After the real forward, overwrite verify rows with causal attention
    over their own new K/V only (no cache read): the upstream defect."""
    import torch.nn.functional as F

    def attend(self, q, k, v):
        # q: (B, T, Hq, D), k/v: (B, T, Hk, D)
        rep = q.shape[2] // k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.transpose(1, 2)

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output=None, *a, **kw
    ):
        output = orig(
            self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw
        )
        plan = getattr(attn_metadata, "_matrix_fault", None) or _plan_from(
            attn_metadata
        )
        if plan is None or key is None:
            return output
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_size
        flat = output.view(output.shape[0], hq * d)
        if plan[0] in ("uniform", "prefix") and query.shape[0] % plan[1] == 0:
            t = plan[1]
            b = query.shape[0] // t if plan[0] == "uniform" else plan[2]
            out = attend(
                self,
                query[: b * t].reshape(b, t, hq, d),
                key[: b * t].reshape(b, t, hk, d),
                value[: b * t].reshape(b, t, hk, d),
            )
            flat[: b * t] = out.reshape(b * t, hq * d).to(flat.dtype)
        elif plan[0] == "rows":
            for s, e in plan[1]:
                out = attend(
                    self,
                    query[s:e].reshape(1, e - s, hq, d),
                    key[s:e].reshape(1, e - s, hk, d),
                    value[s:e].reshape(1, e - s, hk, d),
                )
                flat[s:e] = out.reshape(e - s, hq * d).to(flat.dtype)
        return output

    return forward


def _gdn_offset_zero(orig: Callable) -> Callable:
    """GDN state read from slot 0 after accepted drafts: the builder is told
    every request accepted 1 token (as in /work/notes/gdn.md; it copies the
    ones into its persistent buffer, so FULL graphs replay the fault)."""
    import torch

    def build(
        self,
        common_prefix_len,
        common_attn_metadata,
        num_accepted_tokens=None,
        *a,
        **kw,
    ):
        if num_accepted_tokens is not None:
            num_accepted_tokens = torch.ones_like(num_accepted_tokens)
        return orig(
            self, common_prefix_len, common_attn_metadata, num_accepted_tokens, *a, **kw
        )

    return build


FAULTS: dict[str, list[tuple[str, str, str, Callable]]] = {
    "verify-new-tokens-only": [
        (_TQ, "TurboQuantMetadataBuilder", "build", _plan_verify_rows),
        (_TQ, "TurboQuantAttentionImpl", "forward", _verify_new_tokens_only),
    ],
    "gdn-offset-zero": [
        (_GDN, "GDNAttentionMetadataBuilder", "build", _gdn_offset_zero),
    ],
}


def _verify_raw_own_kv(orig: Callable) -> Callable:
    """Verifier-precision variant (issue 8 item 3), not a fault: after the
    real forward, every verify row (1 < len <= 1+k, with cached context) is
    recomputed over the cached context read back quantized plus the row's
    OWN new K/V raw, with the backend's own continuation-prefill path
    (dequantize the cache, FlashAttention over it and the raw chunk). The
    shipped path reads the new K/V back quantized too, as a plain decode does.
    Host reads: eager engines only (cudagraph_mode NONE)."""

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output=None, *a, **kw
    ):
        output = orig(
            self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw
        )
        if attn_metadata is None or key is None:
            return output
        n = attn_metadata.num_actual_tokens
        num_reqs = attn_metadata.seq_lens.shape[0]
        qsl = attn_metadata.query_start_loc[: num_reqs + 1].tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_size
        flat = output.view(output.shape[0], hq * d)
        for i, (s, e) in enumerate(zip(qsl, qsl[1:])):
            if not 1 < e - s <= _max_verify_len() or seq_lens[i] <= e - s or e > n:
                continue
            out = self._continuation_prefill(
                layer,
                query[s:e].view(e - s, hq, d),
                key[s:e].view(e - s, hk, d),
                value[s:e].view(e - s, hk, d),
                kv_cache,
                attn_metadata.block_table[i : i + 1],
                seq_lens[i] - (e - s),
                seq_lens[i],
                layer._tq_Pi,
                layer._tq_centroids,
            )
            flat[s:e] = out.reshape(e - s, hq * d).to(flat.dtype)
        return output

    return forward


# Engine variants that are measurements, not faults (not --inject choices).
VARIANTS: dict[str, list[tuple[str, str, str, Callable]]] = {
    "verify-raw-own-kv": [
        (_TQ, "TurboQuantAttentionImpl", "forward", _verify_raw_own_kv),
    ],
}


def apply_fault(name: str) -> list[str]:
    import importlib

    hooks = {**FAULTS, **VARIANTS}
    if name not in hooks:
        raise SystemExit(f"unknown fault {name!r}; known: {sorted(hooks)}")
    done = []
    for module, cls_name, attr, wrap in hooks[name]:
        cls = getattr(importlib.import_module(module), cls_name, None)
        if cls is None or attr not in vars(cls):
            raise RuntimeError(
                f"fault {name}: {module}.{cls_name}.{attr} not found; the hook "
                "point moved, update FAULTS in spec_decode_matrix.py"
            )
        setattr(cls, attr, wrap(vars(cls)[attr]))
        done.append(f"{cls_name}.{attr}")
    return done


# --------------------------------------------------------------------------
# Child: one engine.
# --------------------------------------------------------------------------

MODULE = "tests.models.tiny_hybrids.spec_decode_matrix"
# Whole full-matrix run (132 engines) inside one 10-minute device call,
# with room for the checkpoint build, the table and fetching OUTDIR.
FULL_DEADLINE = 510
MAX_NUM_SEQS = 16
NEW_TOKENS = 64


def engine_kwargs(
    cell: Cell,
    ckpts: dict[str, str],
    max_num_batched_tokens: int | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    from .checkpoints import MATRIX_DTYPE
    from .checkpoints import MODELS as CKPTS

    mm = matrix_model(cell.model)
    extra = CKPTS[mm.checkpoint].engine_kwargs if mm.checkpoint in CKPTS else {}
    kwargs: dict[str, Any] = dict(
        model=ckpts[mm.checkpoint],
        skip_tokenizer_init=True,
        max_model_len=512,
        max_num_seqs=MAX_NUM_SEQS,
        kv_cache_memory_bytes=256 * 2**20,
        gpu_memory_utilization=0.08,
        kv_cache_dtype=cell.kv,
        # float16, not the checkpoints' bfloat16: ~8x less rounding noise
        # (checkpoints.MATRIX_DTYPE says why); --dtype bfloat16 for the other.
        dtype=dtype or MATRIX_DTYPE,
        seed=0,
        disable_log_stats=False,
        **extra,
    )
    if mm.dummy:
        kwargs["load_format"] = "dummy"
    if max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if cell.cg == "NONE":
        kwargs["enforce_eager"] = True
    else:
        kwargs["compilation_config"] = {
            "cudagraph_mode": cell.cg,
            "max_cudagraph_capture_size": MAX_NUM_SEQS * 4,
        }
    spec = SPECS[cell.spec]
    if spec is not None:
        spec = dict(spec)
        if spec["method"] == "draft_model":
            spec["model"] = ckpts["self_draft" if mm.draft == "self" else mm.draft]
        kwargs["speculative_config"] = spec
    return kwargs


def spec_metrics(metrics: list) -> dict[str, Any]:
    """Spec-decode counters from ``LLM.get_metrics()`` and the histogram of
    accepted tokens per draft (index j: drafts with exactly j accepted)."""
    values: dict[str, Any] = {}
    for m in metrics:
        if not m.name.startswith("vllm:spec_decode"):
            continue
        short = m.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
        if hasattr(m, "values"):
            values[short] = list(m.values)
        elif hasattr(m, "value"):
            values[short] = values.get(short, 0) + m.value
    drafts = int(values.get("num_drafts", 0))
    per_pos = [int(v) for v in values.get("num_accepted_tokens_per_pos", [])]
    if drafts and per_pos:
        at_least = [drafts, *per_pos, 0]
        values["histogram"] = [
            at_least[j] - at_least[j + 1] for j in range(len(per_pos) + 1)
        ]
        values["mean_accept_len"] = 1 + values.get("num_accepted_tokens", 0) / drafts
    return values


def run_child(args: dict[str, Any]) -> dict[str, Any]:
    if args.get("fault"):
        print("FAULT", apply_fault(args["fault"]), flush=True)
    from vllm import LLM, SamplingParams

    llm = LLM(**args["engine"])
    params = SamplingParams(
        max_tokens=args.get("max_tokens", NEW_TOKENS),
        temperature=0.0,
        ignore_eos=True,
        logprobs=2 if args.get("logprobs") else None,
    )
    prompts = [{"prompt_token_ids": p} for p in args["prompts"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "seconds": seconds,
        "metrics": spec_metrics(llm.get_metrics()),
    }
    if args.get("logprobs"):
        gaps = []
        for o in outs:
            row = []
            for lp in o.outputs[0].logprobs or []:
                top = sorted((v.logprob for v in lp.values()), reverse=True)
                row.append(top[0] - top[1] if len(top) > 1 else None)
            gaps.append(row)
        result["gaps"] = gaps
    return result


_EXC = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))(?::\s*(.*))?$")
_PREFIX = re.compile(r"^(?:\[rank\d+\]:\s*|\(\w+ pid=\d+\)\s*)+")
# Wrappers that re-raise a root cause printed above them.
_GENERIC = ("Engine core initialization failed", "See root cause above")


def crash_text(log: str) -> str:
    """``Type: first line`` of the last root-cause exception in ``log``."""
    found = []
    for line in log.splitlines():
        m = _EXC.match(_PREFIX.sub("", line.strip()))
        if m:
            found.append(f"{m.group(1)}: {(m.group(2) or '').strip()}"[:200])
    specific = [f for f in found if not any(g in f for g in _GENERIC)]
    if specific or found:
        return (specific or found)[-1]
    tail = [ln for ln in log.splitlines() if ln.strip()]
    return (tail[-1] if tail else "no output")[:200]


# A CUDA kernel's own assert: printed before the exception it causes, which
# names only where the error surfaced (a later cuBLAS call, a sync).
_DEVICE_ASSERT = re.compile(r"\.cu:\d+: .*Assertion .* failed|device-side assert")


def first_root_cause(log: str) -> str:
    """The first line of ``log`` that says what went wrong: a device-side
    assert, else the first exception that is not a wrapper re-raising one
    printed above it. ``crash_text`` gives the last one instead."""
    for line in log.splitlines():
        text = _PREFIX.sub("", line.strip())
        if _DEVICE_ASSERT.search(text):
            return text[:200]
        m = _EXC.match(text)
        if m and not any(g in text for g in _GENERIC):
            return f"{m.group(1)}: {(m.group(2) or '').strip()}"[:200]
    return crash_text(log)


def spawn(
    name: str, args: dict[str, Any], outdir: Path, timeout: float, env: dict[str, str]
) -> dict[str, Any]:
    """Run one engine in a subprocess; its result or a failure record."""
    logs = outdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    args_file = logs / f"{name}.args.json"
    result_file = logs / f"{name}.result.json"
    args_file.write_text(json.dumps(args))
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", MODULE, "--child", str(args_file), str(result_file)]
    start = time.time()
    with open(logs / f"{name}.log", "w") as log:
        # Own session: a timeout kills the engine and its compile workers.
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    record: dict[str, Any] = {"rc": rc, "wall": round(time.time() - start, 1)}
    if rc == 0 and result_file.exists():
        record.update(json.loads(result_file.read_text()))
    else:
        text = (logs / f"{name}.log").read_text(errors="replace")
        record["crash"] = (
            f"TIMEOUT after {timeout:.0f}s" if rc == "timeout" else crash_text(text)
        )
        record["root_cause"] = (
            record["crash"] if rc == "timeout" else first_root_cause(text)
        )
    return record


# --------------------------------------------------------------------------
# Comparison and table.
# --------------------------------------------------------------------------

TIE_FRACTION = 0.01


def context_positions(prompts: list[list[int]], outputs: list[list[int]]) -> int:
    """Generated tokens that are not the bigram successor of the token before:
    where context (attention, GDN) decided. A fault can only show in cells
    where this is well above zero."""
    from .checkpoints import successor_map

    succ = successor_map()
    n = 0
    for p, out in zip(prompts, outputs):
        seq = p[-1:] + out
        n += sum(succ[a] != b for a, b in zip(seq, seq[1:]))
    return n


def near_tie(
    gaps: list[list[float | None]] | None, p: int, t: int
) -> tuple[bool, float | None]:
    """Whether the reference's top-1/top-2 logprob gap at prompt ``p`` token
    ``t`` is below TIE_FRACTION of its median gap, and that gap."""
    gaps = gaps or []
    flat = sorted(g for r in gaps for g in r if g is not None)
    median = flat[len(flat) // 2] if flat else None
    gap = gaps[p][t] if p < len(gaps) and t < len(gaps[p]) else None
    return gap is not None and median is not None and gap < TIE_FRACTION * median, gap


def same_or_tie(status: str) -> bool:
    """``compare``'s verdict counts as equal: exact, or a first difference at a
    flagged near-tie (rounding between two nearly equal logits, not a wrong
    result)."""
    return status == "exact" or status.endswith(" tie")


def first_token_difference(x: list[int], y: list[int]) -> int | None:
    """The first position where two outputs hold different tokens, within the
    shorter one; None where one is a prefix of the other."""
    return next((t for t, (u, v) in enumerate(zip(x, y)) if u != v), None)


def compare(
    ref: dict[str, Any], run: dict[str, Any], prompts: list[list[int]] | None = None
) -> dict[str, Any]:
    """Row fields for one cell from the reference and speculative records."""
    row: dict[str, Any] = {}
    crashed = [w for w, rec in (("ref", ref), ("spec", run)) if "crash" in rec]
    if crashed:
        # Both texts when both crashed (pristine): the cell's own first.
        row["status"] = f"CRASH({'+'.join(crashed)})"
        first = run if "spec" in crashed else ref
        row["crash"] = first["crash"]
        row["root_cause"] = first.get("root_cause", first["crash"])
        if len(crashed) == 2 and ref["crash"] != run["crash"]:
            row["crash"] += f" | reference: {ref['crash']}"
        return row
    a, b = ref["outputs"], run["outputs"]
    first = []
    for i, (x, y) in enumerate(zip(a, b)):
        pos = first_token_difference(x, y)
        if pos is None and len(x) != len(y):
            pos = min(len(x), len(y))
        if pos is not None:
            first.append((i, pos))
    row["prompts_exact"] = f"{len(a) - len(first)}/{len(a)}"
    if prompts is not None:
        row["ctx_positions"] = context_positions(prompts, a)
    row["distinct_min"] = min((len(set(o)) for o in b), default=0)
    row["first_diffs"] = first
    if not first:
        row["status"] = "exact"
    else:
        p, t = first[0]
        tie, gap = near_tie(ref.get("gaps"), p, t)
        row["status"] = f"DIFF {p}@{t}" + (" tie" if tie else "")
        row["gap_at_diff"] = gap
    m = run.get("metrics", {})
    row["histogram"] = m.get("histogram")
    row["mean_accept_len"] = m.get("mean_accept_len")
    return row


def kv_sensitivity(records: dict[str, dict[str, Any]]) -> list[str]:
    """How far each TurboQuant reference departs from ``auto`` on the same
    model and cudagraph mode: evidence that outputs depend on attention."""
    lines = []
    for name, rec in sorted(records.items()):
        model, kv, spec, cg = (name.split(".") + [""] * 4)[:4]
        if spec != "none" or kv == "auto" or "outputs" not in rec:
            continue
        auto = records.get(f"{model}.auto.none.{cg}", {})
        if "outputs" not in auto:
            continue
        row = compare(auto, rec)
        firsts = [t for _, t in row["first_diffs"]]
        lines.append(
            f"{kv} vs auto ({model}, {cg}): {row['prompts_exact']} prompts equal"
            + (f", first differences at tokens {sorted(firsts)}" if firsts else "")
        )
    return lines


def aligned(cols: tuple[str, ...], lines: list[tuple]) -> list[str]:
    """A header and rows, each column padded to its widest cell."""
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*cols), *(fmt.format(*ln) for ln in lines)]


def unstable_prompts(records: dict[str, dict[str, Any]]) -> dict[str, list[int]]:
    """``{"model.kv": prompts}`` whose output WITHOUT speculation already
    changes with the cudagraph mode alone (same checkpoint, KV dtype and
    prompts; only the kernel order differs): the trajectory sits on a tie at
    the model dtype's resolution there, so a speculative cell that differs on
    such a prompt shows rounding, not a wrong result. Reported beside the
    strict count, never folded into ``status``."""
    outs: dict[str, list[list[list[int]]]] = {}
    for name, rec in records.items():
        parts = name.split(".")
        if len(parts) != 4 or parts[2] != "none" or "outputs" not in rec:
            continue
        outs.setdefault(f"{parts[0]}.{parts[1]}", []).append(rec["outputs"])
    unstable = {}
    for key, runs in sorted(outs.items()):
        bad = {
            i
            for run in runs[1:]
            for i, (a, b) in enumerate(zip(runs[0], run))
            if a != b
        }
        if bad:
            unstable[key] = sorted(bad)
    return unstable


def with_unstable_prompts(
    rows: list[dict[str, Any]], records: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each row's ``unstable_prompts`` (of its reference's checkpoint)."""
    unstable = unstable_prompts(records)
    for r in rows:
        ref = Cell(r["model"], r["kv"], r["spec"], r["cg"]).reference()
        r["unstable_prompts"] = unstable.get(f"{ref.model}.{ref.kv}", [])
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    cols = (
        "model",
        "kv",
        "spec",
        "cg",
        "status",
        "exact",
        "dist",
        "ctx",
        "accept hist",
        "len",
    )
    lines = []
    for r in rows:
        acc = r.get("mean_accept_len")
        lines.append(
            (
                r["model"],
                r["kv"].removeprefix("turboquant_") if r["kv"] != "auto" else "auto",
                r["spec"],
                {
                    "NONE": "none",
                    "PIECEWISE": "pw",
                    "FULL_AND_PIECEWISE": "full+pw",
                }.get(r["cg"], r["cg"]),
                r.get("status", "?"),
                r.get("prompts_exact", "-"),
                str(r.get("distinct_min", "-")),
                str(r.get("ctx_positions", "-")),
                ",".join(map(str, r["histogram"])) if r.get("histogram") else "-",
                f"{acc:.2f}" if acc else "-",
            )
        )
    out = aligned(cols, lines)
    crashes = [r for r in rows if r.get("crash")]
    for r in crashes:
        out.append(f"  {r['model']}.{r['kv']}.{r['spec']}.{r['cg']}: {r['crash']}")
    exact = sum(r.get("status") == "exact" for r in rows)
    out.append(f"{exact}/{len(rows)} cells exact")
    if any(r.get("unstable_prompts") for r in rows):
        stable = sum(
            r.get("status") == "exact"
            or (
                bool(r.get("first_diffs"))
                and {p for p, _ in r["first_diffs"]} <= set(r["unstable_prompts"])
            )
            for r in rows
        )
        out.append(
            f"{stable}/{len(rows)} cells exact on every prompt whose output without "
            "speculation is the same in all cudagraph modes; prompts that are not: "
            + "; ".join(
                sorted(
                    {
                        f"{r['model']}.{r['kv']}: {r['unstable_prompts']}"
                        for r in rows
                        if r.get("unstable_prompts")
                    }
                )
            )
        )
    return "\n".join(out)


# --------------------------------------------------------------------------
# Driver.
# --------------------------------------------------------------------------


def child_env(
    outdir: Path,
    cache: Path | None,
    num_spec: int,
    in_process: bool = True,
    shared_compile: bool = False,
) -> dict[str, str]:
    env = dict(os.environ)
    cache = cache or outdir / "cache"
    env.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    env.setdefault("VLLM_CACHE_ROOT", str(cache / "vllm"))
    if shared_compile:
        # vLLM's AOT-compile path points Inductor at a cache directory per
        # config hash (every cell has its own), so 88 compiled engines would
        # each compile the same few graphs. Without it Inductor keeps the
        # directory set here: one FX-graph cache for all engines, and an
        # engine whose model graphs another engine compiled loads them.
        # (Compiled code is the same either way; this only moves caches.)
        env["VLLM_USE_AOT_COMPILE"] = "0"
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    # In-process engine core: a monkeypatched fault reaches the model runner.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    if in_process:
        # Many engines compile at once on 16 cores: keep Inductor's pools small.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "2")
    env["HYBRIDKV_MATRIX_NUM_SPEC"] = str(num_spec)
    from .ports import child_port_env

    env.update(child_port_env())
    env["HF_HUB_OFFLINE"] = "1"
    repo = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    return env


def build_checkpoints(
    root: Path, gains: dict[str, float] | None = None
) -> dict[str, str]:
    from .checkpoints import build_all, copy_checkpoint

    paths = {k: str(v) for k, v in build_all(root, gains=gains).items()}
    paths["self_draft"] = str(
        copy_checkpoint(paths["qwen3_dense"], root / "qwen3_dense_copy")
    )
    return paths


def check_configs(args: argparse.Namespace) -> int:
    """Build every selected engine's VllmConfig without starting it (no GPU
    needed with a CPU platform): argument names, cudagraph/spec/KV choices
    and config-time refusals, in seconds. With ``--speed``: the speed ones."""
    from vllm.engine.arg_utils import EngineArgs

    from .checkpoints import MODELS as CKPTS
    from .checkpoints import write_config
    from .shapes import write_full_size_config

    outdir = Path(args.outdir)
    ckpts = {n: str(write_config(n, outdir / "configs" / n)) for n in CKPTS}
    ckpts["self_draft"] = ckpts["qwen3_dense"]
    kwargs = {}
    if args.speed:
        path = outdir / "configs" / "qwen3_6_27b"
        model = str(write_full_size_config("Qwen3.6-27B", path))
        for cg in args.modes:
            kwargs[f"speed.{cg}"] = speed_engine_kwargs(model, cg)
    else:
        cells = chosen_cells(args)
        for cell in cells:
            for c in (cell.reference(), cell):
                kwargs[c.key] = engine_kwargs(
                    c, ckpts, args.max_num_batched_tokens, args.dtype
                )
    failed = 0
    for name, kw in kwargs.items():
        try:
            EngineArgs(**kw).create_engine_config()
        except Exception as e:
            failed += 1
            first = (str(e).splitlines() or [""])[0]
            print(f"  {name}: {type(e).__name__}: {first[:150]}")
    print(f"{len(kwargs) - failed}/{len(kwargs)} engine configs build")
    return 1 if failed else 0


def _order(cell: Cell) -> tuple[int, int, int]:
    """Queue order: compiled engines before eager (NONE) ones, which are the
    shortest, and within them references (no speculation) first, FULL
    graphs before PIECEWISE ones, so that each checkpoint and KV dtype's
    first engine (its group leader, see ``run_engines``) compiles every graph
    and kernel of the main model."""
    return (cell.cg == "NONE", cell.spec != "none", -CG_MODES.index(cell.cg))


def compile_group(cell: Cell) -> tuple[str, str]:
    """Engines that compile the same main-model kernels and graphs."""
    return (matrix_model(cell.model).checkpoint, cell.kv)


def run_engines(
    engines: dict[str, tuple[Cell, dict[str, Any]]],
    outdir: Path,
    args: argparse.Namespace,
    t0: float,
) -> dict[str, dict[str, Any]]:
    """Run every engine (``--jobs`` at a time, each compile group's leader
    before the rest of its group); engines that cannot start or finish
    before ``--deadline`` (seconds since ``t0``) are recorded as not run /
    timed out, so the table always comes out inside one device call."""
    from .scheduling import NOT_RUN, run_grouped

    done = [0]
    deadline = t0 + args.deadline if args.deadline else None

    def one(item):
        name, (c, child_args) = item
        timeout = args.timeout
        if deadline is not None:
            left = deadline - time.time()
            if left < 20:
                done[0] += 1
                return name, {"rc": "skipped", "wall": 0, "crash": NOT_RUN}
            timeout = min(timeout, left)
        num_spec = (SPECS[c.spec] or {}).get("num_speculative_tokens", 0)
        env = child_env(
            outdir, args.cache, num_spec, shared_compile=args.shared_compile
        )
        rec = spawn(name, child_args, outdir, timeout, env)
        done[0] += 1
        if "crash" in rec:
            print(f"  {name}: {rec['crash'][:100]} ({rec['wall']}s)", flush=True)
        elif done[0] % 10 == 0:
            print(f"  [{done[0]}/{len(engines)}] {time.time() - t0:.0f}s", flush=True)
        return name, rec

    items = sorted(engines.items(), key=lambda kv: _order(kv[1][0]))
    return dict(
        run_grouped(items, lambda item: compile_group(item[1][0]), one, args.jobs)
    )


def run_matrix(args: argparse.Namespace) -> int:
    from .checkpoints import bigram_prompts

    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    cells = chosen_cells(args)
    t0 = time.time()
    ckpts = build_checkpoints(outdir / "ckpt", args.gain)
    prompts = bigram_prompts(args.prompts)
    engines: dict[str, tuple[Cell, dict[str, Any]]] = {}
    for cell in cells:
        for c, fault in ((cell.reference(), None), (cell, args.inject)):
            name = c.key + (f".{fault}" if fault else "")
            engines[name] = (
                c,
                {
                    "engine": engine_kwargs(
                        c, ckpts, args.max_num_batched_tokens, args.dtype
                    ),
                    "prompts": prompts,
                    "fault": fault,
                    "logprobs": c.spec == "none",
                },
            )
    dtype = next(iter(engines.values()))[1]["engine"]["dtype"]
    reused = reuse_references(
        args.resume or args.refs,
        engines,
        prompts,
        args.gain,
        dtype,
        every=args.resume is not None,
    )
    for name in reused:
        engines.pop(name)
    print(
        f"{len(cells)} cells, {len(engines)} engines ({len(reused)} earlier "
        f"records reused), {args.jobs} at a time, deadline {args.deadline}s",
        flush=True,
    )
    records = {**reused, **run_engines(engines, outdir, args, t0)}
    rows = with_unstable_prompts(
        [
            {
                **dataclasses.asdict(cell),
                "fault": args.inject,
                **compare(
                    records[cell.reference().key],
                    records[cell.key + (f".{args.inject}" if args.inject else "")],
                    prompts,
                ),
            }
            for cell in cells
        ],
        records,
    )
    sensitivity = kv_sensitivity(records)
    result = {
        "rows": rows,
        "kv_sensitivity": sensitivity,
        "records": records,
        "inject": args.inject,
        "gains": args.gain,
        "dtype": dtype,
        "prompts": prompts,
        "seconds": round(time.time() - t0, 1),
    }
    (outdir / "matrix.json").write_text(json.dumps(result))
    _tar_logs(outdir)
    print(format_table(rows))
    print(
        f"{time.time() - t0:.0f}s; {outdir / 'matrix.json'}, {outdir / 'logs.tar.gz'}"
    )
    # The gate's cells pass at a flagged near-tie too (same_or_tie), and the
    # gate's record shows this status beside its verdict.
    passes = same_or_tie if args.gate else (lambda status: status == "exact")
    return 0 if all(passes(r.get("status", "")) for r in rows) else 1


# --------------------------------------------------------------------------
# Verifier precision (issue 8 item 3): acceptance with verify rows reading
# their own new K/V back quantized (shipped) vs raw (VARIANTS), eager.
# --------------------------------------------------------------------------

PRECISION_CELLS: tuple[tuple[str, str], ...] = (
    # Dense target + identical-config draft, vLLM dummy weights: dummy values
    # depend only on a parameter's size and dtype (per-parameter seed), so
    # target == draft and every draft should be accepted.
    ("dummy_dense", "draft3"),
    ("qwen3_dense", "draft3"),
    ("qwen3_next", "mtp3"),
    ("qwen3_5", "mtp3"),
    ("hybrid_draft", "draft3"),
)
PRECISION_KVS = ("turboquant_4bit_nc", "turboquant_3bit_nc")
RAW = "verify-raw-own-kv"


def precision_rows(
    cells: list[Cell], records: dict[str, dict[str, Any]], prompts: list[list[int]]
) -> list[dict[str, Any]]:
    rows = []
    for cell in cells:
        ref = records[cell.reference().key]
        for variant, label in ((None, "quantized"), (RAW, "raw own K/V")):
            rec = records[cell.key + (f".{variant}" if variant else "")]
            row = {"model": cell.model, "kv": cell.kv, "spec": cell.spec}
            row["verify"] = label
            row.update(compare(ref, rec, prompts))
            m = rec.get("metrics", {})
            if m.get("num_draft_tokens"):
                row["accept_rate"] = m.get("num_accepted_tokens", 0) / float(
                    m["num_draft_tokens"]
                )
            rows.append(row)
    return rows


def format_precision(rows: list[dict[str, Any]]) -> str:
    cols = ("model", "kv", "spec", "verify", "accept", "len", "exact vs no-spec")
    lines = []
    for r in rows:
        rate, length = r.get("accept_rate"), r.get("mean_accept_len")
        status = r.get("status", "?")
        lines.append(
            (
                r["model"],
                r["kv"].removeprefix("turboquant_"),
                r["spec"],
                r["verify"],
                f"{100 * rate:.1f}%" if rate is not None else "-",
                f"{length:.2f}" if length else "-",
                "yes" if status == "exact" else f"no ({status})",
            )
        )
    out = aligned(cols, lines)
    out += [
        f"  {r['model']}.{r['kv']}.{r['verify']}: {r['crash']}"
        for r in rows
        if r.get("crash")
    ]
    return "\n".join(out)


def run_precision(args: argparse.Namespace) -> int:
    from .checkpoints import bigram_prompts, copy_checkpoint, write_config

    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    ckpts = build_checkpoints(outdir / "ckpt", args.gain)
    ckpts["dummy_dense"] = str(write_config("qwen3_dense", outdir / "ckpt" / "dummy"))
    ckpts["dummy_dense_draft"] = str(
        copy_checkpoint(ckpts["dummy_dense"], outdir / "ckpt" / "dummy_draft")
    )
    prompts = bigram_prompts(args.prompts)
    cells = [
        Cell(m, kv, spec, "NONE") for m, spec in PRECISION_CELLS for kv in args.kvs
    ]
    engines: dict[str, tuple[Cell, dict[str, Any]]] = {}
    for cell in cells:
        for c, variant in ((cell.reference(), None), (cell, None), (cell, RAW)):
            engines[c.key + (f".{variant}" if variant else "")] = (
                c,
                {
                    "engine": engine_kwargs(c, ckpts, dtype=args.dtype),
                    "prompts": prompts,
                    "fault": variant,
                    "logprobs": c.spec == "none",
                },
            )
    print(f"{len(cells)} cells, {len(engines)} engines, {args.jobs} at a time")
    records = run_engines(engines, outdir, args, t0)
    rows = precision_rows(cells, records, prompts)
    (outdir / "precision.json").write_text(
        json.dumps({"rows": rows, "records": records, "prompts": prompts})
    )
    _tar_logs(outdir)
    print(format_precision(rows))
    print(f"{time.time() - t0:.0f}s; {outdir / 'precision.json'}")
    return 0 if all("crash" not in r for r in rows) else 1


def reuse_references(
    refs: Path | None,
    engines: dict[str, tuple[Cell, dict[str, Any]]],
    prompts: list[list[int]],
    gains: dict[str, float],
    dtype: str = "float16",
    every: bool = False,
) -> dict[str, dict[str, Any]]:
    """Reference records (no speculation, no fault) from an earlier run's
    matrix.json with the same prompts and gains, instead of new engines;
    with ``every`` (``--resume``) every engine that finished there."""
    if refs is None:
        return {}
    path = refs / "matrix.json" if refs.is_dir() else refs
    prev = json.loads(path.read_text())
    # Runs before the dtype was recorded used bfloat16.
    same = prev.get("gains", {}) == gains and prev.get("dtype", "bfloat16") == dtype
    if prev.get("prompts") != prompts or not same:
        raise SystemExit(
            f"{path}: other prompts, --gain or --dtype; run without --refs/--resume"
        )
    return {
        name: prev["records"][name]
        for name, (c, _) in engines.items()
        if (every or c.spec == "none") and "outputs" in prev["records"].get(name, {})
    }


def _tar_logs(outdir: Path) -> None:
    (outdir / "logs").mkdir(parents=True, exist_ok=True)
    with tarfile.open(outdir / "logs.tar.gz", "w:gz") as tar:
        tar.add(outdir / "logs", arcname="logs")


# --------------------------------------------------------------------------
# Speed: full-size Qwen3.6-27B-shaped hybrid, dummy weights.
# --------------------------------------------------------------------------

SPEED_MODES = ("FULL_AND_PIECEWISE", "PIECEWISE", "NONE")


def speed_engine_kwargs(model: str, cg: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=model,
        load_format="dummy",
        language_model_only=True,
        skip_tokenizer_init=True,
        kv_cache_dtype="turboquant_4bit_nc",
        max_model_len=1024,
        max_num_seqs=64,
        gpu_memory_utilization=0.92,
        speculative_config={"method": "mtp", "num_speculative_tokens": 3},
        seed=0,
        disable_log_stats=False,
    )
    if cg == "NONE":
        kwargs["enforce_eager"] = True
    else:
        kwargs["compilation_config"] = {
            "cudagraph_mode": cg,
            "max_cudagraph_capture_size": 256,
        }
    return kwargs


def run_speed(args: argparse.Namespace) -> int:
    import random

    from .shapes import write_full_size_config

    outdir = Path(args.outdir)
    model = str(write_full_size_config("Qwen3.6-27B", outdir / "qwen3_6_27b"))
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 200000) for _ in range(128)] for _ in range(64)]
    rows = []
    t0 = time.time()
    for cg in args.modes:
        # Engine core in its own process, as users run it (no faults here).
        env = child_env(outdir, args.cache, 3, in_process=False)
        child_args = {
            "engine": speed_engine_kwargs(model, cg),
            "prompts": prompts,
            "max_tokens": args.speed_tokens,
        }
        rec = spawn(f"speed.{cg}", child_args, outdir, args.timeout, env)
        row = {"cg": cg, "wall": rec["wall"]}
        if "crash" in rec:
            row["crash"] = rec["crash"]
        else:
            toks = sum(len(o) for o in rec["outputs"])
            row["out_tok_s"] = round(toks / rec["seconds"], 1)
            row["mean_accept_len"] = rec["metrics"].get("mean_accept_len")
        rows.append(row)
        print(f"  speed {cg}: {row}", flush=True)
    result = {"rows": rows, "tokens": args.speed_tokens}
    (outdir / "speed.json").write_text(json.dumps(result))
    _tar_logs(outdir)
    print(format_speed(rows, args.speed_tokens))
    print(f"{time.time() - t0:.0f}s")
    return 0 if all("crash" not in r for r in rows) else 1


def format_speed(rows: list[dict[str, Any]], tokens: int) -> str:
    out = [
        "Qwen3.6-27B-shaped, dummy weights, turboquant_4bit_nc, MTP k=3, "
        f"64x(128->{tokens})"
    ]
    out.append("(dummy weights: acceptance is not meaningful, only speed)")
    for r in rows:
        if "crash" in r:
            out.append(f"  {r['cg']:<20} CRASH {r['crash']}")
            continue
        line = f"  {r['cg']:<20} {r['out_tok_s']:>9.1f} out tok/s"
        if r.get("mean_accept_len"):
            line += f"  accept len {r['mean_accept_len']:.2f}"
        out.append(line)
    return "\n".join(out)


def print_tables(paths: list[str]) -> int:
    for p in paths:
        data = json.loads(Path(p).read_text())
        if data.get("rows") and "verify" in data["rows"][0]:
            print(format_precision(data["rows"]))
        elif data.get("rows") and "model" in data["rows"][0]:
            rows = data["rows"]
            if "records" in data:
                rows = with_unstable_prompts(rows, data["records"])
            print(format_table(rows))
        else:
            print(format_speed(data.get("rows", []), data.get("tokens", 512)))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tests.models.tiny_hybrids.spec_decode_matrix",
        description="speculative decoding vs none, token for token (issue 8)",
    )
    p.add_argument("outdir", nargs="?")
    p.add_argument("--quick", action="store_true", help="the cells that fit 8 minutes")
    p.add_argument(
        "--gate",
        action="store_true",
        help="the release gate's cells (GATE_CELLS; scripts/gpu-gate.sh runs them)",
    )
    p.add_argument(
        "--inject", choices=sorted(FAULTS), help="fault in the speculative engine"
    )
    p.add_argument("--only", help="filters, e.g. model=qwen3_next,cg=NONE|PIECEWISE")
    p.add_argument("--jobs", type=int, default=16, help="engines at a time")
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds for the whole run (default 510 for the full matrix, "
        "else none): engines still queued then are recorded NOT RUN, running "
        "ones are stopped, the table is printed",
    )
    p.add_argument(
        "--no-shared-compile",
        dest="shared_compile",
        action="store_false",
        help="keep vLLM's per-config AOT compile cache (slower: no sharing)",
    )
    p.add_argument(
        "--verify-precision",
        action="store_true",
        help="acceptance with verify rows reading their own K/V quantized "
        "(shipped) vs raw, eager engines (issue 8 item 3)",
    )
    p.add_argument(
        "--kvs",
        default=",".join(PRECISION_KVS),
        help="--verify-precision: TurboQuant presets, comma-separated",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per engine (default: 240 --quick, 300 --speed, else 420)",
    )
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument(
        "--dtype",
        choices=("float16", "bfloat16"),
        default=None,
        help="model dtype of the tiny-checkpoint engines (default "
        "checkpoints.MATRIX_DTYPE, float16: less rounding noise)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--cache", type=Path, default=None, help="TRITON/VLLM cache root")
    p.add_argument(
        "--refs",
        type=Path,
        default=None,
        help="reuse the no-speculation engines of an earlier run (its OUTDIR)",
    )
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="reuse every engine that finished in an earlier run of the same "
        "code (its OUTDIR): a matrix that hit --deadline continues there",
    )
    p.add_argument(
        "--gain",
        action="append",
        default=[],
        metavar="CKPT=G",
        help="override a checkpoint's bigram_gain (checkpoints.MODELS), e.g. "
        "qwen3_next=0.05: lower lets context decide more tokens",
    )
    p.add_argument("--speed", action="store_true", help="full-size speed run instead")
    p.add_argument(
        "--speed-tokens",
        type=int,
        default=128,
        help="--speed: output tokens per prompt (eager mode needs minutes for 512)",
    )
    p.add_argument(
        "--modes",
        default=",".join(SPEED_MODES),
        help="--speed: cudagraph modes to run, comma-separated",
    )
    p.add_argument(
        "--table", nargs="+", metavar="JSON", help="print tables of earlier runs"
    )
    p.add_argument(
        "--check-configs",
        action="store_true",
        help="only build each selected engine's config (with --speed: those)",
    )
    p.add_argument(
        "--child", nargs=2, metavar=("ARGS", "RESULT"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    if not (args.outdir or args.table or args.child):
        p.error("OUTDIR is required")
    gains = {}
    for item in args.gain:
        name, _, value = item.partition("=")
        try:
            gains[name] = float(value)
        except ValueError:
            p.error(f"--gain: expected CKPT=FLOAT, got {item!r}")
    args.gain = gains
    if args.timeout is None:
        args.timeout = 240 if args.quick else 300 if args.speed else 300
    full = not (
        args.quick or args.gate or args.only or args.speed or args.verify_precision
    )
    if args.deadline is None and full:
        args.deadline = FULL_DEADLINE
    args.kvs = args.kvs.split(",")
    if not set(args.kvs) <= set(KV_DTYPES) - {"auto"}:
        p.error(f"--kvs: expected TurboQuant presets of {KV_DTYPES}, got {args.kvs}")
    modes = args.modes.split(",")
    if not set(modes) <= set(CG_MODES):
        p.error(f"--modes: expected some of {CG_MODES}, got {modes}")
    args.modes = modes
    return args


def child_main(
    paths: list[str],
    run: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    before_exit: Callable[[], None] | None = None,
):
    """``--child ARGS RESULT``: one engine's run (``run``, default
    ``run_child``), its result written as JSON; the process then ends without
    engine teardown, which can hang or crash after the work is done
    (``before_exit`` first, e.g. ending worker processes)."""
    child_args = json.loads(Path(paths[0]).read_text())
    result = (run or run_child)(child_args)
    Path(paths[1]).write_text(json.dumps(result))
    sys.stdout.flush()
    if before_exit is not None:
        before_exit()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
    if args.table:
        return print_tables(args.table)
    if args.check_configs:
        return check_configs(args)
    if args.speed:
        return run_speed(args)
    if args.verify_precision:
        return run_precision(args)
    return run_matrix(args)


if __name__ == "__main__":
    sys.exit(main())
