# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU: vLLM's own scheduler serving prefix_cache_matrix's workload at a KV
budget, to find budgets at which a cell is preempted (issue 47).

``prefix_cache_matrix --preempt`` has to make the engine preempt, and
whether it does depends on the block size and on the blocks a request's
GDN groups hold: at 1.15 max-length requests of KV memory, cells with
272-416-token blocks and MTP admit one hit at a time, which never has to
give way. So each cell's budget is chosen here. The cell's configuration
goes through the capacity planner of patch 0006 (``EngineArgs`` -> the
engine's config for a CUDA target, the hybrid page planner, the engine's
``get_kv_cache_configs``) at each candidate budget; vLLM's ``Scheduler``
then serves the matrix's phases (one batch per ``generate`` call, the
prefix cache kept between them), the model's tokens and the accepted
drafts drawn at random. The budget is the largest candidate at which every
seed preempts at least ``MIN_PREEMPTIONS`` times: the engine admits the
most requests at once there, so it finishes soonest. Where none does, the
smallest candidate is the budget and ``met`` is false.

The simulation schedules synchronously and accepts drafts at random, so its
counts predict the engine's, they do not equal them; the matrix prints both.

    python -m tests.models.tiny_hybrids.preemption_sim OUT.json
        [--only SUBSTR[,SUBSTR...]] [--hits N] [--new-tokens N]
        [--warm-suffix N] [--prefix-lens A,B] [--jobs N] [--workdir DIR]

OUT.json holds the settings it simulated and each cell's budget; the matrix
takes it with ``--preempt-sim OUT.json`` (so the simulation can run on
another host before the GPU run) and refuses one simulated for other
settings. It is written whole or not at all.
"""

import argparse
import dataclasses
import json
import multiprocessing
import os
import random
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from . import prefix_cache_matrix as pcm

MODULE = "tests.models.tiny_hybrids.preemption_sim"

# Candidate budgets in requests of max_model_len (the plan's concurrency at
# the matrix's budget), largest first.
CANDIDATES = (6.0, 4.0, 3.0, 2.75, 2.5, 2.25, 2.0, 1.8, 1.6, 1.4, 1.3, 1.2, 1.15)
SEEDS = (0, 1, 2)
MIN_PREEMPTIONS = 3


@dataclasses.dataclass
class Served:
    preemptions: int
    steps: int
    most_running: int


def planned_config(cell: pcm.Cell, model_dir: str, kv_bytes: int) -> tuple:
    """(vllm_config, scheduler KV-cache config) the engine plans for ``cell``
    at ``kv_bytes`` of KV memory, on this host."""
    from . import prefix_cache_plan as pcp

    req = dataclasses.replace(
        pcp.cell_request(cell, model_dir), kv_cache_memory_bytes=kv_bytes
    )
    with pcp.ngram_engine_args(cell):
        vllm_config, config = pcp.planned_kv_cache_config(req)
    # The planner leaves it at the engine's default; the matrix's engines
    # run at most this many requests at once.
    vllm_config.scheduler_config.max_num_seqs = pcm.MAX_NUM_SEQS
    return vllm_config, config


def max_concurrency(vllm_config: Any, config: Any) -> float:
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    return get_max_concurrency_for_kv_cache_config(vllm_config, config)


def step(
    scheduler: Any,
    rng: random.Random,
    num_drafts: int,
    seen: Callable[[Any], None] | None = None,
) -> None:
    """One engine step of vLLM's ``scheduler`` without a model: schedule,
    ``seen(scheduler_output)`` if given, then every decoding request's
    accepted drafts (any prefix of them) and one sampled token, and
    ``num_drafts`` new drafts for the requests still decoding; tokens drawn
    from ``rng``."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    out = scheduler.schedule()
    if seen is not None:
        seen(out)
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        drafts = out.scheduled_spec_decode_tokens.get(rid, [])
        accepted = drafts[: rng.randrange(len(drafts) + 1)]
        chunk = scheduler.requests[rid].is_prefill_chunk
        sampled.append([] if chunk else [*accepted, rng.randrange(1000)])
    scheduler.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
        ),
    )
    if num_drafts:
        live = [
            rid
            for rid in ids
            if rid in scheduler.requests
            and not scheduler.requests[rid].is_prefill_chunk
        ]
        drafts = [[rng.randrange(1000)] * num_drafts for _ in live]
        scheduler.update_draft_token_ids(DraftTokenIds(live, drafts))


def serve(
    vllm_config: Any,
    config: Any,
    phases: list[list[pcm.Request]],
    new_tokens: int,
    num_drafts: int,
    seed: int,
) -> Served:
    """vLLM's scheduler serving ``phases`` in order (each phase's requests
    added at once and served to the end, as one ``generate`` call), every
    request ``new_tokens`` long; drafts (``num_drafts`` per decode step, any
    prefix of them accepted) and sampled tokens drawn from ``seed``."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    rng = random.Random(seed)
    init_none_hash(sha256)
    vllm_config.scheduler_config.async_scheduling = False
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        log_stats=True,
    )
    hasher = get_request_block_hasher(vllm_config.cache_config.block_size, sha256)
    served = Served(0, 0, 0)
    for p, phase in enumerate(phases):
        reqs = []
        for i, r in enumerate(phase):
            params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
            req = Request(f"{p}.{i}", list(r.tokens), params, None, block_hasher=hasher)
            scheduler.add_request(req)
            reqs.append(req)
        while not all(r.is_finished() for r in reqs):
            step(scheduler, rng, num_drafts)
            served.steps += 1
            served.most_running = max(served.most_running, len(scheduler.running))
        served.preemptions += sum(r.num_preemptions for r in reqs)
    return served


def num_drafts(cell: pcm.Cell) -> int:
    spec = pcm.SPECS[cell.spec]
    return int(spec["num_speculative_tokens"]) if spec else 0


def choose_budget(
    cell: pcm.Cell,
    model_dir: str,
    phases: list[list[pcm.Request]],
    new_tokens: int,
) -> dict[str, Any]:
    """The largest candidate budget at which every seed preempts at least
    ``MIN_PREEMPTIONS`` times (else the smallest), with what each tried
    candidate served."""
    vllm_config, config = planned_config(cell, model_dir, pcm.KV_CACHE_MEMORY_BYTES)
    per_request = pcm.KV_CACHE_MEMORY_BYTES / max_concurrency(vllm_config, config)
    tried = []
    for requests in CANDIDATES:
        kv_bytes = int(per_request * requests)
        runs = []
        for seed in SEEDS:
            vllm_config, config = planned_config(cell, model_dir, kv_bytes)
            runs.append(
                serve(vllm_config, config, phases, new_tokens, num_drafts(cell), seed)
            )
        tried.append(
            {
                "requests": requests,
                "kv_bytes": kv_bytes,
                "num_blocks": config.num_blocks,
                "preemptions": [r.preemptions for r in runs],
                "most_running": [r.most_running for r in runs],
                "steps": [r.steps for r in runs],
            }
        )
        if min(r.preemptions for r in runs) >= MIN_PREEMPTIONS:
            break
    last = tried[-1]
    return {
        "kv_bytes": last["kv_bytes"],
        "requests": last["requests"],
        "preemptions": last["preemptions"],
        "met": min(last["preemptions"]) >= MIN_PREEMPTIONS,
        "tried": tried,
    }


def select(only: str | None) -> list[pcm.Cell]:
    """The prefix-caching cells whose name contains any of ``only``'s
    comma-separated substrings (all of them without ``only``)."""
    return [c for c in pcm.select(pcm.cells(), only) if c.prefix_caching]


def _choose_one(
    cell: pcm.Cell, model_dir: str, settings: dict[str, Any]
) -> dict[str, Any]:
    phases = pcm.build_phases(
        tuple(settings["prefix_lens"]),
        settings["hits"],
        warm_suffix_len=settings["warm_suffix"],
    )
    return choose_budget(cell, model_dir, phases, settings["new_tokens"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__)
    p.add_argument("out", type=Path, help="JSON: the settings and each cell's budget")
    p.add_argument("--only", help="cells whose name contains one of these")
    p.add_argument("--hits", type=int, default=pcm.HITS)
    p.add_argument("--new-tokens", type=int, default=pcm.NEW_TOKENS)
    p.add_argument("--warm-suffix", type=int, default=pcm.WARM_SUFFIX_LEN)
    p.add_argument("--prefix-lens", default=",".join(map(str, pcm.PREFIX_LENS)))
    p.add_argument("--jobs", type=int, default=1, help="cells simulated at once")
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    from . import prefix_cache_plan as pcp

    chosen = select(args.only)
    settings = pcm.run_settings(
        args.hits,
        args.new_tokens,
        args.warm_suffix,
        [int(x) for x in args.prefix_lens.split(",")],
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        dirs = pcp.write_configs(root, {c.model for c in chosen})
        # Each worker process sets up vLLM's planning platform for itself.
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max(1, args.jobs), mp_context=spawn) as pool:
            futures = {
                c.name: pool.submit(_choose_one, c, dirs[c.model], settings)
                for c in chosen
            }
            cells = {}
            for name, future in futures.items():
                got = cells[name] = future.result()
                print(
                    f"{name}: {got['requests']} requests, {got['kv_bytes']} B: "
                    f"preemptions {got['preemptions']}"
                    + ("" if got["met"] else f" (fewer than {MIN_PREEMPTIONS})"),
                    flush=True,
                )
    partial = args.out.with_name(args.out.name + ".partial")
    partial.write_text(json.dumps({"settings": settings, "cells": cells}, indent=1))
    os.replace(partial, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
