# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One end-to-end table from several runs of benchmark_turboquant_e2e.py.

The full table (both shapes, every KV dtype, every scenario, 3 repeats) takes
hours of one GPU; a device call or a session gives minutes. Each part runs as
its own harness run, with its own ``auto`` for every model it measures, and
this joins their result files:

    python benchmarks/e2e/combine_turboquant_e2e.py RUN1.json RUN2.json [--out DIR]

Every ratio stays the one its run took (each row over the ``auto`` of the
same run, and of the same GPU where the run had ``--lanes``): ``auto`` repeats
in every run, the rows it is compared with do not. The runs must agree on
what makes their figures comparable: vLLM and torch versions, GPU model,
repeats, sequences per engine, the decode stage, queueing, ``--interleave``
and each scenario's shape. The table marks each model with its run, and
lists what the full table still lacks.

Exit status: 0 written; 2 refused (a file that is not a harness result, runs
that disagree, a configuration measured in two runs, a run without the
``auto`` its ratios need), with a line naming the file, the rule and the
fix. Results: e2e-combined-<time>.json and .md in ``--out``, else $OUT,
else benchmarks/runs/ (git-ignored), each written whole or not at all.
"""

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

# Run as a file, only the script's own folder is on sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark_turboquant_e2e as e2e  # noqa: E402

# What a run's figures depend on besides its rows; runs that differ in one
# of these do not go in one table.
SAME = {
    "vllm": "vLLM version",
    "torch": "torch version",
    "device": "GPU model",
    "repeats": "timed repeats per scenario (--repeats)",
    "max_num_seqs": "sequences per engine (--max-num-seqs)",
    "tq_decode": "decode stage (VLLM_TURBOQUANT_DECODE)",
    "queue": "request queueing",
    "interleave": "--interleave",
}


class Refused(ValueError):
    """Runs that cannot make one table; the message names why and the fix."""


def load_run(path: Path) -> dict:
    try:
        run = json.loads(path.read_text())
        if not isinstance(run.get("rows"), list) or "device" not in run.get("meta"):
            raise ValueError("no rows, or no meta with the device")
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise Refused(
            f"{path}: not a result file of benchmark_turboquant_e2e.py ({e}); "
            "pass the e2e-<time>.json files its runs wrote"
        ) from None
    return run


def _reference(kv: str) -> bool:
    """auto, with or without a prefix-caching suffix: every run has its own."""
    return e2e.kv_config(kv)[0] == "auto"


def check_comparable(runs: list[tuple[Path, dict]]) -> None:
    first_path, first = runs[0]
    for path, run in runs[1:]:
        for key, what in SAME.items():
            a, b = first["meta"].get(key), run["meta"].get(key)
            if a != b:
                raise Refused(
                    f"{path}: {what} is {b!r}, {first_path} ran with {a!r}; "
                    "combine runs of one release on one GPU model with the same "
                    "settings, or run the part again"
                )
        for name, shape in run["meta"].get("scenarios", {}).items():
            other = first["meta"].get("scenarios", {}).get(name)
            if other is not None and list(other) != list(shape):
                raise Refused(
                    f"{path}: scenario {name} is {shape} (prompts, input, output), "
                    f"{first_path} ran it as {other}; both runs must use one "
                    "harness version's scenarios"
                )


def check_cells(runs: list[tuple[Path, dict]]) -> None:
    """Each (model, KV, scenario) of the compared rows in one run only, and
    every run with the auto its rows are compared with."""
    seen: dict[tuple, Path] = {}
    for path, run in runs:
        rows = [r for r in run["rows"] if "scenarios" in r]
        for r in rows:
            if _reference(r["kv"]):
                continue
            labels = e2e.auto_labels(r["kv"])
            base = labels[0]
            refs = [
                x
                for x in rows
                if x["model"] == r["model"]
                and x.get("gpu") == r.get("gpu")
                and x["kv"] in labels
            ]
            for name in r["scenarios"]:
                if not any(name in x["scenarios"] for x in refs):
                    raise Refused(
                        f"{path}: {r['model']} {r['kv']} {name} has no {base} of "
                        "its own run to be compared with; every ratio is taken in "
                        "one run, so run that part again with auto beside it"
                    )
                cell = (r["model"], r["kv"], name)
                if cell in seen:
                    raise Refused(
                        f"{path}: {' '.join(cell)} was measured in {seen[cell]} "
                        "too; give each configuration and scenario to one run "
                        "(pass one of the two files)"
                    )
                seen[cell] = path


def missing_cells(rows: list[dict]) -> dict[tuple[str, str], list[str]]:
    """Per (model, KV dtype) of the full table, the scenarios no run measured."""
    have = {
        (r["model"], r["kv"], name) for r in rows for name in r.get("scenarios", {})
    }
    out = {}
    for model in e2e.MODELS:
        for kv in e2e.KV_DTYPES:
            lack = [n for n in e2e.SCENARIOS if (model, kv, n) not in have]
            if lack:
                out[model, kv] = lack
    return out


def combine(paths: list[Path]) -> tuple[dict, list[dict]]:
    """The combined result's meta and rows; Refused where the runs do not
    make one table."""
    runs = [(p, load_run(p)) for p in paths]
    check_comparable(runs)
    check_cells(runs)
    rows = []
    for i, (_, run) in enumerate(runs, 1):
        for r in run["rows"]:
            rows.append(dict(r, run=i))
    e2e.add_ratios(rows)
    first = runs[0][1]["meta"]
    meta = dict(
        {k: first.get(k) for k in SAME},
        time=datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
        scenarios={
            name: shape
            for _, run in runs
            for name, shape in run["meta"].get("scenarios", {}).items()
        },
        runs=[
            dict(run=i, file=str(p), time=run["meta"].get("time"))
            for i, (p, run) in enumerate(runs, 1)
        ],
    )
    return meta, rows


def markdown(meta: dict, rows: list[dict]) -> str:
    shown = [dict(r, model=f"{r['model']} (run {r['run']})") for r in rows]
    text = e2e.markdown(meta, shown)
    runs = "; ".join(f"run {r['run']}: {r['file']} ({r['time']})" for r in meta["runs"])
    lines = [
        "",
        "## Runs",
        "",
        f"{runs}.",
        "",
        "## Not measured by these runs (the full table's KV dtypes and scenarios)",
        "",
    ]
    lack = missing_cells(rows)
    lines += [
        f"- {model} {kv}: {', '.join(names)}" for (model, kv), names in lack.items()
    ] or ["- nothing: every model, KV dtype and scenario"]
    return text + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="e2e-<time>.json files")
    ap.add_argument(
        "--out", default=os.environ.get("OUT") or str(e2e.REPO / "benchmarks" / "runs")
    )
    args = ap.parse_args(argv)
    try:
        meta, rows = combine(args.runs)
    except Refused as e:
        print(f"combine_turboquant_e2e: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    md = markdown(meta, rows)
    e2e.write_whole(
        out / f"e2e-combined-{stamp}",
        json.dumps(dict(meta=meta, rows=rows), indent=1),
        md,
    )
    print(md)
    print(f"wrote {out}/e2e-combined-{stamp}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
