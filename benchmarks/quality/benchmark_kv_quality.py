# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a compressed KV cache does to a trained model: perplexity, needle
recall, greedy agreement and the needles' answer NLL, per KV-cache dtype, on
real weights (GPU).

    python benchmarks/quality/benchmark_kv_quality.py \\
        --model smollm2_135m=DIR --model gemma3_270m=DIR [--corpus FILE ...] \\
        [--out OUTDIR] [--jobs 6] [--gpus 0,1] [--timeout 420] [--deadline 450] \\
        [--models NAME ...] [--kv KV ...] [--skip default boundary:0 LIST ...] \\
        [--needles 3] [--needle-sample 0] [--attention-backend NAME]

The checkpoints are the directories ``tests/models/real_weights/checkpoints.py``
converts (``python -m tests.models.real_weights.checkpoints OUTDIR --gguf
PATH``); the name before ``=`` is a key of its MODELS and picks the grid.

Cells: model x KV dtype (auto, fp8, turboquant_k8v4, turboquant_4bit_nc,
turboquant_k3v4_nc, turboquant_3bit_nc) x skip layers: the engine's default,
and for the TurboQuant presets also ``boundary:0``
(``kv_cache_dtype_skip_layers=["boundary:0"]``: no boundary protection, every
full-attention layer quantized; the default keeps the first and last two
attention layers at bf16 on these all-attention models, and Gemma 3's
sliding-window layers stay bf16 either way). ``--skip`` narrows the
TurboQuant cells only; auto and fp8 run once. 20 cells for both models.
``--kv`` also takes vLLM's ``int8_per_token_head`` and ``fp8_per_token_head``
(every layer in that cache, run once like fp8) and
``turboquant_3bit_pair_nc`` (skip settings as the other presets), never run
by default.
``--skip`` also takes a skip list of its own, comma-separated, as one more
setting (``boundary:0,11=turboquant_4bit_nc``: layer 11 stores its own
preset).

How: the parent tokenizes the corpus once per model with the checkpoint's
tokenizer (its BOS as the tokenizer adds it) and builds every prompt as token
ids (kvq_inputs.py). Each cell is one process (this script with ``--child``,
kvq_child.py): one ``vllm.LLM`` with a fixed KV cache (``kv_cache_memory_bytes``,
no memory profiling, so engines share a GPU), eager, chunked prefill in
512-token steps (later tokens of a prompt attend to the cache as stored,
compressed), no prefix caching, seed 0, bf16. Up to ``--jobs`` cells run at
once, spread over ``--gpus`` (least loaded first) through
CUDA_VISIBLE_DEVICES; a cell past ``--timeout`` is killed, and after
``--deadline`` seconds no cell starts and running ones are killed.

Per cell:

1. Perplexity: non-overlapping 3,000-token windows of the corpus (at most
   ``--ppl-windows``), scored with ``prompt_logprobs=0``;
   exp(mean NLL over every token after each window's first), and its ratio
   to the same model's auto.
2. Needle recall: "The secret passcode for the <word> vault is <7 digits>."
   in a corpus haystack at depths 0.1-0.9, lengths per model (GRIDS),
   ``--needles`` (3) each, drawn by a seed per ``--needle-sample``, length and
   depth; the question in completion form, 12 greedy tokens; a hit
   when the number appears in the answer. Recall % overall and per length,
   with its 95 % Wilson interval, and the cases lost / gained against auto.
3. Greedy agreement with auto: 16 corpus excerpts (200-1,500 tokens), 64
   greedy tokens; tokens equal to auto's before the first difference, summed
   over all tokens, and prompts equal throughout.
4. Answer NLL: each needle prompt followed by its number, scored with
   ``prompt_logprobs=0``; the number's NLL per case, and against auto on the
   same cases the mean difference and its standard error. A hit flips on
   cases at the boundary; this moves by degrees.

Each cell also records the KV dtype and attention backend of every layer as
the engine runs them, the "GPU KV cache size" it planned, and the wall time
of each phase.

Output: OUTDIR/quality.json (devices, versions, command, date, every cell
with every case), OUTDIR/quality.md (one table per model; printed last),
OUTDIR/logs/<cell>.log and OUTDIR/logs.tar.gz (every child's log), the
children's inputs and results under OUTDIR/work/. The JSON and Markdown are
rewritten whole (tmp + rename) after every cell, marked partial until the end.
OUTDIR is ``--out``, else $OUT, else benchmarks/runs/kv-quality-<time> (git-ignored).
On the device machine, where at most 8 files of $OUT come back, write to a
folder outside $OUT and copy quality.json, quality.md and logs.tar.gz there.

A cell's status: ``ok`` (every phase measured); ``failed`` (the engine or a
phase raised; what was measured is kept); ``crash`` / ``crash (signal N)``
(the child died without saying why); ``timeout`` and ``killed at deadline``
(killed; phases finished before are kept); ``not run (deadline)``. Every
status but ok comes with the first root-cause line of the child's log (for
killed cells: the phases done and the log's last line).

Exit status: 0 every cell ok; 1 any other cell status (or SIGTERM / Ctrl-C:
running cells are killed, what was measured is written); 2 bad arguments or
missing inputs (unknown model name, checkpoint directory without config.json
/ weights / tokenizer, no readable corpus, no GPU): the message says which
and how to fix it.
"""

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# The helpers are imported by their own names from this folder, and the
# repository comes first for ``tests.``: a runtime's site directory may carry
# packages of the same top-level names.
for _p in (str(REPO), str(HERE)):
    if _p in sys.path:
        sys.path.remove(_p)
    sys.path.insert(0, _p)

import kvq_inputs  # noqa: E402
import kvq_measures as measures  # noqa: E402
import kvq_report  # noqa: E402

KV_DTYPES = (
    "auto",
    "fp8",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
)
# vLLM's per-token-head 8-bit caches and hybridkv's pair-coded 3-bit keys
# run only when --kv names them: the default table stays the one every
# release is compared on.
OPT_IN_KV_DTYPES = (
    "int8_per_token_head",
    "fp8_per_token_head",
    "turboquant_3bit_pair_nc",
)
ALL_KV_DTYPES = KV_DTYPES + OPT_IN_KV_DTYPES
# Skip-layer settings: label -> kv_cache_dtype_skip_layers (None: not passed).
# --skip also takes a list of its own, comma-separated, as its label (e.g.
# "boundary:0,19=turboquant_4bit_nc": layer 19 stores its own preset).
SKIPS: dict[str, list[str] | None] = {"default": None, "boundary:0": ["boundary:0"]}


def skip_entries(label: str) -> list[str] | None:
    """The ``kv_cache_dtype_skip_layers`` a cell's skip label stands for."""
    if label in SKIPS:
        return SKIPS[label]
    return label.split(",")


PHASES = ("ppl", "agreement", "needle", "answer")
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Grid:
    context: int  # max_model_len
    lengths: tuple[int, ...]  # needle prompt lengths, tokens
    cost: int  # relative cell cost, for the run order


GRIDS = {
    "smollm2_135m": Grid(8192, (1024, 2048, 4096, 7168), cost=1),
    "gemma3_270m": Grid(32768, (1024, 4096, 8192, 16384, 30720), cost=4),
}
# Engine arguments every cell shares (see the module docstring for why).
ENGINE = dict(
    gpu_memory_utilization=0.08,  # only the start-up free-memory check
    enforce_eager=True,
    enable_chunked_prefill=True,
    max_num_batched_tokens=512,
    max_num_seqs=128,
    enable_prefix_caching=False,
    seed=0,
    dtype="bfloat16",
)
CHILD_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCHINDUCTOR_COMPILE_THREADS": "2",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


class UsageError(Exception):
    """Bad arguments or missing inputs: exit status 2."""


@dataclasses.dataclass(frozen=True)
class Cell:
    model: str
    kv: str
    skip: str  # a key of SKIPS, or a comma-separated skip list

    @property
    def key(self) -> str:
        # Also a file name: letters, digits, '.', '_' and '-' only.
        skip = self.skip.replace(":", "").replace("turboquant_", "")
        return f"{self.model}.{self.kv}.{re.sub(r'[^A-Za-z0-9._-]', '-', skip)}"


# ---------------------------------------------------------------- arguments


def known_models() -> dict[str, Any]:
    """MODELS of tests/models/real_weights/checkpoints.py (name -> RealModel)."""
    from tests.models.real_weights.checkpoints import MODELS

    return MODELS


def resolve_models(specs: Sequence[str], only: Sequence[str] | None) -> dict[str, Path]:
    models = known_models()
    names = sorted(set(models) & set(GRIDS))
    convert = (
        "convert one with `python -m tests.models.real_weights.checkpoints OUTDIR "
        "--gguf PATH`"
    )
    if not specs:
        raise UsageError(
            f"no --model given: pass --model NAME=DIR for each of {', '.join(names)} "
            f"to measure ({convert})"
        )
    dirs: dict[str, Path] = {}
    for spec in specs:
        name, sep, where = spec.partition("=")
        if not sep or not name or not where:
            raise UsageError(
                f"--model {spec!r}: expected NAME=DIR, e.g. {names[0]}=/tmp/ck"
            )
        if name not in names:
            raise UsageError(
                f"--model {spec!r}: unknown model {name!r}; known: {', '.join(names)}"
            )
        if name in dirs:
            raise UsageError(f"--model {name} given twice")
        path = Path(where).expanduser().resolve()
        config_file = path / "config.json"
        if not config_file.is_file():
            raise UsageError(f"--model {spec}: {path} has no config.json; {convert}")
        if not any(path.glob("*.safetensors")):
            raise UsageError(
                f"--model {spec}: {path} has no *.safetensors weights; {convert}"
            )
        if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            raise UsageError(f"--model {spec}: {path} has no tokenizer.json; {convert}")
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"--model {spec}: {config_file} is not JSON ({e})") from e
        want = models[name].facts.model_type
        if config.get("model_type") != want:
            raise UsageError(
                f"--model {spec}: {path} is a {config.get('model_type')!r} checkpoint, "
                f"{name} is {want!r}; swapped directories?"
            )
        longest = max(GRIDS[name].lengths) + 16
        if config.get("max_position_embeddings", longest) < longest:
            raise UsageError(
                f"--model {spec}: max_position_embeddings "
                f"{config['max_position_embeddings']} < the longest needle case "
                f"({longest} with its answer)"
            )
        dirs[name] = path
    if only:
        missing = [n for n in only if n not in dirs]
        if missing:
            raise UsageError(
                f"--models {' '.join(missing)}: not among the --model checkpoints "
                f"given ({', '.join(dirs)}); add --model {missing[0]}=DIR"
            )
        dirs = {n: dirs[n] for n in only}
    return dirs


def detect_gpus() -> list[dict[str, str]]:
    """Every GPU nvidia-smi lists (index, name, memory); [] if none or no nvidia-smi."""
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=index,name,memory.total",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0]:
            gpus.append(
                {"index": parts[0], "name": parts[1], "memory": ",".join(parts[2:])}
            )
    return gpus


def choose_gpus(flag: str | None, detected: list[dict[str, str]]) -> list[str]:
    if flag is not None:
        gpus = [g.strip() for g in flag.split(",") if g.strip()]
        if not gpus:
            raise UsageError("--gpus is empty; give indices like 0,1")
        return gpus
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
        if not gpus:
            raise UsageError(
                "no GPU: CUDA_VISIBLE_DEVICES is empty; unset it or pass --gpus 0"
            )
        return gpus
    if not detected:
        raise UsageError(
            "no GPU: `nvidia-smi` lists none (or is missing); run on a GPU host, "
            "or pass --gpus if nvidia-smi is not on PATH there"
        )
    return [g["index"] for g in detected]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="benchmark_kv_quality.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--models", nargs="+", metavar="NAME", help="only these of --model")
    ap.add_argument("--kv", nargs="+", choices=ALL_KV_DTYPES, default=list(KV_DTYPES))
    ap.add_argument(
        "--skip",
        nargs="+",
        default=list(SKIPS),
        metavar="SKIP",
        help=f"skip-layer settings of the TurboQuant cells: {', '.join(SKIPS)}, or "
        "a comma-separated --kv-cache-dtype-skip-layers list of its own",
    )
    ap.add_argument(
        "--corpus",
        nargs="+",
        metavar="FILE",
        help="plain text; default: " + " ".join(kvq_inputs.DEFAULT_CORPUS),
    )
    ap.add_argument(
        "--out", type=Path, help="OUTDIR (default $OUT, else benchmarks/runs/)"
    )
    ap.add_argument("--jobs", type=int, default=6, help="cells at once (all GPUs)")
    ap.add_argument("--gpus", help="comma-separated indices (default: every GPU)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per cell")
    ap.add_argument(
        "--deadline",
        type=float,
        default=450.0,
        help="seconds from start; then no cell starts and running ones are killed "
        "(0: none)",
    )
    ap.add_argument("--ppl-windows", type=int, default=8)
    ap.add_argument("--ppl-window", type=int, default=3000, help="tokens per window")
    ap.add_argument("--needles", type=int, default=3, help="per length and depth")
    ap.add_argument(
        "--needle-sample",
        type=int,
        default=0,
        metavar="N",
        help="which draw of needle cases (words, numbers, haystack offsets); 0, "
        "the default, is the one every earlier table used",
    )
    ap.add_argument(
        "--kv-cache-gib", type=float, default=3.0, help="KV cache per engine"
    )
    ap.add_argument(
        "--attention-backend",
        metavar="NAME",
        help="vLLM's --attention-backend for every cell (e.g. TRITON_ATTN, the "
        "backend of the per-token-head KV dtypes, for FP8 layers FlashAttention "
        "would serve); layers it cannot serve, TurboQuant's among them, keep "
        "their own (default: vLLM's choice per layer)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, low in (
        ("jobs", 1),
        ("ppl_windows", 1),
        ("needles", 1),
        ("needle_sample", 0),
    ):
        if getattr(args, name) < low:
            raise UsageError(f"--{name.replace('_', '-')} must be at least {low}")
    if args.needles > len(kvq_inputs.WORDS):
        raise UsageError(f"--needles must be at most {len(kvq_inputs.WORDS)}")
    if args.ppl_window < 16:
        raise UsageError("--ppl-window must be at least 16 tokens")
    if args.timeout <= 0 or args.deadline < 0 or args.kv_cache_gib <= 0:
        raise UsageError("--timeout and --kv-cache-gib must be > 0, --deadline >= 0")
    if args.attention_backend is not None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        names = [b.name for b in AttentionBackendEnum]
        if args.attention_backend not in names:
            raise UsageError(
                f"--attention-backend {args.attention_backend} is not one of vLLM's "
                f"attention backends; pass one of {', '.join(names)}"
            )
    return args


def plan_cells(
    models: Sequence[str], kvs: Sequence[str], skips: Sequence[str]
) -> list[Cell]:
    """Cells in table order (model, KV dtype, skip setting)."""
    cells = []
    for model in models:
        for kv in ALL_KV_DTYPES:
            if kv not in kvs:
                continue
            if not kv.startswith("turboquant_"):
                cells.append(Cell(model, kv, "default"))
                continue
            own = [s for s in skips if s not in SKIPS]
            cells.extend(Cell(model, kv, s) for s in [*SKIPS, *own] if s in skips)
    return cells


def run_order(cells: Sequence[Cell]) -> list[Cell]:
    """auto first (every ratio needs it), then default-skip cells heaviest
    first, boundary:0 last: by then its preset's Triton kernels are compiled
    and cached by the default cell."""

    def key(c: Cell) -> tuple:
        return (
            c.kv != "auto",
            c.skip != "default",
            -GRIDS[c.model].cost,
            not c.kv.startswith("turboquant_"),
            ALL_KV_DTYPES.index(c.kv),
        )

    return sorted(cells, key=key)


def engine_kwargs(
    cell: Cell, kv_cache_gib: float, attention_backend: str | None = None
) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        kv_cache_dtype=cell.kv,
        max_model_len=GRIDS[cell.model].context,
        kv_cache_memory_bytes=int(kv_cache_gib * GIB),
        **ENGINE,
    )
    if skip_entries(cell.skip) is not None:
        kw["kv_cache_dtype_skip_layers"] = list(skip_entries(cell.skip))
    if attention_backend is not None:
        kw["attention_backend"] = attention_backend
    return kw


# ---------------------------------------------------------------- children


def child_env(gpu: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(CHILD_ENV)
    env["CUDA_VISIBLE_DEVICES"] = gpu
    # Several engines share the host's cores: keep each one's CPU pools small.
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def child_command(args_file: Path) -> list[str]:
    return [sys.executable, str(HERE / Path(__file__).name), "--child", str(args_file)]


_EXCEPTION = re.compile(
    r"^(?:\(\w+ pid=\d+\)\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))"
    r"(?::\s*(.*))?$"
)


def _first_exception(log: str) -> str | None:
    for line in log.splitlines():
        m = _EXCEPTION.match(line.strip())
        if m:
            return f"{m.group(1)}: {(m.group(2) or '').strip()}"[:200]
    return None


def root_cause(log: str) -> str:
    """The first line of a child's log that says what went wrong."""
    from tests.models.tiny_hybrids.spec_decode_matrix import first_root_cause

    return first_root_cause(log)


def cell_record(
    cell: Cell, rc: int | str, wall: float, gpu: str, log_file: Path, result_file: Path
) -> dict[str, Any]:
    """What the parent keeps of one finished (or killed) child."""
    rec: dict[str, Any] = {
        "key": cell.key,
        "model": cell.model,
        "kv": cell.kv,
        "skip": cell.skip,
        "skip_layers": skip_entries(cell.skip),
        "gpu": gpu,
        "rc": rc,
        "wall_s": round(wall, 1),
        "log": str(log_file),
    }
    result: dict[str, Any] = {}
    if result_file.is_file():
        try:
            result = json.loads(result_file.read_text())
        except (OSError, ValueError) as e:
            rec["result_error"] = f"unreadable result: {e}"
    for k in ("timings", "facts", "errors", *PHASES):
        if k in result:
            rec[k] = result[k]
    try:
        log = log_file.read_text(errors="replace")
    except OSError:
        log = ""
    m = _KV_TOKENS.search(log)
    rec["kv_tokens"] = int(m.group(1).replace(",", "")) if m else None
    errors = result.get("errors") or {}
    missing = [p for p in PHASES if p not in result]
    if rc == 0 and result and not errors and not missing:
        rec["status"] = "ok"
        return rec
    if rc in ("timeout", "deadline", "interrupted"):
        rec["status"] = {
            "timeout": "timeout",
            "deadline": "killed at deadline",
            "interrupted": "interrupted",
        }[rc]
        done = [k.removesuffix("_s") for k in rec.get("timings", {})]
        tail = [ln.strip() for ln in log.splitlines() if ln.strip()]
        # A killed child rarely printed an exception; when it did (a hang
        # after an error), that line says more than the last one.
        detail = (
            root_cause(log)
            if _first_exception(log)
            else f"last log line: {tail[-1][:160] if tail else 'none'}"
        )
        rec["root_cause"] = (
            f"after {wall:.0f} s; done: {', '.join(done) or 'nothing'}; {detail}"
        )
        return rec
    if isinstance(rc, int) and rc < 0:
        rec["status"] = f"crash (signal {-rc})"
    elif result and (errors or missing):
        rec["status"] = "failed"
    else:
        rec["status"] = "crash"
    rec["root_cause"] = (
        root_cause(log)
        if log.strip()
        else ("; ".join(f"{k}: {v}" for k, v in errors.items()) or f"exit {rc}, no log")
    )
    return rec


def not_run_record(cell: Cell, why: str) -> dict[str, Any]:
    return {
        "key": cell.key,
        "model": cell.model,
        "kv": cell.kv,
        "skip": cell.skip,
        "skip_layers": skip_entries(cell.skip),
        "status": why,
    }


@dataclasses.dataclass
class _Running:
    cell: Cell
    proc: subprocess.Popen
    gpu: str
    started: float


def _kill(run: _Running) -> None:
    # Each child leads its own session: the whole group (engine, compile
    # workers) goes, and nothing this harness did not start. A process stuck
    # in the driver may take a while to die; the harness does not wait for
    # it past half a minute.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        run.proc.wait(timeout=30)


def run_cells(
    order: Sequence[Cell],
    prepare: Callable[[Cell], tuple[list[str], Path, Path]],
    gpus: Sequence[str],
    jobs: int,
    timeout: float,
    deadline_at: float | None,
    on_done: Callable[[dict[str, Any]], None],
    env_for: Callable[[str], dict[str, str]] = child_env,
    poll: float = 0.5,
) -> list[dict[str, Any]]:
    """Run every cell (at most ``jobs`` at once, least-loaded GPU first).

    ``prepare(cell)`` -> (command, log file, result file). Returns one record
    per cell, in ``order``; ``on_done`` sees each as it finishes.
    """
    pending = list(order)
    running: list[_Running] = []
    records: dict[str, dict[str, Any]] = {}
    load = {g: 0 for g in gpus}
    turn = 0

    def done(run: _Running, rc: int | str) -> None:
        load[run.gpu] -= 1
        _, log_file, result_file = prepare_cache[run.cell.key]
        rec = cell_record(
            run.cell, rc, time.monotonic() - run.started, run.gpu, log_file, result_file
        )
        records[run.cell.key] = rec
        on_done(rec)

    prepare_cache: dict[str, tuple[list[str], Path, Path]] = {}
    try:
        while pending or running:
            now = time.monotonic()
            past_deadline = deadline_at is not None and now >= deadline_at
            for run in list(running):
                rc = run.proc.poll()
                if rc is None and past_deadline:
                    _kill(run)
                    rc = "deadline"
                elif rc is None and now - run.started > timeout:
                    _kill(run)
                    rc = "timeout"
                if rc is not None:
                    running.remove(run)
                    done(run, rc)
            if past_deadline and pending:
                for cell in pending:
                    records[cell.key] = not_run_record(cell, "not run (deadline)")
                    on_done(records[cell.key])
                pending.clear()
            while pending and len(running) < jobs:
                cell = pending.pop(0)
                # Least-loaded GPU; ties go round the list.
                gpu = min(
                    gpus, key=lambda g: (load[g], (gpus.index(g) - turn) % len(gpus))
                )
                turn += 1
                prepare_cache[cell.key] = cmd, log_file, _ = prepare(cell)
                try:
                    # The child writes to its own copy of the file descriptor.
                    with open(log_file, "w") as log:
                        proc = subprocess.Popen(
                            cmd,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            env=env_for(gpu),
                            cwd=str(REPO),
                            start_new_session=True,
                        )
                except OSError as e:
                    records[cell.key] = not_run_record(cell, "crash")
                    records[cell.key]["root_cause"] = f"could not start: {e}"
                    on_done(records[cell.key])
                    continue
                load[gpu] += 1
                running.append(_Running(cell, proc, gpu, time.monotonic()))
                print(f"[kv-quality] start {cell.key} on GPU {gpu}", flush=True)
            if pending or running:
                time.sleep(poll)
    except KeyboardInterrupt:
        for run in list(running):
            _kill(run)
            running.remove(run)
            done(run, "interrupted")
        for cell in pending:
            records[cell.key] = not_run_record(cell, "not run (interrupted)")
        raise _Interrupted(records) from None
    finally:
        # Children lead sessions of their own and would outlive this process:
        # whatever goes wrong here, none is left running.
        for run in running:
            _kill(run)
    return [records[c.key] for c in order]


class _Interrupted(Exception):
    def __init__(self, records: dict[str, dict[str, Any]]):
        super().__init__("interrupted")
        self.records = records


# ---------------------------------------------------------------- results


def compare_with_auto(
    cells: list[dict[str, Any]], inputs_meta: dict[str, dict]
) -> None:
    """Fill in each cell's ratio to auto, agreement with auto and per-case
    needle outcomes (in place)."""
    auto = {c["model"]: c for c in cells if c["kv"] == "auto"}
    for c in cells:
        try:
            _compare_one(c, auto.get(c["model"], {}), inputs_meta)
        except Exception as e:  # one odd record must not cost the others
            c["compare_error"] = f"{type(e).__name__}: {e}"


def _compare_one(c: dict[str, Any], ref: dict[str, Any], inputs_meta: dict) -> None:
    ppl = c.get("ppl")
    if isinstance(ppl, dict):
        ref_ppl = ref.get("ppl") or {}
        ppl["ratio_to_auto"] = measures.ratio(ppl.get("ppl"), ref_ppl.get("ppl"))
        # The ratio's spread: each window against auto's same window. Beside
        # other quantized layers a small change moves single windows by ~1 %.
        mine, ref_windows = ppl.get("windows") or [], ref_ppl.get("windows") or []
        if c is not ref and len(mine) > 1 and len(mine) == len(ref_windows):
            ppl["windows_vs_auto"] = measures.paired_difference(
                [w["nll_mean"] for w in ref_windows], [w["nll_mean"] for w in mine]
            )
    agr = c.get("agreement")
    ref_out = (ref.get("agreement") or {}).get("outputs")
    if isinstance(agr, dict) and "outputs" in agr and ref_out is not None:
        agr.update(measures.agreement(ref_out, agr["outputs"]))
    needle = c.get("needle")
    if isinstance(needle, dict) and "answers" in needle:
        # The JSON keeps every case: its meta (length, depth, word, number,
        # where the needle sits) beside the engine's answer.
        cases = inputs_meta[c["model"]]["needle"]["cases"]
        answers = needle.pop("answers")
        needle["cases"] = [{**m, **a} for m, a in zip(cases, answers)]
    answer, ref_answer = c.get("answer"), ref.get("answer") or {}
    if isinstance(answer, dict) and answer.get("nll") and ref_answer.get("nll"):
        answer["vs_auto"] = measures.paired_difference(ref_answer["nll"], answer["nll"])
    ref_needle = ref.get("needle") or {}
    ref_cases = ref_needle.get("cases") or ref_needle.get("answers")
    if isinstance(needle, dict) and "cases" in needle and ref_cases:
        needle.update(
            measures.needles_lost(
                [a["hit"] for a in ref_cases], [a["hit"] for a in needle["cases"]]
            )
        )


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_outputs(outdir: Path, result: dict[str, Any]) -> str:
    _write_atomic(outdir / "quality.json", json.dumps(result, indent=1).encode())
    try:
        md = kvq_report.markdown(result)
    except Exception as e:  # the JSON has every figure; say why there is no table
        why = f"{type(e).__name__}: {e}"
        md = f"# KV-cache quality\n\nNo table ({why}); quality.json has the figures."
    _write_atomic(outdir / "quality.md", (md + "\n").encode())
    return md


def write_logs_tar(outdir: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for log in sorted((outdir / "logs").glob("*.log")):
            tar.add(log, arcname=f"logs/{log.name}")
    _write_atomic(outdir / "logs.tar.gz", buf.getvalue())


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in ("vllm", "torch", "triton", "transformers"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def default_outdir() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return REPO / "benchmarks" / "runs" / f"kv-quality-{stamp}"


def load_tokenizer(path: Path) -> Any:
    # Local files only; and no tokenizer thread pool to warn about at each
    # fork of a child.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def build_model_inputs(
    name: str, path: Path, text: str, args: argparse.Namespace
) -> dict[str, Any]:
    try:
        tok = load_tokenizer(path)
    except Exception as e:
        raise UsageError(
            f"{name}: the tokenizer in {path} does not load ({type(e).__name__}: "
            f"{e}); reconvert the checkpoint"
        ) from e
    grid = GRIDS[name]
    if args.ppl_window + 1 > grid.context:
        raise UsageError(f"--ppl-window {args.ppl_window} exceeds {name}'s context")
    return kvq_inputs.build_inputs(
        tok,
        text,
        grid.lengths,
        args.ppl_window,
        args.ppl_windows,
        args.needles,
        args.needle_sample,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    try:
        args = parse_args(argv)
        if args.child:
            import kvq_child

            kvq_child.main(args.child)  # ends the process itself
            return 3
        models = resolve_models(args.model, args.models)
        text, corpus_files = kvq_inputs.read_corpus(
            args.corpus or kvq_inputs.DEFAULT_CORPUS, explicit=bool(args.corpus)
        )
        detected = detect_gpus()
        gpus = choose_gpus(args.gpus, detected)
        outdir = (args.out or default_outdir()).resolve()
        work = outdir / "work"
        (outdir / "logs").mkdir(parents=True, exist_ok=True)
        work.mkdir(exist_ok=True)
        inputs_meta = {}
        for name, path in models.items():
            t0 = time.monotonic()
            built = build_model_inputs(name, path, text, args)
            (work / f"inputs-{name}.json").write_text(json.dumps(built))
            inputs_meta[name] = built["meta"]
            print(
                f"[kv-quality] {name}: {built['meta']['corpus_tokens']} corpus tokens, "
                f"inputs built in {time.monotonic() - t0:.1f} s",
                flush=True,
            )
    except (UsageError, kvq_inputs.InputError) as e:
        print(f"benchmark_kv_quality.py: error: {e}", file=sys.stderr)
        return 2

    cells = plan_cells(list(models), args.kv, args.skip)
    used = [d for d in detected if d["index"] in gpus] or [
        {"index": g, "name": "unknown", "memory": ""} for g in gpus
    ]
    result: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"
            ),
            "command": shlex.join(
                ["python", "benchmarks/quality/benchmark_kv_quality.py", *argv]
            ),
            "devices": used,
            "gpus": gpus,
            "host": os.uname().nodename,
            "versions": _versions(),
            "corpus": {"files": corpus_files, "chars": len(text)},
            "engine": {
                **ENGINE,
                "kv_cache_memory_bytes": int(args.kv_cache_gib * GIB),
                "attention_backend": args.attention_backend,
            },
            "jobs": args.jobs,
            "timeout_s": args.timeout,
            "deadline_s": args.deadline or None,
            "complete": False,
        },
        "models": {
            name: {
                "dir": str(models[name]),
                "context": GRIDS[name].context,
                "inputs": inputs_meta[name],
            }
            for name in models
        },
        "cells": [not_run_record(c, "pending") for c in cells],
    }
    slot = {c.key: i for i, c in enumerate(cells)}

    def prepare(cell: Cell) -> tuple[list[str], Path, Path]:
        args_file = work / f"{cell.key}.args.json"
        result_file = work / f"{cell.key}.result.json"
        result_file.unlink(missing_ok=True)
        child = {
            "key": cell.key,
            "model_dir": str(models[cell.model]),
            "engine": engine_kwargs(cell, args.kv_cache_gib, args.attention_backend),
            "inputs": str(work / f"inputs-{cell.model}.json"),
            "result": str(result_file),
            "phases": list(PHASES),
        }
        args_file.write_text(json.dumps(child, indent=1))
        return (
            child_command(args_file),
            outdir / "logs" / f"{cell.key}.log",
            result_file,
        )

    def on_done(rec: dict[str, Any]) -> None:
        result["cells"][slot[rec["key"]]] = rec
        if "wall_s" in rec:
            print(
                f"[kv-quality] {rec['key']}: {rec['status']} ({rec['wall_s']} s)",
                flush=True,
            )
        try:
            snapshot = json.loads(json.dumps(result))
            compare_with_auto(snapshot["cells"], inputs_meta)
            write_outputs(outdir, snapshot)
        except Exception as e:  # the final write tries again
            print(f"[kv-quality] snapshot not written: {e!r}", flush=True)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    deadline_at = started + args.deadline if args.deadline else None
    interrupted = False
    try:
        records = run_cells(
            run_order(cells),
            prepare,
            gpus,
            args.jobs,
            args.timeout,
            deadline_at,
            on_done,
        )
    except _Interrupted as e:
        interrupted = True
        records = [e.records.get(c.key) or not_run_record(c, "not run") for c in cells]
    by_key = {r["key"]: r for r in records}
    result["cells"] = [by_key[c.key] for c in cells]
    compare_with_auto(result["cells"], inputs_meta)
    result["meta"]["complete"] = not interrupted
    result["meta"]["wall_s"] = round(time.monotonic() - started, 1)
    write_logs_tar(outdir)
    md = write_outputs(outdir, result)
    print(f"[kv-quality] wrote {outdir}/quality.json, quality.md, logs.tar.gz\n")
    print(md, flush=True)
    return 0 if all(c["status"] == "ok" for c in result["cells"]) else 1


if __name__ == "__main__":
    sys.exit(main())
