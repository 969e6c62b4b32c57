# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The capacity planner with prefix caching (issue 47): `enable_prefix_caching`
and `mamba_cache_mode` go to the engine's config as `vllm serve` takes them.

On a GDN hybrid, prefix caching in Mamba cache mode align sets
``mamba_block_size`` to the attention block and keeps more state per request,
so fewer KV tokens fit than with it off; the tiny Qwen3-Next figures here are
what the engine's "GPU KV cache size" line said on an H200
(tests/models/tiny_hybrids/PREFIX_CACHING.md, "GPU half: measured"). On a
dense model prefix caching changes nothing in the plan.
"""

from dataclasses import asdict
from typing import get_args

import pytest

from tests.models.tiny_hybrids import prefix_cache_matrix as pcm
from tests.models.tiny_hybrids import prefix_cache_plan
from tests.models.tiny_hybrids.shapes import write_full_size_config
from vllm.v1.core import kv_cache_capacity as capacity

GIB = 2**30
CODER_NEXT = "Qwen3-Coder-Next-80B-A3B"
QWEN36 = "Qwen3.6-27B"
# The engine's "GPU KV cache size" for the tiny Qwen3-Next at the GPU
# matrix's budget (bf16 KV, no speculation), measured on an H200.
TINY_NEXT_KV_TOKENS = {"align": 123_736, "off": 126_855}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return prefix_cache_plan.write_configs(root, {"qwen3_next", "qwen3_dense"})


@pytest.fixture(scope="module")
def coder_next(tmp_path_factory):
    root = tmp_path_factory.mktemp("full_size")
    return str(write_full_size_config(CODER_NEXT, root / CODER_NEXT))


def tiny_request(model_dir: str, **kw) -> capacity.CapacityRequest:
    """The GPU matrix's budget (prefix_cache_matrix)."""
    return capacity.CapacityRequest(
        model=model_dir,
        max_model_len=pcm.MAX_MODEL_LEN,
        kv_cache_memory_bytes=pcm.KV_CACHE_MEMORY_BYTES,
        max_num_batched_tokens=pcm.MAX_NUM_BATCHED_TOKENS,
        usage_context="llm",
        **kw,
    )


def plan(req: capacity.CapacityRequest) -> capacity.CapacityReport:
    report = capacity.plan_capacity(req)
    print(capacity.format_report(report))
    assert not report.fails, report.error or report.backend_errors
    return report


def test_tiny_hybrid_plans_what_the_engine_measured(tiny):
    on = plan(
        tiny_request(
            tiny["qwen3_next"], enable_prefix_caching=True, mamba_cache_mode="align"
        )
    )
    off = plan(tiny_request(tiny["qwen3_next"]))
    assert on.kv_tokens == TINY_NEXT_KV_TOKENS["align"]
    assert off.kv_tokens == TINY_NEXT_KV_TOKENS["off"]
    assert (on.enable_prefix_caching, on.mamba_cache_mode) == (True, "align")
    assert on.mamba_block_size == on.block_size == 80
    # Without prefix caching vLLM keeps one state per request, of a block of
    # max_model_len tokens.
    assert (off.enable_prefix_caching, off.mamba_cache_mode) == (False, "none")
    assert off.mamba_block_size == pcm.MAX_MODEL_LEN
    assert off.prefix_caching_source == "the engine's default for this model"
    text = capacity.format_report(on)
    assert (
        "  prefix caching: on (as asked); Mamba cache mode: align, "
        "mamba_block_size: 80\n"
    ) in text
    assert "prefix caching: off (the engine's default for this model); Mamba " in (
        capacity.format_report(off)
    )


def test_full_size_hybrid_equals_prefix_cache_plan(coder_next):
    """Qwen3-Coder-Next at 16 GiB and 64K tokens: the request fields plan what
    prefix_cache_plan's row for the same cell says."""
    kv_bytes, max_model_len = prefix_cache_plan.budget(CODER_NEXT)
    common = dict(
        model=coder_next,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_bytes,
        max_num_batched_tokens=pcm.MAX_NUM_BATCHED_TOKENS,
        usage_context="llm",
    )
    on = plan(
        capacity.CapacityRequest(
            **common, enable_prefix_caching=True, mamba_cache_mode="align"
        )
    )
    off = plan(capacity.CapacityRequest(**common))
    assert on.kv_tokens != off.kv_tokens
    row = prefix_cache_plan.plan_cell(
        pcm.Cell(CODER_NEXT, "auto", "none", "align"), coder_next
    )
    assert row["error"] is None, row["error"]
    assert on.kv_tokens == row["kv_tokens"]
    assert (on.block_size, on.mamba_block_size) == (
        row["block_size"],
        row["mamba_block_size"],
    )
    assert on.page_size_bytes == row["page_size_bytes"]
    cold = prefix_cache_plan.plan_cell(
        pcm.Cell(CODER_NEXT, "auto", "none", pcm.COLD), coder_next
    )
    assert off.kv_tokens == cold["kv_tokens"]


@pytest.fixture(scope="module")
def qwen36(tmp_path_factory):
    root = tmp_path_factory.mktemp("full_size")
    return str(write_full_size_config(QWEN36, root / QWEN36))


# The engines' "GPU KV cache size" for the Qwen3.6-27B shape at max_model_len
# 8,848 (the e2e harness's shared-prefix lane), prefix caching off and on in
# align mode, on two H200s of one host (benchmarks/releases/release-47.md).
QWEN36_SHARED_PREFIX_KV_TOKENS = {
    "auto": (1_005_268, 901_275),
    "turboquant_4bit_nc": (2_894_279, 2_170_709),
}


@pytest.mark.parametrize("kv", sorted(QWEN36_SHARED_PREFIX_KV_TOKENS))
def test_prefix_caching_costs_the_27b_what_its_engines_lost(qwen36, kv):
    """Align mode holds two GDN states a request where prefix caching off
    holds one. At 8,848 tokens a 4bit_nc request needs 6 attention blocks of
    1,568 tokens, so its blocks go from 6 + 3 to 6 + 6 and a quarter of the
    KV tokens go (bf16: 23 + 3 to 23 + 6, a tenth). The plan's share equals
    the engines' to 0.01 %; their budgets differ from this one."""

    def kv_tokens(**kw):
        report = plan(
            capacity.CapacityRequest(
                model=qwen36,
                max_model_len=8848,
                kv_cache_dtype=kv,
                language_model_only=True,
                kv_cache_memory_bytes=60 * 10**9,
                **kw,
            )
        )
        held = sorted(
            g["blocks_per_request"] for g in report.groups if g["type"] == "MambaSpec"
        )
        return report.kv_tokens, held

    off, held_off = kv_tokens()
    on, held_on = kv_tokens(enable_prefix_caching=True, mamba_cache_mode="align")
    assert (held_off, held_on) == ([1, 1, 1], [2, 2, 2])
    engine_off, engine_on = QWEN36_SHARED_PREFIX_KV_TOKENS[kv]
    assert on / off == pytest.approx(engine_on / engine_off, abs=1e-4)


def test_mode_all_falls_back_to_align_with_a_warning(tiny):
    every = plan(
        tiny_request(
            tiny["qwen3_next"], enable_prefix_caching=True, mamba_cache_mode="all"
        )
    )
    assert every.mamba_cache_mode == "align"
    assert every.kv_tokens == TINY_NEXT_KV_TOKENS["align"]
    assert every.warnings == [
        "`mamba_cache_mode` all: the engine falls back to align, as "
        "Qwen3NextForCausalLM has no prefix caching in Mamba cache mode all; "
        "the plan is align's."
    ]
    # Without a mode vLLM picks one itself, and the report names it.
    chosen = plan(tiny_request(tiny["qwen3_next"], enable_prefix_caching=True))
    assert chosen.mamba_cache_mode == "align" and chosen.warnings == []


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        (
            {"mamba_cache_mode": "align"},
            "mamba_cache_mode='align': a Mamba cache mode applies only with prefix "
            "caching, which is off (the engine's default for GDN/Mamba hybrids)",
        ),
        (
            {"enable_prefix_caching": False, "mamba_cache_mode": "all"},
            "mamba_cache_mode='all': a Mamba cache mode applies only with prefix "
            "caching, which is off (as asked)",
        ),
        (
            {"enable_prefix_caching": True, "mamba_cache_mode": "none"},
            "mamba_cache_mode='none': with prefix caching on, the engine reads none "
            "as no choice and picks its own mode (align for this model)",
        ),
    ],
)
def test_a_mode_that_cannot_apply_is_refused_by_field(tiny, kw, expected):
    with pytest.raises(capacity.CapacityInputError) as e:
        capacity.plan_capacity(tiny_request(tiny["qwen3_next"], **kw))
    print(e.value)
    assert e.value.field == "mamba_cache_mode"
    assert str(e.value).startswith(expected)
    assert "--" not in str(e.value)


def test_a_mode_vllm_does_not_have_is_refused_by_field(tiny):
    from vllm.config.cache import MambaCacheMode

    with pytest.raises(capacity.CapacityInputError) as e:
        capacity.plan_capacity(
            tiny_request(
                tiny["qwen3_next"],
                enable_prefix_caching=True,
                mamba_cache_mode="everything",
            )
        )
    assert (e.value.field, e.value.value) == ("mamba_cache_mode", "everything")
    modes = ", ".join(map(repr, get_args(MambaCacheMode)))
    assert f"not a Mamba cache mode: vLLM accepts {modes} (as for `vllm " in str(
        e.value
    )


def test_dense_model_plans_the_same_with_prefix_caching(tiny):
    on = plan(tiny_request(tiny["qwen3_dense"], enable_prefix_caching=True))
    off = plan(tiny_request(tiny["qwen3_dense"], enable_prefix_caching=False))
    default = plan(tiny_request(tiny["qwen3_dense"]))
    assert (on.enable_prefix_caching, off.enable_prefix_caching) == (True, False)
    # vLLM turns prefix caching on for attention-only models by default.
    assert default.enable_prefix_caching is True
    for report in (off, default):
        assert report.kv_tokens == on.kv_tokens
        assert report.num_blocks == on.num_blocks
        assert report.groups == on.groups
    assert on.mamba_block_size is None
    assert "prefix caching: on (as asked)\n" in capacity.format_report(on)
    with pytest.raises(capacity.CapacityInputError) as e:
        capacity.plan_capacity(
            tiny_request(
                tiny["qwen3_dense"],
                enable_prefix_caching=True,
                mamba_cache_mode="align",
            )
        )
    assert e.value.field == "mamba_cache_mode"
    assert "the model has no GDN/Mamba layers" in str(e.value)


def test_report_carries_the_prefix_caching_facts_in_json(tiny):
    report = plan(
        tiny_request(
            tiny["qwen3_next"], enable_prefix_caching=True, mamba_cache_mode="align"
        )
    )
    document = asdict(report)
    assert {k: document[k] for k in ("enable_prefix_caching", "mamba_cache_mode")} == {
        "enable_prefix_caching": True,
        "mamba_cache_mode": "align",
    }
    assert document["mamba_block_size"] == 80
    assert document["prefix_caching_source"] == "as asked"
