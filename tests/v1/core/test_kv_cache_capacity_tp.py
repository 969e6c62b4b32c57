# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every full-size shape of the bug reports at tensor-parallel sizes 1, 2, 4
and 8 through the capacity planner (patch 0006), with and without
TurboQuant: each plans (all of them shard at these sizes), each rank holds
the KV heads the engine gives it (split, or replicated below one head per
rank), and a fixed per-GPU budget holds more tokens as the ranks grow, by at
most the rank count. Sizes the engine refuses (3 for every shape, 16 for
Qwen3.6-27B's 24 query heads) are refused with the engine's reason.

On pristine 0.20.2 (the planner file loaded from this repository, planning
with 0.20.2's rules) the TurboQuant cases fail as the reports say: the
hybrids are refused for being hybrid (#41560), Gemma-4-31B stops on "page
size ... not divisible" (#41403 Gate 5); the rest plans the same.
"""

import pytest

from tests.models.tiny_hybrids.shapes import FULL_SIZE_MODELS, write_full_size_config
from tests.v1.core.test_kv_cache_capacity import GIB, capacity

TPS = (1, 2, 4, 8)
KV_DTYPES = ("auto", "turboquant_4bit_nc")
MULTIMODAL = ("Qwen3.6-27B", "Gemma-4-31B")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("full_size_tp")
    return {n: str(write_full_size_config(n, root / n)) for n in FULL_SIZE_MODELS}


def request(model_dir: str, name: str, tp: int, kv: str, **kw):
    return capacity.CapacityRequest(
        model=model_dir,
        max_model_len=8192,
        kv_cache_dtype=kv,
        tensor_parallel_size=tp,
        kv_cache_memory_bytes=4 * GIB,
        language_model_only=name in MULTIMODAL,
        **kw,
    )


@pytest.fixture(scope="module")
def reports(shapes):
    return {
        (name, kv, tp): capacity.plan_capacity(request(shapes[name], name, tp, kv))
        for name in FULL_SIZE_MODELS
        for kv in KV_DTYPES
        for tp in TPS
    }


def _kv_heads(text, attr: str, tp: int) -> int:
    # vLLM's rule: split when there are at least as many heads as ranks,
    # otherwise every rank holds one replicated head.
    return max(1, getattr(text, attr) // tp)


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("name", FULL_SIZE_MODELS)
def test_every_shape_plans_at_tp_1_2_4_8(reports, name, kv):
    for tp in TPS:
        report = reports[(name, kv, tp)]
        assert report.error is None, (tp, report.error)
        assert report.tensor_parallel_size == tp
        assert report.kv_tokens > 0 and report.max_concurrency >= 1
        # Sharding changes heads per rank, never which layers hold KV.
        assert report.layer_dtypes == reports[(name, kv, 1)].layer_dtypes


@pytest.mark.parametrize("name", FULL_SIZE_MODELS)
def test_per_rank_kv_heads_are_the_engines(shapes, name):
    for tp in TPS:
        req = request(shapes[name], name, tp, "auto")
        vllm_config = capacity.engine_config(req)
        text = vllm_config.model_config.hf_text_config
        layers = capacity.layer_geometry(vllm_config.model_config, tp)
        for layer in layers:
            if layer.kind == "mamba":
                continue
            if getattr(text, "global_head_dim", None) and layer.kind == "full":
                expected = _kv_heads(text, "num_global_key_value_heads", tp)
            elif layer.kind == "sliding":
                expected = _kv_heads(text, "num_key_value_heads", tp)
            else:
                expected = vllm_config.model_config.get_num_kv_heads(
                    vllm_config.parallel_config
                )
            assert layer.num_kv_heads == expected, (tp, layer)


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("name", FULL_SIZE_MODELS)
def test_tokens_grow_with_ranks_by_at_most_their_count(reports, name, kv):
    """Per-GPU budget fixed: a rank stores 1/tp of each layer or more
    (replicated KV heads), so tokens grow, by at most tp x (one block of
    rounding per rank). Dense models with tp <= KV heads grow by exactly tp."""
    base = reports[(name, kv, 1)]
    previous = base.kv_tokens
    for tp in TPS[1:]:
        report = reports[(name, kv, tp)]
        slack = tp * report.block_size
        assert previous <= report.kv_tokens <= tp * base.kv_tokens + slack, tp
        if name in ("Qwen3-4B", "LocoOperator-4B"):
            assert abs(report.kv_tokens - tp * base.kv_tokens) <= slack, tp
        previous = report.kv_tokens


@pytest.mark.parametrize("tp", TPS)
def test_qwen3_coder_next_with_draft_at_tp(shapes, tp):
    """The draft runs at the main model's TP; its 36 layers join the plan."""
    report = capacity.plan_capacity(
        request(
            shapes["Qwen3-Coder-Next-80B-A3B"],
            "Qwen3-Coder-Next-80B-A3B",
            tp,
            "turboquant_4bit_nc",
            draft=shapes["LocoOperator-4B"],
            num_speculative_tokens=3,
        )
    )
    assert report.error is None, report.error
    assert sum(report.layer_dtypes.values()) == 12 + 36


@pytest.mark.parametrize(
    "name, tp, reason, engine_refuses_at_config",
    [
        ("Qwen3-4B", 3, "num_attention_heads=32 (query heads)", True),
        ("LocoOperator-4B", 3, "num_attention_heads=32 (query heads)", True),
        ("Gemma-4-31B", 3, "num_attention_heads=32 (query heads)", True),
        ("Qwen3-Coder-Next-80B-A3B", 3, "num_attention_heads=16", True),
        # 24 query heads split over 3; the GDN and MLP dims do not, which the
        # engine only finds when it builds the layers.
        ("Qwen3.6-27B", 3, "linear_num_key_heads=16", False),
        ("Qwen3.6-27B", 16, "num_attention_heads=24 (query heads)", True),
    ],
)
def test_refused_sizes_carry_the_engines_reason(
    shapes, name, tp, reason, engine_refuses_at_config
):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(capacity.CapacityInputError) as planned:
        capacity.plan_capacity(request(shapes[name], name, tp, "auto"))
    assert reason in str(planned.value)
    assert "The engine would stop at model load" in str(planned.value)
    args = EngineArgs(
        model=shapes[name],
        tensor_parallel_size=tp,
        max_model_len=8192,
        skip_tokenizer_init=True,
        load_format="dummy",
        language_model_only=name in MULTIMODAL,
    )
    if engine_refuses_at_config:
        with pytest.raises(Exception, match="divisible by tensor parallel size"):
            args.create_engine_config()
    else:
        assert args.create_engine_config().parallel_config.tensor_parallel_size == tp
