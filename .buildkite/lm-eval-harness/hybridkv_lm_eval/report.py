# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every job of a list against the scores in a results directory, one line per metric.

    python -m hybridkv_lm_eval.report --config-list-file configs/models-X.txt \
        --results-dir results [--tp-size 1] [--markdown]

Runs nothing: it reads what the engines wrote (``<results-dir>/<key>.json``) and
prints each job's comparison lines (the test's own, with lm-eval's standard error
of each score where it gives one), or the table rows for the README with
``--markdown``. A job whose engine runs are missing says so. Exits 1
when any comparison failed or any run is missing, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import config as job_config
from . import sides
from .compare import Comparison, MissingMetric, compare

MARKDOWN_HEADER = (
    "| job | candidate KV | task | metric | baseline | candidate | change | bound "
    "| verdict |\n|---|---|---|---|---|---|---|---|---|"
)


def stderr(results: dict[str, Any], task: str, metric: str) -> float | None:
    """lm-eval's standard error of ``metric`` (``name,filter``), when it gave one
    (NIAH recall has one; the perplexities have "N/A")."""
    name, _, filt = metric.partition(",")
    value = results.get(task, {}).get(
        f"{name}_stderr,{filt}" if filt else f"{name}_stderr"
    )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _with_stderr(value: float, err: float | None) -> str:
    return f"{value:.4f}" if err is None else f"{value:.4f} ± {err:.4f}"


def _markdown_row(job: str, kv: str, c: Comparison, errs: tuple) -> str:
    change = c.relative_change
    sign = ">=" if c.higher_is_better else "<="
    return (
        f"| {job} | {kv} | {c.task} | {c.metric} | {_with_stderr(c.baseline, errs[0])} "
        f"| {_with_stderr(c.candidate, errs[1])} | "
        f"{'' if change is None else f'{change:+.2%}'} | "
        f"{sign} {c.bound:.4f} | {'ok' if c.passed else 'FAIL'} |"
    )


def report(
    list_file: Path, results_dir: Path, tp_size: int = 1, markdown: bool = False
) -> tuple[list[str], bool]:
    """(lines to print, all passed)."""
    lines = [MARKDOWN_HEADER] if markdown else []
    ok = True
    for config_file in job_config.read_config_list(list_file):
        config = job_config.load(config_file)
        runs: dict[str, Any] = {}
        for role in ("baseline", "candidate"):
            out = results_dir / f"{sides.side_key(config, role, tp_size)}.json"
            runs[role] = json.loads(out.read_text()) if out.is_file() else out
        job = config_file.stem
        missing = [f"{r} ({p})" for r, p in runs.items() if isinstance(p, Path)]
        if missing:
            ok = False
            lines.append(f"{job}: no scores yet for {', '.join(missing)}")
            continue
        try:
            comparisons = compare(
                config, runs["baseline"]["results"], runs["candidate"]["results"]
            )
        except MissingMetric as e:
            ok = False
            lines.append(f"{job}: {e}")
            continue
        kv = job_config.side(config, "candidate")["kv_cache_dtype"]
        for c in comparisons:
            ok = ok and c.passed
            errs = tuple(
                stderr(runs[r]["results"], c.task, c.metric)
                for r in ("baseline", "candidate")
            )
            if markdown:
                lines.append(_markdown_row(job, kv, c, errs))
            else:
                spread = (
                    f" [stderr baseline {errs[0]:.4f}, candidate {errs[1]:.4f}]"
                    if None not in errs
                    else ""
                )
                lines.append(f"{job}: {c.line()}{spread}")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config-list-file", required=True, type=Path)
    parser.add_argument("--results-dir", required=True, type=Path)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--markdown", action="store_true")
    ns = parser.parse_args(argv)
    lines, ok = report(ns.config_list_file, ns.results_dir, ns.tp_size, ns.markdown)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
