# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``--kv-cache-dtype-skip-layers recent:W`` in the capacity planner and the
layer policy (``turboquant.raw_window``): one model-dtype sliding-window twin
per TurboQuant layer of the main model, named as the engine names it, planned
in its own group; refused where the engine refuses it."""

from types import SimpleNamespace

import pytest

from tests.models.tiny_hybrids import prefix_cache_matrix as pcm
from tests.models.tiny_hybrids import prefix_cache_plan
from vllm.model_executor.layers.quantization.turboquant import raw_window
from vllm.model_executor.layers.quantization.turboquant.layer_policy import (
    recent_window,
)
from vllm.v1.core import kv_cache_capacity as capacity

PRESET = "turboquant_3bit_nc"


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return prefix_cache_plan.write_configs(root, {"qwen3_dense"})["qwen3_dense"]


def plan(model_dir, *skip, kv=PRESET):
    report = capacity.plan_capacity(
        capacity.CapacityRequest(
            model=model_dir,
            max_model_len=pcm.MAX_MODEL_LEN,
            kv_cache_memory_bytes=pcm.KV_CACHE_MEMORY_BYTES,
            max_num_batched_tokens=pcm.MAX_NUM_BATCHED_TOKENS,
            usage_context="llm",
            kv_cache_dtype=kv,
            kv_cache_dtype_skip_layers=skip,
        )
    )
    print(capacity.format_report(report))
    return report


def test_each_turboquant_layer_gets_a_twin(dense):
    plain = plan(dense, "boundary:0")
    windowed = plan(dense, "boundary:0", "recent:16")
    assert not plain.fails and not windowed.fails, windowed.error
    n = plain.layer_dtypes[PRESET]
    assert windowed.layer_dtypes == {PRESET: n, "auto": n}
    twins = [g for g in windowed.groups if g["type"] == "SlidingWindowSpec"]
    assert len(twins) == 1 and twins[0]["layers"] == n
    assert twins[0]["first_layer"] == "model.layers.0.self_attn.attn.raw_window"
    assert twins[0]["dtype"] == "torch.bfloat16"
    # The twin's bf16 page is the largest: the TurboQuant block grows to
    # fill it, by the scale-then-pad rule.
    tq = next(g for g in windowed.groups if g["type"] == "TQFullAttentionSpec")
    assert tq["page_size_bytes"] == twins[0]["page_size_bytes"]
    assert tq["block_size"] > plain.block_size
    assert (
        windowed.attention_backends["sliding attention, head_size 128, KV auto"]
        == "FLASH_ATTN"
    )


def test_layers_kept_at_the_model_dtype_get_no_twin(dense):
    """boundary:1 keeps two of the six layers bf16: four twins."""
    report = plan(dense, "boundary:1", "recent:8")
    assert not report.fails, report.error
    assert report.layer_dtypes == {PRESET: 4, "auto": 2 + 4}


def test_without_turboquant_the_entry_is_refused(dense):
    report = plan(dense, "recent:16", kv="auto")
    assert report.fails
    assert "recent:16" in report.error and "turboquant_*" in report.error


@pytest.mark.parametrize("entry", ["recent:0", "recent:65", "recent:x", "recent:"])
def test_a_window_out_of_range_is_refused(entry):
    with pytest.raises(ValueError, match="'recent:W' with W a whole number"):
        recent_window(["boundary:0", entry])


def _config(spec=None, hybrid_manager_off=False):
    return SimpleNamespace(
        speculative_config=spec,
        scheduler_config=SimpleNamespace(
            disable_hybrid_kv_cache_manager=hybrid_manager_off
        ),
    )


def test_a_unified_cache_is_refused():
    raw_window.check_config(_config(), 16)
    with pytest.raises(
        raw_window.RawWindowConfigError, match="hybrid KV cache manager is off"
    ):
        raw_window.check_config(_config(hybrid_manager_off=True), 16)


def test_speculation_widens_the_twins_window():
    """With k speculative tokens, asynchronous scheduling counts the last
    step's k drafts as computed when vLLM frees the twin's blocks."""
    assert raw_window.twin_window(_config(), 16) == 16
    spec = SimpleNamespace(method="mtp", num_speculative_tokens=3)
    assert raw_window.twin_window(_config(spec=spec), 16) == 19
