# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU: what the engine configures when prefix caching is on (issue 47,
"First measure", the columns a CPU can fill).

For every cell of prefix_cache_matrix (tiny Qwen3-Next-like, Qwen3.5-like
and dense Qwen3 checkpoints' configs x KV dtype x speculation x Mamba cache
mode) and the same grid on the full-size shape records (shapes.py:
Qwen3-Coder-Next-80B-A3B, Qwen3.6-27B, Qwen3-4B as the dense control), the
configuration goes through the capacity planner of patch 0006
(``vllm.v1.core.kv_cache_capacity.plan_capacity``: ``EngineArgs`` ->
``create_engine_config`` for a CUDA target on this host, the hybrid page
planner, the engine's own ``get_kv_cache_configs``), its request naming
prefix caching and the Mamba cache mode (``enable_prefix_caching``,
``mamba_cache_mode``). Ngram speculation, which a request cannot name, is
added to the planner's engine arguments from outside for the ngram cells.
Per cell: accepted or the first line of the refusal, the Mamba cache mode
the config ends with, the attention block size(s), ``mamba_block_size``,
the unified page and the GDN state it pads, bytes per token of the
attention layers, padding, blocks and KV tokens at the fixed budget, and the
KV tokens of the same configuration with prefix caching off.

For each tiny model the run also checks the command line (``probe_cli``):
``vllm kv-capacity --enable-prefix-caching --mamba-cache-mode align`` (no
mode on the dense control) plans the KV tokens the Python API plans for the
same request; the exit status is 1 where it does not.

    python -m tests.models.tiny_hybrids.prefix_cache_plan [--markdown FILE]
        [--json FILE] [--only SUBSTR] [--tiny-only] [--with-cold] [--no-probe]

Takes about a second per configuration (the planner builds each config).
"""

import argparse
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import prefix_cache_matrix as pcm

GIB = 2**30
# The full-size records: KV budget and context of a large GPU.
FULL_SIZE_KV_BYTES = 16 * GIB
FULL_SIZE_MAX_MODEL_LEN = 65536


@dataclasses.dataclass(frozen=True)
class Model:
    specs: tuple[str, ...]
    language_model_only: bool = False
    full_size: str | None = None  # shapes.py name; None: a tiny checkpoint
    hybrid: bool = True


MODELS: dict[str, Model] = {
    "qwen3_next": Model(pcm.MODELS["qwen3_next"]),
    "qwen3_5": Model(pcm.MODELS["qwen3_5"], language_model_only=True),
    "qwen3_5_split": Model(pcm.MODELS["qwen3_5_split"], language_model_only=True),
    "qwen3_dense": Model(pcm.MODELS["qwen3_dense"], hybrid=False),
    "Qwen3-Coder-Next-80B-A3B": Model(
        ("none", "mtp", "ngram"), full_size="Qwen3-Coder-Next-80B-A3B"
    ),
    "Qwen3.6-27B": Model(
        ("none", "mtp", "ngram"), language_model_only=True, full_size="Qwen3.6-27B"
    ),
    "Qwen3-4B": Model(("none", "ngram"), full_size="Qwen3-4B", hybrid=False),
}


def plan_cells(tiny_only: bool = False, with_cold: bool = False) -> list[pcm.Cell]:
    """prefix_cache_matrix's cells, the full-size grid after them; with
    ``with_cold`` each (model, KV, speculation)'s prefix-caching-off
    configuration (the matrix's cold engine) too."""
    out = list(pcm.cells())
    if not tiny_only:
        for name, m in MODELS.items():
            if m.full_size is None:
                continue
            modes = pcm.MODES if m.hybrid else (pcm.DENSE_MODE,)
            out += [
                pcm.Cell(name, kv, spec, mode)
                for kv in pcm.KV_DTYPES
                for spec in m.specs
                for mode in modes
            ]
    if with_cold:
        out += list(dict.fromkeys(c.cold() for c in out))
    return out


def write_configs(root: Path, names: set[str]) -> dict[str, str]:
    """config.json (and the tiny tokenizer) of each model, no weights: the
    tiny ones exactly as prefix_cache_matrix builds them."""
    from .checkpoints import write_config
    from .shapes import write_full_size_config

    dirs = {}
    for name in sorted(names):
        m = MODELS[name]
        if m.full_size is None:
            spec = pcm.checkpoint_spec(name)
            dirs[name] = str(write_config(name, root / name, spec))
        else:
            dirs[name] = str(write_full_size_config(m.full_size, root / name))
    return dirs


def budget(model: str) -> tuple[int, int]:
    """(KV-cache bytes, max_model_len) the cell is planned with: the
    matrix's for the tiny models; for a full-size record 16 GiB and 64K
    tokens, or its own context where that is shorter (Qwen3-4B: 40,960)."""
    m = MODELS[model]
    if m.full_size is None:
        return pcm.KV_CACHE_MEMORY_BYTES, pcm.MAX_MODEL_LEN
    from .shapes import load_full_size

    record = load_full_size(m.full_size)
    text = record.get("text_config", record)
    longest = int(text.get("max_position_embeddings") or FULL_SIZE_MAX_MODEL_LEN)
    return FULL_SIZE_KV_BYTES, min(FULL_SIZE_MAX_MODEL_LEN, longest)


def cell_request(cell: pcm.Cell, model_dir: str) -> Any:
    """The planner's request for ``cell`` (ngram speculation aside)."""
    from vllm.v1.core import kv_cache_capacity as kcc

    kv_bytes, max_model_len = budget(cell.model)
    return kcc.CapacityRequest(
        model=model_dir,
        max_model_len=max_model_len,
        kv_cache_dtype=cell.kv,
        num_speculative_tokens=(
            pcm.SPECS["mtp"]["num_speculative_tokens"] if cell.spec == "mtp" else 0
        ),
        language_model_only=MODELS[cell.model].language_model_only,
        kv_cache_memory_bytes=kv_bytes,
        max_num_batched_tokens=pcm.MAX_NUM_BATCHED_TOKENS,
        usage_context="llm",
        enable_prefix_caching=cell.prefix_caching,
        mamba_cache_mode=cell.mode if cell.mode in pcm.MODES else None,
    )


def planned_kv_cache_config(req: Any) -> tuple[Any, Any]:
    """(vllm_config, the scheduler's KV-cache config) that the engine plans
    for the capacity request ``req`` on this host: plan_capacity's steps,
    keeping the config it reports on. The config carries its block count
    (``cache_config.num_gpu_blocks``), as the engine's does."""
    from vllm.v1.core import kv_cache_capacity as kcc
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_configs,
    )

    kcc.use_planning_platform()
    vllm_config = kcc.engine_config(
        req, kcc.parse_device_capability(req.device_capability)
    )
    layers = kcc.all_layers(vllm_config)
    layers += kcc.raw_window_twins(vllm_config, layers)
    kcc.plan_block_size(vllm_config, layers, False)
    specs, _ = kcc.kv_cache_specs(vllm_config, layers, False)
    configs = get_kv_cache_configs(vllm_config, [specs], [kcc.available_kv_memory(req)])
    config = generate_scheduler_kv_cache_config(configs)
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    return vllm_config, config


@contextlib.contextmanager
def ngram_engine_args(cell: pcm.Cell):
    """The planner's EngineArgs with ngram speculation for an ngram cell."""
    from vllm.v1.core import kv_cache_capacity as kcc

    if cell.spec != "ngram":
        yield
        return
    saved_cls = kcc._planning_engine_args_cls
    speculative = dict(pcm.SPECS["ngram"])

    def engine_args_cls(target: Any) -> type:
        base = saved_cls(target)

        class NgramEngineArgs(base):  # type: ignore[misc, valid-type]
            def __init__(self, **kwargs: Any) -> None:
                super().__init__(**{**kwargs, "speculative_config": speculative})

        return NgramEngineArgs

    kcc._planning_engine_args_cls = engine_args_cls
    try:
        yield
    finally:
        kcc._planning_engine_args_cls = saved_cls


def _first_line(text: Any) -> str:
    """The first line of an error; with pydantic's "N validation error for
    X" header, the line that names the problem too."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    if not lines:
        return ""
    first = lines[0]
    if "validation error" in first and len(lines) > 1:
        first = f"{first}: {lines[1]}"
    return first[:200]


def report_facts(report: Any) -> dict[str, Any]:
    """The row fields of one planner report."""
    row: dict[str, Any] = {
        "error": None,
        "block_size": report.block_size,
        "page_size_bytes": report.page_size_bytes,
        "padding_fraction": round(report.padding_fraction, 4),
        "padding_fraction_full_load": round(report.padding_fraction_full_load, 4),
        "num_blocks": report.num_blocks,
        "kv_tokens": report.kv_tokens,
        "max_concurrency": report.max_concurrency,
        "max_num_batched_tokens": report.max_num_batched_tokens,
    }
    attn_blocks, per_token, mamba_state = set(), set(), None
    for g in report.groups:
        for r in g["layer_pages"]:
            stored = r["page_size_bytes"] - r["padding_bytes"]
            if "Mamba" in r["type"]:
                mamba_state = stored
            else:
                attn_blocks.add(r["block_size"])
                per_token.add(stored // r["block_size"])
    row["hit_block"] = math.lcm(*(g["block_size"] for g in report.groups))
    row["attention_block_sizes"] = sorted(attn_blocks)
    row["attention_bytes_per_token"] = sorted(per_token)
    row["mamba_state_bytes"] = mamba_state
    row["mode_effective"] = report.mamba_cache_mode
    row["mamba_block_size"] = report.mamba_block_size
    row["enable_prefix_caching"] = report.enable_prefix_caching
    return row


def plan_cell(cell: pcm.Cell, model_dir: str) -> dict[str, Any]:
    """The planner's answer for ``cell`` (accepted or the refusal's first line)."""
    from vllm.v1.core import kv_cache_capacity as kcc

    req = cell_request(cell, model_dir)
    row: dict[str, Any] = {**dataclasses.asdict(cell), "name": cell.name}
    row.update(
        kv_cache_memory_bytes=req.kv_cache_memory_bytes,
        max_model_len=req.max_model_len,
    )
    try:
        with ngram_engine_args(cell):
            report = kcc.plan_capacity(req)
    except Exception as e:  # the planner's input errors and refusals alike
        row["error"] = f"{type(e).__name__}: {_first_line(e)}"
        return row
    if report.error:
        row["error"] = _first_line(report.error)
        # None where the engine refused the configuration itself.
        if report.mamba_cache_mode is not None:
            row["mode_effective"] = report.mamba_cache_mode
        return row
    row.update(report_facts(report))
    if cell.prefix_caching:
        predicted = pcm.cell_predictions(
            cell, row["hit_block"], pcm.build_phases(), MODELS[cell.model].hybrid
        )
        row["predicted_cached"] = {g: pcm._mean(v) for g, v in predicted.items()}
    return row


def probe_cell(model: str) -> pcm.Cell:
    """The configuration ``probe_cli`` plans: no speculation, bf16 KV, ``align``
    on the hybrids (the dense control takes no Mamba cache mode)."""
    mode = pcm.MODES[0] if MODELS[model].hybrid else pcm.DENSE_MODE
    return pcm.Cell(model, "auto", "none", mode)


def cli_argv(req: Any) -> list[str]:
    """``vllm kv-capacity`` arguments for a ``cell_request`` request."""
    argv = [
        req.model,
        "--max-model-len", str(req.max_model_len),
        "--kv-cache-dtype", req.kv_cache_dtype,
        "--kv-cache-memory-bytes", str(req.kv_cache_memory_bytes),
        "--max-num-batched-tokens", str(req.max_num_batched_tokens),
        "--usage-context", req.usage_context,
    ]  # fmt: skip
    if req.num_speculative_tokens:
        argv += ["--num-speculative-tokens", str(req.num_speculative_tokens)]
    if req.language_model_only:
        argv.append("--language-model-only")
    if req.enable_prefix_caching is not None:
        flag = "enable" if req.enable_prefix_caching else "no-enable"
        argv.append(f"--{flag}-prefix-caching")
    if req.mamba_cache_mode is not None:
        argv += ["--mamba-cache-mode", req.mamba_cache_mode]
    return argv


def probe_cli(model: str, model_dir: str) -> dict[str, Any]:
    """``vllm kv-capacity`` with prefix caching on (``probe_cell``) against the
    Python API on the same request: both plans' KV tokens, and whether the
    command planned them equal."""
    from vllm.v1.core import kv_cache_capacity as kcc

    req = cell_request(probe_cell(model), model_dir)
    try:
        api = kcc.plan_capacity(req)
        api_kv_tokens, api_error = api.kv_tokens, api.error
    except kcc.CapacityInputError as e:
        api_kv_tokens, api_error = None, str(e)
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "kv-capacity"]
    cmd += [*cli_argv(req), "--json"]
    # As after a plain install: the command picks its own planning platform.
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDKV_TEST_PLATFORM"}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    probe: dict[str, Any] = {
        "cmd": ["vllm", *cmd[3:]],
        "exit_status": proc.returncode,
        "api_kv_tokens": api_kv_tokens,
        "api_error": api_error,
    }
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError:
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
        doc = {"error": (errors or proc.stderr.splitlines() or ["(no output)"])[-1]}
    probe.update(
        error=doc.get("error"),
        block_size=doc.get("block_size"),
        mamba_cache_mode=doc.get("mamba_cache_mode"),
        kv_tokens=doc.get("kv_tokens"),
    )
    probe["agrees"] = (
        proc.returncode == 0
        and api_error is None
        and probe["kv_tokens"] is not None
        and probe["kv_tokens"] == api_kv_tokens
    )
    return probe


def probe_summary(name: str, probe: dict[str, Any]) -> str:
    cmd = probe["cmd"]
    flags = " ".join(cmd[cmd.index("--enable-prefix-caching") : -1])
    if probe["agrees"]:
        verdict = f"{probe['kv_tokens']:,} KV tokens, as the Python API plans"
    elif probe["error"] or probe["exit_status"]:
        verdict = f"exit status {probe['exit_status']}: {probe['error']}"
    else:
        verdict = (
            f"{_num(probe['kv_tokens'])} KV tokens, the Python API "
            f"{_num(probe['api_kv_tokens'])} ({probe['api_error'] or 'planned'})"
        )
    return f"vllm kv-capacity {flags} ({name}): {verdict}"


def _kv(kv: str) -> str:
    return kv.removeprefix("turboquant_")


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:,}"


MD_COLUMNS = (
    "model",
    "kv",
    "spec",
    "mode",
    "config",
    "mode eff",
    "attn block",
    "mamba_block_size",
    "page B",
    "GDN state B",
    "attn B/token",
    "padding",
    "KV tokens PC on",
    "KV tokens PC off",
    "pred. cached 2K / 8K",
    "pred. cached 2K-pre / 8K-pre",
    "GPU boot",
    "GPU hit 2K/8K",
    "GPU hit vs cold",
)


def _padding(r: dict[str, Any]) -> str:
    """Padding with every group weighted alike, then with the cache full of
    max_model_len requests (``padding_fraction_full_load``)."""
    text = f"{100 * r['padding_fraction']:.1f}%"
    full = r.get("padding_fraction_full_load")
    return text if full is None else f"{text} ({100 * full:.1f}% full)"


def _pair(pred: dict[str, Any], a: str, b: str) -> str:
    return f"{_num(pred.get(a))} / {_num(pred.get(b))}" if pred else "-"


def markdown_lines(rows: list[dict[str, Any]]) -> list[str]:
    cold = {r["name"]: r for r in rows if r["mode"] == pcm.COLD}
    lines = [
        "| " + " | ".join(MD_COLUMNS) + " |",
        "|" + "|".join("---" for _ in MD_COLUMNS) + "|",
    ]
    for r in rows:
        if r["mode"] == pcm.COLD:
            continue
        off = cold.get(pcm.Cell(r["model"], r["kv"], r["spec"], pcm.COLD).name, {})
        if r.get("error"):
            facts = [f"refused: {r['error']}", r.get("mode_effective", "-")]
            facts += ["-"] * 7
        else:
            facts = [
                "accepted",
                str(r.get("mode_effective", "-")),
                "/".join(map(str, r["attention_block_sizes"])) or "-",
                _num(r.get("mamba_block_size")),
                _num(r.get("page_size_bytes")),
                _num(r.get("mamba_state_bytes")),
                "/".join(map(str, r["attention_bytes_per_token"])) or "-",
                _padding(r),
                _num(r.get("kv_tokens")),
            ]
        off_text = (
            "refused"
            if off.get("error")
            else _num(off.get("kv_tokens"))
            if off
            else "-"
        )
        pred = r.get("predicted_cached") or {}
        cells = [r["model"], _kv(r["kv"]), r["spec"], r["mode"], *facts, off_text]
        cells += [_pair(pred, "2K", "8K"), _pair(pred, "2K-pre", "8K-pre")]
        cells += ["not yet run"] * 3
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.models.tiny_hybrids.prefix_cache_plan",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--markdown", type=Path, help="write the table here")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument(
        "--only",
        help="cells whose name (model.kv.spec.mode) contains this, or one of "
        "these comma-separated substrings",
    )
    p.add_argument("--tiny-only", action="store_true", help="no full-size records")
    p.add_argument(
        "--with-cold",
        action="store_true",
        help="also each configuration with prefix caching off (always planned "
        "for the Markdown table's last KV column)",
    )
    p.add_argument("--no-probe", dest="probe", action="store_false")
    p.add_argument("--workdir", type=Path, help="config dirs (default: a temp dir)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cells = plan_cells(args.tiny_only, with_cold=args.with_cold or bool(args.markdown))
    cells = pcm.select(cells, args.only)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        dirs = write_configs(root, {c.model for c in cells})
        rows = []
        for c in cells:
            row = plan_cell(c, dirs[c.model])
            rows.append(row)
            print(
                f"{c.name}: {row.get('error') or 'accepted'} "
                f"block={row.get('block_size')} kv_tokens={row.get('kv_tokens')}",
                flush=True,
            )
        probes = {}
        if args.probe:
            for name in sorted({c.model for c in cells}):
                if MODELS[name].full_size is None:
                    probes[name] = probe_cli(name, dirs[name])
    doc = {"rows": rows, "cli_probe": probes}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    table = "\n".join(markdown_lines(rows)) + "\n"
    if args.markdown:
        args.markdown.write_text(table)
    print(table)
    for name, probe in probes.items():
        print(probe_summary(name, probe))
    return 0 if all(p["agrees"] for p in probes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
