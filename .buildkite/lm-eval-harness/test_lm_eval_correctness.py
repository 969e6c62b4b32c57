# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""hybridkv lm-eval jobs: each config runs a baseline and a candidate engine on the
same prompts and asserts the candidate's scores are within the config's tolerance
of the baseline's. Configs are in configs/*.yaml, grouped in configs/models-*.txt.

pytest -s -v test_lm_eval_correctness.py \
    --config-list-file=configs/models-qwen3.6-27b.txt --tp-size=1 --results-dir=results

With ``--jobs N`` (N > 1) the distinct engine runs of all selected jobs are started
first, N at a time (``--gpus 0,1`` spreads them over those GPUs), each logging to
``<results-dir>/<key>.log``; the tests then compare what they wrote.
"""

import json
import subprocess
from pathlib import Path

from hybridkv_lm_eval import config as job_config
from hybridkv_lm_eval import sides
from hybridkv_lm_eval.compare import compare

HERE = Path(__file__).parent


def _side_key(config: dict, role: str, tp_size: int) -> str:
    """What decides an engine's scores; equal keys give the same run."""
    return sides.side_key(config, role, tp_size)


def run_side(
    config_file: Path,
    config: dict,
    role: str,
    tp_size: int,
    results_dir: Path,
    parallel_failures: dict | None = None,
) -> dict:
    key = _side_key(config, role, tp_size)
    out = results_dir / f"{key}.json"
    failed = (parallel_failures or {}).get(key)
    if failed is not None:
        raise AssertionError(
            f"{role} engine ({failed.describe()}, started by --jobs) exited "
            f"{failed.returncode} without scores; the end of {failed.log}:\n"
            + sides.log_tail(failed.log)
        )
    if out.is_file():
        print(f"{role}: reusing {out} (same engine, tasks and limits)")
    else:
        cmd = sides.command(config_file, role, tp_size, out)
        print(f"{role}: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, cwd=HERE, env=sides.environment(), check=True)
    run = json.loads(out.read_text())
    print(f"{role}: {run['model_args']} ({run['seconds']} s)")
    return run["results"]


def test_lm_eval_correctness_param(
    config_filename, tp_size, results_dir, parallel_sides
):
    config = job_config.load(config_filename)
    baseline = run_side(
        config_filename, config, "baseline", tp_size, results_dir, parallel_sides
    )
    candidate = run_side(
        config_filename, config, "candidate", tp_size, results_dir, parallel_sides
    )

    comparisons = compare(config, baseline, candidate)
    for c in comparisons:
        print(c.line())
    failed = [c.line() for c in comparisons if not c.passed]
    assert not failed, (
        f"{config_filename.name}: candidate beyond tolerance:\n" + "\n".join(failed)
    )
