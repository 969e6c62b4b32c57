# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU checks of preemption_sim.py: vLLM's scheduler, serving the prefix-cache
matrix's phases on the engine's plan, preempts at a small budget and not at
a large one, and the chosen budget is the largest that preempts."""

import json

import pytest

from . import preemption_sim as sim
from . import prefix_cache_matrix as pcm
from .prefix_cache_plan import write_configs

pytestmark = pytest.mark.cpu_test

# The split pool's cell: MTP's drafts and 416-token blocks, which admit one
# hit at a time at the 1.15 max-length requests the matrix once used.
CELL = pcm.Cell("qwen3_5_split", "turboquant_4bit_nc", "mtp", "align")
PHASES = pcm.build_phases((2048,), hits=8)
NEW_TOKENS = 320


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    return write_configs(root, {CELL.model})[CELL.model]


def _per_request(model_dir) -> float:
    vllm_config, config = sim.planned_config(CELL, model_dir, pcm.KV_CACHE_MEMORY_BYTES)
    return pcm.KV_CACHE_MEMORY_BYTES / sim.max_concurrency(vllm_config, config)


def _served(model_dir, requests: float) -> sim.Served:
    kv_bytes = int(_per_request(model_dir) * requests)
    vllm_config, config = sim.planned_config(CELL, model_dir, kv_bytes)
    return sim.serve(vllm_config, config, PHASES, NEW_TOKENS, sim.num_drafts(CELL), 0)


def test_a_small_budget_preempts_and_a_large_one_does_not(model_dir):
    large = _served(model_dir, 6.0)
    assert large.preemptions == 0 and large.most_running == 8
    small = _served(model_dir, 3.0)
    assert small.preemptions >= sim.MIN_PREEMPTIONS


def test_the_budget_is_the_largest_candidate_that_preempts(model_dir, monkeypatch):
    monkeypatch.setattr(sim, "CANDIDATES", (6.0, 3.0, 1.15))
    monkeypatch.setattr(sim, "SEEDS", (0,))
    got = sim.choose_budget(CELL, model_dir, PHASES, NEW_TOKENS)
    assert got["met"] and got["requests"] == 3.0
    assert [t["requests"] for t in got["tried"]] == [6.0, 3.0]
    assert got["kv_bytes"] == int(_per_request(model_dir) * 3.0)
    monkeypatch.setattr(sim, "CANDIDATES", (6.0, 4.0))
    got = sim.choose_budget(CELL, model_dir, PHASES, NEW_TOKENS)
    assert not got["met"] and got["requests"] == 4.0


def test_select_keeps_prefix_caching_cells_only():
    names = {c.name for c in sim.select("qwen3_5_split")}
    assert names == {
        f"qwen3_5_split.{kv}.mtp.{mode}" for kv in pcm.KV_DTYPES for mode in pcm.MODES
    }


def test_the_output_holds_its_settings_and_is_written_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(sim, "CANDIDATES", (3.0,))
    monkeypatch.setattr(sim, "SEEDS", (0,))
    out = tmp_path / "sim.json"
    argv = [str(out), "--only", CELL.name, "--hits", "8", "--new-tokens", "320"]
    assert sim.main([*argv, "--prefix-lens", "2048"]) == 0
    data = json.loads(out.read_text())
    assert data["settings"] == pcm.run_settings(8, 320, pcm.WARM_SUFFIX_LEN, [2048])
    assert list(data["cells"]) == [CELL.name]
    assert data["cells"][CELL.name]["met"]
    assert [p.name for p in tmp_path.iterdir()] == ["sim.json"]
