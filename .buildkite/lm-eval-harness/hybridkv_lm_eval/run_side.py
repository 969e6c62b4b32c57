# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run one engine of a job (baseline or candidate) through lm-eval; write its scores.

    python -m hybridkv_lm_eval.run_side --config CONFIG.yaml --role baseline \
        --tp-size 1 --out baseline.json

Its own process per engine: vLLM's engine holds the GPU until its process exits,
and the two engines of a job must not share one. The engine is built once and
runs every task of the job; each task gets its own ``num_fewshot``, ``limit`` and
``metadata`` (lm-eval applies those to all tasks of one call).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from . import config as job_config


def _version(dist: str) -> str | None:
    try:
        return importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return None


def run(config: dict[str, Any], role: str, tp_size: int) -> dict[str, Any]:
    settings = job_config.side(config, role)
    # Before vLLM is imported: some of its settings are read at import time.
    os.environ.update({k: str(v) for k, v in settings["env_vars"].items()})

    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    args = job_config.model_args(config, role, tp_size)
    started = time.monotonic()
    lm = get_model(settings["backend"]).create_from_arg_obj(
        args, {"batch_size": config["batch_size"]}
    )
    scores: dict[str, dict[str, Any]] = {}
    for task in config["tasks"]:
        task_metadata = {
            "tokenizer": settings["tokenizer"] or config["model_name"],
            "trust_remote_code": config["trust_remote_code"],
            **(task.get("metadata") or {}),
        }
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=[task["name"]],
            num_fewshot=task.get("num_fewshot", config.get("num_fewshot")),
            limit=task.get("limit", config.get("limit")),
            task_manager=TaskManager(
                include_path=str(job_config.TASKS_DIR), metadata=task_metadata
            ),
            apply_chat_template=config["apply_chat_template"],
            fewshot_as_multiturn=config["fewshot_as_multiturn"],
            gen_kwargs=config.get("gen_kwargs"),
            batch_size=config["batch_size"],
        )
        scores[task["name"]] = results["results"][task["name"]]
    return {
        "role": role,
        "model_args": args,
        "env_vars": settings["env_vars"],
        "results": scores,
        "seconds": round(time.monotonic() - started, 1),
        "versions": {
            d: _version(d) for d in ("vllm", "lm_eval", "transformers", "torch")
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--role", required=True, choices=("baseline", "candidate"))
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--out", required=True, type=Path)
    ns = parser.parse_args(argv)
    out = run(job_config.load(ns.config), ns.role, ns.tp_size)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    # All or nothing: a scores file that exists is complete (sides.Side.failed).
    part = ns.out.with_name(ns.out.name + ".part")
    part.write_text(json.dumps(out, indent=2, default=str) + "\n")
    os.replace(part, ns.out)
    print(f"{ns.role}: wrote {ns.out} ({out['seconds']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
