# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""hybridkv lm-eval jobs: each config runs a baseline and a candidate engine on the
same prompts and asserts the candidate's scores are within the config's tolerance
of the baseline's. Configs are in configs/*.yaml, grouped in configs/models-*.txt.

pytest -s -v test_lm_eval_correctness.py \
    --config-list-file=configs/models-qwen3.6-27b.txt --tp-size=1 --results-dir=results
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from hybridkv_lm_eval import config as job_config
from hybridkv_lm_eval.compare import compare

HERE = Path(__file__).parent


def _side_key(config: dict, role: str, tp_size: int) -> str:
    """What decides an engine's scores; equal keys give the same run."""
    shared = {
        k: config.get(k)
        for k in (
            "model_name",
            "num_fewshot",
            "limit",
            "batch_size",
            "apply_chat_template",
            "fewshot_as_multiturn",
            "gen_kwargs",
            "trust_remote_code",
            "add_bos_token",
        )
    }
    # Which metrics are read from a run does not change the run.
    shared["tasks"] = [
        {k: v for k, v in t.items() if k != "metrics"} for t in config["tasks"]
    ]
    blob = json.dumps(
        {"shared": shared, "engine": job_config.side(config, role), "tp": tp_size},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_side(
    config_file: Path, config: dict, role: str, tp_size: int, results_dir: Path
) -> dict:
    out = results_dir / f"{_side_key(config, role, tp_size)}.json"
    if out.is_file():
        print(
            f"{role}: reusing {out} "
            "(same engine, tasks and limits, run earlier in this job)"
        )
    else:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(HERE), env.get("PYTHONPATH")])
        )
        cmd = [
            sys.executable,
            "-m",
            "hybridkv_lm_eval.run_side",
            "--config",
            str(config_file),
            "--role",
            role,
            "--tp-size",
            str(tp_size),
            "--out",
            str(out),
        ]
        print(f"{role}: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, cwd=HERE, env=env, check=True)
    run = json.loads(out.read_text())
    print(f"{role}: {run['model_args']} ({run['seconds']} s)")
    return run["results"]


def test_lm_eval_correctness_param(config_filename, tp_size, results_dir):
    config = job_config.load(config_filename)
    baseline = run_side(config_filename, config, "baseline", tp_size, results_dir)
    candidate = run_side(config_filename, config, "candidate", tp_size, results_dir)

    comparisons = compare(config, baseline, candidate)
    for c in comparisons:
        print(c.line())
    failed = [c.line() for c in comparisons if not c.passed]
    assert not failed, (
        f"{config_filename.name}: candidate below tolerance:\n" + "\n".join(failed)
    )
