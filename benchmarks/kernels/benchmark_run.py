# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A kernel benchmark's command and record: ``--iters`` checked, the run's
metadata (device, software, copy bandwidth), its rows and table written whole
as JSON and Markdown, and the command of the benchmarks that sweep shapes x
sizes x presets (store, read-back)."""

import argparse
import datetime
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
from gpu_timer import Timer, copy_bandwidth
from turboquant_layer_setup import PRESETS

# Where results go without --out or $OUT: a git-ignored folder of the checkout.
# Raw runs are not committed; a release's summary table is (benchmarks/releases/).
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "runs"


def run_meta(bw: float, **fields) -> dict:
    """What a kernel benchmark's run records about itself: when, on which
    device and software, at which copy bandwidth (bytes per second, read +
    write), and the benchmark's own ``fields``."""
    import triton

    import vllm

    return dict(
        time=datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        vllm=vllm.__version__,
        copy_bandwidth_gbs=bw / 1e9,
        **fields,
    )


def write_run(out_dir: str, name: str, meta: dict, rows: list[dict], md: str) -> None:
    """A run's rows as ``name-<time>.json`` and its table as ``.md`` in
    ``out_dir``, each whole or not at all (written aside, then renamed);
    the table and where it went printed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for suffix, text in (
        ("json", json.dumps(dict(meta=meta, rows=rows), indent=1)),
        ("md", md),
    ):
        part = out / f".{name}-{stamp}.{suffix}.part"
        part.write_text(text)
        os.replace(part, out / f"{name}-{stamp}.{suffix}")
    print(md, flush=True)
    print(f"wrote {out}/{name}-{stamp}.json and .md in {meta['wall_s']} s", flush=True)


def check_iters(ap: argparse.ArgumentParser, iters: int | None, quick: bool) -> int:
    """Timed samples per case: ``--iters``, or the default for the run."""
    if iters is None:
        return 10 if quick else 25
    if iters < 1:
        ap.error(
            f"--iters {iters}: expected at least 1 timed sample per case; pass 1 "
            "or more, or leave it out (25; 10 with --quick)"
        )
    return iters


def sweep_main(doc, quick_help, name, bench, markdown, full, quick) -> None:
    """The command of a benchmark that sweeps shapes x sizes x presets
    (store, read-back): ``--quick`` / ``--presets`` / ``--iters`` / ``--out``,
    then ``bench(shapes, sizes, presets, timer, bw, rows, log)`` over
    ``full`` or, with --quick, ``quick`` (each ``(shapes, sizes)``), its rows
    kept if it fails part-way and written with ``markdown(meta, rows)``
    (``write_run``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--presets", nargs="+", default=PRESETS, choices=PRESETS)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(DEFAULT_OUT))
    args = ap.parse_args()
    iters = check_iters(ap, args.iters, args.quick)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    start = time.time()
    timer = Timer(iters, warmup=2)
    bw = copy_bandwidth(timer)
    meta = run_meta(bw, quick=args.quick)
    print(f"{meta['device']}: copy bandwidth {bw / 1e9:,.0f} GB/s", flush=True)
    rows: list[dict] = []
    try:
        bench(
            *(quick if args.quick else full),
            args.presets,
            timer,
            bw,
            rows,
            functools.partial(print, flush=True),
        )
    except Exception as e:  # noqa: BLE001 - keep what was measured
        print(f"aborted: {type(e).__name__}: {e}", flush=True)
        meta["aborted"] = f"{type(e).__name__}: {e}"
    meta["wall_s"] = round(time.time() - start, 1)
    write_run(args.out, name, meta, rows, markdown(meta, rows))
